"""Predict a run's peak memory before anything is allocated, by running its own training step on fake tensors.

:func:`estimate_run` builds the run's model through the run's own build sequence
(:func:`memfit.build.build_training`) on the meta device, makes every parameter a fake tensor
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and devices, no storage), applies the method,
activation checkpointing and (for ``world_size`` > 1) FSDP sharding over a fake process group in which this
process plays rank 0, builds the run's optimizer, and runs :func:`memfit.step.train_step` -- the very function the
training loop calls -- under a :class:`~memfit.memory.tracker.MemoryTracker`, as the second step of the run: the
first only creates the optimizer state (an optimizer step on zero gradients at lr 0, as torch's distributed
checkpointing lays the state out; a whole first train step would double the time and allocate the same state).
What the tracker sees is what a real step allocates: the peak of live bytes, its breakdown by category and the
phase it falls in.

What the caching allocator cannot see is moved out of the device peak and reported apart, from the same trace:

- paged optimizers (``paged_adamw8bit``, ``paged_adamw``): the moments of tensors of >= 100,000 elements live in
  CUDA unified memory (bitsandbytes' ``get_state_buffer``; smaller tensors' state, the absmax and the code tables
  stay in device memory). The driver counts them on the device while resident (``device_total``), the allocator
  does not (``peak``).
- ``optimizer.cpu_offload`` (torchao ``CPUOffloadOptimizer``): optimizer state, a host copy of each parameter and
  of each gradient live in pinned host memory (``host``).
- ``distributed.cpu_offload`` (FSDP ``CPUOffloadPolicy``): parameter shards, gradient shards and optimizer state
  live on the host; the device keeps the gathered layers in flight and the activations.
- ``activation_offloading``: tensors saved for backward live in pinned host memory. The trace runs the offloading
  hooks themselves, which move them (on a CUDA target) to the ``meta`` device the tracker does not count and bring
  them back one ahead in the backward, so the device's timeline is traced; their host bytes are the hooks' peak.

The trace runs on CPU fake tensors whatever ``device`` says (a CPU build of torch cannot make CUDA tensors, fake or
not); sizes are the same, but kernels may differ in their workspaces, which no tracker sees (see docs/memory.md).

For a CPU run the trace also predicts the process's peak resident set (``host_peak_rss_bytes``, what
``/usr/bin/time -v`` and ``peak_memory_rss`` report): the estimating process's own resident set when the trace
begins (interpreter, torch, memfit and the optimizer's library imported, no tensor allocated), plus the traced
peak, plus measured constants for what a stepping process holds besides and for the free memory glibc's heaps keep
(for a rank of a sharded run also a part of the whole model's parameter and gradient bytes,
:func:`memfit.memory.host.retained_heap_bytes`; :func:`memfit.memory.host.predict_peak_rss`; docs/memory.md,
"Host memory (RSS) on CPU").

A sharded CPU run communicates through gloo, whose reduce-scatter clones its input
(:class:`~memfit.planner.fake_trace.GlooBuffers`); the fake process group's collectives allocate nothing, so the
trace makes that clone itself. The trace's environment (fake tensors and process group, scalar reads, the
optimizer libraries' tables) is :mod:`memfit.planner.fake_trace`.

A closed-form bytes model (:func:`memfit.planner.closed_form.model_state_bytes_closed_form`) gives parameters,
gradients and optimizer state from the shapes and dtypes alone, beside the traced numbers; the two agree exactly
on model states.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.build import build_training, run_model_config
from memfit.checkpoint import init_optimizer_state
from memfit.config import TrainConfig, check_lengths, device_type
from memfit.distributed import shard_ranks
from memfit.distributed import unwrap as dist_unwrap
from memfit.errors import ConfigError
from memfit.memory import optimizers, switches
from memfit.memory.allocator import CUDA_CONTEXT_BYTES_ESTIMATE, replay, workspace_events
from memfit.memory.host import (
    fixes_mmap_threshold,
    mmap_threshold_bytes,
    predict_peak_rss,
    process_rss_bytes,
    retained_heap_bytes,
)
from memfit.memory.offload import OffloadStats
from memfit.memory.optim import optimizers_in
from memfit.memory.optimizers import BNB_PAGED_MIN_NUMEL
from memfit.memory.tracker import CATEGORIES, MemoryTracker, model_state_bytes
from memfit.memory.ulysses import shard_batch
from memfit.models import moe
from memfit.models.config import DecoderConfig
from memfit.objectives import PREFERENCE_OBJECTIVES
from memfit.planner.closed_form import model_state_bytes_closed_form
from memfit.planner.compose import COMPOSE_FROM_LAYERS, TRACED_LAYERS, LayerTrace, NotComposable, marking
from memfit.planner.compose import compose as compose_layers
from memfit.planner.compose_allocations import compose_allocations
from memfit.planner.cuda_paths import cuda_paths
from memfit.planner.fake_trace import GlooBuffers, ScalarReads, fake_ids, fake_mode, fake_process_group, quiet
from memfit.planner.phases import load_peak_bytes
from memfit.step import sequence_logps, train_step, train_step_options
from memfit.units import GIB
from memfit.validation import reference_mode


@dataclass
class Estimate:
    """A run's predicted memory, for one rank. Bytes throughout (``to_json`` gives GiB, 1024**3 bytes)."""

    peak_bytes: int
    """The highest live bytes the caching allocator would hold (tensor storages; its rounding and cache excluded)."""
    breakdown: dict[str, int]
    """Bytes by category (see :data:`memfit.memory.tracker.CATEGORIES`) at that peak."""
    phase: str
    """The phase of the step the peak falls in (``forward``, ``backward``, ``optimizer_step``, ``other``)."""
    device_total_bytes: int
    """What the driver would show at the peak: on CUDA, the allocator's reserved bytes (:attr:`peak_reserved_bytes`,
    or the live peak where that is not predicted) plus the CUDA context
    (:data:`memfit.memory.allocator.CUDA_CONTEXT_BYTES_ESTIMATE`) plus resident paged (unified) memory; on CPU the
    peak plus paged memory."""
    host_bytes: int
    """Pinned / host memory the run keeps there by design (offloaded state, parameters, activations)."""
    unseen: dict[str, int]
    """The allocator-invisible parts by name (``paged_optimizer_state``, ``offloaded_optimizer_state``, ...)."""
    model_states: dict[str, int]
    """Closed-form bytes of ``parameters``, ``gradients`` and ``optimizer_state`` of this rank."""
    traced_model_states: dict[str, int]
    """The same three, as traced (``gradients``: those live when the optimizer phase of the step starts)."""
    num_params: int
    num_trainable_params: int
    world_size: int
    batch_size: int
    seq_len: int
    seconds: float
    """Wall time of the estimate."""
    config: dict[str, Any] = field(default_factory=dict)
    """The switches that decide memory, for reports."""
    host_peak_rss_bytes: int | None = None
    """CPU runs (``device`` not ``cuda``): the predicted peak resident set of the training process, the highest of
    :attr:`phase_rss_bytes` (:func:`memfit.memory.host.predict_peak_rss` of each phase's tensors over
    ``process_baseline_bytes``; what ``/usr/bin/time -v`` and ``peak_memory_rss`` report; docs/memory.md, "Host
    memory (RSS) on CPU").
    ``None`` for CUDA runs or where the resident set cannot be read."""
    phase_rss_bytes: dict[str, int] | None = None
    """CPU runs: the predicted peak resident set of each of :attr:`phase_peaks`: the phase's tensors plus the baseline
    and :data:`memfit.memory.host.RUNTIME_BYTES`, and for ``step`` the free heap its steps keep
    (:func:`memfit.memory.host.retained_heap_bytes`; the load comes before it, a save gives it back first).
    :attr:`host_peak_rss_bytes` is the highest. ``None`` where that is."""
    process_baseline_bytes: int | None = None
    """The resident set of the estimating process when the trace began, the optimizer's library imported and no
    tensor allocated: the stand-in for the training process's own (interpreter, torch, memfit, libraries)."""
    peak_reserved_bytes: int | None = None
    """CUDA runs: what ``torch.cuda.max_memory_reserved()`` would report, the traced allocations and frees (with
    the cuBLAS workspace, :data:`CUBLAS_SM`) replayed through a model of PyTorch's caching allocator
    (:func:`memfit.memory.allocator.replay`). ``None`` on CPU, and where part of the step's memory moves to the
    host (``optimizer.cpu_offload``, ``distributed.cpu_offload``), which the replay
    does not model."""
    load_peak_bytes: int | None = None
    """CPU runs of one process from ``checkpoint_dir``: the peak live tensor bytes while the pretrained weights load
    (:func:`memfit.planner.phases.load_peak_bytes`); ``None`` where not predicted (no checkpoint to load, a format
    read otherwise, CUDA, sharded)."""
    save_peak_bytes: int | None = None
    """CPU runs of one process: the peak live tensor bytes while a checkpoint is written, the live bytes at the end
    of the traced step (:mod:`memfit.planner.phases`); ``None`` where not predicted."""
    reference_peak_bytes: int | None = None
    """A preference run with a stored reference (``preference.reference: precomputed``): the peak live tensor
    bytes of the pass that computes it before training (:mod:`memfit.reference`), traced; ``None`` otherwise."""
    fixes_mmap_threshold: bool = False
    """CPU runs: the run fixes glibc's mmap threshold when it starts (:func:`memfit.memory.host.fixes_mmap_threshold`),
    so the predicted resident set holds no free heap."""
    routing: dict[str, Any] | None = None
    """A mixture of experts (None for a dense model): the routing this estimate assumed (``assumption``:
    ``balanced`` with ``moe_skew``, or ``collapsed``, the bound) and the other's figures (``other``:
    ``assumption``, ``peak_bytes``, ``run_peak_bytes``, ``host_peak_rss_bytes``)."""
    trace: dict[str, Any] = field(default_factory=dict)
    """How the figure was obtained: ``layers``, ``layers_traced`` (the depths traced: the run's, or 3 and 4 to
    compose it), ``composed``, ``trace_seconds`` (each trace's seconds, in that order), ``events_traced`` and
    ``events_composed`` (the tracker's timeline events of the traces and of the composed L-layer step) where it
    composed, and ``why_not_composed`` where the whole model was traced."""

    @property
    def phase_peaks(self) -> dict[str, int]:
        """Live tensor bytes at the peak of each predicted phase of the run: ``load``, ``reference`` (a stored
        reference's pass) and ``save`` where predicted, ``step`` (the traced peak plus host bytes) always."""
        phases = {
            "load": self.load_peak_bytes,
            "reference": self.reference_peak_bytes,
            "step": self.peak_bytes + self.host_bytes,
            "save": self.save_peak_bytes,
        }
        return {k: v for k, v in phases.items() if v is not None}

    @property
    def run_peak_bytes(self) -> int:
        """The highest of :attr:`phase_peaks`: what a CPU process's tensors need at once over the whole run."""
        return max(self.phase_peaks.values())

    def to_json(self) -> dict[str, Any]:
        """The contract of ``memfit estimate --json``: ``peak_memory_gib``, ``breakdown`` (category -> GiB),
        ``phase``, ``device_total_gib``, ``host_gib``, and more detail."""
        return {
            "peak_memory_gib": self.peak_bytes / GIB,
            "breakdown": {k: v / GIB for k, v in self.breakdown.items()},
            "phase": self.phase,
            "device_total_gib": self.device_total_bytes / GIB,
            "host_gib": self.host_bytes / GIB,
            "unseen_gib": {k: v / GIB for k, v in self.unseen.items()},
            "model_states_gib": {k: v / GIB for k, v in self.model_states.items()},
            "traced_model_states_gib": {k: v / GIB for k, v in self.traced_model_states.items()},
            "num_params": self.num_params,
            "num_trainable_params": self.num_trainable_params,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "seconds": self.seconds,
            "config": self.config,
            "host_peak_rss_gib": None if self.host_peak_rss_bytes is None else self.host_peak_rss_bytes / GIB,
            "phase_rss_gib": (
                None
                if self.phase_rss_bytes is None
                else {k: v / GIB for k, v in self.phase_rss_bytes.items()}
            ),
            "process_baseline_gib": (
                None if self.process_baseline_bytes is None else self.process_baseline_bytes / GIB
            ),
            "peak_memory_reserved_gib": (
                None if self.peak_reserved_bytes is None else self.peak_reserved_bytes / GIB
            ),
            "phase_peaks_gib": {k: v / GIB for k, v in self.phase_peaks.items()},
            "fixes_mmap_threshold": self.fixes_mmap_threshold,
            "routing": _routing_json(self.routing),
            "trace": self.trace,
        }


def _routing_json(routing: dict[str, Any] | None) -> dict[str, Any] | None:
    """:attr:`Estimate.routing` with its byte counts in GiB (``..._gib``)."""
    if routing is None:
        return None
    other = {k.replace("_bytes", "_gib"): (v / GIB if k.endswith("_bytes") and v is not None else v)
             for k, v in routing["other"].items()}  # fmt: skip
    return {**routing, "other": other}


# ----------------------------------------------------------------------------------------------------------------
# The trace
# ----------------------------------------------------------------------------------------------------------------


def estimate_run(
    cfg: TrainConfig,
    *,
    world_size: int = 1,
    seq_len: int | None = None,
    model_config: DecoderConfig | None = None,
    compose: bool | None = None,
    routing: moe.Routing | None = None,
) -> Estimate:
    """Predict the peak memory of one rank of the run ``cfg`` describes, without allocating it.

    Args:
        cfg: a validated run config (``memfit.config.load_config``); its ``device`` says what the run targets
            (paging, offloading and CUDA-only switches count as on CUDA when it is ``cuda``).
        world_size: ranks of a sharded run (this process plays rank 0 of a fake process group); 1 for one device.
        seq_len: the sequence length to trace (the longest the data can produce); default ``cfg.seq_len`` or the
            model's ``max_seq_len``.
        model_config: the architecture; default from ``cfg.checkpoint_dir``'s config (headers only) or the preset
            with ``model_args`` (``vocab_size`` from ``tokenizer.vocab_size`` when the preset has none).
        compose: ``None`` (default): a model of at least :data:`memfit.planner.compose.COMPOSE_FROM_LAYERS`
            decoder layers is composed from traces of 3 and 4 layers (:mod:`memfit.planner.compose`) where
            composing holds, else traced whole; ``True``: compose any model of at least 5 layers where it holds;
            ``False``: trace the whole model. :attr:`Estimate.trace` says which was done and why.
        routing: a mixture of experts' routing assumption (:class:`memfit.models.moe.Routing`); default from
            ``estimate.moe_skew`` and ``estimate.moe_bound``. The other figure (the bound, or the balanced one) is
            estimated too, into :attr:`Estimate.routing`.

    Returns:
        The :class:`Estimate`.

    Raises:
        ValueError: ``world_size`` < 1.
        memfit.errors.ConfigError, memfit.errors.CheckpointError: as the run itself would raise them.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    start = time.perf_counter()
    mcfg = model_config or run_model_config(cfg)
    seq_len = seq_len or cfg.seq_len or mcfg.max_seq_len
    check_lengths(dataclasses.replace(cfg, seq_len=seq_len), mcfg, 0)
    target = "cuda" if cfg.device == "cuda" else "cpu"
    if world_size > 1 and cfg.distributed.strategy != "fsdp2":
        raise ConfigError(
            "config key 'distributed.strategy': estimates of sharded runs trace FSDP2; FSDP1 shards a whole unit "
            "into one flat buffer, so its model states are those of FSDP2 to within padding. Estimate with "
            "distributed.strategy=fsdp2"
        )
    other = None
    if (
        mcfg.num_experts is not None and routing is None
    ):  # the stated assumption, and the other figure beside it
        balanced = moe.Routing("balanced", cfg.estimate.moe_skew)
        routing, alternative = (
            (moe.Routing("collapsed"), balanced) if cfg.estimate.moe_bound else (balanced, None)
        )
        alternative = alternative or moe.Routing("collapsed")
        kwargs = {"world_size": world_size, "seq_len": seq_len, "model_config": mcfg, "compose": compose}
        other = estimate_run(cfg, routing=alternative, **kwargs)
    with moe.routing_assumption(routing or moe.Routing()):
        estimate = _estimate(cfg, mcfg, world_size, seq_len, target, compose, start)
    if other is not None:
        estimate.routing = {
            "assumption": routing.kind,
            "moe_skew": routing.skew if routing.kind == "balanced" else None,
            "other": {
                "assumption": "collapsed" if routing.kind == "balanced" else "balanced",
                "peak_bytes": other.peak_bytes,
                "run_peak_bytes": other.run_peak_bytes,
                "host_peak_rss_bytes": other.host_peak_rss_bytes,
            },
        }
        estimate.seconds = time.perf_counter() - start
    return estimate


def _estimate(
    cfg: TrainConfig,
    mcfg: DecoderConfig,
    world_size: int,
    seq_len: int,
    target: str,
    compose: bool | None,
    start: float,
) -> Estimate:
    """:func:`estimate_run`'s figure under the routing assumption in force."""
    why_full = _why_not_composed(cfg, mcfg, target, compose)
    rounding = switches.resolved_rounding(cfg, target, world_size)
    if why_full is None and world_size > 1 and rounding != "nearest":
        why_full = (
            f"bf16_rounding={rounding} on {world_size} ranks: its per-parameter rounded steps on the shards do not "
            f"compose from 3 and 4 layers yet"
        )
    composed = None
    if why_full is None:
        traces, trace_seconds = [], []
        for n in TRACED_LAYERS:
            began = time.perf_counter()
            traces.append(
                _trace(cfg, dataclasses.replace(mcfg, num_layers=n), world_size, seq_len, target, marks=True)
            )
            trace_seconds.append(time.perf_counter() - began)
        layer_traces = [t.layer_trace for t in traces]
        try:
            composing = compose_layers(*layer_traces, mcfg.num_layers)
            if target == "cuda" and not switches.moved_categories(cfg, "cuda"):  # the reserved peak's replay
                composing.allocations = compose_allocations(*layer_traces, mcfg.num_layers)
            composed = composing
        except NotComposable as exc:
            why_full = str(exc)
    if composed is None:
        began = time.perf_counter()
        trace = _trace(cfg, mcfg, world_size, seq_len, target, marks=False)
        trace_seconds = [time.perf_counter() - began]
        timeline, offloaded, traced = trace.timeline, trace.offloaded, trace.traced
        num_params, num_trainable = trace.num_params, trace.num_trainable
        reference_peak = trace.reference_peak
        baseline = trace.baseline
        how = {"layers": mcfg.num_layers, "layers_traced": [mcfg.num_layers], "composed": False}
        how["why_not_composed"] = why_full
    else:
        three, four = traces
        extra = mcfg.num_layers - four.layers
        timeline, offloaded = composed.timeline, composed.offloaded_peak
        traced = {k: four.traced[k] + extra * (four.traced[k] - three.traced[k]) for k in four.traced}
        num_params = four.num_params + extra * (four.num_params - three.num_params)
        num_trainable = four.num_trainable + extra * (four.num_trainable - three.num_trainable)
        reference_peak = (
            None  # each layer adds its weights; the pass's own temporaries are one layer's and the head's
        )
        if four.reference_peak is not None:
            reference_peak = four.reference_peak + extra * (four.reference_peak - three.reference_peak)
        baseline = three.baseline
        how = {"layers": mcfg.num_layers, "layers_traced": list(TRACED_LAYERS), "composed": True}
        how["events_composed"] = len(timeline)
        how["events_traced"] = len(three.timeline) + len(four.timeline)
        trace = None
    how["trace_seconds"] = [round(t, 3) for t in trace_seconds]
    traced["gradients"] = _step_gradients(timeline)
    closed = model_state_bytes_closed_form(cfg, mcfg, world_size)
    peak, breakdown, phase, unseen, host = _split_unseen(cfg, target, _Timeline(timeline), closed)
    if switches.offloads_activations(cfg, target):  # the trace moved them off the device itself (cuda_paths)
        unseen["offloaded_activations"] = offloaded
        host += offloaded
    reserved = None
    if target == "cuda" and trace is not None:
        reserved = _replay_reserved(cfg, trace.tracker, trace.paged_keys)
    elif composed is not None and composed.allocations is not None:
        reserved = _reserved_peak(composed.allocations)
    device = peak if reserved is None else reserved
    if target == "cuda":
        device += CUDA_CONTEXT_BYTES_ESTIMATE
    load = save = None
    if target != "cuda" and world_size == 1:  # the phases around the step (planner/phases.py)
        load = load_peak_bytes(cfg, mcfg)
        # what the run holds between steps, written in place: the step's last temporaries and (zero_grad with
        # set_to_none) its gradients are freed by then, with no op to show it in the timeline
        save = sum(v for k, v in timeline[-1][2].items() if k not in ("gradients", "temporaries")) + host
    fixed = fixes_mmap_threshold(cfg.mmap_threshold, mcfg.dim, target, cfg.method, dtype=cfg.dtype)
    estimate = Estimate(
        peak_bytes=peak,
        breakdown=breakdown,
        phase=phase,
        device_total_bytes=device + unseen.get("paged_optimizer_state", 0),
        host_bytes=host,
        unseen=unseen,
        model_states=closed,
        traced_model_states=traced,
        num_params=num_params,
        num_trainable_params=num_trainable,
        world_size=world_size,
        batch_size=cfg.batch_size,
        seq_len=seq_len,
        seconds=time.perf_counter() - start,
        config=_switches(cfg),
        process_baseline_bytes=baseline,
        peak_reserved_bytes=reserved,
        load_peak_bytes=load,
        save_peak_bytes=save,
        reference_peak_bytes=reference_peak if world_size == 1 and target != "cuda" else None,
        fixes_mmap_threshold=fixed,
        trace=how,
    )
    if target != "cuda" and baseline is not None:
        gathered = reduced = 0
        if world_size > 1:  # the whole model and gradients pass through FSDP2's and gloo's buffers each step
            whole = model_state_bytes_closed_form(cfg, mcfg, 1)
            gathered, reduced = whole["parameters"], whole["trainable_parameters"]
        threshold = mmap_threshold_bytes(cfg.method, cfg.dtype)
        retained = retained_heap_bytes(gathered, reduced, fixed=fixed, threshold=threshold)
        # the steps' free heap: the load comes before it, and a save gives it back first (memory/host.py)
        estimate.phase_rss_bytes = {
            k: predict_peak_rss(v, baseline, heap_retained_bytes=retained if k == "step" else 0)
            for k, v in estimate.phase_peaks.items()
        }
        estimate.host_peak_rss_bytes = max(estimate.phase_rss_bytes.values())
    return estimate


@dataclass
class _Timeline:
    """A timeline where :func:`_split_unseen` reads a tracker's."""

    timeline: list


def _step_gradients(timeline: list) -> int:
    """The gradients a step holds for its update: those live at the last op of the optimizer phase, when the
    update has read them all (sharded: the reduced shards, the unsharded ones in flight are gone by then; in
    backward: none, each was freed after its update -- the first ops labelled optimizer_step are updates inside
    the backward, with a gradient live)."""
    return next((b["gradients"] for _, ph, b in reversed(timeline) if ph == "optimizer_step"), 0)


def _why_not_composed(cfg: TrainConfig, mcfg: DecoderConfig, target: str, compose: bool | None) -> str | None:
    """Why the estimate traces the whole model instead of composing it (None: it composes)."""
    if compose is False:
        return "asked for the full trace"
    least = 5 if compose else COMPOSE_FROM_LAYERS
    if mcfg.num_layers < least:
        return f"{mcfg.num_layers} decoder layers: tracing them all costs no more than composing"
    if mcfg.layer_types is not None and len(set(mcfg.layer_types)) > 1:
        return "the layers differ: local (sliding-window) and global attention layers (layer_types)"
    if mcfg.layer_types is not None:
        return "the layers follow a declared pattern (layer_types), traced as it is"
    if mcfg.dense_layers:
        return "the layers differ: dense feed-forwards in a mixture of experts (dense_layers)"
    if cfg.activation_checkpointing == "every_n":
        return "activation_checkpointing=every_n: the layers differ (checkpointed or not)"
    if cfg.method == "adapter" and cfg.adapter.num_layers and cfg.adapter.num_layers < mcfg.num_layers:
        return "method=adapter on the top layers only: the layers differ"
    return None


@dataclass
class _Traced:
    """One traced step, and what the estimate reads of it."""

    tracker: Any
    timeline: list
    layer_trace: LayerTrace | None
    offloaded: int
    traced: dict[str, int]
    paged_keys: set[int]
    baseline: int | None
    num_params: int
    num_trainable: int
    layers: int
    reference_peak: int | None = None


def _trace(
    cfg: TrainConfig, mcfg: DecoderConfig, world_size: int, seq_len: int, target: str, *, marks: bool
) -> _Traced:
    """Build the run on fake tensors and trace one ``train_step`` of it (the module doc); with ``marks``, the
    decoder layers' boundaries are marked in the timeline (:class:`memfit.planner.compose.LayerMarks`)."""
    trace_cfg = _traceable(cfg, world_size)
    with (
        fake_process_group(world_size),
        quiet(),
        fake_mode(cfg.optimizer.name) as fake,
        cuda_paths(target == "cuda"),
    ):
        baseline = process_rss_bytes()  # imports done (the optimizer's library too), no tensor allocated yet
        # the run's own build sequence, on the meta device, materialised with fake storage
        built = build_training(trace_cfg, mcfg, torch.device("cpu"), world_size=world_size, fake_mode=fake)
        model, optimizer = built.model, built.optimizer
        with fake, ScalarReads():
            batches = [
                _fake_micro_batch(cfg, seq_len, mcfg.vocab_size)
                for _ in range(cfg.gradient_accumulation_steps)
            ]
            sp = cfg.distributed.sequence_parallel
            if world_size > 1 and sp > 1:  # rank 0's slice of its group's sequences, as a run draws it
                batches = [shard_batch(b, 0, sp) for b in batches]
            # before the first step, a stored reference's pass (memfit.reference): the starting model's forwards
            # without gradients, the optimizer state not made yet
            reference_peak = _trace_reference_pass(cfg, model, optimizer, seq_len, mcfg.vocab_size)
            # step 1 only creates the optimizer state: an optimizer step on zero gradients at lr 0 (what torch's
            # distributed checkpointing does to lay the state out); step 2, the run's train_step, is traced
            init_optimizer_state(optimizer)
            tracker = MemoryTracker(
                model,
                optimizer,
                refresh_roles_at_peak=False,
                record_allocations=target == "cuda",
                record_ops=_offloaded_now if marks else None,
            )
            tracker.record_timeline = True
            # gloo's reduce-scatter buffers, made inside the tracker's mode so that the tracker sees them
            gloo = (
                GlooBuffers(shard_ranks(cfg.distributed.replicate, world_size))  # a replica's reduce-scatter
                if target == "cpu" and world_size > 1
                else contextlib.nullcontext()
            )
            OffloadStats.reset()
            layers = list(dist_unwrap(model).model.layers) if marks else None
            counted = (lambda: tracker.allocations) if target == "cuda" else None
            with tracker, gloo, marking(layers, tracker.timeline, counted) as marked:
                train_step(
                    model,
                    optimizer,
                    batches,
                    tracker=tracker,
                    **train_step_options(trace_cfg, built.reference),
                )
            offloaded = OffloadStats.peak
            traced = model_state_bytes(model, optimizer)
            paged_keys = _paged_state_entries(cfg, tracker, optimizer) if target == "cuda" else set()
            del fake
    layer_trace = None
    if marked is not None:
        layer_trace = LayerTrace(tracker.timeline, tracker.ops, marked.marks)
        if target == "cuda":
            layer_trace.allocation_marks = list(marked.allocation_marks)
            layer_trace.allocations = allocation_events(tracker, paged_keys, layer_trace.allocation_marks)
    return _Traced(
        tracker=tracker,
        timeline=tracker.timeline,
        layer_trace=layer_trace,
        offloaded=offloaded,
        traced=traced,
        paged_keys=paged_keys,
        baseline=baseline,
        num_params=built.num_params,
        num_trainable=built.num_trainable,
        layers=mcfg.num_layers,
        reference_peak=reference_peak,
    )


def _trace_reference_pass(cfg: TrainConfig, model, optimizer, seq_len: int, vocab_size: int) -> int | None:
    """The peak live bytes of a stored reference's pass (:func:`memfit.reference.precompute_reference`): one
    batch of ``2 * preference.reference_batch_size`` rows through :func:`memfit.step.sequence_logps`, traced;
    ``None`` where the run has no such pass."""
    if reference_mode(cfg) != "precomputed":
        return None
    rows = 2 * (cfg.preference.reference_batch_size or cfg.batch_size)
    tracker = MemoryTracker(model, optimizer, refresh_roles_at_peak=False)
    with tracker:
        sequence_logps(
            model,
            fake_ids(rows, seq_len, vocab_size),
            fake_ids(rows, seq_len, vocab_size),
            dtype=cfg.dtype,
            chunked_cross_entropy=cfg.chunked_cross_entropy,
        )
    return tracker.peak_bytes


def _fake_micro_batch(cfg: TrainConfig, seq_len: int, vocab_size: int) -> tuple:
    """A micro-batch as the run draws it, fake: ``(inputs, targets)`` (B, T) with packed samples' ``doc_ids``;
    for a preference objective ``2B`` rows (each pair's chosen and rejected reply) and the stored reference
    log-probabilities (2B,) where the run reads them from disk (:mod:`memfit.reference`)."""
    if cfg.objective in PREFERENCE_OBJECTIVES:
        rows = 2 * cfg.batch_size
        stored = reference_mode(cfg) == "precomputed"
        reference = torch.zeros(rows, dtype=torch.float32) if stored else None
        return fake_ids(rows, seq_len, vocab_size), fake_ids(rows, seq_len, vocab_size), reference
    return tuple(fake_ids(cfg.batch_size, seq_len, vocab_size) for _ in ("inputs", "targets")) + (
        (torch.zeros(cfg.batch_size, seq_len, dtype=torch.long),) if packs_documents(cfg) else ()
    )


def _offloaded_now() -> int:
    return OffloadStats.live


CUBLAS_SM = 90
"""The compute capability whose cuBLAS workspace the reserved prediction counts: Hopper (H100, H200), the largest
default workspace (32 MiB; 8.1 MiB on others, :func:`memfit.memory.allocator.cublas_workspace_bytes`)."""


def _paged_state_entries(cfg: TrainConfig, tracker: Any, optimizer: Any) -> set[int]:
    """The ledger entries (by ``id``) of the optimizer state a paged bitsandbytes optimizer keeps in unified memory
    on CUDA (``cudaMallocManaged``, outside the caching allocator): the two moments (``state1``, ``state2``) of each
    parameter of at least :data:`memfit.memory.optimizers.BNB_PAGED_MIN_NUMEL` elements."""
    if not optimizers.spec(cfg.optimizer.name).paged:
        return set()
    entries = set()
    for opt in optimizers_in(optimizer):
        for param, state in getattr(opt, "state", {}).items():
            if isinstance(param, torch.Tensor) and param.numel() >= BNB_PAGED_MIN_NUMEL:
                for name in ("state1", "state2"):
                    if isinstance(state.get(name), torch.Tensor):
                        entries.update(id(e) for e in tracker.storage_entries(state[name]))
    return entries


def _replay_reserved(cfg: TrainConfig, tracker: Any, paged: set[int]) -> int | None:
    """``torch.cuda.max_memory_reserved()`` of the traced step: its allocations and frees, without the paged state
    (:func:`_paged_state_entries`), after the cuBLAS workspace, replayed through the caching allocator model; FSDP2's
    all-gather and reduce-scatter buffers on their own streams, whose cached blocks the compute stream cannot use.
    ``None`` when the run moves memory to the host (:attr:`Estimate.peak_reserved_bytes`)."""
    if switches.moved_categories(cfg, "cuda"):
        return None
    return _reserved_peak(allocation_events(tracker, paged))


def _reserved_peak(events: list[tuple]) -> int:
    """``torch.cuda.max_memory_reserved()`` of a step's allocator events, bytes: replayed after the cuBLAS
    workspace (:data:`CUBLAS_SM`) through :func:`memfit.memory.allocator.replay`."""
    return replay(workspace_events(CUBLAS_SM) + events).peak_reserved


def allocation_events(tracker: Any, paged: set[int], marks: list[int] | None = None) -> list[tuple]:
    """The tracker's allocations as the caching allocator model's events (``("alloc", key, nbytes, stream)``,
    ``("free", key)``), each allocation a key of its own (a storage resized is freed and allocated again), less the
    paged state's (:func:`_paged_state_entries`).

    Args:
        tracker: the traced step's :class:`memfit.memory.tracker.MemoryTracker` (``record_allocations``).
        paged: the ledger entries (by ``id``) to leave out.
        marks: indices into ``tracker.allocations`` (:class:`memfit.planner.compose.LayerMarks`' counts),
            rewritten in place as indices into the returned events.

    Returns:
        The events, in the tracker's order (frees of allocations it never counted left out).
    """
    events: list[tuple] = []
    current: dict[int, int] = {}
    kept_before: list[int] = []  # at each of the tracker's events, how many events were returned before it
    for op, entry, nbytes in tracker.allocations:
        kept_before.append(len(events))
        if id(entry) in paged:
            continue
        if op == "alloc":
            current[id(entry)] = key = len(events)
            events.append(("alloc", key, nbytes, entry.stream))
        else:
            key = current.pop(id(entry), None)
            if key is not None:
                events.append(("free", key))
    if marks is not None:
        marks[:] = [kept_before[m] if m < len(kept_before) else len(events) for m in marks]
    return events


def packs_documents(cfg: TrainConfig) -> bool:
    """Whether the run's rows carry document ids (packed instruction samples, or a text dataset read with
    ``data.cross_document_attention: false``): its attention then runs in blocks of queries within documents
    (:func:`memfit.models.attention.document_attention`), and the trace gives it ids too (one document a row: the
    blocks' shapes, and so their bytes, do not depend on where documents end)."""
    if cfg.data.format == "text":
        return not cfg.data.cross_document_attention
    return cfg.data.packing


def _traceable(cfg: TrainConfig, world_size: int = 1) -> TrainConfig:
    """The config the trace runs: the run's, on the CPU, untracked, with each switch that needs a CUDA device or a
    compiler at build time set to its entry's trace value (:func:`memfit.memory.switches.trace_values`: their bytes
    are moved to host / unified memory afterwards, see the module doc; ``compile`` off: the trace runs the eager
    step, an upper bound of the compiled one, docs/memory.md); ``bf16_rounding`` as it resolves on the run's own
    device (``auto`` is ``nearest`` for bitsandbytes on CUDA, :func:`memfit.memory.switches.resolved_rounding`)."""
    rounding = (
        switches.resolved_rounding(cfg, device_type(cfg.device), world_size)
        if cfg.dtype == "bf16"
        else cfg.bf16_rounding
    )
    return switches.with_values(
        cfg,
        {**switches.trace_values(), "device": "cpu", "track_memory": False, "bf16_rounding": rounding},
    )


# ----------------------------------------------------------------------------------------------------------------
# What the allocator does not see
# ----------------------------------------------------------------------------------------------------------------


def _split_unseen(
    cfg: TrainConfig, target: str, tracker: Any, closed: dict[str, int]
) -> tuple[int, dict[str, int], str, dict[str, int], int]:
    """From the trace's timeline: the device peak, its breakdown and phase, once the categories that live in
    unified or host memory are taken out; those by name; and the host bytes."""
    moved = switches.moved_categories(cfg, target)  # category -> the name it is reported under
    paged = 0  # the part of optimizer_state in unified memory (bitsandbytes pages big tensors only)
    if target == "cuda" and optimizers.spec(cfg.optimizer.name).paged:
        paged = closed["paged_optimizer_state"]
    best, best_total, best_paged, unseen = None, -1, 0, dict.fromkeys(moved.values(), 0)
    if paged:
        unseen["paged_optimizer_state"] = 0
    for _, phase, b in tracker.timeline:
        now_paged = min(b["optimizer_state"], paged)
        total = sum(v for k, v in b.items() if k not in moved) - now_paged
        if total > best_total:
            best_total, best, best_paged = total, (phase, b), now_paged
        for k, name in moved.items():
            unseen[name] = max(unseen[name], b[k])
        if paged:
            unseen["paged_optimizer_state"] = max(unseen["paged_optimizer_state"], now_paged)
    if best is None:  # nothing ran
        return 0, dict.fromkeys(CATEGORIES, 0), "other", {}, 0
    phase, b = best
    breakdown = {k: (0 if k in moved else v) for k, v in b.items()}
    breakdown["optimizer_state"] -= best_paged
    host = sum(v for k, v in unseen.items() if k != "paged_optimizer_state")
    # host copies the trace does not see (optimizer.cpu_offload's, distributed.cpu_offload's shards)
    copies = switches.host_copies(cfg, target, closed)
    unseen.update(copies)
    host += sum(copies.values())
    for state in switches.off_device_states(cfg, target):
        # the device sees only the gathered layers in flight of what lives on the host
        best_total -= min(breakdown[state], closed[state])
        breakdown[state] -= min(breakdown[state], closed[state])
    return best_total, breakdown, phase, unseen, host


def _switches(cfg: TrainConfig) -> dict[str, Any]:
    """The estimate's ``config`` record: the model, the device, each switch by its entry's record name
    (:func:`memfit.memory.switches.records`) and the whole ``distributed`` section."""
    return {
        "model": cfg.model if cfg.checkpoint_dir is None else str(cfg.checkpoint_dir),
        "device": "cuda" if cfg.device == "cuda" else "cpu",
        **switches.records(cfg),
        "packed_documents": packs_documents(cfg),
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "distributed": dataclasses.asdict(cfg.distributed),
    }
