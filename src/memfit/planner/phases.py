"""The phases of a run around its steps, predicted from headers and shapes: loading pretrained weights and writing a
checkpoint (docs/memory.md, "Load and save").

A run's training step is traced on fake tensors (:mod:`memfit.planner.estimate`); what happens before and after it
is simple enough to walk instead:

- **Load** (:func:`load_peak_bytes`): :func:`memfit.convert.load_pretrained` reads the checkpoint one tensor at a
  time (:func:`memfit.convert.load_order`: the order and shapes from the file headers), converts it to the run's
  parameter dtype (a second tensor where the dtype differs) and, for QLoRA, quantizes each decoder linear to NF4
  (torchao's ``to_nf4``, whose temporaries are traced once per shape on fake tensors: several times the weight, as
  it scales every block and compares every value with the 16 codes in chunks). What was loaded before stays, the
  source is dropped before the next is read. The peak is the largest ``loaded so far + this tensor's transient``.
- **Save** (:func:`memfit.planner.estimate.estimate_run`): the weights go to safetensors straight from their memory
  and the optimizer state through ``torch.save`` storage by storage, so a save holds what the run holds between
  steps and no copy of it: the live bytes at the end of the traced step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import nn

from memfit.build import PARAM_DTYPES
from memfit.config import TrainConfig
from memfit.convert import load_order
from memfit.memory.tracker import MemoryTracker
from memfit.models.llama import LlamaConfig, build_llama
from memfit.models.peft import is_qlora_quantized, nf4_bytes, nf4_layout, nf4_module


def load_peak_bytes(cfg: TrainConfig, mcfg: LlamaConfig) -> int | None:
    """The peak of live tensor bytes while one process loads ``cfg.checkpoint_dir`` (before the method's adapters
    and the optimizer exist), from the file headers.

    Args:
        cfg: the run config (``checkpoint_dir``, ``dtype``, ``method``).
        mcfg: the architecture (for the model's buffers, recomputed after the load).

    Returns:
        Bytes, or ``None`` where there is nothing to predict: no ``checkpoint_dir`` (the model is drawn in place,
        its parameters are the step's own), or a format read otherwise (:func:`memfit.convert.load_order`).

    Raises:
        memfit.errors.CheckpointError: as the load itself would raise it.
    """
    if cfg.checkpoint_dir is None:
        return None
    order = load_order(cfg.checkpoint_dir)
    if order is None:
        return None
    dtype = PARAM_DTYPES[cfg.dtype]
    loaded = peak = 0
    for entry, kept in order:
        numel = math.prod(entry.shape)
        stored_dtype = entry.dtype or dtype
        stored = numel * stored_dtype.itemsize
        if not kept:  # read, then dropped
            peak = max(peak, loaded + stored)
            continue
        converted = 0 if stored_dtype == dtype else numel * dtype.itemsize  # .to() returns the same tensor
        if cfg.method == "qlora" and is_qlora_quantized(entry.name):
            # the source (when converted) beside to_nf4's own peak, which holds its input and its result
            peak = max(
                peak, loaded + (stored if converted else 0) + nf4_quantization_peak(entry.shape, dtype)
            )
            loaded += nf4_bytes(entry.shape, dtype)
        else:
            peak = max(peak, loaded + stored + converted)
            loaded += converted or stored
    return max(peak, loaded + _rope_peak(mcfg))


def _rope_peak(mcfg: LlamaConfig) -> int:
    """The peak live bytes of recomputing the model's RoPE buffers once the weights are in (``reset_rope``): the
    buffers and the temporaries of computing them, traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: imports torch._dynamo

    model = build_llama(mcfg, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
        with tracker:
            model.model.reset_rope("cpu")
    return tracker.peak_bytes


@functools.lru_cache(maxsize=64)
def nf4_quantization_peak(shape: Sequence[int], dtype: torch.dtype) -> int:
    """The peak live bytes of quantizing one ``(out, in)`` weight of ``dtype`` to NF4 with torchao's ``to_nf4``
    (:func:`memfit.models.peft.to_nf4`'s blocks), its input and its result included: traced on fake tensors by a
    :class:`~memfit.memory.tracker.MemoryTracker`, once per shape and dtype.

    Args:
        shape: the weight's shape (a tuple).
        dtype: its dtype, the run's parameter dtype.

    Returns:
        Bytes.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: imports torch._dynamo

    nf4 = nf4_module()
    with FakeTensorMode(allow_non_fake_inputs=True):
        weight = torch.empty(tuple(shape), dtype=dtype)
        tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
        with tracker:
            nf4.to_nf4(weight, *nf4_layout(shape))
    return tracker.peak_bytes
