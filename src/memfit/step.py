"""The training step and evaluation: the functions the loop (:mod:`memfit.train`) and the estimator
(:mod:`memfit.planner.estimate`) both call, so what the estimator predicts is what runs.

:func:`train_step` is a pure tensor program: no ``.item()``, no host sync, no data-dependent Python branching, so
it runs unchanged under ``FakeTensorMode`` on a meta-built model of any size.

Dtype policy (``dtype``):

=============  ==============  ==============  =================  =====================================
``dtype``      weights         gradients       AdamW state (m, v)  forward / backward compute
=============  ==============  ==============  =================  =====================================
``fp32``       fp32            fp32            fp32                fp32
``bf16``       bf16            bf16            bf16                bf16 (RoPE tables, RMSNorm and the loss in fp32)
``bf16_mixed`` fp32            fp32            fp32                bf16 autocast (matmuls), fp32 master weights
=============  ==============  ==============  =================  =====================================
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from memfit import distributed as dist_
from memfit.config import TrainConfig
from memfit.memory import optimizers, techniques
from memfit.memory.optim import OptimizerInBackward
from memfit.memory.techniques import IGNORE_INDEX, compiled
from memfit.memory.tensor_parallel import local_loss, loss_context
from memfit.models import moe
from memfit.models.peft import lora_effective_weight, lora_off
from memfit.objectives import (
    PREFERENCE_OBJECTIVES,
    Preference,
    StepNorms,
    metrics_from_sums,
    micro_batch_objective,
    nll_tokens,
    pair_terms,
    whole_targets,
)
from memfit.validation import reference_mode


def autocast_context(dtype: str, device_type: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``bf16_mixed``; nothing otherwise."""
    if dtype == "bf16_mixed":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32.

    Args:
        logits: ``(B, T, vocab_size)``, any float dtype; a tensor-parallel model's are a DTensor sharded on the
            vocabulary, whose loss runs parallel over it (under :func:`memfit.memory.tensor_parallel.loss_context`,
            entered by the callers around the forward and the backward).
        targets: ``(B, T)`` int64; ``-100`` marks tokens that do not count.

    Returns:
        A 0-dim fp32 tensor (plain, also under tensor parallelism): the sum over counted tokens of
        ``-log p(target)``, in nats.
    """
    if hasattr(logits, "to_local"):  # sharded on V: (B, V, T) vs (B, T), which keeps one Shard placement even
        # for B = 0 (a data-parallel group without validation rows), where DTensor's flatten of (0, T) does not
        return local_loss(
            F.cross_entropy(
                logits.float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="sum"
            )
        )
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )  # (B*T, V) vs (B*T,)


@dataclass
class StepResult:
    """What one optimizer step returns: device tensors, read by the host only at logging boundaries."""

    loss: torch.Tensor
    """0-dim: mean cross-entropy per counted token over all micro-batches of the step (of all ranks)."""
    grad_norm: torch.Tensor
    """0-dim: global L2 norm of the gradients before clipping."""
    num_tokens: torch.Tensor
    """0-dim int64: tokens that counted in the loss (of all ranks)."""
    skipped: bool = False
    """``skip_nonfinite`` only: the loss or gradient norm was not finite, and the update was not applied."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """A preference objective's metrics (0-dim, :func:`memfit.objectives.metrics_from_sums`); empty otherwise."""


REFERENCES = ("none", "batch", "lora_off", "model")
"""Where a preference step's reference log-probabilities come from: none (SimPO, ORPO), the micro-batch (computed
before training and stored: :mod:`memfit.reference`), the policy with its LoRA switched off, or a second model."""


@dataclass(frozen=True)
class PreferenceStep:
    """How :func:`train_step` computes a preference objective (:mod:`memfit.objectives`)."""

    objective: Preference
    reference: str = "none"
    """One of :data:`REFERENCES`."""
    reference_model: torch.nn.Module | None = None
    """The frozen reference model, for ``reference="model"``."""


def _phase(tracker, name: str) -> None:
    if tracker is not None:
        tracker.set_phase(name)


def micro_batch_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    dtype: str,
    chunked_cross_entropy: int | str = 0,
    doc_ids: torch.Tensor | None = None,
    compile: bool = False,
    positions: torch.Tensor | None = None,
    defer_head_gradient: bool = False,
) -> torch.Tensor:
    """Summed cross-entropy of one micro-batch (the forward half of a step).

    Args:
        model: a :class:`~memfit.models.decoder.Llama`.
        inputs: ``(B, T)`` int64 ids.
        targets: ``(B, T)`` int64; ``-100`` does not count.
        dtype: the dtype policy (``bf16_mixed`` runs the forward under bf16 autocast).
        chunked_cross_entropy: > 0 computes the loss in this many chunks of tokens from the hidden states, never
            materialising the ``(B, T, vocab_size)`` logits; ``auto`` sizes the chunks in tokens
            (:func:`memfit.memory.techniques.loss_chunks`; the config key of the same name).
        doc_ids: ``(B, T)`` ids of the samples packed into each row, or ``None`` (one sequence per row).
        compile: run the loss (or each chunk's) as a ``torch.compile``'d function (``compile: true``; the
            decoder layers are compiled at build time).
        positions: the tokens' RoPE positions, (T,) or (B, T), or ``None`` (``0 .. T - 1``): a sequence-parallel
            rank's slice of its rows (:func:`memfit.memory.ulysses.shard_batch`; ``doc_ids`` are then the whole
            rows').
        defer_head_gradient: with ``chunked_cross_entropy``, make the ``lm_head`` weight gradient at the end of
            the backward rather than in the forward (:class:`~memfit.memory.techniques.DeferredWeightGradient`),
            where :func:`~memfit.memory.techniques.can_defer_head_gradient` allows: an untied, unadapted head in
            one process. The step passes it when the optimizer steps in the backward.

    Returns:
        0-dim fp32 summed loss in nats.
    """
    with autocast_context(dtype, inputs.device.type):
        if chunked_cross_entropy:
            deferred = None
            if defer_head_gradient and techniques.can_defer_head_gradient(model):
                # before the forward: its autograd node must be older than every node of the model's
                deferred = techniques.DeferredWeightGradient(model.lm_head.weight)
            hidden = model(
                inputs, doc_ids, return_hidden=True, positions=positions
            )  # (B, T, dim); one call of the whole model (FSDP)
            weight, chunks, softcap = _chunked_head(model, targets.numel(), chunked_cross_entropy, deferred)
            return techniques.chunked_cross_entropy(
                hidden, weight, targets, chunks, compile=compile, softcap=softcap, deferred=deferred
            )
        logits = model(inputs, doc_ids, positions=positions)  # (B, T, V)
        return (compiled(loss_sum) if compile else loss_sum)(logits, targets)


def _chunked_head(model, hidden_rows: int, chunked_cross_entropy: int | str, deferred=None):
    """``(weight, chunks, softcap)`` of a chunked loss over ``model``'s head: the weight it acts with (LoRA merged
    in, or the deferred alias), the chunks of ``hidden_rows`` tokens, and Gemma 2's logit soft-cap."""
    # (V, dim); with LoRA on lm_head: W + scale * B @ A
    weight = lora_effective_weight(model.lm_head) if deferred is None else deferred.weight
    chunks = techniques.loss_chunks(chunked_cross_entropy, hidden_rows, weight.shape[0])
    # Gemma 2's final_logit_softcapping, which the model's own forward applies to its logits
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return weight, chunks, softcap


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy, computed in fp32.

    Args:
        logits: ``(R, T, vocab_size)``, any float dtype.
        targets: ``(R, T)`` int64; ``-100`` marks tokens that do not count.

    Returns:
        ``(R, T)`` fp32 nats, 0 where the target does not count.
    """
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(targets.shape)


def _reference_logps(
    model: torch.nn.Module, preference: PreferenceStep, inputs, targets, given, options: dict
) -> torch.Tensor | None:
    """A preference micro-batch's reference log-probabilities ``(2B,)``: ``given`` (the batch's stored ones, or
    ``None`` for a reference-free objective), or computed now from the policy with its LoRA off or from the
    resident reference model."""
    if preference.reference == "lora_off":
        with lora_off():
            return sequence_logps(model, inputs, targets, **options)
    if preference.reference == "model":
        return sequence_logps(preference.reference_model, inputs, targets, **options)
    return given


@torch.no_grad()
def sequence_logps(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    dtype: str,
    chunked_cross_entropy: int | str = 0,
    compile: bool = False,
) -> torch.Tensor:
    """Each row's summed log-probability of its counted targets, without gradients (a preference objective's
    reference, :mod:`memfit.reference`).

    Args:
        model: a :class:`~memfit.models.decoder.Decoder`.
        inputs: ``(R, T)`` int64 ids.
        targets: ``(R, T)`` int64; ``-100`` does not count.
        dtype: the dtype policy.
        chunked_cross_entropy: > 0 or ``auto``: from the hidden states chunk by chunk, never the ``(R, T,
            vocab_size)`` logits (see :func:`micro_batch_loss`).
        compile: unused (no gradient: nothing to fuse); accepted with the step's other options.

    Returns:
        ``(R,)`` fp32 log-probabilities in nats.
    """
    del compile
    with autocast_context(dtype, inputs.device.type):
        if chunked_cross_entropy:
            hidden = model(inputs, None, return_hidden=True)  # (R, T, dim)
            weight, chunks, softcap = _chunked_head(model, targets.numel(), chunked_cross_entropy)
            tokens = techniques.chunked_token_losses(hidden, weight, targets, chunks, softcap=softcap)
        else:
            tokens = token_cross_entropy(model(inputs, None), targets)  # (R, T)
    return -tokens.sum(dim=1)  # (R,): the tokens that do not count are 0


def preference_micro_batch_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    reference: torch.Tensor | None,
    pref: Preference,
    norms: StepNorms,
    *,
    dtype: str,
    chunked_cross_entropy: int | str = 0,
    compile: bool = False,
    defer_head_gradient: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One preference micro-batch's share of the step's loss (the forward half of its step).

    The plain path takes each row's log-probability from the ``(2B, T, vocab_size)`` logits. With
    ``chunked_cross_entropy`` no such logits exist: a first pass over the chunks sums each row's log-probability
    without gradients, the objective's derivative with respect to each row's sum is taken on those ``2B`` numbers,
    and the fused chunked cross-entropy then runs with each token weighted by its row's derivative
    (``token_weights``), its gradients made in the forward as for the plain objective. The loss is the
    objective's value, its gradient the weighted sum's: equal to the plain path's (within rounding), at the cost
    of one more ``lm_head`` matmul in the forward.

    Args:
        model: a :class:`~memfit.models.decoder.Decoder`.
        inputs: ``(2B, T)`` int64 ids: the B pairs' chosen rows, then their rejected rows.
        targets: ``(2B, T)`` int64; ``-100`` outside the replies.
        reference: ``(2B,)`` fp32 reference log-probabilities of the rows, or ``None`` (SimPO, ORPO).
        pref: the objective.
        norms: the step's totals (:class:`~memfit.objectives.StepNorms`).
        dtype, chunked_cross_entropy, compile, defer_head_gradient: as :func:`micro_batch_loss`.

    Returns:
        ``(loss, sums)`` as :func:`memfit.objectives.micro_batch_objective`.
    """
    counts = (targets != IGNORE_INDEX).sum(dim=1)  # (2B,)
    reply = targets != IGNORE_INDEX  # (2B, T)
    # ORPO's NLL covers the chosen rows' prompts too: the loss is then over every next token of the rows
    loss_targets = whole_targets(inputs, targets) if pref.nll_covers_prompt else targets

    def objective(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, sums, logps, prompt_nll) from each token's cross-entropy (2B, T)."""
        logps = -(tokens * reply).sum(dim=1)  # (2B,)
        prompt_nll = (tokens * ~reply).sum(dim=1) if pref.nll_covers_prompt else None  # (2B,)
        loss, sums = micro_batch_objective(pref, logps, counts, reference, norms, prompt_nll)
        return loss, sums, logps, prompt_nll

    with autocast_context(dtype, inputs.device.type):
        if not chunked_cross_entropy:
            return objective(token_cross_entropy(model(inputs, None), loss_targets))[:2]
        deferred = None
        if defer_head_gradient and techniques.can_defer_head_gradient(model):
            deferred = techniques.DeferredWeightGradient(model.lm_head.weight)
        hidden = model(inputs, None, return_hidden=True)  # (2B, T, dim)
        weight, chunks, softcap = _chunked_head(model, targets.numel(), chunked_cross_entropy, deferred)
        with torch.no_grad():
            tokens = techniques.chunked_token_losses(
                hidden.detach(), weight.detach(), loss_targets, chunks, softcap=softcap
            )  # (2B, T)
        with torch.enable_grad():
            tokens.requires_grad_(True)
            loss, sums, _, _ = objective(tokens)
            (token_weights,) = torch.autograd.grad(loss, tokens)  # d loss / d cross-entropy, (2B, T)
        weighted = techniques.chunked_cross_entropy(
            hidden, weight, loss_targets, chunks, compile=compile, softcap=softcap, deferred=deferred,
            token_weights=token_weights.reshape(-1),
        )  # fmt: skip
    return loss.detach() + (weighted - weighted.detach()), sums


def _optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, as a function of the optimizer for ``torch.compile`` (one graph per optimizer: the
    guards hold its identity)."""
    optimizer.step()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, ...]],
    *,
    max_grad_norm: float,
    dtype: str,
    chunked_cross_entropy: int | str = 0,
    compile: bool = False,
    skip_nonfinite: bool = False,
    tracker=None,
    router_aux_loss_coef: float | None = None,
    preference: PreferenceStep | None = None,
) -> StepResult:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches.

    Each micro-batch's summed loss is divided by the token count of the *whole* step before its backward, so the
    accumulated gradient equals that of one big batch (token-weighted, not micro-batch-averaged), while only one
    micro-batch's activations are alive at a time.

    With an :class:`~memfit.memory.optim.OptimizerInBackward`, the updates run inside ``backward`` (one parameter
    at a time, each gradient freed at once); ``grad_norm`` is then the norm of the gradients as each was consumed.

    Args:
        model: maps ``(B, T)`` int64 ids to ``(B, T, vocab_size)`` logits.
        optimizer: over the model's trainable parameters; its learning rate is already set for this step.
        micro_batches: ``[(inputs, targets), ...]``, ``[(inputs, targets, doc_ids), ...]`` or ``[(inputs,
            targets, doc_ids, positions), ...]``, each ``(B, T)`` int64 on the model's device (``doc_ids``: packed
            samples, or ``None``; ``positions``: a sequence-parallel rank's, see :func:`micro_batch_loss`).
        max_grad_norm: clip the global gradient norm to this; 0 disables clipping.
        dtype: the dtype policy (``fp32``, ``bf16``, ``bf16_mixed``).
        chunked_cross_entropy: see :func:`micro_batch_loss`.
        compile: see :func:`micro_batch_loss`; the optimizer's step is compiled too where
            :func:`memfit.memory.optimizers.step_compiles` says so.
        skip_nonfinite: when the loss or the gradient norm is not finite, apply no update and return
            ``skipped=True`` (one host sync: the decision is needed before the update). Not with an
            :class:`~memfit.memory.optim.OptimizerInBackward`, whose updates happen during backward.
        tracker: a :class:`~memfit.memory.tracker.MemoryTracker` to tell the phases to, or ``None``.
        router_aux_loss_coef: a mixture of experts' load-balancing loss weight (``moe.router_aux_loss_coef``:
            :func:`memfit.models.moe.aux_loss_coefficient`), each micro-batch's loss weighted by
            ``1 / gradient_accumulation_steps``; a dense model ignores it.
        preference: a preference objective (:class:`PreferenceStep`), or ``None`` for the next-token
            cross-entropy. Its micro-batches are ``(inputs, targets, reference)``: ``(2B, T)`` rows, chosen then
            rejected (:func:`preference_micro_batch_loss`), and ``(2B,)`` reference log-probabilities or ``None``
            (computed here from the policy with its LoRA off, or from ``reference_model``). The loss is the mean
            over the step's pairs.

    Returns:
        A :class:`StepResult` of device tensors (no host sync happened, unless ``skip_nonfinite``).
    """
    in_backward = isinstance(optimizer, OptimizerInBackward)
    # sharded: the token count of the global batch (all ranks), and FSDP averages gradients over the ranks, so
    # each rank's backward is scaled by world_size to make the average the global batch's gradient
    world = dist_.world_size()
    num_tokens = dist_.all_reduce_sum(
        torch.stack([(mb[1] != IGNORE_INDEX).sum() for mb in micro_batches]).sum()
    )
    denom = num_tokens.clamp(min=1).float()
    total = torch.zeros((), dtype=torch.float32, device=micro_batches[0][0].device)
    # a mixture of experts' load-balancing loss: its gradient, per micro-batch, added inside each MoE layer
    aux_scale = moe.aux_loss_coefficient(model, router_aux_loss_coef) / len(micro_batches)
    options = {"dtype": dtype, "chunked_cross_entropy": chunked_cross_entropy, "compile": compile}
    metrics: dict[str, torch.Tensor] = {}
    if preference is not None:
        total, metrics = _preference_backward(
            model, micro_batches, preference, options, in_backward, aux_scale, tracker
        )
    for inputs, targets, *rest in micro_batches if preference is None else ():
        # around the forward and its backward (a checkpointed layer runs its forward again in the backward); a
        # tensor-parallel model's loss runs parallel over the vocabulary in both
        with moe.aux_loss_scale(aux_scale), loss_context(model):
            _phase(tracker, "forward")
            loss = (
                micro_batch_loss(
                    model,
                    inputs,
                    targets,
                    dtype=dtype,
                    chunked_cross_entropy=chunked_cross_entropy,
                    doc_ids=rest[0] if rest else None,
                    compile=compile,
                    positions=rest[1] if len(rest) > 1 else None,
                    defer_head_gradient=in_backward,
                )
                / denom
            )
            _phase(tracker, "backward")
            (loss * world if world > 1 else loss).backward()
        total = total + loss.detach()
    _phase(tracker, "optimizer_step")
    if preference is None:
        total = dist_.all_reduce_sum(total)
    if in_backward:
        grad_norm = optimizer.consume_grad_norm()
    else:
        grad_norm = dist_.grad_norm_and_clip(model, max_grad_norm)
    skipped = skip_nonfinite and not bool(
        torch.isfinite(total) & torch.isfinite(grad_norm)
    )  # the same on every rank
    if not skipped:
        if compile and optimizers.step_compiles(optimizer):
            compiled(_optimizer_step, fullgraph=False)(optimizer)
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _phase(tracker, "other")
    return StepResult(
        loss=total, grad_norm=grad_norm, num_tokens=num_tokens, skipped=skipped, metrics=metrics
    )


def _preference_backward(
    model,
    micro_batches,
    preference: PreferenceStep,
    options: dict,
    in_backward: bool,
    aux_scale: float,
    tracker,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The forwards and backwards of a preference step's micro-batches (see :func:`train_step`): returns the
    step's loss (all ranks) and its metrics."""
    world = dist_.world_size()
    pref = preference.objective
    device = micro_batches[0][0].device
    pairs = sum(mb[0].shape[0] // 2 for mb in micro_batches)
    chosen = torch.stack([nll_tokens(pref, mb[0], mb[1]) for mb in micro_batches]).sum()
    totals = dist_.all_reduce_sum(torch.stack([torch.tensor(pairs, device=device), chosen]).float())
    norms = StepNorms(pairs=totals[0].clamp(min=1), chosen_tokens=totals[1].clamp(min=1))
    total = torch.zeros((), dtype=torch.float32, device=device)
    sums = None
    for inputs, targets, reference in micro_batches:
        with moe.aux_loss_scale(aux_scale):
            _phase(tracker, "forward")
            reference = _reference_logps(model, preference, inputs, targets, reference, options)
            loss, mb_sums = preference_micro_batch_loss(
                model, inputs, targets, reference, pref, norms, **options, defer_head_gradient=in_backward
            )
            _phase(tracker, "backward")
            (loss * world if world > 1 else loss).backward()
        total = total + loss.detach()
        sums = mb_sums if sums is None else sums + mb_sums
    return dist_.all_reduce_sum(total), metrics_from_sums(pref, dist_.all_reduce_sum(sums), norms)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    *,
    dtype: str,
    device: torch.device,
    chunked_cross_entropy: int | str = 0,
    compile: bool = False,
    preference: PreferenceStep | None = None,
) -> float:
    """Mean cross-entropy per counted token over ``batches`` (the same fixed validation batches at every call);
    with a preference objective, its loss over the batches' pairs (``(inputs, targets, reference)`` batches, as
    :func:`train_step`'s).

    Sharded, each rank passes its own part of the batches, and the sums are all-reduced: every rank returns the
    loss over all ranks' batches.

    Args:
        model: the model (put in eval mode for the call).
        batches: ``(inputs, targets, doc_ids)`` or ``(inputs, targets, doc_ids, positions)`` on the CPU (see
            :func:`train_step`); ``targets`` ``-100`` does not count.
        dtype: the dtype policy.
        device: where the model is.
        chunked_cross_entropy: see :func:`micro_batch_loss`.
        compile: see :func:`micro_batch_loss`.

    Returns:
        Validation loss in nats/token (NaN when no token counted).
    """
    was_training = model.training
    model.eval()
    if preference is not None:
        options = {"dtype": dtype, "chunked_cross_entropy": chunked_cross_entropy, "compile": compile}
        loss = _evaluate_preference(model, batches, preference, options, device)
        model.train(was_training)
        return loss
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, targets, doc_ids, *rest in batches:
        with loss_context(model):
            loss = micro_batch_loss(
                model,
                inputs.to(device),
                targets.to(device),
                dtype=dtype,
                chunked_cross_entropy=chunked_cross_entropy,
                doc_ids=None if doc_ids is None else doc_ids.to(device),
                compile=compile,
                positions=rest[0].to(device) if rest else None,
            )
        total += loss.double()
        count += (targets != IGNORE_INDEX).sum().to(device)
    model.train(was_training)
    total, count = dist_.all_reduce_sum(total), int(dist_.all_reduce_sum(count).item())
    return float(total.item() / count) if count else math.nan


def _evaluate_preference(model, batches, preference: PreferenceStep, options: dict, device) -> float:
    """The preference objective over every pair of ``batches`` (all ranks'): the mean of the pairs' losses, plus
    the NLL term over the tokens it covers. NaN without a pair."""
    pref = preference.objective
    # the pairs' losses and the NLL term's cross-entropy; the pairs and the NLL term's tokens
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets, reference, *rest in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        if rest:  # which pairs count: an uncounted pair's rows score nothing (data.run.preference_data)
            counted = rest[0].to(device).repeat(2)  # (2B,)
            targets = targets.masked_fill(~counted[:, None], IGNORE_INDEX)
        reference = None if reference is None else reference.to(device)
        reference = _reference_logps(model, preference, inputs, targets, reference, options)
        B = inputs.shape[0] // 2
        logps = sequence_logps(model, inputs, targets, **options)
        losses, _ = pair_terms(pref, logps, (targets != IGNORE_INDEX).sum(dim=1), reference)
        if rest:
            losses = losses * counted[:B]
        sums[0] += losses.double().sum()
        if pref.nll_weight:  # the chosen rows' cross-entropy over what the NLL term covers
            covered = whole_targets(inputs, targets) if pref.nll_covers_prompt else targets
            sums[1] += -sequence_logps(model, inputs[:B], covered[:B], **options).double().sum()
        pairs = counted[:B].sum().cpu() if rest else torch.tensor(B)
        counts += torch.stack([pairs, nll_tokens(pref, inputs, targets).cpu()]).to(counts)
    sums, counts = dist_.all_reduce_sum(sums), dist_.all_reduce_sum(counts)
    pairs, chosen = float(counts[0].item()), float(counts[1].item())
    if not pairs:
        return math.nan
    nll = pref.nll_weight * float(sums[1].item()) / max(chosen, 1.0) if pref.nll_weight else 0.0
    return float(sums[0].item()) / pairs + nll


STEP_OPTIONS = ("dtype", "chunked_cross_entropy", "compile")
"""The config keys :func:`train_step` takes as keyword arguments of the same name (with ``max_grad_norm``)."""
EVALUATION_OPTIONS = ("dtype", "chunked_cross_entropy", "compile")
"""Those :func:`evaluate` takes too."""


def preference_step(
    cfg: TrainConfig, reference_model: torch.nn.Module | None = None
) -> PreferenceStep | None:
    """The :class:`PreferenceStep` of a run with a preference ``objective`` (``reference_model``: a ``resident``
    reference's, :attr:`memfit.build.TrainingModel.reference`), else ``None``."""
    if cfg.objective not in PREFERENCE_OBJECTIVES:
        return None
    p = cfg.preference
    objective = Preference(cfg.objective, p.beta, p.label_smoothing, p.simpo_gamma, p.cpo_alpha)
    where = {"none": "none", "lora_off": "lora_off", "precomputed": "batch", "resident": "model"}
    return PreferenceStep(objective, where[reference_mode(cfg)], reference_model)


def train_step_options(cfg: TrainConfig, reference_model: torch.nn.Module | None = None) -> dict[str, Any]:
    """The keyword arguments of :func:`train_step` that ``cfg`` sets (the loop and the estimator pass the same;
    ``reference_model`` as :func:`preference_step`)."""
    return {
        "max_grad_norm": cfg.max_grad_norm,
        "router_aux_loss_coef": cfg.moe.router_aux_loss_coef,
        "preference": preference_step(cfg, reference_model),
        **{key: getattr(cfg, key) for key in STEP_OPTIONS},
    }


def evaluation_options(
    cfg: TrainConfig, device: torch.device, reference_model: torch.nn.Module | None = None
) -> dict[str, Any]:
    """The keyword arguments of :func:`evaluate` that ``cfg`` sets: :func:`train_step_options`' evaluation part, and
    the model's ``device``."""
    step = train_step_options(cfg, reference_model)
    return {
        **{key: step[key] for key in EVALUATION_OPTIONS},
        "device": device,
        "preference": step["preference"],
    }
