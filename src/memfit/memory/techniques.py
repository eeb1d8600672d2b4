"""Activation-memory techniques, applied to a built model from outside (the model file knows nothing of them).

- **Activation checkpointing** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): a wrapped
  decoder layer keeps only its input ``(B, T, dim)`` during the forward and recomputes its internals in the
  backward. Saves the tensors the layer would keep for backward (norm outputs, q/k/v, attention output and
  statistics, the SwiGLU gate/up products: measured in docs/memory.md) at the cost of one more forward of the layer.
- **Selective activation checkpointing** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models"; op-level as torchtitan applies it): every decoder layer is checkpointed with a policy that
  saves the outputs of its matmuls and of attention and recomputes everything else (norms, RoPE, SiLU, the
  elementwise products, casts), so the backward redoes no matmul.
- **Tiled MLP** (Arctic Long Sequence Training's TiledMLP, Bekman et al. 2025, arXiv 2506.13996): each decoder
  layer's SwiGLU MLP runs over the tokens tile by tile; in the backward each tile is recomputed and its gradients
  taken at once, so SwiGLU's three ``(B, T, intermediate_size)`` tensors exist for one tile at a time. The weight
  gradients add up over the tiles and reach the weights once (optimizer-in-backward hooks and FSDP see one).
- **Activation offloading**: tensors saved for backward outside checkpointed regions (with full checkpointing: the
  checkpointed layer inputs) move to pinned host memory in the forward, copied on a side stream, and come back
  one ahead in the backward (:class:`OffloadSavedTensors`).
- **Chunked (fused linear) cross-entropy**: the loss over ``lm_head`` is computed chunk by chunk of tokens, each
  chunk's gradients with respect to the hidden states and the weight computed in the same pass (Liger-Kernel's
  fused linear cross-entropy), so the full ``(B, T, vocab_size)`` logits — and their fp32 copy, softmax and
  gradient — never exist at once, and the backward recomputes nothing. For Llama 3's 128,256-entry vocabulary
  at ``B*T = 16k`` tokens those are 8 GiB in fp32.

All keep the arithmetic of the plain computation, so losses are identical within float rounding of the summation
order (tested to 1e-6; tiled MLP and the chunked loss add their tiles' weight gradients in another order, 1e-5).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.memory.switches import AUTO_CHUNK_LOGITS, AUTO_CHUNK_TOKENS, checkpointed_layers
from memfit.models.tiles import representative

IGNORE_INDEX = -100


def apply_activation_checkpointing(model: nn.Module, mode: str, interval: int = 1) -> list[int]:
    """Make the chosen decoder layers recompute their activations in the backward.

    Each chosen layer's ``forward`` is replaced by a non-reentrant ``torch.utils.checkpoint.checkpoint`` of the
    original, so module structure and parameter names (and so checkpoints) are unchanged.

    Args:
        model: a :class:`memfit.models.llama.Llama` (its ``model.layers``).
        mode: ``none``, ``selective`` (every layer, keeping matmul and attention outputs), ``full`` or ``every_n``.
        interval: ``n`` for ``every_n``.

    Returns:
        The indices of the layers now checkpointed.

    Raises:
        ValueError: unknown mode or interval.
    """
    layers = model.model.layers
    chosen = checkpointed_layers(len(layers), mode, interval)
    options = {"context_fn": _selective_contexts} if mode == "selective" else {}
    for i in chosen:
        layer = layers[i]
        if getattr(layer, "_memfit_checkpointed", False):
            continue
        layer.forward = functools.partial(_checkpointed, layer.forward, options)
        layer._memfit_checkpointed = True
    return chosen


def _checkpointed(forward, options: dict, *args, **kwargs):
    # a frame of ours around torch's checkpoint, where a compiled layer's tracing starts (torch.utils is skipped
    # by TorchDynamo as a first frame; called from here it becomes the checkpoint higher-order op)
    return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)


def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls and every attention kernel SDPA may pick."""
    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls)


_SAVED_OPS = _saved_ops()


# ----------------------------------------------------------------------------------------------------------------
# Tiled MLP
# ----------------------------------------------------------------------------------------------------------------


def mlp_tiles(setting: int | str, tokens: int, dim: int) -> int:
    """How many tiles a tiled MLP cuts ``tokens`` into.

    Args:
        setting: ``tiled_mlp``: a number of tiles, or ``auto`` (tiles of about ``dim`` tokens, as Arctic Long
            Sequence Training sizes them: a tile's ``(tile, intermediate_size)`` tensors are then about the size of
            one MLP weight, whatever the sequence length).
        tokens: tokens of the micro-batch, ``B * T``.
        dim: the model's width C.

    Returns:
        Tiles, at least 1 and at most ``tokens``.
    """
    tiles = -(-tokens // dim) if setting == "auto" else int(setting)  # ceil, in integers (SymInt-safe)
    return max(1, min(tiles, tokens))


def tile_ranges(rows: int, count: int, like: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[start, end)`` rows of ``count`` tiles of ``rows`` (as ``tensor_split`` cuts them: the first
    ``rows % count`` one row longer) that a loop runs: all of them, or in the estimator's trace the first and the
    last (:func:`memfit.models.tiles.representative`)."""
    size = rows // count  # no divmod: under a compiled layer with dynamic shapes ``rows`` is a SymInt
    longer = rows - size * count
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + size + (1 if i < longer else 0))
    return [(bounds[i], bounds[i + 1]) for i in representative(count, like)]


class _TiledMLP(torch.autograd.Function):
    """The MLP tile by tile without a graph; in the backward each tile again, with one, and its gradients at once.

    Inputs: the tiled MLP module, ``x`` ``(B, T, C)`` and the MLP's trainable parameters (so that their gradients
    are this function's outputs: summed over the tiles, they reach each parameter once).
    """

    @staticmethod
    def forward(ctx, module, x, *params):  # noqa: D102 (autograd's signature)
        ctx.module = module
        ctx.tiles = mlp_tiles(module.memfit_tiles, x.numel() // x.shape[-1], x.shape[-1])
        ctx.autocast = _autocast_state(x.device.type)
        # the random state dropout (LoRA's) draws from, replayed for the backward's tiles; a compiled layer's
        # graph cannot read it (config validation refuses compile with dropout inside a tiled MLP)
        ctx.rng = None if torch.compiler.is_compiling() else _rng_state(x.device)
        ctx.save_for_backward(x)
        return _tiles_without_graph(module, x, ctx.tiles)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        (x,) = ctx.saved_tensors
        module = ctx.module
        params = [
            p for p in module.parameters() if p.requires_grad
        ]  # as in the forward (FSDP2 gathered them)
        flat = x.detach().reshape(-1, x.shape[-1])  # (N, C)
        grads = grad_out.reshape(-1, grad_out.shape[-1])  # (N, C)
        need_x = ctx.needs_input_grad[1]
        grad_x = torch.empty_like(flat) if need_x else None  # (N, C)
        summed: list[torch.Tensor | None] = [None] * len(params)
        # the tiles in the forward's order, from the forward's random state: LoRA dropout draws the same masks
        with _replayed_rng(ctx.rng), _autocast(x.device.type, ctx.autocast):
            for s, e in tile_ranges(len(flat), ctx.tiles, flat):
                tile = flat[s:e].requires_grad_(need_x)  # (n, C)
                with torch.enable_grad():
                    out = _untiled(module, tile)  # (n, C); SwiGLU's (n, I) tensors live until the grad below
                inputs = ([tile] if need_x else []) + params
                tile_grads = list(torch.autograd.grad(out, inputs, grads[s:e])) if inputs else []
                if need_x:
                    grad_x[s:e] = tile_grads.pop(0)
                for i, g in enumerate(tile_grads):  # in the parameter's dtype, as autograd accumulates
                    summed[i] = g if summed[i] is None else summed[i].add_(g)
        return (None, grad_x.view_as(x) if need_x else None, *summed)


def _untiled(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own ``forward`` (its class's base, :func:`apply_tiled_mlp`) of ``x``."""
    return _UNTILED[type(module)].forward(module, x)


def _tiles_without_graph(module: nn.Module, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """The MLP of ``x`` ``(B, T, C)`` over ``tiles`` tiles of its tokens, written into one output."""
    flat = x.reshape(-1, x.shape[-1])  # (N, C)
    out = None
    with torch.no_grad():
        for s, e in tile_ranges(len(flat), tiles, flat):
            y = _untiled(module, flat[s:e])  # (n, C)
            if out is None:
                out = y.new_empty(flat.shape[0], y.shape[-1])  # (N, C), in the dtype the MLP returns
            out[s:e] = y
    return out.view(*x.shape[:-1], out.shape[-1])  # (B, T, C)


def _tiled_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The ``forward`` of a tiled MLP's class (:func:`apply_tiled_mlp`).

    Args:
        x: (B, T, C).

    Returns:
        (B, T, C), the MLP's output.
    """
    params = [p for p in self.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        tokens = x.numel() // x.shape[-1]
        return _tiles_without_graph(self, x, mlp_tiles(self.memfit_tiles, tokens, x.shape[-1]))
    return _TiledMLP.apply(self, x, *params)


_UNTILED: dict[type, type] = {}
"""A tiled MLP class -> the MLP class it derives from (whose ``forward`` each tile runs)."""


def _tiled_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``forward`` runs tile by tile, made once per class (so that every layer has
    the same class and a compiled layer's graph serves them all, without a guard on a per-layer object)."""
    for tiled, base in _UNTILED.items():
        if base is cls:
            return tiled
    tiled = type(f"Tiled{cls.__name__}", (cls,), {"forward": _tiled_mlp_forward, "__module__": __name__})
    _UNTILED[tiled] = cls
    return tiled


def apply_tiled_mlp(model: nn.Module, setting: int | str) -> int:
    """Make every decoder layer's MLP run tile by tile (``tiled_mlp``; see the module doc).

    Each MLP becomes an instance of a subclass of its class (``TiledMLP``) whose ``forward`` runs the original tile
    by tile (LoRA's adapted projections included), with ``memfit_tiles`` the setting; module structure and parameter
    names are unchanged. Apply before activation checkpointing and compile; both then take the tiled MLP as part of
    the layer.

    Args:
        model: a :class:`memfit.models.llama.Llama`.
        setting: tiles per micro-batch, or ``auto`` (:func:`mlp_tiles`); 0 leaves the model as it is.

    Returns:
        The number of MLPs tiled.
    """
    if setting == 0:
        return 0
    layers = model.model.layers
    for layer in layers:
        mlp = layer.mlp
        if type(mlp) not in _UNTILED:
            mlp.__class__ = _tiled_class(type(mlp))
        mlp.memfit_tiles = setting
    return len(layers)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(device_type: str, state: tuple[bool, torch.dtype]) -> contextlib.AbstractContextManager:
    enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype) if enabled else contextlib.nullcontext()


def _rng_state(device: torch.device) -> tuple[torch.Tensor, list, list]:
    """The CPU generator's state, and the CUDA device's when ``device`` is one (what dropout draws from)."""
    if device.type == "cuda":
        return torch.get_rng_state(), [device], [torch.cuda.get_rng_state(device)]
    return torch.get_rng_state(), [], []


@contextlib.contextmanager
def _replayed_rng(state: tuple[torch.Tensor, list, list] | None) -> Any:
    """Draw from ``state`` (:func:`_rng_state`) until the context exits, then from where the generators were."""
    if state is None:
        yield
        return
    cpu, devices, states = state
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu)
        for device, cuda_state in zip(devices, states, strict=True):
            torch.cuda.set_rng_state(cuda_state, device)
        yield


# ----------------------------------------------------------------------------------------------------------------
# Activation offloading
# ----------------------------------------------------------------------------------------------------------------


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

    __slots__ = ("host", "device", "nbytes", "back", "event", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int) -> None:
        self.host = host
        self.device = device
        self.nbytes = nbytes
        self.back: torch.Tensor | None = None  # on the device again (prefetched or fetched)
        self.event: Any = None  # CUDA: the copy's completion, on the side stream
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
      arrives while this one is used: one ahead.

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
        # one ahead: the one packed before this one comes back while this one is used
        index = next((i for i in range(len(self._order) - 1, -1, -1) if self._order[i]() is packed), None)
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
        model: a :class:`memfit.models.llama.Llama`.

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


def apply_compile(model: nn.Module) -> int:
    """``torch.compile`` every decoder layer in place, as torchtitan compiles a model: block by block.

    Each layer gets ``nn.Module.compile`` (its ``__call__`` compiled, parameter names and so checkpoints
    unchanged). The layers share their code, so TorchDynamo captures one graph (per grad mode, and one more for
    the plain layers of ``every_n`` checkpointing) and all layers reuse it; activation checkpointing applied
    before is compiled with the layer (torch's checkpoint is a higher-order op the compiler traces), and so is a
    tiled MLP (its backward takes each tile's gradients with ``torch.autograd.grad``, which TorchDynamo traces
    once ``torch._dynamo.config.trace_autograd_ops`` is set: this function sets it when a layer's MLP is tiled).
    The embedding, the final norm and ``lm_head`` stay eager; the loss is compiled apart (:func:`compiled`).

    Args:
        model: a :class:`memfit.models.llama.Llama` (its ``model.layers``), before FSDP wraps it.

    Returns:
        The number of layers compiled.
    """
    layers = model.model.layers
    if any(type(layer.mlp) in _UNTILED for layer in layers):
        torch._dynamo.config.trace_autograd_ops = True
    for layer in layers:
        layer.compile(fullgraph=True)
    return len(layers)


@functools.cache
def compiled(fn):
    """``torch.compile(fn)``, made once per function (the compiled loss of a ``compile: true`` run)."""
    return torch.compile(fn, fullgraph=True)


def loss_chunks(setting: int | str, tokens: int, vocab_size: int) -> int:
    """How many chunks the fused chunked cross-entropy cuts ``tokens`` into.

    Args:
        setting: ``chunked_cross_entropy``: a number of chunks (0: the plain loss), or ``auto``: chunks of at most
            :data:`memfit.memory.switches.AUTO_CHUNK_LOGITS` logits and
            :data:`memfit.memory.switches.AUTO_CHUNK_TOKENS` tokens each (261 tokens a chunk for Llama 3's
            128,256 ids, 2,048 for a 2,048-id vocabulary), so the ``(chunk, vocab_size)`` logits stay bounded at
            any sequence length.
        tokens: tokens of the micro-batch, ``B * T``.
        vocab_size: V.

    Returns:
        Chunks (0 for the plain loss), at most ``tokens``.
    """
    if setting == "auto":
        by_logits = -(-tokens * vocab_size // AUTO_CHUNK_LOGITS)  # ceil, in integers (SymInt-safe)
        return max(1, by_logits, -(-tokens // AUTO_CHUNK_TOKENS)) if tokens else 0
    return min(int(setting), tokens)


def _chunk_loss_and_grad(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed cross-entropy and its gradient with respect to the chunk's logits.

    Args:
        hidden: ``(n, dim)``.
        weight: ``(V, dim)``.
        targets: ``(n,)`` int64, ``-100`` not counted.

    Returns:
        ``(loss, grad_logits)``: a 0-dim fp32 sum in nats, and ``(n, V)`` ``softmax(logits) - one_hot(targets)``
        (zero in rows that do not count) in the dtype of the logits. The softmax is taken in fp32.
    """
    logits = F.linear(hidden, weight)  # (n, V), in the matmul dtype (bf16 under autocast)
    probs = logits.float()  # (n, V): the same tensor in fp32, a copy otherwise
    lse = torch.logsumexp(probs, dim=-1)  # (n,)
    counted = targets != IGNORE_INDEX
    safe = targets.masked_fill(~counted, 0)
    picked = probs.gather(1, safe[:, None]).squeeze(1)  # (n,)
    loss = torch.where(counted, lse - picked, 0.0).sum()
    probs.sub_(lse[:, None]).exp_()  # softmax, in place: the logits are not needed any more
    probs[torch.arange(len(safe), device=safe.device), safe] -= 1.0
    probs.mul_(counted[:, None])
    return loss, probs.to(logits.dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy over ``hidden @ weight.T`` whose gradients are computed chunk by chunk in the forward.

    The forward leaves ``grad_hidden`` ``(N, dim)`` and ``grad_weight`` ``(V, dim)`` (for a loss gradient of 1)
    for the backward, which only scales them by the incoming gradient: no logits are kept or recomputed.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, num_chunks, chunk_fn):  # noqa: D102 (autograd's signature)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # the weight gradient accumulates in the weight's dtype over the chunks, as autograd accumulates a
        # parameter's gradient over the chunks of a chunked computation (each matmul sums its chunk in fp32)
        grad_weight = torch.zeros_like(weight) if need_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s, e in tile_ranges(len(hidden), num_chunks, hidden):
            h = hidden[s:e]  # (n, dim)
            loss, grad_logits = chunk_fn(h, weight, targets[s:e])  # 0-dim, (n, V)
            total += loss
            if need_hidden:
                grad_hidden[s:e] = grad_logits @ weight  # (n, dim)
            if need_weight:
                if grad_logits.dtype == h.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)  # (V, dim), no temporary
                else:  # autocast: the matmul in its dtype, the sum in the weight's
                    grad_weight += grad_logits.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        grad_hidden, grad_weight = ctx.saved_tensors
        # scaled in place: they are this graph's own buffers, used once (the training step never retains a graph)
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_output.to(grad.dtype))
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    num_chunks: int,
    *,
    compile: bool = False,
) -> torch.Tensor:
    """Summed token cross-entropy of ``hidden @ lm_head_weight.T``, fused with its gradients, chunk by chunk.

    A fused linear cross-entropy (as Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, Hsu et al. 2024): for
    each chunk of tokens the forward computes the logits, the loss and at once the gradients with respect to the
    hidden states and the weight, then drops the logits. The backward only scales those gradients, so the
    ``(B, T, vocab_size)`` logits never exist and nothing is recomputed: the step does the plain computation's
    three ``lm_head`` matmuls. Without gradients (evaluation) it only sums the chunks' losses.

    Args:
        hidden: ``(B, T, dim)`` final-normed hidden states.
        lm_head_weight: ``(vocab_size, dim)``.
        targets: ``(B, T)`` int64; ``-100`` marks tokens that do not count.
        num_chunks: split the ``B*T`` tokens into this many chunks (the last may be shorter).
        compile: run each chunk's loss and softmax gradient as one ``torch.compile``'d function.

    Returns:
        A 0-dim fp32 tensor: the summed cross-entropy (nats) over counted tokens. At most one chunk's logits
        ``(B*T/num_chunks, vocab_size)``, their fp32 softmax and gradient are alive at a time; between forward
        and backward the graph holds ``grad_hidden`` ``(B*T, dim)`` (in place of the hidden states a plain loss
        keeps) and ``grad_weight`` ``(vocab_size, dim)`` (which autograd would create at the start of the
        backward).
    """
    flat_h = hidden.flatten(0, 1)  # (B*T, dim)
    flat_t = targets.flatten()  # (B*T,)
    if torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
        chunk_fn = compiled(_chunk_loss_and_grad) if compile else _chunk_loss_and_grad
        return _FusedLinearCrossEntropy.apply(flat_h, lm_head_weight, flat_t, num_chunks, chunk_fn)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for s, e in tile_ranges(len(flat_h), num_chunks, flat_h):
        logits = F.linear(flat_h[s:e], lm_head_weight)  # (n, V)
        total += F.cross_entropy(logits.float(), flat_t[s:e], ignore_index=IGNORE_INDEX, reduction="sum")
    return total
