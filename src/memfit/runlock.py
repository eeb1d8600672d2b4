"""One writer per run directory: an advisory lock on ``output_dir/.memfit.lock``.

A run holds an exclusive ``flock`` on the file for its whole life; the file says who holds it (pid, host, start
time, command). The kernel releases a ``flock`` when its process dies however it dies (SIGKILL included), so a
lock file left behind by a dead run is not a lock: the next run takes it over and says so. A second run started
on the same ``output_dir`` while the first is alive is refused before it reads or writes anything there.

``flock`` is advisory and per host on some network file systems (NFSv3 without lockd): two hosts writing one
``output_dir`` on such a file system are not caught.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from memfit.errors import RunLockedError

LOCK_NAME = ".memfit.lock"


class RunLock:
    """The lock of one run directory. Use :func:`acquire`; release with :meth:`release` (or as a context
    manager). Releasing removes the lock file, and the directory too when the lock created it and it is empty
    (a run refused by validation leaves nothing behind)."""

    def __init__(self, directory: Path, fd: int, created_dir: Path | None, note: str | None) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = fd
        self._created_dir = created_dir
        self.note = note
        """A message for the user when the lock was taken over from a dead process, else ``None``."""

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(
                missing_ok=True
            )  # while still holding the lock: nobody can be waiting on this inode
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        if self._created_dir is not None:
            try:  # only the empty directories this lock created; anything the run wrote keeps them
                for d in [self.directory, *self.directory.parents]:
                    d.rmdir()
                    if d == self._created_dir:
                        break
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    pid, host, command = holder.get("pid", "?"), holder.get("host", "?"), holder.get("command", "?")
    return f"pid {pid} on host {host} (started {when}: {command})"


def acquire(directory: str | Path) -> RunLock:
    """Take the lock of the run directory ``directory``, creating the directory if needed.

    Returns:
        The held :class:`RunLock`.

    Raises:
        RunLockedError: another live process holds it; the message names its pid, host, start and command.
        OSError: the directory or the lock file cannot be created (the caller reports it).
    """
    directory = Path(directory).absolute()
    created = None
    if not directory.exists():
        created = directory
        while not created.parent.exists():
            created = created.parent
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockedError(
                f"output_dir '{directory}' is in use by another run: {_describe(_holder(path))}. Two runs writing "
                f"one output_dir would overwrite each other's checkpoints and metrics; wait for it to finish, stop "
                f"it, or choose another output_dir (nothing was changed)"
            ) from None
        # the holder may have removed the file between our open and our lock: then lock the new file instead
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    previous = _holder(path)
    note = None
    if previous and previous.get("pid") != os.getpid():
        note = (
            f"note: took over the lock of output_dir '{directory}' left by {_describe(previous)}, which is no "
            f"longer running"
        )
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": " ".join(["memfit", *sys.argv[1:]]) if sys.argv else "memfit",
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return RunLock(directory, fd, created, note)
