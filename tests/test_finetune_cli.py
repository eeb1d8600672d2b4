"""Fine-tuning end to end through the CLI: a small pretrained checkpoint, the real Dolly sample, every method.

The base is a tiny Llama pretrained here on Shakespeare and exported to Hugging Face form; fine-tuning moves it to
the Dolly records' format and words. Exact numbers asserted: resume equals an uninterrupted run, frozen weights
stay bit-identical, exported directories load in transformers with equal logits.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from tests.conftest import DOLLY, finetune_overrides

transformers = pytest.importorskip("transformers")


def test_the_base_checkpoint_is_a_transformers_model(hf_checkpoint):
    model = transformers.LlamaForCausalLM.from_pretrained(hf_checkpoint)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    tok = transformers.AutoTokenizer.from_pretrained(hf_checkpoint)
    assert tok.encode("ROMEO:", add_special_tokens=False)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


LR = {"full": 3e-3, "lora": 1e-2, "qlora": 1e-2, "adapter": 5e-2}
# How far the full-batch loss falls in 12 steps, at least. Every step sees the same 10 samples, so the curve is
# deterministic (no sampling noise) and any fall is learning. LLaMA-Adapter starts exactly at the base model
# (zero gates) and moves it slowly: ~0.015 nats here, measured; LoRA ~0.3, full ~0.8.
MIN_FALL = {"full": 0.5, "lora": 0.2, "qlora": 0.2, "adapter": 0.008}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hf_checkpoint) -> dict[str, Path]:
    """One 12-step fine-tuning run per method (shared by the tests below)."""
    root = tmp_path_factory.mktemp("finetune")
    out = {}
    for method in ("full", "lora", "qlora", "adapter"):
        extra = {"method": method, "optimizer.lr": LR[method], "optimizer.min_lr": LR[method] / 10}
        if method in ("lora", "qlora"):
            extra["lora.target_modules"] = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
            extra["lora.dropout"] = 0.0
        assert main(["finetune", *finetune_overrides(hf_checkpoint, root / method, **extra)]) == 0
        out[method] = root / method
    return out


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "adapter"])
def test_loss_falls_and_checkpoint_holds_what_trains(runs, method):
    out = runs[method]
    curve = losses(out)
    assert len(curve) == 12
    assert curve[-1] < curve[0] - MIN_FALL[method], curve
    assert all(b <= a + 1e-3 for a, b in zip(curve[2:], curve[3:], strict=False)), (
        curve
    )  # after warm-up it only falls
    assert any("val_loss" in r for r in read_metrics(out))
    ckpt = out / "checkpoints" / "step_00000012"
    if method == "full":
        assert (ckpt / "model.safetensors").is_file() and not (ckpt / "adapter.safetensors").exists()
    else:  # only the trained weights are saved; the base stays in checkpoint_dir
        assert (ckpt / "adapter.safetensors").is_file() and not (ckpt / "model.safetensors").exists()


@pytest.mark.parametrize("method", ["lora", "qlora", "adapter"])
def test_frozen_base_is_unchanged(runs, hf_checkpoint, method):
    from safetensors.torch import load_file

    from memfit.build import load_for_generation
    from memfit.models.nf4 import is_nf4, to_nf4

    model, _, _ = load_for_generation(runs[method])
    base = load_file(str(hf_checkpoint / "model.safetensors"))
    params = dict(model.named_parameters())
    for name, tensor in base.items():
        if is_nf4(params[name]):  # QLoRA: the base's NF4 codes and scales, as quantizing it gives them
            assert method == "qlora" and ".layers." in name
            expected = to_nf4(tensor)
            for inner in expected.__tensor_flatten__()[0]:
                assert torch.equal(getattr(params[name], inner), getattr(expected, inner)), (name, inner)
        else:
            torch.testing.assert_close(params[name].detach(), tensor, rtol=0, atol=0)
    trained = {n for n, p in params.items() if n not in base}
    assert trained and all(("lora_" in n) or ("adapter_" in n) for n in trained)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_generate_applies_the_run_template(runs, capsys, method):
    from memfit.build import load_for_generation
    from memfit.data.templates import encode_prompt, stop_token_ids
    from memfit.generate import generate

    out = runs[method]
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(out), "--prompt", "What is a llama?", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "12", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["template"] == "alpaca"
    # the same greedy reply, computed by hand from the alpaca rendering of one user turn
    model, tokenizer, template = load_for_generation(out)
    prompt = encode_prompt([{"role": "user", "content": "What is a llama?"}], "alpaca", tokenizer)
    assert tokenizer.decode(prompt).endswith("### Instruction:\nWhat is a llama?\n\n### Response:\n")
    ids = generate(
        model,
        torch.tensor([prompt]),
        max_new_tokens=12,
        temperature=0,
        eos_id=stop_token_ids(template, tokenizer),
    )
    specials = set(tokenizer.special_tokens.values())
    expected = tokenizer.decode([i for i in ids[0, len(prompt) :].tolist() if i not in specials])
    assert shown["text"] == expected
    assert main([*args, "--max-new-tokens", "12", "--json", "--template", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["template"] is None and plain["text"].startswith("What is a llama?")


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_export_loads_in_transformers_with_equal_logits(runs, tmp_path, method):
    from memfit.build import load_for_generation

    hf_dir = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(runs[method]), "--out", str(hf_dir)]) == 0
    model, tokenizer, _ = load_for_generation(runs[method])
    ids = torch.tensor([tokenizer.encode("Instruction: tell me about Virgin Australia.", bos=True)])
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    assert diff <= 1e-5
    # and it fine-tunes again from the exported directory
    assert (hf_dir / "tokenizer.json").is_file() or (hf_dir / "tokenizer.model").is_file()


def test_export_adapter_only_and_adapter_method(runs, tmp_path, capsys):
    assert (
        main(["export", "--checkpoint", str(runs["lora"]), "--out", str(tmp_path / "peft"), "--adapter-only"])
        == 0
    )
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(runs["adapter"]), "--out", str(tmp_path / "x")]) == 1
    assert "adapter" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_resume_equals_uninterrupted_run(runs, tmp_path, hf_checkpoint, method):
    """Drop the final checkpoint of the (Q)LoRA run and resume from step 6: steps 7-12 reproduce exactly."""
    out = tmp_path / method
    shutil.copytree(runs[method], out)
    shutil.rmtree(out / "checkpoints" / "step_00000012")
    reference = read_metrics(runs[method])
    extra = {
        "optimizer.lr": LR[method],
        "optimizer.min_lr": LR[method] / 10,
        "method": method,
        "lora.target_modules": "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        "lora.dropout": 0.0,
        "resume": True,
    }
    assert main(["finetune", *finetune_overrides(hf_checkpoint, out, **extra)]) == 0
    keys = ("step", "loss", "lr", "grad_norm", "val_loss")  # everything but timings and memory peaks
    resumed = [{k: r[k] for k in keys if k in r} for r in read_metrics(out)]
    assert resumed == [{k: r[k] for k in keys if k in r} for r in reference]
    assert len(resumed) == len(reference) > 12


@pytest.mark.parametrize(
    "extra, status, message",
    [
        ({"method": "lora", "checkpoint_dir": None}, 2, "checkpoint_dir"),
        # refused before torchrun starts: the tiny model's k_proj has one group of NF4 scales
        ({"method": "qlora", "nproc": 2}, 2, "does not split evenly over 2 ranks"),
        ({"data.template": "llama3-chat"}, 1, "<|start_header_id|>"),
        ({"data.format": "sharegpt"}, 1, "dolly_sample.json"),
        ({"data.format": "alpaca", "data.packing": True, "seq_len": 0}, 2, "seq_len"),
        ({"method": "adapter", "adapter.num_layers": 5}, 2, "'adapter.num_layers'"),
        ({"seq_len": 2048}, 2, "'seq_len'"),
        ({"data.column_map": "{instructoin: question}"}, 2, "'data.column_map'"),
        ({"data.path": "/nonexistent/records.json"}, 1, "/nonexistent/records.json"),
    ],
)
def test_bad_input_is_reported_before_training(hf_checkpoint, tmp_path, capsys, extra, status, message):
    overrides = finetune_overrides(hf_checkpoint, tmp_path / "out", **extra)
    overrides = [o for o in overrides if not o.endswith("=None")]
    capsys.readouterr()
    assert main(["finetune", *overrides]) == status
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_run_works_from_any_directory_and_notices_a_changed_base(
    runs, hf_checkpoint, tmp_path, monkeypatch, capsys
):
    """The base path is recorded absolute; a base whose weights changed since training is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(hf_checkpoint, base)
    monkeypatch.chdir(tmp_path)
    extra = {
        "method": "lora",
        "max_steps": 2,
        "eval_every": 0,
        "checkpoint_every": 0,
        "checkpoint_dir": "base",
    }
    assert main(["finetune", *finetune_overrides(hf_checkpoint, tmp_path / "run", **extra)]) == 0
    monkeypatch.chdir(runs["lora"])  # elsewhere
    args = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "Hi", "--max-new-tokens", "2"]
    assert main(args) == 0
    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(args) == 1
    assert "is not the one the lora run" in capsys.readouterr().err
    shutil.rmtree(base)
    assert main(args) == 1
    assert "does not exist" in capsys.readouterr().err


def test_resume_refuses_a_different_template(runs, tmp_path, hf_checkpoint, capsys):
    out = tmp_path / "full"
    shutil.copytree(runs["full"], out)
    extra = {"method": "full", "resume": True, "data.template": "chatml", "max_steps": 13}
    capsys.readouterr()
    assert main(["finetune", *finetune_overrides(hf_checkpoint, out, **extra)]) == 2
    assert "'data.template'" in capsys.readouterr().err


def test_no_validation_split(hf_checkpoint, tmp_path, capsys):
    extra = {"data.val_fraction": 0, "max_steps": 2, "eval_every": 1, "checkpoint_every": 0}
    assert main(["finetune", *finetune_overrides(hf_checkpoint, tmp_path / "out", **extra)]) == 0
    assert not any("val_loss" in r for r in read_metrics(tmp_path / "out"))
    assert "no validation samples" in capsys.readouterr().out


def test_qlora_first_loss_is_lora_s_within_the_quantization_noise(runs, hf_checkpoint):
    """QLoRA's step-1 loss against LoRA's on the full-precision base (same data, seed and settings; lora_B = 0, so
    step 1 is the base model). NF4 rounds each weight to within 15% of its block's absmax, errors that are
    independent and zero-mean across weights, so the first-order loss change sum(g * dW) has a standard deviation
    of sqrt(sum((g * dW)^2)); computed here on a Dolly batch with this base's gradients (~0.0025 nats, against a
    worst case sum |g * dW| of ~0.28 when every error lines up). The runs must agree within 4 such deviations."""
    import torch.nn.functional as F

    from memfit.convert import load_pretrained
    from memfit.models.nf4 import is_nf4
    from memfit.models.peft import quantize_for_qlora

    full, tokenizer, _ = load_pretrained(hf_checkpoint)
    quantized = dict(load_pretrained(hf_checkpoint, transform=quantize_for_qlora)[0].named_parameters())
    records = json.loads(DOLLY.read_text())
    text = " ".join(r["instruction"] + " " + r["response"] for r in records[:10])
    ids = torch.tensor([tokenizer.encode(text, bos=True)[:1025]])
    F.cross_entropy(full(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    variance = 0.0
    for name, p in full.named_parameters():
        if is_nf4(quantized[name]):
            variance += (p.grad * (p.detach() - quantized[name].get_original_weight())).square().sum().item()
    sigma = variance**0.5
    diff = abs(losses(runs["qlora"])[0] - losses(runs["lora"])[0])
    print(f"step-1 loss |QLoRA - LoRA| = {diff:.5f} nats; quantization noise sigma {sigma:.5f}")
    assert 0 < diff <= 4 * sigma


def test_qlora_adapter_only_export_is_the_trained_lora(runs, tmp_path):
    from safetensors.torch import load_file

    from memfit.checkpoint import ADAPTER_WEIGHTS
    from memfit.convert.peft_adapter import PEFT_PREFIX

    out = tmp_path / "peft"
    assert main(["export", "--checkpoint", str(runs["qlora"]), "--out", str(out), "--adapter-only"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and len(config["target_modules"]) == 7
    exported = load_file(out / "adapter_model.safetensors")
    trained = load_file(runs["qlora"] / "checkpoints" / "step_00000012" / ADAPTER_WEIGHTS)
    assert len(exported) == len(trained) == 2 * 7 * 2
    for name, tensor in trained.items():  # PEFT's names: base_model.model.<module>.lora_A.weight
        module, which = name.rsplit(".", 1)
        assert torch.equal(exported[f"{PEFT_PREFIX}{module}.{which}.weight"], tensor), name


@pytest.mark.slow
def test_resume_with_dropout_is_exact(hf_checkpoint, tmp_path):
    """LoRA dropout draws from the global generator, whose state a checkpoint restores: a QLoRA run with dropout
    resumed from step 3 gives steps 4-6 of the uninterrupted run exactly (nothing between the restore and the first
    step may draw from it: the CPU matmul probe behind mfu used to)."""
    extra = {
        "method": "qlora",
        "optimizer.lr": LR["qlora"],
        "lora.dropout": 0.05,
        "max_steps": 6,
        "eval_every": 3,
        "checkpoint_every": 3,
        "sample.max_new_tokens": 0,
    }
    from memfit import flops

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    flops._CPU_PROBE.clear()  # each run probes, as a fresh process does
    assert main(["finetune", *finetune_overrides(hf_checkpoint, whole, **extra)]) == 0
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    flops._CPU_PROBE.clear()
    assert main(["finetune", *finetune_overrides(hf_checkpoint, resumed, resume="true", **extra)]) == 0
    keys = ("step", "loss", "lr", "grad_norm", "val_loss")
    records = [[{k: r[k] for k in keys if k in r} for r in read_metrics(out)] for out in (whole, resumed)]
    assert records[0] == records[1] and len(records[0]) >= 6


# Each optimizer that keeps less state in a recipe and with switches it must work with (a few steps each): the loss
# falls and the trainable tensors, only, have their state (tracked as optimizer_state).
LOW_STATE_RECIPES = {
    # Muon's update has RMS 0.2 x lr (adjust_lr_fn match_rms_adamw), AdamW's first ones ~lr: a larger lr for LoRA
    "lora+muon+in_backward": {
        "method": "lora",
        "optimizer.name": "muon",
        "optimizer_in_backward": True,
        "optimizer.lr": 5e-2,
    },
    "qlora+apollo_mini+accumulation": {
        "method": "qlora",
        "optimizer.name": "apollo_mini",
        "gradient_accumulation_steps": 2,
        "batch_size": 5,
    },
    "adapter+adam_mini": {"method": "adapter", "optimizer.name": "adam_mini"},
    "full+adafactor+bf16": {
        "method": "full",
        "optimizer.name": "adafactor",
        "dtype": "bf16",
        "optimizer.lr": 0.05,
    },
    "full+muon+compile+clipping": {
        "method": "full",
        "optimizer.name": "muon",
        "compile": True,
        "max_grad_norm": 0.5,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOW_STATE_RECIPES))
def test_optimizers_that_keep_less_state_in_every_recipe(name, hf_checkpoint, tmp_path):
    extra = dict(LOW_STATE_RECIPES[name])
    method = extra["method"]
    lr = extra.pop("optimizer.lr", LR[method])
    if extra.get("optimizer_in_backward"):
        extra["max_grad_norm"] = 0
    tracked = not extra.get(
        "compile"
    )  # the tracker refuses compile (compiled kernels bypass its dispatch mode)
    settings = {
        **extra,
        "optimizer.lr": lr,
        "optimizer.min_lr": lr / 10,
        "max_steps": 6,
        "eval_every": 0,
        "checkpoint_every": 0,
        "track_memory": tracked,
        "sample.max_new_tokens": 0,
    }
    assert main(["finetune", *finetune_overrides(hf_checkpoint, tmp_path / "run", **settings)]) == 0
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(records) == 6 and all(math.isfinite(x) for x in losses)
    # half the steps of MIN_FALL's runs, and the first of them warm-up: a quarter of its fall, at least
    assert losses[-1] < losses[0] - MIN_FALL[method] / 4, losses
    if tracked:
        state = records[-1]["memory_breakdown"]["optimizer_state"]
        assert state > 0
        if method != "full":  # the trainable tensors' state only: under half a full fine-tune's AdamW state
            # (8 bytes for each of the base's 139,584 parameters: the tiny model with 512 ids)
            assert state * 2**30 < 0.5 * 8 * 139_584
