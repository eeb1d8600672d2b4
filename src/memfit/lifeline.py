"""A torchrun worker stops when its launcher dies, however it dies.

torchrun's agent (the ``torchrun`` command, or ``memfit pretrain nproc=N``, which runs torchrun's launcher in its own
process) starts each worker in a session of its own and stops them itself when it is signalled. Killed with
SIGKILL, which it cannot pass on, it would leave its workers training and writing checkpoints with nobody watching
them. So every memfit worker under torchrun ties its life to its parent, the agent, as soon as it starts
(:func:`stop_with_launcher`):

- on Linux, ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends SIGTERM the moment the parent dies. memfit stops
  on SIGTERM as on Ctrl-C: a checkpoint being written is completed first, the newest complete one is kept.
- everywhere, a daemon thread checks every :data:`POLL_S` seconds that the parent is still there; once it is gone
  the thread says so on stderr, sends SIGTERM itself where the kernel does not, and kills the worker (SIGKILL) if it
  is still alive :data:`GRACE_S` seconds later (a collective that waits for a rank that is gone does not unwind).

The kernel's signal follows the *thread* that started the worker: torchrun's agent starts its workers
(``subprocess.Popen`` in torch.distributed.elastic's ``SubprocessContext``) from its main thread, which ends only
with the agent. ``memfit pretrain nproc=N`` puts its own pid in :data:`LAUNCHER_PID_ENV` for its workers, so that
a worker whose launcher died before the worker got here stops too. Imports nothing from memfit or torch:
``python -m memfit`` calls it before it imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "MEMFIT_LAUNCHER_PID"
GRACE_S = 30.0  # SIGTERM, then SIGKILL this much later: torchrun's own --shutdown_timeout
POLL_S = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_armed = False
_parent: int | None = None  # the parent stop_with_launcher saw
_grace_s = GRACE_S
_told = threading.Lock()  # held once the launcher's death was reported: one line per worker


def under_torchrun() -> bool:
    """This process is a worker that torchrun's agent started (it sets ``TORCHELASTIC_RUN_ID`` for its workers)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def stop_with_launcher(grace_s: float = GRACE_S) -> bool:
    """Under torchrun, stop this worker when its parent (torchrun's agent) dies: SIGTERM, then SIGKILL after
    ``grace_s`` seconds (see the module docstring). Does nothing outside torchrun or when called again.

    Args:
        grace_s: seconds between the SIGTERM and the SIGKILL of a worker that has not exited.

    Returns:
        Whether this call armed the watch.
    """
    global _armed, _parent, _grace_s
    if _armed or not under_torchrun():
        return False
    _armed, _grace_s = True, grace_s
    parent = _parent = os.getppid()
    by_kernel = _parent_death_signal(signal.SIGTERM)
    # the parent may have died before the prctl, which then never fires: the worker was re-parented already, or
    # the launcher that memfit's nproc=N names is gone
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    gone = os.getppid() != parent or (launcher.isdigit() and not _alive(int(launcher)))
    threading.Thread(
        target=_watch,
        args=(parent, gone, by_kernel and not gone, grace_s),
        name="memfit-lifeline",
        daemon=True,
    ).start()
    return True


def _parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` (Linux); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid
        return True
    return True


def report_launcher_gone() -> bool:
    """Say on stderr, once per worker, that its launcher is gone, if it is (the watch thread does, and so does the
    worker's own stop: the kernel's SIGTERM may end it before the thread's next poll).

    Returns:
        Whether the launcher is gone.
    """
    if _parent is None or os.getppid() == _parent:
        return False
    _report(_parent, _grace_s)
    return True


def _report(parent: int, grace_s: float) -> None:
    if _told.acquire(blocking=False):
        rank = os.environ.get("RANK", "?")
        with contextlib.suppress(OSError):  # stderr may be a pipe nobody reads any more
            print(
                f"memfit: rank {rank}: its launcher (pid {parent}) is gone; stopping (SIGTERM, then SIGKILL after "
                f"{grace_s:g} s)",
                file=sys.stderr,
                flush=True,
            )


def _watch(parent: int, gone: bool, by_kernel: bool, grace_s: float) -> None:
    """The watch thread: wait until the parent is gone (a worker whose parent dies is re-parented), then SIGTERM
    (unless the kernel sent it), then SIGKILL."""
    while not gone:
        time.sleep(POLL_S)
        gone = os.getppid() != parent
    _report(parent, grace_s)
    if not by_kernel:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
