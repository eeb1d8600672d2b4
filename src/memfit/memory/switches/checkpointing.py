"""The switches of activation checkpointing: ``activation_checkpointing`` and its ``_interval``.

Each entry is declared after its checks, candidates and cost (:class:`~memfit.memory.switches.base.Switch`).
"""

from __future__ import annotations

from typing import Any

from memfit.memory.switches.base import (
    AC_MODES,
    EXACT,
    Parity,
    PlanSpace,
    Refusal,
    RunConfig,
    StepTerms,
    Switch,
    Target,
    check_nothing,
    checkpointed_layers,
    require,
)

# ----------------------------------------------------------------------------------------------------------------
# activation_checkpointing
# ----------------------------------------------------------------------------------------------------------------


PLAN_CHECKPOINTING = (("none", None), ("selective", None), ("every_n", 2), ("full", None))
"""``activation_checkpointing`` modes the planner tries (with the interval of ``every_n``)."""


def _plan_checkpointing(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    own = (cfg.activation_checkpointing, cfg.activation_checkpointing_interval)
    modes = [own] + [(m, n or cfg.activation_checkpointing_interval) for m, n in PLAN_CHECKPOINTING]
    return tuple(
        {"activation_checkpointing": m, "activation_checkpointing_interval": n}
        for m, n in dict.fromkeys(modes)
    )


def _changed_checkpointing(cfg: RunConfig, base: RunConfig) -> bool:
    if cfg.activation_checkpointing == base.activation_checkpointing == "every_n":
        return cfg.activation_checkpointing_interval != base.activation_checkpointing_interval
    return cfg.activation_checkpointing != base.activation_checkpointing


def _label_checkpointing(mode: str, cfg: RunConfig) -> str:
    if mode == "every_n":
        return f"ac=every_{cfg.activation_checkpointing_interval}"
    return "" if mode == "none" else f"ac={mode}"


def _cost_checkpointing(mode: str, t: StepTerms) -> None:
    m = t.mcfg
    recomputed: float = len(checkpointed_layers(m.num_layers, mode, t.cfg.activation_checkpointing_interval))
    if mode == "selective":  # only elementwise ops are redone
        recomputed = t.constants["selective_recompute_layer_forwards"] * m.num_layers
    t.per_token += t.flops["layers"] * recomputed / m.num_layers


ACTIVATION_CHECKPOINTING = Switch(
    key="activation_checkpointing",
    baseline="none",
    record="activation_checkpointing",
    applied="build: memfit.memory.techniques.apply_activation_checkpointing",
    check=check_nothing,
    choices=AC_MODES,
    activation=True,
    candidates=_plan_checkpointing,
    changed=_changed_checkpointing,
    label=_label_checkpointing,
    comment=lambda v: {
        "full": "recompute every layer in backward: ~1/3 more compute",
        "selective": "keep matmul and attention outputs, recompute the elementwise ops in backward",
        "every_n": "recompute every n-th layer in backward",
        "none": "",
    }[v],
    cost=_cost_checkpointing,
    parity=(
        Parity({"activation_checkpointing": "full"}, EXACT),
        Parity({"activation_checkpointing": "selective"}, EXACT),
    ),
    doc="recompute decoder layers' activations in backward: none, selective, every_n or full",
)


# ----------------------------------------------------------------------------------------------------------------
# activation_checkpointing_interval
# ----------------------------------------------------------------------------------------------------------------


def _check_interval(cfg: RunConfig, target: Target) -> None:
    require(
        cfg.activation_checkpointing_interval >= 1,
        "activation_checkpointing_interval",
        f"must be >= 1, got {cfg.activation_checkpointing_interval}",
    )


ACTIVATION_CHECKPOINTING_INTERVAL = Switch(
    key="activation_checkpointing_interval",
    applied="build: memfit.memory.techniques.apply_activation_checkpointing (every_n)",
    check=_check_interval,
    activation=True,
    in_yaml=lambda cfg: cfg.activation_checkpointing == "every_n",
    refusals=(
        Refusal(
            {"activation_checkpointing": "every_n", "activation_checkpointing_interval": 0},
            "must be >= 1, got 0",
        ),
    ),
    parity=(Parity({"activation_checkpointing": "every_n", "activation_checkpointing_interval": 2}, EXACT),),
    not_planned="planned with activation_checkpointing (every_n with interval 2, and the config's own)",
    doc="n of activation_checkpointing: every_n (planned with it, labelled ac=every_n)",
)
