"""Sequence parallelism (``distributed.sequence_parallel: N``): DeepSpeed-Ulysses attention over a group of ranks.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509; the core of Arctic Long Sequence Training, arXiv
2506.13996): the N ranks of a sequence-parallel group share one batch of sequences, each holding ``T / N``
consecutive tokens of it. Everything but attention works per token (embedding, RMSNorm, MLP, tiled MLP, the
chunked loss) and runs on the rank's shard. Attention needs the whole sequence, so around it an all-to-all turns
the shard's ``(B, nh, T / N, hd)`` queries, keys and values into whole sequences of ``nh / N`` heads,
``(B, nh / N, T, hd)``; each rank attends over all ``T`` tokens for its heads (causal and packed-document masks
and a sliding window unchanged) and the inverse all-to-all gives back ``(B, nh, T / N, hd)``. Key/value heads are
split over the group when ``num_kv_heads`` is a multiple of N, else each is repeated ``N / num_kv_heads`` times
first (the heads of one group of queries then sit on one rank), as DeepSpeed does.

Each rank sends and receives, per layer and forward, ``(N - 1) / N`` of its ``q, k, v`` and attention output
shards (:func:`memfit.memory.switches.all_to_all_elements`). The collective is torch's functional
``all_to_all_single`` (autograd: the backward is the inverse exchange), so the layer runs under ``torch.compile``,
activation checkpointing (the recomputation exchanges again, on every rank in the same order) and fake tensors
(the estimator).

The batch side (:func:`shard_batch`): every rank of a group draws the same sequences and keeps its slice of the
inputs and targets; RoPE positions and document ids stay global (each rank gets the positions of its tokens and
the whole row's document ids for the attention mask), so the group computes exactly what one process computes on
the whole sequences.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from memfit.memory.switches import kv_heads_sent
from memfit.memory.techniques import IGNORE_INDEX
from memfit.models.decoder import Attention, packed_positions


def _heads_to_sequence(x: Tensor, size: int, group) -> Tensor:
    """``(B, n, T / N, hd)`` of a rank's tokens to ``(B, n / N, T, hd)``: all tokens of its share of the heads."""
    B, n, t, hd = x.shape
    send = (
        x.reshape(B, size, n // size, t, hd).transpose(0, 1).contiguous()
    )  # (N, B, n/N, T/N, hd): to rank j
    got = funcol.all_to_all_single_autograd(send, None, None, group)  # (N, B, n/N, T/N, hd): from rank j
    got = funcol.wait_tensor(got)
    return got.permute(1, 2, 0, 3, 4).reshape(B, n // size, size * t, hd)  # (B, n/N, T, hd)


def _sequence_to_heads(y: Tensor, size: int, group) -> Tensor:
    """The inverse of :func:`_heads_to_sequence`: ``(B, n / N, T, hd)`` to ``(B, n, T / N, hd)``."""
    B, m, T, hd = y.shape
    t = T // size
    send = y.reshape(B, m, size, t, hd).permute(2, 0, 1, 3, 4).contiguous()  # (N, B, n/N, T/N, hd): to rank j
    got = funcol.all_to_all_single_autograd(send, None, None, group)  # (N, B, n/N, T/N, hd): heads of rank j
    got = funcol.wait_tensor(got)
    return got.transpose(0, 1).reshape(B, size * m, t, hd)  # (B, n, T/N, hd)


class UlyssesAttention(Attention):
    """:class:`~memfit.models.decoder.Attention` over a sequence shard, exchanging heads for tokens around the core
    (see the module doc). Made by :func:`apply_sequence_parallel` (a class swap: parameters and names unchanged);
    ``memfit_sp_group`` and ``memfit_sp_size`` are set there."""

    memfit_sp_group = None
    memfit_sp_size = 1

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """Attend causally over the group's whole sequences.

        Args:
            x: (B, T / N, C) normed hidden states of this rank's tokens.
            cos: (T / N, hd) or (B, 1, T / N, hd) RoPE table of this rank's positions.
            sin: same shape as ``cos``.
            doc_ids: None (causal), or (B, T) ids of the packed documents of the whole rows.

        Returns:
            (B, T / N, C).
        """
        B, t, _ = x.shape
        size, group = self.memfit_sp_size, self.memfit_sp_group
        q, k, v = self.project_qkv(x, cos, sin)  # (B, nh, T/N, hd), (B, nkv, T/N, hd) x 2
        if self.num_kv_heads % size:  # fewer kv heads than ranks: each repeated to fill the group
            k = k.repeat_interleave(size // self.num_kv_heads, dim=1)  # (B, N, T/N, hd)
            v = v.repeat_interleave(size // self.num_kv_heads, dim=1)
        q, k, v = (_heads_to_sequence(h, size, group) for h in (q, k, v))  # (B, heads/N, T, hd)
        y = self.attend(
            q, k, v, doc_ids
        )  # (B, nh/N, T, hd): decoder.causal_attention with the layer's options
        y = _sequence_to_heads(y, size, group)  # (B, nh, T/N, hd)
        y = y.transpose(1, 2).reshape(B, t, self.num_heads * self.head_dim)  # (B, T/N, nh * hd)
        return self.o_proj(y)  # (B, T/N, C)


def apply_sequence_parallel(model: nn.Module, group, size: int) -> int:
    """Make every decoder layer's attention a :class:`UlyssesAttention` over ``group``.

    Apply before activation checkpointing, compile and sharding (they take the layer as it then is).

    Args:
        model: a :class:`memfit.models.decoder.Llama`.
        group: the process group of this rank's sequence-parallel group (``size`` ranks).
        size: N; 1 leaves the model as it is.

    Returns:
        The number of attention modules changed.

    Raises:
        ValueError: ``num_heads`` not divisible by ``size``, or ``num_kv_heads`` and ``size`` dividing neither way.
    """
    if size == 1:
        return 0
    layers = model.model.layers
    for layer in layers:
        attn = layer.self_attn
        if attn.num_heads % size:
            raise ValueError(f"num_heads {attn.num_heads} is not divisible by sequence_parallel {size}")
        kv_heads_sent(attn.num_kv_heads, size)
        attn.__class__ = UlyssesAttention
        attn.memfit_sp_group, attn.memfit_sp_size = group, size
    return len(layers)


def pad_batch(batch: tuple[Tensor | None, ...], size: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """A micro-batch whose rows are padded at the end to a multiple of ``size`` tokens: input id 0, target ``-100``
    (they count nowhere), a document of their own. Causal attention keeps padding at the end from changing any
    earlier token. What a group that splits the sequence needs (Ulysses here, tensor parallelism's sequence split).

    Args:
        batch: ``(inputs, targets)`` or ``(inputs, targets, doc_ids)``, each (B, T) int64 (``doc_ids`` may be
            None).
        size: the multiple.

    Returns:
        ``(inputs, targets, doc_ids)``, (B, T') with T' the least multiple of ``size`` >= T (the tensors themselves
        when T is one).
    """
    inputs, targets, *rest = batch
    doc_ids = rest[0] if rest else None
    B, T = inputs.shape
    pad = -T % size
    if pad:
        inputs = torch.cat([inputs, inputs.new_zeros(B, pad)], dim=1)
        targets = torch.cat([targets, targets.new_full((B, pad), IGNORE_INDEX)], dim=1)
        if doc_ids is not None:
            doc_ids = torch.cat([doc_ids, (doc_ids.amax(dim=1, keepdim=True) + 1).expand(B, pad)], dim=1)
    return inputs, targets, doc_ids


def shard_batch(
    batch: tuple[Tensor | None, ...], rank: int, size: int
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """This rank's slice of a sequence-parallel group's micro-batch.

    Rows whose length is not a multiple of ``size`` (instruction batches are as long as their longest sample) are
    padded at the end first: input id 0, target ``-100`` (they count nowhere), a document of their own. Causal
    attention keeps padding at the end from changing any earlier token, so the group's loss is that of the
    unpadded rows.

    Args:
        batch: ``(inputs, targets)`` or ``(inputs, targets, doc_ids)``, each (B, T) int64 (``doc_ids`` may be
            None).
        rank: this rank's place in its group, ``0 .. size - 1``.
        size: N, ranks of the group.

    Returns:
        ``(inputs, targets, doc_ids, positions)``: (B, T' / N) inputs and targets of tokens
        ``[rank * T' / N, (rank + 1) * T' / N)``, the whole rows' (B, T') ``doc_ids`` (or None) and the tokens'
        positions, (T' / N,) int64, or (B, T' / N) restarting at each packed document; T' is T padded to a multiple
        of N.
    """
    inputs, targets, doc_ids = pad_batch(batch, size)
    T = inputs.shape[1]
    t = T // size
    lo, hi = rank * t, (rank + 1) * t
    if doc_ids is None:
        positions = torch.arange(lo, hi, device=inputs.device)  # (T/N,)
    else:
        positions = packed_positions(doc_ids)[:, lo:hi]  # (B, T/N)
    return inputs[:, lo:hi], targets[:, lo:hi], doc_ids, positions
