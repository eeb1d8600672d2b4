"""Pretrained checkpoint I/O: Hugging Face, Meta and memfit checkpoints load with the logits of transformers'
Llama; exports load in transformers with the same logits and token ids; broken checkpoints fail naming the file."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memfit.checkpoint import save_checkpoint
from memfit.convert import (
    PretrainedInfo,
    detect_format,
    export_checkpoint,
    iter_state_dict,
    load_pretrained,
    read_config,
)
from memfit.convert.hf import export_hf, read_hf_config
from memfit.convert.meta import meta_to_hf_rows, read_meta_params
from memfit.errors import CheckpointError
from memfit.models.config import RopeScaling
from memfit.models.decoder import build_decoder
from memfit.models.layers import RotaryEmbedding, apply_rope
from memfit.models.presets import model_config
from memfit.tokenizer import CharTokenizer, load_tokenizer, train_bpe

transformers = pytest.importorskip("transformers")

ASSETS = Path(__file__).parent / "assets"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
TEXT = "Hello there, my lord!\nWhat say you?  12345 <|eot_id|> ok"


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_model(
    vocab_size: int = 96,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie: bool = False,
    seed: int = 0,
):
    """A tiny transformers Llama with weights far from their init (so logits differ across layouts)."""
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    randomize(model)
    return model


def randomize(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.1)


def max_logit_diff(model, hf, vocab_size: int, length: int = 48) -> float:
    ids = torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = model.eval()(ids)
    assert expected.abs().max() > 1.0  # not a comparison of near-zero logits
    return (got - expected).abs().max().item()


# ================================================================================================ HF -> memfit


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        ("gqa", {}),
        ("mha", {"num_kv_heads": 4}),
        (
            "llama3_rope",
            {"rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 16}},
        ),
        ("tied", {"tie": True}),
    ],
)
def test_hf_checkpoint_loads_with_transformers_logits(tmp_path, kind, kwargs):
    hf = hf_model(**kwargs)
    hf.save_pretrained(tmp_path)
    assert detect_format(tmp_path) == "hf"
    model, tokenizer, info = load_pretrained(tmp_path)
    assert tokenizer is None and any("no tokenizer" in n for n in info.notes)
    assert info.format == "hf" and info.stored_dtype == torch.float32 and info.path == tmp_path
    assert max_logit_diff(model, hf, 96) <= 1e-5
    assert torch.equal(model.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert not any(p.is_meta for p in model.parameters()) and all(p.requires_grad for p in model.parameters())
    if kind == "tied":
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if kind == "llama3_rope":
        assert model.config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)


def test_sharded_hf_checkpoint(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (
        tmp_path / "model.safetensors"
    ).exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    model, _, _ = load_pretrained(tmp_path)
    assert max_logit_diff(model, hf, 96) <= 1e-5
    names = [name for name, _ in iter_state_dict(tmp_path)]
    assert sorted(names) == sorted(hf.state_dict())


def test_safetensors_without_the_pread_backend(tmp_path, monkeypatch):
    """Older safetensors memory-map only: tensors are copied out of the mapping before it closes."""
    import memfit.convert.tensors

    hf = hf_model()
    hf.save_pretrained(tmp_path)
    monkeypatch.setattr(memfit.convert.tensors, "_PREAD", False)
    model, _, _ = load_pretrained(tmp_path)
    assert max_logit_diff(model, hf, 96) <= 1e-5


def test_bf16_checkpoint_loads_in_any_dtype(tmp_path):
    hf = hf_model().to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    assert {t.dtype for _, t in iter_state_dict(tmp_path)} == {torch.bfloat16}
    model, _, info = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert info.stored_dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    fp32, _, _ = load_pretrained(tmp_path)  # the default float32 upcasts
    assert fp32.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(fp32.model.embed_tokens.weight, hf.model.embed_tokens.weight.float())


def _as_4x(config: dict) -> dict:
    """transformers 4.x spelling: top-level rope_theta, rope_scaling with "type", torch_dtype."""
    out = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
    rope = dict(config["rope_parameters"])
    out["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    out["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    out["torch_dtype"] = config["dtype"]
    return out


def test_config_json_in_4x_and_5x_spelling_give_the_same_config(tmp_path):
    hf = hf_model(rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 16})
    hf.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written  # what transformers 5.24 writes
    v5 = read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_as_4x(written)))
    v4 = read_hf_config(tmp_path / "config.json")
    assert v4 == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling.original_max_position_embeddings == 16
    assert (v5.dim, v5.num_layers, v5.num_heads, v5.num_kv_heads, v5.intermediate_size) == (64, 2, 4, 2, 128)
    assert (v5.vocab_size, v5.max_seq_len, v5.norm_eps, v5.tie_word_embeddings) == (96, 256, 1e-5, False)
    model, _, info = load_pretrained(tmp_path)  # the 4.x file, loaded
    assert info.stored_dtype == torch.float32
    assert max_logit_diff(model, hf, 96) <= 1e-5
    # 4.x defaults: no rope keys at all is plain RoPE with theta 10000; no num_key_value_heads is MHA
    plain = {
        k: v
        for k, v in _as_4x(written).items()
        if k not in ("rope_theta", "rope_scaling", "num_key_value_heads")
    }
    (tmp_path / "config.json").write_text(json.dumps(plain))
    config = read_hf_config(tmp_path)
    assert (config.rope_theta, config.rope_scaling, config.num_kv_heads) == (10000.0, None, 4)


def core_bpe():
    """A small byte-level BPE ``tokenizers.Tokenizer`` with Llama 3's BOS/EOS as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT * 20], trainer=trainer)
    return tok


def test_generation_config_eos_list_and_hf_tokenizer_specials(tmp_path):
    hf = hf_model(vocab_size=300)
    hf.save_pretrained(tmp_path)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(
        json.dumps({**gen, "bos_token_id": 256, "eos_token_id": [257, 260]})
    )
    # a tokenizer saved by transformers, with Llama 3's chat tokens added as special tokens
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core_bpe(), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    fast.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    fast.save_pretrained(tmp_path)
    _, tokenizer, info = load_pretrained(tmp_path)
    assert (info.bos_token_id, info.eos_token_ids) == (256, (257, 260))
    assert info.tokenizer_path == tmp_path
    for token in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert tokenizer.special_tokens[token] == fast.convert_tokens_to_ids(token)
    plain = TEXT.replace("<|eot_id|>", "")  # (transformers turns special-token text into the special id)
    assert tokenizer.encode(plain) == fast.encode(plain, add_special_tokens=False)


def test_hf_to_hf_export_keeps_generation_config_and_chat_template(tmp_path):
    src = tmp_path / "src"
    hf = hf_model(vocab_size=300)
    hf.save_pretrained(src)
    gen = {"bos_token_id": 256, "eos_token_id": [257, 260], "temperature": 0.6, "do_sample": True}
    (src / "generation_config.json").write_text(json.dumps(gen))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core_bpe(),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )
    fast.chat_template = "{% for m in messages %}<|start|>{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(src)
    out = export_checkpoint(src, tmp_path / "out")
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: written[k] for k in gen} == gen
    again = transformers.AutoTokenizer.from_pretrained(out)
    assert again.chat_template == fast.chat_template
    assert again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|start|>hi"
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert max_logit_diff(load_pretrained(out)[0], model, 300) == 0.0
    assert max_logit_diff(load_pretrained(src)[0], model, 300) == 0.0


def test_tokenizer_config_lists_specials_that_tokenizer_json_does_not_mark(tmp_path):
    core = core_bpe()
    core.add_tokens(["<|eot_id|>"])  # an ordinary added token in tokenizer.json ...
    core.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "extra_special_tokens": ["<|eot_id|>"],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))  # ... declared special here
    tokenizer = load_tokenizer(tmp_path)
    eot = tokenizer.special_tokens["<|eot_id|>"]
    assert eot not in tokenizer.encode("a<|eot_id|>b")  # special text in plain text stays text


# ================================================================================================ memfit -> HF


def _memfit_model(name: str):
    model = build_decoder(model_config(name), seed=0)
    randomize(model)
    return model.eval()


@pytest.mark.parametrize("name", ["tiny", "tiny-mha", "tiny-llama3", "tiny-tied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, name):
    model = _memfit_model(name)
    out = export_hf(model, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert max_logit_diff(model, hf, model.config.vocab_size, length=80) <= 1e-5
    stored = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not model.config.tie_word_embeddings)
    again, _, _ = load_pretrained(out)
    assert again.config == model.config
    assert max_logit_diff(again, hf, model.config.vocab_size) <= 1e-5
    assert not list(tmp_path.glob(".tmp-*"))


def test_sharded_export(tmp_path):
    model = _memfit_model("tiny")
    out = export_hf(model, tmp_path / "fp32", max_shard_size=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert max_logit_diff(model, hf, model.config.vocab_size) <= 1e-5

    out = export_hf(model, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size=40_000)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name].to(torch.bfloat16)), name
    assert model.model.embed_tokens.weight.dtype == torch.float32  # export converts copies, shard by shard


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece", "tiktoken", "gpt2"])
def test_exported_tokenizer_loads_in_transformers_with_the_same_ids(tmp_path, kind):
    tokenizer = {
        "bpe": lambda: train_bpe(
            [(ASSETS.parent.parent / "src/memfit/assets/tinyshakespeare.txt").read_text()[:20000]], 400
        ),
        "sentencepiece": lambda: load_tokenizer(ASSETS / "sentencepiece_2k.model"),
        "tiktoken": lambda: load_tokenizer(ASSETS / "tiktoken_2k.model"),
        "gpt2": lambda: load_tokenizer(ASSETS),
    }[kind]()
    model = build_decoder(model_config("tiny", vocab_size=tokenizer.vocab_size), seed=0)
    out = export_hf(model, tmp_path / "hf", tokenizer=tokenizer)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = TEXT.replace("<|eot_id|>", "")  # (transformers turns special-token text into the special id)
    assert hf_tok.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    # a prompt reads in transformers as memfit trained on documents: BOS first
    assert tokenizer.add_bos and hf_tok(text)["input_ids"] == tokenizer.encode(text, bos=True)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen.get("bos_token_id"), gen.get("eos_token_id")) == (tokenizer.bos_id, tokenizer.eos_id)
    assert hf_tok.eos_token_id == tokenizer.eos_id
    if kind == "tiktoken":
        for token in ("<|start_header_id|>", "<|eot_id|>"):
            assert hf_tok.convert_tokens_to_ids(token) == tokenizer.special_tokens[token]
    again = load_tokenizer(out)  # memfit reads back the same kind
    assert again.kind == tokenizer.kind and again.encode(text) == tokenizer.encode(text)


def test_export_checkpoint_from_a_memfit_run(tmp_path):
    model = _memfit_model("tiny")
    tokenizer = CharTokenizer.from_text("abcdefgh ")
    config = dataclasses.replace(model.config)
    run = tmp_path / "run"
    save_checkpoint(run, 7, model, config, None, {}, tokenizer, keep_last=2)
    assert detect_format(run) == "memfit"
    loaded, tok, info = load_pretrained(run)
    assert info.format == "memfit" and info.path.name == "step_00000007" and tok.kind == "char"
    assert (info.bos_token_id, info.eos_token_ids) == (tokenizer.bos_id, (tokenizer.eos_id,))
    out = export_checkpoint(run, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert max_logit_diff(loaded, hf, config.vocab_size) <= 1e-5
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_id


# ================================================================================================ Meta


def meta_rope_scores(q: torch.Tensor, k: torch.Tensor, theta: float) -> torch.Tensor:
    """Attention scores with RoPE applied as Meta's reference code does: complex rotation of channel pairs."""
    T, nh, hd = q.shape
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))  # (hd/2,)
    cis = torch.polar(torch.ones(T, hd // 2), torch.outer(torch.arange(T).float(), freqs))  # (T, hd/2)

    def rotate(x):
        xc = torch.view_as_complex(x.reshape(T, x.shape[1], hd // 2, 2))  # (T, n, hd/2)
        return torch.view_as_real(xc * cis[:, None]).flatten(2)  # (T, n, hd)

    return torch.einsum("tnd,snd->nts", rotate(q), rotate(k))  # (nh, T, T)


def test_meta_permutation_turns_meta_rope_into_rotate_half():
    """Independent of the writer below: the permuted weights with rotate_half RoPE give Meta's attention scores."""
    torch.manual_seed(0)
    T, nh, hd, C = 12, 4, 16, 64
    config = model_config("tiny-mha", rope_theta=10000.0)
    wq, wk = torch.randn(nh * hd, C), torch.randn(nh * hd, C)  # Meta layout
    x = torch.randn(T, C)
    expected = meta_rope_scores((x @ wq.T).view(T, nh, hd), (x @ wk.T).view(T, nh, hd), 10000.0)
    cos, sin = RotaryEmbedding(config)(T, torch.float32)  # (T, hd)
    q = apply_rope((x @ meta_to_hf_rows(wq, nh).T).view(T, nh, hd).transpose(0, 1), cos, sin)  # (nh, T, hd)
    k = apply_rope((x @ meta_to_hf_rows(wk, nh).T).view(T, nh, hd).transpose(0, 1), cos, sin)
    torch.testing.assert_close(q @ k.transpose(1, 2), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(
        q @ k.transpose(1, 2),
        torch.einsum("tnd,snd->nts", (x @ wq.T).view(T, nh, hd), (x @ wk.T).view(T, nh, hd)),
    )


def _to_meta_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of Hugging Face's conversion permutation, written out independently of memfit."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def write_meta(hf, directory: Path, shards: int, llama3: bool, output: str = "separate") -> Path:
    """Write an HF model in Meta's layout: params.json + consolidated.NN.pth, model-parallel over ``shards``."""
    directory.mkdir(parents=True)
    c = hf.config
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    meta = {"tok_embeddings.weight": sd["model.embed_tokens.weight"]}
    split = {"tok_embeddings.weight": 0 if llama3 else 1}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for meta_name, hf_name, dim in [
            ("attention.wq", "self_attn.q_proj", 0),
            ("attention.wk", "self_attn.k_proj", 0),
            ("attention.wv", "self_attn.v_proj", 0),
            ("attention.wo", "self_attn.o_proj", 1),
            ("feed_forward.w1", "mlp.gate_proj", 0),
            ("feed_forward.w2", "mlp.down_proj", 1),
            ("feed_forward.w3", "mlp.up_proj", 0),
            ("attention_norm", "input_layernorm", None),
            ("ffn_norm", "post_attention_layernorm", None),
        ]:
            w = sd[p + hf_name + ".weight"]
            if meta_name == "attention.wq":
                w = _to_meta_rows(w, nh)
            elif meta_name == "attention.wk":
                w = _to_meta_rows(w, nkv)
            meta[f"layers.{i}.{meta_name}.weight"] = w
            split[f"layers.{i}.{meta_name}.weight"] = dim
    meta["norm.weight"], split["norm.weight"] = sd["model.norm.weight"], None
    if output == "separate":
        meta["output.weight"] = sd["lm_head.weight"]
    elif output == "copy":  # Llama 3.2: a copy of the tied embedding
        meta["output.weight"] = sd["model.embed_tokens.weight"].clone()
    split["output.weight"] = 0
    if not llama3:
        meta["rope.freqs"], split["rope.freqs"] = torch.randn(c.hidden_size // nh // 2), None
    for j in range(shards):
        part = {
            k: (v if split[k] is None else v.chunk(shards, dim=split[k])[j]).clone() for k, v in meta.items()
        }
        torch.save(part, directory / f"consolidated.{j:02d}.pth")
    hidden = c.intermediate_size
    params = {
        "dim": c.hidden_size,
        "n_layers": c.num_hidden_layers,
        "n_heads": nh,
        "norm_eps": c.rms_norm_eps,
    }
    if llama3:
        params.update(n_kv_heads=nkv, vocab_size=c.vocab_size, multiple_of=32, ffn_dim_multiplier=1.3)
        params.update(rope_theta=c.rope_parameters["rope_theta"], use_scaled_rope=True)
        assert hidden == 224  # = 32 * ceil(int(1.3 * int(8 * 64 / 3)) / 32)
    else:
        params.update(vocab_size=-1, multiple_of=32)
        assert hidden == 192  # = 32 * ceil(int(8 * 64 / 3) / 32)
    (directory / "params.json").write_text(json.dumps(params))
    return directory


LLAMA2_KW = {"vocab_size": 2000, "num_kv_heads": 4, "intermediate_size": 192}
LLAMA31_KW = {
    "vocab_size": 2256,
    "num_kv_heads": 2,
    "intermediate_size": 224,
    "rope_theta": 500000.0,
    "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("family", ["llama2", "llama3.1"])
def test_meta_checkpoint_loads_with_transformers_logits(tmp_path, family, shards):
    llama3 = family == "llama3.1"
    hf = hf_model(**(LLAMA31_KW if llama3 else LLAMA2_KW))
    directory = write_meta(hf, tmp_path / "meta" / "model", shards, llama3)
    if llama3:
        shutil.copyfile(ASSETS / "tiktoken_2k.model", directory / "tokenizer.model")
    else:  # Meta's Llama 2 download keeps tokenizer.model beside the model directories
        shutil.copyfile(ASSETS / "sentencepiece_2k.model", directory.parent / "tokenizer.model")
    assert detect_format(directory) == "meta"
    config = read_meta_params(directory)
    assert config == expected_meta_config(hf, max_seq_len=131072 if llama3 else 4096)
    model, tokenizer, info = load_pretrained(directory)
    assert max_logit_diff(model, hf, config.vocab_size) <= 1e-5
    assert info.format == "meta" and info.stored_dtype == torch.float32
    if llama3:
        assert tokenizer.kind == "tiktoken"
        eom, eot = tokenizer.special_tokens["<|eom_id|>"], tokenizer.special_tokens["<|eot_id|>"]
        assert info.eos_token_ids == (tokenizer.eos_id, eom, eot)
    else:
        assert (
            tokenizer.kind == "sentencepiece" and info.tokenizer_path == directory.parent / "tokenizer.model"
        )
    names = dict(iter_state_dict(directory))
    assert "rope.freqs" not in names and sorted(names) == sorted(hf.state_dict())


def expected_meta_config(hf, max_seq_len: int):
    """The memfit config of a test model, as a Meta checkpoint of it should give."""
    c = hf.config
    rope = c.rope_parameters
    scaling = None
    if rope["rope_type"] == "llama3":
        scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], 8192)
    return model_config(
        "tiny",
        vocab_size=c.vocab_size,
        num_kv_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size,
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        norm_eps=c.rms_norm_eps,
        max_seq_len=max_seq_len,
        tie_word_embeddings=c.tie_word_embeddings,
    )


@pytest.mark.parametrize("output", ["absent", "copy"])
def test_meta_output_tied_when_absent_or_identical(tmp_path, output):
    hf = hf_model(**LLAMA31_KW, tie=True)
    directory = write_meta(hf, tmp_path / "m", 1, llama3=True, output=output)
    model, tokenizer, info = load_pretrained(directory)
    assert tokenizer is None and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert max_logit_diff(model, hf, 2256) <= 1e-5


def test_meta_to_hf_export(tmp_path):
    hf = hf_model(**LLAMA31_KW)
    directory = write_meta(hf, tmp_path / "meta", 2, llama3=True)
    out = export_checkpoint(directory, tmp_path / "hf")
    again = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 2256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() <= 1e-5
    assert (
        again.config.rope_parameters["rope_type"] == "llama3"
        and again.config.max_position_embeddings == 131072
    )


# ================================================================================================ errors


def test_detect_format_lists_what_it_expects(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        detect_format(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(
        CheckpointError, match=r"config.json \+ model.safetensors.*params.json.*Found: notes.txt"
    ):
        detect_format(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.*safetensors"):
        detect_format(tmp_path)


def test_missing_shard_is_named(tmp_path):
    hf_model().save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(
        CheckpointError, match=rf"shard '.*{shard.name}' listed in '.*model.safetensors.index.json'"
    ):
        load_pretrained(tmp_path)


def test_truncated_safetensors_is_named(tmp_path):
    hf_model().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors' is not a complete safetensors file"):
        load_pretrained(tmp_path)


def test_index_pointing_at_the_wrong_shard_is_named(tmp_path):
    hf_model().save_pretrained(tmp_path, max_shard_size="40KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = (
        shards[0] if index["weight_map"]["model.norm.weight"] != shards[0] else shards[1]
    )
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model.norm.weight'.*index.json"):
        load_pretrained(tmp_path)


def _rewrite_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_unexpected_missing_and_misshaped_tensors_are_named(tmp_path):
    hf_model().save_pretrained(tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(
        CheckpointError, match=r"model.safetensors' holds tensor 'model.layers.0.self_attn.q_proj.bias'"
    ):
        load_pretrained(tmp_path)
    _rewrite_weights(
        tmp_path,
        lambda t: [t.pop("model.layers.0.self_attn.q_proj.bias"), t.pop("model.layers.1.mlp.up_proj.weight")],
    )
    with pytest.raises(
        CheckpointError, match=r"lacks tensor 'model.layers.1.mlp.up_proj.weight' \(shape \(128, 64\)\)"
    ):
        load_pretrained(tmp_path)
    _rewrite_weights(
        tmp_path, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(100, 64)})
    )
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors': tensor 'model.layers.1.mlp.up_proj.weight' has shape \(100, 64\)",
    ):
        load_pretrained(tmp_path)
    # weights saved by transformers < 4.31 carry the RoPE buffer: ignored, as transformers does
    _rewrite_weights(
        tmp_path,
        lambda t: t.update(
            {
                "model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64),
                "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
            }
        ),
    )
    load_pretrained(tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"model_type": "dbrx"}, "model_type is 'dbrx'"),
        ({"attention_bias": True}, "attention_bias is true"),
        ({"mlp_bias": True}, "mlp_bias is true"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"head_dim": 0}, "head_dim is 0"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            r"rope_parameters.rope_type is 'yarn'",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling.rope_type is 'linear'"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
            r"rope_parameters.factor is missing",
        ),
        ({"hidden_size": None}, "hidden_size is missing"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config is set"),
    ],
)
def test_bad_config_json_names_the_key(tmp_path, edit, message):
    hf_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config.json': .*{message}"):
        load_pretrained(tmp_path)


def test_export_refuses_a_non_empty_directory_and_leaves_it_alone(tmp_path):
    model = _memfit_model("tiny")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=rf"'{out}' exists and is not empty"):
        export_hf(model, out)
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export_checkpoint(tmp_path / "does-not-matter", out)  # checked before the source is read
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_hf(model, empty)  # an empty directory is fine
    assert (empty / "config.json").is_file()
    with pytest.raises(CheckpointError, match="is a file"):
        export_hf(model, out / "keep.txt")


def test_export_refuses_meta_and_lora_models(tmp_path):
    with pytest.raises(CheckpointError, match="meta device"):
        export_hf(build_decoder(model_config("tiny"), device="meta"), tmp_path / "a")
    model = _memfit_model("tiny")
    model.model.layers[0].self_attn.q_proj.register_parameter(
        "lora_a", torch.nn.Parameter(torch.zeros(2, 64))
    )
    with pytest.raises(CheckpointError, match="merge LoRA"):
        export_hf(model, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_meta_errors_name_the_file(tmp_path):
    hf = hf_model(**LLAMA2_KW)
    directory = write_meta(hf, tmp_path / "m", 2, llama3=False)
    params = json.loads((directory / "params.json").read_text())
    (directory / "params.json").write_text(json.dumps({**params, "multiple_of": 256}))
    with pytest.raises(CheckpointError, match=r"params.json': multiple_of 256 .* 192 rows"):
        read_meta_params(directory)
    (directory / "params.json").write_text(json.dumps({**params, "vocab_size": 32000}))
    with pytest.raises(
        CheckpointError, match=r"params.json': vocab_size is 32000 but tok_embeddings.weight holds 2000"
    ):
        read_meta_params(directory)
    (directory / "params.json").write_text(json.dumps(params))
    shard = directory / "consolidated.01.pth"
    shard.write_bytes(shard.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"consolidated.01.pth' cannot be read as a PyTorch checkpoint"):
        load_pretrained(directory)
    (directory / "consolidated.00.pth").unlink()
    with pytest.raises(CheckpointError, match=r"lacks '.*consolidated.00.pth'"):
        load_pretrained(directory)


def test_read_config_reads_no_weights(tmp_path):
    hf_model().to(torch.bfloat16).save_pretrained(tmp_path)
    config, info = read_config(tmp_path)
    assert isinstance(info, PretrainedInfo) and info.stored_dtype == torch.bfloat16
    meta_model = build_decoder(config, device="meta")  # what an estimate builds
    assert sum(p.numel() for p in meta_model.parameters()) == config.num_params()
    assert math.isclose(config.norm_eps, 1e-5)
