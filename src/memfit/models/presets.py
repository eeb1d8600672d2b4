"""Named model sizes: ``model_config("llama3-8b")`` returns a ``DecoderConfig``.

Published sizes copy the config.json of the official checkpoints on the Hugging Face Hub (Meta's Llama, Mistral
AI's, Qwen's, Hugging Face's SmolLM2) (field names translated:
``hidden_size`` -> ``dim``, ``num_hidden_layers`` -> ``num_layers``, ``num_attention_heads`` -> ``num_heads``,
``num_key_value_heads`` -> ``num_kv_heads``, ``rms_norm_eps`` -> ``norm_eps``, ``max_position_embeddings`` ->
``max_seq_len``; the family's differences as ``family``, ``attention_bias``, ``qk_norm``, ``head_dim``,
``sliding_window``: :mod:`memfit.models.families`, whose entries list their presets). Each is a small delta from a
base. A preset without ``vocab_size`` takes it from the caller
(the tokenizer).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from memfit.errors import UnknownPresetError
from memfit.models.config import DecoderConfig, RopeScaling
from memfit.models.families import family

# meta-llama/Llama-2-7b-hf config.json
_LLAMA2_7B: dict[str, Any] = dict(
    vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=11008,
    norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
)  # fmt: skip
# meta-llama/Meta-Llama-3-8B config.json
_LLAMA3_8B: dict[str, Any] = dict(
    vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
    norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
)  # fmt: skip
# meta-llama/Llama-3.1-8B config.json: Llama 3 plus "llama3" rope scaling to a 128k context
_LLAMA3_1_8B: dict[str, Any] = {**_LLAMA3_8B, "rope_scaling": RopeScaling(factor=8.0), "max_seq_len": 131072}
# mistralai/Mistral-7B-v0.1 config.json: Llama's layers with a 4096-token sliding window
_MISTRAL_7B_V01: dict[str, Any] = dict(
    family="mistral", vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
    intermediate_size=14336, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=32768, sliding_window=4096,
)  # fmt: skip
# Qwen/Qwen2.5-7B config.json: biases on q, k and v
_QWEN2_5_7B: dict[str, Any] = dict(
    family="qwen2", attention_bias=True, vocab_size=152064, dim=3584, num_layers=28, num_heads=28,
    num_kv_heads=4, intermediate_size=18944, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=131072,
)  # fmt: skip
# Qwen/Qwen3-8B config.json: q/k RMSNorm per head, head_dim 128
_QWEN3_8B: dict[str, Any] = dict(
    family="qwen3", qk_norm=True, head_dim=128, vocab_size=151936, dim=4096, num_layers=36, num_heads=32,
    num_kv_heads=8, intermediate_size=12288, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
)  # fmt: skip
# microsoft/Phi-3-mini-4k-instruct config.json (model_type phi3; q/k/v and gate/up fused in the checkpoint, split
# here): a 2047-token sliding window, rms_norm_eps 1e-5, rope_scaling null
_PHI3_MINI: dict[str, Any] = dict(
    family="phi3", vocab_size=32064, dim=3072, num_layers=32, num_heads=32, num_kv_heads=32,
    intermediate_size=8192, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096, sliding_window=2047,
)  # fmt: skip
# google/gemma-2-2b config.json (as transformers' Gemma2Config defaults and a copy quoted in NVIDIA Megatron
# Bridge's Gemma 2 conversion test): GeGLU, (1 + w) norms before and after attention and MLP, embeddings times
# sqrt(2304), local (4096-key window) and global layers alternating, soft-capped scores (50) and logits (30)
_GEMMA2_2B: dict[str, Any] = dict(
    family="gemma2", vocab_size=256000, dim=2304, num_layers=26, num_heads=8, num_kv_heads=4,
    intermediate_size=9216, head_dim=256, norm_eps=1e-6, rope_theta=10000.0, max_seq_len=8192,
    tie_word_embeddings=True, sliding_window=4096, layer_types=("sliding_attention", "full_attention") * 13,
    query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    mlp_activation="gelu_tanh", norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
)  # fmt: skip
# google/gemma-3-1b-pt config.json (model_type gemma3_text; as quoted from gemma-3-1b-it's, the same
# architecture): Gemma 2's layers with q/k norms, no soft-capping, five local layers (a 512-key window, RoPE base
# 10,000) to one global (1,000,000)
_GEMMA3_1B: dict[str, Any] = dict(
    _GEMMA2_2B, family="gemma3", qk_norm=True, vocab_size=262144, dim=1152, num_layers=26, num_heads=4,
    num_kv_heads=1, intermediate_size=6912, max_seq_len=32768, sliding_window=512, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, attn_logit_softcapping=None, final_logit_softcapping=None,
    layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)),
)  # fmt: skip
# tiny sizes for tests: 2 layers, width 64; vocab_size may be overridden
_TINY: dict[str, Any] = dict(
    vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=128,
)  # fmt: skip

# Qwen/Qwen3-30B-A3B config.json: Qwen3's attention, 128 experts of 768 in each of 48 layers, 8 a token
_QWEN3_30B_A3B: dict[str, Any] = dict(
    family="qwen3_moe", qk_norm=True, head_dim=128, vocab_size=151936, dim=2048, num_layers=48, num_heads=32,
    num_kv_heads=4, intermediate_size=6144, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    router_aux_loss_coef=0.001,
)  # fmt: skip
# mistralai/Mixtral-8x7B-v0.1 config.json: Mistral's attention without a window, 8 experts, 2 a token
_MIXTRAL_8X7B: dict[str, Any] = dict(
    family="mixtral", vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
    intermediate_size=14336, norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.02,
)  # fmt: skip
# allenai/OLMoE-1B-7B-0924 config.json: q/k norms over the whole projections, 64 experts of 1024, 8 a token
_OLMOE_1B_7B: dict[str, Any] = dict(
    family="olmoe", qk_norm=True, qk_norm_per_head=False, vocab_size=50304, dim=2048, num_layers=16,
    num_heads=16, num_kv_heads=16, intermediate_size=1024, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096,
    num_experts=64, num_experts_per_tok=8, router_aux_loss_coef=0.01,
)  # fmt: skip
_TINY_EXPERTS: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # memfit's own: sized so the default run trains ~1M tokens in ~8 minutes on 2 CPU cores (6 layers, width 256,
    # 8 query heads sharing 2 kv heads, SwiGLU 688 = 8/3 * 256 rounded up to 16, context 256); 4,156,672 parameters
    # besides the embeddings
    "shakespeare": dict(
        dim=256,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=688,
        max_seq_len=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # tests: grouped-query attention (2 query heads per kv head)
    "tiny": _TINY,
    # tests: plain multi-head attention
    "tiny-mha": {**_TINY, "num_kv_heads": 4},
    # tests: Llama 3.1 rope scaling with a 32-token original context, so short sequences exercise it
    "tiny-llama3": {
        **_TINY,
        "rope_theta": 500000.0,
        "rope_scaling": RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
        ),
    },
    # tests: tied input and output embeddings
    "tiny-tied": {**_TINY, "tie_word_embeddings": True},
    # meta-llama/Llama-2-7b-hf config.json: 6,738,415,616 parameters
    "llama2-7b": _LLAMA2_7B,
    # meta-llama/Llama-2-13b-hf config.json: 13,015,864,320 parameters
    "llama2-13b": {
        **_LLAMA2_7B,
        "dim": 5120,
        "num_layers": 40,
        "num_heads": 40,
        "num_kv_heads": 40,
        "intermediate_size": 13824,
    },
    # meta-llama/Meta-Llama-3-8B config.json: 8,030,261,248 parameters
    "llama3-8b": _LLAMA3_8B,
    # meta-llama/Llama-3.1-8B config.json: 8,030,261,248 parameters
    "llama3.1-8b": _LLAMA3_1_8B,
    # meta-llama/Llama-3.2-1B config.json: 1,235,814,400 parameters (tied)
    "llama3.2-1b": {
        **_LLAMA3_1_8B,
        "dim": 2048,
        "num_layers": 16,
        "num_heads": 32,
        "num_kv_heads": 8,
        "intermediate_size": 8192,
        "rope_scaling": RopeScaling(factor=32.0),
        "tie_word_embeddings": True,
    },
    # meta-llama/Llama-3.2-3B config.json: 3,212,749,824 parameters (tied)
    "llama3.2-3b": {
        **_LLAMA3_1_8B,
        "dim": 3072,
        "num_layers": 28,
        "num_heads": 24,
        "num_kv_heads": 8,
        "intermediate_size": 8192,
        "rope_scaling": RopeScaling(factor=32.0),
        "tie_word_embeddings": True,
    },
    # HuggingFaceTB/SmolLM2-1.7B config.json (model_type llama, tied): 1,711,376,384 parameters
    "smollm2-1.7b": {
        **_LLAMA2_7B,
        "vocab_size": 49152,
        "dim": 2048,
        "num_layers": 24,
        "num_heads": 32,
        "num_kv_heads": 32,
        "intermediate_size": 8192,
        "rope_theta": 130000.0,
        "max_seq_len": 8192,
        "tie_word_embeddings": True,
    },
    # mistralai/Mistral-7B-v0.1 config.json: 7,241,732,096 parameters
    "mistral-7b-v0.1": _MISTRAL_7B_V01,
    # mistralai/Mistral-7B-v0.3 config.json: 7,248,023,552 parameters (vocabulary 32768, no sliding window)
    "mistral-7b-v0.3": {
        **_MISTRAL_7B_V01,
        "vocab_size": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    # Qwen/Qwen2.5-0.5B config.json: 494,032,768 parameters (tied)
    "qwen2.5-0.5b": {
        **_QWEN2_5_7B,
        "vocab_size": 151936,
        "dim": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
        "max_seq_len": 32768,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen2.5-7B config.json: 7,615,616,512 parameters
    "qwen2.5-7b": _QWEN2_5_7B,
    # Qwen/Qwen3-0.6B config.json: 596,049,920 parameters (tied; head_dim 128 where dim // num_heads is 64)
    "qwen3-0.6b": {
        **_QWEN3_8B,
        "dim": 1024,
        "num_layers": 28,
        "num_heads": 16,
        "num_kv_heads": 8,
        "intermediate_size": 3072,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-8B config.json: 8,190,735,360 parameters
    "qwen3-8b": _QWEN3_8B,
    # tests: each family's differences at the tiny size (a window shorter than the tests' 32 tokens; Qwen3's
    # head_dim 32 where dim // num_heads is 16)
    "tiny-mistral": {**_TINY, "family": "mistral", "sliding_window": 12},
    "tiny-qwen2": {**_TINY, "family": "qwen2", "attention_bias": True, "tie_word_embeddings": True},
    "tiny-qwen3": {**_TINY, "family": "qwen3", "qk_norm": True, "head_dim": 32},
    # Qwen/Qwen3-30B-A3B config.json: 30,532,122,624 parameters (published: 30.5B, 3.3B active)
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # Qwen/Qwen3-235B-A22B config.json: 235,093,634,560 parameters (published: 235B, 22B active)
    "qwen3-235b-a22b": {
        **_QWEN3_30B_A3B,
        "dim": 4096,
        "num_layers": 94,
        "num_heads": 64,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
    },
    "tiny-qwen3-moe": {
        **_TINY,
        **_TINY_EXPERTS,
        "family": "qwen3_moe",
        "qk_norm": True,
        "head_dim": 32,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
    },
    # mistralai/Mixtral-8x7B-v0.1 config.json: 46,702,792,704 parameters (published: 46.7B, 12.9B active)
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "tiny-mixtral": {
        **_TINY,
        **_TINY_EXPERTS,
        "family": "mixtral",
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.02,
    },
    # allenai/OLMoE-1B-7B-0924 config.json: 6,919,161,856 parameters (published: 6.9B, 1.3B active)
    "olmoe-1b-7b": _OLMOE_1B_7B,
    "tiny-olmoe": {
        **_TINY,
        **_TINY_EXPERTS,
        "family": "olmoe",
        "qk_norm": True,
        "qk_norm_per_head": False,
        "router_aux_loss_coef": 0.01,
    },
    # microsoft/Phi-3-mini-4k-instruct config.json: 3,821,079,552 parameters (published: 3.8B)
    "phi-3-mini": _PHI3_MINI,
    # microsoft/Phi-3.5-mini-instruct config.json: Phi-3-mini's shapes (3,821,079,552 parameters), whose
    # checkpoint memfit refuses for its LongRoPE scaling (rope_scaling "longrope", to 131,072 tokens, with a
    # 262,144-token window that never binds); the preset is its original 4,096-token context with plain RoPE
    # (original_max_position_embeddings), for estimates, plans and pretraining
    "phi-3.5-mini": {**_PHI3_MINI, "sliding_window": None},
    # tests: Phi-3 at the tiny size, a window shorter than the tests' 32 tokens
    "tiny-phi3": {**_TINY, "family": "phi3", "sliding_window": 12},
    # google/gemma-2-2b config.json: 2,614,341,888 parameters (tied; published "2.6B")
    "gemma-2-2b": _GEMMA2_2B,
    # google/gemma-2-9b config.json: 9,241,705,984 parameters (tied; published "9.24B")
    "gemma-2-9b": {
        **_GEMMA2_2B,
        "dim": 3584,
        "num_layers": 42,
        "num_heads": 16,
        "num_kv_heads": 8,
        "intermediate_size": 14336,
        "layer_types": ("sliding_attention", "full_attention") * 21,
    },
    # google/gemma-3-1b-pt config.json: 999,885,952 parameters (tied; published "1B")
    "gemma-3-1b": _GEMMA3_1B,
    # google/gemma-3-4b-pt config.json's text_config (the text model of the multimodal checkpoint, as quoted in
    # transformers' Gemma 3 docs and tests; the rest Gemma3TextConfig's defaults): 3,880,263,168 parameters
    # (tied; published "4B" with the 417M-parameter SigLIP vision tower beside it); linear RoPE scaling (8) of the
    # global layers, a 1024-key window
    "gemma-3-4b": {
        **_GEMMA3_1B,
        "vocab_size": 262208,
        "dim": 2560,
        "num_layers": 34,
        "num_heads": 8,
        "num_kv_heads": 4,
        "intermediate_size": 10240,
        "max_seq_len": 131072,
        "sliding_window": 1024,
        "rope_linear_factor": 8.0,
        "layer_types": tuple(
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)
        ),
    },
    # tests: Gemma 2 and 3 at the tiny size (head_dim 32 where dim // num_heads is 16; a local layer with a
    # 12-key window then a global one; soft-caps small enough to bite)
    "tiny-gemma2": {
        **_TINY,
        **{
            k: _GEMMA2_2B[k]
            for k in ("family", "mlp_activation", "norm_plus_one", "sandwich_norms", "scale_embeddings")
        },
        "head_dim": 32,
        "norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "sliding_window": 12,
        "layer_types": ("sliding_attention", "full_attention"),
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0,
    },
    "tiny-gemma3": {
        **_TINY,
        **{
            k: _GEMMA3_1B[k]
            for k in (
                "family",
                "mlp_activation",
                "norm_plus_one",
                "sandwich_norms",
                "scale_embeddings",
                "qk_norm",
                "rope_theta",
                "rope_local_base_freq",
            )
        },
        "head_dim": 32,
        "norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "sliding_window": 12,
        "layer_types": ("sliding_attention", "full_attention"),
        "query_pre_attn_scalar": 24,
        "rope_linear_factor": 8.0,
    },  # fmt: skip
    # meta-llama/Meta-Llama-3-70B config.json: 70,553,706,496 parameters
    "llama3-70b": {
        **_LLAMA3_8B,
        "dim": 8192,
        "num_layers": 80,
        "num_heads": 64,
        "num_kv_heads": 8,
        "intermediate_size": 28672,
    },
}


def model_config(name: str, **overrides: Any) -> DecoderConfig:
    """The ``DecoderConfig`` of a named preset, with fields overridden.

    Args:
        name: a key of ``MODEL_PRESETS``.
        **overrides: ``DecoderConfig`` fields that replace the preset's (``vocab_size`` from a tokenizer, for
            example). ``rope_scaling`` may be a dict of ``RopeScaling`` fields.

    Returns:
        The validated config.

    Raises:
        UnknownPresetError: (a ValueError and a KeyError) when ``name`` is unknown; the message lists the known
            names.
        ValueError: naming the field, when an override is not a ``DecoderConfig`` field, when ``vocab_size`` is
            neither in the preset nor given, or when ``DecoderConfig`` validation rejects the result.
    """
    if name not in MODEL_PRESETS:
        raise UnknownPresetError(f"unknown model preset {name!r}; known presets: {', '.join(MODEL_PRESETS)}")
    known = [f.name for f in fields(DecoderConfig)]
    for key in overrides:
        if key not in known:
            raise ValueError(f"{key!r} is not a DecoderConfig field (model preset {name!r}); fields: {known}")
    kwargs = {**MODEL_PRESETS[name], **overrides}
    family(kwargs.get("family", "llama"))  # a ValueError naming the families memfit builds
    if kwargs.get("vocab_size") is None:
        raise ValueError(
            f"model preset {name!r} has no vocab_size: pass vocab_size (usually the tokenizer's)"
        )
    return DecoderConfig(**kwargs)
