"""One measured child process: its resident set sampled every 0.1 s, its output lines timestamped, its peak from
``/usr/bin/time -v``, phases split at the lines it prints; and the hard memory cap a peer runs under.

The parent never imports torch (a child's ``ru_maxrss`` would include the parent's high-water mark at the fork).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from memfit.units import GIB

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_SECONDS = 0.1
TIME = Path("/usr/bin/time")


def _proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from ``/proc/PID/stat``)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            out[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return out


def process_tree(root: int, include_root: bool) -> tuple[int, list[int]]:
    """The resident bytes and the pids of ``root``'s descendants (and of ``root`` itself with ``include_root``)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    pids = [root] if include_root else []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack += children.get(pid, [])
    return sum(_proc_rss(pid) for pid in pids), pids


@dataclass
class Measured:
    """A child process as this script saw it."""

    returncode: int
    lines: list[tuple[float, str]]
    """Each stdout/stderr line with its arrival, seconds after the start."""
    samples: list[tuple[float, int]]
    """(seconds after the start, resident bytes of the process tree)."""
    wall_seconds: float
    max_rss_bytes: int | None
    """``/usr/bin/time -v``'s Maximum resident set size (None without /usr/bin/time)."""
    signal: int | None
    killed_by_guard: bool = False
    command: list[str] = field(default_factory=list)

    def first(self, pattern: str) -> float | None:
        """The arrival of the first line matching ``pattern`` (a regex, from the line's start)."""
        return next((t for t, line in self.lines if re.match(pattern, line)), None)

    def peak(self, start: float, end: float) -> int | None:
        """The largest sample in [start, end]; the first one after ``end`` when none falls inside."""
        inside = [rss for t, rss in self.samples if start <= t <= end]
        if inside:
            return max(inside)
        return next((rss for t, rss in self.samples if t > end), None)


def run_measured(cmd: list[str], log: Path, guard_bytes: int | None, tag: str) -> Measured:
    """Run ``cmd`` under ``/usr/bin/time -v``, sampling its process tree's RSS every 0.1 s in a thread and
    timestamping each output line (also written to ``log`` and echoed to stderr, prefixed ``[tag]``).

    Args:
        cmd: the command.
        log: its output, each line with its time.
        guard_bytes: kill the measured processes (SIGKILL) when their RSS passes this (None: never), so that a run
            that overshoots fails alone rather than the machine's OOM killer choosing.
        tag: the prefix of the echoed lines.
    """
    timed = TIME.exists()
    time_file = log.with_name(log.name + ".time")
    wrapped = [str(TIME), "-v", "-o", str(time_file), *cmd] if timed else list(cmd)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(
        wrapped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env,
        start_new_session=True, cwd=ROOT,
    )  # fmt: skip
    samples: list[tuple[float, int]] = []
    stop, guard_hit = threading.Event(), threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss, pids = process_tree(proc.pid, include_root=not timed)  # not /usr/bin/time's own few MiB
            samples.append((time.monotonic() - start, rss))
            if guard_bytes is not None and rss > guard_bytes and not guard_hit.is_set():
                guard_hit.set()
                for pid in pids:  # the measured processes (ours), not /usr/bin/time: it reports the kill
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            stop.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines: list[tuple[float, str]] = []
    try:
        with open(log, "w") as f:
            for line in proc.stdout:
                t = time.monotonic() - start
                lines.append((t, line.rstrip("\n")))
                f.write(f"{t:9.2f}  {line}")
                f.flush()
                print(f"  [{tag} {t:7.1f}s] {line}", end="", file=sys.stderr, flush=True)
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: end the child's group (it is ours: start_new_session)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop.set()
        sampler.join()
    wall = time.monotonic() - start
    max_rss, sig = None, -code if code < 0 else None
    if timed and time_file.exists():
        text = time_file.read_text()
        if m := re.search(r"Maximum resident set size \(kbytes\): (\d+)", text):
            max_rss = int(m.group(1)) * 1024
        if m := re.search(r"Command terminated by signal (\d+)", text):
            sig = int(m.group(1))
        if m := re.search(r"Exit status: (\d+)", text):
            code = int(m.group(1)) if sig is None else 128 + sig
    return Measured(code, lines, samples, wall, max_rss, sig, guard_hit.is_set(), wrapped)


def split_phases(
    run: Measured, order: list[tuple[str, float | None]]
) -> tuple[dict[str, float | None], dict[str, float], str | None]:
    """The peak RSS (GiB) and seconds of each phase, and the phase the process ended in when it did not reach the
    last marker.

    Args:
        run: the measured process.
        order: ``(phase, the arrival of the line that ends it, or None when never seen)``, in order; a phase whose
            end is missing while a later one's is present is merged into the next.
    """
    peaks: dict[str, float | None] = {}
    seconds: dict[str, float] = {}
    start, ended_in = 0.0, None
    for i, (name, end) in enumerate(order):
        if end is None:
            if any(e is not None for _, e in order[i + 1 :]):
                continue
            end, ended_in = run.wall_seconds, name
        peak = run.peak(start, end)
        peaks[name] = None if peak is None else round(peak / GIB, 3)
        seconds[name] = round(end - start, 2)
        start = end
        if ended_in is not None:
            break
    return peaks, seconds, ended_in


def gib(value: float | int | None) -> float | None:
    return None if value is None else round(value / GIB, 3)


CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")


@contextlib.contextmanager
def memory_cap(cap_bytes: int, name: str) -> Iterator[tuple[list[str], str]]:
    """The prefix that runs a command under a hard memory cap, and its description, in the first way this machine
    offers:

    1. ``systemd-run --scope`` with ``MemoryMax`` (cgroup v2: resident memory, no swap) where systemd runs;
    2. a cgroup v1 memory cgroup of its own (``memory.limit_in_bytes``: resident memory and page cache, the cache
       reclaimed before the kernel's OOM killer ends a process of the group) where this process may make one,
       removed afterwards;
    3. ``prlimit --as``: the address space, so mapped files and reserved but untouched memory count too, and it
       bites well before the resident memory reaches the cap.

    Raises:
        SystemExit: none of the three is here.
    """
    systemd = ["systemd-run", "--quiet", "--scope", "-p", f"MemoryMax={cap_bytes}", "-p", "MemorySwapMax=0"]
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()  # cgroup v2, where MemoryMax applies
    if unified and shutil.which("systemd-run") and Path("/run/systemd/system").is_dir():
        if subprocess.run([*systemd, "true"], capture_output=True, timeout=60).returncode == 0:
            yield (
                [*systemd, "--"],
                f"systemd-run --scope -p MemoryMax={cap_bytes} (cgroup v2: resident memory)",
            )
            return
    group = CGROUP_V1_MEMORY / f"memfit-bench-{name}-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:  # no cgroup v1 memory controller here, or not ours to write
        group = None
    else:
        try:
            (group / "memory.limit_in_bytes").write_text(str(cap_bytes))
        except OSError:
            group.rmdir()
            group = None
    if group is not None:
        try:  # the shell joins the group, then becomes the command
            enter = f'echo $$ > {shlex.quote(str(group / "cgroup.procs"))} && exec "$@"'
            yield ["sh", "-c", enter, "sh"], f"cgroup v1 memory.limit_in_bytes={cap_bytes} (resident memory)"
        finally:
            with contextlib.suppress(OSError):
                group.rmdir()
        return
    if shutil.which("prlimit"):
        yield ["prlimit", f"--as={cap_bytes}", "--"], f"prlimit --as={cap_bytes} (address space)"
        return
    raise SystemExit(f"{name}: no cgroup (v2 through systemd-run, or v1) and no prlimit here for the cap")
