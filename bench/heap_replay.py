"""How much of a CPU step's free heap its own allocations explain: the traced step's storage allocations and frees
(``memfit estimate``'s trace on fake tensors, allocations recorded as for a CUDA target) replayed through a model of
glibc's ``malloc`` (below), at a few mmap thresholds, with the heap's top trimmed as glibc does or held by a block
the trace never sees freed. docs/memory.md ("Host memory (RSS) on CPU", the 8 MiB threshold) quotes its figures
for the 3B DPO stand-in and the full 28-layer step; nothing in memfit uses this model.

The model (glibc 2.3x ``malloc/malloc.c``, the main arena, one thread): a request of ``n`` bytes is a chunk of
``max(32, n + 8 rounded up to 16)``; it takes the best-fitting free chunk of the heap (split, the rest left free),
else the top chunk; else a chunk of at least the mmap threshold gets its own mapping (its size plus 8, rounded up to
the page) and a smaller one grows the heap. A freed mapping is unmapped, and under the dynamic threshold the
threshold rises to its size (at most 32 MiB) and the trim threshold to twice it; a freed heap chunk merges with its
free neighbours, into the top where it borders it, and the top is trimmed past the trim threshold. Resident: the
mappings, the heap below its top, and the top's untrimmed pages. Not modelled: tcache and fast bins, other threads'
arenas, huge pages.

Reproduce (a checkpoint directory of the run's shape; the run's other keys as for ``memfit estimate``)::

    .venv/bin/python bench/heap_replay.py checkpoint_dir=DIR method=full dtype=bf16 optimizer.name=adafactor \
        optimizer_in_backward=true max_grad_norm=0 seq_len=512 objective=dpo data.format=preference \
        data.template=chatml data.path=PAIRS.jsonl device=cpu batch_size=1
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Iterable
from dataclasses import dataclass

PAGE = 4096
"""Bytes of a page: a mapped chunk is a whole number of them."""
DEFAULT_MMAP_THRESHOLD = 128 * 1024
"""glibc's initial mmap threshold (``DEFAULT_MMAP_THRESHOLD_MIN``)."""
DEFAULT_MMAP_THRESHOLD_MAX = 32 * 1024**2
"""The highest the dynamic threshold rises on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)."""
DEFAULT_TOP_PAD = 128 * 1024
"""What ``systrim`` and ``sysmalloc`` keep on top of the heap (``DEFAULT_TOP_PAD``)."""
_SIZE_SZ = 8
_ALIGN = 16
_MINSIZE = 32


def chunk_size(nbytes: int) -> int:
    """The heap chunk glibc's ``malloc`` serves a request of ``nbytes`` with (``request2size``), bytes."""
    return max(_MINSIZE, (nbytes + _SIZE_SZ + _ALIGN - 1) & ~(_ALIGN - 1))


def mapped_size(chunk: int) -> int:
    """The mapping ``sysmalloc`` makes for a chunk of ``chunk`` bytes at or above the threshold, bytes."""
    return (chunk + _SIZE_SZ + PAGE - 1) // PAGE * PAGE


@dataclass
class HeapReplay:
    """What :func:`replay_heap` found."""

    peak_resident: int
    """Bytes: the highest of mapped chunks plus the heap's resident extent over the events."""
    peak_live: int
    """Bytes: the requests live at that point (what a tracker counts)."""
    free_heap: int
    """Bytes: the heap's free chunks below its top at that point (``mallinfo2().fordblks`` less the top chunk)."""
    mmap_threshold: int
    """The threshold when the events end (risen, under the dynamic threshold)."""


class GlibcHeap:
    """The main arena of glibc's ``malloc`` (the module doc), fed requests and frees by key.

    Args:
        mmap_threshold: bytes; glibc's initial threshold by default.
        dynamic: whether the threshold rises as mapped chunks are freed (glibc's default; ``False`` once a
            process sets it, ``mallopt(M_MMAP_THRESHOLD)`` or ``MALLOC_MMAP_THRESHOLD_``).
        trim: whether a chunk freed next to the top joins it (glibc); ``False``: the top stays where it is, as if a
            block the trace never sees freed held it.
    """

    def __init__(
        self, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, *, dynamic: bool = True, trim: bool = True
    ) -> None:
        self.trim = trim
        self.mmap_threshold = mmap_threshold
        self.trim_threshold = 2 * mmap_threshold if dynamic else 128 * 1024
        self.dynamic = dynamic
        self.top = 0  # the top chunk's address: the heap's resident extent below it
        self.top_resident = 0  # bytes of the top chunk written once and not trimmed since
        self.mapped = 0  # bytes of mapped chunks
        self.live = 0  # bytes requested and not freed
        self._free_by_size: list[tuple[int, int]] = []  # (size, address), sorted
        self._free_at: dict[int, int] = {}  # address -> size of each free chunk
        self._free_ending: dict[int, int] = {}  # end address -> address of each free chunk
        self._used: dict[
            object, tuple[int, int, int]
        ] = {}  # key -> (address or -1 if mapped, size, requested)

    @property
    def resident(self) -> int:
        """Bytes resident now: mapped chunks, the heap below its top and the top's pages not trimmed."""
        return self.mapped + self.top + self.top_resident

    @property
    def free_heap(self) -> int:
        """Bytes of free chunks below the heap's top."""
        return sum(self._free_at.values())

    def malloc(self, key: object, nbytes: int) -> None:
        """Serve ``nbytes`` for ``key`` (a key not live)."""
        nb = chunk_size(nbytes)
        self.live += nbytes
        i = bisect.bisect_left(self._free_by_size, (nb, -1))
        if i < len(self._free_by_size):  # best fit among the free chunks
            size, addr = self._free_by_size[i]
            self._unlink(addr)
            if size - nb >= _MINSIZE:
                self._link(addr + nb, size - nb)
            else:
                nb = size
            self._used[key] = (addr, nb, nbytes)
            return
        if nb >= self.mmap_threshold:
            size = mapped_size(nb)
            self.mapped += size
            self._used[key] = (-1, size, nbytes)
            return
        self._used[key] = (self.top, nb, nbytes)  # from the top chunk, the heap grown as needed
        self.top += nb
        self.top_resident = max(0, self.top_resident - nb)

    def free(self, key: object) -> None:
        """Free ``key``'s chunk (a live key)."""
        addr, size, nbytes = self._used.pop(key)
        self.live -= nbytes
        if addr < 0:
            self.mapped -= size
            chunk = size - _SIZE_SZ  # the mapped chunk's own size, as glibc compares it
            if self.dynamic and self.mmap_threshold < chunk <= DEFAULT_MMAP_THRESHOLD_MAX:
                self.mmap_threshold = chunk
                self.trim_threshold = 2 * chunk
            return
        before = self._free_ending.get(addr)
        if before is not None:  # merge with the free chunk before
            size += addr - before
            self._unlink(before)
            addr = before
        after = self._free_at.get(addr + size)
        if after is not None:
            self._unlink(addr + size)
            size += after
        if (
            self.trim and addr + size == self.top
        ):  # borders the top chunk: becomes part of it, trimmed past the threshold
            self.top = addr
            self.top_resident += size
            if self.top_resident >= self.trim_threshold:
                self.top_resident = DEFAULT_TOP_PAD
        else:
            self._link(addr, size)

    def _link(self, addr: int, size: int) -> None:
        bisect.insort(self._free_by_size, (size, addr))
        self._free_at[addr] = size
        self._free_ending[addr + size] = addr

    def _unlink(self, addr: int) -> None:
        size = self._free_at.pop(addr)
        del self._free_ending[addr + size]
        del self._free_by_size[bisect.bisect_left(self._free_by_size, (size, addr))]


def replay_heap(
    events: Iterable[tuple],
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
    *,
    dynamic: bool = True,
    trim: bool = True,
) -> HeapReplay:
    """Replay allocation events through :class:`GlibcHeap` and report the peak resident bytes.

    Args:
        events: ``("alloc", key, nbytes, ...)`` and ``("free", key)`` in order
            (:func:`memfit.planner.estimate.allocation_events`); a free of a key never allocated is skipped.
        mmap_threshold: the threshold when the events begin, bytes.
        dynamic: whether it rises (:class:`GlibcHeap`).

    Returns:
        The :class:`HeapReplay`.
    """
    heap = GlibcHeap(mmap_threshold, dynamic=dynamic, trim=trim)
    best = HeapReplay(0, 0, 0, mmap_threshold)
    for event in events:
        if event[0] == "alloc":
            heap.malloc(event[1], event[2])
            if heap.resident > best.peak_resident:
                best = HeapReplay(heap.resident, heap.live, heap.free_heap, 0)
        elif event[1] in heap._used:
            heap.free(event[1])
    best.mmap_threshold = heap.mmap_threshold
    return best


THRESHOLDS = ((8 << 20, False), (4 << 20 | 64 << 10, False), (128 << 10, False), (128 << 10, True))
"""(threshold, dynamic) replayed: the bf16 full fine-tune's 8 MiB, 4 MiB + 64 KiB, 128 KiB fixed, and glibc's own."""


def main(overrides: list[str]) -> None:
    from memfit.config import load_config
    from memfit.memory.tracker import MemoryTracker
    from memfit.planner import estimate as E
    from memfit.planner.estimate import run_model_config
    from memfit.units import GIB

    class Recording(MemoryTracker):  # the trace records its allocations on a CPU target too
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "record_allocations": True})

    E.MemoryTracker = Recording
    cfg = load_config(None, overrides, needs_weights=False)
    mcfg = run_model_config(cfg)
    traced = E._trace(cfg, mcfg, 1, cfg.seq_len or mcfg.max_seq_len, "cpu", marks=False)
    events = E.allocation_events(traced.tracker, set())
    peak = max(sum(b.values()) for _, _, b in traced.timeline)
    print(f"{mcfg.num_layers} layers: {len(events):,} events, traced peak {peak / GIB:.3f} GiB")
    print("| threshold | dynamic | top | peak resident (GiB) | live then (GiB) | free heap then (GiB) |")
    print("|---:|---|---|---:|---:|---:|")
    for threshold, dynamic in THRESHOLDS:
        for trim in (True, False):
            r = replay_heap(events, threshold, dynamic=dynamic, trim=trim)
            top = "trimmed" if trim else "held"
            print(f"| {threshold:,} | {dynamic} | {top} | {r.peak_resident / GIB:.3f} | {r.peak_live / GIB:.3f} | "
                  f"{r.free_heap / GIB:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
