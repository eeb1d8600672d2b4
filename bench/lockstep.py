"""Processes that take turns one training step at a time, each step timed by the process's own running time
(``bench/peers.py --lockstep``, ``bench/levers.py``).

On shared cores another tenant can slow every step by a third for tens of seconds; runs measured one after another
catch such spells unevenly, steps taken in turns share them. Only one child runs at any time: the others are
stopped with SIGSTOP (each child in a session of its own, so its whole process group), and time spent stopped
counts for no step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


class Stepper:
    """A child process that runs one training step at a time, when the parent lets it (``--lockstep``).

    The child runs in a session of its own, and the parent stops and continues its whole process group (SIGSTOP,
    SIGCONT). It counts the child's finished steps by the lines holding ``marker`` that the child appends to
    ``progress`` after each step, and keeps the child's running time: the time of a step is the running time
    between the parent seeing its line and seeing the previous one's (the poll every :data:`POLL_SECONDS` errs by as
    much at both ends). Time spent stopped counts for no step, so a slow spell of the machine falls on whichever
    process was running at that moment, step by step, instead of on a whole run.

    Args:
        cmd: the child's command line.
        env: its environment.
        log_dir: where its ``stdout.txt`` and ``stderr.txt`` go.
        progress: the file it appends a line to after each step.
        marker: the text that makes a line of ``progress`` a step's.
    """

    def __init__(
        self, cmd: list[str], env: dict[str, str], log_dir: Path, progress: Path, marker: str
    ) -> None:
        self.cmd, self.env, self.log_dir, self.progress, self.marker = cmd, env, log_dir, progress, marker
        self.marks: list[float] = []  # running seconds when each step's line was seen
        self.ran: tuple[int, float, float, str] | None = None  # run_measured's tuple, once it has exited
        self._running_before = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.progress.unlink(missing_ok=True)  # an earlier run's lines in a reused work directory
        with open(self.log_dir / "stdout.txt", "w") as out, open(self.log_dir / "stderr.txt", "w") as err:
            self._since = time.perf_counter()
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=out, stderr=err, start_new_session=True
            )

    @property
    def alive(self) -> bool:
        return self.ran is None

    def running_seconds(self) -> float:
        now = time.perf_counter()
        return self._running_before + (0.0 if self._since is None else now - self._since)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self._running_before, self._since = self.running_seconds(), None

    def resume(self) -> None:
        self._since = time.perf_counter()
        os.killpg(self.proc.pid, signal.SIGCONT)

    def step(self) -> bool:
        """Wait while it runs until one more step line appears (True) or it exits (False)."""
        want = len(self.marks) + 1
        while True:
            # the line first: a child can write its last one and exit between two looks (its running time then
            # ends at its exit, a little late)
            seen = self._lines() >= want
            if seen or self._reaped():
                if seen or self._lines() >= want:
                    self.marks.append(self.running_seconds())
                    return True
                return False
            time.sleep(POLL_SECONDS)

    def finish(self) -> None:
        """Let it run to its end (the rest of the run, alone)."""
        while not self._reaped():
            time.sleep(POLL_SECONDS)

    def kill(self) -> None:
        """End it if it is still there (an interrupted benchmark leaves no stopped process behind)."""
        if self.alive and hasattr(self, "proc"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def complete(self, steps: int) -> bool:
        """Whether it exited cleanly with all ``steps`` step lines seen."""
        return self.ran is not None and self.ran[0] == 0 and len(self.marks) == steps

    def later_step_seconds(self) -> list[float]:
        """The running time of each step after the first (whose span from the start includes the start-up)."""
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def _lines(self) -> int:
        try:
            return self.progress.read_text().count(self.marker)
        except FileNotFoundError:
            return 0

    def _reaped(self) -> bool:
        pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)  # with its rusage, as run_measured
        if pid == 0:
            return False
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = self.running_seconds()
        self._running_before, self._since = seconds, None
        stdout = (self.log_dir / "stdout.txt").read_text()
        self.ran = (self.proc.returncode, usage.ru_maxrss / 1024, seconds, stdout)
        return True


POLL_SECONDS = 0.002
"""How often the parent looks for a lockstep child's step line (a few microseconds of its CPU a look)."""


def run_lockstep(steppers: list[Stepper], steps: int) -> None:
    """Run the children in turns of one step each, only one running at any time.

    Each first runs alone through its start-up and first step (imports, loading, compilation), then they take
    turns, a step each, in the given order; after its last step a child runs to its end alone.
    """

    def turn(s: Stepper) -> None:  # one step, then stopped; after its last, to its end
        if s.step() and s.alive and len(s.marks) < steps:
            s.pause()
        elif s.alive:
            s.finish()

    try:
        for s in steppers:
            s.start()
            turn(s)
        while live := [s for s in steppers if s.alive]:
            for s in live:
                s.resume()
                turn(s)
    finally:
        for s in steppers:
            s.kill()
