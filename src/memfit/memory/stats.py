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

import psutil
import torch

GIB = 1024**3


def to_gib(num_bytes: float) -> float:
    """Bytes -> GiB (1024**3 bytes)."""
    return num_bytes / GIB


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
