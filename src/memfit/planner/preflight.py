"""The pre-flight check: before a run allocates anything, predict whether it fits, and refuse it with the
predicted breakdown and the planner's cheapest fix when it does not (``preflight: true``, the default)."""

from __future__ import annotations

from typing import Any

import psutil
import torch
from tqdm.auto import tqdm

from memfit import distributed as dist_
from memfit.config import TrainConfig
from memfit.errors import PreflightError
from memfit.models.llama import LlamaConfig
from memfit.planner.closed_form import model_state_bytes_closed_form
from memfit.planner.estimate import estimate_run
from memfit.planner.plan import cheapest_fix
from memfit.planner.report import format_estimate
from memfit.units import GIB, format_bytes


def preflight(cfg: TrainConfig, mcfg: LlamaConfig, seq_len: int, device: torch.device) -> str:
    """Check that the run will fit before anything is allocated, and refuse it when it will not.

    A cheap bound comes first: the closed-form model states plus a generous activation bound (34 bytes per token
    and hidden unit per layer in 16 bits, doubled for fp32, after Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", plus three copies of the fp32 logits). When the bound is under
    half of what is available, the run fits and no trace is made. Otherwise the run's own step is traced on fake
    tensors (:func:`memfit.planner.estimate.estimate_run`) at the widest batch the data can produce, and compared
    with free device memory (CUDA: ``torch.cuda.mem_get_info``; the driver's total, paged memory included) or the
    host's available memory (CPU: allocator peak plus host-side bytes). Sharded ranks check the bound only (the
    trace needs a process of its own: ``memfit estimate world_size=N``).

    Args:
        cfg: the run config.
        mcfg: the architecture.
        seq_len: the widest batch's tokens per row.
        device: this rank's device.

    Returns:
        One line for the log saying what was checked.

    Raises:
        PreflightError: the run is predicted not to fit; the message holds the predicted breakdown, what is
            available and the planner's cheapest fix.
    """
    world = dist_.world_size()
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
        where = f"free on {device}"
    else:
        available = psutil.virtual_memory().available
        where = "available host memory"
    states = model_state_bytes_closed_form(cfg, mcfg, world)
    tokens = cfg.batch_size * seq_len
    act_bytes = 2 if cfg.dtype != "fp32" else 4
    bound = (
        states["parameters"]
        + states["gradients"]
        + states["optimizer_state"]
        + 17 * act_bytes * tokens * mcfg.dim * mcfg.num_layers
        + 3 * 4 * tokens * mcfg.vocab_size
    )
    if bound < available / 2:
        return f"pre-flight: fits (bound {format_bytes(bound)}, {available / GIB:.1f} GiB {where})"
    if world > 1:
        if bound > available:
            tqdm.write(
                f"note: pre-flight bound {format_bytes(bound)} per rank exceeds the {available / GIB:.1f} GiB "
                f"{where}; `memfit estimate world_size={world} ...` traces the exact peak"
            )
        return f"pre-flight: bound {format_bytes(bound)} per rank, {available / GIB:.1f} GiB {where}"
    estimate = estimate_run(cfg, seq_len=seq_len, model_config=mcfg)
    need = estimate.device_total_bytes if device.type == "cuda" else estimate.peak_bytes + estimate.host_bytes
    if need <= available:
        # CPU: `available` leaves out what this process holds already (its baseline, in the peak RSS predicted)
        rss = (
            ""
            if estimate.host_peak_rss_bytes is None
            else f", peak RSS {format_bytes(estimate.host_peak_rss_bytes)}"
        )
        return (
            f"pre-flight: predicted peak {format_bytes(need)} of {available / GIB:.1f} GiB {where} "
            f"(traced in {estimate.seconds:.1f} s{rss})"
        )
    fix = _cheapest_fix(cfg, available)
    raise PreflightError(
        f"the run is predicted not to fit: it needs {need / GIB:.2f} GiB at its peak, {available / GIB:.2f} GiB are "
        f"{where}.\n{format_estimate(estimate)}\n{fix}\nSet preflight=false to start anyway."
    )


def _cheapest_fix(cfg: TrainConfig, available: int) -> str:
    """The planner's fix that changes the fewest switches and fits ``available`` bytes, as override text."""
    # the available memory already leaves out what this process holds: the tensors may have all of it
    fix = cheapest_fix(cfg, available, host_overhead_bytes=0)
    if fix is None:
        return "No combination of memory switches fits; use more ranks (nproc=N), a smaller batch_size or seq_len."
    keys = " ".join(f"{k}={_yaml_scalar(fix.switches[k])}" for k in fix.changes)
    return (
        f"Cheapest fix (memfit plan): {keys} (predicted peak {fix.peak_bytes / GIB:.2f} GiB, relative throughput "
        f"{fix.relative_throughput:.2f})"
    )


def _yaml_scalar(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
