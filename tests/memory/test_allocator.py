"""The model of PyTorch's CUDA caching allocator (``memfit.memory.allocator``): rounding, pools, segment sizes, best
fit, splitting and merging, streams, the out-of-memory release and retry, the cuBLAS workspace; each expected
figure worked out by hand in a comment (MiB = 1,048,576 bytes). A randomised timeline is checked against a plain,
slow re-implementation of the same rules.

Speed (not asserted): a synthetic timeline of 50,020 events shaped like a training step (300 persistent
parameters, 32 layers of allocations and frees, a backward pass freeing the saved ones in reverse, 1 in 50 on a
second stream; 1,444 segments at the end) replays in ~98 ms (best of 5, Python 3, one shared AMD EPYC core).
"""

from __future__ import annotations

import random

import pytest

from memfit.memory import allocator as al
from memfit.memory.allocator import AllocatorOutOfMemoryError, CachingAllocator, replay
from memfit.units import KIB, MIB


def test_constants_are_pytorchs():
    # kMinBlockSize 512, kSmallSize 1048576, kSmallBuffer 2097152, kMinLargeAlloc 10485760, kLargeBuffer 20971520,
    # kRoundLarge 2097152 (c10/cuda/CUDACachingAllocator.cpp)
    assert (al.K_MIN_BLOCK_SIZE, al.K_SMALL_SIZE, al.K_SMALL_BUFFER) == (512, 1_048_576, 2_097_152)
    assert (al.K_MIN_LARGE_ALLOC, al.K_LARGE_BUFFER, al.K_ROUND_LARGE) == (10_485_760, 20_971_520, 2_097_152)


def test_round_size_and_segment_size():
    # < 512 -> 512; else up to a multiple of 512
    assert [al.round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]
    # small (<= 1 MiB) -> 2 MiB; large < 10 MiB -> 20 MiB; else up to a multiple of 2 MiB
    assert al.allocation_size(512) == al.allocation_size(MIB) == 2 * MIB
    assert al.allocation_size(MIB + 512) == al.allocation_size(10 * MIB - 512) == 20 * MIB
    assert al.allocation_size(10 * MIB) == 10 * MIB
    assert al.allocation_size(12 * MIB) == 12 * MIB
    assert al.allocation_size(13 * MIB) == 14 * MIB


def test_a_small_request_takes_a_2_mib_segment():
    r = replay([("alloc", "a", 1)])
    # 1 byte -> a 512-byte block split off a new 2 MiB small segment
    assert (r.peak_reserved, r.allocated, r.peak_requested, r.num_segments) == (2 * MIB, 512, 1, 1)
    r = replay([("alloc", "a", 513)])
    assert (r.reserved, r.allocated) == (2 * MIB, 1024)


def test_pytorch_test_memory_stats():
    # test_memory_stats (pytorch test/test_cuda.py): torch.randn(256) on CUDA is 256 * 4 = 1024 active bytes;
    # freed, 0; torch.cuda.empty_cache() then returns its 2 MiB segment
    alloc = CachingAllocator()
    alloc.malloc("tmp", 256 * 4)
    assert (alloc.allocated, alloc.reserved) == (1024, 2 * MIB)
    alloc.free("tmp")
    assert (alloc.allocated, alloc.reserved) == (0, 2 * MIB)
    assert alloc.empty_cache() == 2 * MIB
    assert (alloc.reserved, alloc.peak_reserved, alloc.num_segments) == (0, 2 * MIB, 0)


def test_pytorch_test_memory_snapshot_with_python_layout():
    # test_memory_snapshot_with_python (pytorch test/test_cuda.py), "make x the second block in a segment":
    # rand(2 * 311, 411) = 1,022,568 B -> 1,022,976-byte block in a new 2 MiB segment, freed at once (merges back);
    # unused = rand(310, 410) = 508,400 B -> 508,416 at offset 0; x = rand(311, 411) = 511,284 B -> 511,488 at
    # offset 508,416; then 1000 rand(128) = 512 B each tile the 1,077,248 bytes left: all in the one 2 MiB segment
    alloc = CachingAllocator()
    alloc.malloc("first", 2 * 311 * 411 * 4)
    alloc.free("first")
    alloc.malloc("unused", 310 * 410 * 4)
    alloc.malloc("x", 311 * 411 * 4)
    assert (alloc.address("unused"), alloc.address("x")) == (0, 508_416)
    for i in range(1000):
        alloc.malloc(i, 128 * 4)
    assert (alloc.reserved, alloc.num_segments) == (2 * MIB, 1)
    assert alloc.allocated == 508_416 + 511_488 + 1000 * 512


def test_large_segments_split_and_round():
    events = [("alloc", "a", 5 * MIB), ("alloc", "b", 5 * MIB)]
    r = replay(events)
    # 5 MiB < 10 MiB -> one 20 MiB segment; the second 5 MiB splits its 15 MiB rest: still 20 MiB
    assert (r.peak_reserved, r.num_segments, r.allocated) == (20 * MIB, 1, 10 * MIB)
    r = replay([*events, ("alloc", "c", 12 * MIB)])
    # the 10 MiB rest cannot hold 12 MiB -> a 12 MiB segment: 20 + 12 = 32 MiB
    assert (r.peak_reserved, r.num_segments) == (32 * MIB, 2)
    r = replay([*events, ("alloc", "c", 12 * MIB), ("alloc", "d", 13 * MIB)])
    # 13 MiB -> a 14 MiB segment; its 1 MiB rest is not > 1 MiB, so the block is handed out whole:
    # reserved 20 + 12 + 14 = 46 MiB; allocated 5 + 5 + 12 + 14 = 36 MiB; requested 5 + 5 + 12 + 13 = 35 MiB
    assert (r.peak_reserved, r.num_segments) == (46 * MIB, 3)
    assert (r.peak_allocated, r.peak_requested) == (36 * MIB, 35 * MIB)


def test_a_freed_block_is_reused_and_split():
    # 8 MiB in a 20 MiB segment, freed (merges with its 12 MiB rest), then 6 MiB: best fit is that 20 MiB block,
    # split (14 MiB rest > 1 MiB): no new segment, 6 MiB allocated
    r = replay([("alloc", "a", 8 * MIB), ("free", "a"), ("alloc", "b", 6 * MIB)])
    assert (r.peak_reserved, r.num_segments, r.allocated) == (20 * MIB, 1, 6 * MIB)


def test_best_fit_takes_the_smallest_free_block():
    events = [("alloc", "a", 12 * MIB), ("alloc", "b", 14 * MIB), ("free", "a"), ("free", "b")]
    # two whole free segments, 12 and 14 MiB (26 MiB reserved); 11 MiB takes the 12 MiB one, whose 1 MiB rest is
    # not split: 12 MiB allocated (from the 14 MiB one it would be split: 11 MiB)
    alloc = CachingAllocator()
    for op, key, *n in [*events, ("alloc", "c", 11 * MIB)]:
        alloc.malloc(key, *n) if op == "alloc" else alloc.free(key)
    assert (alloc.reserved, alloc.allocated, alloc.address("c")) == (26 * MIB, 12 * MIB, 0)


def test_freed_neighbours_merge():
    events = [("alloc", k, 6 * MIB) for k in "abc"]
    # a, b, c at 0, 6, 12 MiB of one 20 MiB segment (2 MiB free rest); a and b freed merge into 12 MiB at 0,
    # which then holds a 12 MiB request: still one 20 MiB segment
    r = replay([*events, ("free", "b"), ("free", "a"), ("alloc", "d", 12 * MIB)])
    assert (r.peak_reserved, r.num_segments, r.allocated) == (20 * MIB, 1, 18 * MIB)
    # c freed too: the whole segment is one free block again, which empty_cache releases
    r = replay([*events, ("free", "a"), ("free", "c"), ("free", "b"), ("empty_cache",)])
    assert (r.peak_reserved, r.reserved, r.num_segments, r.num_device_free) == (20 * MIB, 0, 0, 1)


def test_a_large_block_is_not_split_for_a_rest_of_1_mib_or_less():
    # 19.5 MiB -> a 20 MiB segment (>= 10 MiB: rounded up to 2 MiB); the 0.5 MiB rest is not > 1 MiB: not split,
    # 20 MiB allocated; a 0.3 MiB request is small-pool -> a new 2 MiB segment: 22 MiB
    r = replay([("alloc", "a", 19 * MIB + 512 * KIB), ("alloc", "b", 300 * KIB)])
    assert (r.peak_reserved, r.num_segments, r.peak_allocated) == (22 * MIB, 2, 20 * MIB + 300 * KIB)
    # nor does a large request use it: 1.2 MiB needs a new 20 MiB segment: 40 MiB
    r = replay([("alloc", "a", 19 * MIB + 512 * KIB), ("alloc", "b", 1200 * KIB)])
    assert (r.peak_reserved, r.num_segments) == (40 * MIB, 2)
    # 18.5 MiB leaves 1.5 MiB > 1 MiB: split; 1.2 MiB (1,228,800 B) then takes that 1.5 MiB block whole (its
    # 0.3 MiB rest is not > 1 MiB): 20 MiB reserved, 18.5 + 1.5 = 20 MiB allocated
    r = replay([("alloc", "a", 18 * MIB + 512 * KIB), ("alloc", "b", 1200 * KIB)])
    assert (r.peak_reserved, r.num_segments, r.peak_allocated) == (20 * MIB, 1, 20 * MIB)


def test_blocks_are_cached_per_stream():
    # 8 MiB freed on stream 1 is no use to stream 0: a second 20 MiB segment (40 MiB); on stream 1 it is reused
    events = [("alloc", "a", 8 * MIB, 1), ("free", "a")]
    assert replay([*events, ("alloc", "b", 8 * MIB, 0)]).peak_reserved == 40 * MIB
    assert replay([*events, ("alloc", "b", 8 * MIB, 1)]).peak_reserved == 20 * MIB
    assert replay([*events, ("alloc", "b", 8 * MIB)]).num_segments == 2  # stream 0 by default


def test_capacity_releases_free_segments_and_retries():
    events = [("alloc", "a", 30 * MIB), ("free", "a"), ("alloc", "b", 36 * MIB)]
    # unlimited: the free 30 MiB segment cannot hold 36 MiB -> 30 + 36 = 66 MiB reserved
    assert replay(events).peak_reserved == 66 * MIB
    # capacity 40 MiB: 30 + 36 > 40 -> the free 30 MiB segment is released, the retry fits: 36 MiB, peak 36 MiB
    r = replay(events, capacity=40 * MIB)
    assert (r.peak_reserved, r.reserved, r.num_alloc_retries, r.num_device_free, r.oom) == (
        36 * MIB, 36 * MIB, 1, 1, False,
    )  # fmt: skip
    # a split segment in use is not released: 6 MiB more needs 20 MiB, 36 + 20 > 40 with nothing free -> OOM
    over = [*events, ("alloc", "c", 6 * MIB)]
    with pytest.raises(AllocatorOutOfMemoryError) as exc:
        replay(over, capacity=40 * MIB)
    assert (exc.value.requested, exc.value.segment, exc.value.reserved) == (6 * MIB, 20 * MIB, 36 * MIB)
    assert isinstance(exc.value, MemoryError)
    r = replay(over, capacity=40 * MIB, raise_on_oom=False)
    assert (r.oom, r.oom_event, r.peak_reserved, r.peak_reserved_event) == (True, 3, 36 * MIB, 2)


def test_a_partly_used_segment_is_kept_on_retry():
    # a (2 MiB) and b (2 MiB) split one 20 MiB segment; b freed leaves an 18 MiB free block, too small for 22 MiB,
    # which needs a 22 MiB segment: 20 + 22 > 30 MiB, and the partly used segment is not released -> OOM
    events = [("alloc", "a", 2 * MIB), ("alloc", "b", 2 * MIB), ("free", "b"), ("alloc", "c", 22 * MIB)]
    r = replay(events, capacity=30 * MIB, raise_on_oom=False)
    assert (r.oom, r.reserved, r.num_device_free, r.num_alloc_retries) == (True, 20 * MIB, 0, 1)
    # a freed too: the 20 MiB segment is wholly free, released on the retry, and the 22 MiB segment fits
    r = replay([*events[:3], ("free", "a"), events[3]], capacity=30 * MIB)
    assert (r.oom, r.reserved, r.peak_reserved, r.num_device_free) == (False, 22 * MIB, 22 * MIB, 1)


def test_zero_bytes_and_errors():
    # a 0-byte storage takes no block (PyTorch does not call the allocator for it)
    r = replay([("alloc", "e", 0), ("free", "e")])
    assert (r.peak_reserved, r.num_device_alloc) == (0, 0)
    with pytest.raises(ValueError, match="twice"):
        replay([("alloc", "a", 1), ("alloc", "a", 1)])
    with pytest.raises(KeyError, match="not allocated"):
        replay([("free", "a")])
    with pytest.raises(ValueError, match="unknown kind"):
        replay([("malloc", "a", 1)])
    with pytest.raises(ValueError, match="is not"):
        replay([("alloc", "a")])


def test_cublas_workspace_is_allocated_through_the_allocator():
    # :4096:2:16:8 = 4096 KiB * 2 + 16 KiB * 8 = 8,519,680 B (A100, sm 80); :4096:8 = 32 MiB (H100, sm 90)
    assert al.cublas_workspace_bytes(80) == 8_519_680 == 8 * MIB + 128 * KIB
    assert al.cublas_workspace_bytes(90) == al.cublas_workspace_bytes(100) == 32 * MIB
    assert al.CUBLASLT_WORKSPACE_BYTES == MIB
    # on an A100, one per stream: 8,519,680 B -> a 20 MiB segment each (1 MiB < 8.125 MiB < 10 MiB)
    r = replay(al.workspace_events(80, streams=(0, 1)))
    assert (r.peak_reserved, r.allocated) == (40 * MIB, 2 * 8_519_680)
    # on an H100: 32 MiB segments; a separate 1 MiB cuBLASLt workspace takes a 2 MiB small segment
    r = replay(al.workspace_events(90, unified_lt=False))
    assert r.peak_reserved == 32 * MIB + 2 * MIB
    # the context is outside the allocator: a documented estimate between the measured 287 MB and 426 MiB
    assert al.CUDA_CONTEXT_BYTES_ESTIMATE == 512 * MIB


class _Reference:
    """The same rules, written plainly: segments as address-ordered lists of [size, free, stream, small], best fit
    by scanning every free block."""

    def __init__(self):
        self.segments: list[tuple[int, list[list]]] = []  # (base, blocks)
        self.live: dict = {}
        self.next = self.reserved = self.peak = self.allocated = 0

    def malloc(self, key, n, stream):
        size, small = al.round_size(n), al.round_size(n) <= al.K_SMALL_SIZE
        fits = [
            (b[0], base + sum(x[0] for x in blocks[:i]), si, i)
            for si, (base, blocks) in enumerate(self.segments)
            for i, b in enumerate(blocks)
            if b[1] and b[2] == stream and b[3] == small and b[0] >= size
        ]
        if fits:
            _, _, si, i = min(fits)
        else:
            seg = al.allocation_size(size)
            self.segments.append((self.next, [[seg, True, stream, small]]))
            self.next += seg
            self.reserved += seg
            self.peak = max(self.peak, self.reserved)
            si, i = len(self.segments) - 1, 0
        blocks = self.segments[si][1]
        rest = blocks[i][0] - size
        if (rest >= 512) if small else (rest > al.K_SMALL_SIZE):
            blocks.insert(i + 1, [rest, True, stream, small])
            blocks[i][0] = size
        blocks[i][1] = False
        self.allocated += blocks[i][0]
        self.live[key] = blocks[i]

    def free(self, key):
        block = self.live.pop(key)
        self.allocated -= block[0]
        block[1] = True
        for _, blocks in self.segments:
            i = 0
            while i + 1 < len(blocks):
                if blocks[i][1] and blocks[i + 1][1]:
                    blocks[i][0] += blocks.pop(i + 1)[0]
                else:
                    i += 1

    def address(self, key):
        for base, blocks in self.segments:
            offset = 0
            for b in blocks:
                if b is self.live[key]:
                    return base + offset
                offset += b[0]


def test_matches_a_plain_reimplementation_on_a_random_timeline():
    rng = random.Random(1)
    sizes = [1, 700, 4000, 300 * KIB, MIB, MIB + 1, 3 * MIB, 9 * MIB, 11 * MIB + 3, 25 * MIB]
    model, ref = CachingAllocator(), _Reference()
    live: list[int] = []
    for step in range(1500):
        if live and rng.random() < 0.45:
            key = live.pop(rng.randrange(len(live)))
            model.free(key)
            ref.free(key)
        else:
            n, stream = rng.choice(sizes) + rng.randrange(0, 2048), rng.choice((0, 0, 0, 1))
            model.malloc(step, n, stream)
            ref.malloc(step, n, stream)
            live.append(step)
            assert model.address(step) == ref.address(step)
        assert (model.reserved, model.allocated) == (ref.reserved, ref.allocated)
    assert model.peak_reserved == ref.peak
