"""MFU: the model FLOPs per token against torch's FLOP counter, and the ``mfu`` field of the step record."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memfit import flops
from memfit.cli import main
from memfit.metrics import read_records
from memfit.models.llama import build_llama
from memfit.models.presets import model_config
from tests.conftest import tiny_run_overrides


@pytest.mark.parametrize("num_kv_heads", [2, 4])
def test_matmul_flops_equal_torch_s_count_of_a_training_step(num_kv_heads):
    cfg = dataclasses.replace(model_config("tiny"), num_kv_heads=num_kv_heads)
    batch, seq_len = 2, 32
    model = build_llama(cfg, seed=0)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (batch, seq_len))).float().sum().backward()
    counted = counter.get_flop_counts()["Global"]
    assert set(counted) == {torch.ops.aten.mm}  # CPU attention is one fused op the counter does not count
    # by hand: tiny is dim 64, 2 layers, 4 heads of 16, SwiGLU 128, vocab 256
    hd = 64 // 4
    weights = (
        2 * (64 * 64 + 64 * num_kv_heads * hd + 64 * num_kv_heads * hd + 64 * 64 + 3 * 64 * 128) + 64 * 256
    )
    attention = (
        6 * 2 * seq_len * 64
    )  # causal half of scores and weighted values, forward + backward, per token
    per_token = flops.training_flops_per_token(cfg, seq_len)
    assert per_token == 6 * weights + attention
    assert counted[torch.ops.aten.mm] == batch * seq_len * (per_token - attention)


def test_a_frozen_base_costs_two_forwards():
    cfg = model_config("tiny")
    assert (
        flops.training_flops_per_token(cfg, 32, full=False) * 3 == flops.training_flops_per_token(cfg, 32) * 2
    )


def test_peak_flops_configured_table_and_cpu_probe(monkeypatch):
    cpu = torch.device("cpu")
    assert flops.peak_flops_per_second(cpu, "fp32", configured=5e9) == 5e9
    flops._CPU_PROBE.clear()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    probe = flops.peak_flops_per_second(cpu, "fp32")
    assert probe == flops.cpu_matmul_flops_per_second("fp32") and probe > 1e8  # measured once per process
    # the probe draws from its own generator: dropout masks (and a resumed run's restored state) are untouched
    assert torch.equal(torch.get_rng_state(), state)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert flops.peak_flops_per_second(cuda, "bf16_mixed") == 989e12
    assert flops.peak_flops_per_second(cuda, "fp32") == 67e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    assert flops.peak_flops_per_second(cuda, "bf16") == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert flops.peak_flops_per_second(cuda, "bf16") is None


def test_every_step_record_has_its_mfu(small_corpus, tmp_path):
    out = tmp_path / "run"
    over = {
        "peak_flops": 1e11,
        "max_steps": 4,
        "eval_every": 0,
        "checkpoint_every": 0,
        "sample.max_new_tokens": 0,
    }
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **over)]) == 0
    per_token = flops.training_flops_per_token(model_config("tiny"), 32)  # the char run pads vocab to 256
    records = [r for r in read_records(out / "metrics.jsonl") if "loss" in r]
    assert len(records) == 4
    for r in records:
        assert r["mfu"] == r["tokens_per_second_per_gpu"] * per_token / 1e11 and 0 < r["mfu"] < 1
