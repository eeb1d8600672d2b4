"""The timeline of an L-layer step composed from traces of the same step with 3 and 4 decoder layers.

Decoder layers are identical; the boundaries (embedding, head, loss, optimizer step) are not. So the estimator
(:func:`memfit.planner.estimate.estimate_run`) traces the run's real ``train_step`` twice on a model of 3 and of 4
decoder layers, the rest of the run unchanged, and derives the L-layer answer from the two timelines. Nothing is
modelled: every byte is one the traces allocated; what composing assumes is checked op by op, and where it does
not hold the estimator traces the whole model (and says why).

**Marks.** :class:`LayerMarks` cuts each trace's timeline into segments at the decoder layers' boundaries: a
forward pre-hook on each layer opens its forward segment (``("F", pass, layer)``), a forward hook on the last
opens the head's (``("H", pass, None)``), and a hook on each layer's output opens the layer's backward segment
(``("B", pass, layer)``) when its gradient arrives, i.e. when autograd is about to run that layer's backward.
What comes before the first mark (the first pass's embedding) is ``("I", 0, None)``; the embedding's backward, the
optimizer step and the next pass's embedding are the tail of the ``B`` segment of layer 0.

**Composing.** Between two traces the bytes at an event are affine in the layers around it. With 4 layers
(``0 1 2 3``) and 3 (``0 1 2``) the segments pair up as ``F0-F0, F1-F1, F2-F1, F3-F2, H-H, B3-B2, B2-B1, B1-B1,
B0-B0`` (and ``I-I``), event by event, which must be the same op at the same position (else nothing is composed).
An event ``e`` of the 4-layer trace paired with ``e'`` of the 3-layer one counts
``b4(e) + (L - 4) * (b4(e) - b3(e'))`` bytes in each category at L layers: the pair differs by exactly one layer
in the group the L-layer model has L - 4 more of (the layers not run yet, for ``F0`` and ``F1``; the layers run,
for ``F2`` and ``F3``; in the backward, the layers back-propagated for ``B0`` and ``B1``, the ones still to come
for ``B3`` and ``B2``). ``F1`` stands for layer 1, ``F2`` for layer L - 2, ``B2`` for layer L - 2, ``B1`` for
layer 1. The layers between (2 to L - 3) run the ops of the middle layers (``F2`` and ``B1``: a layer between two
others), and each of their events is affine in the layer's index, so its maximum over them is at layer 2 or
L - 3: ``F2``'s events with ``F1``'s slope (layer 2: more layers still to run) and ``B1``'s with ``B2``'s slope
(layer L - 3: more layers still to back-propagate). The composed timeline holds those events in the order the
L-layer step runs them (a tie keeps the earlier, as the traced peak does), so its maximum, the category bytes
there and its phase are the L-layer trace's.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.memory.tracker import CATEGORIES

TRACED_LAYERS = (3, 4)
"""The depths traced to compose a deeper model: the pair of :mod:`this module <memfit.planner.compose>`."""
COMPOSE_FROM_LAYERS = 8
"""``estimate_run``'s default composes models of at least this many decoder layers (two traces of 3 and 4
layers cost about as much as one of 7; a shallower model is traced whole)."""
OFFLOADED = "offloaded_host"
"""The pseudo-category of a composed event holding the activation-offloading hooks' host bytes then."""

Tag = tuple[str, int, int | None]


@dataclass
class LayerTrace:
    """What one traced step leaves for composing: its timeline, the op and the offloaded host bytes of each of its
    events, and the marks (timeline index, tag) of :class:`LayerMarks`."""

    timeline: list[tuple[int, str, dict[str, int]]]
    ops: list[tuple[Any, Any]]
    marks: list[tuple[int, Tag]]
    allocations: list[tuple] | None = None
    """With a CUDA target: the caching allocator's events (``("alloc", key, nbytes, stream)``, ``("free", key)``)
    in order, each allocation's key its own."""
    allocation_marks: list[int] | None = None
    """The index in :attr:`allocations` at each of :attr:`marks`."""


@dataclass
class Composed:
    """The composed L-layer timeline (``(index, phase, {category: bytes})``, as a tracker's) and its offloaded
    host bytes' peak; ``events``: how many events it holds."""

    timeline: list[tuple[int, str, dict[str, int]]]
    offloaded_peak: int
    layers: int
    info: dict[str, Any] = field(default_factory=dict)
    allocations: list[tuple] | None = None
    """With a CUDA target: the L-layer step's allocator events
    (:func:`memfit.planner.compose_allocations.compose_allocations`)."""


class NotComposable(Exception):
    """The two traces do not compose (the message says where); the estimator traces the whole model."""


class LayerMarks:
    """Hooks on a model's decoder layers that mark where each layer's forward and backward begin in a tracker's
    timeline (see the module doc). Enter around the traced step, after the tracker.

    Args:
        layers: the decoder layers, in order (``model.model.layers``).
        timeline: the tracker's timeline list (read for its length when a hook fires).
        allocations: ``None``, or a callable returning the tracker's allocation events so far (their count is
            marked too).
    """

    def __init__(self, layers: list[nn.Module], timeline: list, allocations: Any = None) -> None:
        self.layers = list(layers)
        self.timeline = timeline
        self.allocations = allocations
        self.marks: list[tuple[int, Tag]] = []
        self.allocation_marks: list[int] = []
        self._pass = -1
        self._stack = contextlib.ExitStack()

    def _mark(self, kind: str, layer: int | None, pass_: int | None = None) -> None:
        self.marks.append((len(self.timeline), (kind, self._pass if pass_ is None else pass_, layer)))
        if self.allocations is not None:
            self.allocation_marks.append(len(self.allocations()))

    def _pre(self, index: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            if torch._C._current_graph_task_id() != -1:  # a recomputation inside the backward
                return
            if index == 0:
                self._pass += 1
            self._mark("F", index)

        return hook

    def _post(self, index: int) -> Any:
        last = index == len(self.layers) - 1

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if torch._C._current_graph_task_id() != -1:
                return
            if isinstance(output, torch.Tensor) and output.requires_grad:
                pass_ = self._pass
                output.register_hook(lambda _grad: self._mark("B", index, pass_))
            if last:
                self._mark("H", None)

        return hook

    def __enter__(self) -> LayerMarks:
        for i, layer in enumerate(self.layers):
            self._stack.callback(layer.register_forward_pre_hook(self._pre(i), prepend=True).remove)
            self._stack.callback(layer.register_forward_hook(self._post(i), prepend=True).remove)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _segments(trace: LayerTrace) -> list[tuple[Tag, int, int]]:
    """``(tag, start, end)`` of each segment of the timeline, in order (``I`` first, possibly empty)."""
    out: list[tuple[Tag, int, int]] = []
    starts = [(0, ("I", 0, None)), *trace.marks]
    for k, (start, tag) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(trace.timeline)
        out.append((tag, start, end))
    return out


def _expected(depth: int, backward: list[bool]) -> list[Tag]:
    """The segments of a step whose passes run forward, and backward where ``backward`` says (a pass without
    gradients, e.g. a preference objective's reference forward, has none)."""
    tags: list[Tag] = [("I", 0, None)]
    for p, back in enumerate(backward):
        tags += [("F", p, j) for j in range(depth)] + [("H", p, None)]
        tags += [("B", p, j) for j in reversed(range(depth))] if back else []
    return tags


def _vector(event: tuple[int, str, dict[str, int]], op: tuple[Any, Any]) -> list[int]:
    return [*(event[2][c] for c in CATEGORIES), op[1] or 0]


UNITS = 4
"""The units of a per-layer run in the 4-layer trace (3 in the 3-layer one): here and in
:mod:`memfit.planner.compose_allocations`."""
MERGED = 8
"""The most blocks the matcher may have cut one layer's more ops into (:func:`_unit_runs`)."""


def _minus(a: list[int], b: list[int]) -> list[int]:
    """``a - b``, event vector by event vector (bytes per category)."""
    return [x - y for x, y in zip(a, b, strict=True)]


def _unit_runs(
    ops4: list[Any], ops3: list[Any], v4: list[list[int]], v3: list[list[int]], tag: Tag
) -> list[tuple[int, int, int, str | None]]:
    """The per-layer runs of a segment that is not a layer's: ``(start4, start3, m, edge)``, four units of ``m``
    events from ``start4`` in the 4-layer segment standing for three from ``start3`` in the 3-layer one; ``edge``:
    ``None`` where the four are alike, ``"first"`` or ``"last"`` where that unit differs (it is paired with the
    3-layer trace's own, as a layer's events are).

    Each block of events the 4-layer segment has beyond the 3-layer one's is one unit of a periodic stretch of ops;
    the run is the first four units of that stretch (each holding the block, or the block at their edge) whose
    events change by the same bytes from one unit to the next in both traces, and by as much between the traces
    for the same unit: the bytes at each of its events are then ``a + b * unit + d * layers``, what the L-layer
    run's units hold.

    Raises:
        NotComposable: the segments differ by more than inserted blocks, or no four like units hold a block.
    """
    codes = difflib.SequenceMatcher(None, ops3, ops4, autojunk=False).get_opcodes()
    if any(code not in ("equal", "insert") for code, *_ in codes):
        raise NotComposable(f"segment {tag}: the two traces' ops differ beyond a layer's more")

    def like(units4: list[list[list[int]]], units3: list[list[list[int]]]) -> bool:
        """Units whose events change by the same bytes from one unit to the next in both traces, and by as much
        between the traces for the same unit (``units4[u]`` and ``units3[u]``)."""
        step = [_minus(x, y) for x, y in zip(units4[1], units4[0], strict=True)]
        depth = [_minus(x, y) for x, y in zip(units4[0], units3[0], strict=True)]
        return all(
            [_minus(x, y) for x, y in zip(units[u + 1], units[u], strict=True)] == step
            for units in (units4, units3)
            for u in range(len(units) - 1)
        ) and all(
            [_minus(x, y) for x, y in zip(units4[u], units3[u], strict=True)] == depth
            for u in range(len(units3))
        )

    runs: list[tuple[int, int, int, str | None]] = []

    def find(i1: int, j1: int, j2: int, m: int | None = None) -> tuple[int, int, int, str | None] | None:
        """The run holding the events ``[j1, j2)`` of the 4-layer segment, where ``m`` events (default all) are
        inserted beyond the 3-layer one's, from its event ``i1`` on (the events before ``j1`` pair with those
        ``j1 - i1`` before them); ``None``: none."""
        m = m or j2 - j1
        if any(ops4[k] != ops4[k - m] for k in range(j1 + m, j2)):
            return None
        lo, hi = j1, max(j2, j1 + m)
        while lo > 0 and ops4[lo - 1] == ops4[lo - 1 + m]:
            lo -= 1
        while hi < len(ops4) and ops4[hi] == ops4[hi - m]:
            hi += 1
        floor = runs[-1][0] + UNITS * runs[-1][2] if runs else 0
        for start4 in range(max(lo, floor, j2 - UNITS * m), min(j1, hi - UNITS * m) + 1):
            start3 = start4 - (j1 - i1)
            if (
                start3 < 0
                or ops3[start3 : start3 + (UNITS - 1) * m] != ops4[start4 : start4 + (UNITS - 1) * m]
            ):
                continue
            units4 = [v4[start4 + u * m : start4 + (u + 1) * m] for u in range(UNITS)]
            units3 = [v3[start3 + u * m : start3 + (u + 1) * m] for u in range(UNITS - 1)]
            # all four units alike; else the first (or the last) differs at its edge (the first parameter's update
            # frees what the one before the run left) and is paired with the 3-layer trace's as it is
            for edge, like4, like3 in (
                (None, (0, 4), (0, 3)),
                ("first", (1, 4), (1, 3)),
                ("last", (0, 3), (0, 2)),
            ):
                if like(units4[like4[0] : like4[1]], units3[like3[0] : like3[1]]):
                    return start4, start3, m, edge
        return None

    inserts = [(i1, j1, j2) for code, i1, _i2, j1, j2 in codes if code == "insert"]
    n = 0
    while n < len(inserts):
        i1, j1, j2 = inserts[n]
        n += 1
        found = find(i1, j1, j2)
        if found is not None:
            runs.append(found)
            continue
        # one layer's parameters of two kinds (quantized state or not): the matcher split its block in parts
        # between like events; the run's unit holds them all
        for more in range(1, MERGED + 1):
            if n - 1 + more >= len(inserts):
                break
            span = inserts[n - 1 : n + more]
            found = find(i1, j1, span[-1][2], sum(b - a for _, a, b in span))
            if found is not None:
                runs.append(found)
                n += more
                break
        if found is not None:
            continue
        # the end of one run and the start of the next (a loop over the parameters, then another): split where
        # both halves are a run's unit
        for k in range(j1 + 1, j2):
            first = find(i1, j1, k)
            if first is None:
                continue
            runs.append(first)
            second = find(i1, k, j2)
            if second is not None:
                runs.append(second)
                break
            runs.pop()
        else:
            raise NotComposable(f"segment {tag}: a layer's more ops are not one of {UNITS} like units")
    return runs


def compose(three: LayerTrace, four: LayerTrace, layers: int) -> Composed:
    """The L-layer timeline from the traces of 3 and 4 decoder layers (the module doc says how).

    Args:
        three: the trace of the model with 3 decoder layers.
        four: the trace with 4, the rest of the run identical.
        layers: L, the run's decoder layers (at least 5).

    Returns:
        The :class:`Composed` timeline.

    Raises:
        NotComposable: the traces' segments or ops do not pair up (layers that differ, a step whose ops depend
            on the depth); the message says which.
        ValueError: ``layers`` < 5.
    """
    if layers < 5:
        raise ValueError(f"composing needs at least 5 layers, got {layers}")
    seg3, seg4 = _segments(three), _segments(four)
    passes = sum(1 for tag, _, _ in seg4 if tag[0] == "H")
    backward = [any(tag == ("B", p, 0) for tag, _, _ in seg4) for p in range(passes)]
    for depth, segs in ((3, seg3), (4, seg4)):
        tags = [t for t, _, _ in segs]
        if tags != _expected(depth, backward):
            raise NotComposable(f"the {depth}-layer trace's layers do not run in order, once a pass")
    by3 = {tag: (a, b) for tag, a, b in seg3}
    by4 = {tag: (a, b) for tag, a, b in seg4}
    pair = {"F": {0: 0, 1: 1, 2: 1, 3: 2}, "B": {0: 0, 1: 1, 2: 1, 3: 2}}

    def rows(trace: LayerTrace, span: tuple[int, int]) -> list[list[int]]:
        a, b = span
        return [_vector(trace.timeline[k], trace.ops[k]) for k in range(a, b)]

    def ops_of(trace: LayerTrace, span: tuple[int, int]) -> list[Any]:
        return [trace.ops[k][0] for k in range(*span)]

    def check_same(name: str, x: tuple[LayerTrace, tuple[int, int]], y: tuple[LayerTrace, tuple[int, int]]):
        if ops_of(*x) != ops_of(*y):
            raise NotComposable(f"{name}: the two segments do not run the same ops")

    def slopes(tag4: Tag) -> list[list[int]]:
        kind, p, j = tag4
        tag3 = tag4 if kind in "IH" else (kind, p, pair[kind][j])
        check_same(f"segment {tag4}", (four, by4[tag4]), (three, by3[tag3]))
        r4, r3 = rows(four, by4[tag4]), rows(three, by3[tag3])
        return [[x - y for x, y in zip(a, b, strict=True)] for a, b in zip(r4, r3, strict=True)]

    extra = layers - 4
    out: list[tuple[int, str, dict[str, int]]] = []
    offloaded = 0

    def put(phase: str, v: list[int]) -> None:
        nonlocal offloaded
        out.append((len(out) + 1, phase, dict(zip(CATEGORIES, v, strict=False))))
        offloaded = max(offloaded, v[-1])

    def emit(tag4: Tag, slope: list[list[int]]) -> None:
        a, _ = by4[tag4]
        for k, s in enumerate(slope):
            v = [
                x + extra * d for x, d in zip(_vector(four.timeline[a + k], four.ops[a + k]), s, strict=True)
            ]
            put(four.timeline[a + k][1], v)

    def emit_runs(tag4: Tag) -> None:
        """A segment whose ops run once per parameter (the optimizer step, clipping): the 4-layer trace runs one
        layer's worth more of them, inside a run of 4 like units (:func:`_unit_runs`); the L-layer step's run has
        L units whose events are affine in the unit's index (the first and the last unit are emitted), the
        events around it paired with the 3-layer trace's as a layer's are. Where the inserted ops are not such
        a run's unit (one layer's parameters of two kinds, which the matcher cuts anywhere), each inserted block is
        composed alone (``emit_blocks``): the L-layer step holds L - 4 more copies of it, its events affine in the
        copy's index, the block placed where the events around it match the 3-layer trace's."""
        kind, p, j = tag4
        tag3 = tag4 if kind in "IH" else (kind, p, pair[kind][j])
        (a4, b4), (a3, b3) = by4[tag4], by3[tag3]
        ops4, ops3 = ops_of(four, (a4, b4)), ops_of(three, (a3, b3))
        if ops4 == ops3:
            emit(tag4, slopes(tag4))
            return
        v4, v3 = rows(four, (a4, b4)), rows(three, (a3, b3))
        nonlocal offloaded
        mark, offloaded_before = len(out), offloaded
        try:
            emit_unit_runs(tag4, a4, ops4, ops3, v4, v3)
        except NotComposable:
            del out[mark:]
            offloaded = offloaded_before
            emit_blocks(tag4, a4, ops4, ops3, v4, v3)

    def emit_unit_runs(tag4: Tag, a4: int, ops4: list, ops3: list, v4: list, v3: list) -> None:
        """The segment's per-layer runs (:func:`_unit_runs`) as the L-layer step runs them."""
        k4 = k3 = 0

        def paired(until4: int, until3: int) -> None:
            nonlocal k4, k3
            if until4 - k4 != until3 - k3 or ops4[k4:until4] != ops3[k3:until3]:
                raise NotComposable(f"segment {tag4}: the events around its per-layer runs do not pair up")
            for i4, i3 in zip(range(k4, until4), range(k3, until3), strict=True):
                put(
                    four.timeline[a4 + i4][1],
                    [x + extra * (x - y) for x, y in zip(v4[i4], v3[i3], strict=True)],
                )
            k4, k3 = until4, until3

        for start4, start3, m, edge in _unit_runs(ops4, ops3, v4, v3, tag4):
            first = 1 if edge == "first" else 0  # the first of the like units
            last = layers - 2 if edge == "last" else layers - 1  # the L-layer run's last like unit
            paired(start4 + first * m, start3 + first * m)
            for unit in (first, last):
                for i in range(m):
                    e4, e3 = start4 + first * m + i, start3 + first * m + i
                    step = _minus(v4[e4 + m], v4[e4])
                    put(
                        four.timeline[a4 + e4][1],
                        [
                            x + (unit - first) * b + extra * (x - y)
                            for x, b, y in zip(v4[e4], step, v3[e3], strict=True)
                        ],
                    )
            if edge == "last":  # unit 3 pairs with the 3-layer trace's unit 2, as the last layer's events do
                k4, k3 = start4 + (UNITS - 1) * m, start3 + (UNITS - 2) * m
                paired(start4 + UNITS * m, start3 + (UNITS - 1) * m)
            k4, k3 = start4 + UNITS * m, start3 + (UNITS - 1) * m
        paired(len(v4), len(v3))

    def emit_blocks(tag4: Tag, a4: int, ops4: list, ops3: list, v4: list, v3: list) -> None:
        """Each block the 4-layer segment adds, as L - 3 copies of it (not at the segment's edges)."""
        d4 = [[x - y for x, y in zip(v4[k], v4[k - 1], strict=True)] if k else v4[0] for k in range(len(v4))]
        d3 = [[x - y for x, y in zip(v3[k], v3[k - 1], strict=True)] if k else v3[0] for k in range(len(v3))]
        codes = difflib.SequenceMatcher(None, ops3, ops4, autojunk=False).get_opcodes()
        if any(code not in ("equal", "insert") for code, *_ in codes):
            raise NotComposable(f"segment {tag4}: the two traces' ops differ beyond a layer's more")
        blocks = []  # (start, end) in the 4-layer segment of each block one layer adds
        for code, _i1, _i2, j1, j2 in codes:
            if code != "insert":
                continue
            m = j2 - j1
            # the same ops could have been inserted earlier in a run of repeated blocks: the layer's own block is
            # the one whose removal leaves the events around it allocating what the 3-layer trace's do
            candidates = [j1]
            while candidates[-1] > 0 and ops4[candidates[-1] - 1] == ops4[candidates[-1] - 1 + m]:
                candidates.append(candidates[-1] - 1)
            lo = candidates[-1]
            base3 = _i1 - (j1 - lo)  # the 3-layer event paired with the 4-layer one at lo

            def score(start: int, lo: int = lo, j2: int = j2, m: int = m, base3: int = base3) -> int:
                kept = [k for k in range(lo, min(j2 + 1, len(d4))) if not start <= k < start + m]
                return sum(1 for n, k in enumerate(kept) if base3 + n < len(d3) and d4[k] == d3[base3 + n])

            blocks.append(max(candidates, key=score))
            blocks[-1] = (blocks[-1], blocks[-1] + m)
        inserted = {k for a, b in blocks for k in range(a, b)}
        mapped = iter(range(len(v3)))
        index3 = {k: next(mapped) for k in range(len(v4)) if k not in inserted}
        starts = {a: b for a, b in blocks}
        k = 0
        while k < len(v4):
            if k in starts:
                j1, j2 = k, starts[k]
                if j1 == 0 or j2 >= len(v4):
                    raise NotComposable(f"segment {tag4}: a layer's more ops at the segment's edge")
                s_before = [x - y for x, y in zip(v4[j1 - 1], v3[index3[j1 - 1]], strict=True)]
                growth = [x - y for x, y in zip(v4[j2 - 1], v4[j1 - 1], strict=True)]  # one copy of the block
                for copy in (0, extra):  # the first and the last of the L - 3 copies
                    for i in range(j1, j2):
                        put(
                            four.timeline[a4 + i][1],
                            [
                                x + extra * s + copy * g
                                for x, s, g in zip(v4[i], s_before, growth, strict=True)
                            ],
                        )
                k = j2
                continue
            i = index3[k]
            put(four.timeline[a4 + k][1], [x + extra * (x - y) for x, y in zip(v4[k], v3[i], strict=True)])
            k += 1

    emit_runs(("I", 0, None))
    for p in range(passes):
        emit(("F", p, 0), slopes(("F", p, 0)))
        after = slopes(("F", p, 1))  # one more layer still to run
        emit(("F", p, 1), after)
        check_same("the middle layers' forwards", (four, by4[("F", p, 1)]), (four, by4[("F", p, 2)]))
        emit(("F", p, 2), after)  # layer 2
        emit(("F", p, 2), slopes(("F", p, 2)))  # layer L - 2
        emit(("F", p, 3), slopes(("F", p, 3)))
        emit(("H", p, None), slopes(("H", p, None)))
        if not backward[p]:  # a forward without gradients: its head's segment runs on to the next pass
            continue
        emit(("B", p, 3), slopes(("B", p, 3)))
        below = slopes(("B", p, 2))  # one more layer still to back-propagate
        emit(("B", p, 2), below)
        check_same("the middle layers' backwards", (four, by4[("B", p, 2)]), (four, by4[("B", p, 1)]))
        emit(("B", p, 1), below)  # layer L - 3
        emit(("B", p, 1), slopes(("B", p, 1)))  # layer 1
        emit_runs(("B", p, 0))
    return Composed(out, offloaded, layers)


@contextlib.contextmanager
def marking(
    layers: list[nn.Module] | None, timeline: list, allocations: Any = None
) -> Iterator[LayerMarks | None]:
    """:class:`LayerMarks` on ``layers`` while inside, or nothing when ``layers`` is None."""
    if layers is None:
        yield None
        return
    with LayerMarks(layers, timeline, allocations) as marks:
        yield marks
