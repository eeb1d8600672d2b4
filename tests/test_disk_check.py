"""The checkpoints' disk space, checked before a run starts (memfit.planner.disk)."""

from __future__ import annotations

import collections

import pytest

from memfit.cli import main
from memfit.config import load_config
from memfit.models.presets import model_config
from memfit.planner import disk
from memfit.planner.disk import checkpoint_bytes, saves_of_run

from .conftest import tiny_run_overrides

# the tiny preset (its own 256 ids, whatever the tokenizer's): 2 layers of width 64, untied embeddings
TINY_PARAMS = 256 * 64 * 2 + 2 * (4 * 64 * 64 // 4 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
TINY_TENSORS = 2 + 2 * 9 + 1


def test_checkpoint_bytes_by_hand(small_corpus, tmp_path):
    """fp32 weights, AdamW's two fp32 moments and a 4-byte step per tensor."""
    cfg = load_config(None, tiny_run_overrides(small_corpus, tmp_path))
    mcfg = model_config("tiny")
    assert mcfg.num_params() == TINY_PARAMS == 106_816
    assert checkpoint_bytes(cfg, mcfg) == 4 * TINY_PARAMS + 2 * 4 * TINY_PARAMS + 4 * TINY_TENSORS


@pytest.mark.parametrize(
    ("max_steps", "every", "start", "saves"),
    [(12, 0, 0, 1), (12, 4, 0, 3), (12, 5, 0, 3), (12, 4, 4, 2), (12, 4, 5, 2), (12, 4, 12, 0), (3, 4, 0, 1)],
)
def test_saves_of_run(max_steps, every, start, saves, small_corpus, tmp_path):
    overrides = {"max_steps": max_steps, "checkpoint_every": every}
    cfg = load_config(None, tiny_run_overrides(small_corpus, tmp_path, **overrides))
    assert saves_of_run(cfg, start) == saves


def _disk_with(monkeypatch, free: int) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: usage(2 * free, free, free))


def test_a_run_whose_checkpoints_do_not_fit_the_disk_is_refused_before_it_starts(
    small_corpus, tmp_path, capsys, monkeypatch
):
    """Three saves (steps 4, 8, 12) with 2 kept: 3 checkpoints on disk while the third is written."""
    run = tiny_run_overrides(small_corpus, tmp_path / "run", checkpoint_every=4, keep_last_checkpoints=2)
    cfg = load_config(None, run)
    one = checkpoint_bytes(cfg, model_config("tiny"))
    _disk_with(monkeypatch, 3 * one - 1)
    assert main(["pretrain", *run]) == 1
    err = capsys.readouterr().err
    assert (
        f"need {3 * one / 2**20:.2f} MiB ({3 * one:,} bytes: 3 of" in err
        and f"({3 * one - 1:,} bytes) free" in err
    )
    assert "keep_last_checkpoints=2; 1 would fit); the run did not start" in err
    assert not (tmp_path / "run" / "checkpoints").exists()

    _disk_with(
        monkeypatch, 3 * one
    )  # just enough: it trains, and each checkpoint holds about that many bytes
    assert main(["pretrain", *run]) == 0
    last = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    written = (last / "model.safetensors").stat().st_size + (last / "optimizer.pt").stat().st_size
    assert one < written < one + 64 * 1024  # + the files' headers and the state dict's structure


def test_a_resumed_run_counts_the_checkpoints_it_already_has(small_corpus, tmp_path, capsys, monkeypatch):
    """Resumed at step 8 of 12 with 2 checkpoints kept (4, 8): the save at 12 adds one while 2 are on disk."""
    run = tiny_run_overrides(small_corpus, tmp_path / "run", checkpoint_every=4, keep_last_checkpoints=2)
    assert main(["pretrain", *[a for a in run if not a.startswith("max_steps=")], "max_steps=8"]) == 0
    one = checkpoint_bytes(load_config(None, run), model_config("tiny"))
    _disk_with(monkeypatch, one - 1)
    assert main(["pretrain", *run, "resume=true"]) == 1
    assert f"need {one / 2**20:.2f} MiB ({one:,} bytes: 1 of" in capsys.readouterr().err
    _disk_with(monkeypatch, one)
    assert main(["pretrain", *run, "resume=true"]) == 0
