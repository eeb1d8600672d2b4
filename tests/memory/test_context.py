"""``memfit plan seq_len=max``: the longest context that fits (:mod:`memfit.planner.context`)."""

import json
from types import SimpleNamespace

import pytest

from memfit.cli import main
from memfit.config import load_config
from memfit.planner import context
from memfit.planner.estimate import estimate_run
from memfit.planner.plan import PlanRequest
from memfit.units import MIB

TINY = [
    "model=tiny",
    "tokenizer.kind=char",
    "device=cuda",
    "dtype=bf16",
    "batch_size=1",
    "optimizer.name=adamw",
]


def _stand_in(peak_of):
    """An estimator whose peak is ``peak_of(seq_len)`` bytes; records the lengths it was asked for."""
    asked = []

    def estimator(cfg, *, world_size=1, seq_len=None):
        asked.append(seq_len)
        return SimpleNamespace(
            peak_bytes=int(peak_of(seq_len)), device_total_bytes=0, host_bytes=0, unseen={}
        )

    return estimator, asked


@pytest.mark.parametrize(
    "peak_of, longest",
    [
        (lambda t: 1_000_000 + 700 * t, 141_312),  # linear: (100e6 - 1e6) / 700 = 141,428 -> 138 x 1024
        # convex (a second term that grows faster takes over): max(1e6 + 400 t, 300 t + t^2 / 20)
        (lambda t: max(1_000_000 + 400 * t, 300 * t + t * t / 20), 40_960),  # the root: 41,821
        (lambda t: 99_000_000 + 1000 * t, 960),  # less than 1,024 tokens: multiples of 64
    ],
    ids=["linear", "convex", "short"],
)
def test_the_search_finds_the_longest_multiple_in_few_estimates(peak_of, longest):
    cfg = load_config(None, TINY, needs_weights=False)
    estimator, asked = _stand_in(peak_of)
    found, _, over, estimates = context.longest_length(cfg, 100_000_000, estimator=estimator)
    assert found == longest
    step = 1024 if longest >= 1024 else 64
    assert peak_of(found) <= 100_000_000 < peak_of(found + step)  # the next multiple does not fit
    assert over == 0 or peak_of(over) > 100_000_000
    assert estimates == len(asked) <= 12


def test_the_search_stops_at_its_cap():
    cfg = load_config(None, TINY, needs_weights=False)
    estimator, _ = _stand_in(lambda t: t)
    assert context.longest_length(cfg, 10**12, cap=20_000, estimator=estimator)[0] == 20_000


def test_nothing_fits_at_any_length():
    """A peak that does not fall with the length (the model states over the budget): two estimates say so, the
    line through them being over the budget at length 0; a falling one is followed down to 64 tokens."""
    cfg = load_config(None, TINY, needs_weights=False)
    estimator, asked = _stand_in(lambda t: 10**9 + 8 * t)
    assert context.longest_length(cfg, 100, estimator=estimator)[:2] == (0, None)
    assert sorted(asked) == [context.FIRST_LENGTH // 2, context.FIRST_LENGTH]
    estimator, asked = _stand_in(lambda t: 10**9 * t)
    assert context.longest_length(cfg, 100, estimator=estimator)[:2] == (0, None)
    assert min(asked) == 64


def test_a_preset_s_context_is_raised_to_the_length():
    cfg = context.at_length(load_config(None, TINY, needs_weights=False), 5000)
    assert cfg.seq_len == 5000 and cfg.model_args["max_seq_len"] == 5000  # the tiny preset's is 128


@pytest.mark.slow  # a seq_len=max ladder of estimates: over 10 s on 2 cores
def test_plan_seq_len_max_through_the_cli(capsys):
    """The chosen row has the longest ``seq_len`` that fits and its peak: estimated at that length it fits, and at
    the next length the search steps by (1,024 tokens; 64 below 1,024) the same switches do not; the ladder gives
    each switch set's longest context."""
    budget = 48 * MIB
    assert main(["plan", *TINY, f"budget={budget}B", "seq_len=max", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best, seq_len = out["best"], out["seq_len"]
    assert best["seq_len"] == seq_len >= 512 and best["fits"]
    usable = out["usable_gib"] * 1024**3
    assert best["peak_memory_gib"] * 1024**3 <= usable
    cfg = load_config(None, [*TINY, *(f"{k}={v}" for k, v in best["config"].items())], needs_weights=False)
    again = estimate_run(context.at_length(cfg, seq_len))
    assert again.peak_bytes / 1024**3 == best["peak_memory_gib"]
    ladder = out["longest_context"]
    assert [r["switches"] for r in ladder][0] == "config as given"
    assert ladder[-1]["seq_len"] == max(r["seq_len"] for r in ladder) == seq_len
    last = ladder[-1]
    step = context.GRANULARITY if seq_len >= context.GRANULARITY else context.FINE_GRANULARITY
    longer = estimate_run(
        context.at_length(load_config(None, [*TINY, *_label_overrides(last)]), seq_len + step)
    )
    assert longer.peak_bytes > usable  # the longest: one step more does not fit
    assert out["limit"] in again.breakdown


@pytest.mark.slow  # a seq_len=max ladder of estimates: over 10 s on 2 cores
def test_the_text_report_gives_the_ladder_then_the_plan():
    found = context.longest_context(PlanRequest(load_config(None, TINY, needs_weights=False), 48 * MIB))
    text = context.format_context(found)
    assert "longest context per switch set" in text and f"longest context: seq_len {found.seq_len:,}" in text
    assert text.index("longest context per switch set") < text.index(
        "rank  switches"
    )  # then the plan's table
    assert [r.name for r in found.rungs][:2] == ["config as given", "least-memory model states"]


def _label_overrides(rung):
    """The overrides of a rung of the ladder, from its label (``bf16 paged_adamw8bit in_bwd ac=full ce=auto tiled
    act_offload``)."""
    words = rung["label"].split()
    out = []
    if "paged_adamw8bit" in words:
        out += ["optimizer.name=paged_adamw8bit"]
    if "in_bwd" in words:
        out += ["optimizer_in_backward=true", "max_grad_norm=0"]
    for word in words:
        if word.startswith("ac="):
            out.append(f"activation_checkpointing={word[3:]}")
        if word.startswith("ce="):
            out.append(f"chunked_cross_entropy={word[3:]}")
    if "tiled" in words:
        out.append("tiled_mlp=auto")
    if "act_offload" in words:
        out.append("activation_offloading=true")
    return out


def test_a_config_asked_again_at_the_same_length_is_answered_from_memory():
    """The ladder's rungs and the plan at the longest length share one memory of estimates (the plan's
    least-memory probe is often the last rung's config at that length)."""
    cfg = load_config(None, TINY, needs_weights=False)
    estimator, asked = _stand_in(lambda t: 1000 * t)
    remembered = context._Remembered(estimator)
    first = remembered(context.at_length(cfg, 2048), world_size=1, seq_len=2048)
    again = remembered(context.at_length(cfg, 2048), world_size=1, seq_len=2048)
    other = remembered(context.at_length(cfg, 4096), world_size=1, seq_len=4096)
    assert again is first and other.peak_bytes == 4_096_000
    assert asked == [2048, 4096]
    assert remembered.asked == 3 and remembered.made == [first, other]


def test_a_plan_fills_in_first_the_estimates_its_estimator_holds():
    """The plan at the longest length asks first for the rows the ladder estimated there already (the last rung's
    config, the least-memory one): they cost nothing, and their sibling bounds prune the search; the plan
    chosen is the one made without them."""
    from memfit.planner import plan as plan_

    cfg = context.at_length(load_config(None, TINY, needs_weights=False), 256)
    budget = 8 * MIB
    fresh = plan_.plan(PlanRequest(cfg, budget, 1))
    remembered = context._Remembered(estimate_run)
    search, _ = plan_._build(PlanRequest(cfg, budget, 1))
    least = search.least_memory()
    held = remembered(least.config, world_size=1, seq_len=256)
    lines: list[str] = []
    again = plan_.plan(PlanRequest(cfg, budget, 1, estimator=remembered, progress=lines.append))
    assert lines[0].startswith(f"  estimate 1 (from memory): {least.label()}: peak ")
    row = next(r for r in again.rows if r.label() == least.label())
    assert row.estimate is held
    assert again.best.label() == fresh.best.label() and again.best.peak_bytes == fresh.best.peak_bytes
    assert remembered.asked == again.estimates + 1 and len(remembered.made) == again.estimates
