"""THE family registry: one declared entry per family of checkpoints that memfit's decoder builds.

Each :class:`Family` is the whole of what sets one family apart: its Hugging Face ``model_type`` and
``architectures``, the ``config.json`` keys it reads and writes beyond the ones every family shares (the sizes,
RoPE, the norms' epsilon, tied embeddings: :mod:`memfit.convert.hf`), its architecture differences as
:class:`~memfit.models.decoder.DecoderConfig` fields, the tensors a layer adds to Llama's, its LoRA targets and its
presets. memfit's own decoder (:mod:`memfit.models.decoder`) builds every family from those fields, so every memory
switch, the tracker, the estimator and the planner apply unchanged, and the model still knows nothing of
techniques.

Weight names are memfit's module names, which are Hugging Face's for most families here (``q_proj``, ``q_norm``,
...): a checkpoint's tensors load by name and an export writes them back under the same names. A family whose
checkpoints fuse several of memfit's matrices into one (Phi-3's ``qkv_proj``: the rows of q, then k, then v;
``gate_up_proj``: gate, then up) declares it in :attr:`Family.fused`: :mod:`memfit.convert.hf` splits such a
tensor into memfit's modules as it reads it and fuses them again as it writes, so the decoder keeps its split
modules and every memory switch applies unchanged. Its LoRA targets may name the fused matrix
(:attr:`Family.lora_aliases`), which adapts each of its parts.

A mixture of experts (Qwen3-MoE, Mixtral, OLMoE) declares how its checkpoints name each expert's tensors
(:attr:`Family.experts`): :mod:`memfit.convert.hf` stacks them into memfit's fused 3-D expert tensors (transformers
5's) as it reads them, reads transformers 5's fused tensors as they are, and writes one tensor per expert again.

Families memfit does not build (other mixtures of experts, a state-space model, an unknown ``model_type``) are refused
by :func:`hf_family` before anything is allocated, naming ``model_type`` / ``architectures`` and the families
memfit builds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memfit.models.config import DecoderConfig

__all__ = ["FAMILIES", "Family", "family", "hf_family"]

Refuse = Callable[[str, str], Exception]
"""``refuse(key, why)``: the error (naming the file and the key) that a family's reader raises."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
"""The linear layers of the Llama-layout families, in module order."""
_ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")
"""The linear layers of a mixture-of-experts family (its experts are 3-D parameters, not linear layers)."""
_MOE_LAYER = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""A mixture-of-experts layer's feed-forward tensors, in memfit (and transformers 5) names."""


@dataclass(frozen=True)
class Family:
    """One family of checkpoints: what memfit reads, builds and writes for it.

    The keys every family shares (sizes, RoPE, ``rms_norm_eps``, ``tie_word_embeddings``, ``hidden_act``) are
    mapped by :mod:`memfit.convert.hf`; ``read`` and ``write`` handle the family's own.
    """

    name: str
    """memfit's name, the value of :attr:`DecoderConfig.family`."""
    model_types: tuple[str, ...]
    """Hugging Face ``model_type`` values read as this family; the first is written."""
    architectures: tuple[str, ...]
    """Hugging Face ``architectures`` read as this family; the first is written (AutoModelForCausalLM's class)."""
    summary: str
    """What sets it apart from Llama, in words (error messages and docs)."""
    read: Callable[[Mapping[str, Any], Refuse], dict[str, Any]]
    """``config.json`` -> the :class:`DecoderConfig` fields of the family's architecture differences
    (``head_dim``, ``attention_bias``, ``qk_norm``, ``sliding_window``); refuses, naming the key, a field that
    changes the computation and that memfit does not implement."""
    write: Callable[[DecoderConfig], dict[str, Any]]
    """:class:`DecoderConfig` -> the family's own ``config.json`` keys (everything transformers would otherwise
    default differently)."""
    hf_defaults: Mapping[str, Any]
    """Shared keys whose transformers default differs from Llama's, used when ``config.json`` lacks them."""
    layer_tensors: tuple[str, ...]
    """A decoder layer's tensors beyond Llama's, under their names in ``model.layers.<i>.`` (checked against
    transformers' own class in the tests)."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Names ``lora.target_modules`` may hold."""
    presets: tuple[str, ...] = ()
    """Names of :data:`memfit.models.presets.MODEL_PRESETS` of this family."""
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(fused, parts)``: a tensor of the family's checkpoints under ``model.layers.<i>.``, and memfit's tensors
    whose rows it holds, concatenated along dim 0 in this order (each part's rows are its shape in the model).
    Read split, written fused (:mod:`memfit.convert.hf`); a memfit checkpoint keeps the parts."""
    lora_aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """A name ``lora.target_modules`` may hold for several of memfit's linear layers (Phi-3's ``qkv_proj``:
    ``q_proj``, ``k_proj``, ``v_proj``): each part gets a LoRA of its own."""
    hidden_acts: tuple[str, ...] = ("silu",)
    """``hidden_act`` values :mod:`memfit.convert.hf` accepts for the family (its MLP's activation)."""
    implements: tuple[str, ...] = ()
    """Keys memfit refuses on other families as computations it does not implement (soft-capping) that this
    family's ``read`` maps."""
    reads_rope: bool = False
    """``read`` maps the RoPE keys itself (Gemma 3's per-layer-type ``rope_parameters``), in place of the shared
    reading of ``rope_theta`` / ``rope_scaling`` / ``rope_parameters``."""
    experts: ExpertLayout | None = None
    """A mixture of experts: how its checkpoints name the experts one tensor each (transformers 4.x and the Hub);
    the fused 3-D tensors of transformers 5 are read under memfit's own names."""


@dataclass(frozen=True)
class ExpertLayout:
    """The per-expert tensor names of a mixture-of-experts checkpoint, under ``model.layers.<i>.``:
    ``{block}.gate.weight`` (the router, memfit's ``mlp.gate.weight``) and ``{block}.experts.<e>.{gate}.weight``
    (I, C), ``...{up}.weight`` (I, C), ``...{down}.weight`` (C, I), which memfit stacks into
    ``mlp.experts.gate_up_proj`` (E, 2I, C) and ``mlp.experts.down_proj`` (E, C, I) as it reads them and splits
    again as it writes."""

    block: str = "mlp"
    """The sparse block's name (Mixtral's ``block_sparse_moe``)."""
    gate: str = "gate_proj"
    """One expert's gate projection (Mixtral's ``w1``)."""
    up: str = "up_proj"
    """One expert's up projection (Mixtral's ``w3``)."""
    down: str = "down_proj"
    """One expert's down projection (Mixtral's ``w2``)."""


# ----------------------------------------------------------------------------------------------------------------
# Readers and writers of the family's own keys


def _refuse_true(
    cfg: Mapping[str, Any], refuse: Refuse, keys: tuple[str, ...], family: str, why: str
) -> None:
    for key in keys:
        if cfg.get(key):
            raise refuse(key, f"is true; {why} ({family} checkpoints have none)")


def _refuse_layer_types(cfg: Mapping[str, Any], refuse: Refuse, allowed: str) -> None:
    """A per-layer pattern of attention kinds (``layer_types``) that is not one kind throughout."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None and set(layer_types) - {allowed}:
        raise refuse(
            "layer_types",
            f"is {sorted(set(layer_types))}; memfit builds every layer alike here ({allowed!r} in each)",
        )


def _refuse_windowed_layers(cfg: Mapping[str, Any], refuse: Refuse, family: str) -> None:
    """Qwen's ``use_sliding_window``: a window on the layers from ``max_window_layers`` on, which memfit does not
    build (every Qwen2.5 and Qwen3 release has it off)."""
    if cfg.get("use_sliding_window"):
        raise refuse(
            "use_sliding_window",
            f"is true; memfit does not build {family}'s sliding window on the layers from max_window_layers on "
            f"(the released checkpoints have it off)",
        )
    _refuse_layer_types(cfg, refuse, "full_attention")


def _head_dim(cfg: Mapping[str, Any], refuse: Refuse, default: int | None = None) -> int | None:
    head_dim = cfg.get("head_dim", default)
    if head_dim is not None and (
        not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0
    ):
        raise refuse("head_dim", f"is {head_dim!r}; it must be a positive int")
    return head_dim


def _read_llama(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    _refuse_true(
        cfg,
        refuse,
        ("attention_bias", "mlp_bias"),
        "Llama",
        "memfit builds Llama without bias terms (Qwen2's q/k/v biases are model_type 'qwen2')",
    )
    return {"head_dim": _head_dim(cfg, refuse)}


def _write_llama(config: DecoderConfig) -> dict[str, Any]:
    return {"head_dim": config.head_dim, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


def _read_mistral(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    _refuse_true(
        cfg, refuse, ("attention_bias", "mlp_bias"), "Mistral", "memfit builds Mistral without biases"
    )
    window = cfg.get("sliding_window", 4096)  # MistralConfig's default when the key is absent
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise refuse("sliding_window", f"is {window!r}; it must be null or a positive int")
    _refuse_layer_types(cfg, refuse, "full_attention" if window is None else "sliding_attention")
    return {"head_dim": _head_dim(cfg, refuse), "sliding_window": window}


def _write_mistral(config: DecoderConfig) -> dict[str, Any]:
    # null written out: MistralConfig reads a missing sliding_window as 4096
    return {"head_dim": config.head_dim, "sliding_window": config.sliding_window}


def _read_qwen2(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    _refuse_true(cfg, refuse, ("mlp_bias",), "Qwen2", "memfit builds Qwen2's MLP without biases")
    _refuse_windowed_layers(cfg, refuse, "Qwen2")
    return {"head_dim": _head_dim(cfg, refuse), "attention_bias": True}


def _write_qwen2(config: DecoderConfig) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": config.num_layers}


def _read_qwen3(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    _refuse_true(
        cfg,
        refuse,
        ("attention_bias", "mlp_bias"),
        "Qwen3",
        "memfit builds Qwen3 without bias terms (its attention_bias puts one on o_proj too)",
    )
    _refuse_windowed_layers(cfg, refuse, "Qwen3")
    return {
        "head_dim": _head_dim(cfg, refuse, default=128),
        "qk_norm": True,
    }  # Qwen3Config's default head_dim


def _write_qwen3(config: DecoderConfig) -> dict[str, Any]:
    return {
        "head_dim": config.head_dim,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
    }


def _read_phi3(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    for key in ("resid_pdrop", "embd_pdrop"):
        if cfg.get(key) not in (None, 0, 0.0):
            raise refuse(
                key,
                f"is {cfg[key]!r}; memfit's decoder has no dropout on the residuals or the embedding (0.0)",
            )
    _refuse_true(cfg, refuse, ("attention_bias", "mlp_bias"), "Phi-3", "memfit builds Phi-3 without biases")
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        rope_type = (
            rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        )
        if rope_type != "default":  # Phi3Config turns "su" and "yarn" into "longrope"
            raise refuse(
                f"{key}.rope_type",
                f"is {rope_type!r}; memfit does not implement LongRoPE (Phi-3.5-mini, Phi-3-*-128k): it builds "
                f"Phi-3 with plain RoPE only (Phi-3-mini-4k)",
            )
        if rope:  # a non-null rope_scaling takes precedence, as in hf.py
            break
    window = cfg.get("sliding_window")  # Phi3Config's default: None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise refuse("sliding_window", f"is {window!r}; it must be null or a positive int")
    return {"head_dim": _head_dim(cfg, refuse), "sliding_window": window}


def _write_phi3(config: DecoderConfig) -> dict[str, Any]:
    return {
        "head_dim": config.head_dim,  # Phi3Attention and its RoPE read it where present
        "sliding_window": config.sliding_window,
        "original_max_position_embeddings": config.max_seq_len,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        # Phi3Config's default pad id, 32000, is an embedding row only a 32064 vocabulary has; the id only
        # zeroes that row's gradient in transformers' training (memfit keeps no pad id), never the logits
        "pad_token_id": None,
    }


def _positive_int(cfg: Mapping[str, Any], refuse: Refuse, key: str, default: Any) -> Any:
    """``cfg[key]`` (``default`` when absent): a positive int."""
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise refuse(key, f"is {value!r}; it must be a positive int")
    return value


def _read_experts(
    cfg: Mapping[str, Any], refuse: Refuse, experts_key: str, experts: int, per_token: int, coef: float
) -> dict[str, Any]:
    """The mixture-of-experts keys every MoE family shares: E (under ``experts_key``), k, the aux-loss weight, and
    refusals of what memfit does not build (router jitter, a shared expert)."""
    if cfg.get("router_jitter_noise"):
        raise refuse(
            "router_jitter_noise", f"is {cfg['router_jitter_noise']!r}; memfit routes without jitter (0.0)"
        )
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key):
            raise refuse(key, "is set; memfit builds no shared expert (Qwen2-MoE, DeepSeek)")
    alias = "num_local_experts" if experts_key == "num_experts" else "num_experts"
    if experts_key not in cfg and alias in cfg:  # transformers 5 writes some under the other name
        experts_key = alias
    num_experts = _positive_int(cfg, refuse, experts_key, experts)
    top_k = _positive_int(cfg, refuse, "num_experts_per_tok", per_token)
    if top_k > num_experts:
        raise refuse(
            "num_experts_per_tok", f"is {top_k}, more than the {num_experts} experts ({experts_key})"
        )
    aux = cfg.get("router_aux_loss_coef", coef)
    if isinstance(aux, bool) or not isinstance(aux, (int, float)) or aux < 0:
        raise refuse("router_aux_loss_coef", f"is {aux!r}; it must be a number >= 0")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k, "router_aux_loss_coef": float(aux)}


def _read_qwen3_moe(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    dense = _read_qwen3(cfg, refuse)
    step = _positive_int(cfg, refuse, "decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) for i in only):
        raise refuse("mlp_only_layers", f"is {only!r}; it must be a list of layer indices")
    layers = cfg.get("num_hidden_layers") or 0
    dense_layers = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
    return {
        **dense,
        **_read_experts(cfg, refuse, "num_experts", 128, 8, 0.001),
        "moe_intermediate_size": _positive_int(cfg, refuse, "moe_intermediate_size", 768),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "dense_layers": dense_layers,
    }


def _write_experts(config: DecoderConfig, experts_key: str = "num_experts") -> dict[str, Any]:
    return {
        experts_key: config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
    }


def _write_qwen3_moe(config: DecoderConfig) -> dict[str, Any]:
    return {
        **_write_qwen3(config),
        **_write_experts(config),
        "moe_intermediate_size": config.expert_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(config.dense_layers),
    }


def _read_mixtral(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    return {
        **_read_mistral({**cfg, "sliding_window": cfg.get("sliding_window")}, refuse),  # MixtralConfig: None
        **_read_experts(cfg, refuse, "num_local_experts", 8, 2, 0.001),
        "norm_topk_prob": True,  # transformers' Mixtral always renormalises the top k
    }


def _write_mixtral(config: DecoderConfig) -> dict[str, Any]:
    return {
        **_write_mistral(config),
        **_write_experts(config, "num_local_experts"),
        "router_jitter_noise": 0.0,
    }


def _read_olmoe(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    _refuse_true(cfg, refuse, ("attention_bias", "mlp_bias"), "OLMoE", "memfit builds OLMoE without biases")
    if cfg.get("clip_qkv") is not None:
        raise refuse(
            "clip_qkv", f"is {cfg['clip_qkv']!r}; memfit does not clip q, k and v (OLMoE-1B-7B: null)"
        )
    return {
        "head_dim": _head_dim(cfg, refuse),
        "qk_norm": True,
        "qk_norm_per_head": False,
        **_read_experts(cfg, refuse, "num_experts", 64, 8, 0.01),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
    }


def _write_olmoe(config: DecoderConfig) -> dict[str, Any]:
    return {
        **_write_experts(config),
        "norm_topk_prob": config.norm_topk_prob,
        "clip_qkv": None,
        "attention_bias": False,
    }


GEMMA_ACT = "gelu_pytorch_tanh"
"""transformers' name of Gemma's activation (GELU, tanh approximation)."""
_GEMMA_COMMON = {"mlp_activation": "gelu_tanh", "norm_plus_one": True, "sandwich_norms": True,
                 "scale_embeddings": True}  # fmt: skip


def _positive(cfg: Mapping[str, Any], refuse: Refuse, key: str, default: Any) -> Any:
    """``cfg[key]`` (``default`` when absent): None or a positive number."""
    value = cfg.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise refuse(key, f"is {value!r}; it must be null or a positive number")
    return value


def _gemma_layers(cfg: Mapping[str, Any], refuse: Refuse, pattern: int) -> tuple[str, ...]:
    """``layer_types``, or transformers' default: every ``pattern``-th layer global, the others local."""
    layers = cfg.get("num_hidden_layers")
    kinds = cfg.get("layer_types")
    if kinds is None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise refuse("sliding_window_pattern", f"is {pattern!r}; it must be a positive int")
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers or 0)]
    if not isinstance(kinds, (list, tuple)) or set(kinds) - {"sliding_attention", "full_attention"}:
        raise refuse(
            "layer_types", f"is {kinds!r}; memfit builds 'sliding_attention' and 'full_attention' layers"
        )
    if isinstance(layers, int) and len(kinds) != layers:
        raise refuse("layer_types", f"has {len(kinds)} entries for {layers} layers (num_hidden_layers)")
    return tuple(kinds)


def _read_gemma_common(cfg: Mapping[str, Any], refuse: Refuse, family: str) -> dict[str, Any]:
    _refuse_true(
        cfg, refuse, ("attention_bias", "mlp_bias"), family, f"memfit builds {family} without bias terms"
    )
    if cfg.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", "is true; memfit builds causal attention only")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or GEMMA_ACT
    if act != GEMMA_ACT:
        key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
        raise refuse(key, f"is {act!r}; memfit builds {family}'s GeGLU with {GEMMA_ACT!r}")
    window = cfg.get("sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise refuse("sliding_window", f"is {window!r}; {family} needs a positive int")
    return {
        **_GEMMA_COMMON,
        "head_dim": _head_dim(cfg, refuse, default=256),
        "query_pre_attn_scalar": _positive(cfg, refuse, "query_pre_attn_scalar", 256),
        "sliding_window": window,
    }


def _read_gemma2(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    return {
        **_read_gemma_common(cfg, refuse, "Gemma 2"),
        "layer_types": _gemma_layers(cfg, refuse, 2),  # Gemma2Config's default: local, global, local, ...
        "attn_logit_softcapping": _positive(cfg, refuse, "attn_logit_softcapping", 50.0),
        "final_logit_softcapping": _positive(cfg, refuse, "final_logit_softcapping", 30.0),
    }


def _write_gemma_common(config: DecoderConfig) -> dict[str, Any]:
    return {
        "hidden_act": GEMMA_ACT,
        "hidden_activation": GEMMA_ACT,
        "head_dim": config.head_dim,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types or ()),
        "attention_bias": False,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
    }


def _write_gemma2(config: DecoderConfig) -> dict[str, Any]:
    return _write_gemma_common(config)


def _gemma3_rope(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    """Gemma 3's RoPE: 5.x ``rope_parameters`` per layer type, or 4.x ``rope_theta``, ``rope_local_base_freq``
    and ``rope_scaling`` (the global layers' linear scaling)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        prefix = "rope_parameters.full_attention"
    else:
        full = dict(cfg.get("rope_scaling") or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
        prefix = "rope_scaling"
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise refuse(
            "rope_parameters.sliding_attention.rope_type",
            f"is {local.get('rope_type', local.get('type'))!r}; memfit scales no local layer's RoPE",
        )
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise refuse(
            f"{prefix}.rope_type",
            f"is {kind!r}; memfit implements Gemma 3's 'default' and 'linear' RoPE only",
        )
    factor = (
        _positive(full, lambda k, why: refuse(f"{prefix}.{k}", why), "factor", None)
        if kind == "linear"
        else None
    )
    if kind == "linear" and factor is None:
        raise refuse(f"{prefix}.factor", "is missing; the 'linear' rope type needs it")
    return {
        "rope_theta": full.get("rope_theta", 1_000_000.0),
        "rope_local_base_freq": local.get("rope_theta", 10_000.0),
        "rope_linear_factor": factor,
        "rope_scaling": None,
    }


def _read_gemma3(cfg: Mapping[str, Any], refuse: Refuse) -> dict[str, Any]:
    return {
        **_read_gemma_common(cfg, refuse, "Gemma 3"),
        "qk_norm": True,
        # Gemma3TextConfig's default: every sixth layer global
        "layer_types": _gemma_layers(cfg, refuse, cfg.get("sliding_window_pattern", 6)),
        "final_logit_softcapping": _positive(cfg, refuse, "final_logit_softcapping", None),
        **_gemma3_rope(cfg, refuse),
    }


def _write_gemma3(config: DecoderConfig) -> dict[str, Any]:
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_linear_factor is not None:
        full = {
            "rope_type": "linear",
            "factor": float(config.rope_linear_factor),
            "rope_theta": full["rope_theta"],
        }
    local_theta = float(config.rope_local_base_freq or config.rope_theta)
    return {
        **_write_gemma_common(config),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        # 4.x spelling, the same values
        "rope_theta": full["rope_theta"],
        "rope_local_base_freq": local_theta,
        "rope_scaling": None
        if config.rope_linear_factor is None
        else {k: full[k] for k in ("rope_type", "factor")},
    }


# ----------------------------------------------------------------------------------------------------------------
# THE registry

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="llama",
            model_types=("llama",),
            architectures=("LlamaForCausalLM",),
            summary="Llama 2/3/3.1/3.2/3.3 and Llama-architecture checkpoints (SmolLM2: tied embeddings)",
            read=_read_llama,
            write=_write_llama,
            hf_defaults={},
            layer_tensors=(),
            presets=(
                "shakespeare",
                "tiny",
                "tiny-mha",
                "tiny-llama3",
                "tiny-tied",
                "llama2-7b",
                "llama2-13b",
                "llama3-8b",
                "llama3.1-8b",
                "llama3.2-1b",
                "llama3.2-3b",
                "llama3-70b",
                "smollm2-1.7b",
            ),  # fmt: skip
        ),
        Family(
            name="mistral",
            model_types=("mistral",),
            architectures=("MistralForCausalLM",),
            summary="Llama's layers with a sliding attention window (v0.1: 4096; v0.3: none) and an explicit head_dim",
            read=_read_mistral,
            write=_write_mistral,
            hf_defaults={"max_position_embeddings": 4096 * 32},
            layer_tensors=(),
            presets=("mistral-7b-v0.1", "mistral-7b-v0.3", "tiny-mistral"),
        ),
        Family(
            name="qwen2",
            model_types=("qwen2",),
            architectures=("Qwen2ForCausalLM",),
            summary="Qwen2 / Qwen2.5: biases on q, k and v; tied embeddings in the small sizes",
            read=_read_qwen2,
            write=_write_qwen2,
            hf_defaults={"max_position_embeddings": 32768},
            layer_tensors=("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
            presets=("qwen2.5-0.5b", "qwen2.5-7b", "tiny-qwen2"),
        ),
        Family(
            name="qwen3",
            model_types=("qwen3",),
            architectures=("Qwen3ForCausalLM",),
            summary="Qwen3 (dense): RMSNorm of q and k per head before RoPE, an explicit head_dim",
            read=_read_qwen3,
            write=_write_qwen3,
            hf_defaults={"max_position_embeddings": 32768},
            layer_tensors=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
            presets=("qwen3-0.6b", "qwen3-8b", "tiny-qwen3"),
        ),
        Family(
            name="gemma2",
            model_types=("gemma2",),
            architectures=("Gemma2ForCausalLM",),
            summary="Gemma 2: GeGLU, (1 + w) RMSNorms before and after attention and MLP, embeddings times "
            "sqrt(dim), local and global layers, soft-capped attention scores and logits, tied embeddings",
            read=_read_gemma2,
            write=_write_gemma2,
            hf_defaults={"max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
            layer_tensors=("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
            presets=("gemma-2-2b", "gemma-2-9b", "tiny-gemma2"),
            hidden_acts=(GEMMA_ACT,),
            implements=("attn_logit_softcapping", "final_logit_softcapping"),
        ),
        Family(
            name="gemma3",
            model_types=("gemma3_text",),
            architectures=("Gemma3ForCausalLM",),
            summary="Gemma 3 (text): Gemma 2's layers with q/k norms in place of soft-capped scores, five local "
            "layers (RoPE base 10,000) to a global one (1,000,000, linearly scaled from 4B up)",
            read=_read_gemma3,
            write=_write_gemma3,
            hf_defaults={
                "max_position_embeddings": 131072,
                "tie_word_embeddings": True,
                "rms_norm_eps": 1e-6,
            },
            layer_tensors=(
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "pre_feedforward_layernorm.weight",
                "post_feedforward_layernorm.weight",
            ),
            presets=("gemma-3-1b", "gemma-3-4b", "tiny-gemma3"),
            hidden_acts=(GEMMA_ACT,),
            implements=("final_logit_softcapping",),
            reads_rope=True,
        ),
        Family(
            name="phi3",
            model_types=("phi3",),
            architectures=("Phi3ForCausalLM",),
            summary="Phi-3 / Phi-3.5-mini: Llama's layers with q, k and v fused into qkv_proj and gate and up into "
            "gate_up_proj in the checkpoint; a sliding window (Phi-3-mini-4k: 2047)",
            read=_read_phi3,
            write=_write_phi3,
            hf_defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
            layer_tensors=(),
            lora_targets=(*LORA_TARGETS, "qkv_proj", "gate_up_proj"),
            presets=("phi-3-mini", "phi-3.5-mini", "tiny-phi3"),
            fused=(
                (
                    "self_attn.qkv_proj.weight",
                    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                ),
                ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
            ),
            lora_aliases={
                "qkv_proj": ("q_proj", "k_proj", "v_proj"),
                "gate_up_proj": ("gate_proj", "up_proj"),
            },
        ),
        Family(
            name="qwen3_moe",
            model_types=("qwen3_moe",),
            architectures=("Qwen3MoeForCausalLM",),
            summary="Qwen3-MoE: Qwen3's attention (q/k norms per head) and a mixture of experts in every layer "
            "(30B-A3B: 128 experts, 8 a token, renormalised)",
            read=_read_qwen3_moe,
            write=_write_qwen3_moe,
            hf_defaults={"max_position_embeddings": 32768},
            layer_tensors=_MOE_LAYER + ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
            lora_targets=_ATTENTION_TARGETS,
            presets=("qwen3-30b-a3b", "qwen3-235b-a22b", "tiny-qwen3-moe"),
            implements=("num_experts", "num_local_experts"),
            experts=ExpertLayout(),
        ),
        Family(
            name="mixtral",
            model_types=("mixtral",),
            architectures=("MixtralForCausalLM",),
            summary="Mixtral: Mistral's attention and 8 experts in every layer, 2 a token (block_sparse_moe "
            "w1/w3/w2 in the checkpoint)",
            read=_read_mixtral,
            write=_write_mixtral,
            hf_defaults={"max_position_embeddings": 4096 * 32},
            layer_tensors=_MOE_LAYER,
            lora_targets=_ATTENTION_TARGETS,
            presets=("mixtral-8x7b", "tiny-mixtral"),
            implements=("num_experts", "num_local_experts"),
            experts=ExpertLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
        ),
        Family(
            name="olmoe",
            model_types=("olmoe",),
            architectures=("OlmoeForCausalLM",),
            summary="OLMoE: RMSNorm of the whole q and k projections, 64 experts in every layer, 8 a token "
            "(weights as the softmax gives them)",
            read=_read_olmoe,
            write=_write_olmoe,
            hf_defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
            layer_tensors=_MOE_LAYER + ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
            lora_targets=_ATTENTION_TARGETS,
            presets=("olmoe-1b-7b", "tiny-olmoe"),
            implements=("num_experts", "num_local_experts"),
            experts=ExpertLayout(),
        ),
    )
}
"""Every family memfit builds, by :attr:`Family.name`."""

_NOT_BUILT = {
    **dict.fromkeys(
        ("qwen2_moe", "deepseek_v2", "deepseek_v3", "dbrx", "granitemoe"),
        "a mixture of experts memfit does not build (shared experts, DeepSeek's latent attention, DBRX's and "
        "Granite's layouts); it builds qwen3_moe, mixtral and olmoe",
    ),
    **dict.fromkeys(
        ("mamba", "mamba2", "falcon_mamba"), "a state-space model (no attention), which memfit does not build"
    ),
    "jamba": "a hybrid of Mamba layers and a mixture of experts, which memfit does not build",
    **dict.fromkeys(
        ("gemma",),
        "a family memfit does not build yet (Gemma 1: GeGLU and (1 + w) norms without Gemma 2's layers)",
    ),
    "gemma3": "Gemma 3's multimodal checkpoint (a vision tower beside the text model); memfit builds the text "
    "model, model_type 'gemma3_text' (Gemma3ForCausalLM)",
}
"""Why a known ``model_type`` is refused."""


def builds() -> str:
    """The families memfit builds, for messages: ``llama (LlamaForCausalLM), mistral (...), ...``."""
    return ", ".join(f"{f.model_types[0]} ({f.architectures[0]})" for f in FAMILIES.values())


def family(name: str) -> Family:
    """The entry of :attr:`DecoderConfig.family` ``name``.

    Raises:
        ValueError: ``name`` is not a family memfit builds; the message lists them.
    """
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; memfit builds: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def hf_family(model_type: Any, architectures: Any, refuse: Refuse) -> Family:
    """The family of a Hugging Face ``config.json``, from its ``model_type`` (or, without one, its
    ``architectures``).

    Args:
        model_type: ``config.json``'s ``model_type`` (None when absent).
        architectures: its ``architectures`` (None when absent).
        refuse: makes the error naming the file and the key.

    Returns:
        The entry.

    Raises:
        The error ``refuse`` makes: naming ``model_type`` and ``architectures`` when the architecture is one memfit
        does not build (a mixture of experts, Mamba, an unknown type), or ``architectures`` when it names a class
        of another family or a head other than the causal LM's (``...ForSequenceClassification``); the message
        lists the families memfit builds.
    """
    archs = list(architectures) if isinstance(architectures, (list, tuple)) else []
    by_type = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    if model_type is None and archs:
        by_type = next((f for f in FAMILIES.values() if archs[0] in f.architectures), None)
    if by_type is None:
        why = _NOT_BUILT.get(model_type, "an architecture memfit does not build")
        raise refuse(
            "model_type",
            f"is {model_type!r} (architectures {archs}): {why}. memfit builds {builds()}",
        )
    if archs and not set(archs) & set(by_type.architectures):
        raise refuse(
            "architectures",
            f"is {archs} for model_type {model_type!r}; memfit builds {by_type.architectures[0]} for it "
            f"(memfit builds {builds()})",
        )
    return by_type
