"""Pre-flight: a run that will not fit is refused before anything is allocated, with the predicted breakdown."""

from __future__ import annotations

import collections

import psutil
import pytest

from memfit.cli import main
from memfit.config import load_config
from memfit.metrics import read_records
from memfit.planner.estimate import estimate_run
from memfit.units import GIB, format_bytes

from .conftest import tiny_run_overrides

VirtualMemory = collections.namedtuple("VirtualMemory", "available")
RUN = {"batch_size": 16, "seq_len": 128, "max_steps": 2, "eval_every": 0, "checkpoint_every": 0}


def _available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VirtualMemory(nbytes))


def test_a_run_that_will_not_fit_is_refused_with_its_breakdown(monkeypatch, small_corpus, tmp_path, capsys):
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    predicted = estimate_run(load_config(None, overrides))
    _available(monkeypatch, predicted.peak_bytes - 1)  # one byte short
    assert main(["pretrain", *overrides]) == 1
    err = capsys.readouterr().err
    assert f"it needs {predicted.peak_bytes / GIB:.2f} GiB at its peak" in err
    assert f"in {predicted.phase}" in err and "activations" in err and "preflight=false" in err
    assert (
        "Cheapest fix (memfit plan): " in err
    )  # e.g. activation_checkpointing=full, which fits one byte less
    assert (
        not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    )


def test_a_run_that_fits_starts_after_the_trace(monkeypatch, small_corpus, tmp_path, capsys):
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    predicted = estimate_run(load_config(None, overrides))
    _available(monkeypatch, predicted.peak_bytes + 1)  # fits, but not by the cheap bound: the trace decides
    assert main(["pretrain", *overrides]) == 0
    assert f"pre-flight: predicted peak {format_bytes(predicted.peak_bytes)} of" in capsys.readouterr().out
    assert [r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2]


@pytest.mark.parametrize("preflight", ["true", "false"])
def test_the_switch_and_the_cheap_bound(monkeypatch, small_corpus, tmp_path, capsys, preflight):
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", preflight=preflight, **RUN)
    if preflight == "false":
        _available(monkeypatch, 1)  # would be refused; the switch turns the check off
    assert main(["pretrain", *overrides]) == 0
    out = capsys.readouterr().out
    assert ("pre-flight: fits (bound" in out) == (preflight == "true")  # plenty of RAM: no trace needed
