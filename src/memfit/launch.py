"""``memfit pretrain|finetune nproc=N ...``: start N ranks on this machine through torchrun.

``nproc=N`` is a CLI shortcut, not a :class:`~memfit.config.TrainConfig` key. With N > 1 and no launcher around
this process yet, the CLI validates the config here (as each of the N ranks will), prints the torchrun command the
launch stands for and runs it with torchrun's own launcher, ``torch.distributed.run``, in this process::

    torchrun --standalone --nproc_per_node N -m memfit <verb> <the same arguments, less nproc>

This process is then torchrun's agent (one process fewer than a torchrun subprocess, and signals reach the agent
directly). Under torchrun already (``WORLD_SIZE`` set), ``nproc`` must equal the launch's ``WORLD_SIZE``;
multi-node runs use torchrun directly (see docs/distributed.md).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys

import torch

from memfit import lifeline
from memfit.errors import ConfigError

NPROC_KEY = "nproc"


def split_nproc(overrides: list[str]) -> tuple[int | None, list[str]]:
    """Take the ``nproc=N`` items out of the CLI's ``key=value`` overrides (the last one wins).

    Args:
        overrides: the CLI's ``key=value`` strings.

    Returns:
        ``(N or None when absent, the other overrides in their order)``.

    Raises:
        ConfigError: ``nproc`` is not an integer >= 1.
    """
    return split_count(overrides, NPROC_KEY, "the number of ranks to start on this machine")


def split_count(overrides: list[str], key: str, meaning: str) -> tuple[int | None, list[str]]:
    """Take the ``key=N`` items (a count that is not a config key, such as ``nproc`` or ``world_size``) out of
    the CLI's ``key=value`` overrides; the last one wins.

    Args:
        overrides: the CLI's ``key=value`` strings.
        key: the key to take out.
        meaning: what the count is, for the error message.

    Returns:
        ``(N or None when absent, the other overrides in their order)``.

    Raises:
        ConfigError: the value is not an integer >= 1.
    """
    count, rest = None, []
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name.strip() != key:
            rest.append(item)
            continue
        value = value.strip()
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"config key '{key}': {meaning} must be an integer >= 1, got {value!r}")
        count = int(value)
    return count, rest


def launched_world_size() -> int | None:
    """``WORLD_SIZE`` of the launcher this process runs under (torchrun sets it), or ``None`` outside one."""
    value = os.environ.get("WORLD_SIZE")
    return None if value is None else int(value)


def check_nproc(nproc: int, device_type: str) -> None:
    """Check ``nproc=N`` against the launch this process runs in and the devices it can use.

    Args:
        nproc: the ``nproc`` value.
        device_type: ``cpu`` or ``cuda``, as ``device`` resolves.

    Raises:
        ConfigError: under torchrun with another ``WORLD_SIZE``, or more ranks than CUDA devices.
    """
    world = launched_world_size()
    if world is not None and nproc != world:
        raise ConfigError(
            f"config key '{NPROC_KEY}': this process runs under a launcher with WORLD_SIZE={world}, but "
            f"nproc={nproc}; the launcher decides the number of ranks, so drop nproc (or set torchrun's "
            f"--nproc_per_node / --nnodes to give {nproc} ranks)"
        )
    if world is None and device_type == "cuda":
        available = torch.cuda.device_count()
        if nproc > available:
            raise ConfigError(
                f"config key '{NPROC_KEY}': {nproc} ranks need one CUDA device each, but torch sees {available}; "
                f"use nproc={available} or fewer (or device=cpu)"
            )


def torchrun_args(nproc: int, verb: str, config: str | None, overrides: list[str]) -> list[str]:
    """torchrun's arguments for N ranks on this machine running ``memfit <verb> [--config F] overrides``."""
    memfit_args = [verb, *(["--config", config] if config is not None else []), *overrides]
    return ["--standalone", "--nproc_per_node", str(nproc), "-m", "memfit", *memfit_args]


def set_worker_threads(nproc: int, device_type: str) -> None:
    """Set ``OMP_NUM_THREADS`` for the workers (they inherit this process's environment) on CPU: an equal part of
    the CPU cores this process may run on, ``max(1, cores // nproc)``, unless the user set it. torchrun's own
    default, kept on CUDA, is 1 thread per rank."""
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))


def run_torchrun(args: list[str]) -> int:
    """Run torchrun's launcher (``torch.distributed.run``, what the ``torchrun`` command runs) with ``args`` in
    this process, and wait for its workers.

    Prints the command first, so that users learn the launch it stands for. This process is then torchrun's
    agent: it starts the workers (each in a session of its own, with this process's environment), watches them,
    and on SIGINT (Ctrl-C), SIGTERM, SIGHUP or SIGQUIT passes the signal on to them and stops them (SIGKILL after
    torchrun's ``--shutdown_timeout``, 30 s). When a worker fails, it stops the others at once. Should this process
    die without passing a signal on (SIGKILL), each worker stops by itself (:mod:`memfit.lifeline`; this process's
    pid is in ``MEMFIT_LAUNCHER_PID`` for them).

    Args:
        args: torchrun's arguments (see :func:`torchrun_args`).

    Returns:
        0 when every rank finished; 1 when a rank failed (after torchrun's report, which names the rank that
        failed first and its exit code or signal); ``128 + signal`` when a signal stopped the launch.
    """
    # deferred: only the launching process runs torchrun's agent; the ranks (which import this module through the
    # CLI) must not import the elastic agent and its machinery
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    print(f"memfit: running {shlex.join(['torchrun', *args])}", flush=True)
    handlers = {
        sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    }
    launcher_pid = os.environ.get(lifeline.LAUNCHER_PID_ENV)
    os.environ[lifeline.LAUNCHER_PID_ENV] = str(os.getpid())  # the workers' launcher (memfit/lifeline.py)
    try:
        torchrun_main(args)
    except ChildFailedError as exc:
        print(f"memfit: error: a rank failed, so the run stopped:\n{exc}", file=sys.stderr)
        return 1
    except SignalException as exc:
        if exc.sigval != signal.SIGINT:  # on SIGINT (Ctrl-C) rank 0 says so itself
            print(
                f"memfit: stopped by {signal.Signals(exc.sigval).name}; the newest complete checkpoint is kept "
                f"(resume=true continues)",
                file=sys.stderr,
            )
        return 128 + int(exc.sigval)
    finally:  # the agent's handlers raise SignalException: restore this process's own
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if launcher_pid is None:
            os.environ.pop(lifeline.LAUNCHER_PID_ENV, None)
        else:
            os.environ[lifeline.LAUNCHER_PID_ENV] = launcher_pid
    return 0
