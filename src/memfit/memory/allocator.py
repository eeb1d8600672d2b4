"""A model of PyTorch's CUDA caching allocator: from a timeline of storage allocations and frees (traced on CPU,
no GPU needed) predict what ``torch.cuda.max_memory_reserved()`` reports, the ``peak_memory_reserved`` of a step.

The model replays PyTorch's ``DeviceCachingAllocator`` (``c10/cuda/CUDACachingAllocator.cpp``, PyTorch 2.x; the
size constants moved to ``c10/core/AllocatorConfig.h`` in later 2.x releases, same values) for its default
configuration: no ``expandable_segments``, ``max_split_size`` unlimited, no ``garbage_collection_threshold``, no
``roundup_power2_divisions``, no memory fraction. What it does, step by step:

- ``round_size``: a request of ``n`` bytes becomes a block of ``max(512, n rounded up to a multiple of 512)``.
- ``get_pool``: blocks of at most 1 MiB go to the *small* pool, larger ones to the *large* pool.
- ``get_free_block``: best fit, the smallest free block of the same pool and the same stream that is at least the
  rounded size; among equal sizes the lowest address (the pool is a ``std::set`` ordered by stream, size, address).
  The two rules that keep a request off an oversize block compare with ``max_split_size``, which is unlimited by
  default, so by default they never apply: a 2 MiB request may take (and split) a free 500 MiB block.
- on a miss, ``alloc_block`` calls ``cudaMalloc`` for a new *segment* of ``get_allocation_size``: 2 MiB for a
  small block, 20 MiB for a large block under 10 MiB, else the block rounded up to a multiple of 2 MiB.
- ``should_split``: the block found is split when the rest is at least 512 bytes (small pool) or more than 1 MiB
  (large pool); else it is handed out whole. ``torch.cuda.memory_allocated()`` (the ``allocated_bytes`` stat)
  counts the whole block: a 13 MiB request takes a 14 MiB segment whole and counts 14 MiB.
- ``free_block``: a freed block goes back to its pool and merges with its free neighbours in its segment.
- segments are never returned to CUDA on this path, so reserved memory only grows, except when ``cudaMalloc``
  fails: then ``release_cached_blocks`` frees every segment that is entirely free (all pools, all streams) and
  ``cudaMalloc`` is tried once more; if it fails again, the allocator raises ``OutOfMemoryError``. Here
  ``cudaMalloc`` fails when the reserved bytes plus the new segment would exceed ``capacity``.

A block freed on one stream is only reused by requests on that stream, so memory that one stream frees is no use
to another: FSDP's all-gathers on their own stream keep their own cache (give those allocations their stream id).

Not modelled: ``recordStream`` (a block used on another stream goes back to the pool only once that stream's work
is done, a time a CPU trace does not have), CUDA graphs' private pools, ``expandable_segments``,
``max_split_size_mb`` / ``roundup_power2_divisions`` / ``garbage_collection_threshold`` settings, the addresses
``cudaMalloc`` returns (segments here are laid out one after another in the order they are allocated, from
address 0; only ties between free blocks of equal size, same pool and stream, depend on them), allocations
made outside the caching allocator (NCCL's buffers, cuBLAS/cuDNN internals), and the device's own fragmentation.

Beyond the reserved bytes, ``nvidia-smi`` shows the CUDA context (:data:`CUDA_CONTEXT_BYTES_ESTIMATE`). The cuBLAS
workspace is *not* beyond it: PyTorch takes it from the caching allocator (:func:`cublas_workspace_bytes`,
:func:`workspace_events`), so it is part of the reserved bytes and belongs in the replayed timeline.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from memfit.units import KIB, MIB

K_MIN_BLOCK_SIZE = 512
"""Bytes: every block is rounded up to a multiple of this (``kMinBlockSize``, c10/cuda/CUDACachingAllocator.cpp;
c10/core/AllocatorConfig.h in later 2.x)."""
K_SMALL_SIZE = 1 * MIB
"""Bytes: the largest block of the small pool (``kSmallSize``, same files); also the least rest of a large block
that is split off (a large block is split only when more than this would remain)."""
K_SMALL_BUFFER = 2 * MIB
"""Bytes: the segment ``cudaMalloc``-ed for a small block (``kSmallBuffer``, same files)."""
K_MIN_LARGE_ALLOC = 10 * MIB
"""Bytes: large blocks under this get a :data:`K_LARGE_BUFFER` segment (``kMinLargeAlloc``, same files)."""
K_LARGE_BUFFER = 20 * MIB
"""Bytes: the segment of a large block under :data:`K_MIN_LARGE_ALLOC` (``kLargeBuffer``,
c10/cuda/CUDACachingAllocator.cpp; ``large_segment_size_`` default in c10/core/AllocatorConfig.h in later 2.x)."""
K_ROUND_LARGE = 2 * MIB
"""Bytes: larger blocks get a segment of their size rounded up to a multiple of this (``kRoundLarge``, same files)."""

CUDA_CONTEXT_BYTES_ESTIMATE = 512 * MIB
"""Bytes of device memory the CUDA context holds outside the caching allocator (driver, the CUDA kernels loaded
so far): ``nvidia-smi`` minus ``torch.cuda.memory_reserved()``. An *estimate*: it depends on the GPU, the driver and
the CUDA and PyTorch versions, and grows as kernels are lazily loaded (``CUDA_MODULE_LOADING=LAZY``, PyTorch's
default since 1.13). Public measurements at CUDA initialisation: 287,047,680 bytes with lazy loading vs 666,632,192
eager (https://github.com/pytorch/pytorch/pull/86509), "~300MB" (ptrblck,
https://github.com/pytorch/pytorch/issues/107667), "around 400MB" with CUDA >= 11.7
(https://github.com/pytorch/pytorch/issues/109888), 426 MiB on an RTX 6000 Ada with PyTorch 2.10 + CUDA 13.0
(https://github.com/unslothai/unsloth-zoo/pull/1053); 512 MiB leaves room for the kernels a training step loads
(cuBLAS, NCCL, attention). NCCL's communication buffers are not included."""

CUBLAS_WORKSPACE_BYTES_DEFAULT = 4096 * KIB * 2 + 16 * KIB * 8
"""Bytes of PyTorch's default cuBLAS workspace before Hopper: ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8`` = 8 MiB +
128 KiB = 8,519,680 (``parseChosenWorkspaceSize`` in aten/src/ATen/cuda/CublasHandlePool.cpp; checked by
``test_cublas_workspace_explicit_allocation`` in test/test_cuda.py)."""
CUBLAS_WORKSPACE_BYTES_HOPPER = 4096 * KIB * 8
"""Bytes of PyTorch's default cuBLAS workspace on Hopper (sm 9.x) and, in recent PyTorch, Blackwell (sm 10.x-12.x):
``:4096:8`` = 32 MiB (same function and test)."""
CUBLASLT_WORKSPACE_BYTES = 1024 * KIB
"""Bytes of PyTorch's default cuBLASLt workspace, ``CUBLASLT_WORKSPACE_SIZE`` = 1024 KiB
(``parseCUDABlasLtWorkspaceSize`` in aten/src/ATen/cuda/CublasHandlePool.cpp). Where cuBLASLt shares the cuBLAS
workspace (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, the default of recent non-fbcode builds) it takes no memory of
its own."""


def round_size(nbytes: int) -> int:
    """Bytes of the block a request of ``nbytes`` takes (``round_size``): at least 512, a multiple of 512."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(block_bytes: int) -> int:
    """Bytes of the segment ``cudaMalloc``-ed when no cached block fits a (rounded) block (``get_allocation_size``).

    Args:
        block_bytes: the rounded size, from :func:`round_size`.
    """
    if block_bytes <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if block_bytes < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-block_bytes // K_ROUND_LARGE) * K_ROUND_LARGE


def cublas_workspace_bytes(sm: int) -> int:
    """Bytes of the cuBLAS workspace PyTorch allocates by default, once per (cuBLAS handle, stream) at the first
    matmul on that stream, through the caching allocator (``setWorkspaceForHandle`` ->
    ``CUDACachingAllocator::get()->allocate``), and keeps: part of the reserved bytes, held until
    ``torch._C._cuda_clearCublasWorkspaces()``.

    Args:
        sm: the compute capability as major * 10 + minor: 80 for A100, 90 for H100/H200, 100 for B200.

    Returns:
        :data:`CUBLAS_WORKSPACE_BYTES_HOPPER` (32 MiB) for sm 90-129, else :data:`CUBLAS_WORKSPACE_BYTES_DEFAULT`
        (8 MiB + 128 KiB). Blackwell's 32 MiB is from PyTorch's main branch; earlier 2.x releases gave 32 MiB to
        sm 90 only. ``CUBLAS_WORKSPACE_CONFIG`` overrides both.
    """
    return CUBLAS_WORKSPACE_BYTES_HOPPER if 90 <= sm < 130 else CUBLAS_WORKSPACE_BYTES_DEFAULT


def workspace_events(sm: int, streams: Sequence[int] = (0,), *, unified_lt: bool = True) -> list[tuple]:
    """Allocation events of the persistent cuBLAS (and cuBLASLt) workspaces, to put in a timeline for :func:`replay`
    where the first matmul on each stream runs (at the start, if that is not known).

    Args:
        sm: the compute capability, as for :func:`cublas_workspace_bytes`.
        streams: the stream ids that run matmuls (one workspace per stream).
        unified_lt: cuBLASLt shares the cuBLAS workspace (no allocation of its own); False adds a
            :data:`CUBLASLT_WORKSPACE_BYTES` allocation per stream.

    Returns:
        ``("alloc", key, nbytes, stream)`` events; keys are ``("cublas_workspace", stream)`` and
        ``("cublaslt_workspace", stream)``; they are never freed.
    """
    events: list[tuple] = []
    for stream in streams:
        events.append(("alloc", ("cublas_workspace", stream), cublas_workspace_bytes(sm), stream))
        if not unified_lt:
            events.append(("alloc", ("cublaslt_workspace", stream), CUBLASLT_WORKSPACE_BYTES, stream))
    return events


class AllocatorOutOfMemoryError(MemoryError):
    """``cudaMalloc`` of a new segment failed even after every free segment was released: PyTorch's
    ``torch.OutOfMemoryError``.

    Attributes:
        requested: bytes of the request that failed.
        segment: bytes of the segment it needed.
        reserved: bytes reserved when it failed (after the release).
        capacity: the capacity, in bytes.
    """

    def __init__(self, requested: int, segment: int, reserved: int, capacity: int):
        self.requested, self.segment, self.reserved, self.capacity = requested, segment, reserved, capacity
        super().__init__(
            f"modelled CUDA out of memory: a request of {requested} bytes needs a new segment of {segment} bytes, "
            f"and {reserved} bytes reserved in segments still in use + {segment} > capacity {capacity} bytes"
        )


@dataclass
class AllocatorReplay:
    """What the modelled allocator reports after a replay, in bytes (the names of ``torch.cuda.memory_stats()``).

    Attributes:
        peak_reserved: ``max_memory_reserved()``: the most bytes held in segments at any time.
        peak_allocated: ``max_memory_allocated()``: the most bytes in blocks handed out (block sizes: rounding and
            unsplit rests included).
        peak_requested: the most bytes requested and not freed (``requested_bytes.all.peak``).
        reserved: ``memory_reserved()`` at the end.
        allocated: ``memory_allocated()`` at the end.
        num_segments: segments held at the end (``segment.all.current``).
        num_device_alloc: ``cudaMalloc`` calls (``num_device_alloc``).
        num_device_free: segments released (``num_device_free``).
        num_alloc_retries: ``cudaMalloc`` calls that failed and were retried after a release (``num_alloc_retries``).
        oom: whether the replay stopped at an out-of-memory (only with ``raise_on_oom=False``).
        oom_event: index of that event in the timeline, or None.
        peak_reserved_event: index of the event at which the reserved bytes first reached their peak (None when
            nothing was reserved).
    """

    peak_reserved: int
    peak_allocated: int
    peak_requested: int
    reserved: int
    allocated: int
    num_segments: int
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int
    oom: bool = False
    oom_event: int | None = None
    peak_reserved_event: int | None = None


class _Block:
    __slots__ = ("addr", "size", "prev", "next", "free", "pool")

    def __init__(self, addr: int, size: int, pool: tuple[bool, int]):
        self.addr = addr
        self.size = size
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.free = True
        self.pool = pool  # (small, stream): the free list it belongs to


class CachingAllocator:
    """The allocator's state, one request at a time (what :func:`replay` drives).

    Args:
        capacity: bytes the allocator may reserve in all (the device's memory less the CUDA context and anything
            else on it); None for no limit.
    """

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._free: dict[
            tuple[bool, int], list[tuple[int, int]]
        ] = {}  # pool -> sorted (size, addr) of free blocks
        self._blocks: dict[int, _Block] = {}  # addr -> free block
        self._live: dict[Hashable, tuple[_Block | None, int]] = {}  # key -> (block, requested bytes)
        self._next_addr = 0
        self.reserved = self.allocated = self.requested = 0
        self.peak_reserved = self.peak_allocated = self.peak_requested = 0
        self.num_segments = self.num_device_alloc = self.num_device_free = self.num_alloc_retries = 0

    def malloc(self, key: Hashable, nbytes: int, stream: int = 0) -> None:
        """Allocate ``nbytes`` for storage ``key`` on ``stream`` (``DeviceCachingAllocator::malloc``).

        A 0-byte request takes no block (PyTorch does not call the allocator for empty storage); its free is a no-op.

        Raises:
            ValueError: ``key`` is already allocated, or ``nbytes`` < 0.
            AllocatorOutOfMemoryError: a new segment does not fit in ``capacity`` even after releasing every free
                segment; the state is as the release left it.
        """
        if key in self._live:
            raise ValueError(f"allocator: storage {key!r} is allocated twice without a free")
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"allocator: storage {key!r} has a negative size ({nbytes} bytes)")
            self._live[key] = (None, 0)
            return
        size = round_size(nbytes)
        pool = (size <= K_SMALL_SIZE, stream)
        free = self._free.get(pool)
        if free is None:
            free = self._free[pool] = []
        i = bisect_left(free, (size, -1))
        if i < len(free):
            addr = free.pop(i)[1]
            block = self._blocks.pop(addr)
        else:
            block = self._new_segment(nbytes, size, pool)
        rest = block.size - size
        if (rest >= K_MIN_BLOCK_SIZE) if pool[0] else (rest > K_SMALL_SIZE):  # should_split
            remaining = _Block(block.addr + size, rest, pool)
            remaining.prev, remaining.next = block, block.next
            if block.next is not None:
                block.next.prev = remaining
            block.next = remaining
            block.size = size
            self._blocks[remaining.addr] = remaining
            insort(free, (rest, remaining.addr))
        block.free = False
        self._live[key] = (block, nbytes)
        self.allocated += block.size
        self.requested += nbytes
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.requested > self.peak_requested:
            self.peak_requested = self.requested

    def _new_segment(self, nbytes: int, size: int, pool: tuple[bool, int]) -> _Block:
        segment = allocation_size(size)
        if self.capacity is not None and self.reserved + segment > self.capacity:
            self.num_alloc_retries += 1
            self.empty_cache()
            if self.reserved + segment > self.capacity:
                raise AllocatorOutOfMemoryError(nbytes, segment, self.reserved, self.capacity)
        block = _Block(self._next_addr, segment, pool)
        self._next_addr += segment
        self.reserved += segment
        self.num_segments += 1
        self.num_device_alloc += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return block

    def free(self, key: Hashable) -> None:
        """Free storage ``key``: its block goes back to its pool and merges with free neighbours (``free_block``).

        Raises:
            KeyError: ``key`` is not allocated.
        """
        try:
            block, nbytes = self._live.pop(key)
        except KeyError:
            raise KeyError(f"allocator: free of storage {key!r}, which is not allocated") from None
        if block is None:
            return
        self.allocated -= block.size
        self.requested -= nbytes
        free = self._free[block.pool]
        blocks = self._blocks
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            del free[bisect_left(free, (prev.size, prev.addr))]
            del blocks[prev.addr]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if prev.prev is not None:
                prev.prev.next = block
        if nxt is not None and nxt.free:
            del free[bisect_left(free, (nxt.size, nxt.addr))]
            del blocks[nxt.addr]
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        block.free = True
        blocks[block.addr] = block
        insort(free, (block.size, block.addr))

    def empty_cache(self) -> int:
        """Release every segment that is entirely free, in all pools and streams (``release_cached_blocks``, as on
        an out-of-memory retry or ``torch.cuda.empty_cache()``).

        Returns:
            The bytes released.
        """
        released = 0
        for free in self._free.values():
            whole = [(s, a) for s, a in free if (b := self._blocks[a]).prev is None and b.next is None]
            if not whole:
                continue
            gone = set(whole)
            free[:] = [e for e in free if e not in gone]
            for s, a in whole:
                del self._blocks[a]
                released += s
            self.num_segments -= len(whole)
            self.num_device_free += len(whole)
        self.reserved -= released
        return released

    def address(self, key: Hashable) -> int:
        """The modelled address of storage ``key``'s block: segments lie one after another from 0 in the order
        they were allocated (released ones leave their range unused), so the first segment's blocks have their
        offsets in it as addresses."""
        block = self._live[key][0]
        if block is None:
            raise ValueError(f"allocator: storage {key!r} has 0 bytes and no block")
        return block.addr

    def result(self, **extra) -> AllocatorReplay:
        """The statistics so far, as an :class:`AllocatorReplay` (``extra`` fills its remaining fields)."""
        return AllocatorReplay(
            peak_reserved=self.peak_reserved,
            peak_allocated=self.peak_allocated,
            peak_requested=self.peak_requested,
            reserved=self.reserved,
            allocated=self.allocated,
            num_segments=self.num_segments,
            num_device_alloc=self.num_device_alloc,
            num_device_free=self.num_device_free,
            num_alloc_retries=self.num_alloc_retries,
            **extra,
        )


def replay(
    events: Iterable[tuple], capacity: int | None = None, *, raise_on_oom: bool = True
) -> AllocatorReplay:
    """Replay a timeline of storage allocations and frees through the modelled caching allocator.

    Args:
        events: in order, each one of
            ``("alloc", key, nbytes)`` or ``("alloc", key, nbytes, stream)``: storage ``key`` (any hashable, unique
            while allocated) takes ``nbytes`` bytes on ``stream`` (an int; default 0, the default stream);
            ``("free", key)``: storage ``key`` is freed (on the stream it was allocated on);
            ``("empty_cache",)``: ``torch.cuda.empty_cache()``.
        capacity: bytes the allocator may reserve (the device's memory less the CUDA context and any other use);
            None for no limit.
        raise_on_oom: raise :class:`AllocatorOutOfMemoryError` when a segment does not fit; False stops the replay
            there and returns the statistics so far with ``oom=True`` and ``oom_event`` set.

    Returns:
        The statistics; ``peak_reserved`` is what ``torch.cuda.max_memory_reserved()`` would report.

    Raises:
        ValueError: an event of an unknown kind or shape, a key allocated twice, a negative size.
        KeyError: a free of a key that is not allocated.
        AllocatorOutOfMemoryError: see ``raise_on_oom``.
    """
    alloc = CachingAllocator(capacity)
    peak, peak_event = 0, None
    index = -1
    for index, event in enumerate(events):
        op = event[0]
        if op == "alloc":
            try:
                alloc.malloc(*event[1:])
            except AllocatorOutOfMemoryError:
                if raise_on_oom:
                    raise
                return alloc.result(oom=True, oom_event=index, peak_reserved_event=peak_event)
            except TypeError:
                raise ValueError(
                    f'allocator: event {index} {event!r} is not ("alloc", key, nbytes[, stream]) with a hashable key'
                ) from None
            if alloc.reserved > peak:
                peak, peak_event = alloc.reserved, index
        elif op == "free":
            if len(event) != 2:
                raise ValueError(f'allocator: event {index} {event!r} is not ("free", key)')
            alloc.free(event[1])
        elif op == "empty_cache":
            alloc.empty_cache()
        else:
            raise ValueError(
                f"allocator: event {index} {event!r}: unknown kind {op!r} (alloc, free, empty_cache)"
            )
    return alloc.result(peak_reserved_event=peak_event)
