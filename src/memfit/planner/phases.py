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
from memfit.convert import expert_load_order, load_order
from memfit.convert.tensors import Entry
from memfit.memory.tracker import MemoryTracker
from memfit.models.config import DecoderConfig
from memfit.models.decoder import build_decoder
from memfit.models.nf4 import NF4_BLOCK_SIZE, NF4Builder, code_table, code_table_bytes, quantize
from memfit.models.peft import is_qlora_quantized, nf4_bytes, quantized_in_parts


def load_peak_bytes(cfg: TrainConfig, mcfg: DecoderConfig) -> int | None:
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
    stacks: dict[str, tuple[Entry, int]] = {}
    if order is None:
        experts = expert_load_order(cfg.checkpoint_dir)
        if experts is None:
            return None
        stored_entries, stacks = experts
        order = [(e, True) for e in stored_entries]
    dtype = PARAM_DTYPES[cfg.dtype]
    walk = _LoadWalk(cfg, dtype)
    missing: dict[str, int] = {}
    for entry, kept in order:
        stored = math.prod(entry.shape) * (entry.dtype or dtype).itemsize
        if entry.name in stacks:  # an expert's tensor, put into its stack (allocated at the first part)
            stack, parts = stacks[entry.name]
            in_nf4 = cfg.method == "qlora" and quantized_in_parts(stack.name, dtype, math.prod(entry.shape))
            buffers = (
                nf4_builder_bytes(stack.shape, dtype)
                if in_nf4
                else math.prod(stack.shape) * (stack.dtype or dtype).itemsize
            )
            if stack.name not in missing:
                missing[stack.name] = parts
                walk.filling += buffers
            if in_nf4:  # the part read, converted and coded into the stack's codes and maxima
                walk.touch_table()
                part = nf4_part_peak(math.prod(entry.shape), entry.dtype or dtype, dtype)
                walk.peak = max(walk.peak, walk.loaded + walk.filling + part)
            else:
                walk.peak = max(walk.peak, walk.loaded + walk.filling + stored)
            missing[stack.name] -= 1
            if missing[stack.name]:
                continue
            del missing[stack.name]
            walk.filling -= buffers
            if in_nf4:  # the maxima double-quantized beside the last part (the file reader's reference)
                finish = nf4_finish_peak(tuple(stack.shape), dtype)
                walk.peak = max(walk.peak, walk.loaded + walk.filling + stored + finish)
                walk.loaded += nf4_bytes(stack.shape, dtype)
                continue
            # handed on whole, counted as the tensor read now; its last part stays alive meanwhile (the file
            # reader's reference, dropped when it reads the next)
            walk.keep(stack, buffers, beside=stored)
        elif not kept:  # read, then dropped
            walk.peak = max(walk.peak, walk.loaded + walk.filling + stored)
        else:
            walk.keep(entry, stored)
    return max(walk.peak, walk.loaded + _rope_peak(mcfg))


class _LoadWalk:
    """What :func:`load_peak_bytes` holds as it walks the load: ``loaded`` (the model so far), ``filling`` (stacks
    of experts in progress) and the ``peak``."""

    def __init__(self, cfg: TrainConfig, dtype: torch.dtype) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.loaded = self.peak = self.filling = 0
        self.table = 0  # the quantizer's code table, made at the first NF4 weight and kept

    def touch_table(self) -> int:
        """The quantizer's code table, made at the first NF4 weight and kept: its bytes the first time, else 0."""
        if self.table:
            return 0
        self.table = code_table_bytes(self.dtype)
        self.loaded += self.table
        return self.table

    def keep(self, entry: Entry, stored: int, beside: int = 0) -> None:
        """One tensor the model keeps, read (``stored`` bytes, with ``beside`` bytes more alive meanwhile),
        converted to the run's dtype (a second tensor where it differs) and, for QLoRA, quantized to NF4."""
        numel, dtype = math.prod(entry.shape), self.dtype
        held = self.loaded + self.filling + beside
        converted = 0 if (entry.dtype or dtype) == dtype else numel * dtype.itemsize  # .to() returns the same
        if self.cfg.method == "qlora" and is_qlora_quantized(entry.name):
            held += self.touch_table()
            # the source (when converted) beside the quantization's own peak, which holds its input and result
            self.peak = max(
                self.peak, held + (stored if converted else 0) + nf4_quantization_peak(entry.shape, dtype)
            )
            self.loaded += nf4_bytes(entry.shape, dtype)
            return
        self.peak = max(self.peak, held + stored + converted)
        self.loaded += converted or stored


def _rope_peak(mcfg: DecoderConfig) -> int:
    """The peak live bytes of recomputing the model's RoPE buffers once the weights are in (``reset_rope``): the
    buffers and the temporaries of computing them, traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: imports torch._dynamo

    model = build_decoder(mcfg, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
        with tracker:
            model.model.reset_rope("cpu")
    return tracker.peak_bytes


def nf4_builder_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes an :class:`~memfit.models.nf4.NF4Builder` of a weight of ``shape`` holds while its parts arrive: the
    packed codes (half a byte a weight) and the block maxima in ``dtype``."""
    numel = math.prod(shape)
    return numel // 2 + numel // NF4_BLOCK_SIZE * dtype.itemsize


@functools.lru_cache(maxsize=64)
def nf4_part_peak(part_numel: int, stored: torch.dtype, dtype: torch.dtype) -> int:
    """The peak live bytes of putting one part of ``part_numel`` weights, read in ``stored``, into an NF4 stack of
    ``dtype`` (:class:`~memfit.models.nf4.NF4Builder`, as QLoRA's load does: :func:`memfit.build.nf4_stack`): the
    part as read, its conversion and the quantization's temporaries, above the stack's own buffers and the code
    table. Traced on fake tensors, once per size and dtypes.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: imports torch._dynamo

    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
        with tracker:
            torch.index_select(code_table(dtype, "cpu"), 0, torch.zeros(0, dtype=torch.int32))
            builder = NF4Builder((part_numel,), dtype, "cpu")
            part = torch.empty(part_numel, dtype=stored)
            builder.put(0, part.to(dtype=dtype))
    return tracker.peak_bytes - code_table_bytes(dtype) - nf4_builder_bytes((part_numel,), dtype)


@functools.lru_cache(maxsize=64)
def nf4_finish_peak(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The peak live bytes of :meth:`~memfit.models.nf4.NF4Builder.finish` of a weight of ``shape``: its codes and
    maxima, the double quantization's temporaries and the result, traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: imports torch._dynamo

    with FakeTensorMode(allow_non_fake_inputs=True):
        tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
        with tracker:
            NF4Builder(shape, dtype, "cpu").finish()
    return tracker.peak_bytes


@functools.lru_cache(maxsize=64)
def nf4_quantization_peak(shape: Sequence[int], dtype: torch.dtype) -> int:
    """The peak live bytes of quantizing one ``(out, in)`` weight of ``dtype`` to NF4 with torchao's ``to_nf4``
    (:func:`memfit.models.nf4_format.to_nf4`'s blocks), its input and its result included: traced on fake tensors by a
    :class:`~memfit.memory.tracker.MemoryTracker`, once per shape and dtype.

    Args:
        shape: the weight's shape (a tuple).
        dtype: its dtype, the run's parameter dtype.

    Returns:
        Bytes.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: imports torch._dynamo

    with FakeTensorMode(allow_non_fake_inputs=True):
        weight = torch.empty(tuple(shape), dtype=dtype)
        tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
        with tracker:
            if code_table_bytes(dtype):  # seen from the start, so that the peak holds it whenever it falls
                torch.index_select(code_table(dtype, "cpu"), 0, torch.zeros(0, dtype=torch.int32))
            quantize(weight)
    return tracker.peak_bytes - code_table_bytes(dtype)
