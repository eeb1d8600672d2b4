"""Named model sizes: ``model_config("llama3-8b")`` returns a ``LlamaConfig``.

Published sizes copy the config.json of the Meta checkpoints on the Hugging Face Hub (field names translated:
``hidden_size`` -> ``dim``, ``num_hidden_layers`` -> ``num_layers``, ``num_attention_heads`` -> ``num_heads``,
``num_key_value_heads`` -> ``num_kv_heads``, ``rms_norm_eps`` -> ``norm_eps``, ``max_position_embeddings`` ->
``max_seq_len``). Each is a small delta from a base. A preset without ``vocab_size`` takes it from the caller
(the tokenizer).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from memfit.errors import UnknownPresetError
from memfit.models.llama import LlamaConfig, RopeScaling

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
# tiny sizes for tests: 2 layers, width 64; vocab_size may be overridden
_TINY: dict[str, Any] = dict(
    vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_seq_len=128,
)  # fmt: skip

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


def model_config(name: str, **overrides: Any) -> LlamaConfig:
    """The ``LlamaConfig`` of a named preset, with fields overridden.

    Args:
        name: a key of ``MODEL_PRESETS``.
        **overrides: ``LlamaConfig`` fields that replace the preset's (``vocab_size`` from a tokenizer, for
            example). ``rope_scaling`` may be a dict of ``RopeScaling`` fields.

    Returns:
        The validated config.

    Raises:
        UnknownPresetError: (a ValueError and a KeyError) when ``name`` is unknown; the message lists the known
            names.
        ValueError: naming the field, when an override is not a ``LlamaConfig`` field, when ``vocab_size`` is
            neither in the preset nor given, or when ``LlamaConfig`` validation rejects the result.
    """
    if name not in MODEL_PRESETS:
        raise UnknownPresetError(f"unknown model preset {name!r}; known presets: {', '.join(MODEL_PRESETS)}")
    known = [f.name for f in fields(LlamaConfig)]
    for key in overrides:
        if key not in known:
            raise ValueError(f"{key!r} is not a LlamaConfig field (model preset {name!r}); fields: {known}")
    kwargs = {**MODEL_PRESETS[name], **overrides}
    if kwargs.get("vocab_size") is None:
        raise ValueError(
            f"model preset {name!r} has no vocab_size: pass vocab_size (usually the tokenizer's)"
        )
    return LlamaConfig(**kwargs)
