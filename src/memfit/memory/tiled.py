"""Tiled MLP (``tiled_mlp``): each decoder layer's SwiGLU MLP over the tokens tile by tile.

Arctic Long Sequence Training's TiledMLP (Bekman et al. 2025, arXiv 2506.13996): the forward runs the MLP tile by
tile without a graph and keeps only its input; the backward runs each tile again, with a graph, and takes its
gradients at once, so SwiGLU's three ``(B, T, intermediate_size)`` tensors exist for one tile at a time. The MLP's
trainable parameters are inputs of the autograd function: the tiles' weight gradients add up and reach each
parameter once (optimizer-in-backward hooks and FSDP2's reduce-scatter see one gradient). The same arithmetic as
the untiled MLP, the weight gradients summed in another order (1e-5 on the losses). Under activation checkpointing
the layer's recomputation in the backward does not run the tiles again (it needs the MLP's input, not its output):
the MLP costs one forward more than untiled, as without checkpointing. Where a norm after the MLP saves its output
(Gemma's ``post_feedforward_layernorm``), the recomputation runs the tiles again (without a graph): one forward
more.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from memfit.models import moe
from memfit.models.tiles import representative


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
        if (
            not torch.compiler.is_compiling()
            and torch._C._current_graph_task_id() != -1
            and not getattr(module, "memfit_output_saved", False)
        ):
            # a checkpointed layer recomputed in the backward: the recomputation needs what the layer saves (this
            # input is its last), not its output, which torch's non-reentrant checkpoint discards (and stops right
            # after the last saved tensor): the tiles' forward is not run again, and the output stays unwritten.
            # Not where a norm after the MLP saves its output (Gemma's sandwich norms): then the tiles run again
            return x.new_empty(x.shape)
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
                # a mixture of experts' load-balancing loss: each tile's by its share of the tokens
                with torch.enable_grad(), moe.aux_loss_share((e - s) / len(flat)):
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


def is_tiled(module: nn.Module) -> bool:
    """Whether ``module`` is an MLP :func:`apply_tiled_mlp` tiled."""
    return type(module) in _UNTILED


def apply_tiled_mlp(model: nn.Module, setting: int | str) -> int:
    """Make every decoder layer's MLP run tile by tile (``tiled_mlp``; see the module doc).

    Each MLP becomes an instance of a subclass of its class (``TiledMLP``) whose ``forward`` runs the original tile
    by tile (LoRA's adapted projections included), with ``memfit_tiles`` the setting; module structure and parameter
    names are unchanged. Apply before activation checkpointing and compile; both then take the tiled MLP as part of
    the layer.

    Args:
        model: a :class:`memfit.models.decoder.Llama`.
        setting: tiles per micro-batch, or ``auto`` (:func:`mlp_tiles`); 0 leaves the model as it is.

    Returns:
        The number of MLPs tiled.
    """
    if setting == 0:
        return 0
    layers = model.model.layers
    # a norm after the MLP (post_feedforward_layernorm) saves the MLP's output for its backward
    output_saved = bool(getattr(model.config, "sandwich_norms", False))
    for layer in layers:
        mlp = layer.mlp
        if type(mlp) not in _UNTILED:
            mlp.__class__ = _tiled_class(type(mlp))
        mlp.memfit_tiles = setting
        mlp.memfit_output_saved = output_saved
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
