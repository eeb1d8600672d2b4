"""``track_memory`` on a sharded run (torchrun, 2 ranks, CPU/gloo): the logged breakdown counts each rank's own
shards, byte for byte, and what FSDP gathers as ``unsharded_parameters``; tracking changes no number of the run.

The model is ``tiny-tied`` with 4 layers and a vocabulary of 259, an odd row count, so that the embedding (tied to
``lm_head``: one tensor, counted once) is padded to 2 x 130 rows and rank 1 holds only 129 real ones. Every
expected byte count is computed here from the model's shapes and the sharding rule of each FSDP version.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.memory.tracker import CATEGORIES
from memfit.metrics import read_records
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config

from .conftest import run_torchrun, tiny_run_overrides

WORLD = 2
PREFETCH = 1  # distributed.prefetch: the next layer's all-gather is issued ahead
MODEL_ARGS = {"vocab_size": 259, "num_layers": 4}
MCFG = model_config("tiny-tied", **MODEL_ARGS)
STEPS = 3
TOL = 1e-5  # as tests/test_distributed.py: 2 ranks sum gradients in another order than one process
GIB = 1024**3


def _overrides(corpus: Path, out: Path, **extra) -> list[str]:
    run = {
        "model": "tiny-tied",
        **{f"model_args.{k}": v for k, v in MODEL_ARGS.items()},
        "max_steps": STEPS,
        "eval_every": 0,
        "checkpoint_every": 0,
        "optimizer.warmup_steps": 1,
        "sample.max_new_tokens": 0,
        "distributed.prefetch": PREFETCH,
    }
    return tiny_run_overrides(corpus, out, **{**run, **extra})


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, small_corpus) -> Callable[[str], Path]:
    """``strategy -> output dir`` of a tracked 2-rank run with batch 4 per rank (run once per strategy)."""
    runs: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"tracked_{strategy}") / "run"
            over = {"batch_size": 4, "track_memory": "true", "distributed.strategy": strategy}
            run_torchrun(["pretrain", *_overrides(small_corpus, out, **over)])
            runs[strategy] = out
        return runs[strategy]

    return run


# ----------------------------------------------------------------------------------------------------------------
# Expected bytes, from the shapes
# ----------------------------------------------------------------------------------------------------------------


@functools.cache
def _units() -> dict[str, list[torch.nn.Parameter]]:
    """The parameters of each FSDP unit, in registration order: every decoder layer, and the root (the rest; the
    tied embedding / lm_head is one Parameter, so listed once)."""
    model = build_decoder(MCFG, device="meta")
    layers = {f"layer{i}": list(layer.parameters()) for i, layer in enumerate(model.model.layers)}
    in_layers = {id(p) for ps in layers.values() for p in ps}
    return {"root": [p for p in model.parameters() if id(p) not in in_layers], **layers}


@functools.cache
def _buffer_bytes() -> int:
    return sum(b.numel() * b.element_size() for b in build_decoder(MCFG, device="meta").buffers())


def _fsdp2_bytes(rank: int) -> dict[str, int]:
    """FSDP2 shards every parameter on dim 0 in ``ceil(rows / WORLD)``-row chunks, each rank's padded to that."""
    out = {"shard": 0, "local": 0, "tensors": 0}
    for unit, params in _units().items():
        out[f"{unit}_unsharded"] = 0
        for p in params:
            rows, row_bytes = p.shape[0], p.numel() // p.shape[0] * p.element_size()
            chunk = math.ceil(rows / WORLD)
            out["shard"] += chunk * row_bytes  # the padded shard FSDP2 stores
            out["local"] += max(0, min(chunk, rows - rank * chunk)) * row_bytes  # its real rows
            out[f"{unit}_unsharded"] += chunk * WORLD * row_bytes  # the padded all-gather output
            out["tensors"] += 1
    return out


def _fsdp1_bytes(rank: int) -> dict[str, int]:
    """FSDP1 (``use_orig_params``) flattens each unit, every parameter starting at a multiple of 16 bytes, pads
    the flat parameter to a multiple of ``WORLD`` elements, and gives each rank an equal slice; a parameter with
    no element in this rank's slice has no gradient there, so AdamW keeps no state for it."""
    out = {"shard": 0, "local": 0, "tensors": 0}
    for unit, params in _units().items():
        spans, numel = [], 0
        for p in params:
            numel += -numel % (16 // p.element_size())
            spans.append((numel, numel + p.numel(), p.element_size()))
            numel += p.numel()
        numel += -numel % WORLD
        size = numel // WORLD
        lo, hi = rank * size, (rank + 1) * size
        for start, end, itemsize in spans:
            mine = max(0, min(end, hi) - max(start, lo))
            out["local"] += mine * itemsize
            out["tensors"] += mine > 0
        out["shard"] += size * 4  # fp32
        out[f"{unit}_unsharded"] = numel * 4
    return out


def _train_records(out: Path) -> list[dict]:
    return [r for r in read_records(out / "metrics.jsonl") if "loss" in r]


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_breakdown_counts_this_ranks_shards_and_the_gathered_layers(strategy, tracked_run):
    out = tracked_run(strategy)
    records = _train_records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    layer_key = "layer0_unsharded"
    for r in records:
        rank = r["memory_peak_rank"]
        assert rank in range(WORLD)
        assert set(r["memory_breakdown"]) == set(r["memory_category_peaks"]) == set(CATEGORIES)
        got = {k: round(v * GIB) for k, v in r["memory_breakdown"].items()}  # GiB back to bytes (exact)
        peaks = {k: round(v * GIB) for k, v in r["memory_category_peaks"].items()}
        expected = (_fsdp2_bytes if strategy == "fsdp2" else _fsdp1_bytes)(rank)
        assert got["parameters"] == peaks["parameters"] == expected["shard"] + _buffer_bytes()
        # gathered, at least: the root (kept from its forward to its backward) and a layer. At most: at the first
        # layer's copy-out the root twice (FSDP2 frees a unit's flat all-gather buffer after the next unit's
        # copy-out) and that layer twice (buffer and storages); later the layer at work, the previous layer's
        # buffer, and the layers gathered ahead
        root, layer = expected["root_unsharded"], expected[layer_key]
        lower = root + layer
        upper = root + max(root + 2 * layer, (PREFETCH + 2) * layer)
        print(
            f"{strategy} step {r['step']} rank {rank}: {got}; unsharded peak {peaks['unsharded_parameters']}"
        )
        assert lower <= peaks["unsharded_parameters"] <= upper
        if (
            r["step"] >= 2
        ):  # AdamW's state exists for the whole step: exp_avg and exp_avg_sq of this rank's real
            # elements (padding has none), and one fp32 step counter per tensor
            assert got["optimizer_state"] == 2 * expected["local"] + 4 * expected["tensors"]
    assert (out / "memory_timeline.png").read_bytes()[:4] == b"\x89PNG"  # rank 0 draws


@pytest.mark.slow
def test_tracked_two_ranks_train_what_one_untracked_process_does(tracked_run, small_corpus, tmp_path):
    out = tracked_run(
        "fsdp2"
    )  # (tests/test_distributed.py checks FSDP1 untracked against the same reference)
    single = tmp_path / "single"
    assert main(["pretrain", *_overrides(small_corpus, single, batch_size=8)]) == 0
    tracked, plain = _train_records(out), _train_records(single)
    assert [r["step"] for r in tracked] == [r["step"] for r in plain]
    for a, b in zip(tracked, plain, strict=True):
        assert abs(a["loss"] - b["loss"]) <= TOL and abs(a["grad_norm"] - b["grad_norm"]) <= TOL
    assert "memory_breakdown" not in plain[0]


class _Rank:
    """What :func:`memfit.memory.stats.tracked_memory_fields` reads of a tracker."""

    categories = CATEGORIES

    def __init__(self, peak: int, phase: str, at_peak: dict[str, int], own_peaks: dict[str, int]) -> None:
        self.peak_bytes, self.peak_phase = peak, phase
        self.peak_breakdown, self.category_peaks = at_peak, own_peaks
        self.reset = False

    def reset_peak(self) -> None:
        self.reset = True


def test_the_record_holds_the_breakdown_of_the_fullest_rank(monkeypatch):
    from memfit import distributed as dist_
    from memfit.memory.stats import tracked_memory_fields

    def bytes_of(**kw):
        return {c: kw.get(c, 0) * GIB for c in CATEGORIES}

    ranks = [
        _Rank(
            3 * GIB, "forward", bytes_of(parameters=1, activations=2), bytes_of(parameters=1, activations=2)
        ),
        _Rank(4 * GIB, "backward", bytes_of(parameters=1, gradients=3), bytes_of(parameters=1, gradients=3)),
        _Rank(2 * GIB, "backward", bytes_of(parameters=2), bytes_of(parameters=2, unsharded_parameters=5)),
    ]
    gathered = [(r.peak_bytes, r.peak_breakdown, r.peak_phase, r.category_peaks) for r in ranks]
    monkeypatch.setattr(dist_, "all_gather_objects", lambda mine: gathered)
    fields = tracked_memory_fields(ranks[0])
    assert fields["memory_peak_rank"] == 1
    assert fields["memory_peak_phase"] == "backward"
    assert fields["memory_breakdown"] == {c: v / GIB for c, v in ranks[1].peak_breakdown.items()}
    assert fields["memory_category_peaks"] == {  # each category's maximum over ranks
        **dict.fromkeys(CATEGORIES, 0.0),
        "parameters": 2.0,
        "unsharded_parameters": 5.0,
        "activations": 2.0,
        "gradients": 3.0,
    }
    assert ranks[0].reset  # the next record starts a new peak
    monkeypatch.setattr(dist_, "all_gather_objects", lambda mine: [mine])  # one process: no rank field
    assert "memory_peak_rank" not in tracked_memory_fields(ranks[2])
