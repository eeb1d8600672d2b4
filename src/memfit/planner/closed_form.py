"""The closed-form bytes model: parameters, gradients and optimizer state of one rank, from shapes and dtypes
alone (no trace). :func:`memfit.planner.estimate.estimate_run` prints it beside the traced numbers (the two agree
exactly on model states), the planner bounds combinations with it, and the pre-flight check's cheap bound starts
from it.
"""

from __future__ import annotations

import torch

from memfit.build import PARAM_DTYPES, build_model
from memfit.config import TrainConfig
from memfit.distributed import local_shape, shard_numel, shard_ranks
from memfit.memory import optimizers, rounding
from memfit.memory.tensor_parallel import tensor_parallel_shape
from memfit.models import nf4 as nf4_format
from memfit.models import peft
from memfit.models.config import DecoderConfig

_UPDATE_FLOPS: dict[str, float] = {}


def _update_flops(cfg: TrainConfig, mcfg: DecoderConfig) -> float:
    entry = optimizers.spec(cfg.optimizer.name)
    model = build_model(cfg, mcfg, torch.device("meta"))
    tensors = optimizers.tensor_infos(
        cfg.optimizer.name,
        [(n, tuple(p.shape), 4, p.ndim) for n, p in model.named_parameters() if p.requires_grad],
        rank=cfg.optimizer.apollo_rank,
        dim=mcfg.dim,
        num_heads=mcfg.num_heads,
        head_dim=mcfg.head_dim,
    )
    return entry.update_flops(tensors, cfg.optimizer) if entry.update_flops is not None else 0.0


def optimizer_update_flops(cfg: TrainConfig, mcfg: DecoderConfig) -> float:
    """Matmul FLOPs of one optimizer update beyond AdamW's elementwise work, on each rank: Muon's Newton-Schulz
    iteration of every hidden matrix, APOLLO's projections (:attr:`memfit.memory.optimizers.Optimizer.
    update_flops`); 0 for the others. Of the whole matrices: sharded, DTensor gathers each matrix for Muon's
    iteration and every rank runs it (as torchtitan's distributed Muon does).

    Returns:
        FLOPs (cached by the settings they depend on).
    """
    if optimizers.spec(cfg.optimizer.name).update_flops is None:
        return 0.0
    key = repr((cfg.method, cfg.lora, cfg.adapter, cfg.optimizer, mcfg))
    if key not in _UPDATE_FLOPS:
        _UPDATE_FLOPS[key] = _update_flops(cfg, mcfg)
    return _UPDATE_FLOPS[key]


def model_state_bytes_closed_form(
    cfg: TrainConfig, mcfg: DecoderConfig, world_size: int = 1
) -> dict[str, int]:
    """Parameters, gradients and optimizer state of one rank, in bytes, from shapes and dtypes alone.

    - parameters: every parameter once (a tied ``lm_head`` is the embedding) in the dtype policy's parameter dtype
      (fp32 for ``fp32`` and ``bf16_mixed``, bf16 for ``bf16``), plus the fp32 RoPE buffer; QLoRA's NF4 weights
      at :func:`memfit.models.peft.nf4_bytes`;
    - gradients: every trainable parameter in its dtype, as the optimizer step finds them (0 with the optimizer
      in backward, which frees each gradient as soon as its update ran);
    - optimizer state: the optimizer's entry says (:attr:`memfit.memory.optimizers.Optimizer.state`; AdamW keeps
      ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype and a 4-byte fp32 ``step`` per parameter), plus
      ``bf16_rounding: kahan``'s bf16 compensation buffer of each trainable bf16 tensor
      (:func:`memfit.memory.rounding.compensation_bytes`).

    Sharded (``world_size`` > 1): every parameter is split on dim 0 into ``ceil(rows / world_size)``-row chunks
    (``torch.chunk``'s layout) and rank 0's chunk counts; under ``distributed.tensor_parallel`` T, rank 0's
    tensor-parallel block (:func:`memfit.memory.tensor_parallel.tensor_parallel_shape`) into ``world_size / T``;
    FSDP1 flattens a unit's parameters into one padded buffer and gives each rank ``ceil(numel / world_size)``
    elements. Hybrid sharding (``distributed.replicate`` R) splits them over the ``world_size / R`` ranks of a
    replica (``world_size / (R T)`` with tensor parallelism).

    Returns:
        ``{"parameters", "gradients", "optimizer_state", "trainable_parameters", "paged_optimizer_state"}`` in
        bytes (the last: the part of ``optimizer_state`` a paged optimizer keeps in unified memory on CUDA).
    """
    dtype = PARAM_DTYPES[cfg.dtype]
    optimizer = optimizers.spec(cfg.optimizer.name)
    model = build_model(cfg, mcfg, torch.device("meta"))
    size = torch.tensor([], dtype=dtype).element_size()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    params = {n: p for n, p in model.named_parameters()}
    # tensor parallelism: each parameter's block on its group's rank 0, sharded over the world / T data ranks
    tp = cfg.distributed.tensor_parallel if world_size > 1 else 1
    shapes = {n: tensor_parallel_shape(n, tuple(p.shape), tp) for n, p in params.items()}
    world_size = shard_ranks(cfg.distributed.replicate, world_size)  # hybrid sharding: a replica's ranks
    local = {n: shard_numel(shapes[n], world_size // tp) for n in params}
    trainable = [n for n, p in params.items() if p.requires_grad]
    tensors = optimizers.tensor_infos(
        cfg.optimizer.name,
        [(n, local_shape(shapes[n], world_size // tp), size, params[n].ndim) for n in trainable],
        rank=cfg.optimizer.apollo_rank,
        dim=mcfg.dim,
        num_heads=mcfg.num_heads,
        head_dim=mcfg.head_dim,
    )
    parameters = buffers + sum(
        peft.nf4_bytes(tuple(p.shape), dtype, world_size) if nf4_format.is_nf4(p) else local[n] * size
        for n, p in params.items()
    )
    return {
        "parameters": parameters,
        "gradients": 0 if cfg.optimizer_in_backward else sum(local[n] for n in trainable) * size,
        "optimizer_state": optimizer.state(tensors)
        + sum(rounding.compensation_bytes(cfg.bf16_rounding, t.numel, t.size) for t in tensors),
        "trainable_parameters": sum(local[n] for n in trainable) * size,
        "paged_optimizer_state": optimizer.paged_state(tensors),
    }
