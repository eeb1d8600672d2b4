"""Shared fixtures: a small real corpus and the overrides of a tiny, fast pretraining run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from memfit.data.corpus import default_corpus_path

ASSETS = Path(__file__).parent / "assets"

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
        "data.path": str(corpus),
        "output_dir": str(output_dir),
        "seq_len": 32,
        "batch_size": 4,
        "max_steps": 12,
        "log_every": 1,
        "eval_every": 4,
        "eval_batches": 2,
        "checkpoint_every": 4,
        "keep_last_checkpoints": 10,
        "optimizer.warmup_steps": 3,
        "sample.max_new_tokens": 16,
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
