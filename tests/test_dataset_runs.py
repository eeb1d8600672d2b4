"""Runs on a prepared multi-source dataset through the real CLI: per-source validation, mixture weights, documents
kept apart, bad weights and a foreign tokenizer refused, and resume after SIGKILL on 2 ranks, also on 1 (elastic)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.config import load_config
from memfit.data.run import text_data
from memfit.data.tokens import document_ids, read_manifest
from memfit.metrics import read_records

from .conftest import ASSETS, finetune_overrides, kill_launch, run_torchrun, tiny_run_overrides

MIXED = ASSETS / "mixed_corpus"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixed") / "data"
    args = ["prepare", "--out", str(out), "--source-tree", str(MIXED), "--quiet", "--workers", "1"]
    assert main([*args, "val_fraction=0.2", "vocab_size=512", "shard_tokens=8000"]) == 0
    return out


def _run(mixed: Path, out: Path, **extra) -> list[str]:
    over = {
        "tokenizer.kind": "bpe",
        "model_args.vocab_size": 512,
        "seq_len": 64,
        "max_steps": 6,
        "eval_every": 3,
    }
    return tiny_run_overrides(mixed, out, **{**over, **extra})


def test_validation_reports_every_source(mixed, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["pretrain", *_run(mixed, out)]) == 0
    val = [r for r in read_records(out / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [3, 6]
    for record in val:
        per_source = [record[f"val_loss/{name}"] for name in ("book", "docs", "github")]
        assert record["val_loss"] == pytest.approx(sum(per_source) / 3, abs=1e-12)
    printed = capsys.readouterr().out
    assert "(book " in printed and "github" in printed  # the banner's mixture and the per-source losses
    assert not (out / "data").exists()  # a prepared dataset is read where it is


def test_weights_and_documents_kept_apart(mixed, tmp_path):
    plain, weighted, apart = tmp_path / "plain", tmp_path / "weighted", tmp_path / "apart"
    assert main(["pretrain", *_run(mixed, plain, eval_every=0)]) == 0
    assert main(["pretrain", *_run(mixed, weighted, eval_every=0), "data.weights.github=1"]) == 0
    assert main(["pretrain", *_run(mixed, apart, eval_every=0), "data.cross_document_attention=false"]) == 0
    losses = {
        p.name: [r["loss"] for r in read_records(p / "metrics.jsonl") if "loss" in r]
        for p in (plain, weighted)
    }
    assert losses["plain"] != losses["weighted"]  # only github windows
    # documents kept apart: the batches carry the document of every token, from the BOS separators
    cfg = load_config(None, _run(mixed, apart, eval_every=0) + ["data.cross_document_attention=false"])
    manifest = read_manifest(mixed)
    data = text_data(cfg, mixed, manifest, 64)
    batches = [data.train_batch(step, 0) for step in range(40)]
    bos = manifest["tokenizer"]["bos_id"]
    assert all(torch.equal(doc_ids, document_ids(inputs, bos, None)) for inputs, _, doc_ids in batches)
    assert any(int(doc_ids.max()) > 0 for _, _, doc_ids in batches)  # some windows span two documents


def test_bad_weights_and_a_foreign_tokenizer_are_refused_before_allocating(
    mixed, hf_checkpoint, tmp_path, capsys
):
    out = tmp_path / "bad"
    assert main(["pretrain", *_run(mixed, out), "data.weights.wiki=1"]) == 2
    assert "config key 'data.weights.wiki'" in capsys.readouterr().err and not (out / "checkpoints").exists()
    assert main(["pretrain", *_run(mixed, out), "data.weights.book=0"]) == 2
    assert "are all 0" in capsys.readouterr().err
    assert main(["pretrain", *_run(mixed, out), "data.weights.book=-1"]) == 2
    assert "config key 'data.weights.book'" in capsys.readouterr().err
    over = finetune_overrides(
        hf_checkpoint, tmp_path / "ft", **{"data.path": str(mixed), "data.format": "text", "seq_len": 32}
    )
    assert main(["finetune", *over]) == 1
    err = capsys.readouterr().err
    assert "prepared with another tokenizer than checkpoint_dir" in err and "--tokenizer" in err
    assert not (tmp_path / "ft").exists()


def _launch(mixed: Path, out: Path, **extra) -> list[str]:
    over = {
        "batch_size": 4,
        "max_steps": 8,
        "checkpoint_every": 2,
        "eval_every": 4,
        "sample.max_new_tokens": 0,
    }
    return ["pretrain", *_run(mixed, out, **{**over, **extra})]


@pytest.mark.slow
def test_sigkill_on_two_ranks_then_resume_exact_and_elastic(mixed, tmp_path):
    """The global batch of a step is a function of the step: a 2-rank run killed and resumed on 2 ranks gives the
    same losses; resumed in one process with the global batch size, the same to float reduction order."""
    ref = tmp_path / "ref"
    run_torchrun(_launch(mixed, ref), timeout=240)
    out = tmp_path / "killed"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "memfit", *_launch(mixed, out)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "checkpoints" / "step_00000004").exists():
        time.sleep(0.02)
    kill_launch(proc, [])  # SIGKILL to the launcher and every rank
    assert (out / "checkpoints" / "step_00000004").exists() and not (
        out / "checkpoints" / "step_00000008"
    ).exists()
    elastic = tmp_path / "elastic"
    subprocess.run(["cp", "-r", str(out), str(elastic)], check=True)
    run_torchrun(_launch(mixed, out, resume="true"), timeout=240)
    losses = lambda p: [(r["step"], r["loss"]) for r in read_records(p / "metrics.jsonl") if "loss" in r]  # noqa: E731
    assert losses(out) == losses(ref)
    assert main(_launch(mixed, elastic, resume="true", batch_size=8)) == 0  # 1 process x 8 = 2 ranks x 4
    resumed = dict(losses(elastic))
    assert [s for s, _ in losses(elastic)] == list(range(1, 9))
    assert max(abs(resumed[s] - loss) for s, loss in losses(ref)) <= 1e-5


def test_a_dataset_prepared_with_the_defaults_validates_every_source(tmp_path, capsys):
    """memfit prepare's default val_fraction (0.01) holds out none of mixed_corpus' 88 documents by the hash; the
    per-source minimum holds out some of each, so a run logs val_loss for every source (main: none, said only at
    the end). With nothing held out, the banner says so at the start."""
    data = tmp_path / "data"
    prepare = ["prepare", "--out", str(data), "--source-tree", str(MIXED), "--quiet", "--workers", "1"]
    assert main([*prepare, "vocab_size=512"]) == 0
    out = tmp_path / "run"
    assert main(["pretrain", *_run(data, out)]) == 0
    val = [r for r in read_records(out / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [3, 6]
    assert all({"val_loss/book", "val_loss/docs", "val_loss/github"} <= set(r) for r in val)
    assert "254,482 train / 47,357 val tokens (book" in capsys.readouterr().out
    off = tmp_path / "off"
    assert main([*prepare[:2], str(off), *prepare[3:], "vocab_size=512", "val_fraction=0"]) == 0
    assert main(["pretrain", *_run(off, tmp_path / "run-off", max_steps=3, eval_every=0)]) == 0
    banner = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("memfit pretrain:")
    )
    reason = "no validation windows: the dataset holds out no text (memfit prepare's val_fraction=0)"
    assert banner.endswith(f"; {reason}")
