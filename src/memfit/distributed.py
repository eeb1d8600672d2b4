"""Sharded training over torch.distributed: process-group set-up, FSDP2 / FSDP1 wrapping, and the few
collectives the training loop needs (global token count, logged loss, gradient norm, memory peaks and the tracked
breakdown of the fullest rank).

Launch with torchrun (``torchrun --nproc_per_node N -m memfit pretrain ...``): every rank runs the same
:func:`memfit.train.train`; a single process (no torchrun environment) runs it unchanged, and every helper here is
then a no-op.

Data parallelism and the loss: each rank takes its ``batch_size`` slice of a global batch of
``world_size * batch_size`` sequences (see :mod:`memfit.train`). Each rank's summed loss is divided by the *global*
count of counted tokens (all-reduced) and multiplied by ``world_size``, because both FSDP versions average the
gradients over ranks; so the averaged gradient is exactly the token-weighted gradient of the global batch, as one
process with ``batch_size * world_size`` computes it.

Strategies (``distributed.strategy``):

- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer, then on the root (embedding, final norm
  and ``lm_head`` form the root's group). Parameters become ``DTensor`` shards (dim 0); each layer's weights are
  all-gathered just before its forward/backward and freed after (``reshard_after_forward``), gradients are
  reduce-scattered. ``bf16_mixed`` becomes a ``MixedPrecisionPolicy`` (bf16 compute, fp32 gradient reduction);
  ``cpu_offload`` keeps shards, gradients and optimizer step on the host (``CPUOffloadPolicy``).
- ``fsdp1``: ``FullyShardedDataParallel`` with one unit per decoder layer plus the root, ``use_orig_params=True``
  (so parameter names, groups and LoRA freezing are unchanged) and ``limit_all_gathers`` (rate-limits the
  all-gathers issued ahead so at most two layers' unsharded weights exist at once on CUDA).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memfit import lifeline
from memfit.models.decoder import DecoderLayer

if TYPE_CHECKING:  # an annotation only: memory modules import this one, and no memory module imports config
    from memfit.config import TrainConfig

# ----------------------------------------------------------------------------------------------------------------
# Process group and rank helpers
# ----------------------------------------------------------------------------------------------------------------


def launched_distributed() -> bool:
    """``True`` when torchrun (or another launcher) set ``WORLD_SIZE`` > 1 for this process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> torch.device:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``).

    gloo on CPU, nccl on CUDA (each rank on ``cuda:LOCAL_RANK``). A single process is left alone. Under torchrun
    the rank also stops when its launcher dies (:func:`memfit.lifeline.stop_with_launcher`; ``python -m memfit``
    arms it earlier).

    Args:
        device: the device the config resolved to (``cpu`` or ``cuda``).
        timeout_s: how long a collective may wait for the other ranks before it fails (instead of hanging).

    Returns:
        This rank's device.
    """
    if not launched_distributed():
        return device
    lifeline.stop_with_launcher()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return device


def is_distributed() -> bool:
    """A process group with more than one rank is up."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0, the one that logs, writes files and prints."""
    return rank() == 0


_MESHES: dict[tuple[int, Any], Any] = {}


def _forget_other_groups_meshes() -> None:
    """Drop the meshes of an earlier (destroyed) process group; a sequence-parallel run's ``sequence_mesh`` and
    its FSDP2 ``training_mesh`` (hybrid sharding) are both of this one and stay."""
    world = id(dist.group.WORLD)
    for key in [k for k in _MESHES if k[0] != world]:
        del _MESHES[key]


def sequence_mesh(sequence_parallel: int):
    """The 2-D ``DeviceMesh`` (``dp`` x ``sp``) of a sequence-parallel run: ``world_size / N`` data-parallel
    groups of N consecutive ranks (``rank = dp_rank * N + sp_rank``; consecutive ranks share a node's links).
    Made once per process group; also under the estimator's fake process group.

    Args:
        sequence_parallel: N, ranks per sequence; divides the world size.

    Returns:
        The mesh, with dimension names ``dp`` and ``sp``.
    """
    world = dist.get_world_size()
    key = (id(dist.group.WORLD), sequence_parallel)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _forget_other_groups_meshes()
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        _MESHES[key] = init_device_mesh(
            device_type, (world // sequence_parallel, sequence_parallel), mesh_dim_names=("dp", "sp")
        )
    return _MESHES[key]


def training_mesh(replicate: int = 1, tensor_parallel: int = 1):
    """The 3-D ``DeviceMesh`` (``replicate`` x ``shard`` x ``tp``) of a hybrid-sharded or tensor-parallel run:
    ``rank = (replica * S + shard) * T + tp_rank`` with ``S = world_size / (R * T)``. Tensor-parallel groups are
    the T innermost (consecutive: a node's fastest links), then the shards of one replica, then the replicas
    (across nodes), torchtitan's order. Made once per process group (also under the estimator's fake one).

    Args:
        replicate: R, replicas (FSDP2's HSDP replicate dimension); divides the world size.
        tensor_parallel: T, ranks of a tensor-parallel group; divides ``world_size / R``.

    Returns:
        The mesh, with dimension names ``replicate``, ``shard`` and ``tp`` (a dimension may have size 1).

    Raises:
        ValueError: R * T does not divide the world size.
    """
    world = dist.get_world_size()
    if world % (replicate * tensor_parallel):
        raise ValueError(
            f"{replicate} replicas x {tensor_parallel} tensor-parallel ranks do not divide {world} ranks"
        )
    key = (id(dist.group.WORLD), ("hybrid", replicate, tensor_parallel))
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _forget_other_groups_meshes()
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        shape = (replicate, world // (replicate * tensor_parallel), tensor_parallel)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard", "tp"))
        if replicate > 1:
            # the data-parallel ranks as one dimension too (torchtitan's flattened "dp"): a DTensor reduced over
            # both FSDP2 dimensions (the gradient norm's Partial, Partial) then takes one all-reduce, not two
            mesh["replicate", "shard"]._flatten("dp")
        if tensor_parallel > 1:
            # a DTensor partial over shard and tp (the gradient norm of FSDP2 x TP) then reduces in one collective
            mesh["shard", "tp"]._flatten()
        _MESHES[key] = mesh
    return _MESHES[key]


def fsdp_mesh(replicate: int = 1, tensor_parallel: int = 1):
    """The mesh FSDP2 shards over: ``None`` (its default, every rank) for a flat run; the 2-D ``(replicate,
    shard)`` sub-mesh of :func:`training_mesh` for hybrid sharding (FSDP2 replicates over the first dimension and
    shards over the second); the 1-D ``shard`` sub-mesh for tensor parallelism without replicas."""
    if replicate == 1 and tensor_parallel == 1:
        return None
    mesh = training_mesh(replicate, tensor_parallel)
    return mesh["replicate", "shard"] if replicate > 1 else mesh["shard"]


def shard_ranks(replicate: int, world_size: int) -> int:
    """Ranks FSDP2 splits each parameter over: all ``world_size`` of them, or a replica's ``world_size / R`` under
    hybrid sharding (``distributed.replicate`` R; every replica holds the same shards). 1 in a single process."""
    return max(1, world_size // replicate) if world_size > 1 else 1


def tensor_parallel_mesh(replicate: int, tensor_parallel: int):
    """The 1-D ``tp`` sub-mesh of :func:`training_mesh`: this rank's tensor-parallel group."""
    return training_mesh(replicate, tensor_parallel)["tp"]


def ranks_per_batch(cfg: TrainConfig) -> int:
    """Consecutive ranks that share one ``batch_size`` of sequences: a sequence-parallel group (each holds a slice
    of its tokens) times a tensor-parallel group (each holds a slice of every layer). 1 in a single process."""
    if world_size() == 1:
        return 1
    return cfg.distributed.sequence_parallel * cfg.distributed.tensor_parallel


def sequence_group(sequence_parallel: int):
    """The process group of this rank's sequence-parallel group (:func:`sequence_mesh`'s ``sp`` dimension)."""
    return sequence_mesh(sequence_parallel)["sp"].get_group()


def sequence_rank(sequence_parallel: int) -> int:
    """This rank's place in its sequence-parallel group, ``0 .. N - 1`` (0 for N = 1)."""
    return rank() % sequence_parallel


def data_rank(sequence_parallel: int = 1) -> int:
    """This rank's data-parallel group: which ``batch_size`` rows of each global batch it trains on."""
    return rank() // sequence_parallel


def data_world_size(sequence_parallel: int = 1) -> int:
    """Data-parallel groups: a global batch holds this many times ``batch_size`` sequences."""
    return world_size() // sequence_parallel


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if is_distributed():
        dist.barrier()


def destroy_distributed() -> None:
    """Leave the process group (at the end of a run).

    Objects left in reference cycles (FSDP's state) can still hold gloo's pending work; they are collected first,
    so that the group's threads are joined while the interpreter is alive. Destroyed during interpreter shutdown
    instead, a rank sometimes aborted at exit ("terminate called without an active exception").
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Collectives of the training step (device tensors, no host sync; identity in a single process)
# ----------------------------------------------------------------------------------------------------------------


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over ranks (a new tensor; ``t`` itself in a single process)."""
    if not is_distributed():
        return t
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def max_over_ranks(values: dict[str, float | None]) -> dict[str, float | None]:
    """Each non-``None`` value replaced by its maximum over ranks (memory peaks). A host sync: logging only."""
    if not is_distributed():
        return values
    keys = [k for k, v in values.items() if v is not None]
    if not keys:
        return values
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {**values, **dict(zip(keys, t.tolist(), strict=True))}


def all_gather_objects(obj: Any) -> list[Any]:
    """``obj`` (picklable) of every rank, in rank order; ``[obj]`` in a single process. A host sync: logging only."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` (picklable), known to every rank; ``obj`` in a single process. So that all ranks raise
    an error rank 0 found, or none does."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` (this rank's shards of DTensors) is finite, on every rank. A host
    sync (and a collective when sharded: every rank must call it).

    Each tensor is reduced to its least and greatest element (``torch.aminmax``, which propagates NaN), so the check
    allocates nothing of the tensor's size: ``torch.isfinite(t).all()`` holds an absolute copy of ``t`` and three
    boolean masks of its shape, 2.57 GiB for Llama-3.2-3B's fp32 embedding, on top of the model at its checkpoint.
    """
    ok = None
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel() == 0:
            continue
        lowest, highest = torch.aminmax(local.detach())
        finite = torch.isfinite(lowest) & torch.isfinite(highest)
        ok = finite if ok is None else ok & finite
    if ok is None:
        ok = torch.ones((), dtype=torch.bool)
    if not is_distributed():
        return bool(ok)
    flag = ok.to(torch.int32).reshape(1)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    else:
        flag = flag.cpu()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def grad_norm_and_clip(model: torch.nn.Module, max_grad_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients (over every rank's shards), clipping them to ``max_grad_norm`` (> 0).

    Works for a plain model, FSDP2 (``DTensor`` gradients: the norm is all-reduced by ``full_tensor``) and FSDP1
    (its own ``clip_grad_norm_``, which all-reduces over the flat shards).

    Returns:
        0-dim fp32 tensor: the norm before clipping.
    """

    if is_fsdp1(model):
        return model.clip_grad_norm_(max_grad_norm if max_grad_norm > 0 else float("inf"))
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(total, "full_tensor"):  # DTensor: the local shards' norms, reduced over the mesh
        total = total.full_tensor()
    if max_grad_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, total)
    return total


# ----------------------------------------------------------------------------------------------------------------
# Sharding
# ----------------------------------------------------------------------------------------------------------------


def shard_model(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """Shard ``model`` over all ranks as ``cfg.distributed.strategy`` says (see the module docstring).

    Apply after the method (LoRA / adapter) and activation checkpointing, before building the optimizer.

    Args:
        model: a :class:`~memfit.models.decoder.Llama`, materialised on ``device`` (or on the host with
            ``distributed.cpu_offload``).
        cfg: the run config (``distributed.*`` and ``dtype``).
        device: this rank's device.

    Returns:
        The sharded model: the same module for FSDP2 (its class swapped in place), an
        ``FullyShardedDataParallel`` wrapper for FSDP1.
    """
    # torch.distributed.fsdp (and DTensor with it) takes ~0.5 s to import: only a sharded run pays for it
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        CPUOffloadPolicy,
        MixedPrecision,
        MixedPrecisionPolicy,
        ShardingStrategy,
        fully_shard,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    d = cfg.distributed
    layers = list(model.model.layers)
    if d.strategy == "fsdp2":
        kwargs = {"reshard_after_forward": d.reshard_after_forward}
        mesh = fsdp_mesh(d.replicate, d.tensor_parallel)
        if mesh is not None:
            kwargs["mesh"] = mesh
        if cfg.dtype == "bf16_mixed":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if d.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for layer in layers:
            fully_shard(layer, **kwargs)
        # the root's own parameters (embedding, norm, lm_head) are needed again right after the forward by the
        # loss and backward: keeping them unsharded saves one all-gather (torchtitan does the same)
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        if d.prefetch > 0:
            for i, layer in enumerate(layers):
                layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + d.prefetch])
                layer.set_modules_to_backward_prefetch(layers[max(0, i - d.prefetch) : i][::-1])
        return model

    for (
        p
    ) in model.parameters():  # use_orig_params keeps the Parameters but makes them 1-D views of the shard:
        p._memfit_ndim = p.ndim  # remember which are matrices (weight decay, see memfit.memory.optim)
    on_meta = any(p.is_meta for p in model.parameters())
    return FSDP1(
        model,
        auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}),
        sharding_strategy=(
            ShardingStrategy.FULL_SHARD if d.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        ),
        mixed_precision=(
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if cfg.dtype == "bf16_mixed"
            else None
        ),
        cpu_offload=CPUOffload(offload_params=True) if d.cpu_offload else None,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE if d.prefetch > 0 else None,
        forward_prefetch=d.prefetch > 0,
        limit_all_gathers=d.limit_all_gathers,
        use_orig_params=True,
        device_id=device,
        sync_module_states=False,  # every rank built the same weights, or fills its shards (materialize_sharded)
        # a meta-built model: each unit gets uninitialised memory just before it is flattened and sharded, so no
        # rank ever holds more than one unit unsharded; materialize_sharded then writes the values
        param_init_fn=_materialize_unit(model, device) if on_meta else None,
    )


def local_shape(shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """The shape of rank 0's shard of a parameter of ``shape`` (:func:`shard_numel`'s chunk of dim 0)."""
    if world_size == 1 or not shape:
        return shape
    return (min(shape[0], -(-shape[0] // world_size)), *shape[1:])


def shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of rank 0's shard of a parameter of ``shape``: its dim-0 chunk of ``ceil(rows / world_size)`` rows
    (``torch.chunk``'s layout, as FSDP2 shards; rank 0's chunk is the largest). The whole tensor for one rank or
    a 0-dim tensor.

    Args:
        shape: the unsharded parameter's shape.
        world_size: ranks it is sharded over.

    Returns:
        Elements (multiply by the element size for bytes).
    """
    if world_size == 1 or not shape:
        return math.prod(shape)
    rows = -(-shape[0] // world_size)
    return min(rows, shape[0]) * math.prod(shape[1:])


def _materialize_unit(model: torch.nn.Module, device: torch.device):
    """FSDP1's ``param_init_fn``: uninitialised memory for one module's own tensors, keeping a tied ``lm_head``
    tied (FSDP1 materialises ``lm_head`` and the embedding separately, and would flatten two matrices)."""

    def materialize(module: torch.nn.Module) -> None:
        module.to_empty(
            device=device, recurse=False
        )  # new Parameter objects: mark them again (see shard_model)
        for p in module.parameters(recurse=False):
            p._memfit_ndim = p.ndim
        if module is model.lm_head or module is model.model.embed_tokens:
            model.tie_weights()

    return materialize


def materialize_sharded(
    model: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """Give a model that was built on the meta device and then sharded its values, one whole tensor at a time.

    Every rank passes the same tensors in the same order (they are read from a checkpoint or drawn from the same
    seed) and keeps only its part, so no rank holds more than its shards plus one unsharded tensor (FSDP2) or one
    unsharded FSDP unit (FSDP1) at any time; then the RoPE buffer is recomputed. Collective under FSDP1.

    - FSDP2: the parameters are ``DTensor`` s sharded on dim 0 in ``torch.chunk``'s layout; the model is moved to
      ``device`` with ``to_empty`` and each rank copies its rows of every tensor into its local shard. A local
      shard that is a tensor subclass (QLoRA's NF4) gets the rank's chunk of ``quantize(whole tensor)``: every
      rank quantizes the whole weight, so the shards are exactly those of one quantized tensor.
    - FSDP1: each tensor's FSDP unit is gathered (``summon_full_params(recurse=False, writeback=True)``, kept
      while consecutive tensors belong to it), the tensor copied into the unsharded view, and the unit's shards
      written back when it is released.

    Args:
        model: the output of :func:`shard_model` on a meta-built model.
        tensors: ``(name, tensor)`` with the names of the unwrapped model's ``named_parameters()`` (a tied weight
            once), each a whole parameter in any floating dtype (converted to the parameter's).
        device: this rank's device.
        quantize: makes a whole tensor into the subclass of the shards that are one (FSDP2); None when there are
            none.

    Returns:
        How many parameters were filled.

    Raises:
        ValueError: a name the model does not have, a shape that differs, or parameters left unfilled.
    """

    fsdp1 = is_fsdp1(model)
    if not fsdp1 and any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    inner = unwrap(model)
    params = {_clean_name(n): p for n, p in inner.named_parameters()}
    units = _fsdp1_units(model) if fsdp1 else {}
    filled: set[str] = set()
    summoned, current = None, None
    try:
        with torch.no_grad():
            for name, full in tensors:
                param = params.get(name)
                if param is None or name in filled:
                    raise ValueError(f"tensor '{name}' is not a parameter of the model (or was given twice)")
                if fsdp1:
                    unit = _owner(units, name)
                    if unit is not current:
                        if summoned is not None:
                            summoned.__exit__(None, None, None)
                        summoned, current = (
                            type(unit).summon_full_params(unit, recurse=False, writeback=True),
                            unit,
                        )
                        summoned.__enter__()
                    param = inner.get_parameter(name)  # the unsharded view while the unit is summoned
                    _check_shape(name, full, tuple(param.shape))
                    param.copy_(full)
                else:
                    _check_shape(name, full, tuple(param.shape))
                    _copy_own_rows(param, full, quantize)
                filled.add(name)
                del full
    finally:
        if summoned is not None:
            summoned.__exit__(None, None, None)
    missing = [n for n in params if n not in filled]
    if missing:
        raise ValueError(f"parameters {missing[:5]} were not filled ({len(missing)} in all)")
    with torch.no_grad():
        inner.model.reset_rope()  # a buffer: to_empty left it uninitialised
    return len(filled)


def _check_shape(name: str, full: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(full.shape) != shape:
        raise ValueError(f"tensor '{name}' has shape {tuple(full.shape)}, the parameter {shape}")


def _copy_own_rows(
    param: torch.Tensor, full: torch.Tensor, quantize: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Copy this rank's block of ``full`` into ``param``'s local shard (a DTensor on any mesh, or a plain tensor); a
    subclass shard (:func:`materialize_sharded`) takes its inner tensors from the chunk of ``quantize(full)``."""
    if not hasattr(param, "to_local"):
        param.copy_(full)
        return

    local = param.to_local()
    if is_traceable_wrapper_subclass(local):
        # FSDP2's Shard(0) over one mesh dimension; hybrid sharding's (Replicate(), Shard(0)): the replicas hold
        # the same chunk, the one of this rank's place within its replica
        placements = param.placements
        mesh = param.device_mesh
        sharded = [i for i, p in enumerate(placements) if not p.is_replicate()]
        if len(sharded) != 1 or not placements[sharded[0]].is_shard(0):
            raise ValueError(
                f"a quantized shard must be sharded on dim 0 over one mesh dimension (replicated over the others), "
                f"got {placements}"
            )
        local = param._local_tensor  # the shard FSDP2 gathers: to_local() gives a subclass a new wrapper
        if quantize is None:
            raise ValueError(f"a {type(local).__name__} shard needs a quantize function to be filled")
        whole = quantize(full.to(device=local.device, dtype=local.dtype))
        dim = sharded[0]
        piece = torch.chunk(whole, mesh.size(dim))[mesh.get_local_rank(dim)]
        if tuple(piece.shape) != tuple(local.shape):
            raise ValueError(f"a shard of shape {tuple(local.shape)} does not match {tuple(piece.shape)}")
        for inner in local.__tensor_flatten__()[0]:  # to_empty left some of them on the meta device
            setattr(local, inner, getattr(piece, inner).clone())
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # every rank holds the same whole tensor: its piece is a block of it (FSDP2's dim-0 chunk, HSDP's chunk within
    # a replica, tensor parallelism's column or row block, chunked again by FSDP2), copied across, never converted
    # whole (a whole-tensor temporary is what breaks at 70B)
    shape, offset = compute_local_shape_and_global_offset(
        tuple(full.shape), param.device_mesh, param.placements
    )
    if tuple(shape) != tuple(local.shape):
        raise ValueError(
            f"a shard of shape {tuple(local.shape)} does not match {tuple(shape)} of {tuple(full.shape)}"
        )
    block = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    local.copy_(block)


def _fsdp1_units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """FSDP1 units by the unwrapped model's name of the module they wrap (``""`` for the root)."""

    return {_clean_name(n): m for n, m in model.named_modules() if is_fsdp1(m)}


def _clean_name(name: str) -> str:
    """A name under FSDP1 wrappers as the unwrapped model has it."""
    return ".".join(p for p in name.split(".") if p != "_fsdp_wrapped_module")


def _owner(units: dict[str, torch.nn.Module], name: str) -> torch.nn.Module:
    """The innermost FSDP1 unit whose module holds parameter ``name``."""
    best = ""
    for prefix in units:
        if prefix and name.startswith(prefix + ".") and len(prefix) > len(best):
            best = prefix
    return units[best]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The :class:`~memfit.models.decoder.Llama` inside an FSDP1 wrapper (FSDP2 models are their own)."""

    return model.module if is_fsdp1(model) else model


def is_fsdp1(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP1 ``FullyShardedDataParallel`` wrapper. Imports nothing: while no code has
    imported ``torch.distributed.fsdp`` (a run on one process, an estimate), no wrapper can exist."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel)
