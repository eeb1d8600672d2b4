"""Loops over tiles of the tokens, and how the estimator's trace runs them.

Long-sequence work is tiled along the tokens (attention's query blocks, RMSNorm's rows, the tiled MLP, the chunked
loss): each tile allocates what the one before it freed. Under ``FakeTensorMode`` (the estimator's trace, which
computes no value and only follows allocations) a loop runs its first and last tile only (:func:`representative`):
the tiles between them allocate and free exactly what the first does (or, for attention's query blocks, whose keys
grow, something between the first's and the last's), so the trace's peak is the same, in a fraction of the time:
at 512K tokens, Llama-3-8B's step is some 30,000 tiles.
"""

from __future__ import annotations

from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor


def representative(count: int, like: Tensor) -> list[int]:
    """The indices of the tiles a loop over ``count`` tiles runs: all of them, or, when ``like`` is a fake tensor,
    the first and the last.

    Args:
        count: tiles in the loop.
        like: a tensor the loop reads (fake in the estimator's trace).

    Returns:
        Increasing tile indices.
    """
    if count > 2 and isinstance(like, FakeTensor):
        return [0, count - 1]
    return list(range(count))
