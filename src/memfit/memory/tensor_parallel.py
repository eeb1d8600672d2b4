"""Tensor parallelism (``distributed.tensor_parallel: T``): Megatron-LM's split of every decoder layer over a group
of T ranks, through ``torch.distributed.tensor.parallel``.

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053) splits attention by heads and the MLP by its hidden units:
q/k/v and gate/up are split column-wise (each rank computes ``nh / T`` query heads, ``nkv / T`` key/value heads
and ``I / T`` hidden units for the whole sequence), o and down row-wise (each rank's partial sums are added up by
one collective). Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) keeps what lies between them --
the residual stream and the norms -- split along the sequence: each rank holds ``(B, T_seq / T, C)`` of it, so
before attention and the MLP an all-gather makes the whole sequence, and after them a reduce-scatter both adds
the ranks' partial sums and splits the sequence again. The embedding is split by vocabulary rows (its output
reduce-scattered to the sequence split), ``lm_head`` by vocabulary columns, and the loss runs parallel over the
vocabulary on the ``(B, T_seq, V / T)`` logits (``loss_parallel``: no rank holds the whole logits). This is
torchtitan's ``parallelize_llama`` plan, on memfit's module names.

Per layer and forward a rank all-gathers and reduce-scatters the ``(B, T_seq, C)`` activations twice each
(around attention and around the MLP); the backward does the same with the roles swapped. What it saves: the
weights of a layer and the activations inside attention and the MLP are split T ways, and the residual stream
and the norms' activations T ways along the sequence.

How memfit's layers take it (the model itself is unchanged; this module changes it from outside):

- The linears are ``ColwiseParallel`` / ``RowwiseParallel``; the attention and MLP modules take the
  sequence-split stream through ``PrepareModuleInput`` (all-gathered to ``Replicate``). Attention's heads are
  local: its views use ``-1`` for the head count, so GQA works where T divides ``num_kv_heads``; Qwen3 / Gemma 3's
  per-head q/k norms (over ``hd``) and Gemma 2's soft-capped scores are per head, so they hold locally. RoPE
  tables come from the whole sequence (the model's positions are those of the whole rows).
- The RMSNorms (input / post-attention, Gemma's pre/post-feedforward, the final norm, and the per-head q/k norms)
  run memfit's own chunked kernel on the rank's local rows: their weights are ``Replicate`` DTensors whose local
  gradient is declared ``Partial`` (each rank saw its share of the tokens or heads), so FSDP2 sums it over the
  group (an all-reduce) before its reduce-scatter.
- Gemma's embedding scale and final logit soft-cap are per element; a tied ``lm_head`` shares the embedding's
  ``Shard(0)`` DTensor (both split the vocabulary rows).
- LoRA (``method: lora``): the adapted linears' ``lora_A`` / ``lora_B`` become DTensors beside the weight
  (column-wise: ``lora_B`` split by rows, ``lora_A`` replicated; row-wise: ``lora_A`` split by columns,
  ``lora_B`` replicated), so ``B A x`` is split as ``W x`` is.

Refused (:mod:`memfit.memory.switches.tensor`): FSDP1, Ulysses on the same ranks, the chunked loss and the tiled
MLP (both read the hidden states and ``lm_head``'s weight outside this plan), mixtures of experts, QLoRA (NF4
weights are not DTensor-shardable by rows and columns), the adapter method, preference objectives, ``compile``
and activation offloading.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import Tensor, nn

from memfit.memory.switches.tensor import architecture_refusal
from memfit.models.decoder import Decoder
from memfit.models.layers import RMSNorm, _RMSNormFunction

TP_ATTRIBUTE = "memfit_tp_mesh"
"""The attribute :func:`apply_tensor_parallel` sets on the model: its tensor-parallel mesh (the loss reads it)."""


def _local_norm_forward(norm: RMSNorm, x: Tensor) -> Tensor:
    """:class:`~memfit.models.layers.RMSNorm`'s forward on this rank's local rows (a plain tensor), with a
    ``Replicate`` DTensor weight whose gradient is this rank's part of the sum (``Partial``).

    Args:
        x: (..., C) this rank's rows (a sequence shard, or its local heads for a q/k norm).

    Returns:
        (..., C), a plain tensor.
    """
    from torch.distributed.tensor import DTensor, Partial

    weight = norm.weight
    if isinstance(weight, DTensor):
        weight = weight.to_local(grad_placements=[Partial()])
    if isinstance(x, DTensor):  # never on the plan's paths: the stream reaching a norm is local
        raise TypeError("a tensor-parallel RMSNorm takes this rank's local rows, not a DTensor")
    return _RMSNormFunction.apply(x, weight, norm.eps, norm.plus_one)


def _replicate_norm(norm: RMSNorm, tp_mesh: Any) -> None:
    """Make ``norm``'s weight a ``Replicate`` DTensor on ``tp_mesh`` and its forward :func:`_local_norm_forward`."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    weight = norm.weight
    replicated = distribute_tensor(weight.detach(), tp_mesh, [Replicate()], src_data_rank=None)
    norm.register_parameter("weight", nn.Parameter(replicated, requires_grad=weight.requires_grad))
    norm.forward = functools.partial(_local_norm_forward, norm)


def _lora_placements(linear: nn.Linear, tp_mesh: Any, colwise: bool) -> None:
    """Give a LoRA-adapted linear's ``lora_A`` / ``lora_B`` the placements that split ``B A x`` as ``W x`` is split
    (see the module doc); a linear without LoRA is left as it is."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = {
        "lora_A": Replicate() if colwise else Shard(1),
        "lora_B": Shard(0) if colwise else Replicate(),
    }
    for name, placement in placements.items():
        param = linear._parameters.get(name)
        if param is None:
            continue
        if param.is_meta:  # built on meta (every sharded run): the values come later, as the weights' do
            full = torch.empty(param.shape, dtype=param.dtype, device="meta")
        else:
            full = param.full_tensor() if isinstance(param, DTensor) else param
        placed = distribute_tensor(full.detach(), tp_mesh, [placement], src_data_rank=None)
        linear.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


def check_tensor_parallel(model: Decoder, size: int) -> None:
    """Refuse an architecture the plan cannot split ``size`` ways (config validation's own refusal,
    :func:`memfit.memory.switches.tensor.architecture_refusal`).

    Raises:
        ValueError: ``num_heads`` or ``num_kv_heads`` not divisible by ``size``; a mixture of experts; q/k norms
            over the whole projection (OLMoE's).
    """
    refusal = architecture_refusal(model.config, size)
    if refusal is not None:
        raise ValueError(refusal)


def apply_tensor_parallel(model: Decoder, tp_mesh: Any) -> int:
    """Split ``model`` over the tensor-parallel mesh ``tp_mesh`` in place (see the module doc).

    Apply to a model built on the meta device (or materialised; values are then taken from each rank's whole
    copy), after the method (LoRA) and before activation checkpointing and FSDP2 (torchtitan's order: TP, AC,
    compile, FSDP). FSDP2 then shards the resulting DTensors over the data-parallel mesh
    (:func:`memfit.distributed.fsdp_mesh`), the 2-D FSDP x TP composition.

    Args:
        model: a :class:`~memfit.models.decoder.Decoder` of a dense family.
        tp_mesh: a 1-D ``DeviceMesh`` of T ranks (:func:`memfit.distributed.tensor_parallel_mesh`).

    Returns:
        The number of decoder layers split (0 for a mesh of one rank, which leaves the model as it is).

    Raises:
        ValueError: as :func:`check_tensor_parallel`.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    size = tp_mesh.size()
    if size == 1:
        return 0
    check_tensor_parallel(model, size)
    # the stream between the layers is this rank's (B, T / tp, C) rows, a plain tensor; the embedding's rows are
    # split by vocabulary and its output reduce-scattered along the sequence; lm_head's columns are split by
    # vocabulary, its logits kept a (B, T, V) DTensor sharded on V for the loss
    parallelize_module(
        model,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    model.tie_weights()  # a tied lm_head got a new Parameter of the same Shard(0) DTensor: the embedding's again
    _lora_placements(model.lm_head, tp_mesh, colwise=True)
    _replicate_norm(model.model.norm, tp_mesh)
    gathered = (Shard(1), None, None, None)  # (x, cos, sin, doc_ids): x all-gathered, the rest as they are
    for layer in model.model.layers:
        plan = {
            "self_attn": PrepareModuleInput(
                input_layouts=gathered, desired_input_layouts=(Replicate(), None, None, None)
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(layer, tp_mesh, plan)
        for name, style in plan.items():  # each split linear's LoRA factors split as its weight is
            if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                colwise = isinstance(style, ColwiseParallel)
                _lora_placements(layer.get_submodule(name), tp_mesh, colwise=colwise)
        for module in layer.modules():
            if isinstance(module, RMSNorm):  # the layer's norms and the per-head q/k norms
                _replicate_norm(module, tp_mesh)
    setattr(model, TP_ATTRIBUTE, tp_mesh)
    return len(model.model.layers)


COLUMN_WISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "embed_tokens")
"""The modules split on their weight's dim 0 (their outputs; the embedding's vocabulary rows)."""
ROW_WISE = ("o_proj", "down_proj")
"""The modules split on their weight's dim 1 (their inputs)."""


def tensor_parallel_shape(name: str, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The shape of a parameter's block on tensor-parallel rank 0 (``torch.chunk``'s layout), from its name: what
    FSDP2 then shards over the data-parallel ranks. Column-wise modules' weights, biases and ``lora_B`` split on dim
    0, row-wise modules' weights and ``lora_A`` on dim 1; the rest (norms, the other LoRA factor) is replicated.

    Args:
        name: the parameter's name in the model (``model.layers.0.self_attn.q_proj.weight``).
        shape: its whole shape.
        size: T, ranks of the tensor-parallel group.

    Returns:
        The block's shape (``shape`` itself for a replicated parameter or T = 1).
    """
    module, _, kind = name.rpartition(".")
    owner = module.rsplit(".", 1)[-1]
    dim = None
    if owner in COLUMN_WISE and kind in ("weight", "bias", "lora_B"):
        dim = 0
    elif owner in ROW_WISE and kind in ("weight", "lora_A"):
        dim = 1
    if size == 1 or dim is None or len(shape) <= dim:
        return shape
    return (*shape[:dim], min(shape[dim], -(-shape[dim] // size)), *shape[dim + 1 :])


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether :func:`apply_tensor_parallel` split ``model`` (its logits are a vocabulary-sharded DTensor)."""
    return getattr(model, TP_ATTRIBUTE, None) is not None


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` for a tensor-parallel model (its cross-entropy runs
    over the vocabulary shards, forward and backward: enter it around both), nothing otherwise."""
    if not is_tensor_parallel(model):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_loss(loss: Tensor) -> Tensor:
    """A loss computed under :func:`loss_context` as the plain tensor the step adds up: a DTensor loss is
    ``Replicate`` over the group (every rank holds the whole sum), so its local value is the loss."""
    return loss.to_local() if hasattr(loss, "to_local") else loss
