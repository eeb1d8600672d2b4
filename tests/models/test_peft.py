"""LoRA and LLaMA-Adapter applied from outside: zero-init equality, only the new parameters train, merge, PEFT
export reproduced with transformers, the adapter against a hand-written reference (GQA, packed rows), activation
checkpointing, fake tensors, optimizer and memory accounting, state dicts and errors.

The tiny preset (vocab 256, dim 64, 2 layers, 4 query / 2 kv heads of 16, SwiGLU 128) has 106,816 parameters.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memfit.config import OptimizerConfig
from memfit.convert.peft_adapter import PEFT_CONFIG, PEFT_WEIGHTS, load_peft_adapter, save_peft_adapter
from memfit.memory.optim import build_optimizer
from memfit.memory.techniques import apply_activation_checkpointing, apply_compile, chunked_cross_entropy
from memfit.memory.tracker import MemoryTracker
from memfit.models.adapter import adapter_state_dict, apply_adapter, load_adapter_state_dict
from memfit.models.decoder import build_decoder
from memfit.models.peft import (
    LORA_TARGETS,
    apply_lora,
    freeze_base,
    load_lora_state_dict,
    lora_effective_weight,
    lora_state_dict,
    merge_lora,
    peft_method,
    trainable_parameter_summary,
)
from memfit.models.presets import model_config
from memfit.step import micro_batch_loss, train_step

CFG = model_config("tiny")
P = 106_816
B, T = 2, 16
# LoRA r=8 on q_proj (64 -> 64) and v_proj (64 -> 32) in 2 layers: A (8, 64) + B (64, 8), A (8, 64) + B (32, 8)
LORA_QV_PARAMS = 2 * ((8 * 64 + 64 * 8) + (8 * 64 + 32 * 8))
# adapter, L=10 in 2 layers: prompt (10, 64) + gate (1, 4, 1, 1)
ADAPTER_PARAMS = 2 * (10 * 64 + 4)


pytestmark = pytest.mark.usefixtures("one_thread")


def batch(seed: int = 0, b: int = B, t: int = T, vocab: int = CFG.vocab_size):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, t), generator=generator)
    return x, torch.randint(0, vocab, (b, t), generator=generator)


def randomize(model, suffixes: tuple[str, ...], std: float = 0.1, seed: int = 5) -> None:
    """Move zero-initialised PEFT parameters (lora_B, adapter_gate) away from zero, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffixes):
                p.copy_(torch.randn(p.shape, generator=generator) * std)


def with_method(method: str, config=CFG, **kwargs):
    model = build_decoder(config, seed=0)
    names = (apply_lora if method == "lora" else apply_adapter)(model, seed=1, **kwargs)
    return model, names


def sgd(model, lr: float = 0.5):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)


# ---------------------------------------------------------------------------------------------------- LoRA


def test_lora_starts_as_the_base_model_with_only_the_new_parameters_trainable():
    model = build_decoder(CFG, seed=0)
    x, _ = batch()
    base_keys = list(model.state_dict())
    with torch.no_grad():
        expected = model(x)
    names = apply_lora(model, target_modules=LORA_TARGETS)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert len(names) == 2 * (7 * CFG.num_layers + 1)
    assert names[:2] == ["model.layers.0.self_attn.q_proj.lora_A", "model.layers.0.self_attn.q_proj.lora_B"]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(names)
    # base weights keep their (Hugging Face) names; the LoRA tensors sit beside them
    assert [k for k in model.state_dict() if "lora" not in k] == base_keys
    k_proj = model.model.layers[1].self_attn.k_proj
    assert k_proj.lora_A.shape == (8, 64) and k_proj.lora_B.shape == (32, 8)
    assert torch.count_nonzero(k_proj.lora_B) == 0 and k_proj.lora_A.abs().max() <= 1 / math.sqrt(64)
    assert peft_method(model) == "lora"
    # same dtype and device as the base weight
    bf16 = build_decoder(CFG, dtype=torch.bfloat16, seed=0)
    apply_lora(bf16)
    assert bf16.model.layers[0].self_attn.q_proj.lora_A.dtype == torch.bfloat16
    meta = build_decoder(CFG, device="meta")
    apply_lora(meta)
    assert meta.model.layers[0].self_attn.v_proj.lora_B.device.type == "meta"


def test_lora_counts_by_hand():
    model, names = with_method("lora")
    summary = trainable_parameter_summary(model)
    assert summary == {
        "trainable_params": LORA_QV_PARAMS,
        "total_params": P + LORA_QV_PARAMS,
        "trainable_bytes": 4 * LORA_QV_PARAMS,
        "total_bytes": 4 * (P + LORA_QV_PARAMS),
        "trainable_fraction": LORA_QV_PARAMS / (P + LORA_QV_PARAMS),
    }
    assert len(names) == 8


def test_lora_sgd_steps_change_only_lora_parameters():
    model, names = with_method(
        "lora", dropout=0.1, target_modules=("q_proj", "v_proj", "down_proj", "lm_head")
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = sgd(model)
    losses = []
    for step in range(4):
        result = train_step(model, optimizer, [batch(step)], max_grad_norm=1.0, dtype="fp32")
        losses.append(result.loss.item())
    for n, p in model.named_parameters():
        if n in names:
            assert not torch.equal(p, before[n]), n  # B moves at step 0, A from step 1 on
        else:
            assert torch.equal(p, before[n]), n  # frozen: bit-identical
            assert p.grad is None
    assert all(math.isfinite(v) for v in losses)


def test_merge_reproduces_the_lora_model_and_restores_the_plain_module():
    model, _ = with_method("lora", rank=4, alpha=8.0, target_modules=LORA_TARGETS)
    randomize(model, ("lora_B",))
    model.eval()
    x, _ = batch()
    with torch.no_grad():
        expected = model(x)
        assert (expected - build_decoder(CFG, seed=0)(x)).abs().max() > 1e-2  # the update matters
        q_proj = model.model.layers[0].self_attn.q_proj
        effective = lora_effective_weight(q_proj).clone()
    merge_lora(model)
    with torch.no_grad():
        merged = model(x)
    assert (merged - expected).abs().max().item() <= 1e-5
    assert torch.allclose(q_proj.weight, effective, atol=1e-6, rtol=0)
    assert lora_effective_weight(q_proj) is q_proj.weight
    assert list(model.state_dict()) == list(build_decoder(CFG).state_dict())
    assert "forward" not in vars(q_proj) and peft_method(model) is None
    with pytest.raises(ValueError, match="no LoRA"):
        merge_lora(model)


def test_merge_in_bf16_is_done_in_fp32():
    model = build_decoder(CFG, dtype=torch.bfloat16, seed=0)
    apply_lora(model, seed=1)
    randomize(model, ("lora_B",))
    q_proj = model.model.layers[0].self_attn.q_proj
    expected = (q_proj.weight.float() + 2.0 * q_proj.lora_B.float() @ q_proj.lora_A.float()).to(
        torch.bfloat16
    )
    merge_lora(model)
    assert q_proj.weight.dtype == torch.bfloat16 and torch.equal(q_proj.weight, expected)


def _hf_llama(config):
    """An untrained transformers Llama of the same architecture (config written by memfit's exporter)."""
    transformers = pytest.importorskip("transformers")
    from memfit.convert.hf import decoder_to_hf_config

    hf_config = transformers.LlamaConfig(**decoder_to_hf_config(config), attn_implementation="eager")
    return transformers.LlamaForCausalLM(hf_config).eval()


def test_peft_export_files_and_transformers_reproduce_the_lora_logits(tmp_path):
    hf = _hf_llama(CFG)
    model = build_decoder(CFG, seed=0).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.05, target_modules=LORA_TARGETS, seed=1)
    randomize(model, ("lora_B",))
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="memfit/tiny")
    assert sorted(p.name for p in out.iterdir()) == [PEFT_CONFIG, PEFT_WEIGHTS]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind

    config = json.loads((out / PEFT_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.05)
    assert config["target_modules"] == list(LORA_TARGETS)
    assert config["bias"] == "none" and config["fan_in_fan_out"] is False and config["inference_mode"] is True
    assert config["base_model_name_or_path"] == "memfit/tiny"

    tensors = load_file(str(out / PEFT_WEIGHTS))
    assert len(tensors) == 2 * (7 * CFG.num_layers + 1)
    a = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (32, 4)
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (CFG.vocab_size, 4)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, 128)

    # what PEFT does on load, by hand: W += (lora_alpha / r) * B @ A on every target of the transformers model
    scale = config["lora_alpha"] / config["r"]
    with torch.no_grad():
        for key, lora_a in tensors.items():
            if ".lora_A." not in key:
                continue
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            lora_b = tensors[key.replace(".lora_A.", ".lora_B.")]
            hf.get_submodule(module).weight += scale * lora_b @ lora_a
        x, _ = batch()
        expected = model(x)
        reproduced = hf(x).logits
    assert (reproduced - expected).abs().max().item() <= 1e-5
    assert (expected - build_decoder(CFG, seed=0)(x)).abs().max() > 1e-2

    # load_peft_adapter applies and loads; saving again replaces the directory
    fresh = build_decoder(CFG, seed=0).eval()
    assert load_peft_adapter(fresh, out) == list(lora_state_dict(model))
    with torch.no_grad():
        assert torch.equal(fresh(x), expected)
    assert save_peft_adapter(fresh, out) == out
    assert json.loads((out / PEFT_CONFIG).read_text())["base_model_name_or_path"] == ""
    config["use_dora"] = True
    (out / PEFT_CONFIG).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="use_dora"):
        load_peft_adapter(build_decoder(CFG), out)


def test_lora_errors():
    model = build_decoder(CFG, seed=0)
    with pytest.raises(ValueError, match=r"'qkv'.*q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj"):
        apply_lora(model, target_modules=("q_proj", "qkv"))
    for bad in ({"rank": 0}, {"alpha": 0.0}, {"dropout": 1.0}, {"target_modules": ()}):
        with pytest.raises(ValueError):
            apply_lora(model, **bad)
    assert peft_method(model) is None and all(p.requires_grad for p in model.parameters())
    apply_lora(model)
    with pytest.raises(ValueError, match="already has lora"):
        apply_lora(model)
    with pytest.raises(ValueError, match="already has lora"):
        apply_adapter(model)
    tied = build_decoder(model_config("tiny-tied"), seed=0)
    with pytest.raises(ValueError, match="tied"):
        apply_lora(tied, target_modules=("q_proj", "lm_head"))
    apply_lora(tied, target_modules=("q_proj", "up_proj"))  # the rest of a tied model is fine
    assert not tied.model.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="not parameters"):
        freeze_base(tied, ["lm_head.lora_A"])
    with pytest.raises(ValueError, match="no LoRA"):
        lora_state_dict(build_decoder(CFG))
    with pytest.raises(ValueError, match="no LoRA"):
        save_peft_adapter(build_decoder(CFG), "unused")


def test_lora_state_dict_round_trip_and_strictness():
    model, names = with_method("lora")
    randomize(model, ("lora_B",))
    sd = {k: v.clone() for k, v in lora_state_dict(model).items()}
    assert list(sd) == names and sd["model.layers.1.self_attn.v_proj.lora_B"].shape == (32, 8)
    other, _ = with_method("lora")
    load_lora_state_dict(other, sd)
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.q_proj.lora_A'\]"):
        load_lora_state_dict(other, {k: v for k, v in sd.items() if k != names[0]})
    with pytest.raises(ValueError, match="unexpected"):
        load_lora_state_dict(other, {**sd, "model.layers.0.mlp.up_proj.lora_A": sd[names[0]]})
    with pytest.raises(ValueError, match=r"has shape \(4, 64\), the model expects \(8, 64\)"):
        load_lora_state_dict(other, {**sd, names[0]: sd[names[0]][:4]})
    with pytest.raises(ValueError, match="no LoRA"):
        load_lora_state_dict(build_decoder(CFG), sd)


# ---------------------------------------------------------------------------------------------------- LLaMA-Adapter


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_adapter_starts_as_the_base_model(name):
    config = model_config(name)
    model = build_decoder(config, seed=0)
    x, _ = batch()
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    with torch.no_grad():
        expected, expected_packed = model(x), model(x, doc_ids)
    names = apply_adapter(model)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x, doc_ids), expected_packed)
    assert names == [
        f"model.layers.{i}.self_attn.adapter_{what}" for i in range(2) for what in ("prompt", "gate")
    ]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(names)
    attn = model.model.layers[0].self_attn
    assert attn.adapter_prompt.shape == (10, 64) and attn.adapter_gate.shape == (1, config.num_heads, 1, 1)
    assert trainable_parameter_summary(model)["trainable_params"] == ADAPTER_PARAMS
    assert peft_method(model) == "adapter"


def _reference_attention(attn, x, cos, sin):
    """LLaMA-Adapter attention written out: explicit softmaxes, kv heads repeated, no SDPA."""
    B_, T_, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.project_qkv(x, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)  # (B, nh, T, hd)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, nh, T, T)
    causal = torch.ones(T_, T_, dtype=torch.bool).tril()
    y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    L = attn.adapter_prompt.shape[0]
    pk = attn.k_proj(attn.adapter_prompt).view(L, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    pv = attn.v_proj(attn.adapter_prompt).view(L, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
    prompt_y = (q @ pk.transpose(-1, -2) / math.sqrt(hd)).softmax(-1) @ pv  # (B, nh, T, hd)
    y = y + attn.adapter_gate * prompt_y
    return attn.o_proj(y.transpose(1, 2).reshape(B_, T_, nh * hd))


@pytest.mark.parametrize("name", ["tiny", "tiny-mha"])
def test_adapter_attention_matches_a_reference_with_grouped_query_heads(name):
    config = model_config(name)
    model, _ = with_method("adapter", config, prompt_length=6)
    # weights far from the small init, so attention is far from uniform and the prompt's part is large
    randomize(model, ("adapter_gate", "adapter_prompt", "proj.weight"), std=0.3)
    attn = model.model.layers[1].self_attn
    x = torch.randn(B, T, config.dim, generator=torch.Generator().manual_seed(2))
    cos, sin = model.model.rotary_emb(T, x.dtype)
    with torch.no_grad():
        got, expected = attn(x, cos, sin), _reference_attention(attn, x, cos, sin)
        attn.adapter_gate.zero_()
        without = attn(x, cos, sin)
    assert (got - expected).abs().max().item() <= 1e-5
    assert (got - without).abs().max().item() > 0.1  # the prompt contributes


def test_adapter_packed_rows_compute_what_their_samples_compute_alone():
    model, _ = with_method("adapter", prompt_length=4)
    randomize(model, ("adapter_gate", "adapter_prompt", "proj.weight"), std=0.3)
    x, _ = batch(3, b=1)
    doc_ids = torch.tensor([[0] * 6 + [1] * 10])
    with torch.no_grad():
        packed = model(x, doc_ids)
        alone = torch.cat([model(x[:, :6]), model(x[:, 6:])], dim=1)
        for layer in model.model.layers:
            layer.self_attn.adapter_gate.zero_()
        without = model(x, doc_ids)
    # every query of every sample sees the whole prompt, whatever the mask
    assert (packed - alone).abs().max().item() <= 1e-5
    assert (packed - without).abs().max().item() > 0.01


def test_adapter_gradients_reach_the_gate_then_the_prompt():
    model, names = with_method("adapter", num_layers=1)
    assert names == ["model.layers.1.self_attn.adapter_prompt", "model.layers.1.self_attn.adapter_gate"]
    attn = model.model.layers[1].self_attn
    assert "adapter_prompt" not in dict(model.model.layers[0].self_attn.named_parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    # zero gate: the gate gets a gradient, the prompt's is exactly zero
    assert attn.adapter_gate.grad.abs().min() > 0
    assert torch.count_nonzero(attn.adapter_prompt.grad) == 0
    optimizer = sgd(model)
    optimizer.step()
    optimizer.zero_grad()
    # once the gate has moved, the prompt learns too
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    assert attn.adapter_prompt.grad.abs().max() > 0
    optimizer.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n not in names), n


def test_adapter_state_dict_round_trip_and_errors():
    model, names = with_method("adapter", prompt_length=3)
    randomize(model, ("adapter_gate",))
    sd = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    assert list(sd) == names
    other, _ = with_method("adapter", prompt_length=3)
    load_adapter_state_dict(other, sd)
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    with pytest.raises(ValueError, match="missing"):
        load_adapter_state_dict(other, {k: v for k, v in sd.items() if k != names[-1]})
    with pytest.raises(ValueError, match="expects"):
        load_adapter_state_dict(with_method("adapter", prompt_length=4)[0], sd)
    with pytest.raises(ValueError, match="no LLaMA-Adapter"):
        load_adapter_state_dict(with_method("lora")[0], sd)
    for bad in ({"prompt_length": 0}, {"num_layers": 0}, {"num_layers": 3}):
        with pytest.raises(ValueError, match="prompt_length|1..2"):
            apply_adapter(build_decoder(CFG), **bad)
    with pytest.raises(ValueError, match="already has adapter"):
        apply_adapter(model)
    with pytest.raises(ValueError, match="already has adapter"):
        apply_lora(model)


# ---------------------------------------------------------------------------------------------------- both methods


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_activation_checkpointing_composes(method):
    results = []
    for checkpointed in (False, True):
        model, names = with_method(method)
        randomize(model, ("lora_B", "adapter_gate"))
        if checkpointed:
            apply_activation_checkpointing(model, "full")
        x, y = batch()
        loss = F.cross_entropy(model(x, torch.tensor([[0] * 9 + [1] * 7] * B)).flatten(0, 1), y.flatten())
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert set(grads) == set(names)
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert (loss_a - loss_b).abs().item() <= 1e-6
    for n in grads_a:
        assert torch.allclose(grads_a[n], grads_b[n], atol=1e-6, rtol=1e-5), n


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_training_step_runs_on_meta_and_under_fake_tensors(method):
    meta = build_decoder(CFG, device="meta")
    (apply_lora if method == "lora" else apply_adapter)(meta)
    x = torch.zeros(B, T, dtype=torch.int64, device="meta")
    meta(x).sum().backward()
    assert all((p.grad is not None) == p.requires_grad for p in meta.parameters())
    with FakeTensorMode():
        model = build_decoder(CFG)
        (apply_lora if method == "lora" else apply_adapter)(model, seed=0)
        optimizer = build_optimizer(model, OptimizerConfig())
        x, y = torch.randint(0, CFG.vocab_size, (B, T)), torch.randint(0, CFG.vocab_size, (B, T))
        result = train_step(model, optimizer, [(x, y)], max_grad_norm=1.0, dtype="fp32")
        assert isinstance(result.loss, FakeTensor)
        assert isinstance(next(p for p in model.parameters() if p.requires_grad), FakeTensor)
        assert len(optimizer.state) == sum(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_gradients_and_optimizer_state_only_for_the_new_parameters(method):
    model, names = with_method(method)
    trainable = LORA_QV_PARAMS if method == "lora" else ADAPTER_PARAMS
    optimizer = build_optimizer(model, OptimizerConfig())
    assert sorted(n for g in optimizer.param_groups for n in g["param_names"]) == sorted(names)
    with MemoryTracker(model, optimizer) as tracker:
        train_step(model, optimizer, [batch()], max_grad_norm=1.0, dtype="fp32", tracker=tracker)
    assert max(b["gradients"] for _, _, b in tracker.timeline) == 4 * trainable
    # AdamW: exp_avg and exp_avg_sq in fp32, and one fp32 `step` counter per trainable tensor
    assert tracker.current_breakdown()["optimizer_state"] == 8 * trainable + 4 * len(names)
    assert tracker.current_breakdown()["parameters"] == 4 * (P + trainable) + 4 * (CFG.head_dim // 2)


@pytest.mark.parametrize("method", ["lora", "adapter"])
@pytest.mark.parametrize("dtype", ["bf16", "bf16_mixed"])
def test_dtype_policies_keep_zero_init_and_train(method, dtype):
    param_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = build_decoder(CFG, dtype=param_dtype, seed=0)
    x, y = batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16_mixed"):
        expected = model(x)
    names = (apply_lora if method == "lora" else apply_adapter)(model, seed=1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16_mixed"):
        assert torch.equal(model(x), expected)
    optimizer = sgd(model)
    for _ in range(2):
        result = train_step(model, optimizer, [(x, y)], max_grad_norm=1.0, dtype=dtype)
    assert math.isfinite(result.loss.item())
    assert all(dict(model.named_parameters())[n].dtype == param_dtype for n in names)


def test_lora_effective_weight_gives_chunked_cross_entropy_the_adapted_lm_head():
    model, _ = with_method("lora", target_modules=("q_proj", "lm_head"))
    randomize(model, ("lora_B",))
    x, y = batch()
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
    chunked = chunked_cross_entropy(model.model(x), lora_effective_weight(model.lm_head), y, 3)
    assert (plain - chunked).abs().item() <= 1e-4
    grads = torch.autograd.grad(chunked, [model.lm_head.lora_A, model.lm_head.lora_B])
    expected = torch.autograd.grad(plain, [model.lm_head.lora_A, model.lm_head.lora_B])
    for got, want in zip(grads, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "adapter"])
def test_compiled_layers_train_lora_and_adapter_as_eager_ones(method):
    """compile: the adapted layers compile with their added weights; loss and trained-weight gradients as eager."""
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for compile_ in (False, True):
        model = build_decoder(model_config("tiny"), seed=0)
        if method == "lora":
            apply_lora(model, target_modules=("q_proj", "v_proj", "down_proj"), seed=1)
            for (
                name,
                p,
            ) in model.named_parameters():  # lora_B starts at zero: give it a gradient path of its own
                if name.endswith("lora_B"):
                    torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(2))
        else:
            apply_adapter(model, prompt_length=4, seed=1)
        apply_activation_checkpointing(model, "selective")
        if compile_:
            apply_compile(model)
        loss = micro_batch_loss(model, x, x.roll(-1, 1), dtype="fp32", compile=compile_)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert abs(compiled - eager) <= 1e-6 * abs(eager)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
