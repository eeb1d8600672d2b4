"""How bf16 weights take an update: computed in fp32, then rounded back by a declared rule (``bf16_rounding``).

A bf16 weight has 8 bits of mantissa. An update smaller than half a unit in the last place of the weight (about
2**-9 of it) is cancelled by round-to-nearest, so late in training, when updates are small, bf16 weights stop
learning ("Revisiting BFloat16 Training", Zamirai et al. 2020, arXiv 2010.06192). Its two remedies, and today's:

=============  =====================================================================================================
``nearest``    the optimizer updates the bf16 tensor as it always has (its arithmetic in bf16, or in fp32 inside
               bitsandbytes' and torchao's kernels), each result rounded to the nearest bf16.
``stochastic`` the update is computed on an fp32 copy of the weight; the result is rounded up or down at random,
               up with probability (distance to the lower bf16) / (gap between the two): its expected value is the
               fp32 result, so small updates survive on average. The random bits come from torch's global
               generator, which ``build`` seeds with the run's ``seed`` and every checkpoint saves and restores:
               a resumed run draws the same bits.
``kahan``      the update is computed on the weight plus a bf16 compensation buffer that holds what the last
               rounding lost (Kahan summation: about 16 bits of mantissa between the two), then rounded to nearest,
               and the new loss kept: 2 bytes more state per weight.
=============  =====================================================================================================

The fp32 copies are temporaries of one chunk (:data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS` elements)
where the optimizer's update is elementwise (AdamW, bitsandbytes', torchao's, and memfit's chunked Adafactor), and
of the whole tensor (a sharded run: its local shard) where the update needs the whole matrix (Muon, APOLLO,
Adam-mini). They are ordinary tensor allocations, so the memory tracker and the estimator (the step on fake tensors)
see them exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

BF16_ROUNDINGS = ("auto", "nearest", "stochastic", "kahan")
"""``bf16_rounding`` values; ``auto`` is ``stochastic`` where the optimizer can round so, else ``nearest``
(:func:`memfit.memory.optimizers.resolve_rounding`)."""
COMPENSATION = "bf16_compensation"
"""The key of a weight's Kahan compensation buffer in its optimizer state (bf16, the weight's shape)."""

_LOW_BITS = 1 << 16  # the fp32 mantissa bits a bf16 drops
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as an int32


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Round ``src`` (fp32) into ``dst`` (bf16) stochastically: up (away from zero) with probability equal to the
    dropped 16 low bits of its fp32 encoding over 2**16, else down; the expected value is ``src`` exactly.

    A uniform random integer in ``[0, 2**16)`` is added to the fp32 bits and the low 16 bits cleared; the result is
    a bf16 value held in fp32, copied exactly. Infinities stay; NaN stays NaN. Temporaries: one int32 tensor of
    ``src``'s size. Draws from torch's global generator on ``src``'s device.

    Args:
        dst: bf16 tensor of ``src``'s shape, written in place.
        src: fp32 tensor, contiguous; left unchanged.

    Returns:
        ``dst``.
    """
    noise = torch.randint_like(src, _LOW_BITS, dtype=torch.int32)
    noise.add_(src.view(torch.int32)).bitwise_and_(_HIGH_MASK)
    dst.copy_(noise.view(torch.float32))
    return dst


def to_fp32(p: torch.Tensor, compensation: torch.Tensor | None) -> torch.Tensor:
    """An fp32 copy of the bf16 weight ``p`` (a chunk of it), plus its Kahan ``compensation`` when given: the
    tensor the optimizer updates."""
    p32 = p.float()
    if compensation is not None:
        p32.add_(compensation)
    return p32


def round_into(p: torch.Tensor, p32: torch.Tensor, rounding: str, compensation: torch.Tensor | None) -> None:
    """Write the updated fp32 weight ``p32`` back into the bf16 ``p`` by ``rounding``.

    Args:
        p: the bf16 weight (or a chunk of it), written in place.
        p32: its updated fp32 value, contiguous (overwritten for ``kahan``).
        rounding: ``nearest``, ``stochastic`` or ``kahan``.
        compensation: ``kahan``: the bf16 buffer of ``p``'s shape, set to what this rounding loses.
    """
    if rounding == "stochastic":
        stochastic_round_(p, p32)
        return
    p.copy_(p32)
    if rounding == "kahan" and compensation is not None:
        compensation.copy_(p32.sub_(p))


@contextmanager
def rounded(
    p: torch.Tensor, rounding: str, compensation: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """The fp32 tensor an update of the bf16 weight ``p`` (a chunk of it) is computed on, rounded back by
    ``rounding`` when the block exits; ``p`` itself for ``nearest`` or a weight that is not bf16.

    Args:
        p: the weight, or a chunk of it (a view: written in place).
        rounding: ``bf16_rounding``.
        compensation: ``kahan``: ``p``'s compensation buffer (the same chunk of it).

    Yields:
        The tensor to update in place.
    """
    if rounding == "nearest" or p.dtype != torch.bfloat16:
        yield p
        return
    p32 = to_fp32(p, compensation if rounding == "kahan" else None)
    yield p32
    round_into(p, p32, rounding, compensation)


def compensation_of(state: dict, p: torch.Tensor, rounding: str) -> torch.Tensor | None:
    """``p``'s Kahan compensation buffer in its optimizer ``state``, created as zeros (bf16, ``p``'s shape) where
    missing; ``None`` unless ``rounding`` is ``kahan`` and ``p`` is bf16."""
    if rounding != "kahan" or p.dtype != torch.bfloat16:
        return None
    comp = state.get(COMPENSATION)
    if comp is None:
        comp = state[COMPENSATION] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    return comp


def compensation_bytes(rounding: str, numel: int, element_size: int) -> int:
    """Bytes of Kahan state for a trainable tensor of ``numel`` elements of ``element_size`` bytes: its bf16
    compensation buffer under ``kahan`` (bf16 weights only), else 0. The closed form of the state adds it."""
    return 2 * numel if rounding == "kahan" and element_size == 2 else 0


__all__ = [
    "BF16_ROUNDINGS",
    "COMPENSATION",
    "compensation_bytes",
    "compensation_of",
    "round_into",
    "rounded",
    "stochastic_round_",
    "to_fp32",
]
