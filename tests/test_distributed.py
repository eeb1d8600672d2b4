"""Sharded training through the real CLI under torchrun on CPU (gloo): 2 ranks with batch_size B train exactly
what one process with batch_size 2B does (losses, gradient norms, validation losses, final weights)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit.cli import main
from memfit.config import load_config
from memfit.errors import ConfigError
from memfit.metrics import read_records

from .conftest import tiny_run_overrides

TOL = 1e-5  # fp32; 2 ranks sum their gradients in another order than one process's batched matmuls
RUN = dict(max_steps=4, eval_every=2, checkpoint_every=2, optimizer__warmup_steps=2, sample__max_new_tokens=8)


def _overrides(corpus: Path, out: Path, **extra) -> list[str]:
    extra = {k.replace("__", "."): v for k, v in {**RUN, **extra}.items()}
    return tiny_run_overrides(corpus, out, **extra)


def _torchrun(args: list[str], nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc -m memfit ...`` with a timeout (a hang fails the test, not the suite)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(nproc), "-m", "memfit", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    # a session of its own, so that on a timeout the launcher and its workers all go
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s: {stdout[-2000:]}{stderr[-4000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _records(out: Path) -> tuple[list[dict], list[dict]]:
    records = read_records(out / "metrics.jsonl")
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def _assert_same_run(sharded: Path, single: Path) -> dict[str, float]:
    """Same steps, losses, gradient norms, validation losses and final weights; returns the largest differences."""
    train2, val2 = _records(sharded)
    train1, val1 = _records(single)
    assert [r["step"] for r in train2] == [r["step"] for r in train1] == list(range(1, RUN["max_steps"] + 1))
    assert [r["step"] for r in val2] == [r["step"] for r in val1]
    diffs = {
        "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(train2, train1, strict=True)),
        "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(train2, train1, strict=True)),
        "val_loss": max(abs(a["val_loss"] - b["val_loss"]) for a, b in zip(val2, val1, strict=True)),
    }
    w2 = load_file(sharded / "checkpoints" / "step_00000004" / "model.safetensors")
    w1 = load_file(single / "checkpoints" / "step_00000004" / "model.safetensors")
    assert w2.keys() == w1.keys()
    diffs["weights"] = max((w2[k] - w1[k]).abs().max().item() for k in w1)
    print(f"max |2 ranks - 1 process|: {diffs}")
    assert all(d <= TOL for d in diffs.values()), diffs
    for r in train2:
        assert r["tokens_per_second_per_gpu"] > 0 and 0 < r["peak_memory_rss"] < 8
    return diffs


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, small_corpus) -> dict[str, Path]:
    """One-process references with batch_size 8 (= 2 ranks x 4): plain, and optimizer in backward."""
    root = tmp_path_factory.mktemp("single")
    runs = {
        "plain": {},
        "in_backward": {"optimizer_in_backward": "true", "max_grad_norm": 0},
    }
    for name, extra in runs.items():
        assert main(["pretrain", *_overrides(small_corpus, root / name, batch_size=8, **extra)]) == 0
    return {name: root / name for name in runs}


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_two_ranks_train_what_one_process_does(strategy, single_runs, small_corpus, tmp_path):
    out = tmp_path / strategy
    proc = _torchrun(
        ["pretrain", *_overrides(small_corpus, out, batch_size=4, **{"distributed.strategy": strategy})]
    )
    _assert_same_run(out, single_runs["plain"])
    assert proc.stdout.count("final validation loss") == 1  # rank 0 alone reports
    assert proc.stdout.count("step 1 |") == 1
    # the gathered checkpoint is an ordinary one: one process samples from it
    assert main(["generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "8"]) == 0


def test_two_ranks_with_optimizer_in_backward(single_runs, small_corpus, tmp_path):
    out = tmp_path / "oib"
    extra = {"optimizer_in_backward": "true", "max_grad_norm": 0, "distributed.strategy": "fsdp2"}
    _torchrun(["pretrain", *_overrides(small_corpus, out, batch_size=4, **extra)])
    _assert_same_run(out, single_runs["in_backward"])
    saved = torch.load(out / "checkpoints" / "step_00000004" / "optimizer.pt", weights_only=True)
    reference = torch.load(
        single_runs["in_backward"] / "checkpoints" / "step_00000004" / "optimizer.pt", weights_only=True
    )
    assert saved["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        torch.testing.assert_close(saved["state"][i]["exp_avg"], state["exp_avg"], atol=TOL, rtol=0)


def _sharded_config(monkeypatch, *overrides: str):
    monkeypatch.setenv("WORLD_SIZE", "2")
    return load_config(None, list(overrides))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["distributed.strategy=zero3"], "distributed.strategy"),
        (["distributed.prefetch=-1"], "distributed.prefetch"),
        (["distributed.limit_all_gathers=false"], "distributed.limit_all_gathers"),
        (["distributed.cpu_offload=true", "device=cpu"], "distributed.cpu_offload"),
        (
            ["distributed.strategy=fsdp1", "optimizer_in_backward=true", "max_grad_norm=0"],
            "optimizer_in_backward",
        ),
        (["chunked_cross_entropy=4"], "chunked_cross_entropy"),
        (["track_memory=true"], "track_memory"),
    ],
)
def test_sharded_combinations_that_cannot_work_are_rejected(monkeypatch, overrides, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        _sharded_config(monkeypatch, *overrides)


def test_sharded_switches_accepted(monkeypatch):
    cfg = _sharded_config(
        monkeypatch,
        "distributed.strategy=fsdp1",
        "distributed.reshard_after_forward=false",
        "distributed.prefetch=2",
    )
    assert cfg.distributed.strategy == "fsdp1" and not cfg.distributed.reshard_after_forward
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert load_config(None, ["chunked_cross_entropy=4"]).chunked_cross_entropy == 4  # one process: no limit
