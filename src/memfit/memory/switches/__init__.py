"""The memory techniques, one declared entry each: what every layer of memfit needs to know of a switch.

A :class:`Switch` is one config key. Its entry holds, next to a pointer to the code that implements it:

- **config**: the key, its allowed values (:attr:`Switch.choices`) and the checks of its value and of its conflicts
  with other switches, strategies, methods and devices (:attr:`Switch.check`; ``check_model`` for those that need
  the architecture), each with the message users see;
- **how it is applied** (:attr:`Switch.applied`): at build time to the model, as an option of the training step
  (under the config key's own name, :data:`memfit.step.STEP_OPTIONS`), or by the launcher;
- **the estimator** (:mod:`memfit.planner.estimate`): whether the eager trace on fake CPU tensors sees its bytes
  as the target does (:attr:`Switch.trace_value`: the value the trace runs with instead), which traced categories
  leave the device (:attr:`Switch.moves`) and the closed-form host bytes it adds (:attr:`Switch.host_bytes`);
- **the planner** (:mod:`memfit.planner.plan`): its candidate values (:attr:`Switch.candidates`), its share of
  the cost model (:attr:`Switch.cost`), its short label (``ac=full``, ``ce=8``) and the one-line comment beside it
  in the runnable YAML of ``memfit plan``;
- **the tests**: the loss parity its runs keep with the baseline (:attr:`Switch.parity`).

:data:`SWITCHES` lists the entries in the order the planner combines them and the labels are written. The
functions below iterate it; config validation, the estimator, the planner and the report read nothing else about
a switch. The optimizers behind ``optimizer.name`` have their own registry, :mod:`memfit.memory.optimizers`.

Each entry is declared in the module of its family, after its own checks, candidates and cost: :mod:`.methods`
(``method``, ``dtype``), :mod:`.optimizer` (the optimizer step's four), :mod:`.checkpointing`, :mod:`.sequence`
(chunked loss, tiled MLP, sequence parallelism), :mod:`.compile_offload` (activation offloading, ``compile``),
:mod:`.sharding` (FSDP's, hybrid sharding's) and :mod:`.tensor` (tensor parallelism); :mod:`.base` holds what an
entry is made of and the helpers the families share.
Searching for ``key="tiled_mlp"`` lands on the entry, its functions just above it.

Adding a switch is one entry in its family's module, listed in :data:`SWITCHES` here, plus its implementation;
``tests/memory/test_switches.py`` fails for an entry without its planner parts or its line in docs/memory.md.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from memfit.memory.switches.base import (
    AC_MODES,
    DTYPES,
    METHODS,
    STRATEGIES,
    Parity,
    PlanSpace,
    Refusal,
    RunConfig,
    StepTerms,
    Switch,
    Target,
    check_nothing,
    checkpointed_layers,
    one_of,
    require,
    value_of,
    with_values,
)
from memfit.memory.switches.checkpointing import ACTIVATION_CHECKPOINTING, ACTIVATION_CHECKPOINTING_INTERVAL
from memfit.memory.switches.compile_offload import ACTIVATION_OFFLOADING, COMPILE, cxx_compiler
from memfit.memory.switches.methods import (
    BF16_ROUNDING,
    DTYPE,
    METHOD,
    dequantize_passes,
    layer_weights,
    resolved_rounding,
)
from memfit.memory.switches.optimizer import (
    OPTIMIZER_CPU_OFFLOAD,
    OPTIMIZER_IMPLEMENTATION,
    OPTIMIZER_IN_BACKWARD,
    OPTIMIZER_NAME,
)
from memfit.memory.switches.sequence import (
    AUTO_CHUNK_LOGITS,
    AUTO_CHUNK_TOKENS,
    CHUNKED_CROSS_ENTROPY,
    SEQUENCE_PARALLEL,
    TILED_MLP,
    all_to_all_elements,
    kv_heads_sent,
)
from memfit.memory.switches.sharding import (
    FSDP_CPU_OFFLOAD,
    LIMIT_ALL_GATHERS,
    PREFETCH,
    REPLICATE,
    RESHARD_AFTER_FORWARD,
    STRATEGY,
)
from memfit.memory.switches.tensor import TENSOR_PARALLEL, tensor_parallel_elements

if TYPE_CHECKING:
    from memfit.models.config import DecoderConfig

__all__ = [
    "AC_MODES",
    "AUTO_CHUNK_LOGITS",
    "AUTO_CHUNK_TOKENS",
    "DTYPES",
    "METHODS",
    "STRATEGIES",
    "SWITCHES",
    "SWITCHES_BY_KEY",
    "Parity",
    "PlanSpace",
    "Refusal",
    "RunConfig",
    "StepTerms",
    "Switch",
    "Target",
    "activation_key",
    "add_costs",
    "baseline_values",
    "all_to_all_elements",
    "changed_keys",
    "check",
    "check_model",
    "check_nothing",
    "check_values",
    "checkpointed_layers",
    "comment",
    "cxx_compiler",
    "dequantize_passes",
    "host_copies",
    "kv_heads_sent",
    "label",
    "layer_weights",
    "moved_categories",
    "off_device_states",
    "offloads_activations",
    "one_of",
    "plan_settings",
    "planned",
    "records",
    "require",
    "resolved_rounding",
    "switch_keys",
    "tensor_parallel_elements",
    "trace_values",
    "value_of",
    "values",
    "with_values",
    "yaml_keys",
]

# ----------------------------------------------------------------------------------------------------------------
# The registry, in the order the planner combines the entries and a plan's label lists them
# ----------------------------------------------------------------------------------------------------------------

SWITCHES: tuple[Switch, ...] = (
    METHOD,
    DTYPE,
    OPTIMIZER_NAME,
    OPTIMIZER_IMPLEMENTATION,
    OPTIMIZER_IN_BACKWARD,
    OPTIMIZER_CPU_OFFLOAD,
    BF16_ROUNDING,
    ACTIVATION_CHECKPOINTING,
    ACTIVATION_CHECKPOINTING_INTERVAL,
    CHUNKED_CROSS_ENTROPY,
    TILED_MLP,
    ACTIVATION_OFFLOADING,
    COMPILE,
    STRATEGY,
    RESHARD_AFTER_FORWARD,
    FSDP_CPU_OFFLOAD,
    PREFETCH,
    LIMIT_ALL_GATHERS,
    REPLICATE,
    SEQUENCE_PARALLEL,
    TENSOR_PARALLEL,
)
"""Every memory technique, in the order the planner combines them and a plan's label lists them."""

SWITCHES_BY_KEY: dict[str, Switch] = {s.key: s for s in SWITCHES}


# ----------------------------------------------------------------------------------------------------------------
# What the layers ask of the registry
# ----------------------------------------------------------------------------------------------------------------


def check_values(cfg: RunConfig) -> None:
    """Every switch's value against its allowed values (:attr:`Switch.choices`), in :data:`SWITCHES` order; config
    validation runs this before the checks that read other keys.

    Raises:
        ConfigError: naming the first offending key and listing its values.
    """
    for switch in SWITCHES:
        if switch.choices:
            one_of(value_of(cfg, switch.key), switch.choices, switch.key)


def check(cfg: RunConfig, target: Target) -> None:
    """Every switch's conflicts (:attr:`Switch.check`), in :data:`SWITCHES` order, once :func:`check_values`
    passed.

    Raises:
        ConfigError: naming the first offending key.
    """
    for switch in SWITCHES:
        switch.check(cfg, target)


def check_model(cfg: RunConfig, mcfg: DecoderConfig) -> None:
    """The checks that need the architecture (:attr:`Switch.check_model`)."""
    for switch in SWITCHES:
        if switch.check_model is not None:
            switch.check_model(cfg, mcfg)


def trace_values() -> dict[str, Any]:
    """``{dotted key: value}`` the estimator's trace runs with instead of ``cfg``'s (:attr:`Switch.trace_value`)."""
    return {s.key: s.trace_value for s in SWITCHES if s.trace_value is not None}


def baseline_values() -> dict[str, Any]:
    """``{dotted key: value}`` of the planner's baseline, the fastest setting of each switch that has one
    (:attr:`Switch.baseline`; the dtype policy is the planner's first)."""
    return {s.key: s.baseline for s in SWITCHES if s.baseline is not None}


def records(cfg: RunConfig) -> dict[str, Any]:
    """``{name: value}`` of the switches an estimate records by name (:attr:`Switch.record`), in :data:`SWITCHES`
    order."""
    return {s.record: value_of(cfg, s.key) for s in SWITCHES if s.record}


def _is_on(cfg: RunConfig, switch: Switch) -> bool:
    """The switch's value is truthy (set, on, > 0)."""
    return bool(value_of(cfg, switch.key))


def moved_categories(cfg: RunConfig, target: str) -> dict[str, str]:
    """Traced categories that live outside the device allocator, by the name they are reported under."""
    moved: dict[str, str] = {}
    for s in SWITCHES:
        if s.moves is not None and _is_on(cfg, s):
            moved.update(s.moves(cfg, target))
    return moved


def host_copies(cfg: RunConfig, target: str, closed: dict[str, int]) -> dict[str, int]:
    """Host bytes the trace does not see, by name (:attr:`Switch.host_bytes`)."""
    out: dict[str, int] = {}
    for s in SWITCHES:
        if s.host_bytes is not None and _is_on(cfg, s):
            out.update(s.host_bytes(cfg, target, closed))
    return out


def offloads_activations(cfg: RunConfig, target: str) -> bool:
    """Tensors saved for backward leave the device (:attr:`Switch.offloads_activations`; only a CUDA target has a
    host apart from the device)."""
    return target == "cuda" and any(s.offloads_activations and _is_on(cfg, s) for s in SWITCHES)


def off_device_states(cfg: RunConfig, target: str) -> tuple[str, ...]:
    """Closed-form states that leave the device on ``target`` (:attr:`Switch.off_device`)."""
    if target != "cuda":
        return ()
    return tuple(k for s in SWITCHES if s.off_device and _is_on(cfg, s) for k in s.off_device)


def planned(world_size: int) -> tuple[Switch, ...]:
    """The switches a plan sets, in order (the sharded ones only for ``world_size`` > 1)."""
    return tuple(s for s in SWITCHES if s.candidates is not None and (world_size > 1 or not s.sharded_only))


def switch_keys(world_size: int = 2) -> tuple[str, ...]:
    """The keys of :func:`planned`."""
    return tuple(s.key for s in planned(world_size))


def values(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """``{key: value}`` of the planned switches of ``cfg``."""
    return {s.key: value_of(cfg, s.key) for s in planned(world_size)}


def changed_keys(cfg: RunConfig, base: RunConfig, world_size: int) -> tuple[str, ...]:
    """The planned switches whose value in ``cfg`` differs from ``base`` (:attr:`Switch.changed`)."""
    out = []
    for s in planned(world_size):
        if s.changed is not None:
            if s.changed(cfg, base):
                out.append(s.key)
        elif value_of(cfg, s.key) != value_of(base, s.key):
            out.append(s.key)
    return tuple(out)


def label(switch_values: dict[str, Any], cfg: RunConfig) -> str:
    """Short names of the switches (``bf16 paged_adamw8bit in_bwd ac=full ce=8``; a fine-tuning method first)."""
    parts = []
    for s in SWITCHES:
        if s.label is not None and s.key in switch_values:
            part = s.label(switch_values[s.key], cfg)
            if part:
                parts.append(part)
    return " ".join(parts)


def comment(key: str, value: Any) -> str:
    """The trade-off of ``key: value`` for the plan's YAML, ``""`` for none.

    Raises:
        KeyError: ``key`` has no comment, or ``value`` is not one the entry describes.
    """
    fn = SWITCHES_BY_KEY[key].comment
    if fn is None:
        raise KeyError(key)
    return fn(value)


def yaml_keys(cfg: RunConfig) -> set[str]:
    """The switch keys the plan's YAML shows whatever their value."""
    out = set()
    for s in SWITCHES:
        if s.in_yaml is not None:
            if s.in_yaml(cfg):
                out.add(s.key)
        elif s.candidates is not None:
            out.add(s.key)
    return out


def activation_key(cfg: RunConfig) -> tuple:
    """The values of the switches that decide what forward and backward allocate (:attr:`Switch.activation`)."""
    every_n = cfg.activation_checkpointing == "every_n"
    return tuple(
        (value_of(cfg, s.key) if s.key != "activation_checkpointing_interval" or every_n else 0)
        for s in SWITCHES
        if s.activation
    )


def add_costs(terms: StepTerms) -> StepTerms:
    """Every entry's share of the step's cost (:attr:`Switch.cost`), in :data:`SWITCHES` order."""
    for s in SWITCHES:
        if s.cost is not None:
            s.cost(value_of(terms.cfg, s.key), terms)
    return terms


def plan_settings(cfg: RunConfig, space: PlanSpace) -> list[dict[str, Any]]:
    """Every combination of the planned switches' candidate settings, ``cfg``'s own first, pruned
    (:attr:`Switch.prune`) and without repeats: ``{dotted key: value}`` each, to apply to ``cfg``."""

    entries = planned(space.world_size)
    out, seen = [], set()
    for combo in itertools.product(*(s.candidates(cfg, space) for s in entries)):
        settings: dict[str, Any] = {}
        for part in combo:
            settings.update(part)
        key = tuple(sorted((k, repr(v)) for k, v in settings.items() if k != "max_grad_norm"))
        if key in seen:
            continue
        current = {s.key: value_of(cfg, s.key) for s in SWITCHES}
        view = {**current, **settings}
        if any(s.prune is not None and s.prune(view, cfg) for s in entries):
            continue
        seen.add(key)
        out.append(settings)
    return out
