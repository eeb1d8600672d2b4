"""LLaMA-Adapter (Zhang et al. 2023, "LLaMA-Adapter: Efficient Fine-tuning of Language Models with Zero-init
Attention", in lit-llama's formulation), applied to a built :class:`~memfit.models.decoder.Decoder` from outside:
each adapted attention layer learns ``prompt_length`` prompt vectors; its (RoPE'd) queries also attend, without mask
or position, over keys and values projected from the prompt by the layer's own frozen ``k_proj`` / ``v_proj``, and
that output, scaled per head by a zero-initialised gate, is added before ``o_proj``. Zero gates make the model the
base at step 0. The shared parts of the methods (freezing, one method a model, state dicts) are
:mod:`memfit.models.peft`'s.

Shape letters: B batch, T sequence length, C model width, nh query heads, nkv key/value heads, hd head size,
L adapter prompt length.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.models.decoder import Attention, Decoder
from memfit.models.peft import (
    ADAPTER_SUFFIXES,
    AdapterSettings,
    check_no_peft,
    freeze_base,
    init_method_parameter_,
    load_selected,
    select_state_dict,
)


def _prompt_attention(attn: Attention, q: Tensor) -> Tensor:
    """Attention of the queries over the layer's adapter prompt: no mask, no positions.

    Args:
        attn: an adapted attention layer.
        q: (B, nh, T, hd) RoPE'd queries.

    Returns:
        (B, nh, T, hd).
    """
    B, nh, _, hd = q.shape
    nkv = attn.num_kv_heads
    prompt = attn.adapter_prompt  # (L, C)
    L = prompt.shape[0]
    pk = attn.k_proj(prompt).view(L, nkv, hd)  # (L, nkv, hd)
    if "k_norm" in attn._modules:  # qk_norm (Qwen3): the prompt's keys are normed as the sequence's are
        pk = attn.k_norm(pk)
    pk = pk.transpose(0, 1)  # (nkv, L, hd)
    pv = attn.v_proj(prompt).view(L, nkv, hd).transpose(0, 1)  # (nkv, L, hd)
    # each kv head serves nh // nkv query heads; the prompt is the same for every sample (a broadcast view)
    pk = (
        pk[:, None].expand(nkv, nh // nkv, L, hd).reshape(1, nh, L, hd).expand(B, nh, L, hd)
    )  # (B, nh, L, hd)
    pv = (
        pv[:, None].expand(nkv, nh // nkv, L, hd).reshape(1, nh, L, hd).expand(B, nh, L, hd)
    )  # (B, nh, L, hd)
    return F.scaled_dot_product_attention(q, pk.to(q.dtype), pv.to(q.dtype))  # (B, nh, T, hd)


def _adapter_attention_forward(
    self: Attention, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None
) -> Tensor:
    """Causal attention plus the gated attention over the adapter prompt, bound to an adapted ``Attention``.

    Args:
        x: (B, T, C) normed hidden states.
        cos: (T, hd) or (B, 1, T, hd) RoPE table.
        sin: same shape as ``cos``.
        doc_ids: None (causal), or (B, T) ids of packed documents; they restrict the sequence part only, every
            query sees every prompt vector.

    Returns:
        (B, T, C).
    """
    B, T, _ = x.shape
    q, k, v = self.project_qkv(x, cos, sin)  # (B, nh, T, hd), (B, nkv, T, hd) x 2
    y = self.attend(q, k, v, doc_ids)  # (B, nh, T, hd)
    y = y + self.adapter_gate * _prompt_attention(self, q)  # gate (1, nh, 1, 1)
    y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, nh * hd)
    return self.o_proj(y)  # (B, T, C)


def apply_adapter(
    model: Decoder, *, prompt_length: int = 10, num_layers: int | None = None, seed: int | None = None
) -> list[str]:
    """Add LLaMA-Adapter prompts and zero gates to the top decoder layers and freeze everything else.

    Each adapted ``self_attn`` gets ``adapter_prompt`` (L, C), normal(0, ADAPTER_PROMPT_STD), and ``adapter_gate``
    (1, nh, 1, 1), zeros, on the base weights' device and in their dtype; its ``forward`` adds
    ``gate * attention(q, k_proj(prompt), v_proj(prompt))`` to the causal attention output before ``o_proj``.

    Args:
        model: a built :class:`~memfit.models.decoder.Llama` (base weights already loaded).
        prompt_length: L, a positive int.
        num_layers: adapt the last ``num_layers`` decoder layers; None adapts all.
        seed: seed of a generator for the prompts' init; None draws from the global RNG.

    Returns:
        The names of the new trainable parameters, e.g. ``model.layers.1.self_attn.adapter_prompt``.

    Raises:
        ValueError: ``prompt_length`` not a positive int, ``num_layers`` outside 1..(layers of the model), or a
            method already applied.
    """
    check_no_peft(model, "LLaMA-Adapter")
    if not isinstance(prompt_length, int) or isinstance(prompt_length, bool) or prompt_length <= 0:
        raise ValueError(f"adapter prompt_length must be a positive int, got {prompt_length!r}")
    total = len(model.model.layers)
    if num_layers is None:
        num_layers = total
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= total:
        raise ValueError(
            f"adapter num_layers must be an int in 1..{total} (the model's layers), got {num_layers!r}"
        )
    layers = tuple(range(total - num_layers, total))
    names = []
    for i in layers:
        attn = model.model.layers[i].self_attn
        weight = attn.q_proj.weight
        dim = attn.k_proj.in_features
        prompt = torch.empty(prompt_length, dim, device=weight.device, dtype=weight.dtype)  # (L, C)
        gate = torch.empty(1, attn.num_heads, 1, 1, device=weight.device, dtype=weight.dtype)  # (1, nh, 1, 1)
        init_method_parameter_("adapter_prompt", prompt, seed)
        init_method_parameter_("adapter_gate", gate, seed)
        attn.register_parameter("adapter_prompt", nn.Parameter(prompt))
        attn.register_parameter("adapter_gate", nn.Parameter(gate))
        attn.forward = types.MethodType(_adapter_attention_forward, attn)
        names += [f"model.layers.{i}.self_attn.adapter_prompt", f"model.layers.{i}.self_attn.adapter_gate"]
    freeze_base(model, names)
    model.memfit_peft = AdapterSettings(prompt_length=prompt_length, layers=layers)
    return names


def _adapter_settings(model: nn.Module) -> AdapterSettings:
    settings = getattr(model, "memfit_peft", None)
    if not isinstance(settings, AdapterSettings):
        raise ValueError("the model has no LLaMA-Adapter applied (call apply_adapter first)")
    return settings


def adapter_state_dict(model: Decoder) -> dict[str, Tensor]:
    """The adapter tensors only: ``model.layers.{i}.self_attn.adapter_prompt`` (L, C) and ``.adapter_gate``.

    Args:
        model: a model with LLaMA-Adapter.

    Returns:
        Name -> tensor, detached, sharing storage with the parameters.
    """
    _adapter_settings(model)
    return select_state_dict(model, ADAPTER_SUFFIXES)


def load_adapter_state_dict(model: Decoder, state_dict: Mapping[str, Tensor]) -> None:
    """Copy an :func:`adapter_state_dict` into the model's adapter parameters (strict).

    Args:
        model: a model with LLaMA-Adapter applied to the same layers with the same prompt length.
        state_dict: names as :func:`adapter_state_dict` gives them.

    Raises:
        ValueError: the model has no adapter, a key is missing or unexpected, or a shape differs (nothing copied).
    """
    _adapter_settings(model)
    load_selected(model, state_dict, ADAPTER_SUFFIXES, "LLaMA-Adapter")
