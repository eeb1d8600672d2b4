"""The closed-form bytes model: parameters, gradients and optimizer state of one rank, from shapes and dtypes
alone (no trace). :func:`memfit.planner.estimate.estimate_run` prints it beside the traced numbers (the two agree
exactly on model states), the planner bounds combinations with it, and the pre-flight check's cheap bound starts
from it.
"""

from __future__ import annotations

import torch

from memfit.build import PARAM_DTYPES, build_model
from memfit.config import TrainConfig
from memfit.distributed import shard_numel
from memfit.memory.optim import BNB_MIN_8BIT_SIZE, TORCHAO_BLOCK_SIZES, TORCHAO_MIN_QUANTIZED_SIZE
from memfit.models import peft
from memfit.models.llama import LlamaConfig


def model_state_bytes_closed_form(cfg: TrainConfig, mcfg: LlamaConfig, world_size: int = 1) -> dict[str, int]:
    """Parameters, gradients and optimizer state of one rank, in bytes, from shapes and dtypes alone.

    - parameters: every parameter once (a tied ``lm_head`` is the embedding) in the dtype policy's parameter dtype
      (fp32 for ``fp32`` and ``bf16_mixed``, bf16 for ``bf16``), plus the fp32 RoPE buffer; QLoRA's NF4 weights
      at :func:`memfit.models.peft.nf4_bytes`;
    - gradients: every trainable parameter in its dtype, as the optimizer step finds them (0 with the optimizer
      in backward, which frees each gradient as soon as its update ran);
    - optimizer state: AdamW keeps ``exp_avg`` and ``exp_avg_sq`` in the parameter dtype and a 4-byte fp32 ``step``
      per parameter; low-bit optimizers as :func:`optimizer_state_bytes` says.

    Sharded (``world_size`` > 1): every parameter is split on dim 0 into ``ceil(rows / world_size)``-row chunks
    (``torch.chunk``'s layout) and rank 0's chunk counts; FSDP1 flattens a unit's parameters into one padded buffer
    and gives each rank ``ceil(numel / world_size)`` elements.

    Returns:
        ``{"parameters", "gradients", "optimizer_state", "trainable_parameters", "paged_optimizer_state"}`` in
        bytes (the last: the part of ``optimizer_state`` a paged optimizer keeps in unified memory on CUDA).
    """
    dtype = PARAM_DTYPES[cfg.dtype]
    model = build_model(cfg, mcfg, torch.device("meta"))
    size = torch.tensor([], dtype=dtype).element_size()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    params = {n: p for n, p in model.named_parameters()}
    local = {n: shard_numel(tuple(p.shape), world_size) for n, p in params.items()}
    trainable = [n for n, p in params.items() if p.requires_grad]
    tensors = [(local[n], size) for n in trainable]
    parameters = buffers + sum(
        peft.nf4_bytes(tuple(p.shape), dtype, world_size) if peft.is_nf4(p) else local[n] * size
        for n, p in params.items()
    )
    return {
        "parameters": parameters,
        "gradients": 0 if cfg.optimizer_in_backward else sum(local[n] for n in trainable) * size,
        "optimizer_state": optimizer_state_bytes(cfg.optimizer.name, tensors),
        "trainable_parameters": sum(local[n] for n in trainable) * size,
        "paged_optimizer_state": paged_optimizer_state_bytes(cfg.optimizer.name, tensors),
    }


def optimizer_state_bytes(name: str, tensors: list[tuple[int, int]]) -> int:
    """Bytes of optimizer state for trainable tensors given as ``(numel, element_size)``.

    - ``adamw``, ``paged_adamw``: two moments in the parameter dtype, and a 4-byte ``step`` per tensor
      (torch keeps it as a 0-dim fp32 tensor; bitsandbytes keeps its step in the param group, no tensor);
    - ``adamw8bit``, ``paged_adamw8bit`` (bitsandbytes block-wise): tensors of >= 4,096 elements keep two uint8
      moments and one fp32 absmax per 256-element block of each, and the optimizer two 256-entry fp32
      quantization maps shared by all tensors; smaller tensors keep fp32 moments; no ``step`` tensor;
    - torchao low-bit AdamW (8-bit, fp8: 1 byte per element; 4-bit: half a byte): tensors of >= 4,096 elements
      whose size is a multiple of the block (256; 128 for 4-bit) keep two quantized moments with one fp32 scale per
      block each, and their own copy of the quantization map (256 fp32 entries per moment for 8-bit, 16 for
      4-bit, none for fp8); others keep moments in the parameter dtype. Every tensor has a 4-byte ``step``.

    Returns:
        Bytes.
    """
    total = 0
    if name in ("adamw8bit", "paged_adamw8bit") and any(n >= BNB_MIN_8BIT_SIZE for n, _ in tensors):
        total += 2 * 256 * 4  # the signed and unsigned quantization maps, shared by all tensors
    for numel, size in tensors:
        if name == "adamw":
            total += 2 * numel * size + 4
        elif name == "paged_adamw":
            total += 2 * numel * 4
        elif name in ("adamw8bit", "paged_adamw8bit"):
            if numel >= BNB_MIN_8BIT_SIZE:
                blocks = -(-numel // 256)
                total += 2 * numel + 2 * blocks * 4
            else:
                total += 2 * numel * 4
        else:
            block = TORCHAO_BLOCK_SIZES[name]
            if numel >= TORCHAO_MIN_QUANTIZED_SIZE and numel % block == 0:
                per = 0.5 if name == "torchao_adamw4bit" else 1
                code = int(2 * numel * per)
                total += code + 2 * (numel // block) * 4 + 4
                if name == "torchao_adamw4bit":
                    total += 2 * 16 * 4  # the 4-bit code books
                elif name == "torchao_adamw8bit":
                    total += 2 * 256 * 4
            else:
                total += 2 * numel * size + 4
    return total


BNB_PAGED_MIN_NUMEL = 100_000
"""bitsandbytes' paged optimizers page the moments of tensors of at least this many elements (its
``get_state_buffer``); smaller tensors' moments, every absmax and the code tables are ordinary device memory."""


def paged_optimizer_state_bytes(name: str, tensors: list[tuple[int, int]]) -> int:
    """Bytes of optimizer state that a paged optimizer keeps in CUDA unified memory (0 for the others).

    Args:
        name: ``optimizer.name``.
        tensors: the trainable tensors as ``(numel, element_size)``.

    Returns:
        Bytes: for each tensor of >= :data:`BNB_PAGED_MIN_NUMEL` elements, two uint8 moments
        (``paged_adamw8bit``; such a tensor is always above bitsandbytes' 8-bit threshold) or two fp32 moments
        (``paged_adamw``).
    """
    if name not in ("paged_adamw8bit", "paged_adamw"):
        return 0
    per_element = 2 if name == "paged_adamw8bit" else 2 * 4
    return sum(per_element * numel for numel, _ in tensors if numel >= BNB_PAGED_MIN_NUMEL)
