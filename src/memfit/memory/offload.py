"""Offloaded checkpoints (``activation_offloading``): what each decoder layer saves for backward in host memory.

With full activation checkpointing a layer saves only its inputs outside its checkpoint, so this moves the
checkpoints to pinned host memory in the forward, on a side CUDA stream, and brings each back one layer ahead in the
backward (:class:`OffloadSavedTensors`). Where the host is the device (CPU) nothing moves. The estimator traces the
same hooks, with the saved tensors moved to the ``meta`` device for a CUDA target (:func:`offload_host`,
:mod:`memfit.planner.cuda_paths`), and reads their host bytes from :class:`OffloadStats`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors smaller than this stay on the device (0-dim scalars, step counters): not worth a copy (as torchtune's
OffloadActivations)."""


def offload_host(device: torch.device) -> torch.device | None:
    """Where :class:`OffloadSavedTensors` moves tensors saved on ``device``: the CPU (pinned memory) from a CUDA
    device; None (they stay) on the CPU, which is the host. The estimator's trace of a CUDA run swaps this for
    ``meta`` (:mod:`memfit.planner.cuda_paths`): the moved tensors then leave the traced device as they leave a GPU.
    """
    return torch.device("cpu") if device.type == "cuda" else None


class OffloadStats:
    """Bytes of saved tensors held on the host by the offloading hooks of this process (all of them): now and at
    the peak since :meth:`reset`. The estimator reads the peak as the run's offloaded activations."""

    live = 0
    peak = 0

    @classmethod
    def reset(cls) -> None:
        cls.live = cls.peak = 0

    @classmethod
    def add(cls, nbytes: int) -> None:
        cls.live += nbytes
        cls.peak = max(cls.peak, cls.live)


class _Offloaded:
    """One tensor saved on the host: its host copy, the device it came from, and its copy back once fetched."""

    __slots__ = ("host", "device", "nbytes", "back", "event", "shared", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int) -> None:
        self.host = host
        self.device = device
        self.nbytes = nbytes
        self.back: torch.Tensor | None = None  # on the device again (prefetched or fetched)
        self.event: Any = None  # CUDA: the copy's completion, on the side stream
        self.shared = (
            False  # saved again by a later layer (the RoPE tables): packed once, with the first layer's
        )
        OffloadStats.add(nbytes)

    def __del__(self) -> None:
        OffloadStats.live -= self.nbytes


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep what decoder layers save for backward in host memory, and bring it back one
    ahead in the backward (:func:`apply_activation_offloading` puts them around every decoder layer).

    - **Pack** (forward): a tensor of at least :data:`MIN_OFFLOAD_BYTES` that is not a parameter (nor a view of
      one) is copied to a pinned host buffer on a side CUDA stream, overlapping the next kernels; the device tensor
      is freed once the copy is done (``record_stream``). A tensor saved again (the RoPE tables and document ids
      every layer keeps) is copied once.
    - **Unpack** (backward): the compute stream waits for the tensor's copy back, started earlier on the side
      stream; then the copy back of the tensor packed before it starts, so the next one (in backward order)
      arrives while this one is used: one ahead. A tensor saved again is fetched when first unpacked (by the
      last layer's backward) and starts no copy ahead: the one packed before it is the first layer's input,
      needed last.

    Under activation checkpointing only a checkpointed layer's inputs are saved outside it (torch's non-reentrant
    checkpoint saves them through the hooks in force; its recomputation in the backward runs without these), so
    with ``activation_checkpointing: full`` this offloads exactly the checkpoints: ``num_layers * B * T * dim``
    elements, leaving the device the input of the layer being recomputed and the next one in flight. A layer that
    is not checkpointed moves everything it saves (slow: ~34 x ``dim`` bytes per token, Korthikanti et al. 2022).

    Where the host is the device (a CPU run) nothing moves: the hooks hand each tensor back as it is.
    """

    def __init__(self) -> None:
        self._order: list[weakref.ref] = []  # the offloaded tensors, in pack order
        self._seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(saved tensor) -> (it, its copy)
        self._stream: Any = None
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        host = offload_host(t.device)
        if host is None or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES or _is_parameter(t):
            return t
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and (again := seen[1]()) is not None:
            again.shared = True
            return again
        if t.device.type == "cuda":
            copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                copy.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the device memory is not reused before the copy is done
        else:  # the estimator's trace: a fake tensor on the meta device, which the tracker does not count
            copy = t.detach().to(host)
        item = _Offloaded(copy, t.device, t.numel() * t.element_size())
        if len(self._order) > 2 * len(self._seen) + 64:  # the last steps' tensors, freed with their graphs
            self._order = [r for r in self._order if r() is not None]
            self._seen = {k: v for k, v in self._seen.items() if v[1]() is not None}
        self._seen[id(t)] = (weakref.ref(t), weakref.ref(item))
        self._order.append(weakref.ref(item))
        return item

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.back is None:
            self._fetch(packed)
        if packed.event is not None:
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(packed.event)
            packed.back.record_stream(current)
            packed.event = None
        # one ahead: the one packed before this one comes back while this one is used. Not from a shared tensor:
        # packed with the first layer's, its neighbour is the first layer's input, which the backward of the last
        # layer (the first to unpack it) would then fetch, to hold through the whole backward
        index = (
            None
            if packed.shared
            else next((i for i in range(len(self._order) - 1, -1, -1) if self._order[i]() is packed), None)
        )
        if index is not None:
            for ref in reversed(self._order[:index]):
                earlier = ref()
                if earlier is not None and earlier.back is None:
                    self._fetch(earlier)
                    break
        return packed.back

    def _fetch(self, item: _Offloaded) -> None:
        if item.device.type == "cuda":
            stream = self._side_stream(item.device)
            stream.wait_stream(torch.cuda.current_stream(item.device))
            with torch.cuda.stream(stream):
                item.back = item.host.to(item.device, non_blocking=True)
                item.event = torch.cuda.Event()
                item.event.record(stream)
        else:
            item.back = item.host.to(item.device)

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` that a matmul saves): it stays where it is."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def apply_activation_offloading(model: nn.Module) -> int:
    """Offload what every decoder layer saves for backward (``activation_offloading``): one
    :class:`OffloadSavedTensors` for the model, entered around each layer's forward. Apply after activation
    checkpointing, so that a checkpointed layer offloads its inputs (the checkpoint's) and nothing else; the
    embedding, the final norm and the loss keep theirs on the device (the backward needs them first).

    Args:
        model: a :class:`memfit.models.decoder.Llama`.

    Returns:
        The number of layers whose saved tensors are offloaded.
    """
    layers = model.model.layers
    hooks = OffloadSavedTensors()
    for layer in layers:
        if getattr(layer, "_memfit_offloaded", False):
            continue
        layer.forward = functools.partial(_offloaded, hooks, layer.forward)
        layer._memfit_offloaded = True
    return len(layers)


def _offloaded(hooks: OffloadSavedTensors, forward: Callable, *args: Any, **kwargs: Any) -> Any:
    with hooks:
        return forward(*args, **kwargs)
