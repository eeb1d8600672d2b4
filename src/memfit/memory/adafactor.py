"""``torch.optim.Adafactor`` whose update of a bf16 weight under ``bf16_rounding`` runs in fp32, chunk by chunk.

Adafactor (Shazeer and Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost") keeps a row and a
column vector of the second moment per matrix. Its update needs the whole matrix three times: the column means of
the squared gradient, the update's RMS (the clipping by ``d``) and the weight's RMS (the relative step size). torch
computes each over whole tensors, so a bf16 weight updated in fp32 held fp32 copies of the weight, its gradient, the
variance estimate and the update at once: 16 bytes per element of the largest tensor (Llama-3.1-8B's embedding:
7.8 GiB).

:class:`Adafactor` runs the same arithmetic over row chunks of :data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS`
elements in three passes (the norms and the factors' means; the update's norm; the update, rounded back by
:mod:`memfit.memory.rounding`), so the fp32 temporaries are one chunk's. Its scalars stay tensors (no host sync),
and ``eps1`` is fp32's, as torch's for an fp32 weight. ``bf16_rounding: nearest`` is torch's own step, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import _get_scalar_dtype

from memfit.memory import hybrids, rounding


def _rows(t: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges of ``t`` of at most :data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS` elements (a row at least)."""
    rows = t.shape[0] if t.dim() else 1
    per_row = max(1, t.numel() // max(1, rows))
    size = max(1, hybrids.LOW_BIT_CHUNK_ELEMENTS // per_row)
    return [(a, min(rows, a + size)) for a in range(0, rows, size)]


def _lerp_(state: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> None:
    """``state.lerp_(end, weight)`` computed in fp32 and stored in ``state``'s dtype (a bf16 factor of a bf16
    weight's second moment, as torch keeps it)."""
    if state.dtype == torch.float32:
        state.lerp_(end, weight)
    else:
        state.copy_(state.float().lerp_(end, weight))


class Adafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor``; under ``memfit_bf16_rounding`` other than ``nearest`` (set by
    :func:`memfit.memory.optim.build_optimizer`) each tensor's update runs in fp32 over row chunks and is rounded
    back into the bf16 weight (see the module doc). Its state is torch's (``step``, ``row_var`` / ``col_var`` or
    ``variance``, in the gradient's dtype), so checkpoints load either way.

    A mixture of experts' stacked (E, m, n) tensors are factored per expert, as torch factors the last two
    dimensions, over chunks of whole experts.
    """

    memfit_rounds_natively = True
    memfit_bf16_rounding = "nearest"

    @torch.no_grad()
    def create_state(self) -> None:
        """Create now the state torch's first step would make (its ``_init_group``: ``step``, and ``row_var`` and
        ``col_var`` of a matrix or ``variance`` of a vector, zeros in the parameter's dtype) for every parameter
        without any, so that a CPU run makes it in one piece of the heap before its first step
        (:func:`memfit.memory.optim.create_state`) rather than between the first backward's temporaries."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    continue
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                if p.dim() > 1:
                    state["row_var"] = p.new_zeros((*p.shape[:-1], 1))
                    state["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
                else:
                    state["variance"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.memfit_bf16_rounding == "nearest":
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_group(group, [], [], [], [], [], [])
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p)
        return loss

    def _update(self, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        mode = self.memfit_bf16_rounding
        comp = rounding.compensation_of(state, p, mode)
        weight, grad = hybrids._local(p.detach()), hybrids._local(p.grad)
        comp = hybrids._local(comp)
        if group["maximize"]:
            grad = -grad
        lr, wd, d = group["lr"], group["weight_decay"], group["d"]
        eps1, eps2 = group["eps"]
        eps1 = eps1 if eps1 is not None else torch.finfo(torch.float32).eps
        step = state["step"]
        step += 1
        one_minus_beta2 = step.pow(group["beta2_decay"])
        rho = step.rsqrt().clamp(max=lr)
        chunks = hybrids.traced_chunks(_rows(weight), weight)
        factored = weight.dim() >= 2
        stacked = (
            weight.dim() == 3
        )  # a mixture of experts' (E, m, n): chunks of whole experts, factors per expert
        row_var, col_var, variance = (
            hybrids._local(state.get(k)) for k in ("row_var", "col_var", "variance")
        )

        # pass 1: the weight's sum of squares; the second moment's factors (or the whole vector)
        weight_sq = torch.zeros((), dtype=torch.float32, device=weight.device)
        col_sq = (
            torch.zeros(weight.shape[-1], dtype=torch.float32, device=weight.device)
            if factored and not stacked
            else None
        )
        for a, b in chunks:
            w32 = rounding.to_fp32(weight[a:b], None if comp is None else comp[a:b])
            weight_sq += w32.square().sum()
            g32 = grad[a:b].to(torch.float32, copy=True)
            if factored:
                sq = g32.square_()
                _lerp_(row_var[a:b], sq.sum(dim=-1, keepdim=True).div_(weight.shape[-1]), one_minus_beta2)
                if stacked:
                    _lerp_(col_var[a:b], sq.sum(dim=-2, keepdim=True).div_(weight.shape[-2]), one_minus_beta2)
                else:
                    col_sq += sq.sum(dim=0)
            else:
                _lerp_(variance[a:b], g32.square_(), one_minus_beta2)
            del w32, g32
        alpha = (weight_sq.sqrt() / weight.numel() ** 0.5).clamp(min=eps2) * rho
        if factored and not stacked:
            _lerp_(col_var, col_sq.div_(weight.shape[0]).unsqueeze(0), one_minus_beta2)
        if factored:  # (1, 1), or (E, 1, 1): per expert
            row_mean = row_var.float().mean(dim=-2, keepdim=True).clamp_(min=eps1)

        def update_of(a: int, b: int) -> torch.Tensor:
            if stacked:
                estimate = (row_var[a:b].float() @ col_var[a:b].float()).div_(row_mean[a:b])
            elif factored:
                estimate = (row_var[a:b].float() @ col_var.float()).div_(row_mean)
            else:
                estimate = variance[a:b].to(torch.float32, copy=True)
            return estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad[a:b])

        # pass 2: the update's RMS, clipped by d
        update_sq = torch.zeros((), dtype=torch.float32, device=weight.device)
        for a, b in chunks:
            update_sq += update_of(a, b).square().sum()
        denom = (update_sq.sqrt() / (weight.numel() ** 0.5 * d)).clamp(min=1.0)
        scale = -alpha / denom

        # pass 3: weight decay and the update, on fp32 copies of each chunk, rounded back
        for a, b in chunks:
            with rounding.rounded(weight[a:b], mode, None if comp is None else comp[a:b]) as target:
                if wd != 0:
                    target.mul_(1 - lr * wd)
                target.add_(update_of(a, b).mul_(scale))


__all__ = ["Adafactor"]
