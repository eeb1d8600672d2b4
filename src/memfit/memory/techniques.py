"""Activation-memory techniques, applied to a built model from outside (the model file knows nothing of them).

- **Activation checkpointing** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): a wrapped
  decoder layer keeps only its input ``(B, T, dim)`` during the forward and recomputes its internals in the
  backward. Saves the tensors the layer would keep for backward (norm outputs, q/k/v, attention output and
  statistics, the SwiGLU gate/up products: measured in docs/memory.md) at the cost of one more forward of the layer.
- **Selective activation checkpointing** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models"; op-level as torchtitan applies it): every decoder layer is checkpointed with a policy that
  saves the outputs of its matmuls and of attention and recomputes everything else (norms, RoPE, SiLU, the
  elementwise products, casts), so the backward redoes no matmul.
- **Activation offloading** (CUDA only): tensors saved for backward move to pinned host memory during the forward
  and come back in the backward (``torch.autograd.graph.save_on_cpu``).
- **Chunked cross-entropy**: the loss over ``lm_head`` is computed chunk by chunk of tokens, and each chunk's logits
  are recomputed in the backward, so the full ``(B, T, vocab_size)`` logits — and their fp32 copy, softmax and
  gradient — never exist at once. For Llama 3's 128,256-entry vocabulary at ``B*T = 16k`` tokens those are
  8 GiB in fp32. (The same idea as torchtune's ``CEWithChunkedOutputLoss`` and Liger's fused linear
  cross-entropy; here each chunk is an activation-checkpointed ``lm_head`` + cross-entropy.)

All three keep the arithmetic of the plain computation, so losses are identical within float rounding of the
summation order (tested to 1e-6).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.config import AC_MODES

IGNORE_INDEX = -100


def checkpointed_layers(num_layers: int, mode: str, interval: int = 1) -> list[int]:
    """Indices of the decoder layers that ``mode`` checkpoints.

    Args:
        num_layers: layers in the model.
        mode: ``none``, ``selective`` or ``full`` (every layer) or ``every_n`` (layers 0, n, 2n, ...).
        interval: ``n`` for ``every_n``.

    Raises:
        ValueError: unknown mode or ``interval < 1``.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "none":
        return []
    if mode in ("full", "selective"):
        return list(range(num_layers))
    if interval < 1:
        raise ValueError(f"activation_checkpointing_interval must be >= 1, got {interval}")
    return list(range(0, num_layers, interval))


def apply_activation_checkpointing(model: nn.Module, mode: str, interval: int = 1) -> list[int]:
    """Make the chosen decoder layers recompute their activations in the backward.

    Each chosen layer's ``forward`` is replaced by a non-reentrant ``torch.utils.checkpoint.checkpoint`` of the
    original, so module structure and parameter names (and so checkpoints) are unchanged.

    Args:
        model: a :class:`memfit.models.llama.Llama` (its ``model.layers``).
        mode: ``none``, ``selective`` (every layer, keeping matmul and attention outputs), ``full`` or ``every_n``.
        interval: ``n`` for ``every_n``.

    Returns:
        The indices of the layers now checkpointed.

    Raises:
        ValueError: unknown mode or interval.
    """
    layers = model.model.layers
    chosen = checkpointed_layers(len(layers), mode, interval)
    options = {"context_fn": _selective_contexts} if mode == "selective" else {}
    for i in chosen:
        layer = layers[i]
        if getattr(layer, "_memfit_checkpointed", False):
            continue
        original = layer.forward
        layer.forward = functools.partial(checkpoint, original, use_reentrant=False, **options)
        layer._memfit_checkpointed = True
    return chosen


def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls and every attention kernel SDPA may pick."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls)


_SAVED_OPS = _saved_ops()


def activation_offloading(enabled: bool) -> contextlib.AbstractContextManager:
    """Context for the forward pass: tensors saved for backward live in pinned host memory while enabled.

    Only meaningful on CUDA; config validation rejects it elsewhere.
    """
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight)  # (N_chunk, V)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, num_chunks: int
) -> torch.Tensor:
    """Summed token cross-entropy of ``hidden @ lm_head_weight.T`` without materialising all logits.

    Args:
        hidden: ``(B, T, dim)`` final-normed hidden states.
        lm_head_weight: ``(vocab_size, dim)``.
        targets: ``(B, T)`` int64; ``-100`` marks tokens that do not count.
        num_chunks: split the ``B*T`` tokens into this many chunks (the last may be shorter).

    Returns:
        A 0-dim fp32 tensor: the summed cross-entropy (nats) over counted tokens. At most one chunk's logits
        ``(B*T/num_chunks, vocab_size)`` and their fp32 copy are alive at a time, in the forward and the backward.
    """
    flat_h = hidden.flatten(0, 1)  # (B*T, dim)
    flat_t = targets.flatten()  # (B*T,)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, t in zip(flat_h.tensor_split(num_chunks), flat_t.tensor_split(num_chunks), strict=True):
        total = total + checkpoint(_chunk_loss, h, lm_head_weight, t, use_reentrant=False)
    return total
