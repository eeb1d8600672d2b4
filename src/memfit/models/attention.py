"""Causal attention within documents, without a ``(T, T)`` tensor: what a row that packs several documents needs.

A row of ``T`` tokens that packs several documents (packed fine-tuning samples, or a pretraining window read with
``data.cross_document_attention: false``) attends causally *within* each document. A dense ``(B, 1, T, T)`` mask
says that in T^2 bytes (16 GiB at 128K tokens), and an explicit mask also moves CUDA's SDPA off its flash kernel and
makes it expand grouped keys and values to every head. :func:`document_attention` computes the same attention in
blocks of queries instead (the blocking of FlashAttention, Dao et al. 2022, one level up): the queries ``[s, e)``
attend over the keys ``[0, e)`` (no later key can be visible to them) under an additive mask of ``(B, 1, e - s,
e)`` built from the document ids of those rows, which exists for one block at a time. Memory is linear in ``T``: the
mask of one block (:func:`query_block` bounds it to :data:`BLOCK_MASK_ELEMENTS`), the output and its per-row
log-sum-exp. Work is the causal half of the square, as with ``is_causal``.

Two kernels run the blocks, the same arithmetic either way:

- **with the log-sum-exp** (CPU): ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, the fused
  kernels SDPA itself runs on CPU, take the block's mask and read grouped keys and values in place (``nkv < nh``).
  The forward keeps the output and its log-sum-exp ``(B, nh, T)``, so the backward recomputes nothing.
- **recomputed** (CUDA, and every other device): each block runs ``F.scaled_dot_product_attention`` (on CUDA the
  memory-efficient kernel, which takes a mask), without a graph in the forward; the backward runs each block again
  with one and takes its gradients. Keys and values are expanded to every head one block at a time (the
  memory-efficient kernel reads no grouped heads). It costs one more forward of the attention, and keeps nothing
  but the inputs.

A sliding window of W keys (Mistral v0.1's ``sliding_window``) uses the same blocks, with or without documents:
the queries ``[s, e)`` read only the keys ``[max(0, s - W + 1), e)`` (:func:`window_start`), under a mask that also
hides the keys more than ``W - 1`` before each query. A block then reads at most ``Bq + W - 1`` keys whatever ``T``
is, and the work is ``T * W`` rather than the causal half of the square.

Gemma 2's soft-capped scores (``cap * tanh(scores / cap)`` before the mask) have no SDPA kernel:
:func:`softcapped_attention` computes each block's scores explicitly, capped, masked and soft-maxed in fp32, and
recomputes them in the backward, so memory stays linear in ``T`` there too.

The step runs under ``FakeTensorMode`` (no data-dependent Python branching: blocks are a function of shapes only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from memfit.models.tiles import representative

BLOCK_MASK_ELEMENTS = 2**24
"""The most elements of one block's additive mask ``(B, 1, Bq, T)`` (64 MiB in fp32) that :func:`query_block`
allows, down to :data:`MIN_QUERY_BLOCK` queries a block."""
MIN_QUERY_BLOCK = 128
MAX_QUERY_BLOCK = 1024
"""Queries per block at most: larger blocks run the fused kernels with fewer calls, but the mask of a block grows
with them."""


def query_block(batch: int, seq_len: int) -> int:
    """Queries per block of :func:`document_attention`: the largest power of two in ``[128, 1024]`` whose mask
    ``(batch, 1, block, seq_len)`` has at most :data:`BLOCK_MASK_ELEMENTS` elements (128 when none does), and never
    more than ``seq_len``.

    Args:
        batch: rows B.
        seq_len: tokens per row T.

    Returns:
        Bq, a function of the shapes only (the same on every rank and under fake tensors).
    """
    block = MAX_QUERY_BLOCK
    while block > MIN_QUERY_BLOCK and batch * block * seq_len > BLOCK_MASK_ELEMENTS:
        block //= 2
    return min(block, seq_len)


def window_start(start: int, window: int | None) -> int:
    """The first key that the queries from ``start`` on can see: 0, or ``max(0, start - window + 1)`` with a
    sliding window of ``window`` keys."""
    return 0 if window is None else max(0, start - window + 1)


def block_mask(
    doc_ids: Tensor | None,
    start: int,
    end: int,
    dtype: torch.dtype,
    window: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """The additive mask of the queries ``[start, end)`` over the keys ``[window_start(start, window), end)``.

    Args:
        doc_ids: (B, T) int; tokens of one document share an id. None: one document a row (a window alone).
        start: first query of the block.
        end: one past its last query (and one past the last key it sees).
        dtype: the queries' dtype (the kernels add the mask to scores of that dtype).
        window: None, or W: query t sees only the keys ``(t - W, t]``.
        device: where to build it when ``doc_ids`` is None.

    Returns:
        (B, 1, end - start, end - k0), or (1, 1, end - start, end - k0) without ``doc_ids``, where k0 is
        :func:`window_start`: 0 where query t may attend to key s (``s <= t``, the same document, and
        ``s > t - W``), -inf elsewhere. Every query sees at least itself, so no row is all -inf.
    """
    device = doc_ids.device if doc_ids is not None else device
    k0 = window_start(start, window)
    queries = torch.arange(start, end, device=device)  # (Bq,)
    keys = torch.arange(k0, end, device=device)  # (Tk,)
    allowed = keys[None, :] <= queries[:, None]  # (Bq, Tk)
    if window is not None:
        allowed = allowed & (keys[None, :] > queries[:, None] - window)  # (Bq, Tk)
    if doc_ids is not None:
        allowed = (doc_ids[:, start:end, None] == doc_ids[:, None, k0:end]) & allowed  # (B, Bq, Tk)
    else:
        allowed = allowed[None]  # (1, Bq, Tk)
    allowed = allowed[:, None]  # (B or 1, 1, Bq, Tk)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf)


def _blocks(q: Tensor) -> list[tuple[int, int]]:
    """The query blocks ``[s, e)`` of ``q`` (B, nh, T, hd) that a loop runs
    (:func:`memfit.models.tiles.representative`)."""
    B, _, T, _ = q.shape
    size = query_block(B, T)
    blocks = [(s, min(T, s + size)) for s in range(0, T, size)]
    return [blocks[i] for i in representative(len(blocks), q)]


class _WithLogSumExp(torch.autograd.Function):
    """Blocks through the CPU flash kernels, keeping each block's output and log-sum-exp for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, window, scale=None):  # noqa: D102 (autograd's signature)
        B, nh, T, hd = q.shape
        aten = torch.ops.aten
        # (B, T, nh, hd) memory viewed as (B, nh, T, hd): the caller's transpose back to (B, T, C) is then a view
        out = q.new_empty(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        lse = q.new_empty(B, nh, T, dtype=torch.float32)  # (B, nh, T)
        for s, e in _blocks(q):
            k0 = window_start(s, window)
            o, m = aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, s:e],
                k[:, :, k0:e],
                v[:, :, k0:e],
                0.0,
                False,
                attn_mask=block_mask(doc_ids, s, e, q.dtype, window, q.device),
                scale=scale,
            )  # (B, nh, Bq, hd), (B, nh, Bq)
            out[:, :, s:e] = o
            lse[:, :, s:e] = m
        ctx.save_for_backward(q, k, v, doc_ids, out, lse)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, doc_ids, out, lse = ctx.saved_tensors
        window, scale = ctx.window, ctx.scale
        B, nh, T, hd = q.shape
        aten = torch.ops.aten
        grad_out = grad_out.contiguous()
        dq = torch.empty_like(q)  # (B, nh, T, hd)
        # keys and values get a part from every block that sees them: summed in fp32 (the kernels' own precision)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # (B, nkv, T, hd)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)  # (B, nkv, T, hd)
        for s, e in _blocks(q):
            k0 = window_start(s, window)
            gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out[:, :, s:e],
                q[:, :, s:e],
                k[:, :, k0:e],
                v[:, :, k0:e],
                out[:, :, s:e],
                lse[:, :, s:e],
                0.0,
                False,
                attn_mask=block_mask(doc_ids, s, e, q.dtype, window, q.device),
                scale=scale,
            )  # (B, nh, Bq, hd), (B, nkv, e - k0, hd) x 2
            dq[:, :, s:e] = gq
            dk[:, :, k0:e] += gk
            dv[:, :, k0:e] += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _sdpa_block(
    qb: Tensor,
    kb: Tensor,
    vb: Tensor,
    doc_ids: Tensor | None,
    s: int,
    e: int,
    window: int | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The queries ``[s, e)`` over the keys ``[k0, e)`` (k0: :func:`window_start`) through
    ``F.scaled_dot_product_attention`` (looked up at call time), keys and values expanded to every head for this
    block.

    Args:
        qb: (B, nh, e - s, hd) the block's queries.
        kb: (B, nkv, e - k0, hd) the keys it sees.
        vb: (B, nkv, e - k0, hd) their values.
        doc_ids: (B, T) the row's document ids, or None.
        s: the block's first query.
        e: one past its last.
        window: None, or the sliding window W.
        scale: the scores' factor, None for ``hd ** -0.5``.
        softcap: None, or the cap of the scores (Gemma 2): ``softmax(cap * tanh(q k^T scale / cap) + mask) v``
            computed explicitly (transformers' eager attention: the softmax in fp32, cast to the queries' dtype),
            on the block's ``(B, nh, e - s, e - k0)`` scores.

    Returns:
        (B, nh, e - s, hd).
    """
    B, nh, _, hd = qb.shape
    nkv, tk = kb.shape[1], kb.shape[2]
    if nkv != nh:
        kb = kb[:, :, None].expand(B, nkv, nh // nkv, tk, hd).reshape(B, nh, tk, hd)  # (B, nh, Tk, hd)
        vb = vb[:, :, None].expand(B, nkv, nh // nkv, tk, hd).reshape(B, nh, tk, hd)  # (B, nh, Tk, hd)
    mask = block_mask(doc_ids, s, e, qb.dtype, window, qb.device)
    if softcap is None:
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
    scores = (qb @ kb.transpose(2, 3)) * (hd**-0.5 if scale is None else scale)  # (B, nh, Bq, Tk)
    scores = torch.tanh(scores / softcap) * softcap + mask  # capped, then masked (transformers' order)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qb.dtype)  # (B, nh, Bq, Tk)
    return weights @ vb  # (B, nh, Bq, hd)


class _Recomputed(torch.autograd.Function):
    """Blocks through the public SDPA; the backward runs each block again with a graph."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, window, scale=None, softcap=None):  # noqa: D102
        B, nh, T, hd = q.shape
        out = q.new_empty(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        for s, e in _blocks(q):
            k0 = window_start(s, window)
            out[:, :, s:e] = _sdpa_block(
                q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e], doc_ids, s, e, window, scale, softcap
            )
        ctx.save_for_backward(q, k, v, doc_ids)
        ctx.window, ctx.scale, ctx.softcap = window, scale, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, doc_ids = ctx.saved_tensors
        window, scale, softcap = ctx.window, ctx.scale, ctx.softcap
        B, nh, T, hd = q.shape
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for s, e in _blocks(q):
            k0 = window_start(s, window)
            qb = q[:, :, s:e].detach().requires_grad_()
            kb = k[:, :, k0:e].detach().requires_grad_()
            vb = v[:, :, k0:e].detach().requires_grad_()
            with torch.enable_grad():
                o = _sdpa_block(qb, kb, vb, doc_ids, s, e, window, scale, softcap)  # (B, nh, Bq, hd)
            gq, gk, gv = torch.autograd.grad(o, (qb, kb, vb), grad_out[:, :, s:e])
            dq[:, :, s:e] = gq
            dk[:, :, k0:e] += gk
            dv[:, :, k0:e] += gv
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor | None,
    *,
    recompute: bool | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Causal attention restricted to each document of a packed row and/or to a sliding window, in blocks of
    queries (see the module doc).

    Args:
        q: (B, nh, T, hd) queries.
        k: (B, nkv, T, hd) keys; nkv divides nh (grouped-query attention).
        v: (B, nkv, T, hd) values.
        doc_ids: (B, T) int; tokens of one document share an id and are contiguous. None: one document a row
            (with a ``window``).
        recompute: True runs the blocks through ``F.scaled_dot_product_attention`` and recomputes them in the
            backward; False through the CPU flash kernels with their log-sum-exp (CPU tensors only). None: False
            on CPU, True elsewhere.
        window: None, or W: query t attends to the keys ``(t - W, t]`` only (of its document).
        scale: the scores' factor; None is ``hd ** -0.5``.

    Returns:
        (B, nh, T, hd), laid out as (B, T, nh, hd) in memory (``transpose(1, 2)`` of it is contiguous). Equal to
        ``F.scaled_dot_product_attention`` with the dense block-diagonal (and banded) causal mask, within float
        rounding.

    Raises:
        ValueError: both ``doc_ids`` and ``window`` are None (plain causal attention needs no blocks), or
            ``window`` is not a positive int.
    """
    if doc_ids is None and window is None:
        raise ValueError("document_attention needs doc_ids or a window; plain causal attention is SDPA's own")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ValueError(f"document_attention's window must be a positive int, got {window!r}")
    if recompute is None:
        recompute = q.device.type != "cpu"
    if torch.is_autocast_enabled(
        q.device.type
    ):  # as autocast casts SDPA's inputs (bf16_mixed: RoPE'd q, k fp32)
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return (_Recomputed if recompute else _WithLogSumExp).apply(q, k, v, doc_ids, window, scale)


def softcapped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor | None,
    *,
    window: int | None = None,
    scale: float | None = None,
    softcap: float,
) -> Tensor:
    """Causal attention with soft-capped scores (Gemma 2's ``attn_logit_softcapping``), in blocks of queries.

    No SDPA kernel caps the scores, so each block's ``(B, nh, Bq, Tk)`` scores are computed explicitly, capped to
    ``cap * tanh(scores / cap)``, masked (causal, the block's documents, the window) and soft-maxed in fp32
    (:func:`_sdpa_block`). The forward keeps no block's scores; the backward runs each block again with a graph
    (:class:`_Recomputed`), so memory stays linear in T: one block's scores at a time, never a (T, T) tensor.

    Args:
        q: (B, nh, T, hd) queries.
        k: (B, nkv, T, hd) keys; nkv divides nh.
        v: (B, nkv, T, hd) values.
        doc_ids: None (one document a row), or (B, T) ids of packed documents.
        window: None, or W: query t attends to the keys ``(t - W, t]`` only.
        scale: the scores' factor before the cap; None is ``hd ** -0.5``.
        softcap: the cap, a positive number.

    Returns:
        (B, nh, T, hd), laid out as (B, T, nh, hd) in memory.

    Raises:
        ValueError: ``softcap`` is not a positive number.
    """
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0:
        raise ValueError(f"softcapped_attention's softcap must be a positive number, got {softcap!r}")
    if torch.is_autocast_enabled(q.device.type):  # the matmuls in autocast's dtype, as SDPA's would be
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return _Recomputed.apply(q, k, v, doc_ids, window, scale, float(softcap))
