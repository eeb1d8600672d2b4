"""Live bytes by category over training steps: where the memory of a run went.

:class:`MemoryTracker` watches every tensor operation (a ``TorchDispatchMode``) and every tensor saved for
backward (``saved_tensors_hooks``), and keeps the bytes of each live storage under one of six categories:

========================  =====================================================================================
``parameters``            storages of the model's parameters and buffers; on a sharded model (FSDP2 or FSDP1),
                          this rank's shards (padded, as FSDP stores them)
``unsharded_parameters``  a sharded model's all-gathered (unsharded) parameters while FSDP holds them, from a
                          module's all-gather to its reshard: FSDP2's per-parameter unsharded storages and its
                          flat all-gather buffer (a module's gathered parameters from the all-gather, issued
                          ahead when prefetching, to their copy-out), FSDP1's padded unsharded flat parameters;
                          always 0 for a model that is not sharded
``gradients``             storages of ``p.grad``; on a sharded model, the sharded gradients and, in the backward,
                          the unsharded gradients of a module until FSDP has reduce-scattered them (FSDP2's
                          reduce-scatter input buffer included)
``optimizer_state``       storages of tensors in ``optimizer.state`` (nested dicts, sub-optimizers of a wrapper,
                          and the inner tensors of tensor subclasses such as torchao's low-bit states or DTensor)
``activations``           storages saved for backward by autograd, while the graph holds them (and, in the
                          backward, tensors recomputed for backward by activation checkpointing, until they are
                          freed)
``temporaries``           everything else: inputs, logits, gradients in flight, the optimizer's scratch tensors,
                          FSDP's other scratch tensors (the copy-in of the shards before an all-gather), ...
========================  =====================================================================================

A storage counts once, at ``untyped_storage().nbytes()`` (views share it), from when it is created or first seen
until it is freed (a weak reference on the storage's Python object, which torch keeps alive exactly as long as the
storage), following ``UntypedStorage.resize_`` as it happens (FSDP frees and re-allocates its unsharded parameters
that way, keeping the storage objects). A storage's category follows the priority order of the table, decided by
identity: a parameter saved for backward is a parameter. Nothing reads tensor data, so it works the same on CPU,
CUDA, and under
``torch._subclasses.fake_tensor.FakeTensorMode`` (enter the tracker *inside* the fake mode), where it sees the
bytes a real run would allocate.

Phases: the training loop may mark them (:meth:`MemoryTracker.set_phase` or :meth:`MemoryTracker.phase`);
besides, ops run by the autograd engine are ``backward``, ops inside any ``Optimizer.step`` are
``optimizer_step`` (an optimizer stepping inside backward included), a call of the model or any of its modules
starts ``forward``, and the end of a backward goes back to ``other``. So a loop that marks nothing still gets
its phases right.

Example:
    >>> with MemoryTracker(model, optimizer) as tracker:
    ...     train_step(model, optimizer, batches, max_grad_norm=1.0, dtype="fp32", tracker=tracker)
    >>> tracker.summary_gib()
    {'peak_gib': ..., 'phase': 'optimizer_step', 'breakdown_gib': {'parameters': ..., ...}}

Sharded models (FSDP2 ``fully_shard``, FSDP1 ``FullyShardedDataParallel``): each rank tracks itself (its shards,
what it gathered, its activations); the training loop gathers the ranks' results at logging time. The roles come
from FSDP's own objects (see "Sharded models" below). The ops inside a ``DTensor`` op (its local computation) run
below the dispatch mode and are not seen one by one; the op's outputs are. FSDP1's sharded gradients are placed at
the end of the backward (they are ``temporaries`` from their reduce-scatter until then).

What it does not see: memory inside a single kernel (workspaces, the allocator's rounding and caching, CUDA
context), and tensors that no tracked operation touches.

Who does what. In this module, a ledger (``_Ledger``) keeps the books: every live storage and its category, the
bytes per category, the peaks, the timeline; :class:`MemoryTracker` instruments the step to feed it: the dispatch
mode, the ``resize_`` patch, the saved-tensor hooks, the gradient, forward and optimizer-step hooks, FSDP's
objects, the role of each storage. :mod:`memfit.memory.optim` finds the optimizer state
(:func:`~memfit.memory.optim.optimizer_state_tensors`, the walker that
:func:`~memfit.memory.optim.optimizer_state_bytes` counts too); :mod:`memfit.memory.timeline` draws a
:attr:`MemoryTracker.timeline`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from memfit.memory.optim import optimizer_state_tensors, optimizers_in, state_tensors, tensors_in
from memfit.units import GIB

CATEGORIES = (
    "parameters",
    "unsharded_parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
)
"""Memory categories, in the priority order that decides a storage's category."""
UNSHARDED_ONLY = ("unsharded_parameters",)
"""Categories that only a sharded (FSDP) model has; see :attr:`MemoryTracker.categories`."""
PHASES = ("forward", "backward", "optimizer_step", "other")
"""Phases of a training step."""

_PARAMS, _UNSHARDED, _GRADS, _OPT_STATE, _ACTIVATIONS, _TEMPORARIES = range(len(CATEGORIES))
# Ops that never allocate and are no step of the computation: no event. (``detach`` is what the pack hook calls,
# ``prim.device`` is ``Tensor.device`` of a fake tensor, the profiler ops mark ``Optimizer.step``.)
_NO_EVENT_OPS = frozenset(
    id(op)
    for op in (
        torch.ops.aten.detach.default,
        torch.ops.prim.device.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    )
)


# ----------------------------------------------------------------------------------------------------------------
# Finding storages and the tensors of each role
# ----------------------------------------------------------------------------------------------------------------


def tensor_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind a tensor: its own, or those of a wrapper subclass's inner tensors.

    Args:
        t: any tensor (plain, parameter, fake, or a traceable wrapper subclass with ``__tensor_flatten__``).

    Returns:
        The storages (empty for tensors without one, such as sparse tensors).
    """
    if is_traceable_wrapper_subclass(t):
        out: list[torch.UntypedStorage] = []
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                out.extend(tensor_storages(inner))
        return out
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError, TypeError):
        return []


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def model_state_bytes(
    model: nn.Module, optimizer: Any = None, device: torch.device | str | None = None
) -> dict[str, int]:
    """Bytes of the model's and optimizer's state now, each storage counted once, no tracking needed.

    Args:
        model: the model; its parameters *and buffers* count as ``parameters``.
        optimizer: its state counts as ``optimizer_state`` (see
            :func:`~memfit.memory.optim.optimizer_state_tensors`); None for none.
        device: count only tensors on this device (AdamW keeps its ``step`` counters on the host for a CUDA
            model, for one); None counts every device.

    Returns:
        ``{"parameters": ..., "gradients": ..., "optimizer_state": ...}`` in bytes, by the priority order of
        :data:`CATEGORIES` (a storage that is both a parameter and a gradient is a parameter).
    """
    tensors = _model_tensors(model)
    groups = {
        "parameters": tensors,
        "gradients": [p.grad for p in model.parameters() if p.grad is not None],
        "optimizer_state": optimizer_state_tensors(optimizer),
    }
    device = None if device is None else torch.device(device)
    seen: set[int] = set()
    out = {}
    for category, group in groups.items():
        total = 0
        for t in group:
            if device is not None and t.device != device:
                continue
            for st in tensor_storages(t):
                if id(st) not in seen:
                    seen.add(id(st))
                    total += st.nbytes()
        out[category] = total
    return out


# ----------------------------------------------------------------------------------------------------------------
# Sharded models: where FSDP keeps shards, gathered parameters and gradients
# ----------------------------------------------------------------------------------------------------------------
#
# FSDP2 (``fully_shard``) keeps one ``FSDPParam`` per parameter. ``sharded_param`` is the module's parameter between
# all-gathers: a DTensor whose local tensor views this rank's padded shard. ``all_gather_outputs`` are the unsharded
# storages, created by the first all-gather and kept for the whole run (resized to 0 bytes at a reshard and back
# to full size by the next all-gather); ``_unsharded_param`` views them and is the module's parameter while
# gathered, so autograd accumulates the unsharded gradient into its ``grad``. The post-backward reduce-scatters
# that gradient into ``sharded_param.grad`` and runs the sharded parameter's post-accumulate-grad hooks.
#
# FSDP1 (``FullyShardedDataParallel``) keeps one ``FlatParameter`` per unit: ``_local_shard`` is this rank's padded
# flat shard, ``_full_param_padded`` the unsharded flat parameter (resized like FSDP2's); the flat parameter's
# ``grad`` is the unsharded gradient in the backward and the sharded one after it (``_saved_grad_shard`` between),
# and with ``use_orig_params`` the original parameters are views into whichever of them is current.


def fsdp2_params(model: nn.Module) -> list[Any]:
    """The ``FSDPParam`` of every parameter FSDP2 manages in ``model`` (empty for a model without FSDP2)."""
    # not imported: no FSDP module can exist (and none is imported here)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    out = []
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(group.fsdp_params)
    return out


def fsdp1_flat_params(model: nn.Module) -> list[nn.Parameter]:
    """The ``FlatParameter`` of every FSDP1 unit in ``model`` (empty for a model without FSDP1)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [
        m._handle.flat_param
        for m in model.modules()
        if isinstance(m, fsdp.FullyShardedDataParallel) and m._handle is not None
    ]


ALL_GATHER_STREAM = 1
"""The CUDA stream id (for :mod:`memfit.memory.allocator`) of FSDP2's all-gather buffers: FSDP2 allocates them on
its all-gather stream (``FSDPParamGroup``'s ``all_gather_copy_in_stream`` / ``all_gather_stream``), so the caching
allocator reuses their freed blocks only for later all-gathers, never for the compute stream's tensors."""
REDUCE_SCATTER_STREAM = 2
"""The stream id of FSDP2's reduce-scatter input buffers (its ``reduce_scatter_stream``)."""


def _fsdp2_buffer_ops() -> dict[int, tuple[int, str | None, int]]:
    """FSDP2's ops that fill its flat communication buffers: ``id(op) -> (role, None for the op's outputs or the
    name of its ``out`` argument, the stream FSDP2 allocates them on)``. The all-gather buffer holds a whole
    group's gathered parameters (from the all-gather, issued ahead when prefetching, until the copy-out to the
    per-parameter storages), the reduce-scatter input a whole group's unsharded gradients (until FSDP lets it go, a
    few groups later)."""
    try:
        return {
            id(torch.ops.fsdp.all_gather_copy_in.default): (_UNSHARDED, None, ALL_GATHER_STREAM),
            id(torch.ops.fsdp.chunk_cat.default): (_GRADS, "out", REDUCE_SCATTER_STREAM),
        }
    except (AttributeError, RuntimeError):  # a torch without these ops: the buffers count as temporaries
        return {}


class _Sharding:
    """A sharded model's tensors by role, read from FSDP's own objects at each call (they change over a step)."""

    def __init__(self, model: nn.Module) -> None:
        self.fsdp2 = fsdp2_params(model)
        self.flat = fsdp1_flat_params(model)
        # where FSDP computes (with CPU offload the shards live on the host, the gathered parameters do not)
        self.compute_device: torch.device | None = None
        if self.fsdp2:
            self.compute_device = self.fsdp2[0].device
        elif self.flat:
            self.compute_device = next(
                m.compute_device for m in model.modules() if getattr(m, "_handle", None) is not None
            )
        managed: set[int] = set()
        for fp in self.fsdp2:
            managed.add(id(fp.sharded_param))
            if hasattr(fp, "_unsharded_param"):
                managed.add(id(fp._unsharded_param))
        for flat in self.flat:
            managed.add(id(flat))
            for p in [
                *(getattr(flat, "_params", None) or []),
                *(getattr(flat, "_shared_params", None) or []),
            ]:
                managed.add(id(p))  # use_orig_params: views into the shard or the unsharded flat parameter
        # the parameters whose storage is this rank's shard, and the ones FSDP does not manage
        self.params: list[torch.Tensor] = [fp.sharded_param for fp in self.fsdp2]
        self.params += [getattr(flat, "_local_shard", flat) for flat in self.flat]  # (set at first forward)
        self.params += [p for p in model.parameters() if id(p) not in managed]
        # the leaves autograd accumulates into (sharded FSDP2 parameters: FSDP runs their hooks)
        self.grad_leaves: list[torch.Tensor] = [fp.sharded_param for fp in self.fsdp2]
        self.grad_leaves += self.flat + [p for p in model.parameters() if id(p) not in managed]
        # FSDP parameters whose unsharded storages did not exist yet when last asked (see newly_gathered)
        self.pending: list[Any] = [*self.fsdp2, *self.flat]

    @property
    def sharded(self) -> bool:
        return bool(self.fsdp2 or self.flat)

    def unsharded(self) -> Iterator[torch.Tensor]:
        """The gathered (unsharded) parameters' tensors, at whatever size FSDP holds them now."""
        for fp in self.fsdp2:
            yield from fp.all_gather_outputs
            yield from getattr(fp, "_unsharded_inner_tensors", ())
        for flat in self.flat:
            for name in ("_full_param_padded", "_full_prec_full_param_padded"):
                t = getattr(flat, name, None)
                if isinstance(t, torch.Tensor):
                    yield t

    def grads(self) -> Iterator[torch.Tensor]:
        """Gradients FSDP holds besides ``p.grad`` of :attr:`params`: unsharded ones, and FSDP1's flat ones."""
        for fp in self.fsdp2:
            unsharded = getattr(fp, "_unsharded_param", None)
            for g in (getattr(unsharded, "grad", None), getattr(fp, "unsharded_accumulated_grad", None)):
                if g is not None:
                    yield g
        for flat in self.flat:
            for g in (flat.grad, getattr(flat, "_saved_grad_shard", None)):
                if g is not None:
                    yield g

    def newly_gathered(self) -> Iterator[tuple[list[torch.Tensor], torch.Tensor | None]]:
        """The unsharded parameters FSDP created since last asked (FSDP2's first all-gather creates them, FSDP1's
        lazy initialisation at the first forward); those not created yet are asked about again next time.

        Yields:
            ``(tensors, param)``: the tensors whose storages hold one parameter unsharded, and FSDP2's unsharded
            parameter (the one autograd accumulates the unsharded gradient into), None for FSDP1.
        """
        pending = []
        for item in self.pending:
            if hasattr(item, "all_gather_outputs"):  # an FSDP2 FSDPParam
                unsharded = getattr(item, "_unsharded_param", None)
                tensors = [*item.all_gather_outputs, *getattr(item, "_unsharded_inner_tensors", ())]
                if unsharded is None or not tensors:
                    pending.append(item)
                    continue
                yield tensors, unsharded
            else:  # an FSDP1 FlatParameter
                tensors = [getattr(item, "_full_param_padded", None)]
                if tensors[0] is None:
                    pending.append(item)
                    continue
                yield tensors, None
        self.pending = pending


# ----------------------------------------------------------------------------------------------------------------
# Bookkeeping: the ledger of live storages, their categories, the peaks and the timeline
# ----------------------------------------------------------------------------------------------------------------


class _Entry:
    """One live storage: its bytes, its role (set by identity) and how many graph slots save it."""

    __slots__ = ("key", "nbytes", "cat", "role", "saved", "sticky", "alive", "ref", "stream")

    def __init__(self, key: int, nbytes: int) -> None:
        self.key = key
        self.nbytes = nbytes
        self.cat = _TEMPORARIES
        self.role: int | None = None  # _PARAMS, _UNSHARDED, _GRADS or _OPT_STATE
        self.saved = 0  # graph slots (saved-tensor hooks' packed objects) that hold this storage
        self.sticky = False  # saved during a backward (recomputation): an activation until freed
        self.alive = True
        self.ref: weakref.ref | None = None
        self.stream = 0  # the CUDA stream it is allocated on (FSDP2's communication buffers have their own)


class _Ledger:
    """The bookkeeping of a :class:`MemoryTracker`: every live storage and its category, the live bytes of each
    category, the peak (its bytes, breakdown and phase), each category's own peak, and the timeline.

    It knows nothing of models, optimizers, FSDP or autograd. The tracker tells it which tensors an op touched
    (:meth:`see`), which storages have a role (:meth:`give_role`, :meth:`give_op_role`, :meth:`set_roles`),
    which are saved for backward (``_Entry.saved``, then :meth:`recategorize`), and when an op ends
    (:meth:`record`); a weak reference on each storage tells it when the storage is freed.

    A storage's category is its role if it has one (parameters, unsharded parameters, gradients, optimizer state),
    else ``activations`` while saved for backward, else ``temporaries``.

    Args:
        device: count only storages of tensors on this device; None counts every device.
        record_timeline: append a :attr:`timeline` entry at each :meth:`record`.

    Attributes:
        device: as the argument (the tracker sets it again each time it is entered).
        record_timeline: as the argument.
        totals: live bytes by category now, in the order of :data:`CATEGORIES`.
        peak_bytes: the maximum over the recorded ops of the total live bytes (all categories).
        peak_breakdown: bytes by category at that peak.
        peak_phase: the phase of the op that reached the peak.
        timeline: ``(event index, phase, {category: bytes})`` after each recorded op.
    """

    def __init__(self, device: torch.device | None, record_timeline: bool) -> None:
        self.device = device
        self.record_timeline = record_timeline
        self.timeline: list[tuple[int, str, dict[str, int]]] = []
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_phase = "other"
        self.totals = [0] * len(CATEGORIES)
        self._category_peaks = [0] * len(CATEGORIES)
        self._event = 0
        # id(storage) -> entry: torch keeps a storage's Python object alive exactly as long as the storage
        self._live: dict[int, _Entry] = {}
        self._roled: set[int] = set()  # keys of the entries with a role
        self._op_roled: set[int] = set()  # keys of the entries whose role an op gave (FSDP2's flat buffers)
        self._plain_types: set[type] = {torch.Tensor, nn.Parameter}
        self.allocations: list[tuple[str, _Entry, int]] | None = None
        """With a list: ``("alloc", entry, nbytes)`` when a storage is counted, ``("free", entry, 0)`` when it is
        freed, both when it is resized, in order (the timeline a caching allocator would see)."""
        self.ops: list[tuple[Any, Any]] | None = None
        """With a list (and ``record_timeline``): ``(op, sample())`` beside each timeline entry, the op that made it
        and what :attr:`sample` returned then (the estimator aligns the timelines of two traces op by op)."""
        self.sample: Callable[[], Any] = lambda: None
        self.current_op: Any = None

    # --- storages -------------------------------------------------------------------------------------------

    def see(self, t: torch.Tensor, check_size: bool) -> None:
        """Count ``t``'s storages if new; with ``check_size``, follow a known one that changed size."""
        if type(t) in self._plain_types:
            try:
                storages = (t.untyped_storage(),)
            except (RuntimeError, NotImplementedError, TypeError):
                return
        elif is_traceable_wrapper_subclass(t):
            storages = tensor_storages(t)
        else:
            self._plain_types.add(type(t))  # FakeTensor and other subclasses with their own storage
            self.see(t, check_size)
            return
        live = self._live
        for st in storages:
            entry = live.get(id(st))
            if entry is None:
                if self.device is None or t.device == self.device:
                    self.add(st)
            elif check_size:
                nbytes = st.nbytes()
                if nbytes != entry.nbytes:
                    self._resize(entry, nbytes)

    def add(self, st: torch.UntypedStorage) -> _Entry:
        """Count a storage not counted yet, as ``temporaries``, until it is freed."""
        key = id(st)
        entry = _Entry(key, st.nbytes())
        entry.ref = weakref.ref(st, functools.partial(self._freed, entry))
        self._live[key] = entry
        self.totals[entry.cat] += entry.nbytes
        if self.allocations is not None:
            self.allocations.append(("alloc", entry, entry.nbytes))
        return entry

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        """``entry``'s storage now holds ``nbytes``: a free and an allocation to the caching allocator."""
        self.totals[entry.cat] += nbytes - entry.nbytes
        if self.allocations is not None:
            self.allocations += [("free", entry, 0), ("alloc", entry, nbytes)]
        entry.nbytes = nbytes

    def entries(self, t: torch.Tensor) -> list[_Entry]:
        """The entries of ``t``'s storages, added if new; none for a tensor on another device."""
        if self.device is not None and t.device != self.device:
            return []
        out = []
        for st in tensor_storages(t):
            entry = self._live.get(id(st))
            out.append(entry if entry is not None else self.add(st))
        return out

    def _freed(self, entry: _Entry, _ref: weakref.ref) -> None:
        entry.alive = False
        if self._live.get(entry.key) is entry:
            del self._live[entry.key]
            self._roled.discard(entry.key)
            self._op_roled.discard(entry.key)
            self.totals[entry.cat] -= entry.nbytes
            if self.allocations is not None:
                self.allocations.append(("free", entry, 0))

    def recategorize(self, entry: _Entry) -> None:
        """Move ``entry``'s bytes to the category its role and saved count say now."""
        if entry.role is not None:
            cat = entry.role
        elif entry.saved > 0 or entry.sticky:
            cat = _ACTIVATIONS
        else:
            cat = _TEMPORARIES
        if cat != entry.cat:
            self.totals[entry.cat] -= entry.nbytes
            self.totals[cat] += entry.nbytes
            entry.cat = cat

    def check_sizes(self) -> None:
        """Follow storages resized outside tensor ops (``UntypedStorage.resize_``, as FSDP does)."""
        for entry in self._live.values():
            st = entry.ref() if entry.ref is not None else None
            if st is not None:
                nbytes = st.nbytes()
                if nbytes != entry.nbytes:
                    self._resize(entry, nbytes)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Follow a storage that ``UntypedStorage.resize_`` just resized (FSDP's free and re-allocation)."""
        entry = self._live.get(id(storage))
        if entry is not None and storage.nbytes() != entry.nbytes:
            self._resize(entry, storage.nbytes())

    # --- roles ----------------------------------------------------------------------------------------------

    def give_role(self, entry: _Entry, role: int) -> None:
        """Give ``entry`` a role until the next :meth:`set_roles` says otherwise (or the storage is freed)."""
        entry.role = role
        self._roled.add(entry.key)
        self.recategorize(entry)

    def give_op_role(self, tensors: Any, role: int, stream: int = 0) -> None:
        """Give ``role`` (and ``stream``) to the storages of the tensors in ``tensors`` for as long as they live (an
        op's buffer, which no object of the model or optimizer names: :meth:`set_roles` leaves it be)."""
        for t in tensors_in(tensors):
            for entry in self.entries(t):
                entry.stream = stream
                self._op_roled.add(entry.key)
                if entry.role != role:
                    entry.role = role
                    self.recategorize(entry)

    def set_roles(self, groups: Iterable[tuple[int, Iterable[torch.Tensor]]]) -> None:
        """Give the storages of each group's tensors the group's role (the first group that holds a storage wins;
        storages are added if new), and take its role from every other storage that had one (except those an op
        gave, see :meth:`give_op_role`).

        Args:
            groups: ``(role, tensors)`` in the priority order of :data:`CATEGORIES`.
        """
        roles: dict[int, tuple[int, _Entry]] = {}
        for role, tensors in groups:
            for t in tensors:
                if self.device is not None and t.device != self.device:
                    continue
                for st in tensor_storages(t):
                    key = id(st)
                    if key not in roles:
                        entry = self._live.get(key)
                        roles[key] = (role, entry if entry is not None else self.add(st))
        for key in self._roled - roles.keys() - self._op_roled:
            entry = self._live.get(key)
            if entry is not None:
                entry.role = None
                self.recategorize(entry)
        for role, entry in roles.values():
            if entry.role != role:
                entry.role = role
                self.recategorize(entry)
        self._roled = set(roles)

    # --- peaks and the timeline -----------------------------------------------------------------------------

    def record(self, phase: str, before_new_peak: Callable[[], None] | None = None) -> None:
        """Snapshot after one op: the category peaks, the peak, a timeline entry.

        Args:
            phase: the op's phase.
            before_new_peak: called when the op makes a new peak, before its breakdown is taken (the tracker
                re-derives the roles there, so that the breakdown at the peak is exact).
        """
        self._event += 1
        totals = self.totals
        peaks = self._category_peaks
        for i, nbytes in enumerate(totals):
            if nbytes > peaks[i]:
                peaks[i] = nbytes
        total = sum(totals)
        if total > self.peak_bytes:
            if before_new_peak is not None:
                before_new_peak()
            self.peak_bytes = total
            self.peak_breakdown = dict(zip(CATEGORIES, totals, strict=True))
            self.peak_phase = phase
        if self.record_timeline:
            self.timeline.append((self._event, phase, dict(zip(CATEGORIES, totals, strict=True))))
            if self.ops is not None:
                self.ops.append((self.current_op, self.sample()))

    def breakdown(self) -> dict[str, int]:
        """Bytes live now, ``{category: bytes}`` for every category of :data:`CATEGORIES`."""
        return dict(zip(CATEGORIES, self.totals, strict=True))

    @property
    def category_peaks(self) -> dict[str, int]:
        """Each category's own maximum (bytes) since the last :meth:`reset_peak` (or since creation)."""
        return dict(zip(CATEGORIES, self._category_peaks, strict=True))

    def reset_peak(self, phase: str) -> None:
        """Start a new peak, and new category peaks, from the bytes live now, in ``phase``."""
        self.peak_bytes = sum(self.totals)
        self.peak_breakdown = self.breakdown()
        self.peak_phase = phase
        self._category_peaks = list(self.totals)

    def clear_timeline(self) -> None:
        """Forget the timeline so far (the peaks are kept)."""
        self.timeline = []

    def summary_gib(self) -> dict[str, Any]:
        """The peak in GiB (1024**3 bytes): ``{"peak_gib": float, "phase": str, "breakdown_gib": {category:
        float}}``."""
        return {
            "peak_gib": self.peak_bytes / GIB,
            "phase": self.peak_phase,
            "breakdown_gib": {k: v / GIB for k, v in self.peak_breakdown.items()},
        }


# ----------------------------------------------------------------------------------------------------------------
# Instrumentation: what the tracker puts around a step to feed the ledger
# ----------------------------------------------------------------------------------------------------------------


class _Observer(TorchDispatchMode):
    """The dispatch mode: lets every op run, shows the ledger the tensors it touched, then ends the op.

    Args:
        ledger: counts the storages.
        buffer_ops: ``id(op) -> (role, None or the name of an argument, stream)``: ops whose outputs (or that
            argument) are buffers of a role, on a stream (see :func:`_fsdp2_buffer_ops`).
        after_op: called after each op (the tracker's phase, roles and snapshot).
    """

    def __init__(
        self,
        ledger: _Ledger,
        buffer_ops: dict[int, tuple[int, str | None, int]],
        after_op: Callable[[], None],
    ) -> None:
        super().__init__()
        self.ledger = ledger
        self.buffer_ops = buffer_ops
        self.after_op = after_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if id(func) in _NO_EVENT_OPS:
            return out
        see = self.ledger.see
        for group in (args, kwargs.values()):
            for a in group:
                if isinstance(a, torch.Tensor):
                    see(a, False)
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, torch.Tensor):
                            see(b, False)
        if isinstance(out, torch.Tensor):
            see(out, True)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    see(o, True)
        buffer_op = self.buffer_ops.get(id(func))
        if buffer_op is not None:
            role, kwarg, stream = buffer_op
            self.ledger.give_op_role(out if kwarg is None else kwargs[kwarg], role, stream)
        self.ledger.current_op = func
        self.after_op()
        return out


@contextlib.contextmanager
def _resizes_reported(ledger: _Ledger) -> Iterator[None]:
    """While active, ``UntypedStorage.resize_`` (FSDP's ``free_storage``/``alloc_storage``) reports to
    ``ledger``."""
    cls = torch.UntypedStorage
    had_own = "resize_" in cls.__dict__
    original = cls.__dict__.get("resize_")
    inner = cls.resize_
    resized = ledger.resized

    def resize_(storage: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
        out = inner(storage, size)
        resized(storage)
        return out

    cls.resize_ = resize_
    try:
        yield
    finally:
        if had_own:
            cls.resize_ = original
        else:
            del cls.resize_


class _Saved:
    """What the pack hook stores in the graph: the inner packed object, and a count on the saved storages.

    Autograd drops it when it frees the saved variable (after the node runs, or with the graph), which is when
    the storages stop being activations (unless something else keeps them as such).
    """

    __slots__ = ("packed", "entries", "ledger")

    def __init__(self, packed: Any, entries: list[_Entry], ledger: _Ledger) -> None:
        self.packed = packed
        self.entries = entries
        self.ledger = ledger

    def __del__(self) -> None:
        ledger = self.ledger
        for entry in self.entries:
            entry.saved -= 1
            if entry.saved == 0 and entry.alive:
                ledger.recategorize(entry)


def _pack_hook(ledger: _Ledger, inner: Any = None) -> Any:
    """A pack hook that counts the saved storages, around ``inner`` (or saving a detached alias)."""

    def pack(x: torch.Tensor) -> _Saved:
        entries = ledger.entries(x)
        packed = x.detach() if inner is None else inner(x)
        for t in tensors_in(packed):  # what the inner hook keeps (a copy, when not on another device)
            if t is not x:
                entries += [e for e in ledger.entries(t) if e not in entries]
        in_backward = torch._C._current_graph_task_id() != -1
        for entry in entries:
            entry.saved += 1
            entry.sticky = entry.sticky or in_backward
            ledger.recategorize(entry)
        return _Saved(packed, entries, ledger)

    return pack


def _unpack_hook(inner: Any = None) -> Any:
    """The unpack hook that goes with :func:`_pack_hook`."""

    def unpack(saved: Any) -> torch.Tensor:
        packed = saved.packed if isinstance(saved, _Saved) else saved
        return packed if inner is None else inner(packed)

    return unpack


@contextlib.contextmanager
def _saved_tensors_counted(ledger: _Ledger) -> Iterator[None]:
    """While active, every tensor saved for backward is counted: our hooks go around the hooks in force (if any),
    and around those others push meanwhile (activation checkpointing, offloading). Nothing while torch has
    saved-tensor hooks disabled."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        yield
        return
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack, unpack = (None, None) if top is None else top
    module = torch._C._autograd
    original = module._push_saved_tensors_default_hooks

    def push(pack_hook: Any, unpack_hook: Any) -> None:
        original(_pack_hook(ledger, pack_hook), _unpack_hook(unpack_hook))

    with torch.autograd.graph.saved_tensors_hooks(_pack_hook(ledger, pack), _unpack_hook(unpack)):
        module._push_saved_tensors_default_hooks = push
        try:
            yield
        finally:
            module._push_saved_tensors_default_hooks = original


class _StateGrowth:
    """Which parameters' optimizer state gained entries since it last looked: it lets the tracker place the state
    that an optimizer step creates op by op (a first step, a lazily built optimizer) without a full role refresh
    per op, which would cost O(parameters^2) over a first step.

    Args:
        optimizers: the optimizers to watch (:func:`~memfit.memory.optim.optimizers_in` of the tracked one).
    """

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers
        self._counts: dict[int, int] = {}  # id(optimizer) -> its fingerprint when last looked
        self._sizes: dict[tuple[int, int], int] = {}  # (optimizer, param) -> entries of its state seen

    @staticmethod
    def fingerprint(opt: Any) -> int:
        """A cheap number that changes when an optimizer's state gains or loses an entry (its keys, not data)."""
        count = 0
        state = getattr(opt, "state", None)
        if isinstance(state, Mapping):
            count += len(state)
            for value in state.values():
                if isinstance(value, (dict, Mapping)):  # dict first: the fast check
                    count += len(value)
        return count

    def changed(self, optimizers: list[Any] | None = None) -> bool:
        """Whether the states of ``optimizers`` (default: all) gained or lost entries since the last
        :meth:`looked` or :meth:`new_tensors`."""
        counts = self._counts
        return any(self.fingerprint(o) != counts.get(id(o)) for o in optimizers or self.optimizers)

    def looked(self) -> None:
        """Note that all the state was looked at now (the tracker's full role refresh)."""
        self._counts = {id(o): self.fingerprint(o) for o in self.optimizers}

    def new_tensors(self, optimizers: list[Any] | None = None) -> list[torch.Tensor]:
        """The tensors of every parameter's state whose number of entries changed since it was last seen here,
        in ``optimizers`` (default: all; one parameter's update in the backward looks at its own optimizer)."""
        out: list[torch.Tensor] = []
        for opt in optimizers or self.optimizers:
            self._counts[id(opt)] = self.fingerprint(opt)
            state = getattr(opt, "state", None)
            if not isinstance(state, Mapping):
                continue
            for param, value in state.items():
                size = len(value) if isinstance(value, Mapping) else 1
                key = (id(opt), id(param))
                if self._sizes.get(key) == size:
                    continue
                self._sizes[key] = size
                out.extend(tensors_in(value))
        return out


# ----------------------------------------------------------------------------------------------------------------
# The tracker
# ----------------------------------------------------------------------------------------------------------------


class MemoryTracker:
    """Live bytes by category (:data:`CATEGORIES`) and phase (:data:`PHASES`) over one or more training steps.

    Use it as a context manager around the steps. Entering seeds it with what already exists (parameters,
    buffers, gradients, optimizer state); other storages count from the first op that creates or touches them.
    Results accumulate over every time it is entered.

    Args:
        model: the model being trained.
        optimizer: its optimizer (a ``torch.optim.Optimizer`` or a wrapper of optimizers), or None.
        device: count only storages on this device; None means the device of the model's first parameter when
            the tracker is entered (so a CUDA run counts GPU memory, not host copies of offloaded activations nor
            AdamW's host ``step`` counters), FSDP's compute device for a sharded model (with CPU offload its
            shards are on the host and not counted), or every device for a model without parameters.
        record_timeline: keep a :attr:`timeline` entry after every op (a few hundred bytes each: turn it off,
            or :meth:`clear_timeline`, when tracking every step of a long run).
        refresh_roles_at_peak: at every new peak reached inside an optimizer step, first re-derive the role of
            every storage (a walk of the parameters, gradients and optimizer state), so that the breakdown at
            the peak is exact even for an optimizer that replaces a state tensor under an existing key. The walk
            costs O(parameters) per such op, and an optimizer step may set a new peak at nearly every op (a first
            step, creating the state, does): up to O(parameters^2) over the step. Turn it off to track a model of
            many parameters quickly (the estimator does): state that gains entries is still placed as the step
            creates it, and only a state tensor replaced under an existing key counts as ``temporaries`` until
            its optimizer step ends.
        record_allocations: keep :attr:`allocations`, the order in which storages are counted and freed (what a
            caching allocator would be asked for; the estimator replays it through
            :mod:`memfit.memory.allocator`).
        record_ops: with a callable, keep :attr:`ops` beside the timeline: the op of each entry and what the
            callable returned after it (the estimator samples the offloading hooks' host bytes so).

    Attributes:
        peak_bytes: the maximum over time of the total live bytes (all categories).
        peak_breakdown: bytes by category at that peak.
        peak_phase: the phase of the op that reached the peak.
        timeline: ``(event index, phase, {category: bytes})`` after each op.

    A sharded model (FSDP2 ``fully_shard`` or FSDP1 ``FullyShardedDataParallel``, see the module docstring) is
    tracked on each rank for that rank alone: its shards are ``parameters``, what FSDP has all-gathered is
    ``unsharded_parameters``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any = None,
        *,
        device: torch.device | str | None = None,
        record_timeline: bool = True,
        refresh_roles_at_peak: bool = True,
        record_allocations: bool = False,
        record_ops: Callable[[], Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.refresh_roles_at_peak = refresh_roles_at_peak
        self._device_arg = None if device is None else torch.device(device)
        self._sharding = _Sharding(model)
        self._ledger = _Ledger(self._device_arg or self._model_device(), record_timeline)
        if record_allocations:
            self._ledger.allocations = []
        if record_ops is not None:
            self._ledger.ops = []
            self._ledger.sample = record_ops
        self._base_phase = "other"  # as marked by the loop, or by the model's forward / the end of backward
        self._last_phase = "other"
        self._in_backward = False
        self._opt_depth = 0
        self._stepping: list[Any] | None = None  # the optimizer of the update running inside the backward
        self._active = 0
        self._params: list[torch.Tensor] = self._sharding.params
        self._buffers: list[torch.Tensor] = list(model.buffers())
        self._state = _StateGrowth(optimizers_in(optimizer))
        self._lazy_hooks: list[Any] = []  # handles of hooks put on unsharded parameters while tracking
        self._buffer_ops: dict[int, tuple[int, str | None, int]] = {}  # see _fsdp2_buffer_ops
        self._exit_stack: contextlib.ExitStack | None = None

    def _model_device(self) -> torch.device | None:
        if self._sharding.compute_device is not None:  # a sharded model: where FSDP gathers and computes
            return self._sharding.compute_device
        first = next(iter(self.model.parameters()), None)
        return None if first is None else first.device

    # --- phases ---------------------------------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        """Mark the phase of the ops that follow (ops in a backward or an optimizer step are labelled so anyway).

        Args:
            phase: one of :data:`PHASES`.

        Raises:
            ValueError: unknown phase.
        """
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        self._base_phase = phase
        self._in_backward = False  # a mark right after a backward wins over "other"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Context manager: ``name`` is the phase inside, the previous one after.

        Args:
            name: one of :data:`PHASES`.

        Raises:
            ValueError: unknown phase.
        """
        previous = self._base_phase
        self.set_phase(name)
        try:
            yield
        finally:
            self._base_phase = previous

    def _current_phase(self) -> str:
        if self._opt_depth:
            return "optimizer_step"
        if torch._C._current_graph_task_id() != -1:
            self._in_backward = True
            return "backward"
        if self._in_backward:  # the first op after a backward
            self._in_backward = False
            self._base_phase = "other"
        return self._base_phase

    # --- results (kept by the ledger) -----------------------------------------------------------------------

    @property
    def peak_bytes(self) -> int:
        """The maximum over time of the total live bytes (all categories)."""
        return self._ledger.peak_bytes

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Bytes by category at :attr:`peak_bytes`."""
        return self._ledger.peak_breakdown

    @property
    def peak_phase(self) -> str:
        """The phase of the op that reached :attr:`peak_bytes`."""
        return self._ledger.peak_phase

    def storage_entries(self, t: torch.Tensor) -> list[Any]:
        """The ledger entries of ``t``'s storages (counted from now if new), the objects :attr:`allocations` holds."""
        return self._ledger.entries(t)

    @property
    def allocations(self) -> list[tuple[str, Any, int]]:
        """With ``record_allocations``: in order, ``("alloc", entry, nbytes)`` when a storage starts to count
        (created by an op, or first seen: what existed at entry comes first) and ``("free", entry, 0)`` when it is
        freed; a resize is both. ``entry`` is one object per storage lifetime (use ``id(entry)`` as its key), with
        ``entry.cat``, its category now, and ``entry.stream``, the CUDA stream it would be allocated on (0, or
        FSDP2's :data:`ALL_GATHER_STREAM` / :data:`REDUCE_SCATTER_STREAM`). Empty without
        ``record_allocations``."""
        return self._ledger.allocations or []

    @property
    def ops(self) -> list[tuple[Any, Any]]:
        """With ``record_ops``: ``(op, sample)`` of each :attr:`timeline` entry; empty without."""
        return self._ledger.ops or []

    @property
    def timeline(self) -> list[tuple[int, str, dict[str, int]]]:
        """``(event index, phase, {category: bytes})`` after each op (to plot:
        :func:`memfit.memory.timeline.plot_timeline`)."""
        return self._ledger.timeline

    @property
    def record_timeline(self) -> bool:
        """Whether each op appends to :attr:`timeline` (settable between steps, to record only some)."""
        return self._ledger.record_timeline

    @record_timeline.setter
    def record_timeline(self, value: bool) -> None:
        self._ledger.record_timeline = value

    @property
    def device(self) -> torch.device | None:
        """The device whose storages count (None: every device); see the ``device`` argument."""
        return self._ledger.device

    @property
    def categories(self) -> tuple[str, ...]:
        """The categories that apply to the model: :data:`CATEGORIES`, less :data:`UNSHARDED_ONLY` for a model
        that is not sharded (whose ``unsharded_parameters`` are always 0). Breakdowns still hold every category."""
        if self._sharding.sharded:
            return CATEGORIES
        return tuple(c for c in CATEGORIES if c not in UNSHARDED_ONLY)

    @property
    def category_peaks(self) -> dict[str, int]:
        """Each category's own maximum (bytes) since the last :meth:`reset_peak` (or since creation).

        They are reached at different moments (activations at the end of the forward, gradients at the end of the
        backward, ...), so their sum is at least :attr:`peak_bytes`.
        """
        return self._ledger.category_peaks

    def current_breakdown(self) -> dict[str, int]:
        """Bytes live now, by category (roles refreshed first, so new gradients or state are placed).

        Returns:
            ``{category: bytes}`` for every category of :data:`CATEGORIES`.
        """
        self._ledger.check_sizes()
        self._refresh_roles()
        return self._ledger.breakdown()

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (the timeline is kept)."""
        self._refresh_roles()
        self._ledger.reset_peak(self._base_phase)

    def clear_timeline(self) -> None:
        """Forget the timeline so far (to keep, or plot, one step of a long run; the peak is kept)."""
        self._ledger.clear_timeline()

    def summary_gib(self) -> dict[str, Any]:
        """The peak in GiB (1024**3 bytes).

        Returns:
            ``{"peak_gib": float, "phase": str, "breakdown_gib": {category: float}}``.
        """
        return self._ledger.summary_gib()

    # --- roles: which storages are parameters, gradients, optimizer state -----------------------------------

    def _refresh_roles(self) -> None:
        """Re-derive which live storages are parameters, gradients and optimizer state, by identity."""
        self._state.looked()
        params = self._params
        grads = itertools.chain((p.grad for p in params if p.grad is not None), self._sharding.grads())
        self._ledger.set_roles(
            (
                (_PARAMS, params + self._buffers),
                (_UNSHARDED, self._sharding.unsharded()),
                (_GRADS, grads),
                (_OPT_STATE, state_tensors(self._state.optimizers)),
            )
        )

    def _add_new_state(self, optimizers: list[Any] | None = None) -> None:
        """Give the optimizer-state role to the state the step just created: only the parameters whose state
        gained entries are looked at (a full refresh per op of a first step would cost O(parameters^2)), in
        ``optimizers`` (default: all)."""
        ledger = self._ledger
        for t in self._state.new_tensors(optimizers):
            for entry in ledger.entries(t):
                if entry.role is None:
                    ledger.give_role(entry, _OPT_STATE)

    def _after_op(self) -> None:
        """After one op: follow a change of phase or new optimizer state, then the ledger's snapshot."""
        phase = self._current_phase()
        if phase != self._last_phase:
            self._ledger.check_sizes()
            if self._update_in_backward(phase, self._last_phase):
                self._add_new_state(self._stepping)
            else:
                self._refresh_roles()
            self._last_phase = phase
        elif phase == "optimizer_step" and self._state.changed(self._stepping):
            # the step added state (its first step, or a lazily built optimizer)
            self._add_new_state(self._stepping)
        # a new peak in an optimizer step: roles refreshed first, exact even for state replaced under its key
        exact_peak = phase == "optimizer_step" and self.refresh_roles_at_peak
        self._ledger.record(phase, self._refresh_roles if exact_peak else None)

    # --- hooks ----------------------------------------------------------------------------------------------

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        for entry in self._ledger.entries(param.grad):
            if entry.role is None:
                self._ledger.give_role(entry, _GRADS)

    def _forward_pre_hook(self, _module: nn.Module, _args: Any) -> None:
        if self._sharding.pending:  # (runs after FSDP's own pre-forward hook, which all-gathers the module's)
            self._adopt_unsharded()
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside a backward
            self._base_phase = "forward"

    def _adopt_unsharded(self) -> None:
        """Place the unsharded parameters FSDP created since we last looked: their storages are
        ``unsharded_parameters``, and the gradients of FSDP2's unsharded parameters are ``gradients`` (a hook, as
        for any parameter)."""
        for tensors, unsharded in self._sharding.newly_gathered():
            if unsharded is not None and unsharded.requires_grad:
                hook = unsharded.register_post_accumulate_grad_hook(self._grad_accumulated)
                self._lazy_hooks.append(hook)
            for t in tensors:
                for entry in self._ledger.entries(t):
                    if entry.role != _UNSHARDED:
                        self._ledger.give_role(entry, _UNSHARDED)

    def _optimizer_pre_hook(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._opt_depth += 1
        in_backward = torch._C._current_graph_task_id() != -1  # one parameter's update: watch its optimizer
        self._stepping = [optimizer] if in_backward and self._opt_depth == 1 else None

    def _optimizer_post_hook(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._opt_depth = max(0, self._opt_depth - 1)
        if torch._C._current_graph_task_id() != -1:  # one parameter's update inside the backward
            self._add_new_state([optimizer])
        else:
            self._refresh_roles()
        if not self._opt_depth:
            self._stepping = None

    @staticmethod
    def _update_in_backward(phase: str, last: str) -> bool:
        """Whether a phase switch is into or out of one parameter's update inside the backward
        (``optimizer_in_backward``). Nothing changes role there but what the hooks place: the gradient (given its
        role when accumulated, freed after the update) and the state the update creates
        (:meth:`_add_new_state`). A full refresh per switch (two per parameter) would cost O(parameters^2) over
        the step: 36 of an 8B estimate's 56 seconds. The full refresh comes at the first switch after the
        backward."""
        return {phase, last} == {"backward", "optimizer_step"} and torch._C._current_graph_task_id() != -1

    # --- entering and leaving -------------------------------------------------------------------------------

    def __enter__(self) -> MemoryTracker:
        """Seed with the existing state and start watching ops, saved tensors, gradients and optimizer steps."""
        self._active += 1
        if self._active > 1:
            return self
        stack = contextlib.ExitStack()
        try:
            self._sharding = _Sharding(self.model)  # fixed while tracking (refreshed at each enter)
            self._ledger.device = self._device_arg or self._model_device()
            self._params = self._sharding.params
            self._buffers = list(self.model.buffers())
            self._state.optimizers = optimizers_in(self.optimizer)
            stack.enter_context(_resizes_reported(self._ledger))
            self._refresh_roles()
            self._last_phase = self._base_phase
            self._watch_model(stack)
            stack.callback(register_optimizer_step_pre_hook(self._optimizer_pre_hook).remove)
            stack.callback(register_optimizer_step_post_hook(self._optimizer_post_hook).remove)
            stack.enter_context(_saved_tensors_counted(self._ledger))
            stack.enter_context(_Observer(self._ledger, self._buffer_ops, self._after_op))
        except BaseException:
            stack.close()
            self._active -= 1
            raise
        self._exit_stack = stack
        return self

    def _watch_model(self, stack: contextlib.ExitStack) -> None:
        """The model's hooks, removed by ``stack``: gradients accumulated, FSDP's gathered parameters and
        buffers, the start of a forward."""
        for p in self._sharding.grad_leaves:
            if p.requires_grad:
                stack.callback(p.register_post_accumulate_grad_hook(self._grad_accumulated).remove)
        stack.callback(self._remove_lazy_hooks)
        self._adopt_unsharded()
        self._buffer_ops = _fsdp2_buffer_ops() if self._sharding.fsdp2 else {}
        for module in self.model.modules():  # any of them: a chunked loss calls the backbone directly
            stack.callback(module.register_forward_pre_hook(self._forward_pre_hook).remove)

    def _remove_lazy_hooks(self) -> None:
        for handle in self._lazy_hooks:
            handle.remove()
        self._lazy_hooks = []
        self._sharding.pending = []

    def __exit__(self, *exc: object) -> None:
        """Stop watching; the results stay readable."""
        self._active -= 1
        if self._active > 0 or self._exit_stack is None:
            return
        stack, self._exit_stack = self._exit_stack, None
        stack.close()
        self._opt_depth = 0
        self._refresh_roles()
