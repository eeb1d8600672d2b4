"""Activation-memory techniques, applied to a built model from outside (the model file knows nothing of them).

- **Activation checkpointing** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): a wrapped
  decoder layer keeps only its input ``(B, T, dim)`` during the forward and recomputes its internals in the
  backward. Saves the tensors the layer would keep for backward (norm outputs, q/k/v, attention output and
  statistics, the SwiGLU gate/up products: measured in docs/memory.md) at the cost of one more forward of the layer.
- **Selective activation checkpointing** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models"; op-level as torchtitan applies it): every decoder layer is checkpointed with a policy that
  saves the outputs of its matmuls and of attention and recomputes everything else (norms, RoPE, SiLU, the
  elementwise products, casts), so the backward redoes no matmul.
- **Chunked (fused linear) cross-entropy**: the loss over ``lm_head`` is computed chunk by chunk of tokens, each
  chunk's gradients with respect to the hidden states and the weight computed in the same pass (Liger-Kernel's
  fused linear cross-entropy), so the full ``(B, T, vocab_size)`` logits — and their fp32 copy, softmax and
  gradient — never exist at once, and the backward recomputes nothing. For Llama 3's 128,256-entry vocabulary
  at ``B*T = 16k`` tokens those are 8 GiB in fp32. With a tied embedding (:func:`apply_tied_embedding_gradient`)
  the embedding's gradient is added, row by row, into the weight gradient the loss made in its forward, instead
  of arriving as a second ``(vocab_size, dim)`` tensor that autograd then sums into a third.

All keep the arithmetic of the plain computation, so losses are identical within float rounding of the summation
order (tested to 1e-6). The tiled MLP is :mod:`memfit.memory.tiled`, offloaded checkpoints
:mod:`memfit.memory.offload`.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.memory.switches import AUTO_CHUNK_LOGITS, AUTO_CHUNK_TOKENS, checkpointed_layers
from memfit.memory.tiled import is_tiled, tile_ranges

IGNORE_INDEX = -100


def apply_activation_checkpointing(model: nn.Module, mode: str, interval: int = 1) -> list[int]:
    """Make the chosen decoder layers recompute their activations in the backward.

    Each chosen layer's ``forward`` is replaced by a non-reentrant ``torch.utils.checkpoint.checkpoint`` of the
    original, so module structure and parameter names (and so checkpoints) are unchanged.

    Args:
        model: a :class:`memfit.models.decoder.Llama` (its ``model.layers``).
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
        model: a :class:`memfit.models.decoder.Llama` (its ``model.layers``), before FSDP wraps it.

    Returns:
        The number of layers compiled.
    """
    layers = model.model.layers
    if any(is_tiled(layer.mlp) for layer in layers):
        torch._dynamo.config.trace_autograd_ops = True
    for layer in layers:
        layer.compile(fullgraph=True)
    return len(layers)


@functools.cache
def compiled(fn, fullgraph: bool = True):
    """``torch.compile(fn)``, made once per function (the compiled loss and optimizer step of a ``compile: true``
    run)."""
    return torch.compile(fn, fullgraph=fullgraph)


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
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed cross-entropy and its gradient with respect to the chunk's logits.

    Args:
        hidden: ``(n, dim)``.
        weight: ``(V, dim)``.
        targets: ``(n,)`` int64, ``-100`` not counted.
        softcap: None, or Gemma 2's ``final_logit_softcapping``: the loss is over ``cap * tanh(logits / cap)``
            (in the logits' dtype, as the model's ``forward`` caps them) and the gradient is taken through it.
        token_weights: None, or ``(n,)`` fp32: each counted token's cross-entropy (and its gradient) times its
            weight (a preference objective's, :func:`memfit.objectives.weighted_policy_loss`).

    Returns:
        ``(loss, grad_logits)``: a 0-dim fp32 sum in nats, and ``(n, V)`` ``softmax(logits) - one_hot(targets)``
        (zero in rows that do not count; times the token's weight) in the dtype of the logits. The softmax is
        taken in fp32.
    """
    logits = F.linear(hidden, weight)  # (n, V), in the matmul dtype (bf16 under autocast)
    tanh = None
    if softcap is not None:  # capped as softcap_logits does: tanh(logits / cap) * cap
        tanh = torch.tanh(logits / softcap)  # (n, V)
        probs = (tanh * softcap).float()  # (n, V)
    else:
        probs = logits.float()  # (n, V): the same tensor in fp32, a copy otherwise
    dtype = logits.dtype
    del logits  # a bf16 chunk's logits are not needed beside their fp32 copy
    counted = targets != IGNORE_INDEX
    safe = targets.masked_fill(~counted, 0)
    picked = probs.gather(1, safe[:, None]).squeeze(1)  # (n,)
    # log-sum-exp and softmax in place (the logits are not needed any more): torch.logsumexp would make an
    # (n, V) temporary inside its kernel, which no tensor op shows to the estimate or the tracker
    peak = probs.amax(dim=-1, keepdim=True)  # (n, 1)
    probs.sub_(peak).exp_()  # exp(logits - max)
    total = probs.sum(dim=-1, keepdim=True)  # (n, 1)
    lse = total.log().add_(peak).squeeze(1)  # (n,)
    token_loss = lse - picked if token_weights is None else (lse - picked) * token_weights
    loss = torch.where(counted, token_loss, 0.0).sum()
    probs.div_(total)  # softmax
    probs[torch.arange(len(safe), device=safe.device), safe] -= 1.0
    probs.mul_((counted if token_weights is None else counted * token_weights)[:, None])
    if tanh is not None:  # d(cap * tanh(z / cap)) / dz = 1 - tanh^2
        probs.mul_(1.0 - tanh.float().square())
    return loss, probs.to(dtype)


_TIED_LOOKUPS: dict[int, weakref.ref] = {}
"""``id(weight)`` -> a weak reference to the weight, for each weight a :class:`_TiedEmbeddingLookup` looked up with
gradients: the chunked loss's backward hands its gradient of these weights on (:data:`_LOSS_WEIGHT_GRADIENTS`), of
no other (an untied ``lm_head``'s would be kept alive)."""

_LOSS_WEIGHT_GRADIENTS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
"""``id(weight)`` -> (a weak reference to the weight, the ``(V, dim)`` gradient the chunked loss's backward has just
returned for it). Set by that backward and taken by the tied embedding's backward, which comes after it in the
same backward pass (the embedding is the first use of the weight in the forward, the loss the last): the gradient
is still in autograd's buffer for the weight then, not yet handed to it."""


def _is(refs: dict[int, weakref.ref], weight: torch.Tensor | None) -> bool:
    """Whether ``refs`` holds ``weight`` itself (an ``id`` can be reused once its tensor is gone)."""
    ref = refs.get(id(weight))
    return ref is not None and ref() is weight


class _TiedEmbeddingLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds the rows of its gradient into the weight gradient that the
    chunked loss made for the same weight (:data:`_LOSS_WEIGHT_GRADIENTS`), in place, and so returns none; where
    there is none (a plain loss, evaluation, LoRA on ``lm_head``), it returns the dense gradient that
    ``F.embedding``'s own backward returns."""

    @staticmethod
    def forward(ctx, ids, weight):  # noqa: D102 (autograd's)
        ctx.save_for_backward(ids)
        # who it is, to find the loss's gradient (a parameter: it outlives this)
        ctx.weight = weakref.ref(weight)
        ctx.num_weights = weight.shape[0]
        return F.embedding(ids, weight)  # (*ids.shape, dim)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        if not ctx.needs_input_grad[1]:
            return None, None
        (ids,) = ctx.saved_tensors
        weight = ctx.weight()
        _TIED_LOOKUPS.pop(id(weight), None)
        of, grad_weight = _LOSS_WEIGHT_GRADIENTS.pop(id(weight), (None, None))
        if of is None or of() is not weight:  # none made for this weight (a reused id is another weight's)
            grad_weight = None
        if grad_weight is None:  # F.embedding's own backward
            return None, torch.ops.aten.embedding_backward(
                grad_output, ids, ctx.num_weights, -1, False, False
            )
        # (N, dim) rows into (V, dim): the sum autograd would make, without the (V, dim) addend and result
        grad_weight.index_add_(
            0, ids.reshape(-1), grad_output.reshape(-1, grad_output.shape[-1]).to(grad_weight.dtype)
        )
        return None, None


class TiedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose lookup is :class:`_TiedEmbeddingLookup`: the same forward, parameters and state
    dict; its weight gradient goes into the chunked loss's (:func:`apply_tied_embedding_gradient`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        """Args: input: int64 ids, any shape. Returns: ``(*input.shape, embedding_dim)``."""
        if (
            torch.is_grad_enabled() and self.weight.requires_grad
        ):  # its backward will take the loss's gradient
            _TIED_LOOKUPS[id(self.weight)] = weakref.ref(self.weight)
        return _TiedEmbeddingLookup.apply(input, self.weight)


def apply_tied_embedding_gradient(model: nn.Module) -> bool:
    """With a chunked loss and a tied embedding, add the embedding's gradient into the loss's weight gradient.

    The chunked loss (:func:`chunked_cross_entropy`) makes the ``(vocab_size, dim)`` gradient of the shared matrix
    in its forward. Left alone, the embedding's backward then returns a second dense ``(vocab_size, dim)``
    gradient (zeros but for the batch's rows) and autograd sums the two, in place when it can, else into a third
    tensor (always under a ``TorchDispatchMode``, a memory tracker's or the estimator's fake tensors). Here the
    embedding's backward adds its ``(B*T, dim)`` rows into the loss's gradient with ``index_add_``: one
    ``(vocab_size, dim)`` tensor at that moment instead of two or three (Llama-3.2-3B in fp32: 1.47 GiB instead
    of 4.40 GiB). The sum is the same but for rounding: a token's rows are added one at a time rather than summed
    first.

    Args:
        model: a :class:`memfit.models.decoder.Llama`, before FSDP wraps it.

    Returns:
        Whether it applied: the model ties ``lm_head`` to ``model.embed_tokens`` and the embedding is a plain one
        (no ``padding_idx``, ``max_norm``, ``scale_grad_by_freq`` or sparse gradient).
    """
    embedding = model.model.embed_tokens
    plain = (
        type(embedding) is nn.Embedding
        and embedding.padding_idx is None
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
    )
    if not plain or model.lm_head.weight is not embedding.weight:
        return False
    embedding.__class__ = TiedEmbedding
    return True


def _add_weight_gradient(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += grad_logits.T @ h`` (``(V, dim)``, from ``(n, V)`` and ``(n, dim)``): in place when the
    dtypes agree, else (autocast) the matmul in its dtype and the sum in the weight's."""
    if grad_logits.dtype == h.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), h)  # no temporary
    else:
        grad_weight += grad_logits.t() @ h


def can_defer_head_gradient(model: nn.Module) -> bool:
    """Whether :class:`DeferredWeightGradient` applies to ``model``'s ``lm_head``: a plain trainable weight (no
    LoRA on the head, not tied to the embedding) in a process that is not part of a group (FSDP gathers
    the head inside the model's forward)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return (
        isinstance(weight, nn.Parameter)
        and weight.requires_grad
        and getattr(head, "memfit_lora", None) is None
        and weight is not getattr(embed, "weight", None)
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    )


class DeferredWeightGradient:
    """The loss's ``lm_head`` weight gradient, computed at the end of the backward instead of in the forward.

    Made *before* the model's forward, it passes the weight through an identity autograd node that is older than
    every node of the forward: autograd runs ready nodes newest first, so this one runs last, after the embedding's
    backward, when the layers' saved activations (or checkpoints) are all freed. There it recomputes each chunk's
    logits and adds up the ``(vocab_size, dim)`` gradient (the same chunks, order and arithmetic as the forward
    would have: bit-identical), at the cost of one more ``lm_head`` matmul. Worth it when the optimizer steps in
    the backward, where the gradient is consumed at once: the peak of a large-vocabulary model at the end of the
    forward (saved activations plus that gradient) goes.

    Attributes:
        weight: ``(vocab_size, dim)``, the alias of the weight that the loss must use.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.compute = None
        self.weight = _DeferredWeight.apply(weight, self)


class _DeferredWeight(torch.autograd.Function):
    """Identity on the weight; its backward computes the gradient the loss left to it (see the class above)."""

    @staticmethod
    def forward(ctx, weight, deferred):  # noqa: D102 (autograd's)
        ctx.deferred = deferred
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, marker):  # noqa: D102
        compute, ctx.deferred.compute = ctx.deferred.compute, None
        return (marker if compute is None else compute()), None


def _deferred_weight_gradient(
    hidden, weight, targets, num_chunks, chunk_fn, softcap, token_weights, scale, autocast
):
    """The ``(V, dim)`` weight gradient of :class:`_FusedLinearCrossEntropy`, chunk by chunk, times ``scale``;
    under the forward's autocast state ``autocast`` (``(device_type, enabled, dtype)``)."""
    device_type, enabled, dtype = autocast
    grad_weight = torch.zeros_like(weight)
    with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
        for s, e in tile_ranges(len(hidden), num_chunks, hidden):
            w = None if token_weights is None else token_weights[s:e]
            _loss, grad_logits = chunk_fn(hidden[s:e], weight, targets[s:e], softcap, w)
            _add_weight_gradient(grad_weight, grad_logits, hidden[s:e])
            del grad_logits
    return grad_weight.mul_(scale.to(grad_weight.dtype))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy over ``hidden @ weight.T`` whose gradients are computed chunk by chunk in the forward.

    The forward leaves ``grad_hidden`` ``(N, dim)`` and ``grad_weight`` ``(V, dim)`` (for a loss gradient of 1)
    for the backward, which only scales them by the incoming gradient: no logits are kept or recomputed. With a
    :class:`DeferredWeightGradient` the forward makes no ``grad_weight``; the backward hands the deferred node the
    work of making it (and a zero-strided marker of the weight's shape in its place).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, num_chunks, chunk_fn, softcap=None, deferred=None, token_weights=None
    ):  # noqa: D102,E501
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        defer = need_weight and deferred is not None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # the weight gradient accumulates in the weight's dtype over the chunks, as autograd accumulates a
        # parameter's gradient over the chunks of a chunked computation (each matmul sums its chunk in fp32)
        grad_weight = torch.zeros_like(weight) if need_weight and not defer else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s, e in tile_ranges(len(hidden), num_chunks, hidden):
            h = hidden[s:e]  # (n, dim)
            w = None if token_weights is None else token_weights[s:e]
            loss, grad_logits = chunk_fn(h, weight, targets[s:e], softcap, w)  # 0-dim, (n, V)
            total += loss
            if need_hidden:
                grad_hidden[s:e] = grad_logits @ weight  # (n, dim)
            if grad_weight is not None:
                _add_weight_gradient(grad_weight, grad_logits, h)
        ctx.weight = weakref.ref(weight)
        ctx.deferred = None
        if defer:
            device_type = hidden.device.type
            ctx.deferred = (deferred, num_chunks, chunk_fn, softcap, token_weights)
            ctx.autocast = (
                device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
            )  # fmt: skip
            ctx.save_for_backward(grad_hidden, hidden, weight, targets)
        else:
            ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        if ctx.deferred is not None:
            grad_hidden, hidden, weight, targets = ctx.saved_tensors
            deferred, num_chunks, chunk_fn, softcap, token_weights = ctx.deferred
            deferred.compute = functools.partial(
                _deferred_weight_gradient, hidden.detach(), weight.detach(), targets, num_chunks, chunk_fn,
                softcap, token_weights, grad_output.detach(), ctx.autocast,
            )  # fmt: skip
            if grad_hidden is not None:
                grad_hidden.mul_(grad_output.to(grad_hidden.dtype))
            marker = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
            return grad_hidden, marker, None, None, None, None, None, None
        grad_hidden, grad_weight = ctx.saved_tensors
        # scaled in place: they are this graph's own buffers, used once (the training step never retains a graph)
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_output.to(grad.dtype))
        # a tied embedding's backward, next, adds its rows into it (apply_tied_embedding_gradient)
        if grad_weight is not None and _is(_TIED_LOOKUPS, ctx.weight()):
            _LOSS_WEIGHT_GRADIENTS[id(ctx.weight())] = (ctx.weight, grad_weight)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    num_chunks: int,
    *,
    compile: bool = False,
    softcap: float | None = None,
    deferred: DeferredWeightGradient | None = None,
    token_weights: torch.Tensor | None = None,
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
        softcap: None, or the model's ``final_logit_softcapping`` (Gemma 2): each chunk's logits are capped as
            the model's ``forward`` caps them.
        deferred: None, or the :class:`DeferredWeightGradient` whose ``weight`` is ``lm_head_weight``: the weight
            gradient is then made at the end of the backward (one more ``lm_head`` matmul), not in the forward.
        token_weights: None, or ``(B*T,)`` fp32: the sum is of each token's cross-entropy times its weight (with
            gradients; a preference objective's per-sequence weights, :mod:`memfit.objectives`).

    Returns:
        A 0-dim fp32 tensor: the summed cross-entropy (nats) over counted tokens. At most one chunk's logits
        ``(B*T/num_chunks, vocab_size)``, their fp32 softmax and gradient are alive at a time; between forward
        and backward the graph holds ``grad_hidden`` ``(B*T, dim)`` (in place of the hidden states a plain loss
        keeps) and ``grad_weight`` ``(vocab_size, dim)`` (which autograd would create at the start of the
        backward); with ``deferred``, ``grad_hidden`` and the ``(B*T, dim)`` hidden states instead, the weight
        gradient made at the end of the backward.
    """
    flat_h = hidden.flatten(0, 1)  # (B*T, dim)
    flat_t = targets.flatten()  # (B*T,)
    if torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
        chunk_fn = compiled(_chunk_loss_and_grad) if compile else _chunk_loss_and_grad
        return _FusedLinearCrossEntropy.apply(
            flat_h, lm_head_weight, flat_t, num_chunks, chunk_fn, softcap, deferred, token_weights
        )
    if token_weights is not None:
        raise ValueError("token_weights is for a loss with gradients (the weighted policy loss)")
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for s, e in tile_ranges(len(flat_h), num_chunks, flat_h):
        logits = F.linear(flat_h[s:e], lm_head_weight)  # (n, V)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        total += F.cross_entropy(logits.float(), flat_t[s:e], ignore_index=IGNORE_INDEX, reduction="sum")
    return total


@torch.no_grad()
def chunked_token_losses(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    num_chunks: int,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each token's cross-entropy of ``hidden @ lm_head_weight.T``, chunk by chunk, without gradients.

    A preference objective sums them per sequence (:mod:`memfit.objectives`) before it knows each sequence's
    weight in the loss. At most one chunk's ``(n, vocab_size)`` logits and their fp32 log-softmax exist at a time.

    Args:
        hidden: ``(B, T, dim)`` final-normed hidden states.
        lm_head_weight: ``(vocab_size, dim)``.
        targets: ``(B, T)`` int64; ``-100`` marks tokens that do not count.
        num_chunks: chunks of the ``B*T`` tokens (at least 1).
        softcap: None, or the model's ``final_logit_softcapping`` (Gemma 2).

    Returns:
        ``(B, T)`` fp32 cross-entropy in nats, 0 where the target does not count.
    """
    flat_h = hidden.flatten(0, 1)  # (B*T, dim)
    flat_t = targets.flatten()  # (B*T,)
    out = torch.empty(flat_t.shape, dtype=torch.float32, device=hidden.device)  # (B*T,)
    for s, e in tile_ranges(len(flat_h), max(1, num_chunks), flat_h):
        logits = F.linear(flat_h[s:e], lm_head_weight)  # (n, V)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        out[s:e] = F.cross_entropy(logits.float(), flat_t[s:e], ignore_index=IGNORE_INDEX, reduction="none")
        del logits
    return out.view(targets.shape)
