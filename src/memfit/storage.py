"""Failed writes as messages a user can act on: what went wrong on the disk, in words.

Libraries report a full disk in their own ways: Python raises ``OSError(ENOSPC)``, safetensors a
``SafetensorError`` whose text ends in ``(os error 28)``, and ``torch.save`` a ``RuntimeError`` from its zip
writer (``[enforce fail at inline_container.cc] ... unexpected pos``) that has lost the cause. :func:`os_error_of`
recovers an ``OSError`` from each, and :func:`torch_save` keeps the cause ``torch.save`` would lose.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import torch

_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "the file is larger than this process or file system allows",
    errno.EIO: "an input/output error of the device",
}
_FIXES = {
    errno.ENOSPC: "free disk space there",
    errno.EDQUOT: "free space within your quota",
    errno.EACCES: "make it writable for this user",
    errno.EPERM: "make it writable for this user",
    errno.EROFS: "use a writable file system",
}
_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)")  # safetensors (Rust's io::Error)
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")  # an OSError reported inside another error (DCP's per rank)


def os_error_of(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind a failed write, or ``None`` when ``exc`` is not one.

    Recognises ``OSError`` itself, safetensors' ``SafetensorError`` carrying ``(os error N)``, an error whose
    text quotes an ``OSError`` (``[Errno N]``: ``torch.distributed.checkpoint`` gathers the ranks' errors so),
    and ``torch.save``'s zip-writer ``RuntimeError`` (its errno is unknown: ``EIO``, or ``ENOSPC`` when the text
    says so).
    """
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    if type(exc).__name__ == "SafetensorError":
        found = _OS_ERROR_IN_TEXT.search(text)
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
    found = _ERRNO_IN_TEXT.search(text)
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    if isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
        code = errno.ENOSPC if "No space left" in text else errno.EIO
        return OSError(code, f"{os.strerror(code)} ({text.splitlines()[0][:120]})")
    return None


def cause(exc: OSError) -> str:
    """``exc`` in words: ``"the disk is full (No space left on device)"``."""
    words = _CAUSES.get(exc.errno)
    detail = exc.strerror or str(exc)
    return f"{words} ({detail})" if words else detail


def fix(exc: OSError, where: str) -> str:
    """What to do about ``exc`` at ``where`` (a directory the user chose, e.g. ``"output_dir"``)."""
    action = _FIXES.get(exc.errno, "check that disk")
    return f"{action}, or choose another {where}"


def write_failure(
    what: str,
    path: str | Path,
    error: OSError,
    kept: str | None,
    where: str,
    partial: str | None = "Nothing partial was left behind",
) -> str:
    """The one-paragraph message of a failed write.

    Args:
        what: what was being written ("checkpoint", "the step 5 record to", ...).
        path: where.
        error: the cause (see :func:`os_error_of`).
        kept: what the user still has (default: "what was there before is untouched").
        where: the setting that chose the location, for the advice (e.g. "output_dir").
        partial: what became of the partly written file, or ``None`` to say nothing of it (an appended record).
    """
    kept = kept or "what was there before is untouched"
    left = f"{partial}; " if partial else ""
    return f"could not write {what} '{path}': {cause(error)}. {left}{kept}. To go on: {fix(error, where)}"


class _RecordingWriter:
    """A binary file whose write errors are kept (``torch.save``'s zip writer replaces them by its own)."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._fh.flush()


def torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, raising the real ``OSError`` when the write fails (disk full, quota, I/O).

    Raises:
        OSError: the write failed; ``filename`` is ``path``.
    """
    with open(path, "wb") as fh:
        writer = _RecordingWriter(fh)
        try:
            torch.save(obj, writer)
        except (RuntimeError, OSError) as exc:
            error = writer.error or (exc if isinstance(exc, OSError) else None)
            if error is None:
                raise
            raise OSError(error.errno, error.strerror, str(path)) from None
