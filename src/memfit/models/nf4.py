"""4-bit NormalFloat weights (QLoRA, Dettmers et al. 2023) as torchao's ``NF4Tensor``, made fast and read in parts.

torchao's ``to_nf4`` scales each block of 64 weights by its absolute maximum, then finds each scaled value's
nearest of the 16 NormalFloat codes by comparing it with all 16 (a (numel, 16) difference in chunks): about 0.19 us
a weight on this machine's CPU, 97 minutes for Qwen3-30B-A3B's 30.5B weights. :func:`to_nf4` gives the very same
tensor, bit for bit, in a fraction of that:

- a 16-bit weight (bf16, fp16) has 65,536 possible scaled values, so torchao's own nearest-code function is run
  once on every one of them (:func:`_code_table`) and each weight's code is then one table lookup on its bits;
- the scaling is the same elementwise division, chunk by chunk (:data:`CHUNK_ELEMENTS`), so temporaries are one
  chunk's whatever the weight's size;
- the double quantization of the block scales is torchao's, on the same block maxima.

A float32 weight takes torchao's path. A weight of any number of dimensions is quantized as its rows flattened
(a mixture of experts' (E, m, n) stack as (E * m, n)); :func:`nf4_rows` dequantizes one expert's (m, n) slice of
such a tensor, bit-identical to dequantizing the whole and indexing it, so an expert's weight exists in the
parameter dtype only while it computes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from memfit.quiet import quiet_torchao_import

NF4_BLOCK_SIZE = 64
"""Weights per block of QLoRA's 4-bit NormalFloat base."""
NF4_SCALER_BLOCK_SIZE = 256
"""Block scales per block of the second (double) quantization to int8 (the paper's 256). NF4 blocks hold
:data:`NF4_BLOCK_SIZE` (64) weights, each block scaled by its absolute maximum (the paper's and
torchtune's block). A weight whose block count is not a multiple of 256 uses the largest power of two that divides
the count (:func:`nf4_layout`)."""
NF4_LUT_SIZE = 16
"""The 16 NormalFloat code values, stored (in the weight's dtype) with every quantized tensor."""
CHUNK_ELEMENTS = 2**22
"""Weights scaled and coded at a time by :func:`to_nf4` (8 MiB of bf16): its temporaries, whatever the weight."""


def nf4_layout(shape: Sequence[int]) -> tuple[int, int]:
    """The NF4 block sizes of a weight of ``shape``: ``(block_size, scaler_block_size)``.

    Args:
        shape: the weight's shape, e.g. ``(out, in)``.

    Returns:
        ``(64, s)`` with ``s`` the largest power of two <= 256 that divides the weight's block count.

    Raises:
        ValueError: the element count is not a multiple of 64 (the block size).
    """
    numel = math.prod(shape)
    if numel == 0 or numel % NF4_BLOCK_SIZE:
        raise ValueError(
            f"a weight of shape {tuple(shape)} ({numel} elements) cannot be stored in NF4: the element count must "
            f"be a positive multiple of the block size {NF4_BLOCK_SIZE}"
        )
    return NF4_BLOCK_SIZE, math.gcd(numel // NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)


def is_nf4(tensor: Tensor) -> bool:
    """Whether ``tensor`` (or a DTensor's local shard) is a torchao ``NF4Tensor``."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def nf4_module() -> Any:
    """torchao's ``nf4_tensor`` module (``NF4Tensor``, ``to_nf4``), imported quietly on first use."""
    with quiet_torchao_import():  # torchao takes seconds to import: only a QLoRA run pays for it
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def _is_fake(t: Tensor) -> bool:
    return t.is_meta or isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def to_nf4(weight: Tensor) -> Tensor:
    """Quantize a weight to NF4 with double-quantized scales, equal bit for bit to torchao's ``to_nf4`` of its rows
    flattened to 2-D (:func:`nf4_layout`'s blocks; the module doc says how it is faster).

    On the meta device (or a fake one) no value is computed: the result has the inner tensors' exact shapes and
    dtypes, empty.

    Args:
        weight: a floating tensor of any shape, real, meta or fake.

    Returns:
        An ``NF4Tensor`` of ``weight``'s shape, dtype and device; ``.to(dtype)`` dequantizes it.

    Raises:
        ValueError: as :func:`nf4_layout`.
    """
    nf4_layout(weight.shape)
    if _is_fake(weight):
        return empty_nf4(weight.shape, weight.dtype, weight.device)
    return quantize(weight)


def quantize(weight: Tensor) -> Tensor:
    """:func:`to_nf4` of a real weight (or a fake one under ``FakeTensorMode``, whose temporaries a tracker
    records: :func:`memfit.planner.phases.nf4_quantization_peak`)."""
    block, scaler_block = nf4_layout(weight.shape)
    nf4 = nf4_module()
    flat = weight.detach().reshape(-1)
    if weight.dtype.itemsize != 2:  # fp32: torchao's own path (its nearest-code search)
        rows = flat.view(-1, weight.shape[-1]) if weight.dim() > 1 else flat
        made = nf4.to_nf4(rows.contiguous(), block, scaler_block)
        return _with_shape(made, weight.shape) if weight.dim() > 2 else made
    builder = NF4Builder(weight.shape, weight.dtype, weight.device)
    builder.put(0, flat)
    return builder.finish()


def in_parts(dtype: torch.dtype, part_numel: int) -> bool:
    """Whether :class:`NF4Builder` can quantize a weight of ``dtype`` from parts of ``part_numel`` weights each (a
    16-bit dtype, and parts of whole blocks)."""
    return dtype.itemsize == 2 and part_numel > 0 and part_numel % NF4_BLOCK_SIZE == 0


class NF4Builder:
    """A 16-bit weight quantized to NF4 part by part as its parts arrive (a mixture of experts' stack, expert by
    expert as the files are read), so that the weight never exists whole in its dtype: the packed codes (half a byte
    a weight) and the block maxima are filled in place, and :meth:`finish` double-quantizes the maxima. The result
    equals :func:`to_nf4` of the whole weight bit for bit (every block is scaled and coded on its own, and the
    double quantization runs on the same maxima).

    Args:
        shape: the whole weight's shape, e.g. (E, 2I, C).
        dtype: a 16-bit dtype (bf16, fp16): the parts' and the result's.
        device: where the inner tensors go.

    Raises:
        ValueError: as :func:`nf4_layout`; a dtype that is not 16-bit (torchao's float32 path has no parts).
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> None:
        self.block, self.scaler_block = nf4_layout(shape)
        if dtype.itemsize != 2:
            raise ValueError(f"NF4Builder quantizes 16-bit weights in parts, not {dtype}")
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        numel = math.prod(shape)
        self.absmax = torch.empty(numel // self.block, dtype=dtype, device=device)  # (n_blocks,)
        self.codes = torch.empty(
            numel // 2, dtype=torch.uint8, device=device
        )  # (numel / 2,) two codes a byte

    def put(self, start: int, part: Tensor) -> None:
        """Quantize ``part`` into the weight's elements ``start .. start + part.numel() - 1`` (row-major).

        Args:
            start: a multiple of the block size (64).
            part: a tensor of whole blocks, in the builder's dtype and on its device.

        Raises:
            ValueError: ``start`` or the part's size not whole blocks, or another dtype.
        """
        block = self.block
        flat = part.detach().reshape(-1)
        if start % block or flat.numel() % block or part.dtype != self.dtype:
            raise ValueError(
                f"NF4Builder.put: a part of {flat.numel()} {part.dtype} weights at {start} is not whole blocks of "
                f"{block} {self.dtype} weights"
            )
        table = code_table(self.dtype, self.device)
        step = max(block, CHUNK_ELEMENTS // block * block)
        for offset in range(0, flat.numel(), step):
            chunk = flat[offset : offset + step]
            blocks = chunk.view(-1, block)  # (n, 64)
            first = start + offset
            scale = self.absmax[first // block : first // block + blocks.shape[0]]
            scale.copy_(blocks.abs().max(dim=1).values)  # torchao's block absmax
            scaled = blocks / scale.unsqueeze(-1)  # (n, 64) in the weight's dtype, as torchao divides
            bits = (
                scaled.view(-1).view(torch.uint16).to(torch.int32)
            )  # (n * 64,) each value's 16 bits, unsigned
            del scaled
            index = torch.index_select(table, 0, bits)  # (n * 64,) uint8 codes: one lookup a weight
            del bits
            out = self.codes[first // 2 : (first + chunk.numel()) // 2]
            torch.bitwise_or(index[::2] << 4, index[1::2], out=out)
            del index

    def finish(self) -> Tensor:
        """The ``NF4Tensor`` once every part is in (the maxima double-quantized; the builder is spent)."""
        made = _assemble(
            self.shape, self.dtype, self.device, self.absmax, self.codes, self.block, self.scaler_block
        )
        del self.absmax, self.codes
        return made


def _assemble(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    absmax: Tensor,
    codes: Tensor,
    block: int,
    scaler_block: int,
) -> Tensor:
    """The ``NF4Tensor`` of a weight of ``shape`` and ``dtype`` from its block maxima and packed codes: torchao's
    double quantization of the scales (``double_quantize_scalers``, on the same maxima)."""
    nf4 = nf4_module()
    mean = absmax.mean()
    centred = absmax - mean
    groups = centred.numel() // scaler_block
    group_blocks = centred.view(groups, scaler_block)
    scaler_absmax = centred.view(groups, scaler_block).abs().max(dim=1).values
    factor = 256 / (2 * scaler_absmax.unsqueeze(-1).expand(groups, scaler_block))
    quantized = (group_blocks * factor).round().clamp(-128, 127)
    factor = factor[:, 0]
    meta = nf4.SubclassTensorArgs(
        torch.Size(shape), torch.empty(shape, device="meta").stride(), 0, dtype, device, False
    )
    return nf4.NF4Tensor(
        meta,
        block,
        absmax.numel(),
        scaler_block,
        quantized.flatten().to(torch.int8),
        factor.view(groups).contiguous(),
        mean,
        codes,
        nf4=_codes(dtype, device),
    )


def _with_shape(made: Tensor, shape: Sequence[int]) -> Tensor:
    """The ``NF4Tensor`` ``made`` (of a weight's rows flattened to 2-D) as a tensor of ``shape``: the same inner
    tensors under another shape (its dequantization reshapes to it)."""
    nf4 = nf4_module()
    meta = nf4.SubclassTensorArgs(
        torch.Size(shape), torch.empty(shape, device="meta").stride(), 0, made.dtype, made.device, False
    )
    return nf4.NF4Tensor(
        meta,
        made.block_size,
        made.n_blocks,
        made.scaler_block_size,
        made.quantized_scalers,
        made.quantization_factor,
        made.scaler_mean,
        made.quantized_data,
        nf4=made.nf4,
    )


def _codes(dtype: torch.dtype, device: torch.device) -> Tensor:
    """The 16 NormalFloat values in ``dtype``, as torchao's ``from_tensor`` makes them."""
    values = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
              0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0]  # fmt: skip
    return torch.tensor(values, device=device, dtype=dtype)


@functools.lru_cache(maxsize=8)
def _on_device(table: Tensor, device: torch.device) -> Tensor:
    return table.to(device)


@functools.lru_cache(maxsize=8)
def _code_table_cpu(dtype: torch.dtype) -> Tensor:
    # made outside any mode (a fake-tensor estimate, a memory tracker): a real table, cached, counted by none
    with torch.utils._python_dispatch._disable_current_modes():
        every = (
            torch.arange(2**16, dtype=torch.int32).to(torch.uint16).view(dtype)
        )  # every bit pattern, in order
        nearest = nf4_module().NF4Tensor.quantize_tensor_nearest(every, _codes(dtype, torch.device("cpu")))
        return nearest.to(torch.uint8)


def code_table_bytes(dtype: torch.dtype) -> int:
    """Bytes of :func:`to_nf4`'s code table for weights of ``dtype``: 65,536 for a 16-bit dtype, 0 for float32
    (torchao's search, no table)."""
    return 2**16 if dtype.itemsize == 2 else 0


def code_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """(65,536,) uint8: the NF4 code torchao's ``quantize_tensor_nearest`` gives each 16-bit value of ``dtype``,
    indexed by the value's bits as an unsigned int (64 KiB, made once per dtype and device, outside any mode)."""
    table = _code_table_cpu(dtype)
    if torch.device(device).type == "cpu":
        return table
    with torch.utils._python_dispatch._disable_current_modes():
        return _on_device(table, torch.device(device))


def empty_nf4(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """An ``NF4Tensor`` with uninitialised inner tensors of exactly the shapes :func:`to_nf4` gives ``shape``.

    For the meta device and for the estimator's fake tensors (inside a ``FakeTensorMode`` they are fake).

    Args:
        shape: the weight's shape, e.g. ``(out, in)``.
        dtype: the dtype it dequantizes to (that of the scales of the scales, their mean and the code table).
        device: where the inner tensors go.

    Returns:
        An ``NF4Tensor`` whose inner tensors hold exactly :func:`memfit.models.peft.nf4_bytes` bytes.

    Raises:
        ValueError: as :func:`nf4_layout`.
    """
    block, scaler_block = nf4_layout(shape)
    nf4 = nf4_module()
    numel = math.prod(shape)
    n_blocks = numel // block
    groups = n_blocks // scaler_block
    # one group: torchao's scale of the scales is a view of scaler_block elements (see nf4_bytes)
    factor = torch.empty(scaler_block if groups == 1 else groups, dtype=dtype, device=device)[:groups]
    meta = nf4.SubclassTensorArgs(
        torch.Size(shape), torch.empty(shape, device="meta").stride(), 0, dtype, torch.device(device), False
    )
    return nf4.NF4Tensor(
        meta,
        block,
        n_blocks,
        scaler_block,
        torch.empty(n_blocks, dtype=torch.int8, device=device),  # quantized_scalers
        factor,  # quantization_factor
        torch.empty((), dtype=dtype, device=device),  # scaler_mean
        torch.empty(numel // 2, dtype=torch.uint8, device=device),  # quantized_data
        torch.empty(NF4_LUT_SIZE, dtype=dtype, device=device),  # nf4 code table
    )


def nf4_rows(weight: Tensor, index: int) -> Tensor:
    """``weight[index]`` of an NF4 weight, dequantized alone: bit-identical to ``weight.get_original_weight()[index]``
    (the same elementwise operations on the slice of codes and scales it owns).

    Args:
        weight: an ``NF4Tensor`` of shape (E, m, n) (or (rows, n) for one row, ``index`` a row).
        index: which slice of dim 0.

    Returns:
        (m, n) (or (n,)) in ``weight``'s dtype, a new tensor.
    """
    per = math.prod(weight.shape[1:])
    start, block = index * per, weight.block_size
    b0, nb = start // block, per // block
    codes = weight.quantized_data[start // 2 : (start + per) // 2]
    groups = torch.arange(b0, b0 + nb, device=codes.device) // weight.scaler_block_size
    scalers = (weight.quantized_scalers[b0 : b0 + nb] / weight.quantization_factor[groups]).to(
        weight.dtype
    ) + weight.scaler_mean  # (nb,): torchao's dequantize_scalers, block by block
    values = torch.index_select(
        _pair_table(weight.nf4), 0, codes.to(torch.int32)
    )  # (per / 2,) both codes' values
    values = values.view(weight.dtype).view(
        nb, block
    )  # (nb, 64): torchao's order (each byte's first, then second)
    return values.mul_(scalers.unsqueeze(-1)).view(weight.shape[1:])  # each value times its block's scale


def _pair_table(nf4: Tensor) -> Tensor:
    """(256,) words: for each byte of two codes, the two code values (the high nibble's first) as one word to gather
    (32-bit for a 16-bit ``nf4``, 64-bit for float32)."""
    pairs = torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], dim=1).contiguous()  # (256, 2)
    word = {2: torch.int32, 4: torch.int64}[nf4.element_size()]
    return pairs.view(word).view(-1)
