"""``memfit pretrain nproc=N``: the CLI starts torchrun itself. 2 ranks through the shortcut train what one process
with twice the batch does; a rank that dies ends the whole launch at once with torchrun's report naming it; SIGTERM
stops the launch and its workers, and so does a SIGKILL of the launcher (the workers see it is gone); bad ``nproc``
values are configuration errors, reported before anything starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from memfit import checkpoint as ckpt_io
from memfit import launch, lifeline
from memfit.cli import main
from memfit.errors import ConfigError
from memfit.metrics import read_records

from .conftest import alive, finish_launch, kill_launch, rank_of, start_python, tiny_run_overrides

TOL = 1e-5  # as tests/test_distributed.py: fp32, 2 ranks reduce in another order than one process
FAIL_WITHIN_S = 60  # a launch whose rank died must have exited by then (gloo sees the closed socket at once)
# a run that is still training when the test acts on it (a few steps per second on 2 busy cores)
LONG_RUN = dict(max_steps=100_000, eval_every=0, checkpoint_every=0, sample__max_new_tokens=0)


def _overrides(corpus: Path, out: Path, **extra) -> list[str]:
    extra = {k.replace("__", "."): v for k, v in extra.items()}
    return tiny_run_overrides(corpus, out, **extra)


def _wait_until_training(proc: subprocess.Popen, out: Path, timeout: float = 120) -> list[psutil.Process]:
    """Wait until rank 0 has logged a step (with a timeout); returns the launch's processes (torchrun, workers)."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and read_records(metrics)):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the launch never started training:\n{kill_launch(proc, [])[-6000:]}")
        time.sleep(0.2)
    return psutil.Process(proc.pid).children(recursive=True)


@pytest.mark.slow
def test_nproc_shortcut_trains_what_one_process_does(small_corpus, tmp_path, capsys):
    run = dict(
        max_steps=4, eval_every=2, checkpoint_every=2, optimizer__warmup_steps=4, sample__max_new_tokens=0
    )
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    # nproc=1 runs in this process: no torchrun
    assert main(["pretrain", "nproc=1", *_overrides(small_corpus, single, batch_size=8, **run)]) == 0
    assert "torchrun" not in capsys.readouterr().out

    args = ["pretrain", *_overrides(small_corpus, sharded, batch_size=4, **run), "nproc=2"]
    proc = start_python(args)
    output = finish_launch(proc, timeout=180)
    assert proc.returncode == 0, output[-6000:]
    # one line tells the torchrun command it stands for, with the arguments less nproc
    launched = "memfit: running torchrun --standalone --nproc_per_node 2 -m memfit pretrain model=tiny "
    assert output.count(launched) == 1 and "nproc=" not in output.split(launched)[1].splitlines()[0]
    assert output.count("final validation loss") == 1  # rank 0 alone reports, and notes
    assert output.count("note: optimizer.warmup_steps (4) >= max_steps (4)") == 1
    assert "x 2 ranks (fsdp2)" in output

    records = {name: read_records(out / "metrics.jsonl") for name, out in [("1", single), ("2", sharded)]}
    for key in ("loss", "grad_norm", "val_loss"):
        one = [(r["step"], r[key]) for r in records["1"] if key in r]
        two = [(r["step"], r[key]) for r in records["2"] if key in r]
        assert [s for s, _ in two] == [s for s, _ in one] and one
        diff = max(abs(a - b) for (_, a), (_, b) in zip(one, two, strict=True))
        print(f"max |nproc=2 x batch 4 - 1 process x batch 8| {key}: {diff:.2e}")
        assert diff <= TOL
    assert (sharded / "checkpoints" / "step_00000004" / "dcp" / ".metadata").is_file()


@pytest.mark.slow
def test_a_killed_rank_ends_the_launch_with_a_report(small_corpus, tmp_path):
    out = tmp_path / "run"
    proc = start_python(["pretrain", "nproc=2", *_overrides(small_corpus, out, **LONG_RUN)])
    processes = _wait_until_training(proc, out)
    rank1 = [p for p in processes if rank_of(p) == "1"]
    assert len(rank1) == 1, [(p.pid, p.cmdline()) for p in processes]
    rank1[0].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    output = finish_launch(proc, timeout=FAIL_WITHIN_S, known=processes)
    print(f"the launch exited {time.monotonic() - killed_at:.1f} s after rank 1 was killed")
    assert proc.returncode == 1, output[-6000:]
    # torchrun's report names the rank that failed first and how; memfit's last line points at it
    root_cause = output.split("Root Cause")[-1]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root_cause), output[-6000:]
    assert "SIGKILL" in root_cause
    assert "memfit: error: a rank failed, so the run stopped:" in output
    assert not alive(processes)  # no worker left behind


# workers whose launcher died get SIGTERM at once and exit in 1-10 s (on 2 busy cores a worker's interpreter alone
# takes 5-9 s to shut down); lifeline.GRACE_S after it, one that did not is killed
STOP_WITHIN_S = lifeline.GRACE_S + 15


def _partial(checkpoints: Path) -> list[str]:
    """The hidden directories of checkpoints being written (or deleted) in ``checkpoints``."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(p.name for p in checkpoints.iterdir() if p.name.startswith((".tmp-", ".old-")))
    return []


@pytest.mark.slow
def test_workers_stop_when_their_launcher_is_killed(small_corpus, tmp_path):
    """SIGKILL of memfit nproc=2 and its process group (torchrun's agent alone: each worker has a session of its
    own) while a checkpoint is being written: each worker is told by the kernel (SIGTERM), completes the checkpoint
    and exits; nothing half-written is left and the newest checkpoint loads. Before, the workers trained on (issue
    22, item 9)."""
    out, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run = {**LONG_RUN, "checkpoint_every": 1}
    proc = start_python(["pretrain", "nproc=2", *_overrides(small_corpus, out, **run)])
    workers = [p for p in _wait_until_training(proc, out) if rank_of(p) in ("0", "1")]
    try:
        assert len(workers) == 2, workers
        deadline = time.monotonic() + 60
        # one checkpoint is complete and the next under way
        while not (ckpt_io.list_checkpoints(out) and _partial(checkpoints)):
            if time.monotonic() > deadline:
                pytest.fail(f"no second checkpoint was started: {sorted(os.listdir(checkpoints))}")
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        writing = _partial(checkpoints)
        while alive(workers) and time.monotonic() - killed_at < STOP_WITHIN_S:
            time.sleep(0.05)
        survivors = alive(workers)
        completed = [w for w in writing if (checkpoints / w.split("-")[1]).is_dir()]
        print(
            f"workers gone {time.monotonic() - killed_at:.1f} s after the kill; being written then: {writing}, "
            f"of which completed: {completed}"
        )
    finally:
        output = kill_launch(proc, workers)  # survivors too (they would train on)
    assert not survivors, (
        f"{len(survivors)} workers still ran {STOP_WITHIN_S} s after their launcher was killed"
    )
    assert output.count("its launcher (pid ") == 2 and "memfit: stopped by SIGTERM" in output, output[-6000:]
    assert not _partial(checkpoints), output[-6000:]  # nothing half-written is left
    newest = ckpt_io.list_checkpoints(out)[-1]
    assert ckpt_io.read_trainer_state(newest)["step"] == int(newest.name.removeprefix("step_"))
    assert ckpt_io.read_sharded_weights(newest)  # every shard there: it consolidates


WORKER = """
import os, pathlib, sys, time
pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_memfit_stops_torchrun_and_its_workers(sig, tmp_path):
    """SIGTERM or SIGINT sent to memfit (torchrun's agent) stops every worker; memfit exits with 128 + signal.

    The workers are tiny scripts (not memfit) so that the launch starts in seconds; memfit.launch is what runs them.
    """
    (tmp_path / "worker.py").write_text(WORKER)
    started = tmp_path / "started"
    started.mkdir()
    args = ["--standalone", "--nproc_per_node", "2", str(tmp_path / "worker.py"), str(started)]
    code = "import sys; from memfit.launch import run_torchrun; sys.exit(run_torchrun(sys.argv[1:]))"
    proc = start_python(args, code=code)
    deadline = time.monotonic() + 120
    while len(list(started.iterdir())) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the workers never started:\n{kill_launch(proc, [])[-6000:]}")
        time.sleep(0.1)
    workers = [psutil.Process(int(f.read_text())) for f in started.iterdir()]
    proc.send_signal(sig)
    output = finish_launch(proc, timeout=FAIL_WITHIN_S, known=workers)
    assert proc.returncode == 128 + sig, output[-6000:]
    assert output.startswith("memfit: running torchrun --standalone --nproc_per_node 2 ")
    assert f"Received {int(sig)} death signal, shutting down workers" in output  # memfit is torchrun's agent
    assert ("memfit: stopped by SIGTERM" in output) == (sig == signal.SIGTERM)  # on SIGINT rank 0 says so
    assert not alive(workers)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_bad_nproc_is_a_config_error(value, small_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["pretrain", f"nproc={value}", *_overrides(small_corpus, out)]) == 2
    captured = capsys.readouterr()
    assert "config key 'nproc'" in captured.err and "integer >= 1" in captured.err
    assert "torchrun" not in captured.out and not out.exists()


def test_nproc_must_agree_with_the_launcher(monkeypatch, small_corpus, tmp_path, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun --nproc_per_node 2
    out = tmp_path / "run"
    assert main(["pretrain", "nproc=4", *_overrides(small_corpus, out)]) == 2
    err = capsys.readouterr().err
    assert "config key 'nproc'" in err and "WORLD_SIZE=2" in err and not out.exists()


def test_sharded_only_checks_fail_before_any_worker_starts(small_corpus, tmp_path, capsys):
    """A combination that only sharded runs refuse is refused by the launching process, as each rank would."""
    out = tmp_path / "run"
    over = _overrides(small_corpus, out, **{"distributed.cpu_offload": "true", "device": "cpu"})
    assert main(["pretrain", "nproc=2", *over]) == 2
    captured = capsys.readouterr()
    assert "config key 'distributed.cpu_offload'" in captured.err
    assert "torchrun" not in captured.out and not out.exists()
    assert "WORLD_SIZE" not in os.environ  # validation takes the world size as an argument: nothing is set


def test_worker_threads_split_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    for nproc, device, threads in [(3, "cpu", "2"), (16, "cpu", "1"), (2, "cuda", None)]:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        launch.set_worker_threads(nproc, device)
        assert os.environ.get("OMP_NUM_THREADS") == threads  # CUDA: torchrun's default
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    launch.set_worker_threads(3, "cpu")
    assert os.environ["OMP_NUM_THREADS"] == "5"  # the user's choice stands


def test_torchrun_arguments_keep_the_config_and_overrides():
    args = launch.torchrun_args(3, "finetune", "my config.yaml", ["checkpoint_dir=base", "sample.prompt=a b"])
    assert args == [
        "--standalone",
        "--nproc_per_node",
        "3",
        "-m",
        "memfit",
        "finetune",
        "--config",
        "my config.yaml",
        "checkpoint_dir=base",
        "sample.prompt=a b",
    ]


def test_nproc_beyond_the_cuda_devices_is_refused(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    launch.check_nproc(1, "cuda")
    with pytest.raises(
        ConfigError, match="config key 'nproc': 2 ranks need one CUDA device each, but torch sees 1"
    ):
        launch.check_nproc(2, "cuda")
    launch.check_nproc(2, "cpu")  # CPU ranks share the cores


def test_a_worker_whose_launcher_died_says_so_once(monkeypatch, capsys):
    """The stop path and the watch thread both report a dead launcher; the worker prints one line (before, a worker
    that the kernel's SIGTERM ended before the thread's next poll printed none: the CI flake of stop 42)."""
    import threading

    monkeypatch.setattr(lifeline, "_told", threading.Lock())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(lifeline, "_parent", None)  # not armed: nothing to report
    assert lifeline.report_launcher_gone() is False
    monkeypatch.setattr(lifeline, "_parent", os.getppid())  # the parent is still there
    assert lifeline.report_launcher_gone() is False
    monkeypatch.setattr(lifeline, "_parent", os.getppid() + 100_000)  # re-parented: the launcher died
    assert lifeline.report_launcher_gone() is True and lifeline.report_launcher_gone() is True
    err = capsys.readouterr().err
    assert err.count("memfit: rank 1: its launcher (pid ") == 1, err
