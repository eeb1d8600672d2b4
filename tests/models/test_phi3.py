"""Phi-3 / Phi-3.5-mini (``model_type`` phi3) against transformers' own ``Phi3ForCausalLM``.

A random tiny ``Phi3Config`` is made here with transformers (a sliding window of 8 keys, shorter than the
sequences), its weights moved off their initial values, and written with ``save_pretrained``: its q, k and v rows
fused in ``qkv_proj`` and gate and up in ``gate_up_proj``. memfit splits them on read into its own modules and must
give the same logits (1e-5 in fp32), packed too; ``memfit export`` writes them fused again and loads back into
transformers with equal logits; a LoRA (targets by the fused names) and a full fine-tune start from the directory
through the CLI. The presets' parameter counts equal transformers' count of the official config.json files and the
published figure; LongRoPE and the other fields memfit does not implement are refused naming the key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from memfit.cli import main
from memfit.convert import export_checkpoint, load_pretrained, read_config
from memfit.convert.hf import hf_config_to_decoder
from memfit.errors import CheckpointError
from memfit.models.decoder import build_decoder
from memfit.models.peft import apply_lora, lora_settings
from memfit.models.presets import model_config
from tests.conftest import finetune_overrides
from tests.models.test_families import COMMON, VOCAB, _ids, _losses, packed_rows_diff, perturbed, save_tiny

transformers = pytest.importorskip("transformers")

WINDOW = 8


def _hf_config(**edit):
    return transformers.Phi3Config(**{**COMMON, "sliding_window": WINDOW, "pad_token_id": 0, **edit})


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    """A saved tiny Phi-3 with a SentencePiece tokenizer beside it."""
    torch.manual_seed(0)
    return save_tiny(perturbed(transformers.Phi3ForCausalLM(_hf_config())), tmp_path_factory.mktemp("phi3"))


def _hf(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def _keys(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


# ----------------------------------------------------------------------------------------------------------------
# Logits and the fused layouts


@pytest.mark.parametrize("T", [24, 1100])  # 1100: two blocks of queries, the window's key ranges
def test_logits_equal_transformers(phi3_dir, T):
    hf = _hf(phi3_dir)
    assert type(hf).__name__ == "Phi3ForCausalLM"
    ours, _, _ = load_pretrained(phi3_dir)
    assert (ours.config.family, ours.config.sliding_window) == ("phi3", WINDOW)
    ids = _ids(T)
    with torch.no_grad():
        diff = (hf(ids).logits - ours.eval()(ids)).abs().max().item()
    assert diff <= 1e-5


def test_packed_rows_equal_each_sample_alone_in_transformers(phi3_dir):
    """Three samples, each longer than the window, packed into one row give transformers' logits of each alone."""
    hf = _hf(phi3_dir)
    ours, _, _ = load_pretrained(phi3_dir)
    assert packed_rows_diff(hf, ours) <= 1e-5


def test_the_fused_rows_split_q_k_v_and_gate_up_in_order(phi3_dir):
    """memfit's split modules hold exactly the fused tensors' row blocks: q, k, v; gate, up."""
    hf = _hf(phi3_dir)
    ours, _, _ = load_pretrained(phi3_dir)
    attn, mlp = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    qkv = hf.model.layers[1].self_attn.qkv_proj.weight  # (64 + 32 + 32, 64)
    gate_up = hf.model.layers[1].mlp.gate_up_proj.weight  # (128 + 128, 64)
    assert qkv.shape == (128, 64) and gate_up.shape == (256, 64)
    assert torch.equal(attn.q_proj.weight, qkv[:64])
    assert torch.equal(attn.k_proj.weight, qkv[64:96])
    assert torch.equal(attn.v_proj.weight, qkv[96:])
    assert torch.equal(mlp.gate_proj.weight, gate_up[:128])
    assert torch.equal(mlp.up_proj.weight, gate_up[128:])
    hf_names = set(hf.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in hf_names
    assert not any("q_proj" in n or ".gate_proj" in n for n in hf_names)


def test_export_writes_the_fused_layout_and_loads_back_with_equal_logits(phi3_dir, tmp_path):
    out = export_checkpoint(phi3_dir, tmp_path / "out")
    assert _keys(out) == _keys(phi3_dir)  # qkv_proj and gate_up_proj, no split names
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("phi3", ["Phi3ForCausalLM"])
    assert written["sliding_window"] == WINDOW
    back = _hf(out)
    assert type(back).__name__ == "Phi3ForCausalLM"
    ids = _ids(24)
    with torch.no_grad():
        assert (back(ids).logits - _hf(phi3_dir)(ids).logits).abs().max().item() <= 1e-5
    for name, tensor in back.state_dict().items():  # the very same numbers, fused again
        assert torch.equal(tensor, _hf(phi3_dir).state_dict()[name]), name
    assert read_config(out)[0] == read_config(phi3_dir)[0]


def test_a_fused_tensor_of_the_wrong_rows_is_refused_naming_it(phi3_dir, tmp_path):
    """A config whose heads do not fit the stored qkv_proj is refused before any weight is read."""
    d = tmp_path / "bad"
    shutil.copytree(phi3_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # 64 + 64 + 64 rows expected, 128 stored
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(128, 64\) but the config "
        r"implies \(192, 64\): the rows of q_proj, k_proj, v_proj \(64, 64, 64\)"
    ):  # fmt: skip
        load_pretrained(d)


# ----------------------------------------------------------------------------------------------------------------
# LoRA targets by the fused names


def test_lora_on_the_fused_names_adapts_their_parts():
    model = build_decoder(model_config("tiny-phi3"), device="meta")
    names = apply_lora(model, rank=2, target_modules=["qkv_proj", "gate_up_proj"])
    adapted = sorted({n.split(".")[-2] for n in names})
    assert adapted == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    assert len(names) == 2 * 5 * 2  # lora_A and lora_B, 5 linears, 2 layers
    assert lora_settings(model).target_modules == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def test_a_layer_named_twice_or_a_fused_name_on_another_family_is_refused():
    phi3 = build_decoder(model_config("tiny-phi3"), device="meta")
    with pytest.raises(ValueError, match=r"names a layer twice: \['qkv_proj', 'k_proj'\].*qkv_proj is"):
        apply_lora(phi3, rank=2, target_modules=["qkv_proj", "k_proj"])
    llama = build_decoder(model_config("tiny"), device="meta")
    with pytest.raises(ValueError, match="unknown LoRA target module 'qkv_proj' for the llama family"):
        apply_lora(llama, rank=2, target_modules=["qkv_proj"])


# ----------------------------------------------------------------------------------------------------------------
# Fine-tuning from the directory, through the CLI


@pytest.mark.parametrize("method", ["full", "lora"])
def test_finetune_from_the_directory_and_export_to_transformers(phi3_dir, tmp_path, method):
    from memfit.build import load_for_generation

    lr = 3e-3 if method == "full" else 1e-2
    extra = {"method": method, "seq_len": 256, "batch_size": 4, "max_steps": 6, "optimizer.lr": lr,
             "optimizer.min_lr": lr / 10, "optimizer.warmup_steps": 1}  # fmt: skip
    if method == "lora":
        extra["lora.target_modules"] = "[qkv_proj,o_proj,gate_up_proj,down_proj]"
    run = tmp_path / "run"
    assert main(["finetune", *finetune_overrides(phi3_dir, run, **extra)]) == 0
    losses = _losses(run)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05
    hf_dir = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--out", str(hf_dir)]) == 0
    assert _keys(hf_dir) == _keys(phi3_dir)  # written fused
    model, _, _ = load_for_generation(run)
    back, base = _hf(hf_dir), _hf(phi3_dir)
    ids = _ids(40)
    with torch.no_grad():
        assert (back(ids).logits - model.eval()(ids)).abs().max().item() <= 1e-5
        assert (back(ids).logits - base(ids).logits).abs().max().item() > 1e-3  # it trained
    if (
        method == "lora"
    ):  # PEFT's qkv_proj adapter shares one A over q, k, v: memfit's three LoRAs do not fit it
        with pytest.raises(CheckpointError, match=r"adapts q_proj, k_proj, v_proj, gate_proj, up_proj, parts of "
                           r"the phi3 checkpoint's fused qkv_proj, gate_up_proj"):  # fmt: skip
            from memfit.export import export_run

            export_run(run, tmp_path / "adapter", adapter_only=True)
        assert not (tmp_path / "adapter").exists()


# ----------------------------------------------------------------------------------------------------------------
# Presets: parameter counts against the official config.json

# microsoft/Phi-3-mini-4k-instruct config.json (published: 3.8B parameters)
PHI3_MINI_4K = dict(
    vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, max_position_embeddings=4096, original_max_position_embeddings=4096,
    rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, sliding_window=2047, tie_word_embeddings=False,
    hidden_act="silu", resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, bos_token_id=1,
    eos_token_id=32000, pad_token_id=32000,
)  # fmt: skip
# microsoft/Phi-3.5-mini-instruct config.json: the same shapes, LongRoPE to 131,072 tokens (its 48 long and short
# factors, one per pair of a 96-channel head, shortened here to their length: only their count is checked)
PHI3_5_MINI = {
    **PHI3_MINI_4K,
    "max_position_embeddings": 131072,
    "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "long_factor": [1.08] * 48, "short_factor": [1.0] * 48},
}
PUBLISHED = 3_821_079_552


def _count(fields: dict) -> int:
    with torch.device("meta"):
        hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**fields))
    return sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name, fields", [("phi-3-mini", PHI3_MINI_4K), ("phi-3.5-mini", PHI3_5_MINI)])
def test_preset_parameters_equal_the_official_config(name, fields):
    preset = model_config(name)
    assert _count(fields) == PUBLISHED
    assert preset.num_params() == PUBLISHED
    assert sum(p.numel() for p in build_decoder(preset, device="meta").parameters()) == PUBLISHED


def test_the_official_phi3_mini_config_reads_as_the_preset():
    cfg = {**transformers.Phi3Config(**PHI3_MINI_4K).to_dict(), "architectures": ["Phi3ForCausalLM"]}
    assert hf_config_to_decoder(cfg)[0] == model_config("phi-3-mini")


# ----------------------------------------------------------------------------------------------------------------
# Refusals: before anything is allocated, naming the key


@pytest.mark.parametrize(
    "edit, message",
    [
        (PHI3_5_MINI, r"rope_scaling.rope_type is 'longrope'; memfit does not implement LongRoPE"),
        ({"rope_scaling": {"type": "su", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}},
         r"rope_scaling.rope_type is 'su'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope_parameters.rope_type is 'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
         r"rope_scaling.rope_type is 'llama3'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
         r"partial_rotary_factor is 0.75"),  # Phi-4-mini's: a part of each head rotated
        ({"resid_pdrop": 0.1}, r"resid_pdrop is 0.1"),
        ({"embd_pdrop": 0.1}, r"embd_pdrop is 0.1"),
        ({"attention_dropout": 0.1}, r"attention_dropout is 0.1"),
        ({"attention_bias": True}, r"attention_bias is true"),
        ({"hidden_act": "gelu"}, r"hidden_act is 'gelu'"),
        ({"architectures": ["Phi3ForSequenceClassification"]}, r"architectures is "),
    ],
)  # fmt: skip
def test_fields_memfit_does_not_implement_are_refused_naming_the_key(tmp_path, edit, message):
    cfg = {**_hf_config().to_dict(), "architectures": ["Phi3ForCausalLM"], **edit}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never opened: the config is refused first
    with pytest.raises(CheckpointError, match=rf"config.json': {message}"):
        read_config(tmp_path)


def test_without_a_window_phi3_reads_none():
    """Phi3Config's default window is None (Mistral's would be 4096)."""
    cfg = {k: v for k, v in _hf_config().to_dict().items() if k != "sliding_window"}
    assert hf_config_to_decoder({**cfg, "architectures": ["Phi3ForCausalLM"]})[0].sliding_window is None
    assert VOCAB == _hf_config().vocab_size
