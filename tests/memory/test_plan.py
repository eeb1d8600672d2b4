"""memfit plan: budgets, the cost model's order, bounds that hold, plans that fit per a real estimate, the YAML."""

from __future__ import annotations

import collections
import dataclasses
import json

import psutil
import pytest
import torch

from memfit.build import run_model_config
from memfit.cli import main, split_budget
from memfit.config import config_to_dict, load_config
from memfit.errors import ConfigError, PreflightError
from memfit.memory import host, hybrids, optimizers, switches
from memfit.memory.switches import layer_weights
from memfit.planner import plan as P
from memfit.planner import report
from memfit.planner.closed_form import model_state_bytes_closed_form
from memfit.planner.cost import COST_CONSTANTS, CostRequest, model_flops_per_token, step_cost
from memfit.planner.estimate import estimate_run
from memfit.planner.preflight import preflight
from memfit.units import GIB, format_bytes, parse_bytes

MIB = 1024**2
TINY = [
    "model=tiny",
    "tokenizer.vocab_size=512",
    "model_args.vocab_size=512",
    "batch_size=2",
    "seq_len=64",
    "device=cuda",  # a GPU plan, made on this CPU machine
    "dtype=bf16",
    # every optimizer and offload can round to nearest (bitsandbytes' CUDA kernel, the offloaded update, cannot round
    # otherwise: under the default, auto, the plan leaves them out; test_a_plan_keeps_the_config_s_rounding)
    "bf16_rounding=nearest",
    "optimizer.name=adamw",  # the plans below keep AdamW's family (left out, a run from scratch gets Muon)
]


def tiny(*extra: str):
    return load_config(None, [*TINY, *extra])


_ESTIMATES: dict[str, object] = {}


def cached_estimate(cfg, **kwargs):
    """``estimate_run``, each config once per test session (the searches of several tests share estimates)."""
    key = json.dumps([config_to_dict(cfg), kwargs], sort_keys=True, default=str)
    if key not in _ESTIMATES:
        _ESTIMATES[key] = estimate_run(cfg, **kwargs)
    return _ESTIMATES[key]


# ----------------------------------------------------------------------------------------------------------------
# Budgets
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * 1024**3),
        ("24GB", 24 * 10**9),
        ("24gib", 24 * 1024**3),
        ("512 MiB", 512 * 1024**2),
        ("1.5TiB", int(1.5 * 1024**4)),
        ("80GB", 80 * 10**9),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["24", "24G", "GiB", "-1GiB", "0GiB", "24 parsecs", ""])
def test_parse_bytes_rejects_and_names_the_key(text):
    with pytest.raises(ConfigError, match="'budget'"):
        parse_bytes(text)


def test_split_budget_takes_it_out_of_the_overrides():
    budget, rest = split_budget(["model=tiny", "budget=2GiB", "batch_size=1"])
    assert budget == 2 * 1024**3 and rest == ["model=tiny", "batch_size=1"]
    assert split_budget(["model=tiny"]) == (None, ["model=tiny"])


def test_cli_requires_a_budget(capsys):
    assert main(["plan", *TINY]) == 2
    assert "config key 'budget'" in capsys.readouterr().err
    assert main(["plan", *TINY, "budget=24G"]) == 2
    assert "GiB = 1024**3" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# The cost model
# ----------------------------------------------------------------------------------------------------------------


def _seconds(**switches) -> float:
    """Step seconds of a Llama-3-8B run (bf16, 1 x 2048 tokens, CUDA) with these switches."""
    base = [
        "model=llama3-8b",
        "dtype=bf16",
        "batch_size=1",
        "seq_len=2048",
        "device=cuda",
        "optimizer.name=adamw",
    ]
    cfg = load_config(None, base)
    opt = {k[len("optimizer.") :]: v for k, v in switches.items() if k.startswith("optimizer.")}
    rest = {k: v for k, v in switches.items() if not k.startswith("optimizer.")}
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, **opt), **rest)
    mcfg = run_model_config(cfg)
    states = model_state_bytes_closed_form(cfg, mcfg)
    return step_cost(CostRequest(cfg, mcfg, world_size=1, seq_len=2048, states=states))["total"]


def test_cost_model_orders_as_documented():
    base = _seconds()
    # activation checkpointing recomputes forwards: full > every 2nd layer > none; full adds ~1/3 of the layers
    assert _seconds(activation_checkpointing="full") > _seconds(activation_checkpointing="every_n") > base
    mcfg = run_model_config(load_config(None, ["model=llama3-8b", "tokenizer.vocab_size=2048"]))
    flops = model_flops_per_token(mcfg, 2048)
    extra = _seconds(activation_checkpointing="full") - base
    assert extra == pytest.approx(2048 * flops["layers"] / 400e12)
    assert _seconds(chunked_cross_entropy=8) > base  # one lm_head forward more
    nearest = {"bf16_rounding": "nearest"}  # stochastic rounding steps each tensor on its own already
    in_backward = _seconds(optimizer_in_backward=True, max_grad_norm=0.0, **nearest)
    assert in_backward > _seconds(**nearest)  # one kernel launch set per tensor
    for name in ("adamw8bit", "torchao_adamw4bit"):  # low-bit updates: 1.4x AdamW's
        assert _seconds(**{"optimizer.name": name}, **nearest) > _seconds(**nearest)
    # rounding stochastically (bf16_rounding=auto for AdamW) costs the update its fp32 copy and random bits
    assert base > _seconds(**nearest)
    # host traffic: offloaded activations and an offloaded optimizer cost PCIe time
    assert _seconds(**{"optimizer.cpu_offload": True, "max_grad_norm": 0.0}) > 2 * base
    # fp32 matmuls are slower than bf16 on a GPU
    assert _seconds(dtype="fp32") > 5 * base


def test_cost_model_charges_qlora_its_dequantization():
    """Every NF4 weight is dequantized in the forward and in the backward, and again in a recomputed forward:
    Llama-3-8B's 6.98e9 decoder-linear weights at 33 bytes each (torchao's eager kernels, bf16) and 2 TB/s."""
    mcfg = run_model_config(load_config(None, ["model=llama3-8b"]))
    assert mcfg.num_layers * layer_weights(mcfg) == 8_030_261_248 - 2 * 128_256 * 4096 - (2 * 32 + 1) * 4096
    per_pass = mcfg.num_layers * layer_weights(mcfg) * 33.0 / 2.0e12
    for ac, passes in (("none", 2), ("selective", 2), ("every_n", 2.5), ("full", 3)):
        lora = _seconds(method="lora", activation_checkpointing=ac)
        assert _seconds(method="qlora", activation_checkpointing=ac) - lora == pytest.approx(
            passes * per_pass
        )
    assert _seconds(method="qlora", gradient_accumulation_steps=2) - _seconds(
        method="lora", gradient_accumulation_steps=2
    ) == pytest.approx(2 * 2 * per_pass)  # per micro-batch
    assert (
        COST_CONSTANTS["cpu"]["nf4_dequantize_bytes_per_element"]["bf16"] > 33
    )  # measured on CPU: 6 ns/element


def test_cost_model_counts_paged_and_offloaded_bytes():
    cfg = load_config(None, ["model=llama3-8b", "dtype=bf16", "batch_size=1", "seq_len=2048", "device=cuda"])
    mcfg = run_model_config(cfg)
    states = model_state_bytes_closed_form(cfg, mcfg)
    cost = lambda **kw: step_cost(CostRequest(cfg, mcfg, world_size=1, seq_len=2048, states=states, **kw))  # noqa: E731
    gib = 1024**3
    link = COST_CONSTANTS["cuda"]["host_link_bytes_per_second"]
    assert cost(paged_out_bytes=gib)["transfers"] == pytest.approx(2 * gib / link)
    # offloaded activations go out and back on a side stream, overlapping compute, but for the first layer's copy
    # back at the start of the backward (1/32 of them for Llama-3-8B)
    offloaded = cost(offloaded_activation_bytes=gib)
    assert offloaded["transfers"] == pytest.approx(gib / 32 / link)
    assert offloaded["total"] == pytest.approx(
        cost()["total"] + gib / 32 / link
    )  # compute > 2 GiB at 25 GB/s
    huge = cost(offloaded_activation_bytes=1000 * gib)  # more than the step's compute can hide
    assert huge["total"] == pytest.approx(2000 * gib / link + huge["optimizer"] + 1000 * gib / 32 / link)


# ----------------------------------------------------------------------------------------------------------------
# Plans, checked against real estimates (tiny model: about a second each)
# ----------------------------------------------------------------------------------------------------------------


# the least memory-hungry combination of switches (CUDA: paging and activation offloading count)
LEAST = (
    "optimizer.name=paged_adamw8bit",
    "optimizer_in_backward=true",
    "max_grad_norm=0",
    "activation_checkpointing=full",
    "chunked_cross_entropy=8",
    "tiled_mlp=auto",
    "activation_offloading=true",
)


@pytest.fixture(scope="module")
def peaks():
    """Estimated peaks of the tiny model's most and least memory-hungry combinations."""
    most = cached_estimate(tiny())
    least = cached_estimate(tiny(*LEAST))
    return most.peak_bytes, least.peak_bytes, least


@pytest.fixture(scope="module")
def tight_plan(peaks):
    """A plan whose budget is between the least and the most memory the tiny run can take."""
    most, least, _ = peaks
    budget = int((least + (most - least) * 0.5) / (1 - P.DEFAULT_MARGIN))
    return P.plan(P.PlanRequest(tiny(), budget, fits=2, estimator=cached_estimate))


def test_the_chosen_plan_fits_per_a_real_estimate(tight_plan, peaks):
    p = tight_plan
    best = p.best
    assert best is not None and best.estimated and best.changes
    again = estimate_run(best.config)  # exactly that config, estimated afresh
    assert again.peak_bytes == best.peak_bytes <= p.usable_bytes
    # the rows are ranked: fitting first, fastest first; the rest do not fit or were not estimated
    fitting = [r for r in p.rows if r.fits]
    assert len(fitting) >= 2 and p.rows[: len(fitting)] == fitting
    speeds = [r.relative_throughput for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.peak_bytes <= p.usable_bytes for r in fitting)
    assert all(r.estimated for r in p.rows if r.status in ("fits", "over budget"))
    # the config planned from (peak = most) does not fit: something was changed
    assert peaks[0] > p.usable_bytes
    # nothing left unestimated could have been faster than the fitting ones kept
    slowest = fitting[1].cost["total"]
    assert all(r.cost["total"] >= slowest for r in p.rows if r.status == "not estimated")
    assert p.estimates < len(p.rows) / 4  # the bounds did their work


def test_bounds_never_exceed_the_estimate(tight_plan):
    """Every bound the search prunes with is below the estimate, for each combination it estimated (an offline
    check of all 408 tiny combinations, bf16 and bf16_mixed, found no exception either)."""
    search = tight_plan.search
    probe = search.least_memory()  # estimated here where the search found its fits before it needed the probe
    assert probe.label() == "bf16 paged_adamw8bit in_bwd ac=full ce=8 tiled act_offload"
    if not probe.estimated:
        search.run_estimate(probe)
    estimated = [r for r in tight_plan.rows if r.estimated]
    assert len(estimated) >= 4
    siblings = 0
    for row in estimated:
        peak, total, host = search.ctx.lower_bounds(row.config)
        e = row.estimate
        assert peak <= e.peak_bytes and total <= e.device_total_bytes and host <= e.host_bytes, row.label()
        assert search.sibling_bound(row) <= e.peak_bytes, row.label()
        key = switches.activation_key(row.config)
        others = [
            o for o in search.by_activation[key] if o is not row and o.estimate.phase != "optimizer_step"
        ]
        siblings += bool(others)
    assert siblings >= 2  # the sibling bound was exercised across optimizers


def test_nothing_fits_exits_1_naming_the_smallest_peak(capsys, peaks):
    least = peaks[2]
    states = sum(least.breakdown[k] for k in ("parameters", "gradients", "optimizer_state"))
    # a little over half the model states would fit beside the rest: 2 ranks would do
    budget = int((least.peak_bytes - 0.45 * states) / (1 - P.DEFAULT_MARGIN))
    assert main(["plan", *TINY, f"budget={budget}B", "--top", "3"]) == 1
    captured = capsys.readouterr()
    assert "nothing fits" in captured.err
    assert f"{format_bytes(least.peak_bytes)} (estimated)" in captured.err
    # what would be needed
    assert "about world_size=2" in captured.err and "smaller batch_size" in captured.err
    assert "rank  switches" in captured.out  # the table still shows what was found


def test_plan_yaml_round_trips_through_load_config(tight_plan, tmp_path):
    best = tight_plan.best
    path = report.write_plan_yaml(tmp_path / "plan.yaml", best, tight_plan)
    text = path.read_text()
    assert text.startswith("# memfit plan: ") and "peak" in text
    loaded = load_config(path)
    planned = dataclasses.replace(best.config, device="cuda", seq_len=tight_plan.seq_len)
    assert config_to_dict(loaded) == config_to_dict(planned)
    for key, value in best.switches.items():
        assert switches.value_of(loaded, key) == value


def test_cli_writes_a_runnable_plan(tmp_path, capsys, peaks):
    out = tmp_path / "best.yaml"
    budget = int(peaks[0] * 2)  # everything fits: the fastest wins, with few estimates
    assert main(["plan", *TINY, f"budget={budget}B", "--out", str(out), "--fits", "1"]) == 0
    printed = capsys.readouterr().out
    assert "rank  switches" in printed and f"wrote {out}" in printed
    cfg = load_config(out)
    assert cfg.model == "tiny" and cfg.device == "cuda" and cfg.batch_size == 2 and cfg.seq_len == 64


def test_cheapest_fix_changes_the_fewest_switches(tight_plan, peaks):
    cfg = tiny()
    same = P.cheapest_fix(P.PlanRequest(cfg, peaks[0] * 4, margin=0.0, estimator=cached_estimate))
    assert same.changes == () and same.estimated
    fix = P.cheapest_fix(P.PlanRequest(cfg, tight_plan.budget_bytes, estimator=cached_estimate))
    assert fix is not None and fix.fits and fix.peak_bytes <= tight_plan.usable_bytes
    assert 1 <= len(fix.changes) <= len(tight_plan.best.changes)
    assert P.cheapest_fix(P.PlanRequest(cfg, max(peaks[1] // 4, 1), estimator=cached_estimate)) is None


# ----------------------------------------------------------------------------------------------------------------
# Candidates: through validation
# ----------------------------------------------------------------------------------------------------------------


def test_candidates_respect_validation_and_the_device():
    def switches(cfg, world_size=1):
        return [P._switches_of(c, world_size) for c in P.candidates(cfg, world_size)]

    cpu = switches(tiny("device=cpu"))
    assert not any(s["activation_offloading"] or s["optimizer.cpu_offload"] for s in cpu)  # CUDA only
    assert not any(s["optimizer.name"].startswith("paged_") for s in cpu)  # the same as unpaged on CPU
    cuda = switches(tiny())
    assert any(s["activation_offloading"] for s in cuda) and any(s["optimizer.cpu_offload"] for s in cuda)
    # offloading needs no clipping and no optimizer in backward, and not a paged optimizer
    for c in P.candidates(tiny()):
        if c.optimizer.cpu_offload:
            assert c.max_grad_norm == 0 and not c.optimizer_in_backward
            assert not c.optimizer.name.startswith("paged_")
        if c.optimizer_in_backward:
            assert c.max_grad_norm == 0
    # the planner never changes the batch of a step: no optimizer in backward with accumulation
    assert not any(s["optimizer_in_backward"] for s in switches(tiny("gradient_accumulation_steps=2")))
    # sharded: bitsandbytes optimizers are rejected, and torchao's with bf16 shards; FSDP's switches are enumerated
    sharded = switches(tiny(), world_size=2)
    assert {s["optimizer.name"] for s in sharded} == {"adamw"}
    mixed = switches(tiny("dtype=bf16_mixed"), world_size=2)
    assert {s["optimizer.name"] for s in mixed} == {"adamw", "torchao_adamw8bit", "torchao_adamw4bit"}
    assert {s["distributed.reshard_after_forward"] for s in sharded} == {True, False}
    assert {s["distributed.cpu_offload"] for s in sharded} == {True, False}


def test_sharded_plan_writes_the_launch(tmp_path):
    p = P.plan(P.PlanRequest(tiny("dtype=fp32"), 64 * MIB, world_size=2, estimator=cached_estimate))
    best = p.best
    assert best is not None and best.estimate.world_size == 2 and p.world_size == 2
    path = report.write_plan_yaml(tmp_path / "sharded.yaml", best, p)
    assert f"# run: memfit pretrain --config {path} nproc=2" in path.read_text()
    assert P._switches_of(load_config(path, world_size=2), 2) == best.switches


def test_a_cpu_plan_gives_the_tensors_the_budget_less_the_process_overhead(monkeypatch):
    """On CPU the budget is peak RSS: the process's own bytes (imports, kernels, the heap's free memory, which grows
    with the tensors) come off it, and every fitting row's traced peak fits in what is left: the largest peak whose
    predicted RSS fits (memfit.memory.host.tensor_share_bytes)."""
    monkeypatch.setattr(host, "process_rss_bytes", lambda: 100 * MIB)
    monkeypatch.setattr(host, "dynamic_mmap_threshold", lambda *_, **__: True)
    cfg = load_config(None, [*(t for t in TINY if not t.startswith(("device=", "dtype="))), "device=cpu"])
    p = P.plan(P.PlanRequest(cfg, 400 * MIB, margin=0.1, estimator=cached_estimate))
    # 360 MiB less 100 + 48 + 32 MiB held, over 1.27 bytes of RSS per byte of tensors: 148,617,071 bytes
    assert p.usable_bytes == host.tensor_share_bytes(int(400 * MIB * 0.9)) == 148_617_071
    assert p.host_overhead_bytes == int(400 * MIB * 0.9) - 148_617_071
    assert p.to_json()["host_overhead_gib"] == p.host_overhead_bytes / GIB
    fitting = [r for r in p.rows if r.fits]
    assert fitting and all(r.peak_bytes <= p.usable_bytes for r in fitting)
    assert f"the process's own {format_bytes(p.host_overhead_bytes)} on CPU" in report.format_plan(p)


# ----------------------------------------------------------------------------------------------------------------
# QLoRA: a LoRA plan stores the base in NF4 only when it must
# ----------------------------------------------------------------------------------------------------------------

# 8 layers and one sequence of 16 tokens: the frozen decoder linears (8 x 36,864 weights) outweigh the activations,
# so QLoRA's NF4 base (~0.52 bytes per weight instead of 2) separates the two methods' least memory. With few, wide
# layers it need not: dequantizing one weight holds ~10 bytes per weight of eager torchao temporaries (int64 codes)
LORA = [
    *TINY[:3],
    "model_args.num_layers=8",
    "batch_size=1",
    "seq_len=16",
    "device=cuda",
    "dtype=bf16",
    "method=lora",
]


def lora(*extra: str):
    """The LoRA run above (a preset: no checkpoint_dir, as memfit plan loads it) with ``extra`` overrides."""
    return load_config(None, [*LORA, *extra], needs_weights=False)


@pytest.fixture(scope="module")
def least_peaks():
    """Estimated peaks of the LoRA and of the QLoRA run with every switch that saves memory on."""
    return cached_estimate(lora(*LEAST)).peak_bytes, cached_estimate(lora(*LEAST, "method=qlora")).peak_bytes


def test_candidates_add_qlora_to_a_lora_run_only():
    def methods(cfg, world_size=1):
        return {c.method for c in P.candidates(cfg, world_size)}

    assert methods(lora()) == {"lora", "qlora"}
    assert methods(tiny()) == {"full"}  # full fine-tuning trains the weights: no frozen base to quantize
    assert methods(lora("method=qlora")) == {"qlora"}
    # k_proj of a 40-wide model has 20 x 40 = 800 weights, not a multiple of the 64-weight NF4 block
    assert methods(lora("model_args.dim=40")) == {"lora"}
    # 2 ranks: the tiny (64, 64) q_proj has 1 group of block scales, which FSDP2 cannot split in two
    assert methods(lora(), world_size=2) == {"lora"}
    # validated as predictions: no checkpoint_dir needed; the switches are those of LoRA
    rows = {
        P.PlanRow(c, P._switches_of(c, 1), P._changes(c, lora(), 1)).label(): c for c in P.candidates(lora())
    }
    assert "qlora bf16 adamw:foreach" in rows and "lora bf16 adamw:foreach" in rows
    assert P._changes(rows["qlora bf16 adamw:foreach ac=full"], lora(), 1) == (
        "method",
        "activation_checkpointing",
    )


def test_a_lora_plan_takes_qlora_when_only_qlora_fits(least_peaks, tmp_path):
    lora_least, qlora_least = least_peaks
    assert qlora_least < lora_least
    budget = int((qlora_least + lora_least) / 2 / (1 - P.DEFAULT_MARGIN))
    p = P.plan(P.PlanRequest(lora(), budget, estimator=cached_estimate))
    best = p.best
    assert best is not None and best.estimated and best.switches["method"] == best.config.method == "qlora"
    assert best.label().startswith("qlora bf16 ") and best.changes[0] == "method"
    assert best.peak_bytes <= p.usable_bytes < lora_least
    assert not any(r.fits for r in p.rows if r.config.method == "lora")
    assert best.cost["dequantize"] > 0
    assert best.cost["total"] >= best.cost["compute"] + best.cost["dequantize"]
    text = report.format_plan(p)
    assert "changes: method=qlora" in text and "NF4 dequantization" in text
    assert best.to_json()["config"]["method"] == "qlora"
    # the bounds stay below every estimate (the closed forms and the sibling bound are per method)
    ctx = p.search.ctx
    assert ctx.closed(best.config)["parameters"] < ctx.closed(lora())["parameters"]
    for row in (r for r in p.rows if r.estimated):
        peak, total, host = ctx.lower_bounds(row.config)
        e = row.estimate
        assert peak <= e.peak_bytes and total <= e.device_total_bytes and host <= e.host_bytes, row.label()
        assert p.search.sibling_bound(row) <= e.peak_bytes, row.label()
    # the written config runs QLoRA with memfit finetune (which needs the base weights)
    path = report.write_plan_yaml(tmp_path / "qlora.yaml", best, p)
    written = path.read_text()
    assert f"# run: memfit finetune --config {path}" in written and "add checkpoint_dir=DIR" in written
    assert "method: qlora" in written
    loaded = load_config(path, needs_weights=False)
    assert loaded.method == "qlora" and P._switches_of(loaded, 1) == best.switches


def test_a_lora_plan_with_room_stays_lora(least_peaks):
    """QLoRA dequantizes every weight in each forward and backward: slower, so never chosen when LoRA fits."""
    p = P.plan(P.PlanRequest(lora(), least_peaks[0] * 4, estimator=cached_estimate))
    assert p.best.config.method == "lora" and p.best.changes == () and p.estimates == 1
    qlora_row = next(r for r in p.rows if r.label() == "qlora bf16 adamw:foreach")
    assert qlora_row.cost["total"] > p.best.cost["total"] and qlora_row.relative_throughput < 1


def test_cheapest_fix_of_lora_may_be_qlora(least_peaks):
    budget = int((least_peaks[0] + least_peaks[1]) / 2 / (1 - P.DEFAULT_MARGIN))
    fix = P.cheapest_fix(P.PlanRequest(lora(), budget, estimator=cached_estimate))
    assert fix is not None and fix.fits and fix.config.method == "qlora" and "method" in fix.changes


VirtualMemory = collections.namedtuple("VirtualMemory", "available")


def test_preflight_of_a_qlora_run(monkeypatch):
    """The pre-flight check of a QLoRA run: the closed-form bound with NF4 weights, the trace, and the planner's
    cheapest fix (which keeps QLoRA)."""
    cfg = load_config(None, [*TINY[:5], "device=cpu", "dtype=fp32", "method=qlora"], needs_weights=False)
    mcfg = run_model_config(cfg)
    # the trace and the fix's search, estimated once per session as the other plans here
    monkeypatch.setattr(P, "estimate_run", cached_estimate)
    monkeypatch.setattr("memfit.planner.preflight.estimate_run", cached_estimate)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VirtualMemory(64 * 1024**3))
    assert preflight(cfg, mcfg, 64, torch.device("cpu")).startswith("pre-flight: fits (bound")
    predicted = cached_estimate(cfg, seq_len=64, model_config=mcfg)
    need = predicted.peak_bytes + predicted.host_bytes
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VirtualMemory(need - 1))
    with pytest.raises(PreflightError) as refused:
        preflight(cfg, mcfg, 64, torch.device("cpu"))
    message = str(refused.value)
    assert "method qlora" in message and "Cheapest fix (memfit plan): " in message
    fix = P.cheapest_fix(P.PlanRequest(cfg, need - 1, host_overhead_bytes=0))
    assert fix is not None and fix.fits and fix.config.method == "qlora" and "method" not in fix.changes
    assert f"{fix.changes[0]}=" in message


_LLAMA3_8B_NS_FLOPS_PER_LAYER = (
    2 * 6 * 4096**3 + 2 * (4 * 1024**2 * 4096 + 2 * 1024**3) + 3 * (4 * 4096**2 * 14336 + 2 * 4096**3)
)


def test_cost_model_charges_muon_s_newton_schulz_and_apollo_s_projections():
    """Llama-3-8B, by hand: per layer q, o (4096 x 4096: 6 * 4096**3 FLOPs a Newton-Schulz iteration each), k, v
    (1024 x 4096: 4 * 1024**2 * 4096 + 2 * 1024**3 each) and gate, up, down (4096 x 14336: 4 * 4096**2 * 14336
    + 2 * 4096**3 each); 5 iterations, 32 layers, at the bf16 rate of the update's matmuls."""
    base = _seconds()
    per_layer = _LLAMA3_8B_NS_FLOPS_PER_LAYER
    muon = _seconds(**{"optimizer.name": "muon"}) - base
    assert muon == pytest.approx(5 * 32 * per_layer / 400e12)
    # muon_ns_dtype=auto is bf16 on CUDA; fp32 runs the same FLOPs at the fp32 matmul rate
    assert _seconds(**{"optimizer.name": "muon", "optimizer.muon_ns_dtype": "bf16"}) - base == muon
    fp32 = _seconds(**{"optimizer.name": "muon", "optimizer.muon_ns_dtype": "fp32"}) - base
    assert fp32 == pytest.approx(5 * 32 * per_layer / 25e12)
    # APOLLO: 2 m n r a matrix, r = 1024 (a quarter of the width): 2 * r * (weights of the hidden matrices)
    hidden = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    apollo = _seconds(**{"optimizer.name": "apollo"}) - base
    assert apollo == pytest.approx(2 * 1024 * hidden / 400e12, rel=1e-6)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_cost_model_prices_muon_on_cpu_in_the_dtype_it_runs_in(monkeypatch, fast_bf16):
    """On a CPU run, ``auto`` is bf16 (370 GFLOP/s) where the CPU has bf16 matrix instructions and fp32 (140)
    where it has not; the planner asks the same rule the optimizer is built with."""
    monkeypatch.setattr(hybrids, "cpu_bf16_matmuls_fast", lambda: fast_bf16)
    base = _seconds(device="cpu", dtype="fp32")
    flops = 5 * 32 * _LLAMA3_8B_NS_FLOPS_PER_LAYER
    muon = _seconds(**{"optimizer.name": "muon", "device": "cpu", "dtype": "fp32"}) - base
    assert muon == pytest.approx(flops / (370e9 if fast_bf16 else 140e9), rel=1e-9)
    for setting, rate in (("bf16", 370e9), ("fp32", 140e9)):
        pinned = _seconds(
            **{"optimizer.name": "muon", "optimizer.muon_ns_dtype": setting, "device": "cpu", "dtype": "fp32"}
        )
        assert pinned - base == pytest.approx(flops / rate, rel=1e-9)


def test_cli_plan_names_a_bad_optimizers_list(capsys):
    assert main(["plan", *TINY, "budget=1GiB", "--optimizers", "muon,sgd"]) == 2
    err = capsys.readouterr().err
    assert "--optimizers must be a comma-separated list" in err and "'muon,sgd'" in err


def test_explain_says_how_the_estimates_were_obtained(capsys):
    """``--explain``: the plan's estimates counted (each row's ``trace`` in the JSON says the same), and one
    estimate's depths traced."""
    assert main(["plan", *TINY, "budget=64MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    traces = [r["trace"] for r in out["rows"] if r["estimated"]]
    why = "2 decoder layers: tracing them all costs no more than composing"
    assert len(traces) == out["estimates"] >= 1
    assert all(t["layers_traced"] == [2] and t["why_not_composed"] == why for t in traces)
    assert main(["plan", *TINY, "budget=64MiB", "--explain"]) == 0
    text = capsys.readouterr().out
    n = out["estimates"]
    assert f"how the estimates were obtained: {n} estimate{'' if n == 1 else 's'} in " in text
    assert f"; 0 composed from traces of 3 and 4 decoder layers, {n} traced whole\n" in text
    assert (
        f"  traced whole ({n}): {why}\n  decoder layers traced: {2 * n} (tracing every model whole: {2 * n})"
        in text
    )
    assert main(["estimate", *TINY, "--explain"]) == 0
    text = capsys.readouterr().out
    assert (
        "\nhow this estimate was obtained:\n  one train_step of the run itself, traced on fake tensors"
        in text
    )
    assert f" s): {why}\n" in text.split("  traced: all 2 decoder layers (")[1]


def test_the_progress_bar_counts_each_estimate_made_even_one_that_fails():
    import io

    from tqdm import tqdm

    from memfit import cli

    bar = tqdm(file=io.StringIO(), bar_format="{n}", mininterval=0)

    def estimator(cfg, **kwargs):
        if cfg is None:
            raise ConfigError("no")
        return cfg * 2

    counted = cli._counted(estimator, bar)
    assert counted(3, world_size=1) == 6 and bar.n == 1
    with pytest.raises(ConfigError):
        counted(None)
    assert bar.n == 2


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_mlp_working_set_bounds_the_peak_from_below(dtype):
    """An untiled MLP holds its activation and up_proj's output, 2 x (B * T, I) at the matmul dtype, in each
    layer's forward: with the checkpoints offloaded and the loss chunked, that is the bound's largest term
    (parameters and optimizer state besides), and it stays below the traced peak; a tiled MLP's is a tile's."""
    args = [
        "model=tiny",
        "tokenizer.kind=char",
        "model_args.intermediate_size=2048",
        "model_args.max_seq_len=512",
        "seq_len=512",
        "batch_size=2",
        "device=cuda",
        f"dtype={dtype}",
        "optimizer.name=adamw",
        "activation_checkpointing=full",
        "activation_offloading=true",
        "chunked_cross_entropy=auto",
    ]
    cfg = load_config(None, args, needs_weights=False)
    ctx = P._build(P.PlanRequest(cfg, 2**40, 1))[0].ctx
    working = ctx.mlp_working_set(cfg)
    assert working == 2 * (2 * 512) * 2048 * (4 if dtype == "fp32" else 2)
    closed = ctx.closed(cfg)
    peak = ctx.lower_bounds(cfg)[0]
    assert peak == closed["parameters"] + closed["optimizer_state"] + working
    assert peak <= estimate_run(cfg).peak_bytes
    assert ctx.mlp_working_set(load_config(None, [*args, "tiled_mlp=4"], needs_weights=False)) == 0


def test_an_optimizer_left_unset_is_the_plan_s_to_choose_and_a_named_one_is_kept(capsys):
    """Left out, ``optimizer.name`` is chosen among every entry of the registry (the plan says so, and prefers
    the config's default at the same speed); named, every row keeps it or an optimizer of its update rule."""
    left_out = [a for a in TINY if not a.startswith("optimizer.name=")]
    assert main(["plan", *left_out, "budget=64MiB", "--json"]) == 0
    unset = json.loads(capsys.readouterr().out)
    names = {r["config"]["optimizer.name"] for r in unset["rows"]}
    assert {"adafactor", "apollo_mini", "adam_mini", "muon"} <= names  # other update rules were candidates
    assert main(["plan", *left_out, "budget=64MiB"]) == 0
    text = capsys.readouterr().out
    best = unset["best"]["config"]["optimizer.name"]
    assert f"optimizer.name={best}: left unset, so chosen among the registry's 13 optimizers" in text
    assert main(["plan", *TINY, "budget=64MiB", "--json"]) == 0
    named = json.loads(capsys.readouterr().out)
    rules = {optimizers.spec(r["config"]["optimizer.name"]).update_rule for r in named["rows"]}
    assert rules == {"adamw"}
    assert main(["plan", *TINY, "budget=64MiB"]) == 0
    assert "left unset" not in capsys.readouterr().out


def test_a_plan_keeps_the_config_s_rounding():
    """Under ``bf16_rounding=auto`` (stochastic where the optimizer can round so) a bf16 plan never trades the
    weights' updates for speed: no bitsandbytes optimizer on CUDA (its kernel rounds to nearest) and no
    ``optimizer.cpu_offload``; with ``nearest`` asked for, both are candidates; an fp32 plan keeps them."""

    def names(*extra):
        cfgs = P.candidates(tiny(*extra), 1)
        return {c.optimizer.name for c in cfgs}, any(c.optimizer.cpu_offload for c in cfgs)

    auto_names, auto_offload = names("bf16_rounding=auto")
    assert not {"adamw8bit", "paged_adamw8bit"} & auto_names and not auto_offload
    assert {"torchao_adamw8bit", "torchao_adamw4bit"} <= auto_names
    nearest_names, nearest_offload = names()
    assert {"adamw8bit", "paged_adamw8bit"} <= nearest_names and nearest_offload
    fp32_names, _ = names("bf16_rounding=auto", "dtype=fp32")
    assert "adamw8bit" in fp32_names
