"""The families beside Llama (Qwen2/2.5, Qwen3, Mistral, SmolLM2's tied Llama) against transformers' own classes.

Per family a random tiny config is made here with transformers, its weights moved off their initial values (so
biases and norms are not zeros and ones), and written with ``save_pretrained``; memfit loads it and must give the
same logits (1e-5 in fp32), packed too, with a sliding window shorter than the sequence for Mistral; ``memfit
export`` writes the family's own ``model_type`` and loads back into transformers with equal logits; a LoRA and a
full fine-tune start from the directory through the CLI. Each preset's parameter count equals transformers' count
of the official config.json (written below) and the published figure. Architectures memfit does not build, and
fields it does not implement, are refused naming the key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.convert import export_checkpoint, load_pretrained, read_config
from memfit.errors import CheckpointError
from memfit.models.decoder import build_decoder
from memfit.models.families import FAMILIES
from memfit.models.presets import MODEL_PRESETS, model_config
from tests.conftest import ASSETS, finetune_overrides

transformers = pytest.importorskip("transformers")

VOCAB = 2000  # tests/assets/sentencepiece_2k.model, the tokenizer written beside the weights
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000.0,
)
WINDOW = 8
HF_CONFIGS = {
    # Qwen2.5's small sizes: q/k/v biases, tied embeddings
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    # Qwen3: q/k norms, head_dim 32 where hidden / heads is 16
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),
    # Mistral v0.1: a window shorter than the sequences below
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=WINDOW),
    # SmolLM2: a Llama with tied embeddings and plain multi-head attention
    "smollm2": lambda: transformers.LlamaConfig(
        **{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True
    ),
}
FAMILY_OF = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "smollm2": "llama"}


def perturbed(model):
    """``model`` in eval mode with every weight moved off its init (biases and norms off zero and one), so that a
    parity test cannot pass on the initial values alone."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_tiny(model, directory: Path) -> Path:
    """``save_pretrained`` into ``directory``, with tests/assets' SentencePiece tokenizer beside the weights."""
    model.save_pretrained(directory)
    shutil.copyfile(ASSETS / "sentencepiece_2k.model", directory / "tokenizer.model")
    return directory


def packed_rows_diff(hf, ours) -> float:
    """Largest |logit| difference between three samples (11, 17 and 9 tokens) packed into one row by ``ours`` and
    each sample alone in ``hf``."""
    lengths = [11, 17, 9]
    ids = _ids(sum(lengths), B=1)
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]  # (1, T)
    with torch.no_grad():
        expected = torch.cat([hf(part).logits for part in ids.split(lengths, dim=1)], dim=1)
        return (expected - ours.eval()(ids, doc_ids=doc_ids)).abs().max().item()


def _hf_model(kind: str):
    torch.manual_seed(0)
    return perturbed(transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[kind]()))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny checkpoint per family, with a SentencePiece tokenizer beside it."""
    return {kind: save_tiny(_hf_model(kind), tmp_path_factory.mktemp(kind)) for kind in HF_CONFIGS}


def _ids(T: int, B: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(T))


# ----------------------------------------------------------------------------------------------------------------
# Logits


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
@pytest.mark.parametrize(
    "T", [24, 1100]
)  # 1100: two blocks of queries (1024 a block), the window's key ranges
def test_logits_equal_transformers(hf_dirs, kind, T):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    ours, _, _ = load_pretrained(hf_dirs[kind])
    assert ours.config.family == FAMILY_OF[kind]
    ids = _ids(T)
    with torch.no_grad():
        diff = (hf(ids).logits - ours.eval()(ids)).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_packed_rows_equal_each_sample_alone_in_transformers(hf_dirs, kind):
    """Three samples packed into one row (each longer than Mistral's window) give the logits transformers gives
    each sample alone."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    ours, _, _ = load_pretrained(hf_dirs[kind])
    assert packed_rows_diff(hf, ours) <= 1e-5


def test_the_window_changes_mistral_logits(hf_dirs):
    """The parity above is not vacuous: without its window the same weights give other logits past it."""
    ours, _, _ = load_pretrained(hf_dirs["mistral"])
    assert ours.config.sliding_window == WINDOW
    unwindowed = build_decoder(dataclass_replace(ours.config, sliding_window=None), init=False)
    unwindowed.load_state_dict(ours.state_dict())
    ids = _ids(24)
    with torch.no_grad():
        a, b = ours.eval()(ids), unwindowed.eval()(ids)
    assert torch.equal(a[:, :WINDOW], b[:, :WINDOW])  # the first W queries see every earlier key either way
    assert (a[:, WINDOW:] - b[:, WINDOW:]).abs().max().item() > 1e-3


def dataclass_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_layer_tensors_are_transformers_names(hf_dirs, kind):
    """The family entry's extra tensors and memfit's parameter names are exactly transformers' state dict."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[kind])
    ours, _, _ = load_pretrained(hf_dirs[kind])
    tied = ours.config.tie_word_embeddings
    assert set(dict(ours.named_parameters())) == set(hf.state_dict()) - (
        {"lm_head.weight"} if tied else set()
    )
    extra = FAMILIES[FAMILY_OF[kind]].layer_tensors
    assert {n for n in hf.state_dict() if n.startswith("model.layers.0.")} == {
        f"model.layers.0.{n}" for n in (*extra, *_LLAMA_LAYER)
    }


_LLAMA_LAYER = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
    "post_attention_layernorm.weight",
)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Export


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_export_writes_the_family_and_loads_back_with_equal_logits(hf_dirs, tmp_path, kind):
    out = export_checkpoint(hf_dirs[kind], tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    original = json.loads((hf_dirs[kind] / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (
        original["model_type"],
        original["architectures"],
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == original["architectures"][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).eval()
    ids = _ids(24)
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5
    assert read_config(out)[0] == read_config(hf_dirs[kind])[0]


# ----------------------------------------------------------------------------------------------------------------
# Fine-tuning from the directory, through the CLI


def _losses(out: Path) -> list[float]:
    return [
        r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
@pytest.mark.parametrize("method", ["full", "lora"])
def test_finetune_from_the_directory_and_export_to_transformers(hf_dirs, tmp_path, kind, method):
    finetune_and_export(hf_dirs[kind], tmp_path, method, FAMILY_OF[kind])


def finetune_and_export(
    directory: Path,
    tmp_path: Path,
    method: str,
    model_type: str,
    targets: str = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
) -> None:
    """A full or LoRA fine-tune from a Hugging Face ``directory`` through the CLI (6 steps; the loss falls), then
    ``memfit export``: the directory is of ``model_type`` and loads into transformers with memfit's logits (1e-5),
    which differ from the base's (it trained)."""
    from memfit.build import load_for_generation

    lr = 3e-3 if method == "full" else 1e-2
    extra = {"method": method, "seq_len": 256, "batch_size": 4, "max_steps": 6, "optimizer.lr": lr,
             "optimizer.min_lr": lr / 10, "optimizer.warmup_steps": 1}  # fmt: skip
    if method == "lora":
        extra["lora.target_modules"] = targets
    run = tmp_path / "run"
    assert main(["finetune", *finetune_overrides(directory, run, **extra)]) == 0
    losses = _losses(run)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05
    hf_dir = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--out", str(hf_dir)]) == 0
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == model_type
    model, _, _ = load_for_generation(run)
    back = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = _ids(40)
    with torch.no_grad():
        assert (back(ids).logits - model.eval()(ids)).abs().max().item() <= 1e-5
        assert (back(ids).logits - base(ids).logits).abs().max().item() > 1e-3  # it trained


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qlora_keeps_the_biases_and_norms_and_trains(hf_dirs, tmp_path, kind):
    extra = {"method": "qlora", "seq_len": 256, "batch_size": 4, "max_steps": 4, "optimizer.lr": 1e-2,
             "optimizer.warmup_steps": 1, "lora.target_modules": "[q_proj,v_proj]"}  # fmt: skip
    run = tmp_path / "run"
    assert main(["finetune", *finetune_overrides(hf_dirs[kind], run, **extra)]) == 0
    losses = _losses(run)
    assert len(losses) == 4 and losses[-1] < losses[0]


# ----------------------------------------------------------------------------------------------------------------
# Presets: parameter counts against the official config.json

OFFICIAL = {
    # Qwen/Qwen2.5-0.5B config.json; published 0.49B
    "qwen2.5-0.5b": (
        "qwen2",
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
             rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
             max_window_layers=24),
        494_032_768,
    ),
    # Qwen/Qwen2.5-7B config.json; published 7.61B
    "qwen2.5-7b": (
        "qwen2",
        dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
             num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1000000.0,
             rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072,
             max_window_layers=28),
        7_615_616_512,
    ),
    # Qwen/Qwen3-0.6B config.json; published 0.6B (0.44B without the embedding)
    "qwen3-0.6b": (
        "qwen3",
        dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False),
        596_049_920,
    ),
    # Qwen/Qwen3-8B config.json; published 8.2B
    "qwen3-8b": (
        "qwen3",
        dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False),
        8_190_735_360,
    ),
    # mistralai/Mistral-7B-v0.1 config.json; published 7.24B
    "mistral-7b-v0.1": (
        "mistral",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=10000.0,
             rms_norm_eps=1e-5, sliding_window=4096, tie_word_embeddings=False),
        7_241_732_096,
    ),
    # mistralai/Mistral-7B-v0.3 config.json; published 7.25B
    "mistral-7b-v0.3": (
        "mistral",
        dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1000000.0,
             rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
        7_248_023_552,
    ),
    # HuggingFaceTB/SmolLM2-1.7B config.json; published 1.71B
    "smollm2-1.7b": (
        "llama",
        dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192, rope_theta=130000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=True),
        1_711_376_384,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_preset_parameters_equal_the_official_config(name):
    assert_preset_is_the_official_config(name, *OFFICIAL[name])


def assert_preset_is_the_official_config(name: str, model_type: str, fields: dict, published: int) -> None:
    """transformers' count of the official config.json is the published figure, and so are the preset's closed form
    and its meta-built model's count; that config.json reads as the preset."""
    hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    counted = sum(p.numel() for p in hf.parameters())  # a tied matrix once
    preset = model_config(name)
    assert counted == published
    assert preset.num_params() == published
    assert sum(p.numel() for p in build_decoder(preset, device="meta").parameters()) == published
    # and the official config.json reads as the preset
    cfg = {**hf_config.to_dict(), "architectures": [FAMILIES[preset.family].architectures[0]]}
    from memfit.convert.hf import hf_config_to_decoder

    assert hf_config_to_decoder(cfg)[0] == preset


def test_every_preset_is_listed_by_its_family():
    listed = {p: f.name for f in FAMILIES.values() for p in f.presets}
    assert listed.keys() == MODEL_PRESETS.keys()
    for name, fam in listed.items():
        assert MODEL_PRESETS[name].get("family", "llama") == fam


# ----------------------------------------------------------------------------------------------------------------
# Refusals: before anything is allocated, naming the key


def _write_config(tmp_path: Path, base: str, **edit) -> Path:
    cfg = HF_CONFIGS[base]().to_dict()
    cfg.update({"architectures": [FAMILIES[FAMILY_OF[base]].architectures[0]], **edit})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never opened: the config is refused first
    return tmp_path


@pytest.mark.parametrize(
    "base, edit, message",
    [
        ("qwen2", {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]},
         r"model_type is 'qwen2_moe' \(architectures \['Qwen2MoeForCausalLM'\]\): a mixture of experts"),
        ("mistral", {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]},
         r"model_type is 'deepseek_v3' .*a mixture of experts memfit does not build"),
        ("smollm2", {"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
         r"model_type is 'mamba' .*a state-space model"),
        ("smollm2", {"model_type": "florp", "architectures": ["FlorpForCausalLM"]},
         r"model_type is 'florp' .*an architecture memfit does not build"),
        ("qwen2", {"architectures": ["Qwen2ForSequenceClassification"]}, r"architectures is "),
        ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
         r"rope_scaling.rope_type is 'yarn'"),
        ("mistral", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
         r"rope_parameters.rope_type is 'longrope'"),
        ("qwen3", {"attention_bias": True}, r"attention_bias is true"),
        ("mistral", {"mlp_bias": True}, r"mlp_bias is true"),
        ("smollm2", {"attention_bias": True}, r"attention_bias is true"),
        ("qwen2", {"use_sliding_window": True}, r"use_sliding_window is true"),
        ("mistral", {"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types is"),
        ("qwen3", {"attention_dropout": 0.1}, r"attention_dropout is 0.1"),
    ],
)  # fmt: skip
def test_unbuilt_architectures_and_fields_are_refused_naming_the_key(tmp_path, base, edit, message):
    directory = _write_config(tmp_path, base, **edit)
    with pytest.raises(CheckpointError, match=rf"config.json': {message}"):
        read_config(directory)


def test_the_refusal_lists_the_families_memfit_builds(tmp_path):
    directory = _write_config(
        tmp_path, "qwen2", model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"]
    )
    with pytest.raises(CheckpointError) as info:
        read_config(directory)
    for f in FAMILIES.values():
        assert f"{f.model_types[0]} ({f.architectures[0]})" in str(info.value)


def test_an_unknown_family_in_a_preset_is_refused():
    with pytest.raises(ValueError, match="unknown model family 'gemma'; memfit builds: llama, mistral"):
        model_config("tiny", family="gemma")
