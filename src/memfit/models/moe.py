"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, OLMoE): a top-k router and experts computed grouped.

A router (``gate``, a (E, C) matrix) scores each token against the E experts; the token goes to the k best
(``num_experts_per_tok``), weighted by their softmax probabilities (renormalised over the k when
``norm_topk_prob``, as Qwen3-MoE and Mixtral do; OLMoE keeps them as they are). Each expert is a gated MLP whose
weights are stored fused as in transformers 5: ``experts.gate_up_proj`` (E, 2 * I, C), the gate's rows then the
up projection's, and ``experts.down_proj`` (E, C, I).

**Grouped, never dense.** The N * k routed rows are sorted by expert, each expert's rows are one contiguous slice,
and each expert runs one matmul over its slice (:class:`_GroupedExperts`, with a backward of its own). No
(tokens x experts x ffn) tensor and no (tokens x k x experts) one-hot exists at any point: the saved activations
are the sorted inputs (N * k, C) and the gate/up products (N * k, 2 * I), whatever the routing, and what depends
on the routing is only the transient work of one expert at a time: (n_e, I) and (n_e, 2 * I) for an expert of
n_e rows.

**Routing in an estimate.** How many rows each expert gets is known only from the data: the loop needs the sizes
on the host (one ``tolist`` per layer). Under ``FakeTensorMode`` there is no data, so :func:`expert_sizes` returns
the sizes of a stated assumption instead (:func:`routing_assumption`): ``balanced`` top-k times a skew factor
(the largest expert receives ``skew`` times its average share, MindSpeed's 2.0 by default), or the ``collapsed``
bound (every token at the same k experts). Tests force a real router into each and compare the tracked peaks.

**The load-balancing loss** (Switch Transformer, Fedus et al. 2021; transformers' ``load_balancing_loss_func``):
per layer ``E * sum_e f_e * P_e``, with ``f_e`` the routed rows of expert e per token and ``P_e`` its mean router
probability, averaged over the MoE layers and scaled by ``router_aux_loss_coef``. It is computed per layer from
(E,) sums (transformers concatenates every layer's (N, k, E) one-hot first: 5.3 GB at 8K tokens for
Qwen3-30B-A3B); for one layer the two are equal, over several transformers' pools the layers' counts first. Its
gradient is added in the backward (:class:`_AuxLossGradient`, Megatron's "aux loss auto-scaler"), so the layer's
output and every memory technique around it are unchanged; the step sets its scale (:func:`aux_loss_scale`).
Under the tiled MLP each tile adds its own, weighted by its share of the tokens (:func:`aux_loss_share`): their
token-weighted mean, not the whole sequence's loss.

Shape letters: N tokens (B * T), C width, E experts, k experts per token, I an expert's hidden size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from memfit.models.config import DecoderConfig
from memfit.models.nf4 import is_nf4, nf4_rows

ROUTING = ("balanced", "collapsed")
"""Routing assumptions of an estimate (:func:`routing_assumption`)."""
DEFAULT_SKEW = 2.0
"""The largest expert's share of the routed rows, in multiples of its average, that ``balanced`` assumes
(MindSpeed recomputes an expert past 2x its average share)."""


@dataclass(frozen=True)
class Routing:
    """How an estimate assumes tokens route (:func:`routing_assumption`)."""

    kind: str = "balanced"
    """``balanced`` (every expert its average share, the first ``skew`` times it) or ``collapsed`` (every token
    at experts 0 .. k - 1: the bound)."""
    skew: float = DEFAULT_SKEW
    """Under ``balanced``: the first expert's rows in multiples of the average ``N * k / E`` (capped at N)."""

    def sizes(self, num_tokens: int, num_experts: int, top_k: int) -> list[int]:
        """Rows per expert under this assumption.

        Args:
            num_tokens: N, the tokens of the layer's input.
            num_experts: E.
            top_k: k.

        Returns:
            E ints summing to ``N * k``, none above N (a token picks an expert at most once).
        """
        total = num_tokens * top_k
        if self.kind == "collapsed":
            return [num_tokens] * top_k + [0] * (num_experts - top_k)
        first = min(
            num_tokens, max(math.ceil(self.skew * total / num_experts), math.ceil(total / num_experts))
        )
        if num_experts == 1:
            return [total]
        rest = total - first
        base, extra = divmod(rest, num_experts - 1)
        return [first] + [base + (1 if e < extra else 0) for e in range(num_experts - 1)]


_ROUTING = Routing()


@contextlib.contextmanager
def routing_assumption(routing: Routing) -> Iterator[None]:
    """Within the block, fake-tensor runs of MoE layers route by ``routing`` (real tensors route by their data).

    Raises:
        ValueError: an unknown ``routing.kind``, or a skew below 1.
    """
    global _ROUTING
    if routing.kind not in ROUTING:
        raise ValueError(f"routing must be one of {list(ROUTING)}, got {routing.kind!r}")
    if not routing.skew >= 1.0:
        raise ValueError(f"moe_skew must be at least 1.0 (the average share), got {routing.skew!r}")
    previous, _ROUTING = _ROUTING, routing
    try:
        yield
    finally:
        _ROUTING = previous


def expert_sizes(counts: Tensor, num_tokens: int, top_k: int) -> list[int]:
    """Rows routed to each expert, on the host: the data's (one sync), or the assumption's under fake tensors.

    Args:
        counts: (E,) int64 rows per expert.
        num_tokens: N.
        top_k: k.

    Returns:
        E ints summing to ``N * k``.
    """
    if is_fake(counts) or counts.is_meta:
        return _ROUTING.sizes(num_tokens, counts.shape[0], top_k)
    return counts.tolist()


_AUX_SCALE = 0.0


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Within the block, each MoE layer adds ``scale`` times its load-balancing loss's gradient in the backward
    (the step passes ``router_aux_loss_coef / (MoE layers * micro-batches)``; 0 adds nothing)."""
    global _AUX_SCALE
    previous, _AUX_SCALE = _AUX_SCALE, scale
    try:
        yield
    finally:
        _AUX_SCALE = previous


@contextlib.contextmanager
def aux_loss_share(fraction: float) -> Iterator[None]:
    """Within the block, the load-balancing loss's scale is ``fraction`` of what it was: a tiled MLP
    (:mod:`memfit.memory.tiled`) runs each tile's experts under its share of the tokens, so that the tiles' losses
    add up to their token-weighted mean."""
    global _AUX_SCALE
    previous, _AUX_SCALE = _AUX_SCALE, _AUX_SCALE * fraction
    try:
        yield
    finally:
        _AUX_SCALE = previous


def load_balancing_loss(probs: Tensor, counts: Tensor) -> Tensor:
    """One layer's load-balancing loss, ``E * sum_e (counts_e / N) * mean_n probs[n, e]`` (transformers'
    ``load_balancing_loss_func`` for one layer without a padding mask).

    Args:
        probs: (N, E) fp32 router probabilities.
        counts: (E,) rows routed to each expert (no gradient).

    Returns:
        A 0-d fp32 tensor; its gradient reaches the router through ``probs``.
    """
    n, num_experts = probs.shape
    return num_experts * (counts.to(probs.dtype) / n * probs.mean(0)).sum()


class _AuxLossGradient(torch.autograd.Function):
    """Identity on ``x``; in the backward, ``aux``'s gradient is ``scale`` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x, aux, scale):  # noqa: D102 (autograd's signature)
        ctx.scale = scale
        ctx.aux_meta = (aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        dtype, device = ctx.aux_meta
        return grad_out, torch.full((), ctx.scale, dtype=dtype, device=device), None


def _expert(weight: Tensor, e: int) -> Tensor:
    """Expert ``e``'s matrix of a stacked (E, m, n) weight: a view, or (QLoRA) its NF4 slice dequantized alone."""
    return nf4_rows(weight, e) if is_nf4(weight) else weight[e]


def _silu_grad(x: Tensor) -> Tensor:
    """d silu(x) / dx = s(x) * (1 + x * (1 - s(x))), s the sigmoid; a new tensor of ``x``'s shape."""
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


@dataclass(frozen=True)
class ExpertsLora:
    """LoRA on a stacked expert weight (added by :func:`memfit.models.peft.apply_lora`): expert e's weight acts as
    ``W_e + scale * B_e @ A_e``.

    ``gate_up`` and ``down`` are ``(A, B)`` pairs or None: for ``gate_up_proj`` A (E, r, C) and B (E, 2I, r), for
    ``down_proj`` A (E, r, I) and B (E, C, r). As PEFT's ``target_parameters`` LoRA of a 3-D parameter, one pair
    adapts each expert's whole fused matrix (the gate's and up projection's rows share A).
    """

    gate_up: tuple[Tensor, Tensor] | None
    down: tuple[Tensor, Tensor] | None
    scale: float

    def tensors(self) -> tuple[Tensor | None, ...]:
        """``(gate_up A, gate_up B, down A, down B)``, None where a weight is not adapted."""
        return (*(self.gate_up or (None, None)), *(self.down or (None, None)))


def _lora_mm(x: Tensor, a: Tensor | None, b: Tensor | None, e: int, scale: float, out: Tensor) -> None:
    """``out += scale * (x @ A_e.T) @ B_e.T`` in place: the low-rank path of one expert, (n, r) in between."""
    if a is not None:
        out.addmm_(x @ a[e].t(), b[e].t(), alpha=scale)


def _lora_mm_backward(
    x: Tensor,
    g: Tensor,
    a: Tensor,
    b: Tensor,
    e: int,
    scale: float,
    grads: tuple[Tensor | None, Tensor | None],
) -> Tensor:
    """The backward of :func:`_lora_mm` for expert ``e``: writes ``grad A_e = scale * (g B_e).T x`` and
    ``grad B_e = scale * g.T (x A_e.T)`` into ``grads`` (where not None) and returns ``scale * (g B_e) A_e``,
    the path's (n, in) input gradient.

    Args:
        x: (n, in) the path's input.
        g: (n, out) the output's gradient.
    """
    gb = g @ b[e]  # (n, r)
    grad_a, grad_b = grads
    if grad_a is not None:
        torch.mm(gb.t(), x, out=grad_a[e]).mul_(scale)  # (r, in)
    if grad_b is not None:
        torch.mm(g.t(), x @ a[e].t(), out=grad_b[e]).mul_(scale)  # (out, r)
    return (gb @ a[e]).mul_(scale)  # (n, in)


class _GroupedExperts(torch.autograd.Function):
    """Each expert's gated MLP over its contiguous slice of the sorted rows: ``down(silu(gate(x)) * up(x))``,
    with a LoRA's low-rank path beside each adapted weight (:class:`ExpertsLora`).

    Saves the sorted inputs (N * k, C) and the gate/up products (N * k, 2 * I); the activation's product is
    recomputed per expert in the backward (and the LoRA paths' (n, r) products). Weight gradients are written
    expert by expert into one (E, ...) tensor each; an expert without rows gets zeros.
    """

    @staticmethod
    def forward(ctx, xs, gate_up, down, sizes, scale, gu_a, gu_b, d_a, d_b):  # noqa: D102 (autograd's signature)
        rows, inner = xs.shape[0], down.shape[2]
        h = xs.new_empty(rows, 2 * inner)  # (N * k, 2I) gate then up
        out = xs.new_empty(rows, down.shape[1])  # (N * k, C)
        start = 0
        for e, n in enumerate(sizes):
            if n:
                s = slice(start, start + n)
                torch.mm(xs[s], _expert(gate_up, e).t(), out=h[s])
                _lora_mm(xs[s], gu_a, gu_b, e, scale, h[s])
                act = F.silu(h[s, :inner]).mul_(h[s, inner:])  # (n, I)
                torch.mm(act, _expert(down, e).t(), out=out[s])
                _lora_mm(act, d_a, d_b, e, scale, out[s])
                del act
            start += n
        ctx.save_for_backward(xs, h)
        # parameters (NF4 under QLoRA) and LoRA factors: held by the model, not saved activations
        ctx.weights = (gate_up, down, gu_a, gu_b, d_a, d_b)
        ctx.sizes, ctx.scale = sizes, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        xs, h = ctx.saved_tensors
        gate_up, down, gu_a, gu_b, d_a, d_b = ctx.weights
        scale = ctx.scale
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        inner = down.shape[2]

        def zeros(t: Tensor | None, needed: bool) -> Tensor | None:
            return torch.zeros_like(t) if needed and t is not None else None

        grad_x = torch.empty_like(xs) if need_x else None
        grad_gu, grad_down = zeros(gate_up, need_gu), zeros(down, need_down)
        lora_grads = [
            zeros(t, needed) for t, needed in zip(ctx.weights[2:], ctx.needs_input_grad[5:], strict=True)
        ]
        start = 0
        for e, n in enumerate(ctx.sizes):
            if n:
                s = slice(start, start + n)
                gate, up, g = h[s, :inner], h[s, inner:], grad_out[s]
                silu = F.silu(gate)  # (n, I)
                act = silu * up if need_down or d_a is not None else None  # (n, I)
                if need_down:
                    torch.mm(g.t(), act, out=grad_down[e])  # (C, I)
                d_act = g @ _expert(down, e)  # (n, I)
                if d_a is not None:
                    d_act += _lora_mm_backward(act, g, d_a, d_b, e, scale, lora_grads[2:])
                del act
                d_gu = torch.cat((d_act * up * _silu_grad(gate), d_act.mul_(silu)), dim=1)  # (n, 2I)
                del silu, d_act
                if need_gu:
                    torch.mm(d_gu.t(), xs[s], out=grad_gu[e])  # (2I, C)
                lora_dx = None
                if gu_a is not None:
                    lora_dx = _lora_mm_backward(xs[s], d_gu, gu_a, gu_b, e, scale, lora_grads[:2])
                if need_x:
                    torch.mm(d_gu, _expert(gate_up, e), out=grad_x[s])  # (n, C)
                    if lora_dx is not None:
                        grad_x[s] += lora_dx
                del d_gu, lora_dx
            start += n
        return (grad_x, grad_gu, grad_down, None, None, *lora_grads)


def grouped_experts(
    xs: Tensor, gate_up: Tensor, down: Tensor, sizes: list[int], lora: ExpertsLora | None = None
) -> Tensor:
    """Run each expert's gated MLP on its slice of the sorted rows (:class:`_GroupedExperts`).

    Args:
        xs: (N * k, C) rows sorted by expert.
        gate_up: (E, 2I, C) stacked weights (NF4 under QLoRA).
        down: (E, C, I).
        sizes: E ints: the rows of each expert, in order.
        lora: a LoRA on either stack, or None.

    Returns:
        (N * k, C), unweighted.
    """
    scale = lora.scale if lora is not None else 0.0
    factors = lora.tensors() if lora is not None else (None,) * 4
    return _GroupedExperts.apply(xs, gate_up, down, sizes, scale, *factors)


class Router(nn.Module):
    """The top-k router (transformers' ``...TopKRouter``, the block's ``gate``): a (E, C) matrix, no bias.

    Args:
        config: a config with ``num_experts``.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens.

        Args:
            x: (N, C).

        Returns:
            ``(probs, weights, experts)``: (N, E) fp32 softmax probabilities, (N, k) routing weights in ``x``'s
            dtype (renormalised over the k with ``norm_topk_prob``), (N, k) int64 expert ids.
        """
        logits = F.linear(x, self.weight)  # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts


class Experts(nn.Module):
    """E gated MLPs stored fused (transformers 5's ``...Experts``): ``gate_up_proj`` (E, 2I, C), ``down_proj``
    (E, C, I).

    Args:
        config: a config with ``num_experts`` and ``moe_intermediate_size``.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        E, C, I = config.num_experts, config.dim, config.expert_intermediate_size  # noqa: E741
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, C))
        self.down_proj = nn.Parameter(torch.empty(E, C, I))

    def forward(self, xs: Tensor, sizes: list[int]) -> Tensor:
        """Run each expert on its slice of ``xs``.

        Args:
            xs: (N * k, C) rows sorted by expert.
            sizes: E ints: the rows of each expert, in order.

        Returns:
            (N * k, C), unweighted.
        """
        return grouped_experts(xs, self.gate_up_proj, self.down_proj, sizes)


class MoE(nn.Module):
    """The sparse block (transformers' ``...SparseMoeBlock``): ``gate`` (the router) and ``experts``.

    Args:
        config: a config with ``num_experts``.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.aux_loss_weight = 1.0 / max(1, config.num_moe_layers)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.gate = Router(config)
        self.experts = Experts(config)

    def forward(self, x: Tensor) -> Tensor:
        """Route, run the experts grouped, and sum each token's k outputs by their weights.

        Args:
            x: (B, T, C) normed hidden states.

        Returns:
            (B, T, C).
        """
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, C)
        n = x2.shape[0]
        probs, weights, experts = self.gate(x2)  # (N, E), (N, k), (N, k)
        flat = experts.reshape(-1)  # (N * k,)
        order = torch.argsort(flat, stable=True)  # (N * k,) routed rows sorted by expert
        token = order // self.top_k  # (N * k,) the token of each sorted row
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # (E,)
        sizes = expert_sizes(counts, n, self.top_k)
        ys = self.experts(x2[token], sizes)  # (N * k, C)
        ys = ys * weights.reshape(-1)[order].unsqueeze(1)  # (N * k, C)
        out = x2.new_zeros(x2.shape).index_add_(0, token, ys)  # (N, C)
        if _AUX_SCALE and torch.is_grad_enabled() and probs.requires_grad:
            aux = load_balancing_loss(probs, counts)
            out = _AuxLossGradient.apply(out, aux, _AUX_SCALE * self.aux_loss_weight)
        return out.view(shape)


def freeze_routers(model: nn.Module) -> int:
    """Stop every router of ``model`` from training (``requires_grad=False``).

    Returns:
        The routers frozen (0 on a dense model).
    """
    routers = [m.gate.weight for m in model.modules() if isinstance(m, MoE)]
    for weight in routers:
        weight.requires_grad_(False)
    return len(routers)


def aux_loss_coefficient(model: nn.Module, override: float | None = None) -> float:
    """The weight of the load-balancing loss a step of ``model`` adds.

    Args:
        model: the model (a dense one gives 0).
        override: the run's ``moe.router_aux_loss_coef``; None is the checkpoint's ``router_aux_loss_coef`` when
            the routers train, else 0.

    Returns:
        The weight, 0 when nothing is added.
    """
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    if not blocks:
        return 0.0
    if override is not None:
        return float(override)
    trains = any(b.gate.weight.requires_grad for b in blocks)
    return blocks[0].router_aux_loss_coef if trains else 0.0
