"""``memfit pretrain|finetune nproc=N ...``: start N ranks on this machine through torchrun.

``nproc=N`` is a CLI shortcut, not a :class:`~memfit.config.TrainConfig` key. With N > 1 and no launcher around
this process yet, the CLI validates the config here (as each of the N ranks will), then runs::

    python -m torch.distributed.run --standalone --nproc_per_node N -m memfit <verb> <the same arguments>

(``python -m torch.distributed.run`` is the ``torchrun`` command, run with this process's interpreter), waits for
it and returns its exit status. Under torchrun already (``WORLD_SIZE`` set), ``nproc`` must equal the launch's
``WORLD_SIZE``; multi-node runs use torchrun directly (see docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys

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
    nproc, rest = None, []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key.strip() != NPROC_KEY:
            rest.append(item)
            continue
        value = value.strip()
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(
                f"config key '{NPROC_KEY}': the number of ranks to start on this machine must be an integer >= 1, "
                f"got {value!r}"
            )
        nproc = int(value)
    return nproc, rest


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
        import torch

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


@contextlib.contextmanager
def validating_as_ranks(nproc: int):
    """Set ``WORLD_SIZE=nproc`` for the duration: :func:`memfit.config.load_config` then applies the checks of
    sharded runs (``distributed.*`` and the switches that do not work sharded) in this process, as each rank
    will, so that a bad combination fails before any worker starts."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(nproc)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved


def worker_environment(nproc: int, device_type: str) -> dict[str, str]:
    """The environment of the launcher and its workers: this process's, plus ``OMP_NUM_THREADS`` on CPU.

    On CPU each rank gets an equal part of this process's CPU cores (``max(1, cores // nproc)``) unless the user
    set ``OMP_NUM_THREADS``; torchrun's own default is 1 thread per rank. On CUDA torchrun's default is kept.
    """
    env = dict(os.environ)
    if device_type == "cpu" and "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    return env


def _terminal_delivers_signals() -> bool:
    """This process is in its terminal's foreground process group: Ctrl-C reaches its children (same group)
    from the terminal itself."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def run_torchrun(args: list[str], env: dict[str, str]) -> int:
    """Run ``torchrun args`` (as ``python -m torch.distributed.run``) and wait for it.

    Prints the command first, so that users learn the launch it stands for. SIGTERM sent to this process is
    forwarded to torchrun, which stops its workers; so is SIGINT, unless this process is in the terminal's
    foreground, where Ctrl-C already reaches torchrun and the workers (one process group). Either way this
    process keeps waiting until torchrun has exited.

    Args:
        args: torchrun's arguments (see :func:`torchrun_args`).
        env: the environment of torchrun and its workers.

    Returns:
        torchrun's exit status (1 when a rank failed: torchrun's report above names it); ``128 + signal``
        when this process got SIGINT or SIGTERM, or torchrun died of a signal.
    """
    print(f"memfit: starting {shlex.join(['torchrun', *args])}", flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env)
    received: list[int] = []

    def forward(signum: int, _frame) -> None:
        received.append(signum)
        if proc.poll() is None and not (signum == signal.SIGINT and _terminal_delivers_signals()):
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:  # on SIGINT rank 0 said so itself
        if received[0] != signal.SIGINT:
            print(
                f"memfit: stopped by {signal.Signals(received[0]).name}; the newest complete checkpoint is kept "
                f"(resume=true continues)",
                file=sys.stderr,
            )
        return 128 + received[0]
    if status < 0:  # torchrun itself died of a signal
        print(f"memfit: torchrun was killed by {signal.Signals(-status).name}", file=sys.stderr)
        return 128 - status
    if status != 0:
        print(
            f"memfit: torchrun exited with status {status} (a rank failed; see its report above)",
            file=sys.stderr,
        )
    return status
