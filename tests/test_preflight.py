"""Pre-flight: a run that will not fit is refused before anything is allocated, with the predicted breakdown."""

from __future__ import annotations

import collections
import json

import psutil
import pytest

from memfit import launch
from memfit.cli import main
from memfit.config import load_config
from memfit.memory import host
from memfit.metrics import read_records
from memfit.planner import estimate as estimate_module
from memfit.planner.estimate import estimate_run
from memfit.units import GIB, MIB, format_bytes

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


# ----------------------------------------------------------------------------------------------------------------
# memory_budget: a run predicted over it is refused as one over the free memory is


def _resident_set(monkeypatch, nbytes: int = 512 * MIB) -> None:
    """This process's resident set read as ``nbytes``: the peak RSS predicted (the trace's baseline, what the
    process holds besides its tensors) is then the same in the test and in the run it starts."""
    monkeypatch.setattr(estimate_module, "process_rss_bytes", lambda: nbytes)
    monkeypatch.setattr(host, "process_rss_bytes", lambda: nbytes)


@pytest.mark.parametrize("over", [True, False])
def test_a_run_predicted_over_memory_budget_is_refused_and_one_under_it_starts(
    monkeypatch, small_corpus, tmp_path, capsys, over
):
    _resident_set(monkeypatch)
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    predicted = estimate_run(
        load_config(None, overrides)
    ).host_peak_rss_bytes  # CPU: the peak RSS the budget bounds
    budget = predicted - 1 if over else predicted  # one byte short, or just enough
    assert main(["pretrain", *overrides, f"memory_budget={budget}B"]) == (1 if over else 0)
    out, err = capsys.readouterr()
    if over:
        assert err.startswith(
            f"memfit: error: the run is predicted not to fit memory_budget={budget}B: it needs "
            f"{predicted / GIB:.2f} GiB at its peak (the process's resident set), over the budget of "
            f"{budget / GIB:.2f} GiB.\nmodel tiny ("
        )
        assert f"host peak RSS of the run (CPU): {predicted / MIB:.2f} MiB" in err
        # the fix fits what the process's own resident set leaves of the budget
        assert "\nCheapest fix (memfit plan): chunked_cross_entropy=" in err
        assert err.endswith("\nRaise memory_budget, or set preflight=false to start anyway.\n")
        assert not (tmp_path / "run" / "checkpoints").exists()
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    else:
        assert "(traced in " in out and f", within memory_budget={budget}B)" in out
        assert [r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2]


@pytest.mark.parametrize("below", [0, 1, 64 * MIB, None])
def test_a_memory_budget_not_above_what_the_process_holds_is_refused_naming_memory_budget(
    monkeypatch, small_corpus, tmp_path, capsys, below
):
    """Issue 40, item 3: a budget at or under what the process holds before training (``below`` bytes under it;
    ``None``: 1 MiB) exits 1 before anything is allocated, naming memory_budget, what the process holds and the
    smallest budget the run fits; one byte over it is the ordinary refusal of a run over its budget."""
    _resident_set(monkeypatch)
    held = host.process_overhead_bytes(step_peak_bytes=0)  # before any tensor: the free heap's floor
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    need = estimate_run(load_config(None, overrides)).host_peak_rss_bytes
    budget = MIB if below is None else held - below
    setting = "1MiB" if below is None else f"{budget}B"
    assert main(["pretrain", *overrides, f"memory_budget={setting}"]) == 1
    assert capsys.readouterr().err == (
        f"memfit: error: memory_budget={setting} ({format_bytes(budget)}) is not more than what this process "
        f"holds before training: {format_bytes(held)} (its resident set and what stepping adds to it), so no "
        f"tensor of the run would fit in it.\nThe smallest budget this run fits as configured: "
        f"memory_budget={-(-need // MIB)}MiB ({format_bytes(need)} predicted at its peak; `memfit plan` finds "
        f"switches that need less).\nRaise memory_budget, or set preflight=false to start anyway.\n"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_budgets_around_what_the_process_holds(monkeypatch, small_corpus, tmp_path, capsys):
    """One byte over what the process holds: the run over its budget (the planner's fix for 1 byte: none);
    the smallest budget the refusal above names: the run starts."""
    _resident_set(monkeypatch)
    held = host.process_overhead_bytes(step_peak_bytes=0)  # before any tensor: the free heap's floor
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    need = estimate_run(load_config(None, overrides)).host_peak_rss_bytes
    assert main(["pretrain", *overrides, f"memory_budget={held + 1}B"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"memfit: error: the run is predicted not to fit memory_budget={held + 1}B: it needs "
    )
    assert "\nNo combination of memory switches fits; " in err and "config key" not in err
    assert main(["pretrain", *overrides, f"memory_budget={-(-need // MIB)}MiB"]) == 0
    assert [r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2]


def test_memory_budget_is_a_size_and_preflight_false_turns_its_check_off(small_corpus, tmp_path, capsys):
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    for value in ("40", "40G", "0GiB"):
        assert main(["pretrain", *overrides, f"memory_budget={value}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("memfit: config error: config key 'memory_budget': "), err
    assert main(["pretrain", *overrides, "budget=40GiB"]) == 2  # plan's key; the run's is memory_budget
    assert "unknown config key 'budget'; did you mean 'memory_budget'?" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert (
        main(["pretrain", *overrides, "memory_budget=1MiB", "preflight=false"]) == 0
    )  # preflight=false wins
    out = capsys.readouterr().out
    assert "note: preflight=false: memory_budget=1MiB is not checked" in out and "pre-flight" not in out


def test_memory_budget_with_a_cheap_bound_far_under_it_needs_no_trace(small_corpus, tmp_path, capsys):
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    assert main(["pretrain", *overrides, "memory_budget=64GiB"]) == 0
    assert "pre-flight: fits (bound " in capsys.readouterr().out  # well within the budget and the free memory


def test_plan_takes_memory_budget_as_its_budget(capsys):
    base = ["plan", "--json", "model=tiny", "tokenizer.kind=char", "batch_size=2", "seq_len=32", "device=cpu"]
    assert main([*base, "memory_budget=3GiB"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_gib"] == 3.0
    assert main([*base, "memory_budget=3GiB", "budget=2GiB"]) == 0  # the command's budget= wins
    assert json.loads(capsys.readouterr().out)["budget_gib"] == 2.0


@pytest.mark.slow
def test_a_sharded_run_s_memory_budget_is_checked_per_rank_before_torchrun_starts(
    monkeypatch, small_corpus, tmp_path, capsys
):
    _resident_set(monkeypatch)
    started = []
    monkeypatch.setattr(launch, "run_torchrun", lambda args: started.append(args) or 0)
    overrides = tiny_run_overrides(small_corpus, tmp_path / "run", **RUN)
    one_rank = estimate_run(load_config(None, overrides, world_size=2), world_size=2).host_peak_rss_bytes
    assert main(["pretrain", "nproc=2", *overrides, f"memory_budget={one_rank - 1}B"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"memfit: error: the run is predicted not to fit memory_budget={one_rank - 1}B: it needs "
        f"{one_rank / GIB:.2f} GiB at its peak per rank of 2 (the process's resident set), over the budget of "
        f"{(one_rank - 1) / GIB:.2f} GiB.\n"
    )
    assert "\nCheapest fix (memfit plan): " in err  # for 2 ranks
    assert started == [] and not (tmp_path / "run").exists()
    assert main(["pretrain", "nproc=2", *overrides, f"memory_budget={one_rank}B"]) == 0
    assert len(started) == 1
    assert (
        f"pre-flight: predicted peak {format_bytes(one_rank)} per rank, within memory_budget={one_rank}B (traced in "
        in capsys.readouterr().out
    )
