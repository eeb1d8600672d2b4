"""Shared fixtures: a small real corpus, the overrides of a tiny, fast pretraining run, and a small pretrained
Hugging Face checkpoint with the overrides of a fine-tuning run on the real Dolly sample."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from memfit.cli import main
from memfit.data.sources import default_corpus_path

ASSETS = Path(__file__).parent / "assets"
CHAT_TEMPLATE = ASSETS / "chat_templates" / "smollm2_instruct.jinja"
"""A checkpoint's own chat template (SmolLM2-Instruct's), for :func:`chat_checkpoint`."""
DOLLY = ASSETS / "dolly_sample.json"

# Tests never download: make any attempt fail loudly instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """The first 60,000 characters of Tiny Shakespeare (real text, quick to tokenize)."""
    path = tmp_path_factory.mktemp("corpus") / "shakespeare_60k.txt"
    path.write_text(default_corpus_path().read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    return path


def tiny_run_overrides(corpus: Path, output_dir: Path, **extra) -> list[str]:
    """``key=value`` overrides for a tiny char-level run that takes a second or two on 2 CPU cores."""
    base = {
        "model": "tiny",
        "tokenizer.kind": "char",
        # the update rule the switch-parity and accounting tests were written for (left out, a run from scratch
        # gets Muon, whose bf16 Newton-Schulz moves the last bits): Muon's own tests name it, and
        # tests/test_switch_parity.py holds the switches' parity under Muon too
        "optimizer.name": "adamw",
        "data.path": str(corpus),
        "output_dir": str(output_dir),
        "seq_len": 32,
        "batch_size": 4,
        "max_steps": 12,
        "log_every": 1,
        # a run does only what its test checks: periodic evaluation, checkpoints, the sample and the loss plot are
        # asked for by the tests that assert them (the final evaluation and checkpoint always happen)
        "eval_every": 0,
        "eval_batches": 2,
        "checkpoint_every": 0,
        "keep_last_checkpoints": 10,
        "optimizer.warmup_steps": 3,
        "sample.max_new_tokens": 0,
        "loss_plot": False,
        "tensorboard": False,
        "progress_bar": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on one thread: quick, and timings not at the mercy of a second busy core. Use it in a module with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, small_corpus) -> Path:
    """A small pretrained checkpoint in Hugging Face form: the tiny GQA Llama pretrained by memfit for 80 steps on
    Shakespeare (byte-level BPE, 512 ids), then written by ``memfit export`` (config.json, model.safetensors,
    tokenizer.json). That it is a valid transformers checkpoint is checked below and in tests/test_convert.py."""
    root = tmp_path_factory.mktemp("base")
    overrides = {
        "model": "tiny",
        "model_args.vocab_size": 512,
        "model_args.max_seq_len": 1024,
        "tokenizer.vocab_size": 512,
        "data.path": str(small_corpus),
        "output_dir": str(root / "pretrain"),
        "seq_len": 128,
        "batch_size": 8,
        "max_steps": 80,
        "optimizer.name": "adamw",  # the base the fine-tuning tests' tolerances and falls were measured on
        "optimizer.lr": 1e-2,
        "optimizer.min_lr": 1e-3,
        "optimizer.warmup_steps": 5,
        "eval_every": 0,
        "eval_batches": 1,
        "checkpoint_every": 0,
        "sample.max_new_tokens": 0,
        "loss_plot": False,
        "tensorboard": False,
        "progress_bar": False,
    }
    assert main(["pretrain", *[f"{k}={v}" for k, v in overrides.items()]]) == 0
    assert main(["export", "--checkpoint", str(root / "pretrain"), "--out", str(root / "hf")]) == 0
    return root / "hf"


@pytest.fixture(scope="session")
def chat_checkpoint(hf_checkpoint, tmp_path_factory) -> Path:
    """The tiny HF checkpoint with a chat template (chat_template.jinja) beside its tokenizer."""
    d = tmp_path_factory.mktemp("chat") / "hf"
    shutil.copytree(hf_checkpoint, d)
    shutil.copyfile(CHAT_TEMPLATE, d / "chat_template.jinja")
    return d


def finetune_overrides(checkpoint: Path, out: Path, **extra) -> list[str]:
    base = {
        "checkpoint_dir": str(checkpoint),
        "data.path": str(DOLLY),
        "data.format": "dolly",
        "data.template": "alpaca",
        "output_dir": str(out),
        "seq_len": 1024,
        "batch_size": 10,  # the 10 training samples (12 records, 1 held out, 1 left with no reply): full batches
        "max_steps": 12,
        "log_every": 1,
        "eval_every": 0,  # as tiny_run_overrides: asked for by the tests that check them
        "eval_batches": 2,
        "checkpoint_every": 0,
        "keep_last_checkpoints": 5,
        "optimizer.lr": 1e-2,
        "optimizer.min_lr": 1e-3,
        "optimizer.warmup_steps": 2,
        "sample.prompt": "What is a llama?",
        "sample.max_new_tokens": 0,
        "loss_plot": False,
        "tensorboard": False,
        "progress_bar": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def start_python(args: list[str], *, module: str = "memfit", code: str | None = None) -> subprocess.Popen:
    """``python -m module args`` (or ``python -c code args``) in a session of its own, on one thread, stdout and
    stderr captured together."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    head = ["-m", module] if code is None else ["-c", code]
    return subprocess.Popen(
        [sys.executable, *head, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def rank_of(process: psutil.Process) -> str | None:
    """The ``RANK`` torchrun gave ``process`` (None: not a worker, or gone)."""
    try:
        return process.environ().get("RANK")
    except psutil.Error:
        return None


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (not gone, not zombies)."""

    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # gone
            return False

    return [p for p in processes if running(p)]


def kill_launch(proc: subprocess.Popen, known: list[psutil.Process]) -> str:
    """SIGKILL a launch: memfit's session, and every process below it or in ``known``. torchrun starts each worker
    in a session of its own, so killing memfit's session alone would leave the workers running (and holding the
    output pipe open). Returns the output so far."""
    try:
        known = [*known, *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in known:
        with contextlib.suppress(psutil.Error):
            p.kill()
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        return "(no output: the pipe is still held open)"


def finish_launch(proc: subprocess.Popen, timeout: float, known: list[psutil.Process] = ()) -> str:
    """Wait for ``proc`` at most ``timeout`` seconds; past it, kill the whole launch and fail the test."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        output = kill_launch(proc, list(known))
        pytest.fail(f"the launch did not exit within {timeout} s:\n{output[-6000:]}")


def run_torchrun(
    args: list[str], nproc: int = 2, timeout: float = 120, script: Path | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nproc -m memfit ...`` (or ``... script ...``) with a timeout (a hang fails the
    test, not the suite)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    program = ["-m", "memfit"] if script is None else [str(script)]
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", str(nproc), *program, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = kill_launch(proc, [])  # torchrun's workers too: each runs in a session of its own
        pytest.fail(f"torchrun did not finish in {timeout} s: {output[-4000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
