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

Adding a switch is one entry here plus its implementation; ``tests/memory/test_switches.py`` fails for an entry
without its planner parts or its line in docs/memory.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memfit.errors import ConfigError
from memfit.memory import optimizers
from memfit.models import peft

if TYPE_CHECKING:
    from memfit.config import TrainConfig
    from memfit.models.llama import LlamaConfig

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
    """The value of a dotted key (``optimizer.name``) of a :class:`~memfit.config.TrainConfig`."""
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


def cxx_compiler() -> str | None:
    """The C++ compiler TorchInductor would build CPU kernels with: ``$CXX``, else ``g++``, else ``clang++`` (its
    path), or ``None`` when there is none."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


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


def layer_weights(mcfg: LlamaConfig) -> int:
    """Weights of one decoder layer's linears: q, k, v, o projections and the SwiGLU MLP's gate, up and down (the
    weights QLoRA stores in NF4, :data:`memfit.models.peft.QLORA_QUANTIZED`)."""
    d, hd = mcfg.dim, mcfg.dim // mcfg.num_heads
    return 2 * d * mcfg.num_heads * hd + 2 * d * mcfg.num_kv_heads * hd + 3 * d * mcfg.intermediate_size


def kv_heads_sent(num_kv_heads: int, size: int) -> int:
    """Key/value heads each rank exchanges: ``num_kv_heads``, or ``size`` when each is repeated to fill the group.

    Raises:
        ValueError: ``num_kv_heads`` and ``size`` divide neither way.
    """
    if num_kv_heads % size == 0:
        return num_kv_heads
    if size % num_kv_heads == 0:
        return size
    raise ValueError(f"num_kv_heads {num_kv_heads} and sequence_parallel {size}: neither divides the other")


def all_to_all_elements(
    batch_size: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, size: int
) -> int:
    """Elements one rank sends (and receives) in one layer's forward: ``(N - 1) / N`` of its query, key, value and
    attention-output shards (the backward exchanges as many again, a recomputed forward as many again).

    Args:
        batch_size: B.
        seq_len: T, the whole sequence (each rank holds ``T / size`` tokens).
        num_heads: nh.
        num_kv_heads: nkv (repeated to ``size`` heads when fewer, :func:`kv_heads_sent`).
        head_dim: hd.
        size: N, ranks of the sequence-parallel group.

    Returns:
        Elements (multiply by the activation dtype's size for bytes); 0 for ``size`` 1.
    """
    if size == 1:
        return 0
    heads = 2 * num_heads + 2 * kv_heads_sent(num_kv_heads, size)  # q and the output; k and v
    return batch_size * (seq_len // size) * heads * head_dim * (size - 1) // size


def dequantize_passes(cfg: TrainConfig, num_layers: int) -> float:
    """How many times a step dequantizes each NF4 weight of QLoRA, averaged over the layers (0 for other methods).

    Per micro-batch: once in the forward and once in the backward (the input gradient; frozen weights have no weight
    gradient), and once more in the recomputed forward of a checkpointed layer (``full``: every layer;
    ``every_n``: every n-th; ``selective`` recomputes no matmul, so no dequantization).
    """
    if cfg.method != "qlora":
        return 0.0
    recomputed = 0
    if cfg.activation_checkpointing != "selective":
        recomputed = len(
            checkpointed_layers(
                num_layers, cfg.activation_checkpointing, cfg.activation_checkpointing_interval
            )
        )
    return cfg.gradient_accumulation_steps * (2 + recomputed / num_layers)


# ----------------------------------------------------------------------------------------------------------------
# What an entry's functions are given
# ----------------------------------------------------------------------------------------------------------------


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
    optimizers: tuple[str, ...] | None = None
    """``optimizer.name`` values allowed besides the config's (``memfit plan --optimizers``), any update rule;
    ``None``: the planned entries that keep the config's update rule."""


@dataclass
class StepTerms:
    """The quantities of one step's cost (:func:`memfit.planner.cost.step_cost`) that switches change; each entry's
    :attr:`Switch.cost` adjusts them in :data:`SWITCHES` order, then ``step_cost`` turns them into seconds.

    Inputs (read only): ``cfg``, ``mcfg``, ``constants`` (:data:`memfit.planner.cost.COST_CONSTANTS` of the target),
    ``flops`` (forward FLOPs per token of ``layers`` and ``head``), ``tokens`` of the step, ``states`` (closed-form
    bytes of one rank), ``world_size``, ``offloaded_activation_bytes``, ``paged_out_bytes``.
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
    """The dotted config key (a field of :class:`memfit.config.TrainConfig`)."""
    applied: str
    """Where and how it takes effect: ``build: <function>`` (to the model, :func:`memfit.build.build_training`),
    ``step: <function>`` (an option of :func:`memfit.step.train_step` under the key's name), ``optimizer:
    <function>`` or ``shard: <function>`` (:func:`memfit.distributed.shard_model`)."""
    check: Callable[[TrainConfig, Target], None]
    """Refuse a conflict with :func:`require` (``ConfigError``, exit 2 at the CLI); :attr:`choices` are checked
    (:func:`check_values`) before any entry's ``check`` runs."""
    choices: tuple[Any, ...] = ()
    """The allowed values, when they are a list."""
    check_model: Callable[[TrainConfig, LlamaConfig], None] | None = None
    """Checks that need the architecture (:func:`memfit.config.check_lengths` calls them)."""
    trace_value: Any = None
    """Not ``None``: the estimator traces the step with this value instead (the switch needs a CUDA device or a
    compiler at build time; its bytes are accounted by :attr:`moves` and :attr:`host_bytes`)."""
    moves: Callable[[TrainConfig, str], dict[str, str]] | None = None
    """``(cfg, target) -> {traced category: name}``: categories whose bytes live outside the device allocator,
    reported under ``name`` (``Estimate.unseen``)."""
    host_bytes: Callable[[TrainConfig, str, dict[str, int]], dict[str, int]] | None = None
    """``(cfg, target, closed-form states) -> {name: bytes}``: host copies the trace does not see."""
    off_device: tuple[str, ...] = ()
    """When on (on CUDA), these closed-form states leave the device: its peak keeps only what is in flight."""
    offloads_activations: bool = False
    """When on (on CUDA), tensors saved for backward leave the device (the trace moves them itself; the planner's
    lower bound keeps none of them on the device, and its cost model charges their traffic)."""
    activation: bool = False
    """It changes what forward and backward allocate (the planner's bound from an estimated sibling)."""
    candidates: Callable[[TrainConfig, PlanSpace], tuple[dict[str, Any], ...]] | None = None
    """The settings the planner tries, ``cfg``'s own first; ``None``: not planned (say why in :attr:`not_planned`)."""
    not_planned: str = ""
    """Why the planner leaves it as the config has it."""
    prune: Callable[[dict[str, Any], TrainConfig], bool] | None = None
    """A combination of settings the planner skips (not worth estimating)."""
    sharded_only: bool = False
    """Planned and labelled only for ``world_size`` > 1."""
    label: Callable[[Any, TrainConfig], str] | None = None
    """The short name in a plan's table (``ac=full``); ``""`` for the default value."""
    comment: Callable[[Any], str] | None = None
    """The trade-off written beside the key in ``memfit plan``'s YAML (``""``: none)."""
    changed: Callable[[TrainConfig, TrainConfig], bool] | None = None
    """Whether a candidate changes this switch of the planned config (default: its value differs)."""
    in_yaml: Callable[[TrainConfig], bool] | None = None
    """Whether the plan's YAML always shows the key (default: when planned)."""
    cost: Callable[[Any, StepTerms], None] | None = None
    """``(value, terms)``: its share of the step's cost; ``None``: it costs no time."""
    refusals: tuple[Refusal, ...] = ()
    """Examples of what :attr:`check` and :attr:`check_model` refuse, one per conflict."""
    parity: tuple[Parity, ...] = ()
    no_parity: str = ""
    """Why it has no parity run (it needs CUDA, or another switch's run covers it)."""
    doc: str = ""
    """One line: what it does. docs/memory.md has its paragraph."""


# ----------------------------------------------------------------------------------------------------------------
# The checks of each entry
# ----------------------------------------------------------------------------------------------------------------


def _check_method(cfg: TrainConfig, target: Target) -> None:
    require(
        not (target.sharded and cfg.method == "qlora" and cfg.distributed.strategy == "fsdp1"),
        "method",
        "qlora does not work with distributed.strategy=fsdp1: FSDP1 flattens a unit's weights into one buffer of "
        "one dtype, which cannot hold NF4 weights. Use distributed.strategy=fsdp2 (which shards torchao's NF4 "
        "tensors as they are)",
    )


def _check_method_model(cfg: TrainConfig, mcfg: LlamaConfig) -> None:
    if cfg.method == "qlora":
        hd = mcfg.head_dim
        block = peft.NF4_BLOCK_SIZE
        shapes = {
            "q_proj/o_proj": (mcfg.num_heads * hd, mcfg.dim),
            "k_proj/v_proj": (mcfg.num_kv_heads * hd, mcfg.dim),
            "gate_proj/up_proj/down_proj": (mcfg.intermediate_size, mcfg.dim),
        }
        for names, (rows, cols) in shapes.items():
            require(
                rows * cols % block == 0,
                "method",
                f"qlora stores each decoder linear in NF4 blocks of {block} weights, but {names} have "
                f"{rows} x {cols} weights, not a multiple of {block}; use method=lora for this model",
            )
    if cfg.method in peft.LORA_METHODS and "lm_head" in cfg.lora.target_modules and mcfg.tie_word_embeddings:
        raise ConfigError(
            "config key 'lora.target_modules': this model ties lm_head to the input embedding, so a LoRA update "
            "of lm_head would also change the embedding when merged; leave lm_head out"
        )
    if cfg.method == "adapter" and cfg.adapter.num_layers > mcfg.num_layers:
        raise ConfigError(
            f"config key 'adapter.num_layers': {cfg.adapter.num_layers} exceeds the model's {mcfg.num_layers} "
            f"layers; use at most {mcfg.num_layers} (0 adapts all)"
        )


def _check_optimizer_name(cfg: TrainConfig, target: Target) -> None:
    opt = cfg.optimizer
    reason = optimizers.check_optimizer_supported(
        opt.name,
        target.device,
        cpu_offload=opt.cpu_offload,
        in_backward=cfg.optimizer_in_backward,
        max_grad_norm=cfg.max_grad_norm,
    )
    require(
        reason is None,
        "optimizer.cpu_offload" if opt.cpu_offload and reason and "offload" in reason else "optimizer.name",
        str(reason),
    )
    if target.sharded:
        reason = optimizers.sharded_refusal(opt.name, strategy=cfg.distributed.strategy, dtype=cfg.dtype)
        require(reason is None, "optimizer.name", str(reason))


def _check_implementation(cfg: TrainConfig, target: Target) -> None:
    known = optimizers.spec(cfg.optimizer.name).implementations
    require(
        not known or cfg.optimizer.implementation in known,
        "optimizer.implementation",
        f"{cfg.optimizer.implementation!r} is not one of {cfg.optimizer.name}'s: {', '.join(known)}",
    )


def _check_in_backward(cfg: TrainConfig, target: Target) -> None:
    if cfg.optimizer_in_backward:
        require(
            cfg.gradient_accumulation_steps == 1,
            "optimizer_in_backward",
            "needs gradient_accumulation_steps=1: each update runs as soon as a parameter's gradient of one "
            "micro-batch is ready, so gradients cannot accumulate over micro-batches; raise batch_size instead",
        )
        require(
            cfg.max_grad_norm == 0,
            "optimizer_in_backward",
            "cannot clip by the global gradient norm (max_grad_norm > 0): each parameter is updated before the "
            "other gradients exist. Set max_grad_norm=0 (grad_norm is still reported) or turn the switch off",
        )
    require(
        not (target.sharded and cfg.optimizer_in_backward and cfg.distributed.strategy == "fsdp1"),
        "optimizer_in_backward",
        "does not work with distributed.strategy=fsdp1: FSDP1 reduces gradients into flat shards after autograd "
        "has run the per-parameter hooks, so the updates would see unreduced gradients. Use "
        "distributed.strategy=fsdp2 (which runs the hooks after its reduce-scatter) or turn the switch off",
    )


def _check_optimizer_offload(cfg: TrainConfig, target: Target) -> None:
    # the device and the combinations with the optimizer: optimizers.check_optimizer_supported (optimizer.name)
    require(
        not (target.sharded and cfg.optimizer.cpu_offload),
        "optimizer.cpu_offload",
        "is not supported sharded; use distributed.cpu_offload, which offloads the shards and their optimizer "
        "step to the host",
    )


def _check_interval(cfg: TrainConfig, target: Target) -> None:
    require(
        cfg.activation_checkpointing_interval >= 1,
        "activation_checkpointing_interval",
        f"must be >= 1, got {cfg.activation_checkpointing_interval}",
    )


def _auto_or_count(value: Any, key: str, what: str) -> None:
    require(
        value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0),
        key,
        f"must be >= 0 {what} (0 is off) or auto, got {value!r}",
    )


def _not_with_fsdp1(cfg: TrainConfig, target: Target, key: str, why: str) -> None:
    require(
        not (target.sharded and value_of(cfg, key) and cfg.distributed.strategy == "fsdp1"),
        key,
        f"does not work with distributed.strategy=fsdp1: {why}",
    )


def _check_chunks(cfg: TrainConfig, target: Target) -> None:
    _auto_or_count(cfg.chunked_cross_entropy, "chunked_cross_entropy", "chunks")
    _not_with_fsdp1(
        cfg,
        target,
        "chunked_cross_entropy",
        "the loss applies lm_head's weight after the model's forward, where FSDP1 has put its flat shard back in "
        "place of the gathered weight. Use distributed.strategy=fsdp2 (which keeps the root's weights gathered "
        "until the backward) or chunked_cross_entropy=0",
    )


def _within_tokens(key: str, what: str, advice: str) -> Callable[[TrainConfig, LlamaConfig], None]:
    """A ``check_model`` refusing more ``what`` (chunks, tiles) than the tokens of a micro-batch."""

    def check(cfg: TrainConfig, mcfg: LlamaConfig) -> None:
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


def _check_tiled(cfg: TrainConfig, target: Target) -> None:
    _auto_or_count(cfg.tiled_mlp, "tiled_mlp", "tiles")
    _check_tiled_compiled(cfg, target)
    _not_with_fsdp1(
        cfg,
        target,
        "tiled_mlp",
        "FSDP1 gives the MLP's weights to the forward as views of its flat parameter, not as the module's "
        "parameters, so the tiles' recomputation in the backward cannot return their gradients. Use "
        "distributed.strategy=fsdp2 or tiled_mlp=0",
    )


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _check_sequence_parallel(cfg: TrainConfig, target: Target) -> None:
    sp, key = cfg.distributed.sequence_parallel, "distributed.sequence_parallel"
    require(
        isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1, key, f"must be >= 1 ranks, got {sp!r}"
    )
    if sp == 1:
        return
    require(
        target.world_size % sp == 0 and target.world_size > 1,
        key,
        f"{sp} ranks per sequence need a multiple of {sp} ranks, and the run has {target.world_size}; launch with "
        f"nproc={sp} (or a multiple: the rest is data parallel), or set it to 1",
    )
    require(
        cfg.distributed.strategy == "fsdp2",
        key,
        "needs distributed.strategy=fsdp2: FSDP1 flattens each layer's weights into one buffer, and the attention "
        "exchange is written for FSDP2's per-parameter sharding",
    )
    if cfg.seq_len:  # else the model's max_seq_len, checked with the architecture
        _require_sequence_divides(cfg.seq_len, sp)


def _require_sequence_divides(seq_len: int, sp: int) -> None:
    require(
        seq_len % sp == 0,
        "distributed.sequence_parallel",
        f"seq_len {seq_len} is not divisible by {sp}: each rank holds seq_len / {sp} tokens; use a seq_len that "
        f"is a multiple of {sp}",
    )


def _check_sequence_parallel_model(cfg: TrainConfig, mcfg: LlamaConfig) -> None:
    sp, key = cfg.distributed.sequence_parallel, "distributed.sequence_parallel"
    if sp == 1:
        return
    require(
        mcfg.num_heads % sp == 0,
        key,
        f"the model's num_heads {mcfg.num_heads} is not divisible by {sp}: each rank attends with num_heads / "
        f"{sp} heads; use a divisor of {mcfg.num_heads}",
    )
    require(
        mcfg.num_kv_heads % sp == 0 or sp % mcfg.num_kv_heads == 0,
        key,
        f"the model's num_kv_heads {mcfg.num_kv_heads} and {sp} divide neither way: key/value heads are split over "
        f"the ranks or repeated to fill them",
    )
    _require_sequence_divides(cfg.seq_len or mcfg.max_seq_len, sp)


def _check_tiled_compiled(cfg: TrainConfig, target: Target) -> None:
    dropout_inside = (
        cfg.method in peft.LORA_METHODS
        and cfg.lora.dropout > 0
        and any(m in MLP_PROJECTIONS for m in cfg.lora.target_modules)
    )
    require(
        not (cfg.tiled_mlp and cfg.compile and dropout_inside),
        "tiled_mlp",
        "with compile cannot replay LoRA's dropout inside the MLP: the tiles recomputed in the backward would draw "
        "other dropout masks than the forward's, which a compiled graph cannot rewind. Set lora.dropout=0, leave "
        "gate_proj/up_proj/down_proj out of lora.target_modules, or turn compile or tiled_mlp off",
    )


def _check_compile(cfg: TrainConfig, target: Target) -> None:
    require(
        not (cfg.compile and cfg.track_memory),
        "compile",
        "cannot be combined with track_memory: the tracker sees each tensor through a dispatch mode, which "
        "compiled kernels bypass. Track the eager step (compile=false), or predict it with `memfit estimate`",
    )
    require(
        not (cfg.compile and target.device == "cpu") or cxx_compiler() is not None,
        "compile",
        "needs a C++ compiler on CPU (TorchInductor builds its CPU kernels with one) and none was found: install "
        "g++ or clang++, name yours in $CXX, or set compile=false",
    )
    require(
        not (cfg.compile and cfg.activation_offloading),
        "compile",
        "cannot be combined with activation_offloading: its saved-tensor hooks move tensors between devices "
        "inside the graph the compiler captures. Turn one of them off",
    )
    require(
        not (target.sharded and cfg.compile and cfg.distributed.strategy == "fsdp1"),
        "compile",
        "does not work with distributed.strategy=fsdp1, which flattens each layer's parameters into one buffer "
        "outside the compiled graph. Use distributed.strategy=fsdp2 (compiled layers are then sharded "
        "per layer, as torchtitan does) or compile=false",
    )


def _check_prefetch(cfg: TrainConfig, target: Target) -> None:
    d = cfg.distributed
    require(d.prefetch >= 0, "distributed.prefetch", f"must be >= 0 (0: FSDP's defaults), got {d.prefetch}")


def _check_limit_all_gathers(cfg: TrainConfig, target: Target) -> None:
    d = cfg.distributed
    require(
        d.strategy == "fsdp1" or d.limit_all_gathers,
        "distributed.limit_all_gathers",
        "applies to distributed.strategy=fsdp1 only; FSDP2 bounds its all-gathers by distributed.prefetch",
    )


def _check_nothing(cfg: TrainConfig, target: Target) -> None:
    """Nothing beyond the type (the dataclass's) and the allowed values (:attr:`Switch.choices`)."""


def _check_fsdp_offload(cfg: TrainConfig, target: Target) -> None:
    require(
        not (target.sharded and cfg.distributed.cpu_offload) or target.device == "cuda",
        "distributed.cpu_offload",
        "moves parameter shards, gradients and the optimizer step from GPU to host memory and needs CUDA; on "
        "CPU they already live in host memory. Turn it off",
    )


# ----------------------------------------------------------------------------------------------------------------
# The planner's parts of each entry
# ----------------------------------------------------------------------------------------------------------------

PLAN_CHECKPOINTING = (("none", None), ("selective", None), ("every_n", 2), ("full", None))
"""``activation_checkpointing`` modes the planner tries (with the interval of ``every_n``)."""
PLAN_CHUNKS = (0, 8)
"""``chunked_cross_entropy`` values the planner tries; ``auto`` in place of 8 where 8 chunks would hold more
logits each than ``auto``'s (long sequences, large vocabularies: :func:`_plan_chunks`)."""
PLAN_TILES = (0, "auto")
"""``tiled_mlp`` values the planner tries."""
AUTO_CHUNK_LOGITS = 2**25
"""The most logits of one chunk of ``chunked_cross_entropy: auto`` (:func:`memfit.memory.techniques.loss_chunks`)."""
AUTO_CHUNK_TOKENS = 2048
"""The most tokens of one chunk of ``chunked_cross_entropy: auto``, whatever the vocabulary (a small one would
otherwise make chunks of 16K tokens and more, whose logits grow with the sequence up to there)."""


def _plan_chunks(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    values = list(PLAN_CHUNKS)
    if space.tokens * space.vocab_size > 8 * AUTO_CHUNK_LOGITS:
        values = [0, "auto"]
    return _each("chunked_cross_entropy", (cfg.chunked_cross_entropy, *values))


def _each(key: str, values: Any) -> tuple[dict[str, Any], ...]:
    return tuple({key: v} for v in dict.fromkeys(values))


def _plan_method(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    lora_to_qlora = cfg.method == "lora" and space.qlora_possible
    return _each("method", (cfg.method, "qlora") if lora_to_qlora else (cfg.method,))


def _plan_optimizer(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    """``cfg``'s optimizer, then the registry's planned ones that keep its update rule, or those the user allows
    (``space.optimizers``, any update rule); paged ones only on CUDA, where paging differs; AdamW with ``cfg``'s
    implementation and ``fused``."""
    pairs = [(cfg.optimizer.name, cfg.optimizer.implementation)]
    rule = optimizers.spec(cfg.optimizer.name).update_rule
    for spec in optimizers.OPTIMIZERS:
        allowed = (
            spec.planned and spec.update_rule == rule
            if space.optimizers is None
            else spec.name in space.optimizers
        )
        if not allowed or (spec.paged and not space.cuda):
            continue  # on CPU paged state is ordinary memory: the same as the unpaged optimizer
        impls = (cfg.optimizer.implementation,) + (("fused",) if "fused" in spec.implementations else ())
        pairs += [(spec.name, impl) for impl in impls]
    return tuple(
        {"optimizer.name": name, "optimizer.implementation": impl} for name, impl in dict.fromkeys(pairs)
    )


def _plan_unclipped(key: str) -> Callable[[TrainConfig, PlanSpace], tuple[dict[str, Any], ...]]:
    """Off and on (with ``max_grad_norm=0``, which it needs, unless ``cfg`` has it on already)."""

    def plan(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
        own = value_of(cfg, key)
        # the planner never changes the batch of a step: in backward only when there is nothing to accumulate
        on = key != "optimizer_in_backward" or cfg.gradient_accumulation_steps == 1
        values = (own, False) + ((True,) if on else ())
        return tuple(
            {key: v, **({"max_grad_norm": 0.0} if v and not own else {})} for v in dict.fromkeys(values)
        )

    return plan


def _plan_checkpointing(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    own = (cfg.activation_checkpointing, cfg.activation_checkpointing_interval)
    modes = [own] + [(m, n or cfg.activation_checkpointing_interval) for m, n in PLAN_CHECKPOINTING]
    return tuple(
        {"activation_checkpointing": m, "activation_checkpointing_interval": n}
        for m, n in dict.fromkeys(modes)
    )


def _plan_bool(key: str, *, cuda_only: bool = False) -> Callable[[TrainConfig, PlanSpace], tuple[dict, ...]]:
    def plan(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
        if cuda_only and not space.cuda:
            return ({},)
        return _each(key, (value_of(cfg, key), False, True))

    return plan


def _plan_sharded(key: str, values: tuple[bool, ...], *, cuda_only: bool = False) -> Callable[..., tuple]:
    def plan(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
        if space.world_size == 1 or (cuda_only and not space.cuda):
            return ({},)  # not set: the config's own value stays
        return _each(key, (value_of(cfg, key), *values))

    return plan


def _plan_sequence_parallel(cfg: TrainConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    """The config's own, then every N > 1 dividing ``world_size`` and the model's heads (as Ulysses needs)."""
    key, own = "distributed.sequence_parallel", cfg.distributed.sequence_parallel
    if space.world_size == 1:
        return ({},)
    nh, nkv = space.num_heads, space.num_kv_heads
    sizes = [
        n
        for n in range(2, space.world_size + 1)
        if space.world_size % n == 0 and nh % n == 0 and (nkv % n == 0 or n % nkv == 0)
    ]
    return _each(key, (own, 1, *sizes))


def _prune_offloading(settings: dict[str, Any], cfg: TrainConfig) -> bool:
    """Offload activations with full checkpointing only, or as ``cfg`` has it: offloading every saved tensor moves
    ~34 x ``dim`` bytes per token and layer (Korthikanti et al. 2022), which the cost model makes 10-20x slower
    than recomputing them at Llama widths 4096-8192, for about the same device memory."""
    ac, off = settings["activation_checkpointing"], settings["activation_offloading"]
    own = (ac, off) == (cfg.activation_checkpointing, cfg.activation_offloading)
    return off and ac != "full" and not own


def _changed_checkpointing(cfg: TrainConfig, base: TrainConfig) -> bool:
    if cfg.activation_checkpointing == base.activation_checkpointing == "every_n":
        return cfg.activation_checkpointing_interval != base.activation_checkpointing_interval
    return cfg.activation_checkpointing != base.activation_checkpointing


def _changed_implementation(cfg: TrainConfig, base: TrainConfig) -> bool:
    if not optimizers.spec(cfg.optimizer.name).implementations:
        return False  # only AdamW has implementations
    return cfg.optimizer.implementation != base.optimizer.implementation


def _label_optimizer(name: str, cfg: TrainConfig) -> str:
    spec = optimizers.spec(name)
    return f"{name}:{cfg.optimizer.implementation}" if spec.implementations else name


def _label_checkpointing(mode: str, cfg: TrainConfig) -> str:
    if mode == "every_n":
        return f"ac=every_{cfg.activation_checkpointing_interval}"
    return "" if mode == "none" else f"ac={mode}"


def _flag(name: str, on: bool = True) -> Callable[[Any, TrainConfig], str]:
    """The label ``name`` when the value is ``on``."""
    return lambda value, cfg: name if bool(value) == on else ""


def _when(text: str, on: bool = True) -> Callable[[Any], str]:
    """The comment ``text`` when the value is ``on``."""
    return lambda value: text if bool(value) == on else ""


# ----------------------------------------------------------------------------------------------------------------
# Each entry's share of the cost model (StepTerms, in SWITCHES order)
# ----------------------------------------------------------------------------------------------------------------


def _cost_method(method: str, t: StepTerms) -> None:
    if method == "qlora":
        elements = dequantize_passes(t.cfg, t.mcfg.num_layers) * t.mcfg.num_layers * layer_weights(t.mcfg)
        t.dequantize_bytes = elements * t.constants["nf4_dequantize_bytes_per_element"][t.cfg.dtype]


def _cost_dtype(dtype: str, t: StepTerms) -> None:
    t.matmul_flops_per_second = t.constants["matmul_flops_per_second"][dtype]


def _cost_optimizer(name: str, t: StepTerms) -> None:
    t.update_factor = t.constants["optimizer_update_factor"].get(name, 1.0)
    t.moved_bytes += 2 * t.paged_out_bytes


def _cost_implementation(impl: str, t: StepTerms) -> None:
    if optimizers.spec(t.cfg.optimizer.name).implementations and impl == "for_loop":
        t.per_tensor = True


def _cost_in_backward(on: bool, t: StepTerms) -> None:
    if on:
        t.per_tensor = True


def _cost_optimizer_offload(on: bool, t: StepTerms) -> None:
    if on:
        t.host_update = True
        t.moved_bytes += 2 * t.states["trainable_parameters"]  # gradients out, updated parameters in


def _cost_checkpointing(mode: str, t: StepTerms) -> None:
    m = t.mcfg
    recomputed: float = len(checkpointed_layers(m.num_layers, mode, t.cfg.activation_checkpointing_interval))
    if mode == "selective":  # only elementwise ops are redone
        recomputed = t.constants["selective_recompute_layer_forwards"] * m.num_layers
    t.per_token += t.flops["layers"] * recomputed / m.num_layers


def _cost_chunks(chunks: int, t: StepTerms) -> None:
    if chunks:
        t.per_token += t.constants["chunked_ce_extra_head_forwards"] * t.flops["head"]


def _cost_tiled(tiles: int | str, t: StepTerms) -> None:
    """Each tile's forward again in the backward: one more MLP forward, but in a layer that full (or every_n)
    checkpointing recomputes, whose recomputation then skips the MLP (memfit.memory.tiled): no more there."""
    if tiles:
        m, cfg = t.mcfg, t.cfg
        recomputed = 0
        if cfg.activation_checkpointing != "selective":  # selective recomputes no matmul
            recomputed = len(
                checkpointed_layers(
                    m.num_layers, cfg.activation_checkpointing, cfg.activation_checkpointing_interval
                )
            )
        t.per_token += t.flops["mlp"] * (m.num_layers - recomputed) / m.num_layers


def _cost_activation_offloading(on: bool, t: StepTerms) -> None:
    # unconditional: the caller passes the offloaded bytes (0 unless the run offloads on CUDA); out in the forward
    # and back in the backward on a side stream, overlapping the layers' compute, but for the first layer's copy
    # back at the start of the backward, which nothing was prefetched ahead of
    t.overlapped_bytes += 2 * t.offloaded_activation_bytes
    t.moved_bytes += t.offloaded_activation_bytes // t.mcfg.num_layers


def _cost_compile(on: bool, t: StepTerms) -> None:
    if not on:
        return
    t.matmul_flops_per_second *= t.constants["compiled_compute_speedup"]
    cfg = t.cfg
    if optimizers.step_compiled(
        cfg.optimizer.name,
        cfg.optimizer.implementation,
        in_backward=cfg.optimizer_in_backward,
        sharded=t.world_size > 1,
    ):
        t.update_factor *= t.constants["compiled_update_factor"]
        t.per_tensor = False  # one generated kernel a tensor, no launches of ~10 eager ones


def _cost_reshard(on: bool, t: StepTerms) -> None:
    t.gathers = 2 if on else 1


def _cost_sequence_parallel(sp: int, t: StepTerms) -> None:
    """Each rank computes ``1 / sp`` of the step (its tokens' linear work, its heads' attention over whole
    sequences) and exchanges q, k, v and the attention output around every layer's attention: in the forward, in
    the backward, and again in a recomputed forward (:func:`all_to_all_elements`)."""
    if sp > 1:
        m, cfg = t.mcfg, t.cfg
        seq_len = t.tokens // (cfg.batch_size * cfg.gradient_accumulation_steps)  # the whole sequence, T
        t.tokens //= sp
        layers = m.num_layers
        recomputed = 0.0
        if cfg.activation_checkpointing != "selective":  # selective keeps the attention output
            recomputed = len(
                checkpointed_layers(
                    layers, cfg.activation_checkpointing, cfg.activation_checkpointing_interval
                )
            )
        passes = 2 * layers + recomputed
        per_layer = all_to_all_elements(cfg.batch_size, seq_len, m.num_heads, m.num_kv_heads, m.head_dim, sp)
        width = 4 if cfg.dtype == "fp32" else 2
        t.exchanged_bytes += int(passes * per_layer * width * cfg.gradient_accumulation_steps)


def _cost_fsdp_offload(on: bool, t: StepTerms) -> None:
    if on:
        t.host_update = True
        t.moved_bytes += (2 if t.cfg.distributed.reshard_after_forward else 1) * t.states["parameters"]
        t.moved_bytes += t.states["gradients"]


# ----------------------------------------------------------------------------------------------------------------
# The estimator's parts
# ----------------------------------------------------------------------------------------------------------------


def _moves_state(cfg: Any, target: str) -> dict[str, str]:
    return {"optimizer_state": "offloaded_optimizer_state"} if target == "cuda" else {}


def _host_copies(cfg: Any, target: str, closed: dict[str, int]) -> dict[str, int]:
    """torchao ``CPUOffloadOptimizer``: a pinned host copy of every trainable parameter and of its gradient."""
    if target != "cuda":
        return {}
    return {
        "host_parameter_copies": closed["trainable_parameters"],
        "host_gradient_copies": closed["gradients"],
    }


def _host_shards(cfg: Any, target: str, closed: dict[str, int]) -> dict[str, int]:
    """FSDP ``CPUOffloadPolicy``: the shards and their gradients stay on the host."""
    if target != "cuda":
        return {}
    return {
        "offloaded_parameter_shards": closed["parameters"],
        "offloaded_gradient_shards": closed["gradients"],
    }


# ----------------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------------

_EXACT = 1e-6
_COMPILED = Parity(
    {"compile": "true"},
    1e-5,
    why="TorchInductor's fused fp32 reductions add in another order than the eager kernels (~1e-7 relative per "
    "op; ten steps carry it to at most ~1e-6 of the loss)",
)

SWITCHES: tuple[Switch, ...] = (
    Switch(
        key="method",
        applied="build: memfit.build.build_model (memfit.models.peft.apply_lora / apply_qlora / apply_adapter)",
        check=_check_method,
        choices=METHODS,
        check_model=_check_method_model,
        activation=True,
        candidates=_plan_method,
        label=lambda v, cfg: "" if v == "full" else v,
        comment=lambda v: {
            "lora": "LoRA: only the low-rank adapters train; the base stays in the parameter dtype",
            "qlora": "LoRA over an NF4 base: ~0.52 B per frozen linear weight, dequantized in every forward/backward",
        }.get(v, ""),
        in_yaml=lambda cfg: cfg.method != "full",  # the default: a pretraining plan's config stays as it was
        cost=_cost_method,
        refusals=(
            Refusal(
                {"method": "qlora", "distributed.strategy": "fsdp1"}, "qlora does not work with", world_size=2
            ),
            Refusal(
                {
                    "method": "qlora",
                    "model_args.dim": 36,
                    "model_args.num_heads": 2,
                    "model_args.num_kv_heads": 1,
                },
                "qlora stores each decoder linear in NF4 blocks of 64 weights, but q_proj/o_proj have 36 x 36",
            ),
            Refusal(
                {
                    "method": "lora",
                    "lora.target_modules": "[q_proj,lm_head]",
                    "model_args.tie_word_embeddings": True,
                },
                "this model ties lm_head to the input embedding",
                key="lora.target_modules",
            ),
            Refusal(
                {"method": "adapter", "adapter.num_layers": 99},
                "99 exceeds the model's 6",
                key="adapter.num_layers",
            ),
        ),
        no_parity="fine-tuning methods train other weights than the baseline; tests/models/test_peft.py and "
        "test_qlora.py compare them with Hugging Face PEFT",
        doc="full, lora, qlora (LoRA over a 4-bit NormalFloat base) or adapter",
    ),
    Switch(
        key="dtype",
        applied="build: memfit.build.PARAM_DTYPES; step: memfit.step.autocast_context (bf16_mixed)",
        check=_check_nothing,
        choices=DTYPES,
        activation=True,
        candidates=lambda cfg, space: _each("dtype", space.dtypes),
        label=lambda v, cfg: v,
        comment=lambda v: {
            "bf16": "weights, gradients and optimizer state bf16 (loss in fp32)",
            "bf16_mixed": "fp32 weights, gradients and state; forward/backward under bf16 autocast",
            "fp32": "everything fp32",
        }[v],
        cost=_cost_dtype,
        parity=(
            Parity(
                {"dtype": "bf16"},
                0.03,
                relative=True,
                why="bf16 rounds weights, activations and updates to "
                "8 bits of mantissa (2**-8 relative), compounding over steps",
            ),
            Parity({"dtype": "bf16_mixed"}, 0.02, relative=True, why="bf16 matmuls under autocast"),
        ),
        doc="fp32, bf16 (weights, gradients, state in bf16) or bf16_mixed (fp32 states, bf16 autocast)",
    ),
    Switch(
        key="optimizer.name",
        applied="optimizer: memfit.memory.optim.build_optimizer (entries: memfit.memory.optimizers.OPTIMIZERS)",
        check=_check_optimizer_name,
        choices=optimizers.OPTIMIZER_NAMES,
        candidates=_plan_optimizer,
        label=_label_optimizer,
        comment=lambda v: optimizers.spec(v).comment if v in optimizers.OPTIMIZER_NAMES else "",
        cost=_cost_optimizer,
        refusals=(
            Refusal(
                {"optimizer.name": "paged_adamw8bit"},
                "'paged_adamw8bit' (bitsandbytes) does not",
                world_size=2,
            ),
            Refusal(
                {"optimizer.name": "torchao_adamw8bit", "dtype": "bf16"},
                "'torchao_adamw8bit' with",
                world_size=2,
            ),
            Refusal(
                {"optimizer.name": "torchao_adamw4bit", "distributed.strategy": "fsdp1"},
                "'torchao_adamw4bit' does not work with distributed.strategy=fsdp1",
                world_size=2,
            ),
            Refusal(
                {"optimizer.name": "muon", "distributed.strategy": "fsdp1"},
                "'muon' does not work with distributed.strategy=fsdp1",
                world_size=2,
            ),
            Refusal({"optimizer.name": "apollo_mini"}, "'apollo_mini' does not work sharded", world_size=2),
            Refusal({"optimizer.name": "adafactor"}, "'adafactor' does not work sharded", world_size=2),
        ),
        parity=(
            Parity(
                {"optimizer.name": "adamw8bit"},
                0.02,
                relative=True,
                why="8-bit block-wise state quantizes m and v: updates differ by a few percent",
            ),
        ),
        doc="the optimizer and the bytes of state it keeps (memfit.memory.optimizers)",
    ),
    Switch(
        key="optimizer.implementation",
        applied="optimizer: memfit.memory.optim.build_optimizer (torch.optim.AdamW foreach / for_loop / fused)",
        check=_check_implementation,
        choices=optimizers.OPTIMIZER_IMPLEMENTATIONS,
        candidates=lambda cfg, space: ({},),  # planned in pairs with optimizer.name (_plan_optimizer)
        changed=_changed_implementation,
        in_yaml=lambda cfg: bool(optimizers.spec(cfg.optimizer.name).implementations),
        comment=lambda v: {
            "fused": "one fused kernel: fewest temporaries, fastest",
            "foreach": "multi-tensor: one parameter-sized set of temporaries at the step",
            "for_loop": "one tensor at a time",
        }[v],
        cost=_cost_implementation,
        refusals=(
            Refusal(
                {"optimizer.name": "adafactor", "optimizer.implementation": "fused"},
                "'fused' is not one of adafactor's: foreach, for_loop",
            ),
        ),
        parity=(
            Parity({"optimizer.implementation": "for_loop"}, _EXACT),
            Parity({"optimizer.implementation": "fused"}, _EXACT),
        ),
        doc="AdamW's foreach (multi-tensor), for_loop (one tensor at a time) or fused kernel",
    ),
    Switch(
        key="optimizer_in_backward",
        applied="optimizer: memfit.memory.optim.OptimizerInBackward (per-parameter updates in backward hooks)",
        check=_check_in_backward,
        activation=True,
        candidates=_plan_unclipped("optimizer_in_backward"),
        label=_flag("in_bwd"),
        comment=_when("no gradient memory; needs gradient_accumulation_steps == 1"),
        cost=_cost_in_backward,
        refusals=(
            Refusal({"optimizer_in_backward": True}, "cannot clip by the global gradient norm"),
            Refusal(
                {"optimizer_in_backward": True, "max_grad_norm": 0, "gradient_accumulation_steps": 2},
                "needs gradient_accumulation_steps=1",
            ),
            Refusal(
                {"optimizer_in_backward": True, "max_grad_norm": 0, "distributed.strategy": "fsdp1"},
                "does not work with distributed.strategy=fsdp1: FSDP1 reduces",
                world_size=2,
            ),
        ),
        parity=(Parity({"optimizer_in_backward": "true"}, _EXACT),),
        doc="each parameter's update runs in backward as soon as its gradient is ready, then the gradient is freed",
    ),
    Switch(
        key="optimizer.cpu_offload",
        applied="optimizer: memfit.memory.optim.build_optimizer (torchao CPUOffloadOptimizer)",
        check=_check_optimizer_offload,
        trace_value=False,
        moves=_moves_state,
        host_bytes=_host_copies,
        candidates=_plan_unclipped("optimizer.cpu_offload"),
        label=_flag("opt_offload"),
        comment=_when("state and update on the host (torchao CPUOffloadOptimizer)"),
        cost=_cost_optimizer_offload,
        refusals=(  # the device and the optimizer: optimizers.check_optimizer_supported, via optimizer.name's check
            Refusal(
                {"optimizer.cpu_offload": True, "max_grad_norm": 0},
                "optimizer.cpu_offload moves optimizer state",
            ),
            Refusal(
                {
                    "optimizer.cpu_offload": True,
                    "max_grad_norm": 0,
                    "device": "cuda",
                    "optimizer.name": "paged_adamw",
                },
                "optimizer.cpu_offload cannot be combined with 'paged_adamw'",
            ),
            Refusal(
                {
                    "optimizer.cpu_offload": True,
                    "max_grad_norm": 0,
                    "device": "cuda",
                    "optimizer_in_backward": True,
                },
                "optimizer.cpu_offload cannot be combined with optimizer_in_backward",
            ),
            Refusal(
                {"optimizer.cpu_offload": True, "device": "cuda"},
                "optimizer.cpu_offload cannot clip gradients",
            ),
            Refusal(
                {"optimizer.cpu_offload": True, "max_grad_norm": 0, "device": "cuda"},
                "is not supported sharded",
                world_size=2,
            ),
        ),
        no_parity="CUDA only (torchao's CPUOffloadOptimizer); not run on CPU",
        doc="optimizer state and the update on the host (CUDA only)",
    ),
    Switch(
        key="activation_checkpointing",
        applied="build: memfit.memory.techniques.apply_activation_checkpointing",
        check=_check_nothing,
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
            Parity({"activation_checkpointing": "full"}, _EXACT),
            Parity({"activation_checkpointing": "selective"}, _EXACT),
        ),
        doc="recompute decoder layers' activations in backward: none, selective, every_n or full",
    ),
    Switch(
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
        parity=(
            Parity({"activation_checkpointing": "every_n", "activation_checkpointing_interval": 2}, _EXACT),
        ),
        not_planned="planned with activation_checkpointing (every_n with interval 2, and the config's own)",
        doc="n of activation_checkpointing: every_n (planned with it, labelled ac=every_n)",
    ),
    Switch(
        key="chunked_cross_entropy",
        applied="step: memfit.memory.techniques.chunked_cross_entropy (fused linear cross-entropy)",
        check=_check_chunks,
        check_model=_within_tokens("chunked_cross_entropy", "chunks", " (4-16 is typical), or auto"),
        activation=True,
        candidates=_plan_chunks,
        label=lambda v, cfg: f"ce={v}" if v else "",
        comment=_when("never materialise the whole (B, T, vocab) logits"),
        cost=_cost_chunks,
        refusals=(
            Refusal({"chunked_cross_entropy": -1}, "must be >= 0 chunks (0 is off) or auto, got -1"),
            Refusal({"chunked_cross_entropy": "many"}, "must be >= 0 chunks (0 is off) or auto, got 'many'"),
            Refusal(
                {"chunked_cross_entropy": 4, "distributed.strategy": "fsdp1"},
                "does not work with distributed.strategy=fsdp1: the loss",
                world_size=2,
            ),
            Refusal(
                {"chunked_cross_entropy": 100_000}, "100000 chunks exceed the 4096 tokens of a micro-batch"
            ),
        ),
        parity=(
            Parity({"chunked_cross_entropy": 4}, _EXACT),
            Parity({"chunked_cross_entropy": "auto"}, _EXACT),
        ),
        doc="the loss in chunks of tokens: the (B, T, vocab_size) logits never exist; auto bounds a chunk's logits",
    ),
    Switch(
        key="tiled_mlp",
        applied="build: memfit.memory.tiled.apply_tiled_mlp",
        check=_check_tiled,
        check_model=_within_tokens("tiled_mlp", "tiles", ", or auto (tiles of about dim tokens)"),
        activation=True,
        candidates=lambda cfg, space: _each("tiled_mlp", (cfg.tiled_mlp, *PLAN_TILES)),
        label=lambda v, cfg: "" if not v else ("tiled" if v == "auto" else f"tiled={v}"),
        comment=_when("the MLP in tiles of ~dim tokens, each recomputed in backward (free with ac=full)"),
        cost=_cost_tiled,
        refusals=(
            Refusal({"tiled_mlp": -2}, "must be >= 0 tiles (0 is off) or auto, got -2"),
            Refusal(
                {"tiled_mlp": 4, "distributed.strategy": "fsdp1"},
                "does not work with distributed.strategy=fsdp1: FSDP1 gives",
                world_size=2,
            ),
            Refusal({"tiled_mlp": 5000}, "5000 tiles exceed the 4096 tokens of a micro-batch"),
            Refusal(
                {
                    "tiled_mlp": 2,
                    "compile": True,
                    "method": "lora",
                    "lora.target_modules": "[q_proj,up_proj]",
                },
                "with compile cannot replay LoRA's dropout inside the MLP",
            ),
        ),
        parity=(
            Parity(
                {"tiled_mlp": 4},
                1e-5,
                why="the MLP's weight gradients add up over the tiles in another order (~1e-7 relative a step)",
            ),
            Parity({"tiled_mlp": "auto", "activation_checkpointing": "full"}, 1e-5, why="as tiled_mlp=4"),
        ),
        doc="the SwiGLU MLP tile by tile over the tokens, each tile recomputed in backward (auto: ~dim tokens a tile)",
    ),
    Switch(
        key="activation_offloading",
        applied="build: memfit.memory.offload.apply_activation_offloading (OffloadSavedTensors around each "
        "decoder layer: saved-tensor hooks to pinned host memory, a side stream, one ahead)",
        check=_check_nothing,
        offloads_activations=True,
        activation=True,
        candidates=_plan_bool("activation_offloading", cuda_only=True),
        prune=_prune_offloading,
        label=_flag("act_offload"),
        comment=_when("saved activations (with ac=full: the checkpoints) in pinned host memory, overlapped"),
        cost=_cost_activation_offloading,
        parity=(
            Parity(
                {"activation_offloading": True, "activation_checkpointing": "full"},
                _EXACT,
                why="on CPU nothing moves (the host is the device): the hooks run and hand each tensor back",
            ),
        ),
        doc="tensors saved for backward (with ac=full: the layers' inputs) in pinned host memory, back one ahead",
    ),
    Switch(
        key="compile",
        applied="build: memfit.build.build_training (torch.compile per decoder layer); step: the loss",
        check=_check_compile,
        trace_value=False,
        refusals=(  # and, on a CPU without a C++ compiler, "needs a C++ compiler on CPU"
            Refusal({"compile": True, "track_memory": True}, "cannot be combined with track_memory"),
            Refusal(
                {"compile": True, "activation_offloading": True, "device": "cuda"},
                "cannot be combined with activation_offloading",
            ),
            Refusal(
                {"compile": True, "distributed.strategy": "fsdp1"},
                "does not work with distributed.strategy=fsdp1, which flattens",
                world_size=2,
            ),
        ),
        parity=(_COMPILED,),
        cost=_cost_compile,
        not_planned="the estimate traces the eager step (an upper bound of the compiled one), and what compiling "
        "saves is measured on CPU only (memfit.planner.cost): a compiled config is priced, not proposed",
        doc="torch.compile each decoder layer and the loss (the estimator traces the eager step, an upper bound)",
    ),
    Switch(
        key="distributed.strategy",
        applied="shard: memfit.distributed.shard_model (FSDP2 fully_shard or FSDP1)",
        check=_check_nothing,
        choices=STRATEGIES,
        no_parity="sharded: tests/test_distributed.py compares 2 ranks with one process",
        not_planned="plans of sharded runs are estimated with FSDP2 (FSDP1 holds the same model states to within "
        "padding)",
        doc="fsdp2 or fsdp1",
    ),
    Switch(
        key="distributed.reshard_after_forward",
        applied="shard: memfit.distributed.shard_model",
        check=_check_nothing,
        activation=True,
        candidates=_plan_sharded("distributed.reshard_after_forward", (True, False)),
        sharded_only=True,
        label=_flag("no_reshard", on=False),
        comment=_when("keep gathered layers to backward: fewer all-gathers", on=False),
        cost=_cost_reshard,
        no_parity="sharded: tests/test_distributed.py compares 2 ranks with one process",
        doc="free each layer's gathered weights after its forward (ZeRO-3) or keep them to backward",
    ),
    Switch(
        key="distributed.cpu_offload",
        applied="shard: memfit.distributed.shard_model (FSDP2 CPUOffloadPolicy / FSDP1 CPUOffload)",
        check=_check_fsdp_offload,
        trace_value=False,
        moves=_moves_state,
        host_bytes=_host_shards,
        off_device=("parameters", "gradients"),
        activation=True,
        candidates=_plan_sharded("distributed.cpu_offload", (False, True), cuda_only=True),
        sharded_only=True,
        label=_flag("fsdp_offload"),
        comment=_when("shards, gradients and the step on the host"),
        cost=_cost_fsdp_offload,
        refusals=(Refusal({"distributed.cpu_offload": True}, "moves parameter shards", world_size=2),),
        no_parity="CUDA only; not run on CPU",
        doc="parameter shards, gradients and the optimizer step on the host (CUDA only)",
    ),
    Switch(
        key="distributed.prefetch",
        applied="shard: memfit.distributed.shard_model (explicit forward/backward prefetch)",
        check=_check_prefetch,
        refusals=(Refusal({"distributed.prefetch": -1}, "must be >= 0 (0: FSDP's defaults), got -1"),),
        no_parity="sharded: tests/test_distributed.py",
        not_planned="it trades overlap for a layer of gathered weights; the plan keeps the config's",
        doc="layers whose all-gather is issued ahead of use",
    ),
    Switch(
        key="distributed.limit_all_gathers",
        applied="shard: memfit.distributed.shard_model (FSDP1 limit_all_gathers)",
        check=_check_limit_all_gathers,
        refusals=(
            Refusal({"distributed.limit_all_gathers": False}, "applies to distributed.strategy=fsdp1 only"),
        ),
        no_parity="sharded, FSDP1 only: tests/test_distributed.py",
        not_planned="FSDP1 only, and plans are FSDP2's",
        doc="fsdp1 only: at most two layers' unsharded weights at once",
    ),
    Switch(
        key="distributed.sequence_parallel",
        applied="build: memfit.memory.ulysses.apply_sequence_parallel (Ulysses all-to-all around attention); data: "
        "memfit.memory.ulysses.shard_batch (each rank's slice of its group's sequences)",
        check=_check_sequence_parallel,
        check_model=_check_sequence_parallel_model,
        activation=True,
        candidates=_plan_sequence_parallel,
        sharded_only=True,
        label=lambda v, cfg: f"sp={v}" if v > 1 else "",
        comment=lambda v: (
            f"each sequence split over {v} ranks: an all-to-all around attention, 1/{v} of the activations"
            if v > 1
            else ""
        ),
        cost=_cost_sequence_parallel,
        refusals=(
            Refusal({"distributed.sequence_parallel": 0}, "must be >= 1 ranks, got 0"),
            Refusal({"distributed.sequence_parallel": 2}, "2 ranks per sequence need a multiple of 2 ranks"),
            Refusal(
                {"distributed.sequence_parallel": 2, "distributed.strategy": "fsdp1"},
                "needs distributed.strategy=fsdp2",
                world_size=2,
            ),
            Refusal(
                {"distributed.sequence_parallel": 2, "seq_len": 255},
                "seq_len 255 is not divisible by 2",
                world_size=2,
            ),
            Refusal(
                {"distributed.sequence_parallel": 3, "seq_len": 255},
                "the model's num_heads 8 is not divisible by 3",
                world_size=3,
            ),
        ),
        no_parity="sharded: tests/test_sequence_parallel.py compares 2 ranks (sp=2) with one process",
        doc="split each sequence over N ranks (DeepSpeed-Ulysses): an all-to-all exchanges tokens for heads around "
        "attention",
    ),
)
"""Every memory technique, in the order the planner combines them and a plan's label lists them."""

SWITCHES_BY_KEY: dict[str, Switch] = {s.key: s for s in SWITCHES}


# ----------------------------------------------------------------------------------------------------------------
# What the layers ask of the registry
# ----------------------------------------------------------------------------------------------------------------


def check_values(cfg: TrainConfig) -> None:
    """Every switch's value against its allowed values (:attr:`Switch.choices`), in :data:`SWITCHES` order; config
    validation runs this before the checks that read other keys.

    Raises:
        ConfigError: naming the first offending key and listing its values.
    """
    for switch in SWITCHES:
        if switch.choices:
            one_of(value_of(cfg, switch.key), switch.choices, switch.key)


def check(cfg: TrainConfig, target: Target) -> None:
    """Every switch's conflicts (:attr:`Switch.check`), in :data:`SWITCHES` order, once :func:`check_values`
    passed.

    Raises:
        ConfigError: naming the first offending key.
    """
    for switch in SWITCHES:
        switch.check(cfg, target)


def check_model(cfg: TrainConfig, mcfg: LlamaConfig) -> None:
    """The checks that need the architecture (:attr:`Switch.check_model`)."""
    for switch in SWITCHES:
        if switch.check_model is not None:
            switch.check_model(cfg, mcfg)


def trace_values() -> dict[str, Any]:
    """``{dotted key: value}`` the estimator's trace runs with instead of ``cfg``'s (:attr:`Switch.trace_value`)."""
    return {s.key: s.trace_value for s in SWITCHES if s.trace_value is not None}


def _is_on(cfg: TrainConfig, switch: Switch) -> bool:
    """The switch's value is truthy (set, on, > 0)."""
    return bool(value_of(cfg, switch.key))


def moved_categories(cfg: TrainConfig, target: str) -> dict[str, str]:
    """Traced categories that live outside the device allocator, by the name they are reported under."""
    moved: dict[str, str] = {}
    for s in SWITCHES:
        if s.moves is not None and _is_on(cfg, s):
            moved.update(s.moves(cfg, target))
    return moved


def host_copies(cfg: TrainConfig, target: str, closed: dict[str, int]) -> dict[str, int]:
    """Host bytes the trace does not see, by name (:attr:`Switch.host_bytes`)."""
    out: dict[str, int] = {}
    for s in SWITCHES:
        if s.host_bytes is not None and _is_on(cfg, s):
            out.update(s.host_bytes(cfg, target, closed))
    return out


def offloads_activations(cfg: TrainConfig, target: str) -> bool:
    """Tensors saved for backward leave the device (:attr:`Switch.offloads_activations`; only a CUDA target has a
    host apart from the device)."""
    return target == "cuda" and any(s.offloads_activations and _is_on(cfg, s) for s in SWITCHES)


def off_device_states(cfg: TrainConfig, target: str) -> tuple[str, ...]:
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


def values(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """``{key: value}`` of the planned switches of ``cfg``."""
    return {s.key: value_of(cfg, s.key) for s in planned(world_size)}


def changed_keys(cfg: TrainConfig, base: TrainConfig, world_size: int) -> tuple[str, ...]:
    """The planned switches whose value in ``cfg`` differs from ``base`` (:attr:`Switch.changed`)."""
    out = []
    for s in planned(world_size):
        if s.changed is not None:
            if s.changed(cfg, base):
                out.append(s.key)
        elif value_of(cfg, s.key) != value_of(base, s.key):
            out.append(s.key)
    return tuple(out)


def label(switch_values: dict[str, Any], cfg: TrainConfig) -> str:
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


def yaml_keys(cfg: TrainConfig) -> set[str]:
    """The switch keys the plan's YAML shows whatever their value."""
    out = set()
    for s in SWITCHES:
        if s.in_yaml is not None:
            if s.in_yaml(cfg):
                out.add(s.key)
        elif s.candidates is not None:
            out.add(s.key)
    return out


def activation_key(cfg: TrainConfig) -> tuple:
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


def plan_settings(cfg: TrainConfig, space: PlanSpace) -> list[dict[str, Any]]:
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
