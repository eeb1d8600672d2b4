"""Runs that meet trouble lose nothing finite: two runs on one output_dir, a diverging run, SIGTERM, and SIGKILL at
random moments inside checkpoint saves (each resume exact)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit import checkpoint as ckpt_io
from memfit import runlock
from memfit.cli import main
from memfit.config import config_to_dict, load_config
from memfit.distributed import all_finite
from memfit.errors import RunLockedError
from memfit.metrics import read_records
from memfit.resume import resume_notes
from tests.conftest import tiny_run_overrides


def _numbers(out: Path) -> list:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_records(out / "metrics.jsonl")]


def _memfit(*args: str) -> list[str]:
    return [sys.executable, "-m", "memfit", *args]


# --- one run per output_dir ---------------------------------------------------------------------------------------


def test_a_lock_is_held_once_and_names_its_holder(tmp_path):
    out = tmp_path / "a" / "run"
    lock = runlock.acquire(out)
    assert lock.note is None and out.is_dir()
    with pytest.raises(RunLockedError) as info:
        runlock.acquire(out)
    message = str(info.value)
    assert message.startswith(f"output_dir '{out}' is in use by another run: pid {os.getpid()} on host ")
    assert message.endswith(
        "wait for it to finish, stop it, or choose another output_dir (nothing was changed)"
    )
    lock.release()
    assert not (tmp_path / "a").exists()  # the lock made both directories, and they stayed empty
    runlock.acquire(out).release()


@pytest.mark.slow
def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    tmp_path.joinpath(runlock.LOCK_NAME).write_text(
        json.dumps({"pid": pid, "host": "h1", "started": 0, "command": "memfit pretrain"})
    )
    (tmp_path / "keep.txt").write_text("x")
    lock = runlock.acquire(tmp_path)
    assert lock.note.startswith(
        f"note: took over the lock of output_dir '{tmp_path}' left by pid {pid} on host h1"
    )
    assert lock.note.endswith("which is no longer running")
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.mark.slow
def test_a_second_run_on_a_running_run_s_output_dir_is_refused(small_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    over = tiny_run_overrides(small_corpus, out, max_steps=150, checkpoint_every=50, eval_every=0)
    first = subprocess.Popen(
        _memfit("pretrain", *over), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.02)
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, seed=7)]) == 1
    err = capsys.readouterr().err
    assert f"output_dir '{out}' is in use by another run: pid {first.pid} on host" in err
    assert first.wait(timeout=300) == 0  # the first run is untouched: all its records and checkpoints
    assert [r["step"] for r in read_records(out / "metrics.jsonl") if "loss" in r] == list(range(1, 151))
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == [
        "step_00000050",
        "step_00000100",
        "step_00000150",
    ]
    assert not (out / runlock.LOCK_NAME).exists()


@pytest.mark.slow
def test_every_rank_refuses_a_locked_output_dir(small_corpus, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with runlock.acquire(out):
        argv = _memfit("pretrain", "nproc=2", *tiny_run_overrides(small_corpus, out))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1
    assert (
        proc.stderr.count(f"memfit: error: output_dir '{out}' is in use by another run: pid {os.getpid()}")
        == 1
    )
    assert not ckpt_io.list_checkpoints(out) and not (out / "metrics.jsonl").exists()


# --- divergence ---------------------------------------------------------------------------------------------------


def test_a_diverging_run_stops_and_keeps_its_finite_checkpoint(small_corpus, tmp_path, capsys):
    out = tmp_path / "diverge"
    over = {"optimizer.lr": 3000, "optimizer.warmup_steps": 10, "max_grad_norm": 0, "max_steps": 30,
            "log_every": 5, "checkpoint_every": 4, "keep_last_checkpoints": 1, "eval_every": 0}  # fmt: skip
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **over)]) == 1
    err = capsys.readouterr().err
    # found at the step-8 checkpoint (no host sync in the steps), named by its first non-finite step
    assert err.strip().splitlines()[-1] == (
        "memfit: error: training diverged at step 8: loss nan, grad_norm nan (on_nonfinite=stop). "
        f"Nothing non-finite was saved: the newest complete checkpoint '{out}/checkpoints/step_00000004' is kept "
        "(resume=true continues from it). Lower optimizer.lr (now 3000), raise optimizer.warmup_steps or set "
        "max_grad_norm, then resume=true; on_nonfinite=skip skips such steps"
    )
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_00000004"]
    weights = load_file(out / "checkpoints" / "step_00000004" / "model.safetensors")
    assert all_finite(weights.values())
    assert not (out / "loss.png").exists()  # the run ended there: no sample, no traceback


def _poison_steps(monkeypatch, steps: set[int]) -> None:
    """Make the training loss (and so every gradient) NaN at the given steps (1-based; evaluation untouched)."""
    from memfit import step as step_module

    real = step_module.micro_batch_loss
    count = {"n": 0}

    def loss(*args, **kwargs):
        value = real(*args, **kwargs)
        if torch.is_grad_enabled():
            count["n"] += 1
            if count["n"] in steps:
                return value * float("nan")
        return value

    monkeypatch.setattr(step_module, "micro_batch_loss", loss)


def test_skip_leaves_a_non_finite_step_unapplied(small_corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "skip"
    _poison_steps(monkeypatch, {3, 4})
    over = {"on_nonfinite": "skip", "checkpoint_every": 2, "max_steps": 8, "eval_every": 0}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **over)]) == 0
    text = capsys.readouterr().out
    assert "step 3 | loss nan | grad_norm nan | not finite: update skipped (1 in a row; " in text
    assert "step 4 | loss nan | grad_norm nan | not finite: update skipped (2 in a row; " in text
    ckpts = out / "checkpoints"
    before, after = (load_file(ckpts / s / "model.safetensors") for s in ("step_00000002", "step_00000004"))
    assert all(torch.equal(before[k], after[k]) for k in before)  # steps 3 and 4 changed nothing
    final = load_file(ckpts / "step_00000008" / "model.safetensors")
    assert all_finite(final.values()) and not all(torch.equal(after[k], final[k]) for k in after)


def test_skip_stops_after_max_nonfinite_steps_in_a_row(small_corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "skip3"
    _poison_steps(monkeypatch, {3, 4, 5})
    over = {"on_nonfinite": "skip", "max_nonfinite_steps": 3, "checkpoint_every": 2, "eval_every": 0}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **over)]) == 1
    err = capsys.readouterr().err
    assert (
        "training diverged at step 5: loss nan, grad_norm nan (3 steps in a row (max_nonfinite_steps))" in err
    )
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_00000002", "step_00000004"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=.inf", "config key 'optimizer.lr' must be a finite number, got inf"),
        ("max_grad_norm=-.inf", "config key 'max_grad_norm' must be a finite number, got -inf"),
        ("on_nonfinite=ignore", "config key 'on_nonfinite': 'ignore' is not one of stop, skip"),
    ],
)
def test_non_finite_settings_are_refused(small_corpus, tmp_path, capsys, override, message):
    assert main(["pretrain", *tiny_run_overrides(small_corpus, tmp_path / "x"), override]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_skip_is_refused_with_the_optimizer_in_backward(small_corpus, tmp_path, capsys):
    over = {"on_nonfinite": "skip", "optimizer_in_backward": "true", "max_grad_norm": 0}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, tmp_path / "x", **over)]) == 2
    assert (
        "config key 'on_nonfinite': skip cannot be combined with optimizer_in_backward"
        in capsys.readouterr().err
    )


# --- signals and kills ----------------------------------------------------------------------------------------------

KILL_RUN = {
    "max_steps": 60,
    "checkpoint_every": 3,
    "eval_every": 20,
    "log_every": 1,
    "keep_last_checkpoints": 3,
}


@pytest.fixture(scope="module")
def kill_reference(tmp_path_factory, small_corpus) -> Path:
    out = tmp_path_factory.mktemp("ref") / "out"
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **KILL_RUN)]) == 0
    return out


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_and_resume_is_exact(kill_reference, small_corpus, tmp_path):
    out = tmp_path / "term"
    proc = subprocess.Popen(
        _memfit("pretrain", *tiny_run_overrides(small_corpus, out, **KILL_RUN)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoints" / "step_00000006").exists():
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == (
        "memfit: stopped by SIGTERM; the newest complete checkpoint is kept (resume=true continues)"
    )
    assert "Traceback" not in err and not (out / runlock.LOCK_NAME).exists()
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, resume="true", **KILL_RUN)]) == 0
    assert _numbers(out) == _numbers(kill_reference)


KILL_TRIALS = 8


@pytest.mark.slow
def test_sigkill_inside_checkpoint_saves_then_resume_is_exact(kill_reference, small_corpus, tmp_path):
    """``KILL_TRIALS`` SIGKILLs, each at a random moment after the start of a randomly chosen one (1st-3rd) of the
    process's checkpoint saves (its ``.tmp-`` directory exists), each followed by a resume from whatever is left;
    the last resume finishes the run, whose numbers must be the uninterrupted run's. A save takes a few ms, so
    some kills land inside it and some just after it: both must be harmless."""
    out = tmp_path / "killed"
    rng = random.Random(0)
    inside, resumed_from = 0, []
    seen: set[str] = set()
    for trial in range(KILL_TRIALS):
        latest = ckpt_io.latest_checkpoint(out)
        resumed_from.append(latest.name if latest else None)
        over = tiny_run_overrides(small_corpus, out, resume="true", **KILL_RUN)
        proc = subprocess.Popen(
            _memfit("pretrain", *over), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        root, target, tmp = out / "checkpoints", rng.randint(1, 3), None
        deadline = time.time() + 120
        while target and time.time() < deadline and proc.poll() is None:
            fresh = [p for p in root.iterdir() if p.name.startswith(".tmp-")] if root.is_dir() else []
            for p in fresh:
                if p.name not in seen:
                    seen.add(p.name)
                    tmp, target = p, target - 1
            if target:
                time.sleep(0.0005)
        assert target == 0, f"trial {trial}: the run ended or stalled before its save to kill"
        time.sleep(rng.uniform(0, 0.02))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        inside += tmp.exists()  # the save was cut short: its directory is left, and ignored by the resume
        for ckpt in ckpt_io.list_checkpoints(out):  # every checkpoint in place is complete
            ckpt_io.check_files(ckpt, ckpt_io.read_trainer_state(ckpt), need_optimizer=True)
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, resume="true", **KILL_RUN)]) == 0
    assert _numbers(out) == _numbers(kill_reference)
    print(f"{KILL_TRIALS} kills, {inside} inside a save; resumed from {resumed_from}")
    assert (
        inside >= 1 and len({r for r in resumed_from if r}) >= 2
    )  # kills inside saves, resumes from several


def test_resume_names_what_changed(kill_reference, small_corpus, tmp_path, capsys):
    import shutil

    out = tmp_path / "changed"
    shutil.copytree(kill_reference, out)
    over = {
        **KILL_RUN,
        "max_steps": 63,
        "optimizer.lr": 0.001,
        "batch_size": 4,
        "gradient_accumulation_steps": 2,
    }
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, resume="true", **over)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: resuming")]
    assert lines == [
        # the checkpoint records its run's ranks: the note says what became of the global batch
        "note: resuming with gradient_accumulation_steps 1 -> 2 per rank on 1 rank: the global batch changes "
        "from 4 to 8 sequences a step",
        "note: resuming with max_steps=63; the checkpoint's run had max_steps=60",
        "note: resuming with optimizer.lr=0.001; the checkpoint's run had optimizer.lr=0.002",
    ]


def _state(world_size: int | None, **keys) -> dict:
    saved = config_to_dict(load_config(None, [f"{k}={v}" for k, v in keys.items()]))
    return {"config": saved, **({} if world_size is None else {"world_size": world_size})}


def test_a_resume_on_fewer_ranks_says_whether_the_global_batch_changed():
    now = load_config(None, ["batch_size=8"])
    # 4 per rank on 2 ranks -> 8 on 1: the same 8 sequences a step
    assert resume_notes(now, _state(2, batch_size=4), world_size=1) == [
        "note: resuming with batch_size 4 -> 8 per rank on 1 rank instead of 2: the global batch (8 sequences a "
        "step) is unchanged"
    ]
    # 4 per rank on 4 ranks -> 8 on 1: half the batch
    assert resume_notes(now, _state(4, batch_size=4), world_size=1) == [
        "note: resuming with batch_size 4 -> 8 per rank on 1 rank instead of 4: the global batch changes from 16 "
        "to 8 sequences a step"
    ]
    # only the ranks changed
    assert resume_notes(now, _state(2, batch_size=8, max_steps=100), world_size=4) == [
        "note: resuming on 4 ranks instead of 2, with batch_size 8 x gradient_accumulation_steps 1 per rank: the "
        "global batch changes from 16 to 32 sequences a step",
        f"note: resuming with max_steps={now.max_steps}; the checkpoint's run had max_steps=100",
    ]
    assert resume_notes(now, _state(1, batch_size=8), world_size=1) == []
    # a checkpoint that does not record its ranks: each key on its own, as before
    assert resume_notes(now, _state(None, batch_size=4), world_size=1) == [
        "note: resuming with batch_size=8; the checkpoint's run had batch_size=4"
    ]


def test_a_resume_with_another_model_is_refused_before_the_pre_flight_and_the_build(
    kill_reference, small_corpus, tmp_path, capsys, monkeypatch
):
    import shutil

    from memfit import train

    out = tmp_path / "other_model"
    shutil.copytree(kill_reference, out)
    for name in ("preflight", "build_training", "run_data"):  # nothing is read, traced or allocated
        monkeypatch.setattr(train, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran"))
    over = {**KILL_RUN, "model_args.num_layers": 3}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, resume="true", **over)]) == 2
    assert capsys.readouterr().err == (
        f"memfit: config error: config key 'model_args.num_layers': the run in '{out}' was trained with a model "
        f"of num_layers=2, the config asks for num_layers=3; resume with the run's model and model_args, or "
        f"choose another output_dir for a new run (nothing was allocated or changed)\n"
    )
    over = {**KILL_RUN, "model_args.dim": 128, "model_args.intermediate_size": 256}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, resume="true", **over)]) == 2
    assert (
        "config key 'model_args': the run in '" in (err := capsys.readouterr().err)
        # head_dim follows dim where the config does not set it
        and "a model of dim=64, intermediate_size=128, head_dim=16, the config asks for dim=128, "
        "intermediate_size=256, head_dim=32;"
        in err
    )
    assert _numbers(out) == _numbers(kill_reference)  # the run is as it was
