"""The planner's reports: ``memfit estimate``'s (:func:`format_estimate`), and ``memfit plan``'s: the table, the
no-fit message, the cost model's constants, and the best plan as a runnable, commented YAML config
(:func:`plan_yaml`)."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import yaml

from memfit.config import TrainConfig, config_to_dict
from memfit.memory import switches
from memfit.planner.cost import COST_CONSTANTS
from memfit.planner.estimate import TRACED_LAYERS, Estimate
from memfit.planner.plan import Plan, PlanRow
from memfit.units import GIB, MIB, format_bytes


def format_estimate(e: Estimate) -> str:
    """A human-readable report of an :class:`Estimate`: in GiB (1024**3 bytes), or in MiB (1024**2 bytes) when every
    number is below 1 GiB, as :func:`format_plan` does."""
    largest = max(e.peak_bytes, e.device_total_bytes, e.host_bytes)
    unit, size = ("GiB", GIB) if largest >= GIB else ("MiB", MIB)
    ranks = f" per rank of {e.world_size}" if e.world_size > 1 else ""
    sp = (e.config.get("distributed") or {}).get("sequence_parallel", 1)
    if e.world_size > 1 and sp > 1:
        ranks += f" (sequence parallel {sp}: {e.seq_len // sp} tokens of each sequence a rank)"
    source = e.config.get("checkpoint_dir") or e.config.get("model")  # as TrainConfig.model_source
    lines = [
        f"model {source} ({e.num_params:,} parameters, {e.num_trainable_params:,} trainable), "
        f"method {e.config.get('method')}, dtype {e.config.get('dtype')}, batch {e.batch_size} x "
        f"{e.config.get('gradient_accumulation_steps')} x {e.seq_len} tokens, optimizer {e.config.get('optimizer')}",
        f"peak memory{ranks}: {e.peak_bytes / size:.2f} {unit} (allocator), in {e.phase}",
    ]
    width = max(len(k) for k in e.breakdown)
    for k, v in e.breakdown.items():
        if v or k != "unsharded_parameters":
            lines.append(f"  {k:<{width}}  {v / size:8.2f} {unit}")
    if e.peak_reserved_bytes is not None:
        lines.append(
            f"peak reserved{ranks}: {e.peak_reserved_bytes / size:.2f} {unit} (the caching allocator's segments: "
            f"+{(e.peak_reserved_bytes - e.peak_bytes) / size:.2f} {unit} of rounding, cache and cuBLAS workspace)"
        )
    if e.config.get("device") == "cuda":
        lines.append(f"device total (as the driver shows it): {e.device_total_bytes / size:.2f} {unit}")
    lines.append(f"host memory kept there by design: {e.host_bytes / size:.2f} {unit}")
    for k, v in e.unseen.items():
        lines.append(f"  {k}: {v / size:.2f} {unit}")
    if e.host_peak_rss_bytes is not None and e.process_baseline_bytes is not None:
        tensors = e.peak_bytes + e.host_bytes
        other = e.host_peak_rss_bytes - e.process_baseline_bytes - tensors
        u, n = (
            ("GiB", GIB) if e.host_peak_rss_bytes >= GIB else ("MiB", MIB)
        )  # its own unit: it holds the most
        lines.append(
            f"host peak RSS of the run (CPU): {e.host_peak_rss_bytes / n:.2f} {u} = process baseline "
            f"{e.process_baseline_bytes / n:.2f} {u} (this process's resident set, imports done) + tensors "
            f"{tensors / n:.2f} {u} + {other / n:.2f} {u} kept by the C allocator, threads and kernels"
        )
    phases = e.phase_peaks
    if len(phases) > 1:  # the phases around the step, where predicted (planner/phases.py, memfit.reference)
        lines.append(
            "live tensors by phase of the run: "
            + ", ".join(f"{k} {v / size:.2f} {unit}" for k, v in phases.items())
        )
    if e.routing is not None:
        lines.append(_routing_line(e, size, unit))
    lines.append("model states, closed form vs traced:")
    for k in ("parameters", "gradients", "optimizer_state"):
        closed, traced = e.model_states[k], e.traced_model_states[k]
        mark = "" if closed == traced else "  (differ)"
        lines.append(f"  {k:<15}  {closed / size:8.3f} {unit}  {traced / size:8.3f} {unit}{mark}")
    lines.append(f"estimated in {e.seconds:.1f} s; {_how_traced(e.trace)}")
    return "\n".join(lines)


def _routing_line(e: Any, size: int, unit: str) -> str:
    """A mixture of experts' routing assumption and the other figure (:attr:`Estimate.routing`)."""
    routing, other = e.routing, e.routing["other"]
    said = {
        "balanced": f"balanced top-k, the busiest expert {routing['moe_skew']}x its share (estimate.moe_skew)",
        "collapsed": "the bound: every token at the same k experts (estimate.moe_bound)",
    }
    other_said = (
        "the bound (every token at the same k experts)" if other["assumption"] == "collapsed" else "balanced"
    )
    rss = other.get("host_peak_rss_bytes")
    return (
        f"routing (mixture of experts): {said[routing['assumption']]}; {other_said}: peak "
        f"{other['peak_bytes'] / size:.2f} {unit}" + (f", peak RSS {rss / size:.2f} {unit}" if rss else "")
    )


def _how_traced(trace: dict) -> str:
    """How an estimate was obtained (:attr:`memfit.planner.estimate.Estimate.trace`), in words."""
    if not trace:
        return "traced"
    if trace.get("composed"):
        traced = " and ".join(str(n) for n in trace["layers_traced"])
        return (
            f"{trace['layers']} decoder layers composed from traces of {traced} "
            f"({trace['layers'] - max(trace['layers_traced'])} layers not traced)"
        )
    return f"all {trace['layers']} decoder layers traced ({trace.get('why_not_composed')})"


def explain_estimate(e: Estimate) -> str:
    """How an estimate was obtained, for ``memfit estimate --explain``: what was traced, what was composed, and
    the seconds of each trace (:attr:`memfit.planner.estimate.Estimate.trace`)."""
    t = e.trace
    layers = t.get("layers", 0)
    seconds = " + ".join(f"{s:.2f}" for s in t.get("trace_seconds", []))
    lines = [
        "how this estimate was obtained:",
        f"  one train_step of the run itself, traced on fake tensors (nothing allocated), in {e.seconds:.2f} s",
    ]
    if t.get("composed"):
        small = t["layers_traced"]
        lines += [
            f"  traced: the run with {' and with '.join(str(n) for n in small)} decoder layers ({seconds} s)",
            f"  composed: the {layers}-layer step from the two, the middle layer's events repeated for the "
            f"{layers - max(small)} layers not traced ({t['events_traced']:,} events traced, "
            f"{t['events_composed']:,} in the composed step)",
            f"  layer-traces: {sum(small)} instead of {layers} (the whole model: memfit estimate --full-trace)",
        ]
    else:
        lines.append(f"  traced: all {layers} decoder layers ({seconds} s): {t.get('why_not_composed')}")
    return "\n".join(lines)


def how_estimated(made: list[Estimate], asked: int | None = None) -> dict[str, Any]:
    """How a plan's estimates were obtained, counted.

    Args:
        made: every estimate the plan ran (each once).
        asked: how many it asked for, when some were answered from memory (``seq_len=max``).

    Returns:
        ``estimates`` (run), ``reused`` (answered from memory), ``composed``, ``traced_whole`` (reason -> count;
        an event index in a reason read as N), ``layer_traces`` (decoder layers traced, all estimates) and
        ``layer_traces_whole`` (had each traced its whole model), ``seconds`` (the estimates' own).
    """
    whole: dict[str, int] = {}
    for e in made:
        if not e.trace.get("composed"):  # one reason, whichever event it names
            why = re.sub(r"event \d+", "event N", str(e.trace.get("why_not_composed")))
            whole[why] = whole.get(why, 0) + 1
    return {
        "estimates": len(made),
        "reused": max(0, (asked or len(made)) - len(made)),
        "composed": sum(1 for e in made if e.trace.get("composed")),
        "traced_whole": whole,
        "layer_traces": sum(sum(e.trace.get("layers_traced", [])) for e in made),
        "layer_traces_whole": sum(e.trace.get("layers", 0) for e in made),
        "seconds": sum(e.seconds for e in made),
    }


def format_how_estimated(how: dict[str, Any]) -> str:
    """:func:`how_estimated` in words (``memfit plan --explain``)."""
    lines = [
        f"how the estimates were obtained: {how['estimates']} estimate{'' if how['estimates'] == 1 else 's'} "
        f"in {how['seconds']:.1f} s"
        + (
            f", {how['reused']} more answered from memory (the same config asked again)"
            if how["reused"]
            else ""
        )
        + f"; {how['composed']} composed from traces of "
        f"{' and '.join(str(n) for n in TRACED_LAYERS)} decoder layers, "
        f"{sum(how['traced_whole'].values())} traced whole",
    ]
    lines += [f"  traced whole ({n}): {why}" for why, n in how["traced_whole"].items()]
    lines.append(
        f"  decoder layers traced: {how['layer_traces']:,} (tracing every model whole: {how['layer_traces_whole']:,})"
    )
    return "\n".join(lines)


def no_fit_message(p: Plan) -> str:
    """Why nothing fits, the smallest peak seen, and what would be needed (budget, ranks, shorter batches)."""
    estimated = [r for r in p.rows if r.estimated]
    least = p.probe if p.probe is not None and p.probe.estimated else None
    if least is None and estimated:
        least = min(estimated, key=lambda r: r.peak_bytes)
    if least is None:
        least = min(p.rows, key=lambda r: r.peak_bytes)
    kind = "estimated" if least.estimated else "a lower bound"
    need = (least.peak_bytes + p.host_overhead_bytes) / (1 - p.margin)
    overhead = (
        f" and the process's own {format_bytes(p.host_overhead_bytes)} (imports, kernels, the C heap's free memory)"
        if p.host_overhead_bytes
        else ""
    )
    msg = (
        f"nothing fits in {format_bytes(p.budget_bytes)} ({format_bytes(p.usable_bytes)} usable after the "
        f"{p.margin:.0%} margin{overhead}) on each of {p.world_size} rank(s): the least memory, with "
        f"{least.label()}, is {format_bytes(least.peak_bytes)} ({kind}). Needs a budget of at least "
        f"{format_bytes(need)}"
    )
    e = least.estimate
    if e is not None:
        states = e.breakdown.get("parameters", 0) + e.breakdown.get("gradients", 0)
        states += e.breakdown.get("optimizer_state", 0)
        rest = e.peak_bytes - states
        if rest < p.usable_bytes and states > 0:
            ranks = p.world_size * math.ceil(states / (p.usable_bytes - rest))
            msg += (
                f", or about world_size={ranks} (parameters, gradients and optimizer state, "
                f"{format_bytes(states)} here, fall as 1/N; bitsandbytes optimizers do not run sharded)"
            )
        msg += (
            f", or a smaller batch_size or seq_len (activations and temporaries are {format_bytes(rest)} "
            f"at that peak)"
        )
    return msg


def format_plan(p: Plan, top: int = 10) -> str:
    """The table of ``memfit plan``: rank, switches, peak (allocator), device total, host (GiB = 1024**3
    bytes), relative throughput, fits, and whether the numbers are estimated or bounds."""
    unit, size = ("GiB", GIB) if p.budget_bytes >= GIB else ("MiB", MIB)
    lines = [
        f"budget {format_bytes(p.budget_bytes)} per device, {format_bytes(p.usable_bytes)} usable "
        f"(margin {p.margin:.0%}"
        + (
            f"; the process's own {format_bytes(p.host_overhead_bytes)} on CPU, where the budget is peak RSS"
            if p.host_overhead_bytes
            else ""
        )
        + f"), {p.world_size} rank(s), target {p.target}, seq_len {p.seq_len}",
        f"{len(p.rows)} combinations, {p.estimates} estimated in {p.seconds:.0f} s; speed: relative throughput "
        f"of the cost model (docs/memory.md, Planner), 1.00 = baseline step of {p.baseline_seconds * 1e3:.0f} ms",
        "estimated: numbers from estimate_run of that exact config; bound: >= peak / <= speed, not estimated",
        "",
    ]
    shown = p.rows[:top]
    width = max([len(r.label()) for r in shown] + [8])
    head = (
        f"{'rank':>4}  {'switches':<{width}}  {'peak ' + unit:>9}  {'device ' + unit:>10}  {'host ' + unit:>8}  "
        f"{'speed':>6}  {'fits':<4}  source"
    )
    lines += [head, "-" * len(head)]
    for i, r in enumerate(shown, 1):
        ge, le = ("", "") if r.estimated else (">=", "<=")
        fits = "yes" if r.fits else ("?" if r.status in ("not estimated", "error") else "no")
        source = "estimated" if r.estimated else ("error" if r.status == "error" else "bound")
        if r.status == "not estimated":
            source = "bound (not estimated: slower)"
        lines.append(
            f"{i:>4}  {r.label():<{width}}  {ge + f'{r.peak_bytes / size:.2f}':>9}  "
            f"{ge + f'{r.device_total_bytes / size:.2f}':>10}  {ge + f'{r.host_bytes / size:.2f}':>8}  "
            f"{le + f'{r.relative_throughput:.2f}':>6}  {fits:<4}  {source}"
        )
    rest = p.rows[top:]
    if rest:
        counts: dict[str, int] = {}
        for r in rest:
            counts[r.status] = counts.get(r.status, 0) + 1
        lines.append(
            f"... {len(rest)} more: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            + " (--top N)"
        )
    errors = [r for r in p.rows if r.status == "error"]
    for r in errors[:3]:
        lines.append(f"error: {r.label()}: {r.note}")
    best = p.best
    if best is not None:
        c = best.cost
        dequantize = f", NF4 dequantization {c['dequantize'] * 1e3:.0f}" if c.get("dequantize") else ""
        dequantize += f", all-to-all {c['exchange'] * 1e3:.0f}" if c.get("exchange") else ""
        lines += [
            "",
            f"best: {best.label()}",
            f"  step {c['total'] * 1e3:.0f} ms (compute {c['compute'] * 1e3:.0f}{dequantize}, communication "
            f"{c['communication'] * 1e3:.0f}, optimizer {c['optimizer'] * 1e3:.0f}, transfers "
            f"{c['transfers'] * 1e3:.0f}), {best.tokens_per_second_per_gpu:,.0f} tokens_per_second_per_gpu "
            f"(cost model)",
        ]
        if best.changes:
            lines.append(
                "  changes: " + ", ".join(f"{k}={switches.value_of(best.config, k)}" for k in best.changes)
            )
        if p.base is not None and best.config.max_grad_norm != p.base.max_grad_norm:
            needs = "optimizer_in_backward" if best.config.optimizer_in_backward else "optimizer.cpu_offload"
            lines.append(
                f"  max_grad_norm={best.config.max_grad_norm:g} (was {p.base.max_grad_norm:g}): no global-norm "
                f"clipping, which {needs} needs (grad_norm is still logged)"
            )
        if p.chosen_among:
            lines.append(
                f"  optimizer.name={best.config.optimizer.name}: left unset, so chosen among the registry's "
                f"{len(p.chosen_among)} optimizers as the fastest predicted to fit (name one, optimizer.name=..., "
                f"and the plan keeps it)"
            )
        if best.config.dtype == "bf16":
            rounding = switches.resolved_rounding(best.config, p.target, p.world_size)
            lines.append(
                f"  dtype bf16: weights and optimizer state in bf16; bf16_rounding={rounding}"
                + (
                    " (small updates round away: fine for short fine-tunes; stochastic keeps them, docs/memory.md)"
                    if rounding == "nearest"
                    else " (each update computed in fp32 and rounded back: small updates survive)"
                )
            )
    return "\n".join(lines)


def format_constants(target: str) -> str:
    """The cost-model constants of a target, one per line (``memfit plan --explain``)."""
    lines = [f"cost-model constants ({target}; sources in docs/memory.md, Planner):"]
    for k, v in COST_CONSTANTS[target].items():
        if isinstance(v, dict):
            lines.append(f"  {k}:")
            lines += [f"    {name}: {value:g}" for name, value in v.items()]
        else:
            lines.append(f"  {k}: {v:g}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# The runnable YAML
# ----------------------------------------------------------------------------------------------------------------


def _comment(dotted: str, value: Any) -> str:
    """The trade-off beside ``dotted: value`` in the plan's YAML: the switch's entry's
    (:func:`memfit.memory.switches.comment`), and ``max_grad_norm``'s, which two switches set."""
    if dotted == "max_grad_norm":
        return "0: no global-norm clipping (grad_norm is still logged)" if value == 0 else ""
    return switches.comment(dotted, value)


def plan_yaml(row: PlanRow, p: Plan, command: str | None = None) -> str:
    """A config file (the format of ``configs/*.yaml``) that runs ``row``: every key that differs from
    :class:`~memfit.config.TrainConfig`'s defaults, plus the model, sizes and every planned switch, with each
    switch's trade-off beside it and the prediction in a header comment. ``load_config`` of it gives
    ``row.config`` back.
    """
    cfg = dataclasses.replace(row.config, device=p.target, seq_len=p.seq_len)
    tree, default = config_to_dict(cfg), config_to_dict(TrainConfig())
    always = {
        "model",
        "dtype",
        "device",
        "batch_size",
        "seq_len",
        "gradient_accumulation_steps",
        "max_grad_norm",
    }
    always |= switches.yaml_keys(cfg)  # every planned switch, by its entry
    out: dict[str, Any] = {}
    first = ["model", "model_args", "checkpoint_dir", "method", "dtype", "device", "batch_size", "seq_len"]
    for key in first + [k for k in tree if k not in first]:
        value = tree[key]
        if (
            isinstance(value, dict)
            and key != "model_args"
            and key in default
            and isinstance(default[key], dict)
        ):
            sub = {k: v for k, v in value.items() if v != default[key].get(k) or f"{key}.{k}" in always}
            if key == "distributed" and p.world_size == 1:
                sub = {k: v for k, v in sub.items() if v != default[key].get(k)}
            if sub:
                out[key] = sub
        elif value != default.get(key) or key in always:
            out[key] = value
    body = yaml.safe_dump(out, sort_keys=False, default_flow_style=False, width=100)
    e = row.estimate
    run = command or (
        f"memfit {run_verb(cfg)} --config FILE.yaml" + (f" nproc={p.world_size}" if p.world_size > 1 else "")
    )
    header = [
        f"# memfit plan: {row.label()}",
        f"# budget {format_bytes(p.budget_bytes)} per device ({format_bytes(p.usable_bytes)} usable, margin "
        f"{p.margin:.0%}), {p.world_size} rank(s), GiB = 1024**3 bytes",
    ]
    if e is not None:
        header.append(
            f"# predicted (estimate_run of this config): peak {format_bytes(e.peak_bytes)} (allocator, in "
            f"{e.phase}), device total {format_bytes(e.device_total_bytes)}, host {format_bytes(e.host_bytes)}"
        )
    header.append(
        f"# cost model: {row.relative_throughput:.2f}x the baseline's throughput, "
        f"{row.tokens_per_second_per_gpu:,.0f} tokens_per_second_per_gpu (docs/memory.md, Planner)"
    )
    header.append(f"# run: {run}")
    if cfg.method != "full" and cfg.checkpoint_dir is None:
        header.append(
            f"# {cfg.method} fine-tunes pretrained weights: add checkpoint_dir=DIR (planned from the preset)"
        )
    return "\n".join(header) + "\n" + _commented(body) + ""


def _commented(body: str) -> str:
    """Put each switch's trade-off beside it (``key: value  # comment``)."""
    out, section = [], ""
    for line in body.splitlines():
        indent = len(line) - len(line.lstrip())
        stripped = line.strip()
        if indent == 0:
            section = ""
        key, sep, raw = stripped.partition(":")
        if sep and not raw.strip() and indent == 0:
            section = key
        dotted = f"{section}.{key}" if indent and section else key
        comment = ""
        if sep and raw.strip():
            try:
                comment = _comment(dotted, yaml.safe_load(raw))
            except (KeyError, yaml.YAMLError):
                comment = ""
        out.append(f"{line:<40}  # {comment}" if comment else line)
    return "\n".join(out) + "\n"


def write_plan_yaml(path: str | Path, row: PlanRow, p: Plan) -> Path:
    """Write :func:`plan_yaml` of ``row`` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = f"memfit {run_verb(row.config)} --config {path}" + _nproc(p)
    path.write_text(plan_yaml(row, p, command), encoding="utf-8")
    return path


def run_verb(cfg: TrainConfig) -> str:
    """The verb that runs ``cfg``: ``finetune`` for a LoRA / QLoRA / adapter run or one from ``checkpoint_dir``,
    else ``pretrain``."""
    return "finetune" if cfg.method != "full" or cfg.checkpoint_dir is not None else "pretrain"


def _nproc(p: Plan) -> str:
    return f" nproc={p.world_size}" if p.world_size > 1 else ""
