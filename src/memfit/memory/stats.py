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
process's resident-set high-water mark (Linux ``VmHWM``), reset after every record through
``/proc/self/clear_refs``; where that is unavailable it is the maximum of RSS samples taken at every step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import torch

from memfit import distributed as dist_
from memfit.units import to_gib


def _read_vmhwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_vmhwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Tracks the memory peaks between two step records.

    Args:
        device: the training device.

    Call :meth:`sample` once per step (cheap: no device sync) and :meth:`read_and_reset` at each record.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._process = psutil.Process()
        self._hwm_resettable = (not self.cuda) and _read_vmhwm() is not None and _reset_vmhwm()
        self._max_sampled = 0
        self.reset()

    def reset(self) -> None:
        """Start a new interval."""
        self._max_sampled = 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._hwm_resettable:
            _reset_vmhwm()
        self.sample()

    def sample(self) -> None:
        """Take one sample of what has no peak counter (device-level usage on CUDA, RSS without VmHWM reset)."""
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            self._max_sampled = max(self._max_sampled, total - free)
        elif not self._hwm_resettable:
            self._max_sampled = max(self._max_sampled, self._process.memory_info().rss)

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
            rss = _read_vmhwm() if self._hwm_resettable else self._max_sampled
            out = {
                "peak_memory_active": None,
                "peak_memory_alloc": None,
                "peak_memory_reserved": None,
                "peak_memory_rss": to_gib(rss or 0),
            }
        self.reset()
        return out


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
