"""Peak-memory fields of the step record, in GiB (1024**3 bytes), peaks since the last record.

On CUDA (from the caching allocator, ``torch.cuda.memory_stats``):

- ``peak_memory_active``: bytes in tensors that are alive (``active_bytes.all.peak``);
- ``peak_memory_alloc``: bytes allocated to tensors by the allocator (``allocated_bytes.all.peak``);
- ``peak_memory_reserved``: bytes the allocator holds from the driver, cached blocks included
  (``reserved_bytes.all.peak``);
- ``peak_memory_device``: bytes used on the device as the driver reports it (``torch.cuda.mem_get_info``), which
  also counts other processes, the CUDA context and memory the allocator cannot see (paged/managed memory). The
  driver keeps no peak, so this is the maximum over samples taken at every step.

On CPU the three allocator fields are ``None`` (there is no caching allocator) and ``peak_memory_rss`` is the
process's resident set at its highest in the interval: the kernel's high-water mark (Linux ``VmHWM``) when the
process set a new one in the interval, else the highest of the samples a background thread takes every 10 ms
(``/proc/self/statm``; ``psutil`` elsewhere). The thread wakes, takes the GIL and reads a file each time, and on a
busy CPU it preempts a compute thread: every 2 ms it cost 2.4% of a step of the 0.8M model of
``bench/step_profile.py`` on 2 cores (0.6% at 25.6M); every 10 ms, within the noise. The kernel's mark is never
reset, so ``ru_maxrss`` (what ``/usr/bin/time -v`` and schedulers report) and the run's ``peak_memory_rss`` agree.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from memfit import distributed as dist_
from memfit.memory.host import process_rss_bytes
from memfit.units import to_gib


def _read_vmhwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _statm_rss() -> Callable[[], int]:
    """A cheap reader of the current RSS in bytes (:func:`memfit.memory.host.process_rss_bytes`, else ``psutil``)."""
    if process_rss_bytes() is None:
        process = psutil.Process()
        return lambda: process.memory_info().rss
    return lambda: process_rss_bytes() or 0


class _RssSampler(threading.Thread):
    """Samples the process's RSS every ``interval`` seconds and keeps the maximum since the last :meth:`take`."""

    def __init__(self, interval: float = 0.010) -> None:
        super().__init__(name="memfit-rss-sampler", daemon=True)
        self._read = _statm_rss()
        self._interval = interval
        self._lock = threading.Lock()
        self._max = self._read()
        self._stopping = threading.Event()  # not ``_stop``: ``Thread.join`` calls a method of that name

    def run(self) -> None:
        while not self._stopping.wait(self._interval):
            # read under the lock: a sample read before a take() and stored after it would land in the new
            # interval (a freed block's bytes reported as the next interval's peak)
            with self._lock:
                rss = self._read()
                if rss > self._max:
                    self._max = rss

    def take(self) -> int:
        """The highest sample since the last call (the current RSS included); a new interval starts."""
        now = self._read()
        with self._lock:
            peak, self._max = max(self._max, now), now
        return peak

    def stop(self) -> None:
        self._stopping.set()


class PeakMemory:
    """Tracks the memory peaks between two step records.

    Args:
        device: the training device.

    Call :meth:`sample` once per step (cheap: no device sync), :meth:`read_and_reset` at each record, and
    :meth:`close` at the end (on CPU it stops the sampling thread).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._sampler = None if self.cuda else _RssSampler()
        if self._sampler is not None:
            self._sampler.start()
        self._hwm = _read_vmhwm()
        self._max_sampled = 0
        self.reset()

    def reset(self) -> None:
        """Start a new interval."""
        self._max_sampled = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()

    def sample(self) -> None:
        """Take one sample of device-level usage (CUDA: the driver keeps no peak)."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self._max_sampled = max(self._max_sampled, total - free)

    def read_and_reset(self) -> dict[str, float | None]:
        """The peaks since the last call, in GiB, then start a new interval.

        Returns:
            ``peak_memory_active``, ``peak_memory_alloc``, ``peak_memory_reserved`` (``None`` on CPU), and
            ``peak_memory_device`` on CUDA or ``peak_memory_rss`` on CPU.
        """
        self.sample()
        if self.cuda:
            stats = torch.cuda.memory_stats(self.device)
            out: dict[str, float | None] = {
                "peak_memory_active": to_gib(stats.get("active_bytes.all.peak", 0)),
                "peak_memory_alloc": to_gib(stats.get("allocated_bytes.all.peak", 0)),
                "peak_memory_reserved": to_gib(stats.get("reserved_bytes.all.peak", 0)),
                "peak_memory_device": to_gib(self._max_sampled),
            }
        else:
            rss = self._sampler.take()
            hwm = _read_vmhwm()
            if hwm is not None and self._hwm is not None and hwm > self._hwm:
                rss = (
                    hwm  # the process's highest ever was reached in this interval: the kernel's exact figure
                )
            self._hwm = hwm
            out = {
                "peak_memory_active": None,
                "peak_memory_alloc": None,
                "peak_memory_reserved": None,
                "peak_memory_rss": to_gib(rss),
            }
        self.reset()
        return out

    def close(self) -> None:
        """Stop the sampling thread (CPU)."""
        if self._sampler is not None:
            self._sampler.stop()


def process_peak_rss() -> int | None:
    """The process's resident-set high-water mark in bytes (``VmHWM``: what ``ru_maxrss`` and ``/usr/bin/time -v``
    report), or ``None`` where the kernel does not say."""
    return _read_vmhwm()


def tracked_memory_fields(tracker) -> dict[str, Any]:
    """The step record's tracked-memory fields since the last record; the tracker then starts a new peak.

    Sharded, every rank tracked itself: the breakdown logged is that of the rank whose tracked peak is highest
    (the ranks' results are gathered here, a host sync, so call it at logging boundaries only), and each
    category's own peak is its maximum over ranks.

    Args:
        tracker: the run's :class:`~memfit.memory.tracker.MemoryTracker` (on every rank).

    Returns:
        ``memory_breakdown`` (GiB by category at the peak), ``memory_peak_phase``, ``memory_category_peaks`` (GiB,
        each category's own maximum, reached at different moments), and, sharded, ``memory_peak_rank``.
        Categories are :attr:`~memfit.memory.tracker.MemoryTracker.categories` (``unsharded_parameters`` only
        for a sharded model).
    """
    mine = (tracker.peak_bytes, tracker.peak_breakdown, tracker.peak_phase, tracker.category_peaks)
    tracker.reset_peak()
    ranks = dist_.all_gather_objects(mine)
    fullest = max(range(len(ranks)), key=lambda r: ranks[r][0])  # the lowest such rank on a tie
    _, breakdown, phase, _ = ranks[fullest]
    fields = {
        "memory_breakdown": {c: to_gib(breakdown[c]) for c in tracker.categories},
        "memory_peak_phase": phase,
        "memory_category_peaks": {c: to_gib(max(r[3][c] for r in ranks)) for c in tracker.categories},
    }
    if len(ranks) > 1:
        fields["memory_peak_rank"] = fullest
    return fields
