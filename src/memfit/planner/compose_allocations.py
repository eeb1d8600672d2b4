"""The caching allocator's events of an L-layer step composed from traces of the same step with 3 and 4 layers.

The reserved peak (``torch.cuda.max_memory_reserved()``) is not a sum of bytes: it comes from replaying the step's
allocations and frees, in order, through the model of PyTorch's caching allocator
(:func:`memfit.memory.allocator.replay`), where a freed block is reused by a later request it fits. So where
:mod:`memfit.planner.compose` composes the byte totals of each event, this module composes the *events*: the
L-layer step's whole allocation sequence, built from the 4-layer trace's, which the replay then runs as it would run
a full trace's. Nothing is modelled: every event is one the traces made; what composing assumes is checked event by
event, and where it does not hold (:class:`memfit.planner.compose.NotComposable`) the estimator traces the whole
model.

**Units.** The 4-layer trace's events are cut at the decoder layers' marks (:class:`memfit.planner.compose.LayerMarks`)
into segments. A layer's forward segment (``F``) and its backward segment (``B``) are the *units* of a run (one run
of forwards and one of backwards per pass), indexed by the layer. Inside the segments that are not a layer's (the
first pass's embedding, ``I``; the head and loss, ``H``; and the tail of layer 0's backward: the embedding's backward,
clipping, the optimizer step), what runs once per parameter (registering the model states, ``zero_grad``, a
``foreach`` update) makes runs of units too: the events the 4-layer trace has beyond the 3-layer one's are one unit,
and the periodic stretch around them, four units of that length. Where two such runs meet (under sharded Muon, the
AdamW part's per-norm updates, then ``zero_grad``'s per-layer frees of the gradients), the matcher may cut one
run's unit around an event of the other's, since a run's units are alike; the inserts are then placed again so
that each is one unit of a run (:func:`_regrouped`).

**Composing.** The L-layer run of a run of four units ``0 1 2 3`` is ``0 1 2 ... 2 3``: unit 2 stands for every
layer from 2 to L - 2 (a layer with layers on both sides). Each free is translated to the allocation it frees in
the L-layer step: within one unit, or to a fixed event, as it is; to another unit, by the same offset in layers
(the layer before, the same layer's forward, the gradient of its parameters in the backward run); from a fixed
event to a unit, to the first two or the last layer (a fixed event that frees what one of the middle layers
allocated would leave the other middle layers' allocations live: not composable). The allocation a free lands on
must be the one the trace freed (the same bytes on the same stream) and still live.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from operator import sub

from memfit.planner.compose import UNITS, LayerTrace, NotComposable, Tag

PAIRED = {0: 0, 1: 1, 2: 1, 3: 2}
"""The 3-layer trace's layer that each of the 4-layer trace's pairs with (:mod:`memfit.planner.compose`)."""

Home = tuple  # ("fixed", index) or (run, unit, offset)


@dataclass
class _Run:
    """A run of :data:`UNITS` units: ``starts[u]`` to ``starts[u] + lengths[u]`` are unit ``u``'s event indices."""

    key: tuple
    starts: list[int]
    lengths: list[int]


def _segments(trace: LayerTrace) -> list[tuple[Tag, int, int]]:
    starts = [(0, ("I", 0, None)), *zip(trace.allocation_marks, (t for _, t in trace.marks), strict=True)]
    ends = [s for s, _ in starts[1:]] + [len(trace.allocations)]
    return [(tag, start, end) for (start, tag), end in zip(starts, ends, strict=True)]


def _signatures(events: list[tuple]) -> list[tuple]:
    """What must agree between two events for one to stand for the other: an allocation's bytes and stream; for a
    free, those of the allocation it frees."""
    alloc = {}
    out = []
    for e in events:
        if e[0] == "alloc":
            alloc[e[1]] = ("free", e[2], e[3])
            out.append(("alloc", e[2], e[3]))
        else:
            out.append(alloc.get(e[1], ("free",)))
    return out


def _nested_runs(
    tag: Tag, sig4: list, span4: tuple[int, int], sig3: list, span3: tuple[int, int]
) -> tuple[list[_Run], dict[int, int]]:
    """The runs inside a segment that is not a layer's, and its events whose bytes grow with the layers.

    The events the 4-layer segment has beyond the 3-layer one's are each one unit; its run is the periodic stretch
    of :data:`UNITS` units around it. Where the two segments differ by more than inserted events, the stretch is
    compared again without the bytes: an event paired with one of other bytes (a buffer of one element per
    parameter: clipping's stacked norms) grows by their difference per layer.

    Returns:
        The runs, and ``{event index: the 3-layer event's bytes}`` of the events whose bytes grow.
    """
    a4, b4 = span4
    a3, b3 = span3
    s4, s3 = sig4[a4:b4], sig3[a3:b3]
    if s4 == s3:
        return [], {}
    inserts: list[tuple[int, int]] = []
    placed: list[tuple[int, int, int]] = []  # (i1, j1, j2): the inserts where the matcher put them
    grows: dict[int, int] = {}
    for code, i1, i2, j1, j2 in _differences(s3, s4):
        if code == "insert":
            placed.append((i1, j1, j2))
            continue
        # one block inserted, which the matcher split around events it paired: look for it in the region and one
        # block's length of the equal events on each side (a block of a periodic run may start before the region)
        m = (j2 - j1) - (i2 - i1)
        w = min(max(m, 0), i1, j1)
        v = min(max(m, 0), len(s3) - i2, len(s4) - j2)
        block = _one_insert(s3[i1 - w : i2 + v], s4[j1 - w : j2 + v])
        if block is not None:
            inserts.append((j1 - w + block, j1 - w + block + m))
            continue
        # pair each of the 3-layer region's events with the next of the 4-layer's that has its signature, else
        # with the next allocation (or free) of more bytes on its stream, which grows; what is left is inserted
        at = j1
        for k in range(i1, i2):
            x3 = s3[k]
            same = next((n for n in range(at, j2) if s4[n] == x3), None)
            if same is None:
                same = next(
                    (n for n in range(at, j2) if len(s4[n]) == len(x3) == 3 and _grown(s4[n], x3)),
                    None,
                )
                if same is None:
                    raise NotComposable(f"segment {tag}: the allocations differ beyond one layer's more")
                if x3[0] == "alloc":
                    grows[a4 + same] = x3[1]
            if same > at:
                inserts.append((at, same))
            at = same + 1
        if at < j2:
            inserts.append((at, j2))
    inserts += _regrouped(s3, s4, placed)
    runs = []
    for j1, j2 in sorted(inserts):
        floor = runs[-1].starts[-1] + runs[-1].lengths[-1] - a4 if runs else 0
        if j2 <= floor:
            raise NotComposable(f"segment {tag}: its runs of per-layer allocations overlap")
        for lo, m in _periodic(s4, j1, j2, tag, floor):
            runs.append(_Run((tag, len(runs)), [a4 + lo + u * m for u in range(UNITS)], [m] * UNITS))
    for first, second in zip(runs, runs[1:], strict=False):
        if first.starts[-1] + first.lengths[-1] > second.starts[0]:
            raise NotComposable(f"segment {tag}: its runs of per-layer allocations overlap")
    if any(i in range(r.starts[0], r.starts[-1] + r.lengths[-1]) for r in runs for i in grows):
        raise NotComposable(f"segment {tag}: an allocation that grows with the layers inside a per-layer run")
    return runs, grows


def _periodic(s4: list, j1: int, j2: int, tag: Tag, floor: int = 0) -> list[tuple[int, int]]:
    """The runs (first event, unit length) that the events ``j1`` to ``j2`` of ``s4`` are one unit of: the periodic
    stretch around them holds :data:`UNITS` units; else the block is the end of one run and the start of the next
    (a ``foreach`` op's allocations, then its frees), split where both halves are. No run starts before ``floor``
    (the end of the run before): where two runs meet, an event alike in both (Adam-mini's one-element state of a
    layer's last matrix, then of its first norm) is the first's, and the second starts after it."""

    def run(a: int, b: int, floor: int) -> int | None:
        m = b - a
        lo, hi = (
            max(a, floor),
            b,
        )  # from ``a`` on the stretch is periodic (each event the one m before), so from lo
        while lo > floor and s4[lo - 1] == s4[lo - 1 + m]:
            lo -= 1
        while hi < len(s4) and s4[hi] == s4[hi - m]:
            hi += 1
        if hi - lo >= UNITS * m:
            return lo
        if hi - lo < (UNITS - 1) * m:
            return None
        # three like units: the first or the last differs a little at its edge (the first parameter's update
        # frees what the parameter before the run left); the one that differs less
        head, tail = hi - UNITS * m, lo
        if head < floor and tail + UNITS * m > len(s4):
            return None

        def unlike(first: int) -> int:
            return sum(s4[first + k] != s4[first + m + k] for k in range(m))

        if head < floor:
            return tail
        if tail + UNITS * m > len(s4):
            return head
        return (
            head
            if unlike(head) <= sum(s4[tail + 3 * m + k] != s4[tail + 2 * m + k] for k in range(m))
            else tail
        )

    whole = run(j1, j2, floor)
    if whole is not None:
        return [(whole, j2 - j1)]
    for k in range(j1 + 1, j2):
        first = run(j1, k, floor)
        second = None if first is None else run(k, j2, first + UNITS * (k - j1))
        if first is not None and second is not None:
            return [(first, k - j1), (second, j2 - k)]
    raise NotComposable(f"segment {tag}: a layer's more allocations are not one of {UNITS} like units")


def _is_unit(s4: list, j1: int, j2: int) -> bool:
    """Whether the events ``j1`` to ``j2`` of ``s4`` are one unit of a run, or two (:func:`_periodic`)."""
    try:
        _periodic(s4, j1, j2, ("", 0, None))
    except NotComposable:
        return False
    return True


def _regrouped(s3: list, s4: list, placed: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The blocks ``(j1, j2)`` of ``s4`` inserted into ``s3``, from the matcher's inserts ``(i1, j1, j2)``.

    Two runs next to each other, each one unit longer in the 4-layer trace (the AdamW updates of a layer's two norms,
    one after the other, then ``zero_grad`` freeing each layer's gradient), make inserts that the matcher may place
    anywhere in their runs, since a run's units are alike: it can cut one unit in two around an event of the other
    run's. Where inserts less than :data:`MERGE` events apart are not all a run's unit, they are placed again: the
    first placement, in the stretch they span and as many events on each side as they hold, of as many blocks
    (:func:`_placements`) that are each a unit of a run. Else they are left as the matcher put them (and
    :func:`_periodic` says they are not).
    """
    units: dict[tuple[int, int], bool] = {}  # blocks recur across placements: each is checked once

    def unit(a: int, b: int) -> bool:
        if (a, b) not in units:
            units[a, b] = _is_unit(s4, a, b)
        return units[a, b]

    clusters: list[list[tuple[int, int, int]]] = []
    for insert in placed:
        if clusters and insert[0] - clusters[-1][-1][0] < MERGE:
            clusters[-1].append(insert)
        else:
            clusters.append([insert])
    out: list[tuple[int, int]] = []
    for cluster in clusters:
        blocks = [(j1, j2) for _i1, j1, j2 in cluster]
        if len(cluster) > 1 and not all(unit(j1, j2) for j1, j2 in blocks):
            n = sum(j2 - j1 for j1, j2 in blocks)
            i1, j1 = cluster[0][0], cluster[0][1]
            i2, j2 = cluster[-1][0], cluster[-1][2]
            w = min(n, i1, j1)
            v = min(n, len(s3) - i2, len(s4) - j2)
            for found in _placements(s3[i1 - w : i2 + v], s4[j1 - w : j2 + v], len(cluster)):
                again = [(j1 - w + a, j1 - w + b) for a, b in found]
                if all(unit(a, b) for a, b in again):
                    blocks = again
                    break
        out += blocks
    return out


PLACED = 2
"""The most inserted blocks :func:`_placements` places in one stretch."""
PLACED_EVENTS = 64
"""The most inserted events :func:`_placements` places (its search grows with their count and the stretch's
length, about ``length**2 * events`` comparisons for two blocks); more are left where the matcher put them."""


def _placements(s3: list, s4: list, count: int) -> Iterator[list[tuple[int, int]]]:
    """Each way ``s4`` is ``s3`` with ``count`` (at most :data:`PLACED`) blocks of events inserted: the blocks'
    ``(start, end)`` in ``s4``, the earliest first; none past :data:`PLACED_EVENTS` inserted events."""
    n = len(s4) - len(s3)
    if not 1 <= count <= PLACED or not count <= n <= PLACED_EVENTS:
        return
    suffix = 0  # the events the two end with alike: one block from p on leaves s3[p:] there
    while suffix < len(s3) and s4[-1 - suffix] == s3[-1 - suffix]:
        suffix += 1
    for p in range(len(s3) + 1):
        if p and s4[p - 1] != s3[p - 1]:
            return
        if count == 1:
            if len(s3) - p <= suffix:
                yield [(p, p + n)]
            continue
        for m in range(1, n - count + 2):
            for rest in _placements(s3[p:], s4[p + m :], count - 1):
                yield [(p, p + m), *((p + m + a, p + m + b) for a, b in rest)]


def _grown(x4: tuple, x3: tuple) -> bool:
    """Event ``x4`` is ``x3`` (an allocation or its free, on the same stream) of more bytes."""
    return x4[0] == x3[0] and x4[2] == x3[2] and x4[1] > x3[1]


def _one_insert(s3: list, s4: list) -> int | None:
    """Where one contiguous block inserted into ``s3`` makes ``s4`` (its start in ``s4``), or None."""
    m = len(s4) - len(s3)
    if m <= 0:
        return None
    for p in range(len(s3) + 1):
        if s4[:p] == s3[:p] and s4[p + m :] == s3[p:]:
            return p
    return None


MERGE = 8
"""Differences between two segments this few events apart are one region (compared again without the bytes)."""


def _differences(s3: list, s4: list) -> list[tuple[str, int, int, int, int]]:
    """The opcodes of ``s3`` -> ``s4`` that are not ``equal``: ``insert`` where only events were inserted, else a
    ``region`` spanning the differences (and the inserts) less than :data:`MERGE` events apart."""
    out: list[list] = []
    for code, i1, i2, j1, j2 in difflib.SequenceMatcher(None, s3, s4, autojunk=False).get_opcodes():
        if code == "equal":
            continue
        near = out and i1 - out[-1][2] < MERGE and j1 - out[-1][4] < MERGE
        if near and "region" in (out[-1][0], "insert" if code == "insert" else "region"):
            out[-1][0] = "region"
            out[-1][2], out[-1][4] = i2, j2
        else:
            out.append([code if code == "insert" else "region", i1, i2, j1, j2])
    return [tuple(o) for o in out]


Relation = tuple[int, int]  # (slope +1 or -1, intercept): the unit a unit's free lands on, in the 4-layer run


def _homologs(
    sig4: list, runs: dict[tuple, _Run], events: list[tuple], allocated_at: dict[int, int]
) -> dict[tuple, list[list[int | None]]]:
    """For each run, for each unit, each event's offset in unit 1 (the middle layers' template) where the two
    units pair up event by event, ``None`` for an event unit 1 has not (an edge unit's own: layer 0's all-gather
    under FSDP2, which the later layers' prefetch puts in the layer before). Events pair by their signature and
    by whether what they allocate or free stays inside the unit: the last layer's backward fetches its own input
    (freed inside it) before it prefetches the next layer's (freed in the next), two allocations alike in bytes."""
    freed_at = {e[1]: i for i, e in enumerate(events) if e[0] == "free"}

    def within(i: int, a: int, b: int) -> bool:
        other = freed_at.get(events[i][1]) if events[i][0] == "alloc" else allocated_at.get(events[i][1])
        return other is not None and a <= other < b

    out = {}
    for key, run in runs.items():

        def signed(u: int, run: _Run = run) -> list[tuple]:
            a, b = run.starts[u], run.starts[u] + run.lengths[u]
            return [(sig4[i], within(i, a, b)) for i in range(a, b)]

        ref = signed(1)
        maps = []
        for u in range(UNITS):
            unit = signed(u)
            if unit == ref:
                maps.append(list(range(len(unit))))
                continue
            # matched from the end: where an edge unit has more events alike than unit 1 (the last layer's backward
            # fetches its own input and the RoPE tables before the events unit 1 runs too), the one nearest the
            # events that follow is unit 1's homolog
            pairs: list[int | None] = [None] * len(unit)
            n, r = len(unit), len(ref)
            for code, i1, i2, j1, _j2 in difflib.SequenceMatcher(
                None, unit[::-1], ref[::-1], autojunk=False
            ).get_opcodes():
                if code == "equal":
                    for k in range(i2 - i1):
                        pairs[n - 1 - (i1 + k)] = r - 1 - (j1 + k)
            maps.append(pairs)
        out[key] = maps
    return out


def _relations(
    events: list[tuple],
    home: list[Home],
    runs: dict[tuple, _Run],
    allocated_at: dict[int, int],
    homologs: dict[tuple, list[list[int | None]]],
) -> dict[tuple[tuple, int], Relation]:
    """For each free at an offset of a run's units (by its :func:`_homologs` offset): the unit of the run it frees
    in, as a function of its own unit, where units 1 and 2 (those with a unit on both sides, as the middle layers
    the composed run copies) agree: the same run and homologous event, the unit ``u + d`` (a run in the same
    order: a layer's activations, freed in its backward) or ``c - u`` (in the reverse order: a ``foreach`` op's
    results, freed last first). Where unit 1 frees what an edge unit alone has (FSDP2's all-gather of layer 0,
    freed two layers on), units 2 and 3 say it."""
    seen: dict[tuple[tuple, int], dict[int, tuple]] = {}
    for run in runs.values():
        for u in (1, 2, 3):
            for offset in range(run.lengths[u]):
                i = run.starts[u] + offset
                hom = homologs[run.key][u][offset]
                if events[i][0] != "free" or home[i] != (run.key, u, offset) or hom is None:
                    continue
                ref = home[allocated_at[events[i][1]]]
                if ref[0] != "fixed":
                    ref = (ref[0], ref[1], homologs[ref[0]][ref[1]][ref[2]])
                seen.setdefault((run.key, hom), {})[u] = ref
    out = {}
    for key, refs in seen.items():
        for pair in ((1, 2), (2, 3)):
            found = [(u, refs[u]) for u in pair if u in refs]
            if len(found) != 2 or any(r[0] == "fixed" or r[2] is None for _, r in found):
                continue
            if len({r[::2] for _, r in found}) > 1:
                continue
            if pair == (2, 3) and 1 in refs and refs[1][0] != "fixed" and refs[1][2] is not None:
                continue  # unit 1 frees a homologous event: units 1 and 2 disagree
            units = [(u, r[1]) for u, r in found]
            for slope in (1, -1):
                intercepts = {v - slope * u for u, v in units}
                if len(intercepts) == 1:
                    out[key] = (slope, intercepts.pop())
                    break
            break
    return out


def _related(relation: Relation, unit: int, layers: int) -> int:
    """The unit that unit ``unit`` of a run of ``layers`` units frees in, by ``relation`` (of the 4-unit run)."""
    slope, intercept = relation
    return unit + intercept if slope == 1 else intercept + (layers - UNITS) - unit


def _template(unit: int, layers: int) -> int:
    """The 4-layer unit that layer ``unit`` of the L-layer run copies."""
    return unit if unit < 2 else 3 if unit == layers - 1 else 2


def _edge(unit: int, layers: int) -> int:
    """The L-layer unit that a fixed event's reference to a 4-layer unit stands for."""
    if unit == 2:
        raise NotComposable("an event outside the layers frees what a middle layer allocated")
    return unit if unit < 2 else layers - 1


def compose_allocations(three: LayerTrace, four: LayerTrace, layers: int) -> list[tuple]:
    """The L-layer step's allocator events from the traces of 3 and 4 decoder layers (the module doc says how).

    Args:
        three: the trace with 3 decoder layers, with :attr:`~memfit.planner.compose.LayerTrace.allocations`.
        four: the trace with 4, the rest of the run identical.
        layers: L, at least 5.

    Returns:
        ``("alloc", key, nbytes, stream)`` and ``("free", key)`` events in the L-layer step's order, for
        :func:`memfit.memory.allocator.replay`.

    Raises:
        NotComposable: the traces' allocations do not compose (the message says where).
        ValueError: ``layers`` < 5, or a trace without allocations.
    """
    if layers < 5:
        raise ValueError(f"composing needs at least 5 layers, got {layers}")
    if four.allocations is None or three.allocations is None:
        raise ValueError("the traces hold no allocations (a CUDA target records them)")
    events = four.allocations
    sig4, sig3 = _signatures(events), _signatures(three.allocations)
    seg4, seg3 = _segments(four), _segments(three)
    by3 = {tag: (a, b) for tag, a, b in seg3}
    if {tag for tag, *_ in seg3} != {t for t, *_ in seg4 if t[0] in "IH" or t[2] in (0, 1, 2)}:
        raise NotComposable("the two traces' layers do not run in the same order")
    # the layers' runs, and those inside the segments that are not a layer's
    runs: dict[tuple, _Run] = {}
    home: list[Home | None] = [None] * len(events)
    segments: list[tuple[Tag, int, int, list[_Run]]] = []
    grows: dict[int, int] = {}
    for tag, a, b in seg4:
        kind, p, j = tag
        if kind in "FB":
            run = runs.setdefault((kind, p), _Run((kind, p), [0] * UNITS, [0] * UNITS))
            run.starts[j], run.lengths[j] = a, b - a
            for i in range(a, b):
                home[i] = (run.key, j, i - a)
        nested = []
        if kind in "IH" or (kind == "B" and j == 0):
            nested, grown = _nested_runs(tag, sig4, (a, b), sig3, by3[tag])
            grows.update(grown)
            for r in nested:
                runs[r.key] = r
                for u in range(UNITS):
                    for i in range(r.starts[u], r.starts[u] + r.lengths[u]):
                        home[i] = (r.key, u, i - r.starts[u])
        elif -sub(*by3[(kind, p, PAIRED[j])]) != b - a:
            raise NotComposable(f"segment {tag}: its allocations differ from the 3-layer trace's")
        segments.append((tag, a, b, nested))
    for i, h in enumerate(home):
        if h is None:
            home[i] = ("fixed", i)

    allocated_at = {e[1]: i for i, e in enumerate(events) if e[0] == "alloc"}
    homologs = _homologs(sig4, runs, events, allocated_at)
    raw = {
        key: [{h: k for k, h in enumerate(m) if h is not None} for m in maps]
        for key, maps in homologs.items()
    }
    relations = _relations(events, home, runs, allocated_at, homologs)
    out: list[tuple] = []
    live: dict[tuple, int] = {}  # the L-layer allocation's home -> its key in ``out``
    events3 = three.allocations
    allocated_at3 = {e[1]: i for i, e in enumerate(events3) if e[0] == "alloc"}
    tag_at4 = {i: (tag, a) for tag, a, b, _ in segments for i in range(a, b)}
    tag_at3 = {i: tag for tag, a, b in seg3 for i in range(a, b)}

    def middle_freed(i: int, layers: int) -> int:
        """The L-layer layer whose allocation the once-run event ``i`` frees, where the 4-layer trace's frees
        layer 2's: its twin in the 3-layer trace (the same offset in the same segment, the events before it
        alike) frees layer 1's (the layer before the last: layer L - 2) or layer 2's (layer 2)."""
        tag, a = tag_at4[i]
        a3, b3 = by3[tag]
        k3 = a3 + i - a
        if k3 >= b3 or sig3[a3 : k3 + 1] != sig4[a : i + 1]:
            raise NotComposable("an event outside the layers frees what a middle layer allocated")
        freed3 = tag_at3[allocated_at3[events3[k3][1]]]
        if freed3[0] in "FB" and freed3[2] == 1:
            return layers - 2
        if freed3[0] in "FB" and freed3[2] == 2:
            return 2
        raise NotComposable("an event outside the layers frees what a middle layer allocated")

    def emit(i: int, unit: int | None) -> None:
        """Event ``i`` of the 4-layer trace, as it runs in L-layer unit ``unit`` of its run."""
        event, h = events[i], home[i]
        where = h if h[0] == "fixed" else (h[0], unit, h[2])
        if event[0] == "alloc":
            live[where] = len(out)
            nbytes = event[2] + (layers - UNITS) * (event[2] - grows[i]) if i in grows else event[2]
            out.append(("alloc", len(out), nbytes, event[3]))
            return
        j = allocated_at[event[1]]
        ref = home[j]
        if ref[0] == "fixed":
            target = ref
        else:
            run, ref_unit, offset = ref
            relation = None if h[0] == "fixed" else relations.get((h[0], homologs[h[0]][h[1]][h[2]]))
            if relation is not None and _related(relation, h[1], UNITS) == ref_unit:
                at = _related(relation, unit, layers)
            elif h[0] == "fixed" and ref_unit == 2:  # a middle layer's: which, the 3-layer trace says
                at = middle_freed(i, layers)
            elif h[0] == "fixed" or _template(unit, layers) != 2:  # an event that runs once
                at = _edge(ref_unit, layers)
            else:
                raise NotComposable(
                    f"a middle layer's free ({h[0][0]} unit {h[1]}, event {h[2]}) lands on no allocation the "
                    f"other middle layers have (it frees {ref})"
                )
            if not 0 <= at < layers:
                raise NotComposable(f"a free lands on layer {at} of {layers}")
            copied = runs[run]
            t = _template(at, layers)
            if t != ref_unit:  # the homologous event of the unit that layer ``at`` copies
                offset = raw[run][t].get(homologs[run][ref_unit][offset], -1)
            if not 0 <= offset < copied.lengths[t] or sig4[copied.starts[t] + offset] != sig4[j]:
                raise NotComposable("a free lands on another allocation in the composed step")
            target = (run, at, offset)
        key = live.pop(target, None)
        if key is None:
            raise NotComposable("a free lands on an allocation that is not live in the composed step")
        out.append(("free", key))

    for tag, a, b, nested in _in_layer_order(segments, layers):
        unit = tag[2]  # the L-layer layer of a layer's segment (its events are its template's)
        i = a
        for r in nested:  # each nested run expanded to L units
            for k in range(i, r.starts[0]):
                emit(k, unit)
            for u in range(layers):
                t = _template(u, layers)
                for k in range(r.starts[t], r.starts[t] + r.lengths[t]):
                    emit(k, u)
            i = r.starts[-1] + r.lengths[-1]
        for k in range(i, b):
            emit(k, unit)
    return out


def _in_layer_order(
    segments: list[tuple[Tag, int, int, list[_Run]]], layers: int
) -> Iterator[tuple[Tag, int, int, list[_Run]]]:
    """The L-layer step's segments in the order it runs them, each ``F`` and ``B`` tag carrying the L-layer
    layer (the segment's events are its template's)."""
    for tag, a, b, nested in segments:
        kind, p, j = tag
        if kind == "F" and j == 2:
            for u in range(2, layers - 1):
                yield (kind, p, u), a, b, nested
        elif kind == "B" and j == 2:
            for u in reversed(range(2, layers - 1)):
                yield (kind, p, u), a, b, nested
        elif kind in "FB" and j == 3:
            yield (kind, p, layers - 1), a, b, nested
        else:
            yield tag, a, b, nested
