"""The planner picks the mesh (issue 52, item 5): ring pricing of the collectives, the layouts of N nodes x G GPUs,
and ``plan_mesh`` over them."""

from __future__ import annotations

import pytest

from memfit.build import run_model_config
from memfit.cli import main
from memfit.config import load_config
from memfit.errors import ConfigError
from memfit.memory import switches
from memfit.planner import mesh as M
from memfit.planner import plan as P
from memfit.planner.cost import (
    COST_CONSTANTS,
    CostRequest,
    collective_bytes,
    mesh_collectives,
    step_cost,
)
from memfit.planner.layout import Layout, layouts, torchrun_line
from memfit.units import MIB
from tests.memory.test_plan import TINY, cached_estimate, tiny

CUDA = COST_CONSTANTS["cuda"]
NVLINK, IB = 450e9, 50e9


def test_the_bandwidth_defaults_are_h100_nvlink_and_400_gbps_infiniband():
    assert CUDA["intra_node_bytes_per_second"] == NVLINK  # 900 GB/s bidirectional / 2
    assert CUDA["inter_node_bytes_per_second"] == IB  # 400 Gb/s / 8
    assert COST_CONSTANTS["cpu"]["inter_node_bytes_per_second"] == IB


@pytest.mark.parametrize(
    "collective, nbytes, ranks, sent",
    [
        ("all_gather", 800, 8, 700),  # (n - 1)/n of the gathered tensor
        ("reduce_scatter", 800, 8, 700),
        ("all_reduce", 1000, 2, 1000),  # reduce-scatter + all-gather: 2 (n - 1)/n
        ("all_reduce", 1600, 16, 3000),
        ("all_to_all", 400, 4, 300),  # a rank keeps 1/n of its buffer
        ("all_gather", 800, 1, 0),  # alone: nothing to send
    ],
)
def test_ring_bytes_per_rank(collective, nbytes, ranks, sent):
    assert collective_bytes(collective, nbytes, ranks) == sent


def test_collective_bytes_refuses_unknown_collectives_and_empty_groups():
    with pytest.raises(ValueError, match="all_gather, reduce_scatter, all_reduce, all_to_all"):
        collective_bytes("broadcast", 8, 2)
    with pytest.raises(ValueError, match=">= 1 ranks"):
        collective_bytes("all_gather", 8, 0)


# ----------------------------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------------------------


def _mesh(layout: Layout) -> tuple[int, int, int]:
    return layout.replicate, layout.shard, layout.tensor_parallel


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b"])
def test_the_layouts_of_two_nodes_of_eight(model):
    # Llama 3 8B: 32 heads, 8 key/value heads; 70B: 64 and 8. Every T in {1, 2, 4, 8} divides both, R divides 2
    mcfg = run_model_config(load_config(None, [f"model={model}"], needs_weights=False))
    assert [_mesh(x) for x in layouts(2, 8, mcfg)] == [
        (1, 16, 1),
        (1, 8, 2),
        (1, 4, 4),
        (1, 2, 8),
        (2, 8, 1),
        (2, 4, 2),
        (2, 2, 4),
        (2, 1, 8),
    ]


def test_layouts_keep_tp_to_the_heads_and_a_node_and_replicas_to_whole_nodes():
    # the tiny preset has 4 heads and 2 key/value heads: T = 4 or 8 would split a key/value head
    mcfg = run_model_config(tiny())
    assert (mcfg.num_heads, mcfg.num_kv_heads) == (4, 2)
    assert [_mesh(x) for x in layouts(2, 8, mcfg)] == [(1, 16, 1), (1, 8, 2), (2, 8, 1), (2, 4, 2)]
    # 3 nodes of 6: R in {1, 3} (divides N), T in {1, 2} (divides 6 and the heads)
    assert [_mesh(x) for x in layouts(3, 6, mcfg)] == [(1, 18, 1), (1, 9, 2), (3, 6, 1), (3, 3, 2)]
    assert [_mesh(x) for x in layouts(1, 1, mcfg)] == [(1, 1, 1)]
    with pytest.raises(ConfigError, match="config key 'gpus_per_node': must be an integer >= 1, got 0"):
        layouts(2, 0, mcfg)


def test_the_torchrun_line_of_a_layout():
    assert torchrun_line(Layout(2, 8, 2, 1), "pretrain", "plan.yaml") == (
        "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 "
        "-m memfit pretrain --config plan.yaml"
    )
    assert torchrun_line(Layout(1, 4), "finetune", "p.yaml") == (
        "torchrun --standalone --nproc_per_node 4 -m memfit finetune --config p.yaml"
    )


# ----------------------------------------------------------------------------------------------------------------
# Pricing on a mesh
# ----------------------------------------------------------------------------------------------------------------


def _llama8b(*extra: str):
    cfg = load_config(
        None,
        ["model=llama3-8b", "dtype=bf16", "device=cuda", "batch_size=1", "seq_len=8192", *extra],
        world_size=16,
        needs_weights=False,
    )
    return cfg, run_model_config(cfg)


# one rank's shard: 1 GB of bf16 parameters, all trainable (round numbers: the arithmetic is the test)
STATES = {"parameters": 10**9, "trainable_parameters": 10**9, "gradients": 10**9, "optimizer_state": 0}


def test_fsdp_across_nodes_pays_infiniband_and_within_a_node_nvlink():
    cfg, _ = _llama8b("activation_checkpointing=none")
    # flat FSDP2 over 16 ranks of 2 nodes: 2 all-gathers + 1 reduce-scatter of 16 GB, 15/16 of each, over IB
    flat = mesh_collectives(cfg, Layout(2, 8), STATES, CUDA)
    assert flat == {"fsdp": pytest.approx(45e9 / IB, rel=1e-12), "replicate": 0.0, "exchange": 0.0}
    # HSDP 2 x 8: the same collectives of 8 GB inside a node (7/8 each, NVLink), and the all-reduce of the 1 GB
    # gradient shard between the 2 replicas (2 x 1/2 of it, IB)
    reduced = collective_bytes("all_reduce", STATES["trainable_parameters"], 2)
    hsdp = mesh_collectives(cfg, Layout(2, 8, replicate=2), STATES, CUDA, replica_bytes=reduced)
    assert hsdp["fsdp"] == pytest.approx(21e9 / NVLINK, rel=1e-12)
    assert hsdp["replicate"] == pytest.approx(1e9 / IB, rel=1e-12)
    assert hsdp["fsdp"] + hsdp["replicate"] < flat["fsdp"] / 10
    # without resharding: one all-gather
    once = mesh_collectives(cfg, Layout(2, 8, replicate=2), STATES, CUDA, gathers=1)
    assert once["fsdp"] == pytest.approx(14e9 / NVLINK, rel=1e-12)


def test_bf16_mixed_gathers_bf16_and_reduces_fp32():
    cfg, _ = _llama8b("dtype=bf16_mixed")
    # the 1 GB shard is fp32 here: FSDP2's param_dtype gathers it as bf16 (4 GB whole), reduces fp32 (8 GB)
    hsdp = mesh_collectives(cfg, Layout(2, 8, replicate=2), STATES, CUDA)
    assert hsdp["fsdp"] == pytest.approx((2 * 7 / 8 * 4e9 + 7 / 8 * 8e9) / NVLINK, rel=1e-12)


def test_tensor_and_sequence_parallel_exchanges_at_the_rate_of_their_group():
    cfg, _ = _llama8b("activation_checkpointing=none")
    # TP 8: its activation collectives inside a node; FSDP2 over 2 shards 8 ranks apart spans both nodes (IB)
    tp = mesh_collectives(cfg, Layout(2, 8, tensor_parallel=8), STATES, CUDA, exchanged_bytes=9e9)
    assert tp["exchange"] == pytest.approx(9e9 / NVLINK, rel=1e-12)
    assert tp["fsdp"] == pytest.approx(3 * 1e9 / IB, rel=1e-12)  # 1/2 of 2 GB per collective
    # Ulysses over 8 ranks stays in a node, over 16 it crosses
    sp8, _ = _llama8b("distributed.sequence_parallel=8")
    sp16, _ = _llama8b("distributed.sequence_parallel=16")
    assert mesh_collectives(sp8, Layout(2, 8), STATES, CUDA, exchanged_bytes=9e9)[
        "exchange"
    ] == pytest.approx(9e9 / NVLINK, rel=1e-12)
    assert mesh_collectives(sp16, Layout(2, 8), STATES, CUDA, exchanged_bytes=9e9)[
        "exchange"
    ] == pytest.approx(9e9 / IB, rel=1e-12)


def test_step_cost_on_a_layout_prices_the_same_bytes_where_their_groups_lie():
    cfg, mcfg = _llama8b("activation_checkpointing=none", "distributed.tensor_parallel=2")
    on_mesh = step_cost(CostRequest(cfg, mcfg, 16, 8192, STATES, layout=Layout(2, 8, tensor_parallel=2)))
    flat = step_cost(CostRequest(cfg, mcfg, 16, 8192, STATES))  # every byte at interconnect_bytes_per_second
    assert (
        on_mesh["compute"] == flat["compute"]
    )  # 1/2 of the matmuls a rank: the tensor-parallel entry's rule
    assert flat["exchange"] > 0
    assert on_mesh["exchange"] == pytest.approx(flat["exchange"] * 200e9 / NVLINK, rel=1e-12)
    # FSDP2 over 8 shards 2 ranks apart: 16 consecutive ranks, both nodes
    assert on_mesh["communication"] == pytest.approx(3 * 7e9 / IB, rel=1e-12)
    one, _ = _llama8b("activation_checkpointing=none")
    assert flat["compute"] == pytest.approx(
        step_cost(CostRequest(one, mcfg, 16, 8192, STATES))["compute"] / 2
    )


# ----------------------------------------------------------------------------------------------------------------
# plan_mesh
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # real estimates on 4 fake ranks, ~30 s
def test_plan_mesh_estimates_each_built_layout_and_says_why_of_the_others():
    cfg = tiny("dtype=fp32")
    mp = M.plan_mesh(P.PlanRequest(cfg, 64 * MIB, estimator=cached_estimate), 2, 2)
    by_mesh = {_mesh(lp.layout): lp for lp in mp.layouts}
    assert set(by_mesh) == {(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)}
    best = mp.best
    assert best is not None and best.status == "fits" and best.best.estimate.world_size == 4
    assert best.best.peak_bytes <= best.plan.usable_bytes
    for mesh, lp in by_mesh.items():  # every layout is built on this branch: searched, or bounded out
        assert lp.status in ("fits", "cannot be faster"), (mesh, lp.status, lp.note)
    table = M.format_mesh_plan(mp)
    assert table.splitlines()[2].startswith(best.layout.label())
    # a tiny model computes next to nothing: the network decides, and a flat group over both nodes loses to
    # replicas of a node each (its all-gathers on NVLink, one all-reduce of a shard over InfiniBand)
    flat = by_mesh[(1, 4, 1)]
    assert best.layout.replicate == 2 and flat.step_seconds > best.step_seconds


def test_a_layout_whose_estimates_all_fail_is_given_up_after_three_optimizers():
    calls = []

    def failing(cfg, **kwargs):
        calls.append(cfg.optimizer.name)
        raise RuntimeError("cannot trace")

    cfg = tiny("dtype=bf16_mixed")
    request = P.PlanRequest(
        cfg, 64 * MIB, estimator=failing, optimizers=("adamw", "torchao_adamw8bit", "torchao_adamw4bit")
    )
    mp = M.plan_mesh(request, 1, 2)
    assert mp.best is None
    flat = next(lp for lp in mp.layouts if _mesh(lp.layout) == (1, 2, 1))
    assert flat.status == "refused" and "RuntimeError: cannot trace" in flat.note
    assert len(set(calls)) == M.FUSE_OPTIMIZERS and len(calls) < len(flat.plan.rows)


# ----------------------------------------------------------------------------------------------------------------
# memfit plan nodes=N gpus_per_node=G
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, message",
    [
        (["nodes=2"], "config key 'gpus_per_node': nodes=2 needs the GPUs (ranks) of each machine too"),
        (
            ["nodes=2", "gpus_per_node=4", "world_size=4"],
            "config key 'world_size': 4 is not nodes x gpus_per_node = 8",
        ),
        (
            ["nodes=2", "gpus_per_node=4", "seq_len=max"],
            "config key 'seq_len': seq_len=max searches one mesh",
        ),
        (
            ["nodes=0", "gpus_per_node=4"],
            "config key 'nodes': the number of machines must be an integer >= 1",
        ),
    ],
)
def test_the_cli_refuses_a_bad_mesh_naming_the_key(given, message, capsys):
    assert main(["plan", *TINY, "budget=1GiB", *given]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # estimates on 8 fake ranks, ~1 min
def test_cli_plans_two_nodes_of_four_and_writes_the_config_and_the_torchrun_line(tmp_path, capsys):
    out = tmp_path / "mesh.yaml"
    assert main(["plan", *TINY, "nodes=2", "gpus_per_node=4", "budget=256MiB", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = (
        "torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m memfit pretrain "
        f"--config {out}"
    )
    assert f"wrote {out}; on every node run:\n{line}" in printed
    assert printed.splitlines()[0].startswith("2 node(s) x 4 GPU(s), budget 0.25 GiB per GPU: 4 layouts, ")
    text = out.read_text()
    assert f"# run: {line}" in text
    cfg = load_config(out, world_size=8)  # validates as each of the 8 ranks will
    assert (
        cfg.model == "tiny"
        and cfg.batch_size == 2
        and cfg.seq_len == 64
        and cfg.distributed.strategy == "fsdp2"
    )
    chosen = next(ln for ln in printed.splitlines() if ln.startswith("best layout: "))
    r, s, t = (int(w) for w in chosen.split()[3::3])  # "best layout: replicate R x shard S x tp T"
    assert (cfg.distributed.replicate, cfg.distributed.tensor_parallel) == (r, t) and r * s * t == 8


def test_a_layout_whose_switch_is_not_declared_is_refused_by_name(monkeypatch):
    # a branch without hybrid sharding's entry cannot run R > 1: the layout says so instead of failing to trace
    without = {k: v for k, v in switches.SWITCHES_BY_KEY.items() if k != "distributed.replicate"}
    monkeypatch.setattr(switches, "SWITCHES_BY_KEY", without)
    assert M._unbuilt(Layout(2, 2, replicate=2)) == "hybrid sharding (distributed.replicate) not built yet"
    assert M._unbuilt(Layout(2, 2, tensor_parallel=2)) is None
    mp = M.plan_mesh(P.PlanRequest(tiny("dtype=fp32"), 64 * MIB, estimator=cached_estimate), 2, 1)
    refused = [lp for lp in mp.layouts if lp.layout.replicate == 2]
    assert [(lp.status, lp.note) for lp in refused] == [
        ("refused", "hybrid sharding (distributed.replicate) not built yet")
    ]
