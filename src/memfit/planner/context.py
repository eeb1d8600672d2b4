"""The longest context that fits: ``memfit plan budget=80GiB model=llama3.1-8b seq_len=max``.

:func:`longest_context` answers the question users ask of a long-context run -- *how long a sequence can I train
at, on this device?* -- before anything is allocated, with the estimator's trace of the run's own step
(:func:`memfit.planner.estimate.estimate_run`) at each length it tries:

1. **A ladder of switch sets**: the config as given; then its model states as the least-memory combination of
   the planner has them (:meth:`memfit.planner.plan._Search.least_memory`: dtype, the optimizer and its state, the
   optimizer in backward, QLoRA for a LoRA run), with the config's activation switches; then, each added to the
   set before it, full activation checkpointing, the loss in chunks sized in tokens
   (``chunked_cross_entropy: auto``), the tiled MLP (``tiled_mlp: auto``) and offloaded checkpoints
   (``activation_offloading``, CUDA only), and, sharded, sequence parallelism over the most ranks the model's
   heads allow (``distributed.sequence_parallel``). For each, the longest ``seq_len`` whose estimated peak fits
   (:func:`longest_length`), so the table says what each technique buys.
2. **The plan at the longest of them**: :func:`memfit.planner.plan.plan` at that ``seq_len``, which picks the
   fastest combination that fits there (every combination is estimated as it would run).

Searching the length needs few estimates: with nothing of T x T elements in the step, a switch set's peak is a
maximum of terms linear in T (convex and increasing), so a line through two estimates predicts where it meets the
budget, and false position between a length that fits and one that does not closes in on the longest in a few
more. Lengths are multiples of :data:`GRANULARITY` (of :data:`FINE_GRANULARITY` below it).

A preset's context is raised as far as the search goes (``model_args.max_seq_len`` in the plan's config: memory
does not care what RoPE was trained for, but quality beyond a model's context needs RoPE scaling or training at that
length); a checkpoint's ``max_seq_len`` caps its search.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.build import run_model_config
from memfit.config import TrainConfig, config_from_dict, config_to_dict, device_type
from memfit.errors import ConfigError
from memfit.memory import switches
from memfit.models.config import DecoderConfig
from memfit.planner import plan as plan_
from memfit.planner import report
from memfit.planner.estimate import Estimate, estimate_run
from memfit.units import GIB, format_bytes

GRANULARITY = 1024
"""Lengths the search tries are multiples of this (tokens)."""
FINE_GRANULARITY = 64
"""...or of this, where not even :data:`GRANULARITY` tokens fit (small models and budgets)."""
FIRST_LENGTH = 8192
"""The first length tried (halved until it fits)."""
GROWTH = 8
"""The most one step of the search may multiply the longest length known to fit by (the line through two lengths
that fit, extended): a peak that is nearly flat at short lengths would put the line's crossing far out, and the
traces of very long sequences run more ops (tiled and blocked loops)."""
MAX_LENGTH = 2**24
"""The longest length searched (16,777,216 tokens), for a preset; a checkpoint's ``max_seq_len`` caps it lower."""

LADDER: tuple[tuple[str, dict[str, Any]], ...] = (
    ("activation_checkpointing=full", {"activation_checkpointing": "full"}),
    ("chunked_cross_entropy=auto", {"chunked_cross_entropy": "auto"}),
    ("tiled_mlp=auto", {"tiled_mlp": "auto"}),
    ("activation_offloading=true", {"activation_offloading": True}),
)
"""The techniques the ladder adds, in order, each to the set before it (offloading on CUDA targets only)."""

SP_KEY = "distributed.sequence_parallel"
"""Sharded, the ladder's last rung splits each sequence over the most ranks the model allows."""


def largest_sequence_parallel(world_size: int, mcfg: DecoderConfig) -> int:
    """The largest N dividing ``world_size`` and ``num_heads`` whose key/value heads split or repeat evenly (1 for
    one rank): the ranks a sequence can be split over (:mod:`memfit.memory.ulysses`)."""
    return max(
        n
        for n in range(1, world_size + 1)
        if world_size % n == 0
        and mcfg.num_heads % n == 0
        and (mcfg.num_kv_heads % n == 0 or n % mcfg.num_kv_heads == 0)
    )


@dataclass
class Rung:
    """One switch set of the ladder and its longest context. Bytes; tokens."""

    name: str
    """What it adds (``config as given``, ``+ tiled_mlp=auto``, ...)."""
    config: TrainConfig
    """The switch set (its ``seq_len`` is the longest that fits, or the config's when nothing does)."""
    seq_len: int = 0
    """The longest sequence that fits (0: not even :data:`FINE_GRANULARITY` tokens)."""
    estimate: Estimate | None = None
    """The estimate at ``seq_len``."""
    over: int = 0
    """The shortest length found not to fit (0: none tried; the search stopped at its cap)."""
    estimates: int = 0
    """Estimates this rung's search made."""
    tokens_per_second_per_gpu: float = 0.0
    """The cost model's, at ``seq_len``."""

    def to_json(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "switches": self.name,
            "label": switches.label(switches.values(self.config, 1), self.config),
            "seq_len": self.seq_len,
            "peak_memory_gib": e.peak_bytes / GIB if e else None,
            "device_total_gib": e.device_total_bytes / GIB if e else None,
            "host_gib": e.host_bytes / GIB if e else None,
            "breakdown_gib": {k: v / GIB for k, v in e.breakdown.items()} if e else None,
            "first_over": self.over or None,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "estimates": self.estimates,
        }


@dataclass
class ContextPlan:
    """What :func:`longest_context` found: the ladder, and the plan at the longest context."""

    rungs: list[Rung]
    plan: plan_.Plan | None
    """The plan at the longest ``seq_len`` of the ladder (None when nothing fits at any length)."""
    seconds: float
    estimates: int
    capped: int = 0
    """The length the search may not pass (a checkpoint's ``max_seq_len``, or :data:`MAX_LENGTH`)."""
    notes: list[str] = field(default_factory=list)
    made: list[Estimate] = field(default_factory=list)
    """Every estimate the search and the plan ran, each once (``memfit plan --explain`` says how they were
    obtained)."""
    asked: int = 0
    """How many estimates the search and the plan asked for: ``asked - len(made)`` were answered from memory."""

    @property
    def seq_len(self) -> int:
        """The longest context that fits (0: none)."""
        return self.plan.seq_len if self.plan is not None and self.plan.best is not None else 0

    def limit(self) -> str:
        """The category of the chosen row's estimated breakdown that is largest at the longest context: what sets
        the limit (``activations``, ``parameters``, ...)."""
        best = self.plan.best if self.plan is not None else None
        if best is None or best.estimate is None:
            return ""
        breakdown = best.estimate.breakdown
        return max(breakdown, key=breakdown.get)

    def to_json(self) -> dict[str, Any]:
        """The plan's JSON at the longest context (its ``best`` row with ``seq_len``), and the ladder."""
        out = self.plan.to_json() if self.plan is not None else {"best": None, "rows": []}
        if out.get("best") is not None:
            out["best"]["seq_len"] = self.seq_len
        out.update(
            seq_len=self.seq_len,
            longest_context=[r.to_json() for r in self.rungs],
            limit=self.limit(),
            capped_at=self.capped,
            search_seconds=self.seconds,
            search_estimates=self.estimates,
            notes=self.notes,
        )
        return out


def at_length(cfg: TrainConfig, seq_len: int, world_size: int = 1) -> TrainConfig:
    """``cfg`` at ``seq_len`` tokens, a preset's ``max_seq_len`` raised to it when shorter (validated for a run of
    ``world_size`` ranks).

    Raises:
        ConfigError: ``seq_len`` is longer than a checkpoint's context, or the config is invalid at that length.
    """
    tree = config_to_dict(cfg)
    tree["seq_len"] = seq_len
    if cfg.checkpoint_dir is None and run_model_config(cfg).max_seq_len < seq_len:
        tree["model_args"] = {**tree.get("model_args", {}), "max_seq_len": seq_len}
    return config_from_dict(tree, world_size=world_size, needs_weights=False)


def longest_length(
    cfg: TrainConfig,
    usable: int,
    *,
    world_size: int = 1,
    cap: int = MAX_LENGTH,
    estimator: Callable[..., Estimate] = estimate_run,
    progress: Callable[[str], None] | None = None,
) -> tuple[int, Estimate | None, int, int]:
    """The longest ``seq_len`` at which ``cfg``'s estimated allocator peak is at most ``usable`` bytes.

    Lengths are multiples of :data:`GRANULARITY` (of :data:`FINE_GRANULARITY` when less than that fits), at most
    ``cap``. The search estimates :data:`FIRST_LENGTH` (halving until it fits), then follows the line through its
    last two estimates to where it meets ``usable``, at most :data:`GROWTH` times as long at a time, and then false
    position between the longest length that fits and the shortest that does not, until they are one step apart.
    The peak is convex and increasing in the length (a maximum of linear terms), so the line from below overshoots
    and the bracket closes in few steps. While halving, the line through the last two peaks ends the search where
    it is over ``usable`` even at length 0: by convexity no shorter length fits.

    Args:
        cfg: the run (its switches, batch and everything but ``seq_len``).
        usable: the budget for the allocator peak of one rank, bytes.
        world_size: ranks.
        cap: the longest length to consider.
        estimator: ``estimate_run`` (tests may pass a stand-in).
        progress: called with one line per estimate.

    Returns:
        ``(seq_len, its estimate, the shortest length found not to fit or 0, estimates made)``; ``seq_len`` 0 and
        no estimate when not even :data:`FINE_GRANULARITY` tokens fit.
    """
    cache: dict[int, Estimate] = {}

    def peak(length: int) -> int:
        if length not in cache:
            start = time.perf_counter()
            cache[length] = estimator(
                at_length(cfg, length, world_size), world_size=world_size, seq_len=length
            )
            if progress:
                e = cache[length]
                verdict = "fits" if e.peak_bytes <= usable else "over"
                progress(
                    f"    seq_len {length:,}: peak {format_bytes(e.peak_bytes)}, {verdict} "
                    f"({time.perf_counter() - start:.0f} s)"
                )
        return cache[length].peak_bytes

    step = GRANULARITY
    lo, hi = 0, 0  # the longest length known to fit, the shortest known not to (0: none)
    length = min(FIRST_LENGTH, cap)
    while length >= FINE_GRANULARITY:  # a first length that fits
        if peak(length) <= usable:
            lo = length
            break
        if hi and peak(length) - (peak(hi) - peak(length)) / (hi - length) * length > usable:
            # a convex peak lies above the line through two of its points, left of them: that line is over the
            # budget at length 0, so no shorter length fits (the model states, not the sequence, are over)
            hi = length
            break
        hi = length
        length //= 2
    if not lo:
        return 0, None, hi, len(cache)
    if lo < GRANULARITY:
        step = FINE_GRANULARITY
    same_side = 0  # false-position steps in a row that moved lo (a convex peak approaches from below)
    while (hi == 0 and lo < cap) or (hi and hi - lo > step):
        if hi and same_side >= 2:  # then halve the bracket instead
            nxt = max(_down((lo + hi) / 2, step), lo + step)
            same_side = 0
        elif hi:  # false position between lo (fits) and hi (over)
            p_lo, p_hi = peak(lo), peak(hi)
            guess = lo + (usable - p_lo) * (hi - lo) / max(1, p_hi - p_lo)
            nxt = min(max(_down(guess, step), lo + step), hi - step)
        else:  # the line through the two longest lengths known to fit, at most GROWTH times lo
            below = max((t for t in cache if t < lo and cache[t].peak_bytes <= usable), default=0)
            if below:
                slope = (peak(lo) - peak(below)) / (lo - below)
                guess = lo + (usable - peak(lo)) / slope if slope > 0 else 2 * lo
            else:
                guess = 2 * lo
            nxt = min(max(_down(guess, step), lo + step), GROWTH * lo, cap)
        if nxt <= lo:
            break
        if peak(nxt) <= usable:
            lo = nxt
            same_side += 1 if hi else 0
        else:
            hi = nxt
            same_side = 0
    return lo, cache[lo], hi, len(cache)


class _Remembered:
    """An estimator that answers a config it was asked before (the same keys, ranks and length) from memory, and
    counts: ``asked`` calls, ``made`` the estimates it ran (each once)."""

    def __init__(self, estimator: Callable[..., Estimate]) -> None:
        self.estimator = estimator
        self.seen: dict[str, Estimate] = {}
        self.asked = 0

    @staticmethod
    def _key(cfg: TrainConfig, world_size: int, seq_len: int | None) -> str:
        return json.dumps([config_to_dict(cfg), world_size, seq_len], sort_keys=True, default=str)

    def knows(self, cfg: TrainConfig, *, world_size: int = 1, seq_len: int | None = None) -> bool:
        """Whether this config's estimate is held (asking for it costs nothing)."""
        return self._key(cfg, world_size, seq_len) in self.seen

    def __call__(self, cfg: TrainConfig, *, world_size: int = 1, seq_len: int | None = None) -> Estimate:
        self.asked += 1
        key = self._key(cfg, world_size, seq_len)
        if key not in self.seen:
            self.seen[key] = self.estimator(cfg, world_size=world_size, seq_len=seq_len)
        return self.seen[key]

    @property
    def made(self) -> list[Estimate]:
        return list(self.seen.values())


def _down(length: float, step: int) -> int:
    return int(length // step) * step


def longest_context(request: plan_.PlanRequest) -> ContextPlan:
    """The longest context that fits ``request.budget_bytes`` on one rank, the ladder of what each technique buys,
    and the fastest switch set at that length (see the module doc).

    Args:
        request: the run to plan (``request.cfg.seq_len`` is searched; everything else is kept), its budget and the
            settings of the plan at the longest length (:class:`memfit.planner.plan.PlanRequest`: ``dtypes``,
            ``fits``, ``constants``, ``optimizers``); ``progress`` is called with a line per rung and per estimate,
            ``estimator`` is ``estimate_run`` (tests may pass a stand-in).

    Returns:
        The :class:`ContextPlan`.

    Raises:
        ConfigError: as :func:`memfit.planner.plan.plan`.
    """
    cfg, budget_bytes, world_size, margin = (
        request.cfg,
        request.budget_bytes,
        request.world_size,
        request.margin,
    )
    progress, constants = request.progress, request.constants
    start = time.perf_counter()
    estimator = _Remembered(request.estimator or estimate_run)  # a rung's config at a length asked again
    say = progress or (lambda _line: None)
    mcfg = run_model_config(cfg)
    cap = mcfg.max_seq_len if cfg.checkpoint_dir is not None else MAX_LENGTH
    # the budget's usable part, as the plan computes it (on CPU less the process's own memory)
    probe_cfg = at_length(cfg, min(FIRST_LENGTH, cap), world_size)
    ctx = plan_._Context(probe_cfg, world_size, budget_bytes, margin, None)
    rungs = [Rung("config as given", cfg)]
    # the model states of the least-memory combination (dtype, optimizer, method, ...), so that the rungs below
    # show what the activation techniques buy where the weights and optimizer fit
    current = cfg
    least = _least_memory(request, cap)
    if least is not None:
        ladder_keys = {k for _, settings in LADDER for k in settings} | {
            "activation_checkpointing_interval",
            SP_KEY,
        }
        states = {
            k: switches.value_of(least, k)
            for k in (*switches.switch_keys(world_size), "max_grad_norm")
            if k not in ladder_keys
        }
        if any(switches.value_of(current, k) != v for k, v in states.items()):
            current = switches.with_values(current, states)
            rungs.append(Rung("least-memory model states", current))
    for name, settings in LADDER:
        if "activation_offloading" in settings and device_type(cfg.device) != "cuda":
            continue  # the host is the device: nothing to offload to
        if all(switches.value_of(current, k) == v for k, v in settings.items()):
            continue
        current = switches.with_values(current, settings)
        rungs.append(Rung(f"+ {name}", current))
    sp = largest_sequence_parallel(world_size, mcfg)
    if sp > switches.value_of(current, SP_KEY):  # sharded: each rank holds 1/sp of every sequence
        current = switches.with_values(current, {SP_KEY: sp})
        rungs.append(Rung(f"+ {SP_KEY}={sp}", current))
    total = 0
    for rung in rungs:
        say(
            f"  {rung.name}: {switches.label(switches.values(rung.config, world_size), rung.config) or 'as given'}"
        )
        try:
            rung.seq_len, rung.estimate, rung.over, rung.estimates = longest_length(
                rung.config,
                ctx.usable,
                world_size=world_size,
                cap=cap,
                estimator=estimator,
                progress=progress,
            )
        except ConfigError as exc:  # a switch set this run cannot take (validation says why)
            say(f"    skipped: {exc}")
            continue
        total += rung.estimates
        if rung.seq_len:
            rung.config = at_length(rung.config, rung.seq_len, world_size)
            at = plan_._Context(rung.config, world_size, budget_bytes, margin, constants)
            rung.tokens_per_second_per_gpu = (
                at.tokens(rung.config)
                / at.cost(
                    rung.config,
                    rung.estimate.unseen.get("offloaded_activations", 0),
                    rung.estimate.device_total_bytes,
                )["total"]
            )
    longest = max((r.seq_len for r in rungs), default=0)
    notes = []
    if longest >= cap:
        notes.append(f"the search stopped at its cap, seq_len {cap:,}")
    result = None
    if longest:
        say(f"  the fastest switch set at seq_len {longest:,}:")
        result = plan_.plan(
            dataclasses.replace(request, cfg=at_length(cfg, longest, world_size), estimator=estimator)
        )
        total += result.estimates
    return ContextPlan(
        rungs,
        result,
        time.perf_counter() - start,
        total,
        capped=cap,
        notes=notes,
        made=estimator.made,
        asked=estimator.asked,
    )


def _least_memory(request: plan_.PlanRequest, cap: int) -> TrainConfig | None:
    """The planner's least-memory combination over ``request.cfg`` (every switch that saves memory on), by its
    lower bounds at a long length; None when validation accepts no combination."""
    cfg = request.cfg
    bounded = plan_.PlanRequest(
        at_length(cfg, min(4 * FIRST_LENGTH, cap), request.world_size),
        request.budget_bytes,
        request.world_size,
        margin=request.margin,
        dtypes=request.dtypes,
        estimator=lambda *a, **k: None,  # nothing is estimated here
    )
    try:
        search, _ = plan_._build(bounded)
    except ConfigError:
        return None
    best = search.least_memory().config
    return dataclasses.replace(best, seq_len=cfg.seq_len, model_args=cfg.model_args)


def format_context(result: ContextPlan, top: int = 10) -> str:
    """The ladder's table (GiB = 1024**3 bytes) and the plan at the longest context, for ``memfit plan
    seq_len=max``."""
    lines = [
        "longest context per switch set (each adds to the one above; peak: estimated, at that length):",
        "",
    ]
    width = max([len(r.name) for r in result.rungs] + [12])
    head = f"{'switch set':<{width}}  {'seq_len':>10}  {'peak GiB':>8}  {'host GiB':>8}  {'tokens/s/gpu':>12}"
    lines += [head, "-" * len(head)]
    for r in result.rungs:
        e = r.estimate
        length = f"{r.seq_len:,}" if r.seq_len else "none"
        lines.append(
            f"{r.name:<{width}}  {length:>10}  {(e.peak_bytes / GIB if e else 0):>8.2f}  "
            f"{(e.host_bytes / GIB if e else 0):>8.2f}  {r.tokens_per_second_per_gpu:>12,.0f}"
        )
    for r in result.rungs:
        lines.append(f"  {r.name}: {switches.label(switches.values(r.config, 1), r.config) or 'as given'}")
    lines.append("")
    if result.seq_len:
        lines.append(
            f"longest context: seq_len {result.seq_len:,} tokens (the limit there: {result.limit()}); "
            f"{result.estimates} estimates in {result.seconds:.0f} s"
        )
    lines += [f"note: {n}" for n in result.notes]
    if result.plan is not None:
        lines += ["", report.format_plan(result.plan, top=top)]
    return "\n".join(lines)
