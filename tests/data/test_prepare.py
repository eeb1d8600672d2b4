"""memfit prepare: readers of every format, the shard format, resume after SIGKILL, workers and nodes, bad input."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from memfit.cli import main
from memfit.config import load_prepare_config
from memfit.data.prepare import prepare
from memfit.data.sources import default_corpus_path, read_pieces, resolve_sources, source_tree
from memfit.data.tokens import is_validation, read_manifest
from memfit.errors import DataError
from memfit.tokenizer import load_tokenizer

from ..conftest import ASSETS

MIXED = ASSETS / "mixed_corpus"
SMALL_SHARDS = ["val_fraction=0.2", "shard_tokens=20000", "vocab_size=512"]


def _prepare(out: Path, *overrides: str, workers: int = 1, sources=None, **given):
    cfg = load_prepare_config([*SMALL_SHARDS, *overrides], out=str(out), workers=workers, **given)
    return prepare(cfg, sources or source_tree(MIXED), progress_bar=False)


def _files(directory: Path) -> dict[str, bytes]:
    """Every file of a dataset, by relative path (the executor's logs and the lock files left out)."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and ".prepare" not in p.parts and not p.name.endswith(".lock")
    }


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "mix"
    _prepare(out)
    return out


def _records(source: str) -> list[str]:
    texts = []
    for path in sorted((MIXED / source).iterdir()):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            texts += [r["text"] for r in pq.read_table(path).to_pylist()]
        elif path.name.endswith(".gz"):
            texts += [json.loads(line)["text"] for line in gzip.open(path, "rt", encoding="utf-8")]
        elif path.name.endswith(".zst"):
            import zstandard

            raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb")).read().decode()
            texts += [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
        elif path.suffix == ".jsonl":
            texts += [json.loads(line)["text"] for line in path.open(encoding="utf-8")]
    return texts


# ----------------------------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------------------------


def test_every_format_reads_every_record_in_order():
    files = resolve_sources({s: [str(MIXED / s)] for s in ("book", "github", "docs")})
    for source, inputs in files.items():
        read = [p.text for f in inputs for p in read_pieces(f, val_fraction=0.0)]
        assert read == _records(source), source
    assert [f.path.name for f in files["book"]] == ["book_000.jsonl", "book_001.jsonl.gz"]


def test_records_are_held_out_by_a_hash_of_their_text():
    (f,) = resolve_sources({"github": [str(MIXED / "github")]})["github"]
    pieces = list(read_pieces(f, val_fraction=0.2))
    assert {p.split for p in pieces} == {"train", "val"}
    assert all((p.split == "val") == is_validation(p.text, 0.2) for p in pieces)
    assert all(p.starts and p.ends for p in pieces)  # each record is a whole document


def test_a_text_file_is_one_document_whose_tail_is_held_out():
    (f,) = resolve_sources({"t": [str(default_corpus_path())]})["t"]
    pieces = list(read_pieces(f, val_fraction=0.1))
    train = "".join(p.text for p in pieces if p.split == "train")
    val = "".join(p.text for p in pieces if p.split == "val")
    text = default_corpus_path().read_text(encoding="utf-8")
    assert train + val == text and train.endswith("\n")  # cut at a line boundary, nothing lost or repeated
    assert abs(len(val) - 0.1 * len(text)) < 200
    assert [(p.split, p.starts, p.ends) for p in pieces] == [("train", True, False), ("val", False, True)]


@pytest.mark.parametrize(
    "line, expected",
    [
        (b'{"text": "ok"\n', "malformed JSON"),
        (b'["a list"]\n', "must be a JSON object"),
        (b'{"meta": {}}\n', "has no 'text' field"),
        (b'{"text": 3}\n', "non-string (int) 'text' field"),
        (b'{"text": "caf\xe9"}\n', "not valid UTF-8: byte 0xe9 at column 14"),
    ],
    ids=["json", "not-object", "missing-field", "not-string", "utf8"],
)
def test_a_bad_record_names_its_file_and_line(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "first"}\n\n' + line + b'{"text": "last"}\n')
    (f,) = resolve_sources({"s": [str(path)]})["s"]
    with pytest.raises(DataError, match=f"{re.escape(str(path))}:3: .*{re.escape(expected)}"):
        list(read_pieces(f, val_fraction=0.0))
    counts_skipped = [p.text for p in read_pieces(f, val_fraction=0.0, skip_malformed=True)]
    assert counts_skipped == ["first", "last"]


def test_parquet_without_the_text_column_or_with_nulls(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "b.parquet")
    (a,) = resolve_sources({"s": [str(tmp_path / "a.parquet")]})["s"]
    with pytest.raises(DataError, match="has no 'text' column .*body"):
        list(read_pieces(a, val_fraction=0.0))
    (b,) = resolve_sources({"s": [str(tmp_path / "b.parquet")]})["s"]
    with pytest.raises(DataError, match="row 2: 'text' is null"):
        list(read_pieces(b, val_fraction=0.0))


def test_sources_that_name_nothing_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="matches no"):
        resolve_sources({"web": [str(tmp_path / "missing" / "*.jsonl")]})
    with pytest.raises(DataError, match="matches no"):
        resolve_sources({"web": [str(tmp_path / "empty")]})
    with pytest.raises(DataError, match="is not a file memfit prepare reads"):
        resolve_sources({"web": [str(tmp_path / "notes.csv")]})
    with pytest.raises(DataError, match="plain name"):
        resolve_sources({"a/b": [str(MIXED / "book")]})


# ----------------------------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------------------------


def test_manifest_counts_every_document_and_token(prepared):
    manifest = read_manifest(prepared)
    assert list(manifest["sources"]) == ["book", "docs", "github"]
    assert {n: s["documents"] for n, s in manifest["sources"].items()} == {
        "book": 8,
        "docs": 40,
        "github": 40,
    }
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == 512
    for name, source in manifest["sources"].items():
        assert source["tokens"] == source["train"]["tokens"] + source["val"]["tokens"]
        assert source["tokens"] == sum(s["tokens"] for s in source["shards"])
        for shard in source["shards"]:
            assert (prepared / name / shard["file"]).stat().st_size == 2 * shard["tokens"]
            assert shard["split"] != "train" or shard["tokens"] <= 20000 or shard["documents"] == 1
    assert manifest["tokens"] == sum(s["tokens"] for s in manifest["sources"].values())


def test_shards_hold_each_document_between_bos_and_eos(prepared):
    manifest = read_manifest(prepared)
    tokenizer = load_tokenizer(prepared / "tokenizer")
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    for split in ("train", "val"):
        stream = np.concatenate(
            [
                np.fromfile(prepared / "docs" / s["file"], dtype=np.uint16)
                for s in manifest["sources"]["docs"]["shards"]
                if s["split"] == split
            ]
        ).tolist()
        documents, current = [], None
        for token in stream:
            if token == bos:
                current = []
            elif token == eos:
                documents.append(tokenizer.decode(current))
            else:
                current.append(token)
        expected = [t for t in _records("docs") if is_validation(t, 0.2) == (split == "val")]
        assert documents == expected, split


def test_workers_do_not_change_a_byte(prepared, tmp_path):
    _prepare(tmp_path / "two", workers=2)
    assert _files(tmp_path / "two") == _files(prepared)


def test_running_again_is_a_no_op(prepared, capsys):
    before = {p: p.stat().st_mtime_ns for p in prepared.rglob("*") if p.is_file()}
    args = ["prepare", "--out", str(prepared), "--source-tree", str(MIXED), "--quiet", *SMALL_SHARDS]
    assert main(args) == 0
    assert "already prepared (nothing to do)" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in prepared.rglob("*") if p.is_file()} == before


def test_a_different_dataset_or_a_foreign_directory_is_refused(prepared, tmp_path, capsys):
    args = [
        "prepare",
        "--out",
        str(prepared),
        "--source-tree",
        str(MIXED),
        "--quiet",
        *SMALL_SHARDS,
        "val_fraction=0.3",
    ]
    assert main(args) == 1
    assert "already holds a different dataset (prepared with other val_fraction)" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["prepare", "--out", str(tmp_path / "other"), "--source-tree", str(MIXED), "--quiet"]) == 1
    assert "holds no prepared dataset" in capsys.readouterr().err
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_an_added_file_is_prepared_and_the_rest_kept(prepared, tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(MIXED, corpus)
    out = tmp_path / "grow"
    _prepare(out, sources=source_tree(corpus))
    old = _files(out)
    (corpus / "book" / "book_002.jsonl").write_text(json.dumps({"text": "A new document.\n" * 50}) + "\n")
    result = _prepare(out, sources=source_tree(corpus))
    assert result.prepared == 1
    new = _files(out)
    assert all(new[k] == v for k, v in old.items() if k.endswith(".bin"))  # what was there is untouched
    assert result.manifest["sources"]["book"]["documents"] == 9


def test_cli_contract_and_the_per_source_table(tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["prepare", "--out", str(out), "--source", f"book={MIXED / 'book'}"]
    args += ["--source", f"code={MIXED / 'github' / '*.zst'}", "--workers", "1", "--quiet", "vocab_size=300"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "book" in printed and "code" in printed and "prepared:" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["sources"]) == {"book", "code"}
    assert all({"documents", "tokens"} <= set(s) for s in manifest["sources"].values())
    assert main(["prepare", "--out", str(out), "--quiet"]) == 2  # no source
    assert "--source" in capsys.readouterr().err


def test_prepare_with_a_given_tokenizer(tmp_path):
    result = _prepare(tmp_path / "sp", tokenizer=str(ASSETS / "sentencepiece_2k.model"))
    given = load_tokenizer(ASSETS / "sentencepiece_2k.model")
    assert result.manifest["tokenizer"]["fingerprint"] == given.fingerprint()
    assert load_tokenizer(tmp_path / "sp" / "tokenizer").fingerprint() == given.fingerprint()


# ----------------------------------------------------------------------------------------------------------------
# Killed, and resumed; two machines
# ----------------------------------------------------------------------------------------------------------------


def _prepare_command(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "memfit", "prepare", "--out", str(out), "--source-tree", str(MIXED), "--quiet",
        "--workers", "1", *SMALL_SHARDS, "shard_tokens=4000", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_bytes(prepared, tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(_prepare_command(reference), check=True, capture_output=True, timeout=300)
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        _prepare_command(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list(out.glob("github/*-00003.json")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists()
    finished = {  # the shard pairs the killed run finished (their sidecars are written last)
        p.with_suffix(".train.bin").name: p.with_suffix(".train.bin").stat().st_mtime_ns
        for p in out.glob("github/*.json")
        if re.search(r"-\d{5}\.json$", p.name)
    }
    assert finished
    subprocess.run(_prepare_command(out), check=True, capture_output=True, timeout=300, env=env)
    assert _files(out) == _files(reference)
    assert {n: (out / "github" / n).stat().st_mtime_ns for n in finished} == finished  # kept, not redone


@pytest.mark.slow
def test_two_nodes_prepare_disjoint_parts_into_one_directory(prepared, tmp_path):
    out = tmp_path / "nodes"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    nodes = [
        subprocess.Popen(
            _prepare_command(out, "num_nodes=2", f"node_rank={k}", "shard_tokens=20000"),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in (0, 1)
    ]
    outputs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs
    if not (out / "manifest.json").exists():  # both finished at once: the documented re-run writes it
        subprocess.run(_prepare_command(out, "shard_tokens=20000"), check=True, capture_output=True, env=env)
    assert _files(out) == _files(prepared)


def test_a_bad_record_in_a_worker_is_reported_with_its_file_and_line(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(MIXED / "book" / "book_000.jsonl", src / "a.jsonl")
    (src / "b.jsonl").write_text('{"text": "ok"}\n{bad\n')
    args = ["prepare", "--out", str(tmp_path / "out"), "--source", f"s={src}", "--workers", "2", "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{src / 'b.jsonl'}:2: malformed JSON" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_one_process_prepare_needs_neither_datatrove_nor_multiprocess(tmp_path, monkeypatch):
    # the lent GPU machine has neither (bench/gpu_run.sh): a run's own data, one file, must prepare there
    for name in ("datatrove", "multiprocess", "loguru"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    book = MIXED / "book" / "book_000.jsonl"
    result = _prepare(tmp_path / "one", workers=4, sources={"book": [str(book)]})  # one unit: one process
    assert result.prepared == 1 and result.manifest["sources"]["book"]["documents"] == 4
    result = _prepare(tmp_path / "two", workers=1, sources={"book": [str(MIXED / "book")]})
    assert result.prepared == 2 and result.manifest["sources"]["book"]["documents"] == 8


# ----------------------------------------------------------------------------------------------------------------
# A prepare stopped by its input leaves nothing; an earlier run's work is kept
# ----------------------------------------------------------------------------------------------------------------


def _long_source(directory: Path, bad: bytes | None = None) -> Path:
    """60 documents of about 1,000 characters (real text), and ``bad`` as line 61: with val_fraction=0.5 the split
    is decided after about 33 of them, so the bad line is met only while preparing."""
    directory.mkdir(parents=True, exist_ok=True)
    text = default_corpus_path().read_text(encoding="utf-8")
    lines = [json.dumps({"text": text[i * 1000 : (i + 1) * 1000]}).encode() + b"\n" for i in range(60)]
    (directory / "a.jsonl").write_bytes(b"".join(lines) + (bad or b""))
    return directory


BAD_INPUTS = {  # what the reader meets, and what it says
    "no-field": (b'{"meta": 1}\n', ":61: the record has no 'text' field"),
    "utf8": (b'{"text": "caf\xe9"}\n', ":61: not valid UTF-8"),
}


@pytest.mark.parametrize(
    "where, bad",
    [
        ("deciding the split", "no-field"),
        ("deciding the split", "utf8"),
        ("training the tokenizer", "utf8"),
        ("in a worker", "no-field"),
    ],
)
def test_a_prepare_stopped_by_bad_input_leaves_nothing(tmp_path, capsys, where, bad):
    line, message = BAD_INPUTS[bad]
    src = tmp_path / "src"
    if where == "deciding the split":  # a small source: read to its end before anything is written
        src.mkdir()
        (src / "a.jsonl").write_bytes(b'{"text": "ok"}\n' + line)
        message = message.replace(":61:", ":2:")
    else:
        _long_source(src, line)
    given = (
        [] if where == "training the tokenizer" else ["--tokenizer", str(ASSETS / "sentencepiece_2k.model")]
    )
    if where == "in a worker":
        shutil.copy(
            MIXED / "book" / "book_000.jsonl", src / "0.jsonl"
        )  # sorted first: two units, two workers
    out = tmp_path / "made" / "out"
    args = ["prepare", "--out", str(out), "--source", f"s={src}", "--quiet"]
    workers = ["--workers", "2" if where == "in a worker" else "1"]
    assert main([*args, *workers, *given, "val_fraction=0.5", "vocab_size=300"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (
        tmp_path / "made"
    ).exists()  # the directories it made, settings, tokenizer, locks, shards: gone
    if where != "deciding the split":
        assert f"--out '{out}' is removed (this prepare made it)" in err
    (src / "a.jsonl").write_bytes((src / "a.jsonl").read_bytes().replace(line, b""))  # fixed
    other = ["--tokenizer", str(ASSETS / "tiktoken_2k.model")]  # another tokenizer: not "a different dataset"
    assert main([*args, "--workers", "1", *other, "val_fraction=0.5"]) == 0


def test_parquet_without_the_column_or_an_empty_file_leaves_nothing(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "p" / "a.parquet")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "only.jsonl").write_bytes(b"")
    for source, message in [("p", "has no 'text' column (columns: body)"), ("e", "source 'e' has no text")]:
        out = tmp_path / f"out-{source}"
        assert (
            main(["prepare", "--out", str(out), "--source", f"{source}={tmp_path / source}", "--quiet"]) == 1
        )
        assert message in capsys.readouterr().err
        assert not out.exists()  # no tokenizer, settings, lock or empty shard
    (tmp_path / "empty").mkdir()  # a directory given empty stays, empty
    assert (
        main(["prepare", "--out", str(tmp_path / "empty"), "--source", f"e={tmp_path / 'e'}", "--quiet"]) == 1
    )
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_bad_file_added_to_a_dataset_keeps_what_it_had(prepared, tmp_path, capsys):
    out = tmp_path / "grown"
    shutil.copytree(prepared, out)
    before = _files(out)
    src = _long_source(tmp_path / "new", b"{bad\n")
    sources = {**source_tree(MIXED), "new": [str(src)]}
    with pytest.raises(DataError, match=r"a\.jsonl:61: malformed JSON"):
        _prepare(out, sources=sources, tokenizer=None)
    after = _files(out)
    assert {k: v for k, v in after.items() if k in before} == before  # the earlier dataset, untouched
    assert (out / ".prepare" / "settings.json").is_file() and read_manifest(out) == read_manifest(prepared)
    assert not any(k.endswith(".tmp") for k in after)
