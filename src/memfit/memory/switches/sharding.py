"""The switches of sharded runs (FSDP): ``distributed.strategy``, ``reshard_after_forward``, ``cpu_offload``,
``prefetch``, ``limit_all_gathers`` and ``replicate`` (hybrid sharding, HSDP). Sequence parallelism is with the
sequence's switches (:mod:`.sequence`).

Each entry is declared after its checks, candidates and cost (:class:`~memfit.memory.switches.base.Switch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit.memory.switches.base import (
    STRATEGIES,
    PlanSpace,
    Refusal,
    RunConfig,
    StepTerms,
    Switch,
    Target,
    check_nothing,
    each,
    flag,
    host_on_cuda,
    moves_state,
    require,
    value_of,
    when,
)


def _plan_sharded(key: str, values: tuple[bool, ...], *, cuda_only: bool = False) -> Callable[..., tuple]:
    def plan(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
        if space.world_size == 1 or (cuda_only and not space.cuda):
            return ({},)  # not set: the config's own value stays
        return each(key, (value_of(cfg, key), *values))

    return plan


# ----------------------------------------------------------------------------------------------------------------
# distributed.strategy
# ----------------------------------------------------------------------------------------------------------------


STRATEGY = Switch(
    key="distributed.strategy",
    applied="shard: memfit.distributed.shard_model (FSDP2 fully_shard or FSDP1)",
    check=check_nothing,
    choices=STRATEGIES,
    no_parity="sharded: tests/test_distributed.py compares 2 ranks with one process",
    not_planned="plans of sharded runs are estimated with FSDP2 (FSDP1 holds the same model states to within "
    "padding)",
    doc="fsdp2 or fsdp1",
)


# ----------------------------------------------------------------------------------------------------------------
# distributed.reshard_after_forward
# ----------------------------------------------------------------------------------------------------------------


def _cost_reshard(on: bool, t: StepTerms) -> None:
    t.gathers = 2 if on else 1


RESHARD_AFTER_FORWARD = Switch(
    key="distributed.reshard_after_forward",
    baseline=True,
    applied="shard: memfit.distributed.shard_model",
    check=check_nothing,
    activation=True,
    candidates=_plan_sharded("distributed.reshard_after_forward", (True, False)),
    sharded_only=True,
    label=flag("no_reshard", on=False),
    comment=when("keep gathered layers to backward: fewer all-gathers", on=False),
    cost=_cost_reshard,
    no_parity="sharded: tests/test_distributed.py compares 2 ranks with one process",
    doc="free each layer's gathered weights after its forward (ZeRO-3) or keep them to backward",
)


# ----------------------------------------------------------------------------------------------------------------
# distributed.cpu_offload
# ----------------------------------------------------------------------------------------------------------------


def _check_fsdp_offload(cfg: RunConfig, target: Target) -> None:
    require(
        not (target.sharded and cfg.distributed.cpu_offload) or target.device == "cuda",
        "distributed.cpu_offload",
        "moves parameter shards, gradients and the optimizer step from GPU to host memory and needs CUDA; on "
        "CPU they already live in host memory. Turn it off",
    )


def _cost_fsdp_offload(on: bool, t: StepTerms) -> None:
    if on:
        t.host_update = True
        t.moved_bytes += (2 if t.cfg.distributed.reshard_after_forward else 1) * t.states["parameters"]
        t.moved_bytes += t.states["gradients"]


FSDP_CPU_OFFLOAD = Switch(
    key="distributed.cpu_offload",
    baseline=False,
    applied="shard: memfit.distributed.shard_model (FSDP2 CPUOffloadPolicy / FSDP1 CPUOffload)",
    check=_check_fsdp_offload,
    trace_value=False,
    moves=moves_state,
    # FSDP CPUOffloadPolicy: the shards and their gradients stay on the host
    host_bytes=host_on_cuda(
        {"offloaded_parameter_shards": "parameters", "offloaded_gradient_shards": "gradients"}
    ),
    off_device=("parameters", "gradients"),
    activation=True,
    candidates=_plan_sharded("distributed.cpu_offload", (False, True), cuda_only=True),
    sharded_only=True,
    label=flag("fsdp_offload"),
    comment=when("shards, gradients and the step on the host"),
    cost=_cost_fsdp_offload,
    refusals=(Refusal({"distributed.cpu_offload": True}, "moves parameter shards", world_size=2),),
    no_parity="CUDA only; not run on CPU",
    doc="parameter shards, gradients and the optimizer step on the host (CUDA only)",
)


# ----------------------------------------------------------------------------------------------------------------
# distributed.prefetch
# ----------------------------------------------------------------------------------------------------------------


def _check_prefetch(cfg: RunConfig, target: Target) -> None:
    d = cfg.distributed
    require(d.prefetch >= 0, "distributed.prefetch", f"must be >= 0 (0: FSDP's defaults), got {d.prefetch}")


PREFETCH = Switch(
    key="distributed.prefetch",
    applied="shard: memfit.distributed.shard_model (explicit forward/backward prefetch)",
    check=_check_prefetch,
    refusals=(Refusal({"distributed.prefetch": -1}, "must be >= 0 (0: FSDP's defaults), got -1"),),
    no_parity="sharded: tests/test_distributed.py",
    not_planned="it trades overlap for a layer of gathered weights; the plan keeps the config's",
    doc="layers whose all-gather is issued ahead of use",
)


# ----------------------------------------------------------------------------------------------------------------
# distributed.limit_all_gathers
# ----------------------------------------------------------------------------------------------------------------


def _check_limit_all_gathers(cfg: RunConfig, target: Target) -> None:
    d = cfg.distributed
    require(
        d.strategy == "fsdp1" or d.limit_all_gathers,
        "distributed.limit_all_gathers",
        "applies to distributed.strategy=fsdp1 only; FSDP2 bounds its all-gathers by distributed.prefetch",
    )


LIMIT_ALL_GATHERS = Switch(
    key="distributed.limit_all_gathers",
    applied="shard: memfit.distributed.shard_model (FSDP1 limit_all_gathers)",
    check=_check_limit_all_gathers,
    refusals=(
        Refusal({"distributed.limit_all_gathers": False}, "applies to distributed.strategy=fsdp1 only"),
    ),
    no_parity="sharded, FSDP1 only: tests/test_distributed.py",
    not_planned="FSDP1 only, and plans are FSDP2's",
    doc="fsdp1 only: at most two layers' unsharded weights at once",
)


# ----------------------------------------------------------------------------------------------------------------
# distributed.replicate
# ----------------------------------------------------------------------------------------------------------------


def _check_replicate(cfg: RunConfig, target: Target) -> None:
    r, key = cfg.distributed.replicate, "distributed.replicate"
    require(
        isinstance(r, int) and not isinstance(r, bool) and r >= 1,
        key,
        f"must be >= 1 replicas (1: FSDP2 shards over every rank), got {r!r}",
    )
    if r == 1:
        return
    require(
        target.world_size > 1 and target.world_size % r == 0,
        key,
        f"{r} replicas need a multiple of {r} ranks, and the run has {target.world_size}; launch with a multiple "
        f"of {r} ranks (replicas x ranks per replica, e.g. nnodes={r} x nproc_per_node), or set it to 1",
    )
    require(
        cfg.distributed.strategy == "fsdp2",
        key,
        "needs distributed.strategy=fsdp2: hybrid sharding is FSDP2's fully_shard on a 2-D (replicate, shard) "
        "device mesh; FSDP1 is not wired for it",
    )


def _plan_replicate(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    """On several nodes: the config's own, 1 (flat), then every R dividing ``world_size`` whose replicas stay
    within a node (R a multiple of the nodes: ``world_size / R`` ranks divide a node's). On one node a flat group's
    all-gathers already stay on its fast links, and hybrid sharding would only hold R times the shards."""
    key, own = "distributed.replicate", cfg.distributed.replicate
    if space.world_size == 1 or space.nodes <= 1:
        return ({},)
    sizes = [r for r in range(2, space.world_size + 1) if space.world_size % r == 0 and r % space.nodes == 0]
    return each(key, (own, 1, *sizes))


def _cost_replicate(r: int, t: StepTerms) -> None:
    """All-gathers and the gradients' reduce-scatter only within a replica of ``world_size / R`` ranks, then each
    rank's gradient shard all-reduced across the R replicas (a ring: ``2 (R - 1) / R`` of its bytes sent)."""
    if r > 1 and t.world_size > 1:
        t.shard_ranks = t.world_size // r
        t.replica_reduced_bytes += 2 * (r - 1) / r * t.states["trainable_parameters"]


REPLICATE = Switch(
    key="distributed.replicate",
    applied="shard: memfit.distributed.shard_model (FSDP2 fully_shard on the (replicate, shard) mesh of "
    "memfit.distributed.training_mesh)",
    check=_check_replicate,
    candidates=_plan_replicate,
    sharded_only=True,
    label=lambda v, cfg: f"hsdp={v}" if v > 1 else "",
    comment=lambda v: (
        f"hybrid sharding: {v} replicas, each sharding the model over its own ranks (a node) and all-reducing "
        "gradients across replicas: all-gathers stay within a node, each rank holds R x the shards"
        if v > 1
        else ""
    ),
    cost=_cost_replicate,
    refusals=(
        Refusal(
            {"distributed.replicate": 0}, "must be >= 1 replicas (1: FSDP2 shards over every rank), got 0"
        ),
        Refusal({"distributed.replicate": 2}, "2 replicas need a multiple of 2 ranks, and the run has 1"),
        Refusal(
            {"distributed.replicate": 2},
            "2 replicas need a multiple of 2 ranks, and the run has 3",
            world_size=3,
        ),
        Refusal(
            {"distributed.replicate": 2, "distributed.strategy": "fsdp1"},
            "needs distributed.strategy=fsdp2",
            world_size=4,
        ),
    ),
    no_parity="sharded: tests/test_hybrid_sharding.py compares a 2 x 2 hybrid mesh with one process",
    doc="hybrid sharding (HSDP): R replicas of world_size / R ranks; shards within a replica, gradients all-reduced "
    "across replicas",
)
