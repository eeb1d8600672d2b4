"""Helpers of the fault-injection tests: a small file system that really fills up, and runs in subprocesses."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@functools.cache
def _can_mount_tmpfs() -> bool:
    """Whether this machine lets an unprivileged user namespace mount a tmpfs (``unshare -rm``); probed once, by the
    first test that needs it (so the fast tier, which collects the slow modules without running them, starts no
    process)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt && echo ok"],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0 and "ok" in probe.stdout


@pytest.fixture
def needs_tmpfs() -> None:
    """Skip the test where no unprivileged tmpfs mount is allowed."""
    if not _can_mount_tmpfs():
        pytest.skip("no unprivileged tmpfs mount here (unshare -rm); the injected ENOSPC tests still run")


def run_on_small_disk(
    mount: Path, size: str, argv: list[str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``python -m memfit argv`` with a tmpfs of ``size`` (e.g. ``"3m"``) mounted at ``mount``, in a mount
    namespace of its own (the mount vanishes with the process: copy out what the test needs inside ``argv``'s
    run, or use :func:`shell_on_small_disk`)."""
    script = f"mount -t tmpfs -o size={size} tmpfs {mount} && exec {sys.executable} -m memfit " + " ".join(
        f"'{a}'" for a in argv
    )
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=timeout
    )


def shell_on_small_disk(
    mount: Path, size: str, script: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the shell ``script`` with a tmpfs of ``size`` mounted at ``mount`` (own mount namespace)."""
    full = f"mount -t tmpfs -o size={size} tmpfs {mount} && {script}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", full], capture_output=True, text=True, timeout=timeout
    )
