"""The pre-flight check: before a run allocates anything, predict whether it fits (in the free memory, and in
``memory_budget`` when it is set), and refuse it with the predicted breakdown and the planner's cheapest fix when it
does not (``preflight: true``, the default)."""

from __future__ import annotations

import dataclasses
from typing import Any

import psutil
import torch
from tqdm.auto import tqdm

from memfit import distributed as dist_
from memfit.config import TrainConfig, device_type, memory_budget_bytes
from memfit.errors import PreflightError
from memfit.memory.allocator import CUDA_CONTEXT_BYTES_ESTIMATE
from memfit.memory.host import (
    fixes_mmap_threshold,
    mmap_threshold_bytes,
    process_overhead_bytes,
    tensor_share_bytes,
)
from memfit.models.config import DecoderConfig
from memfit.objectives import rows_per_micro_batch
from memfit.planner.closed_form import model_state_bytes_closed_form
from memfit.planner.estimate import Estimate, estimate_run
from memfit.planner.phases import load_peak_bytes
from memfit.planner.plan import PlanRequest, cheapest_fix
from memfit.planner.report import format_estimate
from memfit.units import GIB, MIB, format_bytes


def preflight(cfg: TrainConfig, mcfg: DecoderConfig, seq_len: int, device: torch.device) -> str:
    """Check that the run will fit before anything is allocated, and refuse it when it will not.

    A cheap bound comes first: the closed-form model states plus a generous activation bound (34 bytes per token
    and hidden unit per layer in 16 bits, doubled for fp32, after Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", plus three copies of the fp32 logits), or on CPU the load of
    ``checkpoint_dir`` where that is more (:func:`memfit.planner.phases.load_peak_bytes`). When the bound is under
    half of what the tensors may have, the run fits and no trace is made. Otherwise the run's own step is traced
    on fake tensors (:func:`memfit.planner.estimate.estimate_run`) at the widest batch the data can produce, and
    compared with free device memory (CUDA: ``torch.cuda.mem_get_info``; the driver's total, paged memory
    included) or the host's available memory (CPU: allocator peak plus host-side bytes), and with
    ``memory_budget`` when it is set (CUDA: the predicted device total; CPU: the predicted peak resident set of
    this process). Sharded ranks check the bound only (the trace needs a process of its own: ``memfit estimate
    world_size=N``, or :func:`preflight_sharded` before torchrun starts).

    Args:
        cfg: the run config.
        mcfg: the architecture.
        seq_len: the widest batch's tokens per row.
        device: this rank's device.

    Returns:
        One line for the log saying what was checked.

    Raises:
        PreflightError: the run is predicted not to fit; the message holds the predicted breakdown, what is
            available (or the budget) and the planner's cheapest fix.
    """
    world = dist_.world_size()
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
        where = f"free on {device}"
    else:
        available = psutil.virtual_memory().available
        where = "available host memory"
    budget = memory_budget_bytes(cfg)
    fixed = fixes_mmap_threshold(cfg.mmap_threshold, mcfg.dim, device.type, cfg.method, dtype=cfg.dtype)
    held = 0 if budget is None else _held_besides_tensors(device.type, fixed, _threshold(cfg))
    if budget is not None and budget <= held:  # nothing left for the tensors: no plan can fit it
        raise PreflightError(_budget_below_what_is_held(cfg, mcfg, seq_len, device.type, budget, held, world))
    # what the tensors may have: the free memory, and the budget less what the device or process holds besides them
    limit = (
        available
        if budget is None
        else min(available, _tensor_share(device.type, budget, fixed, _threshold(cfg)))
    )
    states = model_state_bytes_closed_form(cfg, mcfg, world)
    tokens = rows_per_micro_batch(cfg) * seq_len
    act_bytes = 2 if cfg.dtype != "fp32" else 4
    bound = (
        states["parameters"]
        + states["gradients"]
        + states["optimizer_state"]
        + 17 * act_bytes * tokens * mcfg.dim * mcfg.num_layers
        + 3 * 4 * tokens * mcfg.vocab_size
    )
    if device.type == "cpu" and world == 1:  # loading can hold more than a step: QLoRA's quantization
        bound = max(bound, load_peak_bytes(cfg, mcfg) or 0)
    within = "" if budget is None else f", within memory_budget={cfg.memory_budget}"
    if bound < limit / 2:
        return f"pre-flight: fits (bound {format_bytes(bound)}, {available / GIB:.1f} GiB {where}{within})"
    if world > 1:
        if bound > limit:
            over = (
                where if limit == available else f"memory_budget={cfg.memory_budget} less what the rank holds"
            )
            tqdm.write(
                f"note: pre-flight bound {format_bytes(bound)} per rank exceeds the {limit / GIB:.1f} GiB {over}; "
                f"`memfit estimate world_size={world} ...` traces the exact peak"
            )
        per_rank = "" if budget is None else f", memory_budget={cfg.memory_budget} per rank"
        return (
            f"pre-flight: bound {format_bytes(bound)} per rank, {available / GIB:.1f} GiB {where}{per_rank}"
        )
    cfg = _on(cfg, device.type)  # device=auto: trace (and fix) the run for the device it resolved to
    estimate = estimate_run(cfg, seq_len=seq_len, model_config=mcfg)
    # CPU: the largest phase's tensors (the load, a step or a save: planner/phases.py)
    need = estimate.device_total_bytes if device.type == "cuda" else estimate.run_peak_bytes
    over_budget = budget is not None and budgeted_bytes(estimate, device.type) > budget
    if over_budget and (need <= available or limit < available):  # the budget is the tighter: its fix
        raise PreflightError(_over_budget(cfg, estimate, budget, device.type))
    if need <= available:
        # CPU: `available` leaves out what this process holds already (its baseline, in the peak RSS predicted)
        rss = (
            ""
            if estimate.host_peak_rss_bytes is None
            else f", peak RSS {format_bytes(estimate.host_peak_rss_bytes)}"
        )
        return (
            f"pre-flight: predicted peak {format_bytes(need)} of {available / GIB:.1f} GiB {where} "
            f"(traced in {estimate.seconds:.1f} s{rss}{within})"
        )
    fix = _cheapest_fix(cfg, available)
    raise PreflightError(
        f"the run is predicted not to fit: it needs {need / GIB:.2f} GiB at its peak, {available / GIB:.2f} GiB are "
        f"{where}.\n{format_estimate(estimate)}\n{fix}\nSet preflight=false to start anyway."
    )


def preflight_sharded(cfg: TrainConfig, world_size: int) -> str | None:
    """``memory_budget`` of a sharded run, checked before torchrun starts its ranks (``memfit pretrain nproc=N``):
    one rank's step traced on fake tensors in a fake process group of ``world_size`` ranks
    (:func:`memfit.planner.estimate.estimate_run`, as ``memfit estimate world_size=N``), at ``seq_len`` (or the
    model's ``max_seq_len``: the widest batch the data can produce is not known before the data is read). The
    free memory of each rank's device is checked by the rank itself (:func:`preflight`).

    Args:
        cfg: the run config.
        world_size: the ranks torchrun will start.

    Returns:
        The line for the log, or ``None`` when there is nothing to check (``preflight: false``, no
        ``memory_budget``).

    Raises:
        PreflightError: one rank is predicted over ``memory_budget``; the message holds the predicted breakdown and
            the planner's cheapest fix for ``world_size`` ranks.
    """
    budget = memory_budget_bytes(cfg)
    if not cfg.preflight or budget is None:
        return None
    target = device_type(cfg.device)
    cfg = _on(cfg, target)
    estimate = estimate_run(cfg, world_size=world_size)
    need = budgeted_bytes(estimate, target)
    if need > budget:
        raise PreflightError(_over_budget(cfg, estimate, budget, target, world_size))
    return (
        f"pre-flight: predicted peak {format_bytes(need)} per rank, within memory_budget={cfg.memory_budget} "
        f"(traced in {estimate.seconds:.1f} s for {world_size} ranks)"
    )


def budgeted_bytes(estimate: Estimate, device_type: str) -> int:
    """What ``memory_budget`` bounds, predicted: on CUDA (``device_type``) the device total as the driver shows it
    (:attr:`~memfit.planner.estimate.Estimate.device_total_bytes`), on CPU the process's peak resident set
    (:attr:`~memfit.planner.estimate.Estimate.host_peak_rss_bytes`; where it cannot be predicted, the traced
    peak and host bytes plus what this process holds besides its tensors)."""
    if device_type == "cuda":
        return estimate.device_total_bytes
    if estimate.host_peak_rss_bytes is not None:
        return estimate.host_peak_rss_bytes
    return estimate.run_peak_bytes + process_overhead_bytes(fixed=estimate.fixes_mmap_threshold)


def _held_besides_tensors(device_type: str, fixed: bool, threshold: int) -> int:
    """What of ``memory_budget`` a run's tensors cannot have: the CUDA context, or (CPU) the process's own
    resident set and what stepping adds to it (:func:`memfit.memory.host.process_overhead_bytes`; ``fixed``: the
    run fixes glibc's mmap threshold, :func:`memfit.memory.host.fixes_mmap_threshold`, at ``threshold``)."""
    if device_type == "cuda":
        return CUDA_CONTEXT_BYTES_ESTIMATE
    return process_overhead_bytes(fixed=fixed, threshold=threshold, step_peak_bytes=0)


def _tensor_share(device_type: str, budget: int, fixed: bool, threshold: int) -> int:
    """What of ``memory_budget`` a run's tensors may have: the budget less the CUDA context, or (CPU) the largest
    tensor peak whose predicted RSS fits it (:func:`memfit.memory.host.tensor_share_bytes`: the free heap grows with
    the tensors)."""
    if device_type == "cuda":
        return max(0, budget - CUDA_CONTEXT_BYTES_ESTIMATE)
    return tensor_share_bytes(budget, fixed=fixed, threshold=threshold)


def _threshold(cfg: TrainConfig) -> int:
    """The mmap threshold ``cfg``'s run fixes where it fixes one, bytes
    (:func:`memfit.memory.host.mmap_threshold_bytes`)."""
    return mmap_threshold_bytes(cfg.method, cfg.dtype)


def _on(cfg: TrainConfig, device_type: str) -> TrainConfig:
    """``cfg`` with ``device`` the type it resolves to (``auto``: what this process found)."""
    return cfg if cfg.device == device_type else dataclasses.replace(cfg, device=device_type)


def _budget_below_what_is_held(
    cfg: TrainConfig,
    mcfg: DecoderConfig,
    seq_len: int,
    device_type: str,
    budget: int,
    held: int,
    world_size: int,
) -> str:
    """The refusal of a ``memory_budget`` at or below what the process (CPU) or the CUDA context holds before
    training, with the smallest budget the run fits as configured (one process: the traced prediction the
    budget check compares; sharded: what to run to get it)."""
    what = "the CUDA context" if device_type == "cuda" else "its resident set and what stepping adds to it"
    head = (
        f"memory_budget={cfg.memory_budget} ({format_bytes(budget)}) is not more than what this process holds "
        f"before training: {format_bytes(held)} ({what}), so no tensor of the run would fit in it."
    )
    if world_size > 1:
        smallest = (
            f"`memfit estimate world_size={world_size} ...` predicts what one rank needs besides that "
            f"(a budget is per rank)."
        )
    else:
        need = budgeted_bytes(
            estimate_run(_on(cfg, device_type), seq_len=seq_len, model_config=mcfg), device_type
        )
        smallest = (
            f"The smallest budget this run fits as configured: memory_budget={-(-need // MIB)}MiB "
            f"({format_bytes(need)} predicted at its peak; `memfit plan` finds switches that need less)."
        )
    return f"{head}\n{smallest}\nRaise memory_budget, or set preflight=false to start anyway."


def _over_budget(
    cfg: TrainConfig, estimate: Estimate, budget: int, device_type: str, world_size: int = 1
) -> str:
    """The refusal of a run predicted over ``memory_budget``: the prediction, the budget, the breakdown, the fix."""
    what = (
        "the device total, as the driver shows it" if device_type == "cuda" else "the process's resident set"
    )
    per_rank = f" per rank of {world_size}" if world_size > 1 else ""
    # the fix fits the tensors' share of the budget (what the CUDA context or, on CPU, the process's own resident
    # set leaves), less plan's margin: its predicted peak passes this check
    share = _tensor_share(device_type, budget, estimate.fixes_mmap_threshold, _threshold(cfg))
    fix = _cheapest_fix(cfg, share, world_size)
    return (
        f"the run is predicted not to fit memory_budget={cfg.memory_budget}: it needs "
        f"{budgeted_bytes(estimate, device_type) / GIB:.2f} GiB at its peak{per_rank} ({what}), over the budget of "
        f"{budget / GIB:.2f} GiB.\n{format_estimate(estimate)}\n{fix}\nRaise memory_budget, or set "
        f"preflight=false to start anyway."
    )


def _cheapest_fix(cfg: TrainConfig, budget: int, world_size: int = 1) -> str:
    """The planner's fix that changes the fewest switches and fits ``budget`` bytes, as override text.

    Args:
        cfg: the run config.
        budget: bytes per device the tensors may have, all of them (the available memory, which already leaves
            out what this process holds, or the tensors' share of ``memory_budget``).
        world_size: ranks of the run.
    """
    fix = cheapest_fix(PlanRequest(cfg, budget, world_size, host_overhead_bytes=0))
    if fix is None:
        return "No combination of memory switches fits; use more ranks (nproc=N), a smaller batch_size or seq_len."
    keys = " ".join(f"{k}={_yaml_scalar(fix.switches[k])}" for k in fix.changes)
    return (
        f"Cheapest fix (memfit plan): {keys} (predicted peak {fix.peak_bytes / GIB:.2f} GiB, relative throughput "
        f"{fix.relative_throughput:.2f})"
    )


def _yaml_scalar(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
