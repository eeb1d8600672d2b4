"""MFU: the model FLOPs per token against torch's FLOP counter, and the ``mfu`` field of the step record."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memfit import flops
from memfit.cli import main
from memfit.metrics import read_records
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from tests.conftest import tiny_run_overrides


@pytest.mark.parametrize("num_kv_heads", [2, 4])
def test_matmul_flops_equal_torch_s_count_of_a_training_step(num_kv_heads):
    cfg = dataclasses.replace(model_config("tiny"), num_kv_heads=num_kv_heads)
    batch, seq_len = 2, 32
    model = build_decoder(cfg, seed=0)
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


# ----------------------------------------------------------------------------------------------------------------
# The CPU ceiling: the best probe on this machine; an mfu above 1 comes with a warning that says why


def test_the_cpu_ceiling_is_the_best_probe_this_machine_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(flops, "_CPU_PROBE", {})
    assert flops.cache_path() == tmp_path / "cache" / "memfit" / "cpu_matmul_flops.json"

    timed = []  # the timed matmuls of each probe

    def probe(rate):  # a fresh process (nothing measured yet) whose probe reads `rate`
        def measure(kind, repeats):
            timed.append(repeats)
            return rate

        flops._CPU_PROBE.clear()
        monkeypatch.setattr(flops, "measure_cpu_matmul", measure)
        return flops.cpu_matmul_flops_per_second("fp32")

    assert probe(5e9) == 5e9  # the first measurement is cached
    (key,) = json.loads(flops.cache_path().read_text())
    assert f"| {torch.get_num_threads()} threads | fp32 | torch {torch.__version__}" in key
    assert probe(1e9) == 5e9  # measured under load: the quiet moment's figure stands
    assert timed == [5, 1]  # a machine with a figure probes once (5 timed matmuls the first time)
    assert probe(8e9) == 8e9 and json.loads(flops.cache_path().read_text()) == {key: 8e9}
    assert flops.peak_flops_per_second(torch.device("cpu"), "fp32", configured=3e9) == 3e9  # the setting wins
    flops.cache_path().write_text("not JSON")  # a damaged cache is measured afresh and rewritten
    assert probe(2e9) == 2e9 and json.loads(flops.cache_path().read_text()) == {key: 2e9}
    monkeypatch.setenv("XDG_CACHE_HOME", str(flops.cache_path()))  # a file: no cache can be made under it
    assert probe(1e9) == 1e9  # never an error
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # unset or empty: ~/.cache
    assert flops.cache_path() == Path.home() / ".cache" / "memfit" / "cpu_matmul_flops.json"


def test_an_mfu_above_one_is_logged_with_a_warning_that_says_why(small_corpus, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(flops, "_CPU_PROBE", {})
    monkeypatch.setattr(
        flops, "measure_cpu_matmul", lambda kind, repeats: 1e3
    )  # a probe that read far too low
    out = tmp_path / "run"
    over = {"max_steps": 3, "eval_every": 0, "checkpoint_every": 0, "sample.max_new_tokens": 0}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **over)]) == 0
    per_token = flops.training_flops_per_token(model_config("tiny"), 32)
    records = [r for r in read_records(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # logged as measured, not clamped
        assert r["mfu"] == r["tokens_per_second_per_gpu"] * per_token / 1e3 and r["mfu"] > 1
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: mfu")]
    first = records[0]
    assert warnings == [  # once, at the first such record
        f"warning: mfu {first['mfu']:.2f} at step 1 is above 1: the step did "
        f"{first['tokens_per_second_per_gpu'] * per_token:.3g} model FLOP/s, the ceiling is 1e+03 FLOP/s; the "
        f"ceiling is the best CPU matmul probe on this machine (this run's, at its start, or one cached in "
        f"'{cache / 'memfit' / 'cpu_matmul_flops.json'}'), which read low: other work shared the cores when it ran, "
        f"or the run's matmuls are faster than the probe's; set peak_flops to the CPU's peak FLOP/s for a fixed "
        f"ceiling"
    ]


def test_the_warning_names_the_ceiling_s_source(monkeypatch):
    line = flops.mfu_above_one(1.5, 10, 3e9, 2e9, torch.device("cpu"), configured=2e9)
    assert line == (
        "warning: mfu 1.50 at step 10 is above 1: the step did 3e+09 model FLOP/s, the ceiling is 2e+09 FLOP/s; "
        "the peak_flops setting (2e+09 FLOP/s) is below what this device does; raise it"
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    line = flops.mfu_above_one(1.2, 5, 1.45e14, 1.21e14, torch.device("cuda"), configured=0.0)
    assert line.endswith(
        "the ceiling is 1.21e+14 FLOP/s; the data-sheet peak of 'NVIDIA L4' (memfit.flops.CUDA_PEAK_FLOPS) is "
        "below what it does; set peak_flops to the device's peak FLOP/s"
    )
