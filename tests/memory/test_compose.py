"""Composing an L-layer estimate from traces of 3 and 4 decoder layers (``memfit.planner.compose``): for each
switch and combination that composes, the composed answer equals the full trace's to the byte (the peak, every
category at it, its phase, the allocator-invisible parts, the host bytes, the traced model states and the parameter
counts), on tiny models of 5 and 6 layers; where composing does not hold the estimate traces the whole model and
says why."""

from __future__ import annotations

import pytest

from memfit.config import load_config
from memfit.memory import optimizers
from memfit.planner.estimate import estimate_run

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {
    "model": "tiny",
    "tokenizer.kind": "char",
    "tokenizer.vocab_size": 65,
    "device": "cpu",
    "optimizer.name": "adamw",
    "batch_size": 2,
    "seq_len": 16,
}
ANSWER = (
    "peak_bytes",
    "breakdown",
    "phase",
    "unseen",
    "host_bytes",
    "device_total_bytes",
    "peak_reserved_bytes",
    "traced_model_states",
    "num_params",
    "num_trainable_params",
)


def _estimate(layers: int, compose: bool | None, world_size: int = 1, **overrides):
    overrides = {k.replace("__", "."): v for k, v in overrides.items()}
    items = {**BASE, "model_args.num_layers": layers, **overrides}
    cfg = load_config(None, [f"{k}={v}" for k, v in items.items()], world_size=world_size)
    return estimate_run(cfg, world_size=world_size, compose=compose)


def _answer(estimate) -> dict:
    return {k: getattr(estimate, k) for k in ANSWER}


COMPOSED = {
    "plain": {},
    "activation_checkpointing=full": {"activation_checkpointing": "full"},
    "activation_checkpointing=selective": {"activation_checkpointing": "selective"},
    "optimizer_in_backward": {"optimizer_in_backward": "true", "max_grad_norm": 0},
    "chunked_cross_entropy=4": {"chunked_cross_entropy": 4},
    "tiled_mlp=2": {"tiled_mlp": 2},
    "gradient_accumulation_steps=2": {"gradient_accumulation_steps": 2},
    "for_loop AdamW": {"optimizer.implementation": "for_loop"},
    "dtype=bf16": {"dtype": "bf16"},
    "dtype=bf16_mixed": {"dtype": "bf16_mixed"},
    "8-bit AdamW": {
        "optimizer.name": "adamw8bit"
    },  # its CPU kernels' ops (traced whole before: the op's none)
    "seed-like: bf16 in_bwd ac=full ce=4": {
        "dtype": "bf16",
        "optimizer_in_backward": "true",
        "max_grad_norm": 0,
        "activation_checkpointing": "full",
        "chunked_cross_entropy": 4,
    },
    "ac=full ce=4 tiled_mlp=2 accumulation=2": {
        "activation_checkpointing": "full",
        "chunked_cross_entropy": 4,
        "tiled_mlp": 2,
        "gradient_accumulation_steps": 2,
    },
    # offloaded checkpoints (a CUDA run's): 64 tokens, so that the RoPE tables every layer saves are offloaded
    # too (4 KiB each, over MIN_OFFLOAD_BYTES), once; the reserved peak's replay composes with them
    "cuda: activation_offloading ac=full": {
        "device": "cuda",
        "activation_offloading": "true",
        "activation_checkpointing": "full",
        "seq_len": 64,
    },
    "cuda: activation_offloading ac=none bf16 in_bwd": {
        "device": "cuda",
        "activation_offloading": "true",
        "dtype": "bf16",
        "optimizer_in_backward": "true",
        "max_grad_norm": 0,
        "seq_len": 64,
    },
}


@pytest.mark.parametrize("layers", [5, pytest.param(6, marks=pytest.mark.slow)])
@pytest.mark.parametrize("overrides", list(COMPOSED.values()), ids=list(COMPOSED))
def test_composed_equals_the_full_trace_to_the_byte(overrides, layers):
    full = _estimate(layers, False, **overrides)
    composed = _estimate(layers, True, **overrides)
    assert composed.trace["composed"] is True, composed.trace
    assert composed.trace["layers_traced"] == [3, 4]
    seconds = full.trace.pop("trace_seconds")
    assert len(seconds) == 1 and 0 < seconds[0] <= full.seconds
    assert full.trace == {
        "layers": layers,
        "layers_traced": [layers],
        "composed": False,
        "why_not_composed": "asked for the full trace",
    }
    assert (
        len(composed.trace["trace_seconds"]) == 2 and sum(composed.trace["trace_seconds"]) <= composed.seconds
    )
    assert _answer(composed) == _answer(full)
    assert composed.peak_bytes > 0


@pytest.mark.parametrize(
    ("layers", "overrides"),
    [
        (5, {}),
        (5, {"device": "cuda"}),
        pytest.param(9, {}, marks=pytest.mark.slow),
        pytest.param(9, {"device": "cuda"}, marks=pytest.mark.slow),
        pytest.param(6, {"activation_checkpointing": "full", "dtype": "bf16"}, marks=pytest.mark.slow),
        pytest.param(
            6, {"activation_checkpointing": "full", "dtype": "bf16", "device": "cuda"}, marks=pytest.mark.slow
        ),
        pytest.param(  # offloaded checkpoints: the last layer fetches its input, then the next's, alike in bytes
            6,
            {
                "device": "cuda",
                "activation_offloading": "true",
                "activation_checkpointing": "full",
                "seq_len": 64,
            },
        ),
        pytest.param(6, {"distributed.reshard_after_forward": "false"}, marks=pytest.mark.slow),
        pytest.param(
            6, {"distributed.reshard_after_forward": "false", "device": "cuda"}, marks=pytest.mark.slow
        ),
        # Muon, pretraining's default: each matrix gathered whole for its Newton-Schulz iteration, then the AdamW
        # part's per-norm updates beside zero_grad's per-layer frees (issue 53: the 70B x 8 estimate); ~10 s each
        # (three traces), so in the slow tier; test_inserts_the_matcher_cuts_across_two_runs... is the fast one
        pytest.param(5, {"optimizer.name": "muon", "device": "cuda"}, marks=pytest.mark.slow),
        pytest.param(
            9, {"optimizer.name": "muon", "device": "cuda", "dtype": "bf16"}, marks=pytest.mark.slow
        ),
        pytest.param(
            6, {"optimizer.name": "muon", "device": "cuda", "world_size": 8}, marks=pytest.mark.slow
        ),
        pytest.param(6, {"optimizer.name": "muon"}, marks=pytest.mark.slow),
        # Adam-mini: its state's runs of a layer's matrices and of its norms meet on an event alike in both
        pytest.param(6, {"optimizer.name": "adam_mini", "device": "cuda"}, marks=pytest.mark.slow),
    ],
)
def test_fsdp2_ranks_compose_to_the_byte(layers, overrides):
    """A rank of FSDP2 on 2 ranks (or ``world_size``): each layer's all-gather and reduce-scatter fall in its own
    segment (the marks' hooks run before FSDP's), so the layers compose as on one device; on CUDA the reserved peak
    too (the all-gather buffer of each layer, prefetched in the layer before, freed once the next is waited on)."""
    overrides = {"distributed.strategy": "fsdp2", **overrides}
    world_size = overrides.pop("world_size", 2)
    full = _estimate(layers, False, world_size, **overrides)
    composed = _estimate(layers, True, world_size, **overrides)
    assert composed.trace["composed"] is True, composed.trace
    assert _answer(composed) == _answer(full)


@pytest.mark.parametrize(
    "name",
    [n if n == "muon" else pytest.param(n, marks=pytest.mark.slow) for n in optimizers.OPTIMIZER_NAMES],
)
def test_every_optimizer_composes_to_the_byte_or_says_why(name):
    """Each optimizer's step on 9 layers (runs of per-parameter updates whose first unit differs, two loops over
    the parameters, Adam-mini's and APOLLO's groups): composed from 3 and 4 layers, it is the full trace.
    bitsandbytes' updates compose too since a CPU trace runs its CPU kernels' ops (bnb_cpu.compose_bnb_cpu_updates;
    through its op, which allocates nothing, a tiny layer's 8-bit and 32-bit updates were cut anywhere by the
    matcher and the model was traced whole, as a CUDA target's still is: test_where_layers_do_not_compose...)."""
    full = _estimate(9, False, optimizer__name=name)
    asked = _estimate(9, True, optimizer__name=name)
    assert asked.trace["composed"] is True, asked.trace
    assert _answer(asked) == _answer(full)
    assert full.breakdown["optimizer_state"] > 0 or name in {"apollo_mini"}


FULL = {  # where composing does not hold: traced whole, the reason said
    "every_n": ({"activation_checkpointing": "every_n"}, 1, "activation_checkpointing=every_n"),
    "8-bit AdamW on CUDA": (  # at these sizes a layer's 8-bit and 32-bit updates (ops that allocate nothing on
        {"optimizer.name": "adamw8bit", "device": "cuda"},  # CUDA) interleave, cut anywhere by the matcher
        1,
        "segment ('B', 0, 0): a layer's more ops at the segment's edge",
    ),
}


@pytest.mark.parametrize(("overrides", "world_size", "why"), list(FULL.values()), ids=list(FULL))
def test_where_layers_do_not_compose_the_whole_model_is_traced_and_the_estimate_says_why(
    overrides, world_size, why
):
    full = _estimate(6, False, world_size, **overrides)
    asked = _estimate(6, True, world_size, **overrides)
    assert asked.trace["composed"] is False
    assert asked.trace["layers_traced"] == [6]
    assert asked.trace["why_not_composed"].startswith(why), asked.trace
    assert _answer(asked) == _answer(full)


CUDA = {  # the reserved peak replays the composed allocation sequence: event for event the full trace's
    "plain": ({}, True),
    "bf16 muon ac=full": (
        {"dtype": "bf16", "optimizer.name": "muon", "activation_checkpointing": "full"},
        True,
    ),
    "paged_adamw8bit in_bwd": (
        {"optimizer.name": "paged_adamw8bit", "optimizer_in_backward": "true", "max_grad_norm": 0},
        True,
    ),
    "accumulation=2 ce=4 tiled_mlp=2": (
        {"gradient_accumulation_steps": 2, "chunked_cross_entropy": 4, "tiled_mlp": 2},
        True,
    ),
    # every matrix's state paged (>= 100,000 elements: out of the replay), the norms' not: the layer marks count
    # the events the replay keeps
    "fsdp2 on 2 ranks": ({"distributed.strategy": "fsdp2", "world_size": 2}, True),
    "muon, fsdp2 on 2 ranks": (
        {"distributed.strategy": "fsdp2", "world_size": 2, "optimizer.name": "muon"},
        False,
    ),
    "paged_adamw8bit, paged state": (
        {"optimizer.name": "paged_adamw8bit", "model_args.dim": 320, "model_args.intermediate_size": 1024},
        True,
    ),
    "ac=selective": ({"activation_checkpointing": "selective"}, False),
    "bf16_mixed": ({"dtype": "bf16_mixed"}, False),
    "adam_mini": ({"optimizer.name": "adam_mini"}, False),
    "adafactor": ({"optimizer.name": "adafactor"}, False),
    "apollo": ({"optimizer.name": "apollo"}, False),
    "torchao_adamw4bit": ({"optimizer.name": "torchao_adamw4bit"}, False),
    "adamw8bit, 9 layers": ({"optimizer.name": "adamw8bit", "model_args.num_layers": 9}, False),
}


def _canonical(events: list[tuple]) -> list[tuple]:
    """Allocator events with each key replaced by its allocation's ordinal (what the replay depends on)."""
    ordinal: dict = {}
    out = []
    for event in events:
        if event[0] == "alloc":
            ordinal[event[1]] = len(ordinal)
            out.append(("alloc", event[2], event[3]))
        else:
            out.append(("free", ordinal[event[1]]))
    return out


@pytest.mark.parametrize(
    "overrides",
    [v if fast else pytest.param(v, marks=pytest.mark.slow) for v, fast in CUDA.values()],
    ids=list(CUDA),
)
def test_cuda_composed_allocations_are_the_full_traces_event_for_event(overrides):
    """The L-layer allocation sequence composed from the 3- and 4-layer traces (what the reserved peak's replay
    reads) is the full trace's: the same bytes on the same streams, each free of the same allocation."""
    import dataclasses

    from memfit.build import run_model_config
    from memfit.planner import estimate
    from memfit.planner.compose_allocations import compose_allocations

    overrides = {"model_args.num_layers": 6, **overrides}
    world_size = overrides.pop("world_size", 1)
    items = {**BASE, "device": "cuda", **overrides}
    cfg = load_config(None, [f"{k}={v}" for k, v in items.items()], world_size=world_size)
    mcfg = run_model_config(cfg)

    def traced(layers: int):  # the estimator's own trace (marked, as it traces the layers it composes from)
        depth = dataclasses.replace(mcfg, num_layers=layers)
        return estimate._trace(cfg, depth, world_size, cfg.seq_len, "cuda", marks=True).layer_trace

    full = _canonical(traced(mcfg.num_layers).allocations)
    composed = _canonical(compose_allocations(traced(3), traced(4), mcfg.num_layers))
    assert len(composed) == len(full) > 1000
    assert composed == full
    assert sum(1 for e in full if e[0] == "free") > 500


def test_cuda_estimates_compose_with_the_reserved_peak():
    """The whole CUDA estimate composes, its reserved peak (the caching allocator's replay) included."""
    overrides = {"dtype": "bf16", "activation_checkpointing": "full"}
    full = _estimate(6, False, device="cuda", **overrides)
    composed = _estimate(6, True, device="cuda", **overrides)
    assert composed.trace["composed"] is True, composed.trace
    assert _answer(composed) == _answer(full)
    assert composed.peak_reserved_bytes >= composed.peak_bytes > 0


def test_cuda_estimates_compose_with_paged_state():
    """A paged optimizer's large states are left out of the replay (unified memory); the rest composes, the
    reserved peak included, as the full trace gives it."""
    overrides = {
        "optimizer.name": "paged_adamw8bit",
        "model_args.dim": 320,
        "model_args.intermediate_size": 1024,
        "activation_checkpointing": "full",
    }
    full = _estimate(6, False, device="cuda", **overrides)
    composed = _estimate(6, True, device="cuda", **overrides)
    assert composed.trace["composed"] is True, composed.trace
    assert _answer(composed) == _answer(full)
    assert full.unseen["paged_optimizer_state"] > 0


def test_the_default_composes_deep_models_only():
    shallow = _estimate(6, None)
    assert shallow.trace["composed"] is False
    assert (
        shallow.trace["why_not_composed"] == "6 decoder layers: tracing them all costs no more than composing"
    )
    deep = _estimate(8, None)
    assert deep.trace["composed"] is True
    assert _answer(deep) == _answer(_estimate(8, False))


def test_local_and_global_layers_are_traced_whole():
    """Gemma's pattern of local (sliding-window) and global layers: the layers differ, so none is composed."""
    from memfit.models.presets import model_config

    mcfg = model_config("tiny-gemma2", num_layers=6, layer_types=("sliding_attention", "full_attention") * 3)
    items = {**BASE, "model": "tiny-gemma2"}
    cfg = load_config(None, [f"{k}={v}" for k, v in items.items()])
    asked = estimate_run(cfg, model_config=mcfg, compose=True)
    assert asked.trace["composed"] is False and asked.trace["layers_traced"] == [6]
    assert asked.trace["why_not_composed"].startswith("the layers differ: local (sliding-window) and global")
    assert _answer(asked) == _answer(estimate_run(cfg, model_config=mcfg, compose=False))


def test_the_report_says_how_the_figure_was_obtained():
    """``memfit estimate --explain`` and ``memfit plan --explain``: the depths traced, what was composed, the
    events, and for a plan the counts (composed, traced whole and why, answered from memory, layers traced)."""
    from memfit.planner import report

    composed, full = _estimate(5, True), _estimate(5, False)
    t = composed.trace
    lines = report.explain_estimate(composed).splitlines()
    assert lines[0] == "how this estimate was obtained:"
    assert lines[2] == (
        f"  traced: the run with 3 and with 4 decoder layers ({t['trace_seconds'][0]:.2f} + "
        f"{t['trace_seconds'][1]:.2f} s)"
    )
    assert lines[3] == (
        f"  composed: the 5-layer step from the two, the middle layer's events repeated for the 1 layers not "
        f"traced ({t['events_traced']:,} events traced, {t['events_composed']:,} in the composed step)"
    )
    assert lines[4] == "  layer-traces: 7 instead of 5 (the whole model: memfit estimate --full-trace)"
    assert report.explain_estimate(full).splitlines()[2] == (
        f"  traced: all 5 decoder layers ({full.trace['trace_seconds'][0]:.2f} s): asked for the full trace"
    )
    how = report.how_estimated([composed, full, full], asked=5)
    assert how == {
        "estimates": 3,
        "reused": 2,
        "composed": 1,
        "traced_whole": {"asked for the full trace": 2},
        "layer_traces": 7 + 5 + 5,
        "layer_traces_whole": 15,
        "seconds": composed.seconds + 2 * full.seconds,
    }
    assert report.format_how_estimated(how).splitlines() == [
        f"how the estimates were obtained: 3 estimates in {how['seconds']:.1f} s, 2 more answered from memory "
        "(the same config asked again); 1 composed from traces of 3 and 4 decoder layers, 2 traced whole",
        "  traced whole (2): asked for the full trace",
        "  decoder layers traced: 17 (tracing every model whole: 15)",
    ]


def test_inserts_the_matcher_cuts_across_two_runs_are_placed_as_units():
    """Two per-layer runs side by side at the end of a sharded Muon step (its AdamW part: two norms a layer, each
    update allocating two buffers and freeing the one before's; then zero_grad freeing each layer's gradient):
    the 4-layer trace holds 8 + 1 events more, which the matcher inserts as 2 + 7, a norm's update cut around
    the last norm's free. Placed again, they are one unit of each run: a layer's two norms (8 events, four units
    from the first free of the norms' run) and one layer's gradient (1 event)."""
    from memfit.planner.compose_allocations import _differences, _nested_runs, _placements

    alloc, free = ("alloc", 128, 0), ("free", 128, 0)

    def step_end(layers: int) -> list[tuple]:
        embeddings = [("alloc", 32768, 0), ("alloc", 32768, 0), ("free", 32768, 0)] * 2 + [
            ("free", 32768, 0)
        ] * 2
        norms = [alloc, alloc, free, *[alloc, alloc, free, free] * (2 * layers), free]
        return [*embeddings, *norms, *[("free", 73984, 0)] * layers, ("free", 65664, 0), ("free", 4, 0)]

    s3, s4 = step_end(3), step_end(4)
    assert (len(s3), len(s4)) == (41, 50)
    assert _differences(s3, s4) == [("insert", 35, 35, 35, 37), ("insert", 36, 36, 38, 45)]
    runs, grows = _nested_runs(("B", 0, 0), s4, (0, len(s4)), s3, (0, len(s3)))
    assert [(r.starts, r.lengths) for r in runs] == [([10, 18, 26, 34], [8] * 4), ([44, 45, 46, 47], [1] * 4)]
    assert grows == {}
    assert list(_placements([1, 2, 3], [1, 9, 2, 3, 8], 2)) == [[(1, 2), (4, 5)]]
    assert list(_placements([1, 1], [1, 1, 1], 1)) == [[(0, 1)], [(1, 2)], [(2, 3)]]


def test_two_runs_that_meet_on_an_event_alike_in_both_do_not_overlap():
    """Sharded Adam-mini's state (segment ``I``): a run of one layer's matrices (4 events: the last a one-element
    state of 4 bytes), then a run of the norms (2 a layer, each ``128, 4``). The 4-layer trace's 8 events more
    straddle the two runs; the 4-byte event where they meet is periodic in both, so each half's stretch reaches it.
    It is the first run's, and the second run starts after it (it overlapped, and the model was traced whole)."""
    from memfit.planner.compose_allocations import _differences, _nested_runs

    def alloc(nbytes: int) -> tuple:
        return ("alloc", nbytes, 0)

    def step_start(layers: int) -> list[tuple]:
        moments = [alloc(n) for n in (4096, 64, 8192, 128, 16384, 256, 16384, 256, 16384, 128)]
        matrices = [alloc(8192), alloc(8), alloc(4096), alloc(4)]
        norms = [alloc(128), alloc(4)] * (2 * layers + 1)
        return [alloc(32), alloc(32768), alloc(512), *moments * layers, alloc(32768), alloc(512)] + (
            matrices * layers + norms + [alloc(256)]
        )

    s3, s4 = step_start(3), step_start(4)
    assert _differences(s3, s4) == [("insert", 3, 3, 3, 13), ("insert", 47, 47, 57, 65)]
    runs, _ = _nested_runs(("I", 0, None), s4, (0, len(s4)), s3, (0, len(s3)))
    assert [(r.starts, r.lengths) for r in runs] == [
        ([3, 13, 23, 33], [10] * 4),
        ([45, 49, 53, 57], [4] * 4),
        ([61, 65, 69, 73], [4] * 4),
    ]
