"""The validation split of a prepared dataset, per source: the hash, with a minimum of held-out text per source (the
documents of smallest hash), the same on any number of workers, kept on no-op runs, redone when a source changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from memfit.cli import main
from memfit.config import load_prepare_config
from memfit.data import prepare as prepare_module
from memfit.data import split as split_module
from memfit.data.prepare import prepare
from memfit.data.sources import default_corpus_path, resolve_sources, source_tree
from memfit.data.split import VAL_MIN_CHARS, plan_source
from memfit.data.tokens import document_hash, read_manifest
from memfit.tokenizer import load_tokenizer

from ..conftest import ASSETS
from .test_prepare import _files, _records

MIXED = ASSETS / "mixed_corpus"
SETTINGS = ["shard_tokens=20000", "vocab_size=512"]  # val_fraction: the default, 0.01


def _prepare(out: Path, *overrides: str, workers: int = 1, sources=None, **given):
    cfg = load_prepare_config([*SETTINGS, *overrides], out=str(out), workers=workers, **given)
    return prepare(cfg, sources or source_tree(MIXED), progress_bar=False)


def _minimum(texts: list[str]) -> list[str]:
    """The documents the minimum holds out when the hash holds out none: by ascending hash, until they hold
    VAL_MIN_CHARS characters."""
    held, chars = [], 0
    for text in sorted(texts, key=document_hash):
        if chars >= VAL_MIN_CHARS:
            break
        held.append(text)
        chars += len(text)
    return held


def _documents(directory: Path, source: str, split: str) -> list[str]:
    manifest = read_manifest(directory)
    tokenizer = load_tokenizer(directory / "tokenizer")
    ids = [
        np.fromfile(directory / source / s["file"], dtype=np.uint16)
        for s in manifest["sources"][source]["shards"]
        if s["split"] == split
    ]
    stream = np.concatenate(ids).tolist() if ids else []
    documents, current = [], []
    for token in stream:
        if token == tokenizer.bos_id:
            current = []
        elif token == tokenizer.eos_id:
            documents.append(tokenizer.decode(current))
        else:
            current.append(token)
    return documents


@pytest.fixture(scope="module")
def default(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("split") / "mix"
    _prepare(out)
    return out


def test_every_source_holds_out_its_documents_of_smallest_hash(default):
    """At val_fraction=0.01 the hash holds out none of the 88 documents; each source holds out its documents of
    smallest hash until it has 16,384 characters (main: no validation document in any source)."""
    manifest = read_manifest(default)
    held = {name: src["val"]["documents"] for name, src in manifest["sources"].items()}
    assert held == {"book": 1, "docs": 3, "github": 7}
    for name, src in manifest["sources"].items():
        texts = _records(name)
        expected = _minimum(texts)
        assert sorted(_documents(default, name, "val")) == sorted(expected), name
        assert sorted(_documents(default, name, "train")) == sorted(t for t in texts if t not in expected), (
            name
        )
        assert src["val_hash_max"] == document_hash(expected[-1])
    assert {n: s["val"]["tokens"] for n, s in manifest["sources"].items()} == {
        "book": 15359,
        "docs": 20416,
        "github": 11582,
    }


def test_the_split_is_the_same_on_any_number_of_workers_and_kept_by_a_no_op_run(
    default, tmp_path, monkeypatch
):
    _prepare(tmp_path / "two", workers=2)
    assert _files(tmp_path / "two") == _files(default)
    run = tmp_path / "again"
    shutil.copytree(default, run)
    monkeypatch.setattr(
        split_module, "plan_source", None
    )  # a no-op run reads no document: the manifest says it
    assert _prepare(run).prepared == 0
    assert _files(run) == _files(default)


def test_a_source_with_enough_held_out_by_the_hash_is_unchanged(tmp_path, monkeypatch):
    """val_fraction=0.2 holds out at least 16,384 characters of every source: the dataset is byte for byte the one
    of the hash alone (the rule before the minimum), and so is Tiny Shakespeare's tail at 0.1 and 0.01."""
    with_minimum = tmp_path / "minimum"
    _prepare(with_minimum, "val_fraction=0.2")
    assert all(s["val_hash_max"] is None for s in read_manifest(with_minimum)["sources"].values())
    monkeypatch.setattr(split_module, "VAL_MIN_CHARS", 0)
    _prepare(tmp_path / "hash", "val_fraction=0.2")
    assert _files(tmp_path / "hash") == _files(with_minimum)
    (shakespeare,) = resolve_sources({"t": [str(default_corpus_path())]})["t"]
    monkeypatch.undo()
    for vf in (0.1, 0.01):  # one .txt document: its tail, as before; the minimum adds only record documents
        split = plan_source("t", [shakespeare], val_fraction=vf, text_field="text", skip_malformed=False)
        assert (split.val_hash_max, split.added) == (None, 0)


def test_prepare_says_at_once_which_source_has_no_validation_split(tmp_path, capsys, monkeypatch):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.jsonl").write_text(json.dumps({"text": "the only document " * 50}) + "\n")
    said_before_the_work = []
    real = prepare_module._dataset_tokenizer

    def tokenizer(*args):  # the first of the heavy work: what had been said by then
        said_before_the_work.append(capsys.readouterr().out)
        return real(*args)

    monkeypatch.setattr(prepare_module, "_dataset_tokenizer", tokenizer)
    args = ["prepare", "--out", str(tmp_path / "out"), "--source", f"one={tmp_path / 'one'}"]
    assert (
        main([*args, "--source", f"docs={MIXED / 'docs'}", "--quiet", "--workers", "1", "vocab_size=300"])
        == 0
    )
    (said,) = said_before_the_work
    assert (
        "note: source 'one' has no validation split: val_fraction=0.01 holds out none of its 1 document, and the "
        "minimum per source cannot hold one out without taking more than half of its text; a run reports no "
        "val_loss/one\n" in said
    )
    assert (
        "note: source 'docs': val_fraction=0.01 holds out 0 of its 40 documents; it holds out the 3 of smallest "
        "hash (39,100 characters; the minimum per source is 16,384)\n" in said
    )
    assert (
        main([*args, "--quiet", "--workers", "1", "val_fraction=0", "vocab_size=300"]) == 1
    )  # other settings
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "off"), "--quiet", "val_fraction=0", "vocab_size=300"]) == 0
    assert "note" not in capsys.readouterr().out  # val_fraction=0 asks for none


def test_a_changed_source_is_split_again_and_its_files_prepared_again(tmp_path):
    """Adding a file to a small source can move its minimum: the source's files are prepared again, as a fresh
    prepare of the new files would be. A file changed in place is prepared anew, none of its old shards kept
    (main kept them, and the old text)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(MIXED, corpus)
    out = tmp_path / "grow"
    tokenizer = str(ASSETS / "sentencepiece_2k.model")  # given: a fresh prepare would train another BPE
    _prepare(out, sources=source_tree(corpus), tokenizer=tokenizer)
    before = read_manifest(out)
    smallest = min(document_hash(t) for t in _records("github"))
    added = next(  # a long document of smaller hash than any of github's: alone, it is github's minimum now
        text
        for i in range(1000)
        if document_hash(text := f"# module {i}\n" + "def f(x):\n    return x + 1\n" * 800) < smallest
    )
    (corpus / "github" / "extra.jsonl").write_text(json.dumps({"text": added}) + "\n")
    book = corpus / "book" / "book_000.jsonl"
    book.write_text(book.read_text().replace("First Citizen", "First Senator"))
    result = _prepare(out, sources=source_tree(corpus), tokenizer=tokenizer)
    fresh = tmp_path / "fresh"
    _prepare(fresh, sources=source_tree(corpus), tokenizer=tokenizer)
    assert _files(out) == _files(fresh)
    assert result.prepared == 3  # the github files (split again) and the changed book file; docs kept
    after = read_manifest(out)["sources"]
    assert (
        before["sources"]["github"]["val_hash_max"] > after["github"]["val_hash_max"] == document_hash(added)
    )
    assert after["github"]["val"]["documents"] == 1  # it alone


def _as_before_the_minimum(directory: Path) -> None:
    """Take ``val_hash_max`` out of a dataset's unit indexes and manifest, as memfit wrote them before."""
    for path in [directory / "manifest.json", *directory.glob("*/*.json")]:
        if path.parent.name == "tokenizer":
            continue
        data = json.loads(path.read_text())
        data.pop("val_hash_max", None)
        for source in data.get("sources", {}).values():
            source.pop("val_hash_max")
        path.write_text(json.dumps(data, indent=1) + "\n")


def test_a_dataset_prepared_before_the_minimum_is_kept_or_split_again(default, tmp_path):
    """Where the hash alone holds out enough, an older dataset stays as it is (nothing prepared again, no shard
    touched); where a source needs the minimum, its files are prepared again, into what a new prepare writes."""
    enough = tmp_path / "enough"
    _prepare(enough, "val_fraction=0.2")
    shards = {k: v for k, v in _files(enough).items() if k.endswith(".bin")}
    _as_before_the_minimum(enough)
    assert _prepare(enough, "val_fraction=0.2").prepared == 0
    assert {k: v for k, v in _files(enough).items() if k.endswith(".bin")} == shards
    needs = tmp_path / "needs"
    shutil.copytree(default, needs)
    _as_before_the_minimum(needs)
    assert _prepare(needs).prepared == 4  # every file: each source needs the minimum
    assert _files(needs) == _files(default)
