"""Gemma 2 and Gemma 3 (text) against transformers' own classes (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``).

Per family a random tiny config is made here with transformers (a local layer with a window of 8 keys, shorter
than the sequences, then a global one; head_dim 32 where hidden / heads is 16; ``query_pre_attn_scalar`` 24 where
head_dim is 32; Gemma 2's soft-caps small enough to bite; Gemma 3's local RoPE base and its global layers' linear
scaling), its weights moved off their initial values and written with ``save_pretrained``. memfit loads it and
must give the same logits (1e-5 in fp32), packed too; the architecture options are shown to matter; ``memfit
export`` loads back into transformers; LoRA, QLoRA and full fine-tunes start from the directory through the CLI;
each preset's parameter count equals transformers' count of the official config.json; the chunked loss and the
tiled GeGLU equal the plain step; and what memfit does not build is refused naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.cli import main
from memfit.convert import export_checkpoint, load_pretrained, read_config
from memfit.convert.hf import hf_config_to_decoder
from memfit.errors import CheckpointError
from memfit.memory.tiled import apply_tiled_mlp
from memfit.models.attention import softcapped_attention
from memfit.models.config import DecoderConfig
from memfit.models.decoder import build_decoder
from memfit.models.families import FAMILIES
from memfit.models.presets import model_config
from memfit.step import micro_batch_loss
from tests.conftest import finetune_overrides
from tests.models.test_families import (
    COMMON,
    _ids,
    _losses,
    finetune_and_export,
    packed_rows_diff,
    perturbed,
    save_tiny,
)

transformers = pytest.importorskip("transformers")

WINDOW = 8
LAYERS = ["sliding_attention", "full_attention"]
GEMMA = dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=LAYERS)
HF_CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON, **GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "rope_theta": 1_000_000.0},
        **GEMMA,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
}
CLASS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _hf_model(kind: str):
    torch.manual_seed(0)
    return perturbed(transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[kind]()))  # norms off zero


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    return {kind: save_tiny(_hf_model(kind), tmp_path_factory.mktemp(kind)) for kind in HF_CONFIGS}


def _hf(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


# ----------------------------------------------------------------------------------------------------------------
# Logits


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
@pytest.mark.parametrize("T", [24, 1100])  # 1100: two blocks of queries (1024 a block)
def test_logits_equal_transformers(hf_dirs, kind, T):
    hf = _hf(hf_dirs[kind])
    assert type(hf).__name__ == CLASS[kind]
    ours, _, _ = load_pretrained(hf_dirs[kind])
    assert ours.config.family == kind and ours.config.layer_types == tuple(LAYERS)
    ids = _ids(T)
    with torch.no_grad():
        diff = (hf(ids).logits - ours.eval()(ids)).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_packed_rows_equal_each_sample_alone_in_transformers(hf_dirs, kind):
    """Three samples, each longer than the window, packed into one row: the logits transformers gives each
    alone."""
    hf = _hf(hf_dirs[kind])
    ours, _, _ = load_pretrained(hf_dirs[kind])
    assert packed_rows_diff(hf, ours) <= 1e-5


OPTIONS = {
    "gemma2": ["attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "layer_types"],
    "gemma3": ["rope_local_base_freq", "rope_linear_factor", "query_pre_attn_scalar", "layer_types"],
}


@pytest.mark.parametrize("kind, field", [(k, f) for k, fs in OPTIONS.items() for f in fs])
def test_each_option_changes_the_logits(hf_dirs, kind, field):
    """The parity above is not vacuous: without the option (a cap, the local base, the scaling, the scalar, the
    local layer's window) the same weights give other logits."""
    ours, _, _ = load_pretrained(hf_dirs[kind])
    other = build_decoder(dataclasses.replace(ours.config, **{field: None}), init=False)
    other.load_state_dict(ours.state_dict())
    ids = _ids(24)
    with torch.no_grad():
        assert (ours.eval()(ids) - other.eval()(ids)).abs().max().item() > 1e-3


def test_the_final_softcap_is_applied_to_the_logits(hf_dirs):
    """forward's logits (what generation samples from) are lm_head's capped: 3 * tanh(raw / 3), exactly."""
    ours, _, _ = load_pretrained(hf_dirs["gemma2"])
    with torch.no_grad():
        logits = ours.eval()(_ids(24))
        raw = ours.lm_head(ours(_ids(24), return_hidden=True))
    assert torch.equal(logits, torch.tanh(raw / 3.0) * 3.0)
    assert (logits - raw).abs().max().item() > 0.1


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_layer_tensors_are_transformers_names(hf_dirs, kind):
    hf = _hf(hf_dirs[kind])
    ours, _, _ = load_pretrained(hf_dirs[kind])
    assert set(dict(ours.named_parameters())) == set(hf.state_dict()) - {"lm_head.weight"}  # tied
    layer = {n.removeprefix("model.layers.0.") for n in hf.state_dict() if n.startswith("model.layers.0.")}
    assert set(FAMILIES[kind].layer_tensors) <= layer
    assert len(layer) == 9 + len(FAMILIES[kind].layer_tensors)  # Llama's nine + the family's


# ----------------------------------------------------------------------------------------------------------------
# The softcapped attention: blocks of queries, never a (T, T) tensor, the dense reference's numbers


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("window", [None, 40])
def test_softcapped_attention_equals_the_dense_one_without_a_t_by_t_tensor(window):
    B, nh, nkv, T, hd, cap, scale = 1, 2, 1, 2100, 8, 2.0, 0.3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, hd, generator=g, requires_grad=True) for n in (nh, nkv, nkv))
    with _Largest() as seen:
        out = softcapped_attention(q, k, v, None, window=window, scale=scale, softcap=cap)
        out.square().sum().backward()
    assert seen.largest < T * T  # one block of 1024 queries at a time: (1, 2, 1024, <= 2100)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    pos = torch.arange(T)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    kk, vv = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    scores = torch.tanh(q @ kk.transpose(2, 3) * scale / cap) * cap
    dense = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1) @ vv
    dense.square().sum().backward()
    assert (out - dense).abs().max().item() <= 1e-5
    for ours, ref in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert (ours - ref).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------------------------------------------
# The memory switches' arithmetic: chunked cross-entropy with the final soft-cap, tiled GeGLU


def _loss_and_grads(model, ids, targets, **options):
    model.zero_grad()
    loss = micro_batch_loss(model, ids, targets, dtype="fp32", **options)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("preset", ["tiny-gemma2", "tiny-gemma3"])
def test_chunked_loss_and_tiled_geglu_equal_the_plain_step(preset):
    model = build_decoder(model_config(preset), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids, targets = _ids(32, B=2) % 256, _ids(33, B=2)[:, 1:] % 256
    plain, plain_grads = _loss_and_grads(model, ids, targets)
    chunked, chunked_grads = _loss_and_grads(model, ids, targets, chunked_cross_entropy=5)
    assert abs(chunked - plain) <= 1e-4 * plain  # a sum over 64 tokens of ~5.5 nats
    assert max((a - b).abs().max().item() for a, b in zip(plain_grads, chunked_grads, strict=True)) <= 1e-5
    apply_tiled_mlp(model, 3)
    tiled, tiled_grads = _loss_and_grads(model, ids, targets)
    assert abs(tiled - plain) <= 1e-4 * plain
    assert max((a - b).abs().max().item() for a, b in zip(plain_grads, tiled_grads, strict=True)) <= 1e-5


# ----------------------------------------------------------------------------------------------------------------
# Export, fine-tuning from the directory


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_export_writes_the_family_and_loads_back_with_equal_logits(hf_dirs, tmp_path, kind):
    out = export_checkpoint(hf_dirs[kind], tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (FAMILIES[kind].model_types[0], [CLASS[kind]])
    back, hf = _hf(out), _hf(hf_dirs[kind])
    assert type(back).__name__ == CLASS[kind]
    ids = _ids(24)
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5
    assert read_config(out)[0] == read_config(hf_dirs[kind])[0]


def _finetune_case(kind: str, method: str):
    # over 10 s on 2 cores (Gemma 2's soft-capped attention, the full fine-tunes' AdamW): the slow tier
    slow = (kind, method) != ("gemma3", "lora")
    return pytest.param(kind, method, marks=pytest.mark.slow if slow else (), id=f"{method}-{kind}")


@pytest.mark.parametrize("kind, method", [_finetune_case(k, m) for k in HF_CONFIGS for m in ("full", "lora")])
def test_finetune_from_the_directory_and_export_to_transformers(hf_dirs, tmp_path, kind, method):
    finetune_and_export(hf_dirs[kind], tmp_path, method, FAMILIES[kind].model_types[0])


def test_qlora_on_gemma2_trains(hf_dirs, tmp_path):
    extra = {"method": "qlora", "seq_len": 256, "batch_size": 4, "max_steps": 4, "optimizer.lr": 1e-2,
             "optimizer.warmup_steps": 1, "lora.target_modules": "[q_proj,v_proj]"}  # fmt: skip
    run = tmp_path / "run"
    assert main(["finetune", *finetune_overrides(hf_dirs["gemma2"], run, **extra)]) == 0
    losses = _losses(run)
    assert len(losses) == 4 and losses[-1] < losses[0]


# ----------------------------------------------------------------------------------------------------------------
# Presets: parameter counts against the official config.json

_GEMMA2 = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
               rope_theta=10000.0, rms_norm_eps=1e-6, vocab_size=256000)  # fmt: skip
_GEMMA3 = dict(head_dim=256, query_pre_attn_scalar=256, sliding_window_pattern=6, rope_theta=1000000.0,
               rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6)  # fmt: skip
OFFICIAL = {
    # google/gemma-2-2b config.json; published 2.61B (2,614,341,888)
    "gemma-2-2b": ("gemma2", dict(_GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                  num_attention_heads=8, num_key_value_heads=4), 2_614_341_888),
    # google/gemma-2-9b config.json; published 9.24B
    "gemma-2-9b": ("gemma2", dict(_GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                  num_attention_heads=16, num_key_value_heads=8), 9_241_705_984),
    # google/gemma-3-1b-pt config.json; published 1B (999,885,952)
    "gemma-3-1b": ("gemma3_text", dict(_GEMMA3, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                       max_position_embeddings=32768, sliding_window=512), 999_885_952),
    # google/gemma-3-4b-pt config.json's text_config; published 4.3B with its 0.42B vision tower
    "gemma-3-4b": ("gemma3_text", dict(_GEMMA3, vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                                       num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=131072, sliding_window=1024,
                                       rope_scaling={"factor": 8.0, "rope_type": "linear"}), 3_880_263_168),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_preset_parameters_equal_the_official_config(name):
    model_type, fields, published = OFFICIAL[name]
    hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    preset = model_config(name)
    assert sum(p.numel() for p in hf.parameters()) == published  # a tied matrix once
    assert preset.num_params() == published
    assert sum(p.numel() for p in build_decoder(preset, device="meta").parameters()) == published
    cfg = {**hf_config.to_dict(), "architectures": [FAMILIES[preset.family].architectures[0]]}
    assert hf_config_to_decoder(cfg)[0] == preset  # the official config.json reads as the preset
    # the 4.x spelling the released files use reads the same
    assert hf_config_to_decoder({**fields, "model_type": model_type})[0] == preset


def test_layer_patterns_of_the_presets():
    assert model_config("gemma-2-9b").layer_types[:3] == (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    )
    g3 = model_config("gemma-3-4b")
    assert [i for i, k in enumerate(g3.layer_types) if k == "full_attention"] == [5, 11, 17, 23, 29]
    keys = g3.layer_attended_keys(8192)
    assert keys.count(1024) == 29 and keys.count(8192) == 5


# ----------------------------------------------------------------------------------------------------------------
# Refusals: before anything is allocated, naming the key


def _write_config(tmp_path: Path, kind: str, **edit) -> Path:
    cfg = HF_CONFIGS[kind]().to_dict()
    cfg.update({"architectures": [CLASS[kind]], **edit})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never opened: the config is refused first
    return tmp_path


@pytest.mark.parametrize(
    "kind, edit, message",
    [
        ("gemma3", {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
         r"model_type is 'gemma3' .*multimodal.*'gemma3_text'"),
        ("gemma2", {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
         r"model_type is 'gemma' .*does not build yet"),
        ("gemma2", {"hidden_activation": "gelu"}, r"hidden_activation is 'gelu'"),
        ("gemma3", {"hidden_act": "silu", "hidden_activation": None}, r"hidden_act is 'silu'"),
        ("gemma2", {"use_bidirectional_attention": True}, r"use_bidirectional_attention is true"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping is 50.0"),
        ("gemma2", {"attention_bias": True}, r"attention_bias is true"),
        ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, r"layer_types is"),
        ("gemma2", {"layer_types": ["sliding_attention"]}, r"layer_types has 1 entries for 2 layers"),
        ("gemma2", {"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar is 0"),
        ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
         r"rope_parameters.full_attention.rope_type is 'yarn'"),
        ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         r"rope_parameters.sliding_attention.rope_type is 'linear'"),
        ("gemma3", {"rope_parameters": None, "rope_scaling": {"rope_type": "linear"}},
         r"rope_scaling.factor is missing"),
    ],
)  # fmt: skip
def test_what_memfit_does_not_build_is_refused_naming_the_key(tmp_path, kind, edit, message):
    with pytest.raises(CheckpointError, match=rf"config.json': {message}"):
        read_config(_write_config(tmp_path, kind, **edit))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mlp_activation": "relu"}, "DecoderConfig.mlp_activation must be one of"),
        ({"attn_logit_softcapping": -1.0}, "DecoderConfig.attn_logit_softcapping must be None or a positive"),
        ({"layer_types": ("full_attention",)}, r"DecoderConfig.layer_types must hold 2 \(num_layers\)"),
        ({"layer_types": ("sliding_attention", "full_attention")}, "sliding_window is None"),
    ],
)
def test_config_fields_are_checked_naming_the_field(fields, message):
    base = dict(vocab_size=64, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**base, **fields)


def test_llama_is_unchanged_by_the_new_fields():
    """Every family before Gemma keeps its defaults: no option of Gemma's is on."""
    for name in ("tiny", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "llama3-8b"):
        config = model_config(name)
        assert (
            config.mlp_activation,
            config.norm_plus_one,
            config.sandwich_norms,
            config.scale_embeddings,
        ) == ("silu", False, False, False)
        assert config.layer_types is None and config.query_pre_attn_scalar is None
