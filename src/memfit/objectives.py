"""Preference objectives: DPO, IPO, SimPO and ORPO over the log-probabilities of chosen and rejected replies.

A preference micro-batch holds ``2B`` rows: rows ``0 .. B-1`` are the ``B`` pairs' prompt + chosen reply, rows
``B .. 2B-1`` their prompt + rejected reply (TRL's concatenated batch), with targets ``-100`` outside the replies
(:mod:`memfit.data.preference`). Every objective here is a function of each row's summed reply log-probability
``logps`` (2B,) and reply length ``counts`` (2B,) (and, for DPO and IPO, a reference model's ``logps``), so the
step can compute those sums chunk by chunk (no ``(2B, T, vocab_size)`` logits) and then weight each row's tokens
by the objective's derivative (:func:`policy_loss`).

Per pair ``i`` (``pc``, ``pr``: the policy's chosen / rejected sums; ``rc``, ``rr`` the reference's; ``n`` the
reply lengths; ``sigma`` the logistic function), as TRL 1.13 computes them:

- ``dpo`` (Rafailov et al. 2023, "Direct Preference Optimization"; TRL ``DPOTrainer`` ``loss_type="sigmoid"``):
  ``d = (pc - rc) - (pr - rr)``, ``loss = -(1 - eps) log sigma(beta d) - eps log sigma(-beta d)``; rewards
  ``beta (p - r)``. With ``label_smoothing`` eps > 0 this is the conservative DPO of Mitchell (2023), as TRL's
  ``CPOTrainer`` and TRL's DPO before 1.0 compute it (TRL 1.13's ``sigmoid`` has no smoothing: eps = 0 there).
- ``ipo`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences";
  TRL ``loss_type="ipo"``, log-ratios averaged per reply token): ``loss = ((pc - rc) / nc - (pr - rr) / nr -
  1 / (2 beta))^2``; rewards ``beta (p - r)``.
- ``simpo`` (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward"; TRL
  ``CPOTrainer`` ``loss_type="simpo"``): ``a = p / n`` (per-token average), ``z = beta (ac - ar) - gamma``,
  ``loss = -(1 - eps) log sigma(z) - eps log sigma(-z)``, plus ``cpo_alpha`` times the chosen replies' mean
  token cross-entropy; rewards ``beta a``.
- ``orpo`` (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model"; TRL
  ``ORPOTrainer``): ``a = p / n``, ``log_odds = (ac - ar) - (log(1 - e^ac) - log(1 - e^ar))``,
  ``loss = NLL(chosen) - beta log sigma(log_odds)``; rewards ``beta a``. As in TRL (and ORPO's own code), this NLL
  is the chosen rows' mean cross-entropy over every token, prompt and reply (SimPO's covers the reply only).

The loss of a step is the mean over its pairs (of all micro-batches and ranks), plus the NLL term as a mean over
the chosen replies' tokens; the logged metrics are TRL's: ``rewards/chosen``, ``rewards/rejected``,
``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` (means over pairs), and for ORPO
``nll_loss``, ``log_odds_ratio`` and ``log_odds_chosen``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
"""The preference objectives (config key ``objective``)."""
OBJECTIVES = ("next_token", *PREFERENCE_OBJECTIVES)
"""The values of ``objective``: ``next_token`` (cross-entropy: pretraining and supervised fine-tuning) or one of
:data:`PREFERENCE_OBJECTIVES`."""
REFERENCE_FREE = ("simpo", "orpo")
"""The objectives that need no reference model."""
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
"""Metrics every preference objective logs, each a mean over the step's pairs (TRL's names)."""
ORPO_METRICS = ("log_odds_ratio", "log_odds_chosen")
"""ORPO's own per-pair metrics (means over pairs), beside ``nll_loss``."""


def rows_per_micro_batch(cfg: Any) -> int:
    """The rows of a run's micro-batch: ``batch_size`` sequences, or two per pair (its chosen and its rejected
    reply) under a preference ``objective``."""
    return cfg.batch_size * (2 if cfg.objective in PREFERENCE_OBJECTIVES else 1)


@dataclass(frozen=True)
class Preference:
    """A preference objective and its hyperparameters (config section ``preference``)."""

    objective: str
    """One of :data:`PREFERENCE_OBJECTIVES`."""
    beta: float = 0.1
    """DPO's and SimPO's inverse temperature, IPO's regularisation (tau), ORPO's odds-ratio weight (lambda)."""
    label_smoothing: float = 0.0
    """DPO and SimPO: the probability that a pair's labels are flipped (conservative DPO), in ``[0, 0.5)``."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (gamma)."""
    cpo_alpha: float = 0.0
    """SimPO: weight of the chosen replies' cross-entropy (TRL's ``cpo_alpha``; the SimPO paper uses 0)."""

    @property
    def needs_reference(self) -> bool:
        """Whether the objective compares the policy with a reference model (DPO, IPO)."""
        return self.objective not in REFERENCE_FREE

    @property
    def nll_weight(self) -> float:
        """Weight of the chosen replies' mean token cross-entropy in the loss (ORPO 1, SimPO ``cpo_alpha``)."""
        return {"orpo": 1.0, "simpo": self.cpo_alpha}.get(self.objective, 0.0)

    @property
    def nll_covers_prompt(self) -> bool:
        """Whether the NLL term covers the chosen rows' prompt tokens too (ORPO, as TRL) or their replies only."""
        return self.objective == "orpo"

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics :func:`pair_terms` returns, in order; ``nll_loss`` after them where the objective has it."""
        return PAIR_METRICS + (ORPO_METRICS if self.objective == "orpo" else ())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012), as TRL's ORPO computes it."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_terms(
    pref: Preference, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss and metrics.

    Args:
        pref: the objective.
        logps: ``(2B,)`` fp32 summed log-probabilities of each row's reply (chosen rows first).
        counts: ``(2B,)`` reply tokens of each row (>= 1).
        reference: ``(2B,)`` the reference model's ``logps`` of the same rows, or ``None`` (SimPO, ORPO).

    Returns:
        ``(losses, metrics)``: ``(B,)`` fp32 per-pair losses (without the NLL term) and ``(len(pref.metric_names),
        B)`` fp32 per-pair metric values (detached).

    Raises:
        ValueError: DPO or IPO without ``reference``.
    """
    B = logps.shape[0] // 2
    n = counts.to(logps.dtype).clamp(min=1)
    if pref.objective in REFERENCE_FREE:
        scores = logps / n  # per-token average log-probabilities
        rewards = pref.beta * scores
    else:
        if reference is None:
            raise ValueError(f"objective {pref.objective!r} needs the reference model's log-probabilities")
        scores = logps
        rewards = pref.beta * (logps - reference)
    pc, pr = scores[:B], scores[B:]
    extra: list[torch.Tensor] = []
    eps = pref.label_smoothing
    if pref.objective == "dpo":
        z = rewards[:B] - rewards[B:]  # beta * ((pc - rc) - (pr - rr))
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif pref.objective == "ipo":
        ratio = (logps - reference) / n  # per-token average log-ratios
        losses = (ratio[:B] - ratio[B:] - 1 / (2 * pref.beta)) ** 2
    elif pref.objective == "simpo":
        z = pref.beta * (pc - pr) - pref.simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif pref.objective == "orpo":
        log_odds = (pc - pr) - (_log1mexp(pc) - _log1mexp(pr))
        ratio = F.logsigmoid(log_odds)
        losses = -pref.beta * ratio
        extra = [ratio.detach(), log_odds.detach()]
    else:
        raise ValueError(f"unknown preference objective {pref.objective!r}")
    rc, rr = rewards[:B].detach(), rewards[B:].detach()
    metrics = torch.stack(
        [rc, rr, rc - rr, (rc > rr).to(rc.dtype), pc.detach(), pr.detach(), *extra]
    )  # (M, B)
    return losses, metrics


@dataclass(frozen=True)
class StepNorms:
    """What a step's preference loss is normalised by, over all its micro-batches and ranks."""

    pairs: torch.Tensor
    """0-dim fp32: pairs in the step."""
    chosen_tokens: torch.Tensor
    """0-dim fp32: reply tokens of the chosen rows in the step (the NLL term's mean)."""


def micro_batch_objective(
    pref: Preference,
    logps: torch.Tensor,
    counts: torch.Tensor,
    reference: torch.Tensor | None,
    norms: StepNorms,
    prompt_nll: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's share of the step's preference loss, and its metric sums.

    Args:
        pref: the objective.
        logps, counts, reference: as :func:`pair_terms`.
        norms: the step's totals.
        prompt_nll: ``(2B,)`` fp32 summed cross-entropy of each row's prompt tokens (where
            ``pref.nll_covers_prompt``), or ``None``.

    Returns:
        ``(loss, sums)``: a 0-dim fp32 loss (``sum(losses) / pairs + nll_weight * nll / chosen_tokens``, ``nll`` the
        chosen rows' summed cross-entropy: ``-sum(chosen logps)``, plus their prompts' with ``prompt_nll``),
        differentiable in ``logps`` and ``prompt_nll``; and ``(M,)`` fp32 sums over the micro-batch's pairs of each
        of ``pref.metric_names``, followed by ``nll`` (detached).
    """
    B = logps.shape[0] // 2
    losses, metrics = pair_terms(pref, logps, counts, reference)
    loss = losses.sum() / norms.pairs
    nll = -logps[:B].sum()
    if prompt_nll is not None and pref.nll_covers_prompt:
        nll = nll + prompt_nll[:B].sum()
    if pref.nll_weight:
        loss = loss + pref.nll_weight * nll / norms.chosen_tokens
    return loss, torch.cat([metrics.sum(dim=1), nll.detach().reshape(1)])


def metrics_from_sums(pref: Preference, sums: torch.Tensor, norms: StepNorms) -> dict[str, torch.Tensor]:
    """The step's metrics (0-dim device tensors) from the sums of :func:`micro_batch_objective` over the step:
    means over pairs, and ``nll_loss`` (mean over the chosen reply tokens) where the objective has it."""
    names = pref.metric_names
    out = {name: sums[i] / norms.pairs for i, name in enumerate(names)}
    if pref.nll_weight or pref.objective == "orpo":
        out["nll_loss"] = sums[len(names)] / norms.chosen_tokens
    return out


def whole_targets(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's next-token targets over prompt and reply, from a preference batch's reply-only ``targets``.

    A row's prompt is followed by its reply, so position ``t`` of the prompt predicts ``inputs[t + 1]``; positions
    after the row's last reply target are padding.

    Args:
        inputs: ``(2B, T)`` int64 ids.
        targets: ``(2B, T)`` int64, ``-100`` outside the replies.

    Returns:
        ``(2B, T)`` int64: ``targets`` on the replies, the next input on the prompts, ``-100`` on padding.
    """
    counted = targets != -100
    real = counted.flip(1).cumsum(1).flip(1) > 0  # at or before the row's last reply target
    following = torch.cat([inputs[:, 1:], inputs[:, -1:]], dim=1)  # (2B, T): inputs[t + 1]
    return torch.where(counted, targets, torch.where(real, following, torch.full_like(targets, -100)))


def nll_tokens(pref: Preference, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0-dim int64: the tokens the NLL term averages over in a micro-batch: the chosen rows' reply targets, or with
    ``pref.nll_covers_prompt`` (ORPO) every next token of the chosen rows (:func:`whole_targets`)."""
    B = targets.shape[0] // 2
    covered = whole_targets(inputs[:B], targets[:B]) if pref.nll_covers_prompt else targets[:B]
    return (covered != -100).sum()
