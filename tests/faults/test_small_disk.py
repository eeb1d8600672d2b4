"""A real full disk and a real read-only file system: a small tmpfs mounted in a mount namespace of the test's own
(``unshare -rm``; skipped where the machine does not allow it; ``test_write_failures.py`` injects the same errors
everywhere)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.metrics import read_records
from tests.conftest import tiny_run_overrides

from .conftest import shell_on_small_disk

pytestmark = [
    pytest.mark.usefixtures("needs_tmpfs"),
    pytest.mark.slow,
]  # runs in mount namespaces of their own (subprocesses)
MIXED = Path(__file__).parents[1] / "assets" / "mixed_corpus"


def _checkpointed(corpus: Path, out: Path, **extra) -> list[str]:
    """The tiny run with what these faults hit: a checkpoint and a validation every 4 steps."""
    return tiny_run_overrides(corpus, out, **{"eval_every": 4, "checkpoint_every": 4, **extra})


def _memfit(*args: str) -> str:
    return shlex.join([sys.executable, "-m", "memfit", *args])


def test_a_full_disk_keeps_the_last_checkpoint_and_resume_is_exact(small_corpus, tmp_path):
    ref = tmp_path / "ref"
    assert main(["pretrain", *_checkpointed(small_corpus, ref)]) == 0
    mount, saved = tmp_path / "disk", tmp_path / "saved"
    mount.mkdir()
    run = mount / "run"
    # 2 MiB: the prepared text, the records and the step-4 checkpoint (1.3 MB) fit; the step-8 one does not. The
    # pre-flight would refuse the run before it starts (its saves need 3.8 MB: tests/test_disk_check.py): off here,
    # as a disk that something else fills while the run trains
    script = (
        f"{_memfit('pretrain', *_checkpointed(small_corpus, run), 'preflight=false')} > /dev/null; echo exit=$?; "
        f"find {run} -name '.tmp*' -o -name '.old-*'; cp -a {run} {saved}"
    )
    proc = shell_on_small_disk(mount, "2m", script)
    assert "exit=1" in proc.stdout, proc.stdout + proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith(f"memfit: error: could not write checkpoint '{run}/checkpoints/step_00000008'")
    assert "the disk is full (No space left on device)" in message
    assert f"'{run}/checkpoints/step_00000004' is kept (resume=true continues from it)" in message
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip().splitlines() == ["exit=1"]  # no temporary file or directory left behind
    assert sorted(p.name for p in (saved / "checkpoints").iterdir()) == ["step_00000004"]
    # space freed (here: the run moved to a bigger disk): resume gives the uninterrupted run's numbers
    assert main(["pretrain", *_checkpointed(small_corpus, saved, resume="true")]) == 0
    records = [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_records(saved / "metrics.jsonl")]
    assert records == [
        (r["step"], r.get("loss"), r.get("val_loss")) for r in read_records(ref / "metrics.jsonl")
    ]


def test_a_full_disk_during_prepare_leaves_no_partial_file(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    out = mount / "ds"
    prepare = _memfit("prepare", "--out", str(out), "--source-tree", str(MIXED), "--workers", "2", "--quiet")
    proc = shell_on_small_disk(mount, "400k", f"{prepare}; echo exit=$?; find {out} -name '*.tmp*'")
    lines = [line for line in proc.stdout.strip().splitlines() if not line.startswith("note: ")]
    assert lines == ["exit=1"], proc.stdout + proc.stderr  # (the notes: each source's validation minimum)
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith(f"memfit: error: could not write the dataset '{out}': the disk is full")
    assert "the same command continues from them" in message and "Traceback" not in proc.stderr


def test_a_read_only_file_system_is_refused_before_anything_runs(small_corpus, tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    run = mount / "run"
    script = f"mount -o remount,ro {mount} && {_memfit('pretrain', *_checkpointed(small_corpus, run))}"
    proc = shell_on_small_disk(mount, "1m", script)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert err == (
        f"memfit: error: output directory '{run}' is not writable (Read-only file system in '{mount}'); choose "
        f"another with output_dir=PATH"
    )
