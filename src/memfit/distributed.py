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
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from memfit.config import TrainConfig

STRATEGIES = ("fsdp2", "fsdp1")


# ----------------------------------------------------------------------------------------------------------------
# Process group and rank helpers
# ----------------------------------------------------------------------------------------------------------------


def launched_distributed() -> bool:
    """``True`` when torchrun (or another launcher) set ``WORLD_SIZE`` > 1 for this process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> torch.device:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``).

    gloo on CPU, nccl on CUDA (each rank on ``cuda:LOCAL_RANK``). A single process is left alone.

    Args:
        device: the device the config resolved to (``cpu`` or ``cuda``).
        timeout_s: how long a collective may wait for the other ranks before it fails (instead of hanging).

    Returns:
        This rank's device.
    """
    if not launched_distributed():
        return device
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


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if is_distributed():
        dist.barrier()


def destroy_distributed() -> None:
    """Leave the process group (at the end of a run)."""
    if dist.is_available() and dist.is_initialized():
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


def grad_norm_and_clip(model: torch.nn.Module, max_grad_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients (over every rank's shards), clipping them to ``max_grad_norm`` (> 0).

    Works for a plain model, FSDP2 (``DTensor`` gradients: the norm is all-reduced by ``full_tensor``) and FSDP1
    (its own ``clip_grad_norm_``, which all-reduces over the flat shards).

    Returns:
        0-dim fp32 tensor: the norm before clipping.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(model, FSDP1):
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
        model: a :class:`~memfit.models.llama.Llama`, materialised on ``device`` (or on the host with
            ``distributed.cpu_offload``).
        cfg: the run config (``distributed.*`` and ``dtype``).
        device: this rank's device.

    Returns:
        The sharded model: the same module for FSDP2 (its class swapped in place), an
        ``FullyShardedDataParallel`` wrapper for FSDP1.
    """
    d = cfg.distributed
    layers = list(model.model.layers)
    if d.strategy == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs = {"reshard_after_forward": d.reshard_after_forward}
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

    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from memfit.models.llama import DecoderLayer

    for (
        p
    ) in model.parameters():  # use_orig_params keeps the Parameters but makes them 1-D views of the shard:
        p._memfit_ndim = p.ndim  # remember which are matrices (weight decay, see memfit.memory.optim)
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
        sync_module_states=False,  # every rank built the same weights from the same seed
    )


def _on_cuda(model: torch.nn.Module) -> bool:
    # cpu_offload on CPU buys nothing, and FSDP1's rank0_only offload then clones freed storage (SIGSEGV, torch 2.13)
    return next(model.parameters()).device.type == "cuda"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The :class:`~memfit.models.llama.Llama` inside an FSDP1 wrapper (FSDP2 models are their own)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return model.module if isinstance(model, FSDP1) else model
