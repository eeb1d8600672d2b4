"""Pick the fastest memory techniques that fit a memory budget: ``memfit plan``.

:func:`plan` enumerates combinations of the memory switches of a run (dtype policy, optimizer, optimizer in
backward, activation checkpointing, chunked cross-entropy, offloading, QLoRA in place of LoRA and, sharded, FSDP's
resharding and CPU offload), keeps those that config validation accepts, and ranks the ones that fit the budget by a
throughput cost model (:func:`memfit.planner.cost.step_cost`; its constants are ``COST_CONSTANTS`` there, documented
with their sources in docs/memory.md, "Planner"). :func:`cheapest_fix` answers the pre-flight question "what is the
smallest change of this config that fits?".

Every combination reported as fitting was estimated with :func:`memfit.planner.estimate.estimate_run` -- the run's
own training step on fake tensors -- exactly as it would run. An 8B estimate takes 15-45 s on two CPU cores, so
the search avoids estimating what cannot matter, with bounds that are proven, never guessed:

1. **Closed-form lower bound.** A step holds at least the parameters and the optimizer state that live on the
   device (closed form, :func:`~memfit.planner.closed_form.model_state_bytes_closed_form`), plus the larger of the
   gradients (at the optimizer step) and every layer's saved input ``B * T * dim`` (at the end of the forward;
   0 with activation offloading). A combination whose bound is over budget is never estimated.
2. **Bound from an estimated sibling.** Optimizer state does not change what the forward and backward allocate:
   when a combination's peak falls in the forward or backward, a sibling that differs only in the optimizer holds,
   at that same moment, the same bytes with the other optimizer's state in place of this one's. That is a lower
   bound on the sibling's peak.
3. **Branch and bound on speed.** The cost model is evaluated first with lower bounds of the bytes that only an
   estimate knows (offloaded activations, paged-out state), which gives an upper bound on each combination's
   throughput. Combinations are estimated fastest-first; the search stops once ``fits`` combinations fit and no
   combination left could be faster than the slowest of them.
4. **Least-memory probe.** After a few estimates without a fit, the combination with the smallest lower bound
   (every switch that saves memory on) is estimated; if even it does not fit, nothing is expected to and the
   search stops. This is the one rule that is not a proof (a combination with a larger bound could, in principle,
   peak lower); the report says so.

Rows that were not estimated carry their bounds: peak bytes ``>=``, throughput ``<=``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.build import build_model, run_model_config
from memfit.config import (
    TrainConfig,
    check_lengths,
    config_from_dict,
    config_to_dict,
    device_type,
    set_dotted,
)
from memfit.distributed import shard_numel, shard_ranks
from memfit.errors import ConfigError
from memfit.memory import optimizers, switches
from memfit.memory.host import fixes_mmap_threshold, mmap_threshold_bytes, tensor_share_bytes
from memfit.memory.switches import checkpointed_layers
from memfit.models import peft
from memfit.objectives import rows_per_micro_batch
from memfit.planner.closed_form import model_state_bytes_closed_form
from memfit.planner.cost import COST_CONSTANTS, CostRequest, param_bytes, step_cost
from memfit.planner.estimate import Estimate, estimate_run
from memfit.planner.layout import Layout
from memfit.units import GIB, format_bytes

# ----------------------------------------------------------------------------------------------------------------
# Candidates
# ----------------------------------------------------------------------------------------------------------------

DEFAULT_MARGIN = 0.1
"""Part of the budget kept free by default: the caching allocator's rounding and fragmentation, the CUDA context
and kernel workspaces, none of which the trace sees (docs/memory.md, "Planner")."""


@dataclass(frozen=True)
class PlanRequest:
    """What a search over the memory switches of one run is asked: :func:`plan`, :func:`cheapest_fix` and
    :func:`memfit.planner.context.longest_context` each take one.

    ``PlanRequest(cfg, 24 * GIB)`` plans ``cfg`` on one device of 24 GiB with the defaults below; a field a
    function does not use (``fits`` and ``optimizers`` for :func:`cheapest_fix`) is ignored by it.
    """

    cfg: TrainConfig
    """The run to plan (model, batch_size, seq_len, device -- ``cuda`` plans a GPU run on any machine -- and every
    other key are kept)."""
    budget_bytes: int
    """Memory of one device (see :func:`memfit.units.parse_bytes`)."""
    world_size: int = 1
    """Ranks of the (FSDP2) run; each gets ``batch_size`` sequences."""
    margin: float = DEFAULT_MARGIN
    """Part of the budget kept free for what the trace does not see (allocator fragmentation, CUDA context,
    kernel workspaces)."""
    dtypes: Iterable[str] | None = None
    """Dtype policies to consider; ``None``: ``cfg.dtype`` alone."""
    fits: int = 1
    """How many fitting combinations :func:`plan` establishes (more means more estimates)."""
    constants: dict[str, Any] | None = None
    """Cost-model constants; ``None``: ``COST_CONSTANTS[target device]``."""
    progress: Callable[[str], None] | None = None
    """Called with one line per estimate (wall time is minutes for 8B models)."""
    estimator: Callable[..., Estimate] | None = None
    """``estimate_run`` (tests may pass a stand-in)."""
    optimizers: Iterable[str] | None = None
    """``optimizer.name`` values to consider besides ``cfg``'s, other update rules included (see
    :func:`candidates`); ``None``: those that keep ``cfg``'s update rule."""
    optimizer_unset: bool = False
    """The user left ``optimizer.name`` out: the plan chooses it (``optimizers`` is then every entry) and says so."""
    host_overhead_bytes: int | None = None
    """What of ``budget_bytes`` the tensors cannot have; ``None``: on CPU, the process's own
    (:attr:`Plan.host_overhead_bytes`), 0 on CUDA. The pre-flight check passes 0: its budget is the available
    memory, which leaves out what the process holds."""
    layout: Layout | None = None
    """The mesh over nodes (``memfit plan nodes=N gpus_per_node=G``, :mod:`memfit.planner.mesh`): ``cfg``'s
    ``distributed.replicate`` and ``distributed.tensor_parallel`` are its, ``world_size`` its ranks, and its
    collectives are priced by where their groups lie (:func:`memfit.planner.cost.mesh_collectives`); ``None``: one
    flat group."""


@dataclass
class PlanRow:
    """One combination of switches and what the planner knows of it. Bytes; seconds."""

    config: TrainConfig
    """The whole run config with these switches (validated)."""
    switches: dict[str, Any]
    """Dotted switch key (:func:`memfit.memory.switches.switch_keys`) -> value."""
    changes: tuple[str, ...]
    """The switch keys whose value differs from the config planned from."""
    status: str = "not estimated"
    """``fits`` and ``over budget`` (estimated), ``over budget (bound)`` (a lower bound is over budget: not
    estimated), ``not estimated`` (could not be faster than the plans kept), ``error`` (the estimate failed)."""
    estimated: bool = False
    """True: ``peak_bytes``, ``device_total_bytes``, ``host_bytes`` come from ``estimate_run`` of exactly
    ``config``. False: they are lower bounds."""
    peak_bytes: int = 0
    """Allocator peak of one rank (estimated, or a lower bound)."""
    device_total_bytes: int = 0
    """What the driver sees: the allocator's bytes plus resident paged state (estimated, or a lower bound)."""
    host_bytes: int = 0
    """Host memory kept there by design (estimated, or a lower bound)."""
    cost: dict[str, float] = field(default_factory=dict)
    """Seconds of one step by component (:func:`memfit.planner.cost.step_cost`); a lower bound while not
    estimated."""
    relative_throughput: float = 0.0
    """Baseline step seconds / this row's (an upper bound while not estimated)."""
    tokens_per_second_per_gpu: float = 0.0
    """Tokens of one rank per predicted step second (the cost model's; an upper bound while not estimated)."""
    estimate: Estimate | None = None
    note: str = ""
    _bound_peak: int = 0
    _bound_total: int = 0

    @property
    def fits(self) -> bool:
        return self.status == "fits"

    def label(self) -> str:
        """Short names of the switches: ``bf16 paged_adamw8bit in_bwd ac=full ce=8``; a fine-tuning method first
        (``qlora bf16 adamw:fused ac=full``). Each entry of :data:`memfit.memory.switches.SWITCHES` gives its own."""
        return switches.label(self.switches, self.config)

    def to_json(self) -> dict[str, Any]:
        """GiB (1024**3 bytes) and seconds; ``estimated`` says whether the memory numbers are estimates or
        lower bounds."""
        return {
            "switches": self.label(),
            "config": dict(self.switches),
            "changes": list(self.changes),
            "status": self.status,
            "fits": self.fits,
            "estimated": self.estimated,
            "peak_memory_gib": self.peak_bytes / GIB,
            "device_total_gib": self.device_total_bytes / GIB,
            "host_gib": self.host_bytes / GIB,
            "relative_throughput": self.relative_throughput,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "step_seconds": self.cost.get("total", 0.0),
            "cost_seconds": dict(self.cost),
            "phase": self.estimate.phase if self.estimate else None,
            "estimate_seconds": self.estimate.seconds if self.estimate else None,
            "trace": self.estimate.trace if self.estimate else None,
            "note": self.note,
        }


@dataclass
class Plan:
    """The result of :func:`plan`: rows sorted (fitting first, fastest first), and what was searched."""

    rows: list[PlanRow]
    budget_bytes: int
    usable_bytes: int
    """The budget less the margin (and, on CPU, less :attr:`host_overhead_bytes`): a row fits when its allocator
    peak is at most this."""
    margin: float
    world_size: int
    seq_len: int
    target: str
    """``cuda`` or ``cpu``: the device the run's ``device`` resolves to."""
    host_overhead_bytes: int
    """CPU: what the training process holds besides its tensors at its peak RSS (its imports, the kernels' and
    threads' pages, the free memory glibc's heap keeps), taken from the budget, which on CPU is the process's peak
    RSS: the budget less the margin less the tensors' share (:func:`memfit.memory.host.tensor_share_bytes`; the
    free heap grows with the tensors, so this is what it holds when they peak at the share). 0 on CUDA."""
    baseline_seconds: float
    """Step seconds of the baseline (:func:`plan`) that ``relative_throughput`` divides."""
    seconds: float
    """Wall time of the search."""
    estimates: int
    """How many combinations were estimated."""
    probe: PlanRow | None = None
    """The least-memory combination, when it was estimated."""
    base: TrainConfig | None = None
    """The config planned from."""
    search: Any = field(default=None, repr=False)
    """The search's state (bounds, estimates by activation switches), for inspection."""
    chosen_among: tuple[str, ...] = ()
    """``optimizer.name`` values the plan chose from because the config left it out (empty: it kept the
    config's)."""

    @property
    def best(self) -> PlanRow | None:
        """The fastest combination that fits, or None."""
        return self.rows[0] if self.rows and self.rows[0].fits else None

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {
            "budget_gib": self.budget_bytes / GIB,
            "usable_gib": self.usable_bytes / GIB,
            "host_overhead_gib": self.host_overhead_bytes / GIB,
            "margin": self.margin,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "target": self.target,
            "baseline_step_seconds": self.baseline_seconds,
            "best": best.to_json() if best else None,
            "rows": [r.to_json() for r in self.rows],
            "estimates": self.estimates,
            "seconds": self.seconds,
            "constants": COST_CONSTANTS[self.target],
        }


def default_dtypes(cfg: TrainConfig) -> tuple[str, ...]:
    """The dtype policies ``memfit plan`` considers when the user sets none: ``bf16_mixed`` and ``bf16`` on
    CUDA (``fp32`` keeps the model states of ``bf16_mixed`` with fp32 activations, and is slower), and ``fp32``
    first on CPU (CPUs without bf16 matrix units emulate bf16 matmuls, ~25x slower)."""
    return ("bf16_mixed", "bf16") if device_type(cfg.device) == "cuda" else ("fp32", "bf16_mixed", "bf16")


def _switches_of(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    return switches.values(cfg, world_size)


def _changes(cfg: TrainConfig, base: TrainConfig, world_size: int) -> tuple[str, ...]:
    return switches.changed_keys(cfg, base, world_size)


def candidates(
    cfg: TrainConfig,
    world_size: int = 1,
    dtypes: Iterable[str] | None = None,
    optimizers: Iterable[str] | None = None,
    nodes: int = 1,
    fixed: dict[str, Any] | None = None,
) -> list[TrainConfig]:
    """Every combination of the plan's switches over ``cfg`` that config validation accepts.

    The values tried are each planned entry's :attr:`~memfit.memory.switches.Switch.candidates`
    (:func:`memfit.memory.switches.plan_settings`), ``cfg``'s own first. Today: ``dtype`` in ``dtypes`` (default:
    ``cfg.dtype`` alone); ``optimizer.name`` in ``optimizers`` and ``cfg``'s own, or by default the planned entries
    of :data:`memfit.memory.optimizers.OPTIMIZERS` that keep ``cfg``'s update rule (AdamW with ``cfg``'s
    implementation and ``fused``; paged optimizers only on CUDA, where they differ from the unpaged ones);
    ``optimizer_in_backward`` (with ``max_grad_norm=0``; only when ``gradient_accumulation_steps`` is 1: the
    planner never changes the batch of a step); ``optimizer.cpu_offload``
    (with ``max_grad_norm=0``); ``activation_checkpointing`` none, selective, every_n with interval 2, full (and
    ``cfg``'s own); ``chunked_cross_entropy`` 0 and 8, or ``auto`` in place of 8 where 8 chunks would hold more
    logits each than ``auto``'s (and ``cfg``'s own); ``tiled_mlp`` 0 and ``auto`` (and ``cfg``'s own);
    ``activation_offloading`` (CUDA) with full checkpointing (so that only the layer inputs cross PCIe: offloading
    every saved tensor moves ~34 x ``dim`` bytes per token and layer (Korthikanti et al. 2022), which the cost model
    makes 10-20x slower than recomputing them at Llama widths 4096-8192, for about the same device memory), or as
    ``cfg`` has it; sharded,
    ``distributed.reshard_after_forward`` and ``distributed.cpu_offload``; for a LoRA fine-tune (``method: lora``),
    ``method`` lora and qlora (the same LoRA over an NF4 base: less memory, a dequantization per weight in every
    forward and backward), when every decoder linear can be stored in NF4 (and, sharded, split evenly over the
    ranks). Combinations validation rejects (CUDA-only switches on CPU, offload with paging, ...) are left out.
    Configs are validated as predictions (``needs_weights=False``): a LoRA or QLoRA config planned from a preset
    needs no ``checkpoint_dir``.

    Args:
        cfg: the run config to plan from (its model, batch, sequence length, device and other keys stay).
        world_size: ranks of the sharded run (validation then applies the sharded rules).
        dtypes: dtype policies to consider.
        optimizers: ``optimizer.name`` values the plan may choose besides ``cfg``'s (``memfit plan --optimizers``),
            update rules other than ``cfg``'s included; default: those that keep ``cfg``'s update rule.
        nodes: nodes the ranks are spread over; above 1, hybrid sharding (``distributed.replicate``) with replicas
            across nodes is tried too.
        fixed: dotted keys held at these values (a layout's ``distributed.replicate`` and
            ``distributed.tensor_parallel``, :mod:`memfit.planner.mesh`): combinations with others are left out.

    Returns:
        Validated configs, ``cfg``'s own switches first when valid; no two with the same switches.
    """
    dtypes = tuple(dict.fromkeys(dtypes or (cfg.dtype,)))
    mcfg = run_model_config(cfg)
    space = switches.PlanSpace(
        cuda=device_type(cfg.device) == "cuda",
        world_size=world_size,
        dtypes=dtypes,
        qlora_possible=cfg.method == "lora" and _qlora_possible(cfg, world_size),
        tokens=cfg.batch_size * (cfg.seq_len or mcfg.max_seq_len),
        vocab_size=mcfg.vocab_size,
        num_heads=mcfg.num_heads,
        num_kv_heads=mcfg.num_kv_heads,
        optimizers=None if optimizers is None else tuple(optimizers),
        nodes=nodes,
    )
    base = config_to_dict(cfg)
    out: list[TrainConfig] = []
    for settings in switches.plan_settings(cfg, space):
        if any(settings.get(key, value) != value for key, value in (fixed or {}).items()):
            continue
        tree = copy.deepcopy(base)
        for dotted, value in settings.items():
            set_dotted(tree, dotted, value)
        try:
            out.append(config_from_dict(tree, world_size=world_size, needs_weights=False))
        except ConfigError:
            continue
    return out


def _qlora_possible(cfg: TrainConfig, world_size: int) -> bool:
    """Whether ``cfg`` could run as QLoRA: every decoder linear a multiple of the NF4 block (validation checks it
    for a preset, :func:`check_lengths` for a checkpoint's architecture) and, sharded, every NF4 weight split evenly
    over the ranks (:func:`memfit.models.peft.check_nf4_sharding`, which the build applies)."""
    qcfg = dataclasses.replace(cfg, method="qlora")
    try:
        mcfg = run_model_config(qcfg)
        check_lengths(qcfg, mcfg, 0)
        if world_size > 1:
            peft.check_nf4_sharding(build_model(qcfg, mcfg, torch.device("meta")), world_size)
    except (ConfigError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# Bounds
# ----------------------------------------------------------------------------------------------------------------


class _Context:
    """What every row of one search shares: architecture, closed forms (cached), budget, constants."""

    def __init__(
        self,
        cfg: TrainConfig,
        world_size: int,
        budget: int,
        margin: float,
        constants: dict[str, Any] | None,
        host_overhead: int | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.layout = layout
        self.mcfg = run_model_config(cfg)
        self.seq_len = cfg.seq_len or self.mcfg.max_seq_len
        self.target = device_type(cfg.device)
        self.constants = constants or COST_CONSTANTS[self.target]
        self.budget = budget
        self.margin = margin
        # on CPU the budget is the process's peak RSS: its tensors get what the process's own overhead leaves
        if host_overhead is None and self.target == "cpu":
            # a rank of a sharded run: its heaps keep holes of a part of the model and its gradients (memory/host.py)
            whole = model_state_bytes_closed_form(cfg, self.mcfg, 1) if world_size > 1 else None
            # the free heap grows with the step's tensors: the tensors get the largest peak whose RSS fits
            share = tensor_share_bytes(
                int(budget * (1 - margin)),
                gathered_parameter_bytes=whole["parameters"] if whole else 0,
                reduced_gradient_bytes=whole["trainable_parameters"] if whole else 0,
                fixed=fixes_mmap_threshold(
                    cfg.mmap_threshold, self.mcfg.dim, self.target, cfg.method, dtype=cfg.dtype
                ),
                threshold=mmap_threshold_bytes(cfg.method, cfg.dtype),
            )
            host_overhead = int(budget * (1 - margin)) - share
        elif host_overhead is None:
            host_overhead = 0
        self.host_overhead = host_overhead
        self.usable = max(0, int(budget * (1 - margin)) - self.host_overhead)
        self._closed: dict[tuple, dict[str, int]] = {}
        self._grad_sizes: dict[tuple, tuple[int, int]] = {}

    def closed(self, cfg: TrainConfig) -> dict[str, int]:
        key = (
            cfg.method,
            cfg.dtype,
            cfg.optimizer.name,
            cfg.optimizer_in_backward,
            cfg.distributed.replicate,
        )
        if key not in self._closed:
            self._closed[key] = model_state_bytes_closed_form(cfg, self.mcfg, self.world_size)
        return self._closed[key]

    def moved_state(self, cfg: TrainConfig) -> str | None:
        """Where the optimizer state lives when not in the allocator: ``paged``, ``host`` or None."""
        if self.target != "cuda":
            return None
        if optimizers.spec(cfg.optimizer.name).paged:
            return "paged"
        if "optimizer_state" in switches.moved_categories(cfg, self.target):
            return "host"
        return None

    def device_state(self, cfg: TrainConfig) -> int:
        return 0 if self.moved_state(cfg) else self.closed(cfg)["optimizer_state"]

    def lower_bounds(self, cfg: TrainConfig) -> tuple[int, int, int]:
        """``(allocator peak, device total, host)`` lower bounds, from closed forms.

        The device always holds its parameters and optimizer state (unless paged or offloaded), and at some
        moment of the step at least one of: every tensor the forward saved for backward (its end); those of the
        decoder layers and ``lm_head``'s weight gradient (the first gradient of the backward, computed while
        every layer's saved tensors are still alive); every gradient (the optimizer step); the largest single
        gradient (optimizer in backward, before its update frees it); the MLP's working set in any layer's
        forward (:meth:`mlp_working_set`). With activation offloading the decoder layers' saved tensors are on
        the host, the loss's still on the device.
        """
        closed = self.closed(cfg)
        off_device = switches.off_device_states(cfg, self.target)
        params = 0 if "parameters" in off_device else closed["parameters"]
        grads = 0 if "gradients" in off_device else closed["gradients"]
        layers, loss = self.saved_activations(cfg)
        # offloading moves the decoder layers' saved tensors to the host; the loss's stay on the device
        if self.offloads_activations(cfg):
            layers = 0
        head, largest = (0, 0) if "gradients" in off_device else self.gradient_sizes(cfg)
        peak = (
            params
            + self.device_state(cfg)
            + max(layers + loss, layers + head, grads, largest, self.mlp_working_set(cfg))
        )
        moved = self.moved_state(cfg)
        total = peak + (closed["optimizer_state"] if moved == "paged" else 0)
        host = closed["optimizer_state"] if moved == "host" else 0
        host += sum(switches.host_copies(cfg, self.target, closed).values())
        return peak, total, host

    def offloads_activations(self, cfg: TrainConfig) -> bool:
        return switches.offloads_activations(cfg, self.target)

    def saved_activations(self, cfg: TrainConfig) -> tuple[int, int]:
        """Lower bounds of the bytes the forward saves for backward: ``(decoder layers, loss)``.

        Each layer saves its input ``(B, T, dim)`` (its first RMSNorm does; a checkpointed layer keeps only that)
        at the residual stream's dtype (bf16 for ``bf16``, else fp32). A layer that is not checkpointed, with
        trainable weights (``method: full``), also saves the input of each projection for its weight's gradient:
        the normed input of q/k/v, the attention output, the normed input of gate/up (``dim`` each) and the input
        of down_proj (``intermediate_size``), at the matmul dtype (bf16 under ``bf16`` and ``bf16_mixed``); LoRA's and
        QLoRA's frozen projections need no input for a weight gradient (QLoRA saves exactly what LoRA does). The
        loss without chunking saves the fp32 log-probabilities ``(B * T, V)``; the chunked (fused) loss its gradient
        with respect to the hidden states ``(B * T, dim)`` (and the weight's, counted apart as ``lm_head``'s). A
        sequence-parallel rank holds ``T / sequence_parallel`` tokens of each row, and a tensor-parallel rank
        ``1 / tensor_parallel`` of them (the residual stream is sequence-parallel between the layers' matmuls).
        """
        m = self.mcfg
        # a micro-batch's, of this rank
        tokens = rows_per_micro_batch(cfg) * self.seq_len // self.ranks_per_batch(cfg)
        resid = param_bytes(cfg.dtype)
        matmul = 4 if cfg.dtype == "fp32" else 2
        checkpointed = len(
            checkpointed_layers(
                m.num_layers, cfg.activation_checkpointing, cfg.activation_checkpointing_interval
            )
        )
        inner = (3 * m.dim + m.intermediate_size) * matmul if cfg.method == "full" else 0
        layers = tokens * (m.num_layers * m.dim * resid + (m.num_layers - checkpointed) * inner)
        loss = tokens * (m.dim * resid if cfg.chunked_cross_entropy else m.vocab_size * 4)
        return layers, loss

    def mlp_working_set(self, cfg: TrainConfig) -> int:
        """A lower bound of the bytes an untiled MLP holds in a decoder layer's forward (and its recomputation):
        the activation and ``up_proj``'s output, two ``(B * T, intermediate_size)`` tensors at the matmul dtype,
        both alive at their product (``down_proj(act(gate) * up)``, every family's). 0 with ``tiled_mlp``: a
        tile's share."""
        if cfg.tiled_mlp:
            return 0
        tokens = rows_per_micro_batch(cfg) * self.seq_len // self.ranks_per_batch(cfg)
        return 2 * tokens * self.mcfg.intermediate_size * (4 if cfg.dtype == "fp32" else 2)

    def gradient_sizes(self, cfg: TrainConfig) -> tuple[int, int]:
        """Bytes of one rank's ``lm_head`` weight gradient (0 when it is frozen) and of its largest gradient, from the
        model of ``cfg``'s method (QLoRA's NF4 weights are frozen: they have none)."""
        key = (cfg.dtype, cfg.method, cfg.distributed.replicate)
        if key not in self._grad_sizes:
            model = build_model(cfg, self.mcfg, torch.device("meta"))
            size = param_bytes(cfg.dtype)

            def local(p: Any) -> int:
                # a replica's ranks split it (a tensor-parallel block, chunked by FSDP2: as many elements)
                return (
                    shard_numel(tuple(p.shape), shard_ranks(cfg.distributed.replicate, self.world_size))
                    * size
                )

            head = getattr(getattr(model, "lm_head", None), "weight", None)
            head_bytes = local(head) if isinstance(head, torch.nn.Parameter) and head.requires_grad else 0
            largest = max((local(p) for p in model.parameters() if p.requires_grad), default=0)
            self._grad_sizes[key] = (head_bytes, largest)
        return self._grad_sizes[key]

    def cost(self, cfg: TrainConfig, offloaded_activations: int, device_total: int) -> dict[str, float]:
        """Seconds of one rank's work on ``batch_size`` sequences a step, by component (:func:`step_cost`).

        With sequence parallelism (N > 1) a rank's step does ``1 / N`` of that work (its group shares the
        sequences), so the step's seconds are multiplied by N: rows with and without it then compare at equal
        tokens per GPU (N steps of a group, each with its all-gathers and all-to-alls, train the tokens one step
        trains without it). Tensor parallelism likewise: a group of T ranks shares a batch (x T).
        """
        paged_out = max(0, device_total - self.usable) if self.moved_state(cfg) == "paged" else 0
        sp = self.ranks_per_batch(cfg)
        cost = step_cost(
            CostRequest(
                cfg,
                self.mcfg,
                world_size=self.world_size,
                seq_len=self.seq_len,
                states=self.closed(cfg),
                offloaded_activation_bytes=offloaded_activations if self.target == "cuda" else 0,
                paged_out_bytes=paged_out,
                constants=self.constants,
                layout=self.layout,
            )
        )
        return {k: v * sp for k, v in cost.items()} if sp > 1 else cost

    def tokens(self, cfg: TrainConfig) -> int:
        """Tokens of one rank's ``batch_size`` sequences a step: the work :meth:`cost` prices."""
        return rows_per_micro_batch(cfg) * self.seq_len * cfg.gradient_accumulation_steps

    def ranks_per_batch(self, cfg: TrainConfig) -> int:
        """Ranks sharing one ``batch_size`` of sequences: sequence- x tensor-parallel (1 in one process)."""
        d = cfg.distributed
        return d.sequence_parallel * d.tensor_parallel if self.world_size > 1 else 1


# ----------------------------------------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------------------------------------

PROBE_AFTER = 3
"""Estimates without a fit after which the least-memory combination is estimated (see the module doc, 4)."""


class _Search:
    def __init__(
        self,
        ctx: _Context,
        rows: list[PlanRow],
        progress: Callable[[str], None] | None,
        estimator: Callable[..., Estimate] | None,
    ) -> None:
        self.ctx = ctx
        self.rows = rows
        self.progress = progress or (lambda _msg: None)
        self.estimator = estimator or estimate_run
        self.estimates = 0
        self.prefer_optimizer: str | None = None
        """``optimizer.name`` tried first among rows as fast (the config's, when the user left it unset)."""
        self.failed_since_fit = 0
        self.probe: PlanRow | None = None
        self.by_activation: dict[tuple, list[PlanRow]] = {}
        self.nothing_fits = False
        self.stopped = False
        """Set from outside to end :meth:`search` before its next estimate (a layout given up)."""

    def bound(self, row: PlanRow) -> None:
        """Fill a row's lower bounds and its optimistic cost."""
        ctx, cfg = self.ctx, row.config
        peak, total, host = ctx.lower_bounds(cfg)
        peak = max(peak, self.sibling_bound(row))
        paged = ctx.closed(cfg)["optimizer_state"] if ctx.moved_state(cfg) == "paged" else 0
        total = max(total, peak + paged)
        row._bound_peak, row._bound_total = peak, total
        row.peak_bytes, row.device_total_bytes, row.host_bytes = peak, total, host
        acts = sum(ctx.saved_activations(cfg)) if ctx.offloads_activations(cfg) else 0
        row.cost = ctx.cost(cfg, acts, total)

    def sibling_bound(self, row: PlanRow) -> int:
        """The bound from an estimated row with the same activation switches whose peak fell in forward or
        backward (module doc, 2)."""
        best = 0
        for other in self.by_activation.get(switches.activation_key(row.config), []):
            e = other.estimate
            if e is None or e.phase not in ("forward", "backward"):
                continue
            state_there = e.breakdown.get("optimizer_state", 0)
            best = max(best, e.peak_bytes - state_there + self.ctx.device_state(row.config))
        return best

    def run_estimate(self, row: PlanRow, why: str = "") -> None:
        ctx = self.ctx
        start = time.perf_counter()
        self.estimates += 1
        try:
            e = self.estimator(row.config, world_size=ctx.world_size, seq_len=ctx.seq_len)
        except Exception as exc:  # noqa: BLE001 -- one combination failing must not end the search
            row.status, row.estimated = "error", False
            row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            self.progress(f"  estimate {self.estimates}{why}: {row.label()}: {row.note}")
            return
        row.estimate, row.estimated = e, True
        row.peak_bytes, row.device_total_bytes, row.host_bytes = (
            e.peak_bytes,
            e.device_total_bytes,
            e.host_bytes,
        )
        acts = e.unseen.get("offloaded_activations", 0)
        row.cost = ctx.cost(row.config, acts, e.device_total_bytes)
        # on CPU the load or a save can be the run's peak (planner/phases.py): the row fits when all of them do
        need = max(e.peak_bytes, e.run_peak_bytes) if ctx.target == "cpu" else e.peak_bytes
        row.status = "fits" if need <= ctx.usable else "over budget"
        self.by_activation.setdefault(switches.activation_key(row.config), []).append(row)
        self.failed_since_fit = 0 if row.fits else self.failed_since_fit + 1
        self.progress(
            f"  estimate {self.estimates}{why}: {row.label()}: peak {format_bytes(e.peak_bytes)}, "
            f"{row.status} ({time.perf_counter() - start:.0f} s)"
        )

    def from_memory(self) -> None:
        """Fill in first the rows whose estimate the estimator holds already (``knows``: a ``seq_len=max`` rung's
        config at the plan's length), for nothing, so that their sibling bounds prune the search."""
        knows = getattr(self.estimator, "knows", None)
        if knows is None:
            return
        for row in self.rows:
            if not row.estimated and knows(
                row.config, world_size=self.ctx.world_size, seq_len=self.ctx.seq_len
            ):
                self.run_estimate(row, " (from memory)")

    def least_memory(self) -> PlanRow:
        """The row with the smallest lower bound (ties: the most switches changed, then the slowest: full
        checkpointing before every_n)."""
        return min(
            self.rows,
            key=lambda r: (r._bound_peak, r._bound_total, -len(r.changes), -r.cost["total"]),
        )

    def probe_if_due(self) -> bool:
        """Estimate the least-memory row after PROBE_AFTER failures; True when it does not fit either."""
        if self.probe is not None or self.failed_since_fit < PROBE_AFTER:
            return self.nothing_fits
        self.probe = self.least_memory()
        if not self.probe.estimated and self.probe.status != "error":
            self.run_estimate(self.probe, " (least-memory probe)")
        self.nothing_fits = self.probe.status == "over budget"  # an estimate that failed proves nothing
        return self.nothing_fits

    def search(self, group: list[PlanRow], want: int) -> list[PlanRow]:
        """Branch and bound over ``group``: estimate fastest-first until ``want`` rows fit and nothing left
        could be faster than the slowest of them."""
        usable = self.ctx.usable
        prefer = self.prefer_optimizer  # optimizer.name left unset: the config's default first at a tie
        pending = sorted(
            ((r.cost["total"], prefer is not None and r.config.optimizer.name != prefer, r._bound_peak, i), r)
            for i, r in enumerate(group)
        )
        found = [r for r in group if r.fits]
        for i, ((optimistic, *_), row) in enumerate(pending):
            if row.estimated or row.status == "error":
                continue
            found.sort(key=lambda r: r.cost["total"])
            if len(found) >= want and optimistic >= found[want - 1].cost["total"]:
                for _, rest in pending[i:]:
                    if not rest.estimated and rest.status != "over budget (bound)":
                        rest.status = "not estimated"
                        rest.note = f"cannot be faster than the {want} kept"
                break
            self.bound(row)  # estimates made since the first bound may give a sibling bound now
            if row._bound_peak > usable:
                row.status = "over budget (bound)"
                continue
            if self.stopped or self.probe_if_due():
                break
            self.run_estimate(row)
            if row.fits:
                found.append(row)
        return found


def _build(request: PlanRequest) -> tuple[_Search, float]:
    """The search's rows (every candidate, bounded) and the baseline's step seconds.

    Args:
        request: what is planned; its ``fits`` is the caller's.

    Returns:
        The search, its rows bounded and none estimated, and the baseline's predicted step seconds.

    Raises:
        ConfigError: a bad budget, margin, world size or strategy; no valid combination.
    """
    r = request
    cfg, budget_bytes, world_size, margin, dtypes = r.cfg, r.budget_bytes, r.world_size, r.margin, r.dtypes
    if budget_bytes <= 0:
        raise ConfigError(f"config key 'budget': must be > 0 bytes, got {budget_bytes}")
    if not 0 <= margin < 1:
        raise ConfigError(f"config key 'margin': must be in [0, 1) (a fraction of the budget), got {margin}")
    if world_size < 1:
        raise ConfigError(f"config key 'world_size': must be >= 1, got {world_size}")
    if world_size > 1 and cfg.distributed.strategy != "fsdp2":
        raise ConfigError(
            "config key 'distributed.strategy': plans of sharded runs are estimated with FSDP2; set "
            "distributed.strategy=fsdp2"
        )
    if r.layout is not None and (
        r.layout.world_size != world_size
        or (cfg.distributed.replicate, cfg.distributed.tensor_parallel)
        != (r.layout.replicate, r.layout.tensor_parallel)
    ):
        raise ValueError(f"PlanRequest: the config and world_size {world_size} are not those of {r.layout}")
    ctx = _Context(cfg, world_size, budget_bytes, margin, r.constants, r.host_overhead_bytes, r.layout)
    fixed = r.layout.overrides() if r.layout is not None else None  # a layout's mesh is the layout's
    configs = candidates(cfg, world_size, dtypes, r.optimizers, fixed=fixed)
    if not configs:
        raise ConfigError(
            "config key 'dtype': no combination of switches over this config passes validation; check it with "
            "memfit estimate first"
        )
    rows = [PlanRow(c, _switches_of(c, world_size), _changes(c, cfg, world_size)) for c in configs]
    search = _Search(ctx, rows, r.progress, r.estimator)
    search.prefer_optimizer = cfg.optimizer.name if r.optimizer_unset else None
    for row in rows:
        search.bound(row)
    # the baseline: the first dtype considered, each switch at its entry's fastest (fused AdamW, nothing that costs
    # time: memfit.memory.switches.Switch.baseline)
    dtype = next(iter(dtypes or (cfg.dtype,)))
    base = switches.with_values(cfg, {"dtype": dtype, **switches.baseline_values()})
    baseline = ctx.cost(base, 0, 0)["total"]
    return search, baseline


def _finish(search: _Search, baseline: float, start: float) -> Plan:
    ctx = search.ctx
    for row in search.rows:
        row.relative_throughput = baseline / row.cost["total"]
        row.tokens_per_second_per_gpu = ctx.tokens(row.config) / row.cost["total"]
        if row.status == "over budget (bound)" and not row.note:
            row.note = "its lower bound is over budget"
        if row.status == "not estimated" and not row.note:
            row.note = "the search stopped: the least-memory combination does not fit"
    order = {"fits": 0, "over budget": 1, "error": 3}
    rows = sorted(
        search.rows,
        key=lambda r: (order.get(r.status, 2), -r.relative_throughput, r.peak_bytes, len(r.changes)),
    )
    return Plan(
        rows=rows,
        budget_bytes=ctx.budget,
        usable_bytes=ctx.usable,
        host_overhead_bytes=ctx.host_overhead,
        margin=ctx.margin,
        world_size=ctx.world_size,
        seq_len=ctx.seq_len,
        target=ctx.target,
        baseline_seconds=baseline,
        seconds=time.perf_counter() - start,
        estimates=search.estimates,
        probe=search.probe,
        base=ctx.cfg,
        search=search,
    )


def plan(request: PlanRequest) -> Plan:
    """The fastest combinations of memory switches over ``request.cfg`` whose peak fits ``request.budget_bytes`` on
    one rank.

    A combination fits when its estimated allocator peak (``estimate_run`` of exactly that config) is at most
    ``budget_bytes * (1 - margin)``; paged optimizer state beyond that pays its PCIe traffic in the cost model
    instead. Rows are ranked by :func:`step_cost`; ``relative_throughput`` is against a baseline of the fastest
    dtype considered and each switch at its entry's fastest value (:attr:`memfit.memory.switches.Switch.baseline`:
    fused AdamW, no switch that costs time), which need not fit.

    Args:
        request: the run, its budget and the search's settings (:class:`PlanRequest`).

    Returns:
        The :class:`Plan`; ``plan(...).best`` is the fastest fitting row, None when nothing fits.

    Raises:
        ConfigError: a bad budget, margin, world size or strategy; no valid combination.
    """
    start = time.perf_counter()
    search, baseline = _build(request)
    return searched(search, baseline, request, start)


def searched(search: _Search, baseline: float, request: PlanRequest, start: float) -> Plan:
    """Run a built search (:func:`_build`; :mod:`memfit.planner.mesh` builds one per layout) to its
    :class:`Plan`: :func:`plan` after the build."""
    search.from_memory()
    search.search(search.rows, max(1, request.fits))
    if not any(r.fits for r in search.rows) and search.probe is None:
        search.failed_since_fit = PROBE_AFTER
        search.probe_if_due()  # estimated for the report: the smallest peak there is
    result = _finish(search, baseline, start)
    if request.optimizer_unset:
        result.chosen_among = tuple(request.optimizers or ())
        # at the same speed, the optimizer the config would have used: another update rule only where it is
        # faster or where the default does not fit
        order = {"fits": 0, "over budget": 1, "error": 3}
        result.rows.sort(
            key=lambda r: (
                order.get(r.status, 2),
                -round(r.relative_throughput, 6),
                r.config.optimizer.name != request.cfg.optimizer.name,
                r.peak_bytes,
                len(r.changes),
            )
        )
    return result


def cheapest_fix(request: PlanRequest) -> PlanRow | None:
    """The combination that fits with the **fewest switches changed** from ``request.cfg``, the fastest of those.

    Combinations are searched by the number of planned switches (:func:`memfit.memory.switches.switch_keys`) they
    change (0: ``cfg`` itself, then one switch, then two, ...), each group fastest-first (branch and bound, as
    :func:`plan`); the first group with a fit gives the answer. ``changes`` of the row names the keys to set and
    ``config`` is the whole fixed config. Without a fit after a few estimates, the least-memory combination is
    estimated; when even it does not fit, the answer is None.

    Args:
        request: the run, its budget and the search's settings (:class:`PlanRequest`; its ``fits`` is not used:
            each group's fastest fit is the one wanted).

    Returns:
        The row (``changes == ()`` when ``cfg`` fits as it is; its peak is estimated), or None when nothing fits.

    Raises:
        ConfigError: as :func:`plan`.
    """
    start = time.perf_counter()
    search, baseline = _build(request)
    levels = sorted({len(r.changes) for r in search.rows})
    for level in levels:
        group = [r for r in search.rows if len(r.changes) == level]
        found = search.search(group, 1)
        if found:
            _finish(search, baseline, start)
            return min(found, key=lambda r: r.cost["total"])
        if search.nothing_fits:
            return None
    return None
