"""Llama architecture and presets: published parameter counts, logits parity with transformers, init, dtypes,
fake-tensor execution at 8B scale, config validation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.errors import UnknownPresetError
from memfit.models import layers as layers_module
from memfit.models.config import DecoderConfig, RopeScaling
from memfit.models.decoder import Decoder, build_decoder, causal_attention
from memfit.models.layers import RMSNorm, apply_rope, rope_inv_freq
from memfit.models.presets import MODEL_PRESETS, model_config

# Parameter counts of the Meta checkpoints as published (Hugging Face model cards / safetensors metadata).
PUBLISHED_PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3-70b": 70_553_706_496,
}


def _preset(name: str) -> DecoderConfig:
    return (
        model_config(name, vocab_size=512) if "vocab_size" not in MODEL_PRESETS[name] else model_config(name)
    )


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_builds_on_meta(name):
    config = _preset(name)
    model = build_decoder(config, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == config.num_params()


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_published_parameter_counts(name):
    config = model_config(name)
    model = build_decoder(config, device="meta")
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]
    assert config.num_params() == PUBLISHED_PARAMS[name]


def test_preset_details():
    assert model_config("llama3.1-8b").rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert model_config("llama3.1-8b").max_seq_len == 131072
    assert model_config("llama3.2-1b").rope_scaling.factor == 32.0
    assert model_config("llama3.2-1b").tie_word_embeddings
    assert model_config("llama3-8b").rope_scaling is None
    assert model_config("llama3-8b").rope_theta == 500000.0
    assert model_config("tiny-llama3").rope_scaling.original_max_position_embeddings == 32
    assert model_config("tiny").vocab_size == 256
    assert model_config("tiny", vocab_size=300).vocab_size == 300
    shakespeare = model_config("shakespeare", vocab_size=65)
    assert (shakespeare.dim, shakespeare.num_layers, shakespeare.num_heads, shakespeare.num_kv_heads) == (
        256,
        6,
        8,
        2,
    )
    assert (shakespeare.intermediate_size, shakespeare.max_seq_len, shakespeare.tie_word_embeddings) == (
        688,
        256,
        False,
    )
    assert model_config("shakespeare", vocab_size=2048).num_params() == 5_205_248


def test_model_config_errors():
    with pytest.raises(ValueError, match="known presets: .*llama3-8b") as info:
        model_config("llama4-8b")
    assert isinstance(info.value, KeyError) and isinstance(info.value, UnknownPresetError)
    with pytest.raises(ValueError, match="'hidden_size' is not a DecoderConfig field"):
        model_config("tiny", hidden_size=128)
    with pytest.raises(ValueError, match="vocab_size"):
        model_config("shakespeare")
    with pytest.raises(
        ValueError, match=r"DecoderConfig\.num_heads \(4\) must be divisible by num_kv_heads \(3\)"
    ):
        model_config("tiny", num_kv_heads=3)
    assert model_config("tiny-llama3", rope_scaling={"factor": 2.0}).rope_scaling == RopeScaling(factor=2.0)


# ---------------------------------------------------------------- config validation

_TINY = dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"dim": 66}, r"DecoderConfig\.dim \(66\) must be divisible by num_heads"),
        ({"num_kv_heads": 3}, r"DecoderConfig\.num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
        ({"num_layers": 0}, r"DecoderConfig\.num_layers must be a positive int"),
        ({"vocab_size": -1}, r"DecoderConfig\.vocab_size must be a positive int"),
        ({"intermediate_size": 12.5}, r"DecoderConfig\.intermediate_size must be a positive int"),
        ({"num_heads": 0}, r"DecoderConfig\.num_heads must be a positive int"),
        ({"max_seq_len": 0}, r"DecoderConfig\.max_seq_len must be a positive int"),
        ({"norm_eps": 0.0}, r"DecoderConfig\.norm_eps must be a positive number"),
        ({"rope_theta": -1.0}, r"DecoderConfig\.rope_theta must be a positive number"),
        ({"dim": 12, "num_heads": 4, "num_kv_heads": 4}, r"dim // num_heads \(3\) must be even"),
        (
            {"rope_scaling": {"factor": 8.0, "beta": 1.0}},
            r"DecoderConfig\.rope_scaling has unknown keys \['beta'\]",
        ),
        ({"rope_scaling": 8.0}, r"DecoderConfig\.rope_scaling must be None, a RopeScaling or a dict"),
        (
            {"rope_scaling": {"low_freq_factor": 4.0}},
            r"RopeScaling\.high_freq_factor \(4.0\) must be greater",
        ),
        ({"rope_scaling": {"factor": 0}}, r"RopeScaling\.factor must be positive"),
    ],
)
def test_config_validation(override, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**_TINY, **override})


def test_config_head_dim_and_dict_rope_scaling():
    config = DecoderConfig(**_TINY, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 16})
    assert config.head_dim == 16
    assert config.rope_scaling == RopeScaling(factor=4.0, original_max_position_embeddings=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dim = 128


# ---------------------------------------------------------------- parity with transformers


def _hf_model(config: DecoderConfig, attn_implementation: str = "eager"):
    transformers = pytest.importorskip("transformers")
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:  # transformers 5 spells the llama3 scaling as rope_parameters
        rope = {
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            **dataclasses.asdict(config.rope_scaling),
        }
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.norm_eps,
        max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # q, k large enough that attention is far from uniform; norms away from one
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.1)
    return model


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["tiny-mha", "tiny", "tiny-llama3", "tiny-tied"])
def test_logits_match_transformers(name, attn_implementation):
    config = model_config(name)
    hf = _hf_model(config, attn_implementation)
    model = build_decoder(config, init=False).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    assert torch.equal(model.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight

    # 80 positions: longer than tiny-llama3's original context (32), so the scaled frequencies matter.
    input_ids = torch.randint(0, config.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids).logits
        logits = model(input_ids)
    assert logits.shape == (2, 80, config.vocab_size) and logits.dtype == torch.float32
    max_diff = (logits - expected).abs().max().item()
    assert max_diff <= 1e-5, max_diff
    assert expected.abs().max().item() > 1.0  # the comparison is not between near-zero logits


def test_rope_scaling_changes_logits_beyond_original_context():
    """The scaling case of the parity test can fail: without scaling the logits differ."""
    config = model_config("tiny-llama3")
    scaled = build_decoder(config, seed=0).eval()
    plain = build_decoder(dataclasses.replace(config, rope_scaling=None), init=False).eval()
    plain.load_state_dict(scaled.state_dict())
    assert not torch.equal(scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    input_ids = torch.randint(0, config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (scaled(input_ids) - plain(input_ids)).abs().max().item() > 1e-4


def test_state_dict_keys_match_transformers():
    for name in ("tiny", "tiny-tied"):
        config = model_config(name)
        assert list(build_decoder(config).state_dict()) == list(_hf_model(config).state_dict())


def test_state_dict_layout():
    model = build_decoder(model_config("tiny"))
    keys = list(model.state_dict())
    assert len(keys) == 2 * 9 + 3
    assert keys[:2] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert keys[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert not any("inv_freq" in key or key.endswith("bias") for key in keys)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)  # (nkv * hd, C)


# ---------------------------------------------------------------- backbone, init, dtypes


def test_forward_is_lm_head_of_backbone():
    config = model_config("tiny")
    model = build_decoder(config, seed=0)
    input_ids = torch.randint(0, config.vocab_size, (2, 7))
    hidden = model.model(input_ids)
    assert hidden.shape == (2, 7, 64)
    torch.testing.assert_close(model(input_ids), model.lm_head(hidden), rtol=0, atol=0)


def test_causal():
    config = model_config("tiny")
    model = build_decoder(config, seed=0)
    input_ids = torch.randint(0, config.vocab_size, (1, 12))
    changed = input_ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % config.vocab_size
    a, b = model(input_ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=0)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


def test_causal_attention_native_gqa_equals_expanded_heads():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 10, 16, generator=generator)  # (B, nh, T, hd)
    k, v = torch.randn(2, 2, 10, 16, generator=generator), torch.randn(2, 2, 10, 16, generator=generator)
    native = causal_attention(q, k, v, native_gqa=True)
    expanded = causal_attention(q, k, v, native_gqa=False)
    # reference: query head h reads kv head h // 4
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), is_causal=True
    )
    assert native.shape == (2, 8, 10, 16)
    torch.testing.assert_close(native, reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(expanded, reference, rtol=0, atol=1e-6)
    assert causal_attention(q.to("meta"), k.to("meta"), v.to("meta")).shape == (2, 8, 10, 16)  # expanded path


def _reference_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm, written out: fp32 normalisation, cast back, then the scale."""
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize(
    "x_dtype, weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("chunk_elements", [None, 3 * 48])  # one chunk; chunks of 3 rows (the last one short)
def test_rms_norm_equals_the_plain_expression(x_dtype, weight_dtype, chunk_elements, monkeypatch):
    if chunk_elements:
        monkeypatch.setattr(layers_module, "NORM_CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 7, 48, generator=generator)).to(x_dtype)  # (B, T, C)
    weight = (1 + 0.3 * torch.randn(48, generator=generator)).to(weight_dtype)
    grad = torch.randn(2, 7, 48, generator=generator).to(torch.promote_types(x_dtype, weight_dtype))
    norm = RMSNorm(48, 1e-5).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    ours_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref_weight = weight.clone().requires_grad_()
    out, expected = norm(ours_x), _reference_rms_norm(ref_x, ref_weight, 1e-5)
    assert out.dtype == expected.dtype and torch.equal(out, expected)  # bit for bit
    out.backward(grad)
    expected.backward(grad)
    # fp32: the same products in the same order; low precision: autograd rounds its intermediates, ours does not
    exact = x_dtype == weight_dtype == torch.float32
    atol = 1e-6 if exact else 2e-2
    torch.testing.assert_close(ours_x.grad, ref_x.grad, rtol=0, atol=atol)
    torch.testing.assert_close(norm.weight.grad, ref_weight.grad, rtol=0 if exact else 1e-2, atol=atol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", ["(T, hd)", "(B, 1, T, hd)"])
def test_rope_equals_rotate_half_expression_bit_for_bit(dtype, table):
    generator = torch.Generator().manual_seed(0)
    B, nh, T, hd = 2, 3, 5, 8
    # (B, nh, T, hd), as projected
    x = torch.randn(B, T, nh, hd, generator=generator).transpose(1, 2).to(dtype)
    shape = (T, hd) if table == "(T, hd)" else (B, 1, T, hd)
    angles = torch.randn(shape[:-1] + (hd // 2,), generator=generator)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    grad = torch.randn(B, nh, T, hd, generator=generator).to(dtype)

    def rotate_half(t):
        return torch.cat((-t[..., hd // 2 :], t[..., : hd // 2]), dim=-1)

    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = apply_rope(ours, cos, sin), ref * cos + rotate_half(ref) * sin
    assert torch.equal(out, expected)
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(ours.grad, ref.grad)


def test_init_weights_deterministic_and_scaled():
    config = model_config("tiny")
    a, b = build_decoder(config, seed=3), build_decoder(config, seed=3)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    c = build_decoder(config, seed=4)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)

    torch.manual_seed(5)
    d = build_decoder(config)
    torch.manual_seed(5)
    e = build_decoder(config)
    assert torch.equal(d.lm_head.weight, e.lm_head.weight)
    d.init_weights(torch.Generator().manual_seed(3))  # re-initialising equals building with that seed
    assert all(
        torch.equal(x, y) for x, y in zip(d.state_dict().values(), a.state_dict().values(), strict=True)
    )

    for name, param in a.named_parameters():
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        expected = (
            0.02 / math.sqrt(2 * config.num_layers)
            if name.endswith(("o_proj.weight", "down_proj.weight"))
            else 0.02
        )
        assert abs(param.std().item() / expected - 1) < 0.05, name
        assert abs(param.mean().item()) < expected / 10, name


def test_rope_buffer_is_float32_and_not_persistent():
    config = model_config("tiny-llama3")
    model = build_decoder(config, dtype=torch.bfloat16, init=False)  # computed even without init
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (config.head_dim // 2,)
    assert torch.equal(inv_freq, rope_inv_freq(config))
    assert "model.rotary_emb.inv_freq" in dict(model.named_buffers())
    assert not any("inv_freq" in key for key in model.state_dict())


def test_bf16_build():
    config = model_config("tiny")
    model = build_decoder(config, dtype=torch.bfloat16, seed=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    logits = model(input_ids)
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 16, config.vocab_size)
    logits.float().sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.dtype == torch.bfloat16

    reference = build_decoder(config, init=False)  # the same weights in float32
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    torch.testing.assert_close(logits.float(), reference(input_ids), rtol=0, atol=0.02)


def test_dtype_cast_and_to_empty_keep_rope_fp32_and_tie():
    model = build_decoder(model_config("tiny-tied"), seed=0)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()


def test_meta_forward():
    config = model_config("tiny")
    model = build_decoder(config, device="meta")
    logits = model(torch.zeros(2, 5, dtype=torch.long, device="meta"))
    assert logits.shape == (2, 5, config.vocab_size) and logits.device.type == "meta"


def test_llama3_8b_forward_backward_under_fake_tensors():
    config = model_config("llama3-8b")
    with FakeTensorMode():
        model = build_decoder(config, device="cpu", dtype=torch.bfloat16, seed=0)
        input_ids = torch.randint(0, config.vocab_size, (1, 16))
        logits = model(input_ids)
        logits.float().sum().backward()
    assert isinstance(model, Decoder)
    assert logits.shape == (1, 16, 128256) and logits.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


# ---------------------------------------------------------------- packed samples


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_packed_row_computes_each_sample_alone(name):
    """A row packing samples of lengths 5, 3 and 4 (with doc ids) gives, for every token, the logits of the sample
    run on its own: attention stays inside each sample and positions restart at 0."""
    config = model_config(name)
    model = build_decoder(config, seed=0)
    lengths = [5, 3, 4]
    samples = [
        torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        for n in lengths
    ]
    packed = torch.cat(samples, dim=1)  # (1, 12)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)  # (1, 12)
    logits = model(packed, doc_ids)
    alone = torch.cat([model(s) for s in samples], dim=1)
    torch.testing.assert_close(logits, alone, rtol=0, atol=2e-5)
    # a single "sample" spanning the row is plain causal attention
    torch.testing.assert_close(model(packed, torch.zeros_like(packed)), model(packed), rtol=0, atol=2e-5)
