"""A failed write (disk full, quota, permissions) at every write site is one paragraph naming the path, the cause,
what was kept and what to do; nothing partial is left behind, and a run resumes exactly once space is freed.

Each write site gets an injected ``OSError(ENOSPC)`` here (runs anywhere); ``test_small_disk.py`` fills a real
tmpfs where the machine allows an unprivileged mount."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from memfit import checkpoint as ckpt_io
from memfit import storage
from memfit.cli import main
from memfit.metrics import read_records
from tests.conftest import tiny_run_overrides

MIXED = Path(__file__).parents[1] / "assets" / "mixed_corpus"
ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def _checkpointed(corpus: Path, out: Path, **extra) -> list[str]:
    """The tiny run with what these faults hit: a checkpoint and a validation every 4 steps."""
    return tiny_run_overrides(corpus, out, **{"eval_every": 4, "checkpoint_every": 4, **extra})


def _losses(out: Path) -> list:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_records(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_corpus) -> Path:
    out = tmp_path_factory.mktemp("ref") / "out"
    assert main(["pretrain", *_checkpointed(small_corpus, out)]) == 0
    return out


def _fail_on_call(n: int, real):
    """A stand-in for ``real`` whose ``n``-th call (from 1) raises ENOSPC."""
    calls = {"n": 0}

    def fake(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise ENOSPC
        return real(*args, **kwargs)

    return fake


def _leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if ".tmp" in p.name or ".old-" in p.name)


@pytest.mark.slow
@pytest.mark.parametrize("site", ["safetensors", "torch.save"])
def test_a_full_disk_during_a_checkpoint_keeps_the_last_one_and_resume_is_exact(
    site, reference, small_corpus, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    if site == "safetensors":  # safetensors' own error type, from the second checkpoint (step 8)
        monkeypatch.setattr(ckpt_io, "save_file", _fail_on_call(2, ckpt_io.save_file))
    else:  # torch's zip writer turns the OSError into "RuntimeError: [enforce fail at inline_container.cc]"
        real_write = storage._RecordingWriter.write
        writers: list[int] = []  # one writer per optimizer.pt
        writes = {"n": 0}

        def write(self, data):
            if id(self) not in writers:
                writers.append(id(self))
            if len(writers) == 2:  # the second checkpoint's (step 8): its third write fails half-way
                writes["n"] += 1
                if writes["n"] == 3:
                    self._fh.write(data[: len(data) // 2])
                    self.error = ENOSPC
                    raise ENOSPC
            return real_write(self, data)

        monkeypatch.setattr(storage._RecordingWriter, "write", write)
    assert main(["pretrain", *_checkpointed(small_corpus, out)]) == 1
    err = capsys.readouterr().err
    first = err.strip().splitlines()[-1]
    assert first.startswith("memfit: error: could not write checkpoint '")
    assert "the disk is full (No space left on device)" in first
    assert "step_00000004' is kept (resume=true continues from it)" in first
    assert "free disk space there, or choose another output_dir" in first and "Traceback" not in err
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_00000004"]
    assert _leftovers(out) == []
    monkeypatch.undo()
    assert main(["pretrain", *_checkpointed(small_corpus, out, resume="true")]) == 0
    assert _losses(out) == _losses(reference)


def test_torch_save_reports_the_real_cause(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(
        storage._RecordingWriter,
        "write",
        lambda self, data: (_ for _ in ()).throw(OSError(errno.EDQUOT, "quota")),
    )
    with pytest.raises(OSError) as info:
        storage.torch_save({"x": torch.zeros(4)}, tmp_path / "x.pt")
    assert info.value.errno == errno.EDQUOT and info.value.filename == str(tmp_path / "x.pt")
    assert storage.cause(info.value) == "the disk quota is exceeded (quota)"


@pytest.mark.parametrize(
    "exc, expected",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "the disk is full (No space left on device)"),
        (OSError(errno.EACCES, "Permission denied"), "permission denied (Permission denied)"),
        (
            OSError(errno.EROFS, "Read-only file system"),
            "the file system is read-only (Read-only file system)",
        ),
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
            "input/output",
        ),
        (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), None),
        (ValueError("a bug, not the disk"), None),
    ],
)
def test_os_error_of_recognises_each_library_s_way_of_saying_it(exc, expected):
    error = storage.os_error_of(exc)
    if expected is None:
        assert error is None  # a RuntimeError that is not safetensors' type, or not an OS error at all
    else:
        assert expected in storage.cause(error)


def test_safetensors_error_text_carries_the_errno():
    from safetensors import SafetensorError

    error = storage.os_error_of(
        SafetensorError("Error while serializing: I/O error: No space left (os error 28)")
    )
    assert error.errno == errno.ENOSPC


def test_a_full_disk_while_logging_stops_with_a_message(small_corpus, tmp_path, capsys, monkeypatch):
    from memfit import metrics

    out = tmp_path / "run"
    real = metrics.MetricsLogger.log
    calls = {"n": 0}

    def log(self, record):
        calls["n"] += 1
        if calls["n"] == 6:
            self._file = _FullFile(self._file)
        return real(self, record)

    monkeypatch.setattr(metrics.MetricsLogger, "log", log)
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, eval_every=4, checkpoint_every=4)]) == 1
    err = capsys.readouterr().err
    assert f"could not write the step 5 record to '{out / 'metrics.jsonl'}': the disk is full" in err
    assert "the newest complete checkpoint in output_dir is kept" in err and "Traceback" not in err
    assert [r["step"] for r in read_records(out / "metrics.jsonl")] == [1, 2, 3, 4, 4]  # 4 twice: loss, val


class _FullFile:
    def __init__(self, fh):
        self._fh = fh

    def write(self, text):
        raise ENOSPC

    def flush(self):
        pass

    def close(self):
        self._fh.close()


def test_a_full_disk_during_prepare_leaves_no_partial_shard(tmp_path, capsys, monkeypatch):
    from memfit.data import prepare

    out = tmp_path / "ds"
    monkeypatch.setattr(prepare._ShardPair, "write", _fail_on_call(3, prepare._ShardPair.write))
    args = ["prepare", "--out", str(out), "--source-tree", str(MIXED), "--workers", "1", "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"could not write the dataset '{out}': the disk is full" in err
    assert "the shards finished so far are kept, and the same command continues from them" in err
    assert "--out" in err and "Traceback" not in err
    assert _leftovers(out) == []
    monkeypatch.undo()
    assert main(args) == 0
    assert json.loads((out / "manifest.json").read_text())["sources"]["book"]["documents"] == 8


@pytest.mark.slow
def test_a_full_disk_during_export_leaves_nothing(reference, tmp_path, capsys, monkeypatch):
    from memfit.convert import hf

    monkeypatch.setattr(hf, "save_file", _fail_on_call(1, hf.save_file))
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(reference), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"could not write Hugging Face directory '{out}': the disk is full" in err
    assert "or choose another --out" in err and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_read_only_output_dir_is_refused_before_training(small_corpus, tmp_path, capsys):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes through permission bits")
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert main(["pretrain", *tiny_run_overrides(small_corpus, parent / "out")]) == 1
        assert "is not writable (Permission denied" in capsys.readouterr().err
    finally:
        parent.chmod(0o755)


def test_metrics_damaged_lines_are_reported_when_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"step": 1, "loss": 2.0}),
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"step": 2}),
        '{"st',
    ]
    path.write_text("\n".join(lines))
    said = []
    records = read_records(path, report=said.append)
    assert [r["step"] for r in records] == [1, 2]
    assert len(said) == 3
    assert said[0].startswith(f"memfit: note: {path}, line 2: not JSON")
    assert said[1].startswith(f"memfit: note: {path}, line 3: not a record")
    assert "line 5" in said[2] and "cut off when a run was killed" in said[2]


def test_leftovers_of_a_failed_save_are_removed(tmp_path):
    final = tmp_path / "checkpoints" / "step_00000001"
    with pytest.raises(ckpt_io.CheckpointError, match="the disk is full"):
        with ckpt_io.atomic_directory(final, "checkpoint") as tmp:
            (tmp / "half").write_bytes(b"x")
            raise ENOSPC
    assert list((tmp_path / "checkpoints").iterdir()) == []
    shutil.rmtree(tmp_path / "checkpoints")
