"""The planner picks the mesh: ``memfit plan nodes=N gpus_per_node=G budget=... model=...``.

:func:`plan_mesh` searches the layouts of :func:`memfit.planner.layout.layouts` (replicas R across nodes, FSDP2
shards, tensor-parallel groups T inside a node) together with the memory switches :func:`memfit.planner.plan.plan`
searches (sequence parallelism among them), and returns the fastest combination whose estimated peak fits the budget
of one GPU. Each layout is one search of :mod:`memfit.planner.plan` over that mesh's config
(``distributed.replicate``, ``distributed.tensor_parallel``), estimated with :func:`memfit.planner.estimate.
estimate_run` on ``N x G`` fake ranks, its collectives priced by where their groups lie
(:func:`memfit.planner.cost.mesh_collectives`: NVLink inside a node, InfiniBand between nodes).

Keeping it affordable: the layouts are few (8 for 2 nodes x 8 GPUs), and they are searched as the switches are --
branch and bound. Every layout's rows are bounded first (closed forms, no estimate); layouts are searched by their
fastest row that its bound lets fit, and a layout none of whose rows could be faster than the best plan found is
not searched (``cannot be faster``). A layout the estimator cannot trace (its first estimate fails) is given up
with the reason, not retried row by row.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.build import run_model_config
from memfit.config import TrainConfig, config_from_dict, config_to_dict, set_dotted
from memfit.errors import ConfigError
from memfit.memory import switches
from memfit.planner import plan as plan_
from memfit.planner.estimate import Estimate, estimate_run
from memfit.planner.layout import Layout, layouts
from memfit.units import GIB, format_bytes


@dataclass
class LayoutPlan:
    """One layout and what its search found."""

    layout: Layout
    status: str = "not searched"
    """``fits`` (its plan has a fitting row), ``nothing fits``, ``cannot be faster`` (its fastest bounded row is
    slower than the best plan found: not searched), ``refused`` (validation or the estimator refused it: see
    ``note``)."""
    plan: plan_.Plan | None = None
    """Its search's :class:`~memfit.planner.plan.Plan` (``None``: not searched, or refused before)."""
    optimistic_seconds: float = float("inf")
    """The fastest step any of its rows could take (the cost model over lower bounds), in seconds."""
    note: str = ""

    @property
    def best(self) -> plan_.PlanRow | None:
        return self.plan.best if self.plan is not None else None

    @property
    def step_seconds(self) -> float:
        """The best row's predicted step seconds, else the optimistic bound."""
        best = self.best
        return best.cost["total"] if best is not None else self.optimistic_seconds

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {
            "layout": self.layout.label(),
            "replicate": self.layout.replicate,
            "shard": self.layout.shard,
            "tensor_parallel": self.layout.tensor_parallel,
            "status": self.status,
            "step_seconds": self.step_seconds,
            "best": best.to_json() if best is not None else None,
            "estimates": self.plan.estimates if self.plan is not None else 0,
            "note": self.note,
        }


@dataclass
class MeshPlan:
    """The result of :func:`plan_mesh`: every layout, the fitting ones first, fastest first."""

    nodes: int
    gpus_per_node: int
    budget_bytes: int
    layouts: list[LayoutPlan]
    seconds: float
    """Wall time of the search."""
    estimates: int
    constants: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def best(self) -> LayoutPlan | None:
        """The fastest layout with a fitting plan, or None."""
        return self.layouts[0] if self.layouts and self.layouts[0].status == "fits" else None

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "world_size": self.nodes * self.gpus_per_node,
            "budget_gib": self.budget_bytes / GIB,
            "best_layout": best.to_json() if best else None,
            "layouts": [lp.to_json() for lp in self.layouts],
            "estimates": self.estimates,
            "seconds": self.seconds,
        }


def layout_config(cfg: TrainConfig, layout: Layout) -> TrainConfig:
    """``cfg`` on ``layout``'s mesh (``distributed.replicate``, ``distributed.tensor_parallel``, FSDP2), validated
    for its ``N x G`` ranks as a prediction.

    Raises:
        ConfigError: validation refuses the mesh for this run (its message names the key).
    """
    tree = config_to_dict(cfg)
    set_dotted(tree, "distributed.strategy", "fsdp2")
    for key, value in layout.overrides().items():
        set_dotted(tree, key, value)
    return config_from_dict(tree, world_size=layout.world_size, needs_weights=False)


FUSE_OPTIMIZERS = 3
"""Optimizers whose estimates of a layout all failed, with none done, after which the layout is given up."""


class _Fuse:
    """An estimator that gives a layout up when it fails for :data:`FUSE_OPTIMIZERS` optimizers with no estimate
    done: a layout the estimator cannot trace costs a few tries, not one per row, while one optimizer failing
    (one that cannot shard a small model's tensors) leaves the others to be estimated. It stops the search
    (``search.stopped``) when it blows."""

    def __init__(self, estimator: Callable[..., Estimate]) -> None:
        self.estimator = estimator
        self.failure: str | None = None
        self.failed: set[str] = set()
        self.done = 0
        self.search: Any = None
        self.knows = getattr(estimator, "knows", None)

    @property
    def blown(self) -> bool:
        return self.done == 0 and len(self.failed) >= FUSE_OPTIMIZERS

    def __call__(self, cfg: TrainConfig, **kwargs: Any) -> Estimate:
        try:
            out = self.estimator(cfg, **kwargs)
        except Exception as exc:
            self.failed.add(cfg.optimizer.name)
            text = str(exc).splitlines()[0] if str(exc) else ""
            self.failure = self.failure or f"{type(exc).__name__}: {text}"[:200]
            if self.blown and self.search is not None:
                self.search.stopped = True
            raise
        self.done += 1
        return out


def _unbuilt(layout: Layout) -> str | None:
    """What this branch cannot run (or trace) of a layout: the part of it no switch declares yet."""
    missing = []
    if layout.replicate > 1 and "distributed.replicate" not in switches.SWITCHES_BY_KEY:
        missing.append("hybrid sharding (distributed.replicate)")
    if layout.tensor_parallel > 1 and "distributed.tensor_parallel" not in switches.SWITCHES_BY_KEY:
        missing.append("tensor parallelism (distributed.tensor_parallel)")
    return " and ".join(missing) + " not built yet" if missing else None


def plan_mesh(request: plan_.PlanRequest, nodes: int, gpus_per_node: int) -> MeshPlan:
    """The fastest layout and memory switches of ``request.cfg`` on ``nodes x gpus_per_node`` GPUs whose peak fits
    ``request.budget_bytes`` on each.

    Args:
        request: the run and the switch search's settings (:class:`~memfit.planner.plan.PlanRequest`; its
            ``world_size`` and ``layout`` are set here for each layout).
        nodes: N, machines.
        gpus_per_node: G, ranks (GPUs) per machine.

    Returns:
        The :class:`MeshPlan`; its ``best`` is the fastest fitting layout (its ``best`` row the switches), None
        when nothing fits anywhere.

    Raises:
        ConfigError: ``nodes`` or ``gpus_per_node`` below 1; no layout passes validation.
    """
    start = time.perf_counter()
    mcfg = run_model_config(request.cfg)
    estimator = request.estimator or estimate_run
    found: list[LayoutPlan] = []
    built: list[tuple[LayoutPlan, Any, float, plan_.PlanRequest]] = []
    refusals: list[str] = []
    for layout in layouts(nodes, gpus_per_node, mcfg):
        entry = LayoutPlan(layout)
        found.append(entry)
        unbuilt = _unbuilt(layout)
        if unbuilt is not None:
            entry.status, entry.note = "refused", unbuilt
            refusals.append(f"{layout.label()}: {unbuilt}")
            continue
        try:
            cfg = layout_config(request.cfg, layout)
            sub = dataclasses.replace(
                request,
                cfg=cfg,
                world_size=layout.world_size,
                layout=layout,
                estimator=_Fuse(estimator),
            )
            search, baseline = plan_._build(sub)
        except ConfigError as exc:
            entry.status, entry.note = "refused", str(exc).splitlines()[0][:200]
            refusals.append(f"{layout.label()}: {entry.note}")
            continue
        # this layout's mesh only, with Ulysses's groups inside the shard dimension (consecutive data-parallel
        # ranks of one replica)
        d = cfg.distributed
        search.rows = [
            r
            for r in search.rows
            if r.config.distributed.replicate == d.replicate
            and r.config.distributed.tensor_parallel == d.tensor_parallel
            and layout.shard % r.config.distributed.sequence_parallel == 0
        ]
        sub.estimator.search = search
        fitting = [r.cost["total"] for r in search.rows if r._bound_peak <= search.ctx.usable]
        entry.optimistic_seconds = min(fitting, default=float("inf"))
        built.append((entry, search, baseline, sub))
    if not built:
        raise ConfigError(
            "config key 'distributed': no layout of "
            f"{nodes} x {gpus_per_node} ranks passes validation for this run: " + "; ".join(refusals)
        )
    estimates = 0
    best: LayoutPlan | None = None
    for entry, search, baseline, sub in sorted(built, key=lambda b: b[0].optimistic_seconds):
        if best is not None and entry.optimistic_seconds >= best.step_seconds:
            entry.status, entry.note = "cannot be faster", f"than {best.layout.label()}"
            continue
        if entry.optimistic_seconds == float("inf"):
            entry.status, entry.note = "nothing fits", "every combination's lower bound is over budget"
            continue
        if request.progress:
            request.progress(f"layout {entry.layout.label()}:")
        result = plan_.searched(search, baseline, sub, time.perf_counter())
        estimates += result.estimates
        entry.plan = result
        fuse = sub.estimator
        if result.best is not None:
            entry.status = "fits"
            if best is None or entry.step_seconds < best.step_seconds:
                best = entry
        elif (
            isinstance(fuse, _Fuse) and fuse.failure is not None and not any(r.estimated for r in result.rows)
        ):
            entry.status, entry.note = "refused", f"the estimator cannot trace it: {fuse.failure}"
        else:
            entry.status = "nothing fits"
    order = {"fits": 0, "nothing fits": 1, "cannot be faster": 2, "not searched": 2, "refused": 3}
    found.sort(key=lambda lp: (order.get(lp.status, 2), lp.step_seconds))
    constants = copy.deepcopy(built[0][1].ctx.constants)
    return MeshPlan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        budget_bytes=request.budget_bytes,
        layouts=found,
        seconds=time.perf_counter() - start,
        estimates=estimates,
        constants=constants,
    )


def format_mesh_plan(mp: MeshPlan) -> str:
    """The layouts' table of ``memfit plan nodes=N gpus_per_node=G``: each layout, its status, its fastest fitting
    switches (or why it has none), their peak per GPU, the predicted step seconds and tokens per second per GPU
    (the cost model's, at equal tokens per GPU); a layout without a plan shows the lower bound of its step."""
    lines = [
        f"{mp.nodes} node(s) x {mp.gpus_per_node} GPU(s), budget {format_bytes(mp.budget_bytes)} per GPU: "
        f"{len(mp.layouts)} layouts, {mp.estimates} estimates in {mp.seconds:.0f} s",
        f"{'layout':<32} {'status':<16} {'peak':>10} {'step s':>10} {'tok/s/GPU':>11}  switches, or why not",
    ]
    for lp in mp.layouts:
        row = lp.best
        peak = format_bytes(row.peak_bytes) if row is not None else ""
        step = f"{lp.step_seconds:.4f}" if row is not None else ""
        if row is None and lp.optimistic_seconds != float("inf"):
            step = f">={lp.optimistic_seconds:.4f}"  # the bound it was judged by
        tps = f"{row.tokens_per_second_per_gpu:,.0f}" if row is not None else ""
        what = row.label() if row is not None else lp.note
        lines.append(f"{lp.layout.label():<32} {lp.status:<16} {peak:>10} {step:>10} {tps:>11}  {what}")
    return "\n".join(lines)
