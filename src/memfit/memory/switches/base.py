"""What every entry of the switch registry is made of, and the helpers the entries share.

The dataclasses an entry is (:class:`Switch`) and what its functions are given (:class:`Target`,
:class:`PlanSpace`, :class:`StepTerms`, the config as :class:`RunConfig`); the allowed values of the keys whose
values are a list; the helpers several families' entries use (checks, candidates, labels, comments). The entries
themselves are in the family modules beside this one, each with its own checks, candidates and cost; the package
(:mod:`memfit.memory.switches`) assembles them into :data:`~memfit.memory.switches.SWITCHES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from memfit.errors import ConfigError

if TYPE_CHECKING:
    from memfit.models.config import DecoderConfig


# ----------------------------------------------------------------------------------------------------------------
# The allowed values, by the key that takes them
# ----------------------------------------------------------------------------------------------------------------

DTYPES = ("fp32", "bf16", "bf16_mixed")
"""``dtype`` policies (:data:`memfit.build.PARAM_DTYPES`)."""
METHODS = ("full", "lora", "qlora", "adapter")
"""``method`` values (:func:`memfit.build.build_model`)."""
AC_MODES = ("none", "selective", "every_n", "full")
"""``activation_checkpointing`` modes (:func:`memfit.memory.techniques.apply_activation_checkpointing`)."""
STRATEGIES = ("fsdp2", "fsdp1")
"""``distributed.strategy`` values (:func:`memfit.distributed.shard_model`)."""


def require(cond: bool, key: str, message: str) -> None:
    """Raise :class:`~memfit.errors.ConfigError` ``config key 'KEY': MESSAGE`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"config key '{key}': {message}")


def one_of(value: Any, choices: tuple[Any, ...], key: str) -> None:
    """Refuse ``value`` unless it is one of ``choices``, listing them."""
    require(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def value_of(cfg: Any, dotted: str) -> Any:
    """The value of a dotted key (``optimizer.name``) of a :class:`~memfit.config.RunConfig`."""
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def with_values(cfg: Any, settings: dict[str, Any]) -> Any:
    """A copy of the config ``cfg`` with dotted keys (``optimizer.name``) set to ``settings``' values, unchecked."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for dotted, value in settings.items():
        head, _, rest = dotted.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, sub in nested.items():
        top[head] = with_values(getattr(cfg, head), sub)
    return dataclasses.replace(cfg, **top)


def checkpointed_layers(num_layers: int, mode: str, interval: int = 1) -> list[int]:
    """Indices of the decoder layers that ``mode`` checkpoints.

    Args:
        num_layers: layers in the model.
        mode: ``none``, ``selective`` or ``full`` (every layer) or ``every_n`` (layers 0, n, 2n, ...).
        interval: ``n`` for ``every_n``.

    Raises:
        ValueError: unknown mode or ``interval < 1``.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "none":
        return []
    if mode in ("full", "selective"):
        return list(range(num_layers))
    if interval < 1:
        raise ValueError(f"activation_checkpointing_interval must be >= 1, got {interval}")
    return list(range(0, num_layers, interval))


def recomputed_layers(num_layers: int, cfg: Any) -> int:
    """How many decoder layers run their forward again in the backward: those ``full`` or ``every_n`` checkpointing
    checkpoints (:func:`checkpointed_layers`); none under ``selective``, which recomputes no matmul and keeps
    attention's output. What the sequence- and tensor-parallel exchanges and the tiled MLP's cost repeat.

    Args:
        num_layers: layers in the model.
        cfg: the run config (``activation_checkpointing``, ``activation_checkpointing_interval``).
    """
    if cfg.activation_checkpointing == "selective":
        return 0
    return len(
        checkpointed_layers(num_layers, cfg.activation_checkpointing, cfg.activation_checkpointing_interval)
    )


# ----------------------------------------------------------------------------------------------------------------
# What an entry's functions are given
# ----------------------------------------------------------------------------------------------------------------


class OptimizerFields(Protocol):
    """The fields of ``optimizer`` (:class:`memfit.config.OptimizerConfig`) the entries read."""

    @property
    def name(self) -> str: ...
    @property
    def implementation(self) -> str: ...
    @property
    def cpu_offload(self) -> bool: ...


class DistributedFields(Protocol):
    """The fields of ``distributed`` (:class:`memfit.config.DistributedConfig`) the entries read."""

    @property
    def strategy(self) -> str: ...
    @property
    def reshard_after_forward(self) -> bool: ...
    @property
    def cpu_offload(self) -> bool: ...
    @property
    def prefetch(self) -> int: ...
    @property
    def limit_all_gathers(self) -> bool: ...
    @property
    def sequence_parallel(self) -> int: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def replicate(self) -> int: ...


class LoraFields(Protocol):
    @property
    def target_modules(self) -> list[str]: ...
    @property
    def dropout(self) -> float: ...


class AdapterFields(Protocol):
    @property
    def num_layers(self) -> int: ...


class RunConfig(Protocol):
    """The fields of a run's config that the entries read: :class:`memfit.config.RunConfig` has them.

    The registry names this protocol, not ``RunConfig``: ``memfit.config`` imports the registry to validate a
    config, so the registry does not import it back (not even for type checking). :func:`value_of` and
    :func:`with_values` read and set any dotted key of the real config."""

    @property
    def method(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def bf16_rounding(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def optimizer(self) -> OptimizerFields: ...
    @property
    def optimizer_in_backward(self) -> bool: ...
    @property
    def max_grad_norm(self) -> float: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def activation_checkpointing(self) -> str: ...
    @property
    def activation_checkpointing_interval(self) -> int: ...
    @property
    def chunked_cross_entropy(self) -> int | str: ...
    @property
    def tiled_mlp(self) -> int | str: ...
    @property
    def activation_offloading(self) -> bool: ...
    @property
    def compile(self) -> bool: ...
    @property
    def track_memory(self) -> bool: ...
    @property
    def distributed(self) -> DistributedFields: ...
    @property
    def lora(self) -> LoraFields: ...
    @property
    def adapter(self) -> AdapterFields: ...


@dataclass(frozen=True)
class Target:
    """Where a config is to run: what the checks of an entry are given."""

    device: str
    """``cpu`` or ``cuda``: the device type ``device`` resolves to (:func:`memfit.config.device_type`)."""
    world_size: int = 1
    """Ranks of the run; the switches that do not work sharded are refused only above 1."""

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class PlanSpace:
    """What the planner knows when it lists an entry's candidate values (:attr:`Switch.candidates`)."""

    cuda: bool
    """The target is a CUDA device."""
    world_size: int
    dtypes: tuple[str, ...]
    """The dtype policies to consider."""
    qlora_possible: bool
    """Every decoder linear can be stored in NF4 (and, sharded, split evenly over the ranks)."""
    tokens: int = 0
    """Tokens of a micro-batch, ``batch_size * seq_len``."""
    vocab_size: int = 0
    """The model's vocabulary."""
    num_heads: int = 0
    """The model's query heads (sequence parallelism splits them over its ranks)."""
    num_kv_heads: int = 0
    """The model's key/value heads."""
    nodes: int = 1
    """Nodes the ranks are spread over (``world_size / nodes`` a node): hybrid sharding is planned only across
    nodes."""
    optimizers: tuple[str, ...] | None = None
    """``optimizer.name`` values allowed besides the config's (``memfit plan --optimizers``), any update rule;
    ``None``: the planned entries that keep the config's update rule."""


@dataclass
class StepTerms:
    """The quantities of one step's cost (:func:`memfit.planner.cost.step_cost`) that switches change; each entry's
    :attr:`Switch.cost` adjusts them in :data:`SWITCHES` order, then ``step_cost`` turns them into seconds.

    Inputs (read only): ``cfg``, ``mcfg``, ``constants`` (:data:`memfit.planner.cost.COST_CONSTANTS` of the target),
    ``flops`` (forward FLOPs per token of ``layers`` and ``head``), ``tokens`` of the step, ``states`` (closed-form
    bytes of one rank), ``world_size``, ``offloaded_activation_bytes``, ``paged_out_bytes``, ``target``.
    """

    cfg: Any
    mcfg: Any
    constants: dict[str, Any]
    flops: dict[str, float]
    tokens: int
    states: dict[str, int]
    world_size: int
    offloaded_activation_bytes: int
    paged_out_bytes: int
    target: str = "cpu"
    """``cpu`` or ``cuda``: the device the run's parameters live on."""
    per_token: float = 0.0
    """FLOPs per token: 3 forwards of the model, plus what switches add (recomputation, the chunked loss)."""
    matmul_flops_per_second: float = 0.0
    """The effective matmul rate of the dtype policy."""
    dequantize_bytes: float = 0.0
    """Bytes moved by QLoRA's dequantization (at device memory bandwidth, on the compute stream)."""
    gathers: int = 2
    """All-gathers of the parameters per step (sharded)."""
    update_factor: float = 1.0
    """The optimizer update, as a multiple of AdamW's at the same dtype."""
    host_update: bool = False
    """The update runs on the host (offloaded state)."""
    per_tensor: bool = False
    """Each tensor is updated on its own (kernel launches per tensor)."""
    moved_bytes: int = 0
    """Bytes over the host link per step, on the compute stream."""
    overlapped_bytes: int = 0
    """Bytes over the host link per step on a side stream, overlapping compute (offloaded activations)."""
    shard_ranks: int = 0
    """Ranks a parameter is sharded over, whose all-gathers and reduce-scatters it takes (0: ``world_size``;
    hybrid sharding: the ranks of a replica)."""
    replica_reduced_bytes: float = 0.0
    """Bytes one rank sends per step all-reducing its gradient shards across hybrid sharding's replicas (between
    nodes); overlapped with compute as the all-gathers are."""
    exchanged_bytes: int = 0
    """Bytes one rank sends per step in sequence parallelism's all-to-alls, at the interconnect; attention waits
    for them (not overlapped)."""


@dataclass(frozen=True)
class Parity:
    """The loss a run with a switch set keeps against the baseline run (``tests/test_switch_parity.py``)."""

    settings: dict[str, Any]
    """Overrides of the run (this switch's, and what it needs)."""
    tolerance: float
    """Largest difference of a step's loss (absolute; relative when ``relative``)."""
    relative: bool = False
    why: str = "the same arithmetic"


@dataclass(frozen=True)
class Refusal:
    """A config an entry refuses and the start of what users are told (``config key 'KEY': MESSAGE...``, exit 2):
    the entry's declared conflicts, which ``tests/memory/test_switches.py`` holds it to."""

    settings: dict[str, Any]
    """Overrides of the default config (``memfit estimate`` takes them as they are)."""
    message: str
    """The start of the message after ``config key 'KEY': ``."""
    key: str = ""
    """The key the message names; default the entry's."""
    world_size: int = 1


@dataclass(frozen=True)
class Switch:
    """One memory technique's config key and what every layer needs to know of it (see the module doc)."""

    key: str
    """The dotted config key (a field of :class:`memfit.config.RunConfig`)."""
    applied: str
    """Where and how it takes effect: ``build: <function>`` (to the model, :func:`memfit.build.build_training`),
    ``step: <function>`` (an option of :func:`memfit.step.train_step` under the key's name), ``optimizer:
    <function>`` or ``shard: <function>`` (:func:`memfit.distributed.shard_model`)."""
    check: Callable[[RunConfig, Target], None]
    """Refuse a conflict with :func:`require` (``ConfigError``, exit 2 at the CLI); :attr:`choices` are checked
    (:func:`check_values`) before any entry's ``check`` runs."""
    choices: tuple[Any, ...] = ()
    """The allowed values, when they are a list."""
    check_model: Callable[[RunConfig, DecoderConfig], None] | None = None
    """Checks that need the architecture (:func:`memfit.config.check_lengths` calls them)."""
    trace_value: Any = None
    """Not ``None``: the estimator traces the step with this value instead (the switch needs a CUDA device or a
    compiler at build time; its bytes are accounted by :attr:`moves` and :attr:`host_bytes`)."""
    moves: Callable[[RunConfig, str], dict[str, str]] | None = None
    """``(cfg, target) -> {traced category: name}``: categories whose bytes live outside the device allocator,
    reported under ``name`` (``Estimate.unseen``)."""
    host_bytes: Callable[[RunConfig, str, dict[str, int]], dict[str, int]] | None = None
    """``(cfg, target, closed-form states) -> {name: bytes}``: host copies the trace does not see."""
    off_device: tuple[str, ...] = ()
    """When on (on CUDA), these closed-form states leave the device: its peak keeps only what is in flight."""
    offloads_activations: bool = False
    """When on (on CUDA), tensors saved for backward leave the device (the trace moves them itself; the planner's
    lower bound keeps none of them on the device, and its cost model charges their traffic)."""
    activation: bool = False
    """It changes what forward and backward allocate (the planner's bound from an estimated sibling)."""
    candidates: Callable[[RunConfig, PlanSpace], tuple[dict[str, Any], ...]] | None = None
    """The settings the planner tries, ``cfg``'s own first; ``None``: not planned (say why in :attr:`not_planned`)."""
    not_planned: str = ""
    """Why the planner leaves it as the config has it."""
    prune: Callable[[dict[str, Any], RunConfig], bool] | None = None
    """A combination of settings the planner skips (not worth estimating)."""
    sharded_only: bool = False
    """Planned and labelled only for ``world_size`` > 1."""
    label: Callable[[Any, RunConfig], str] | None = None
    """The short name in a plan's table (``ac=full``); ``""`` for the default value."""
    comment: Callable[[Any], str] | None = None
    """The trade-off written beside the key in ``memfit plan``'s YAML (``""``: none)."""
    changed: Callable[[RunConfig, RunConfig], bool] | None = None
    """Whether a candidate changes this switch of the planned config (default: its value differs)."""
    in_yaml: Callable[[RunConfig], bool] | None = None
    """Whether the plan's YAML always shows the key (default: when planned)."""
    cost: Callable[[Any, StepTerms], None] | None = None
    """``(value, terms)``: its share of the step's cost; ``None``: it costs no time."""
    baseline: Any = None
    """Its value in the planner's baseline, the fastest setting (which need not fit), whose step time a plan's
    ``relative_throughput`` divides; ``None``: the config's own (:func:`memfit.memory.switches.baseline_values`)."""
    record: str = ""
    """Its name in an estimate's ``config`` record (``memfit estimate --json``, which users' scripts read); ``""``:
    not recorded by name (``distributed.*`` are recorded as their whole section)."""
    refusals: tuple[Refusal, ...] = ()
    """Examples of what :attr:`check` and :attr:`check_model` refuse, one per conflict."""
    parity: tuple[Parity, ...] = ()
    no_parity: str = ""
    """Why it has no parity run (it needs CUDA, or another switch's run covers it)."""
    doc: str = ""
    """One line: what it does. docs/memory.md has its paragraph."""


# ----------------------------------------------------------------------------------------------------------------
# Helpers of several entries
# ----------------------------------------------------------------------------------------------------------------


def check_nothing(cfg: RunConfig, target: Target) -> None:
    """Nothing beyond the type (the dataclass's) and the allowed values (:attr:`Switch.choices`)."""


def auto_or_count(value: Any, key: str, what: str) -> None:
    """Refuse ``value`` unless it is ``auto`` or a count >= 0 of ``what`` (chunks, tiles)."""
    require(
        value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0),
        key,
        f"must be >= 0 {what} (0 is off) or auto, got {value!r}",
    )


def not_with_fsdp1(cfg: RunConfig, target: Target, key: str, why: str) -> None:
    """Refuse ``key`` on (truthy) in a sharded run of ``distributed.strategy=fsdp1``, saying ``why``."""
    require(
        not (target.sharded and value_of(cfg, key) and cfg.distributed.strategy == "fsdp1"),
        key,
        f"does not work with distributed.strategy=fsdp1: {why}",
    )


def within_tokens(key: str, what: str, advice: str) -> Callable[[RunConfig, DecoderConfig], None]:
    """A ``check_model`` refusing more ``what`` (chunks, tiles) than the tokens of a micro-batch."""

    def check(cfg: RunConfig, mcfg: DecoderConfig) -> None:
        sp = cfg.distributed.sequence_parallel
        tokens = cfg.batch_size * (cfg.seq_len or mcfg.max_seq_len) // sp
        value = value_of(cfg, key)
        of = "batch_size * seq_len" + (f" / sequence_parallel {sp}" if sp > 1 else "")
        require(
            value == "auto" or value <= tokens,
            key,
            f"{value} {what} exceed the {tokens} tokens of a micro-batch ({of}); use at most that many{advice}",
        )

    return check


def each(key: str, values: Any) -> tuple[dict[str, Any], ...]:
    return tuple({key: v} for v in dict.fromkeys(values))


def flag(name: str, on: bool = True) -> Callable[[Any, RunConfig], str]:
    """The label ``name`` when the value is ``on``."""
    return lambda value, cfg: name if bool(value) == on else ""


def when(text: str, on: bool = True) -> Callable[[Any], str]:
    """The comment ``text`` when the value is ``on``."""
    return lambda value: text if bool(value) == on else ""


def moves_state(cfg: Any, target: str) -> dict[str, str]:
    return {"optimizer_state": "offloaded_optimizer_state"} if target == "cuda" else {}


def host_on_cuda(reported: dict[str, str]) -> Callable[[Any, str, dict[str, int]], dict[str, int]]:
    """A :attr:`Switch.host_bytes` rule: on CUDA, host memory reported under each key of ``reported``, as many bytes
    as the closed-form model state named by its value (``closed``: bytes by state); nothing on CPU, where the
    states already live in host memory."""

    def host_bytes(cfg: Any, target: str, closed: dict[str, int]) -> dict[str, int]:
        return {name: closed[state] for name, state in reported.items()} if target == "cuda" else {}

    return host_bytes


EXACT = 1e-6
"""The tolerance of a :class:`Parity` run that does the same arithmetic as the baseline (float32 noise)."""
