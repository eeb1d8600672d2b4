"""Tensor parallelism (``distributed.tensor_parallel``) through the real CLI under torchrun on CPU (gloo), 4 ranks:
tensor-parallel 2 x FSDP2 2, tensor-parallel 4 and tensor-parallel 2 x 2 replicas (HSDP: the 3-D mesh) train
exactly what one process does with the same global batch (losses, gradient norms, validation losses, final weights
within 1e-5) on Llama 3, Qwen3 (per-head q/k norms) and Gemma 2 (soft-capped attention and logits, sandwich norms,
tied embeddings, the scaled embedding); LoRA under it; a checkpoint saved on the 2 x 2 mesh resumes in one process,
on the same mesh and on 4 FSDP2 ranks (DCP resharding). In one process: the refusals, the blocks and the
estimate's closed form."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.config import load_config
from memfit.errors import ConfigError
from memfit.memory.tensor_parallel import check_tensor_parallel, tensor_parallel_shape
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config

from .conftest import finetune_overrides, run_torchrun
from .test_distributed import (
    FINETUNE,
    LORA,
    TOL,
    _assert_same_run,
    _interrupted_at_step_3,
    _losses,
    _overrides,
    finetune_diffs,
)

BATCH = 4  # per data-parallel group
# Gemma 2's final weights after 4 AdamW steps: a few elements (1 of 8,192 in 3 matrices) whose gradient is near zero,
# where Adam's division by sqrt(v) magnifies the ranks' other summation order (test_distributed.py's WIDE_WEIGHT_TOL);
# measured 5.2e-5 on tp=2 x fsdp=2, with its losses within 4.8e-7 and gradient norms within 6.7e-6
WEIGHT_TOL = {"tiny-gemma2": 1e-4}
# (layout, tensor_parallel, data-parallel groups of 4 ranks, model_args): tp=4 needs num_kv_heads divisible by 4
# (the tiny presets have 4 heads and 2 key/value heads: tp=2 keeps grouped-query attention, 2 query heads a rank
# sharing one key/value head)
LAYOUTS = {
    "tp2xfsdp2": (2, 2, {}),
    "tp4": (4, 1, {"model_args.num_kv_heads": 4}),
    # the 3-D mesh: 2 replicas (HSDP) x 1 shard x tp 2
    "tp2xreplicate2": (2, 2, {}),
}
MESH = {"tp2xreplicate2": {"distributed.replicate": 2}}
"""The layouts' settings beyond tensor_parallel, for the 4-rank run alone."""
CASES = [
    (layout, model, {})
    for layout in ("tp2xfsdp2", "tp4")
    for model in ("tiny-llama3", "tiny-qwen3", "tiny-gemma2")
] + [
    ("tp2xreplicate2", "tiny-llama3", {}),
    ("tp2xfsdp2", "tiny-llama3", {"activation_checkpointing": "full"}),
    # the gradient norm the hooks sum: a norm weight replicated over the group counts once
    ("tp2xfsdp2", "tiny-llama3", {"optimizer_in_backward": "true", "max_grad_norm": 0}),
]
IDS = [f"{layout}-{model}" + "".join(f"-{k.split('_')[0]}" for k in extra) for layout, model, extra in CASES]


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, small_corpus):
    """One-process references, made once per (model, global batch, settings)."""
    root = tmp_path_factory.mktemp("single")
    made: dict[tuple, Path] = {}

    def get(model: str, groups: int, settings: dict) -> Path:
        key = (model, groups, tuple(sorted(settings.items())))
        if key not in made:
            out = root / f"{model}-{groups}-{len(made)}"
            over = _overrides(small_corpus, out, batch_size=BATCH * groups, model=model, **settings)
            assert main(["pretrain", *over]) == 0
            made[key] = out
        return made[key]

    return get


def _tensor_parallel_run(corpus: Path, out: Path, layout: str, model: str, **extra) -> Path:
    tp, _, model_args = LAYOUTS[layout]
    settings = {
        "model": model,
        "distributed.tensor_parallel": tp,
        **model_args,
        **MESH.get(layout, {}),
        **extra,
    }
    proc = run_torchrun(
        ["pretrain", *_overrides(corpus, out, batch_size=BATCH, **settings)], nproc=4, timeout=300
    )
    assert f"{tp} tensor-parallel ranks" in proc.stdout
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "model", "extra"), CASES, ids=IDS)
def test_four_ranks_tensor_parallel_train_what_one_process_does(
    layout, model, extra, single_runs, small_corpus, tmp_path
):
    _, groups, model_args = LAYOUTS[layout]
    out = _tensor_parallel_run(small_corpus, tmp_path / layout, layout, model, **extra)
    single = single_runs(model, groups, {**model_args, **extra})
    diffs = _assert_same_run(out, single, tol=WEIGHT_TOL.get(model, TOL))
    print(f"{layout} {model} {extra}: {diffs}")
    assert max(diffs["loss"], diffs["grad_norm"], diffs["val_loss"]) <= TOL, diffs


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, small_corpus) -> Path:
    """An uninterrupted tp=2 x fsdp=2 run of tiny-llama3, DCP checkpoints (2-D DTensors) at steps 2 and 4."""
    return _tensor_parallel_run(
        small_corpus, tmp_path_factory.mktemp("tp") / "run", "tp2xfsdp2", "tiny-llama3"
    )


# where the step-2 checkpoint resumes: ranks (1: one process), batch_size a rank (the global batch stays 8), settings
RESUMED_ON = {
    "one-process": (1, 2 * BATCH, {}),
    "tp2xfsdp2": (4, BATCH, {"distributed.tensor_parallel": 2}),
    "fsdp2-4-ranks": (4, BATCH // 2, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", RESUMED_ON)
def test_a_tensor_parallel_checkpoint_resumes_on_any_mesh(where, tp_run, small_corpus, tmp_path):
    """Saved on the tp=2 x fsdp=2 mesh (DCP shards of 2-D DTensors), interrupted after step 3, resumed at step 2: in
    one process (DCP reshards into one plain model), on the same mesh, and on 4 FSDP2 ranks without tensor
    parallelism; the losses are the uninterrupted run's."""
    nproc, batch, settings = RESUMED_ON[where]
    out = _interrupted_at_step_3(tp_run, tmp_path / where)
    over = _overrides(small_corpus, out, batch_size=batch, resume="true", model="tiny-llama3", **settings)
    if nproc == 1:
        assert main(["pretrain", *over]) == 0
    else:
        assert "resuming at step 2" in run_torchrun(["pretrain", *over], nproc=nproc, timeout=300).stdout
    resumed, reference = _losses(out), _losses(tp_run)
    assert [s for s, _ in resumed] == [s for s, _ in reference] == [1, 2, 3, 4]
    diff = max(abs(a - b) for (_, a), (_, b) in zip(resumed, reference, strict=True))
    print(f"max |resumed ({where}) - tp2 x fsdp2| loss: {diff}")
    assert diff <= TOL


@pytest.mark.slow
def test_lora_under_tensor_parallelism_finetunes_what_one_process_does(hf_checkpoint, tmp_path):
    """LoRA on column-wise (q, v), row-wise (o, down) linears and lm_head, tp=2 x fsdp=2: lora_A / lora_B are
    DTensors split as their weight is; losses, validation losses and the gathered adapter equal one process's."""
    extra = {k.replace("__", "."): v for k, v in {**FINETUNE, **LORA}.items()}
    extra["lora.target_modules"] = "[q_proj,v_proj,o_proj,down_proj,lm_head]"
    single, sharded = tmp_path / "single", tmp_path / "tp"
    assert main(["finetune", *finetune_overrides(hf_checkpoint, single, batch_size=10, **extra)]) == 0
    over = finetune_overrides(
        hf_checkpoint, sharded, batch_size=5, **extra, **{"distributed.tensor_parallel": 2}
    )
    run_torchrun(["finetune", *over], nproc=4, timeout=300)
    diffs, w1 = finetune_diffs(sharded, single)
    print(f"max |tp2 x fsdp2 - 1 process| (lora): {diffs}")
    assert all(d <= TOL for d in diffs.values()), diffs
    assert all(w1[k].abs().max() > 0 for k in w1 if k.endswith("lora_B"))  # it trained


# ----------------------------------------------------------------------------------------------------------------
# In one process: what is refused, before anything is allocated
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (
            ["model=tiny", "distributed.tensor_parallel=4"],
            4,
            "the model's num_heads 4 and num_kv_heads 2 must both",
        ),
        (["model=tiny-qwen3-moe", "distributed.tensor_parallel=2"], 2, "a mixture of experts is not split"),
        (
            ["model=tiny", "distributed.tensor_parallel=2"],
            3,
            "2 ranks per tensor-parallel group need a multiple",
        ),
        (
            ["model=tiny", "distributed.tensor_parallel=2", "distributed.sequence_parallel=2"],
            4,
            "and distributed",
        ),
    ],
)
def test_refusals_name_the_key(overrides, world_size, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["tokenizer.kind=char", *overrides], world_size=world_size, needs_weights=False)
    assert str(info.value).startswith(f"config key 'distributed.tensor_parallel': {message}")


def test_the_plan_refuses_what_it_cannot_split():
    mcfg = model_config("tiny")  # 4 heads, 2 key/value heads
    with torch.device("meta"):
        model = build_decoder(mcfg, device="meta")
    check_tensor_parallel(model, 2)
    with pytest.raises(ValueError, match="num_kv_heads 2 must both be divisible by tensor_parallel 4"):
        check_tensor_parallel(model, 4)


def test_tensor_parallel_blocks_by_name():
    assert tensor_parallel_shape("model.layers.0.self_attn.q_proj.weight", (64, 64), 4) == (16, 64)
    assert tensor_parallel_shape("model.layers.0.mlp.down_proj.weight", (64, 128), 4) == (64, 32)
    assert tensor_parallel_shape("model.layers.0.mlp.down_proj.lora_A", (8, 128), 4) == (8, 32)
    assert tensor_parallel_shape("model.layers.0.self_attn.v_proj.lora_A", (8, 64), 4) == (8, 64)
    assert tensor_parallel_shape("lm_head.lora_B", (62, 8), 4) == (
        16,
        8,
    )  # torch.chunk's rows: 16, 16, 16, 14
    assert tensor_parallel_shape("model.embed_tokens.weight", (62, 64), 2) == (31, 64)
    assert tensor_parallel_shape("model.layers.1.input_layernorm.weight", (64,), 4) == (64,)  # replicated


@pytest.mark.parametrize("overrides", [["distributed.tensor_parallel=2"], ["distributed.tensor_parallel=4"]])
def test_the_estimate_of_a_tensor_parallel_rank_is_its_closed_form(overrides):
    """Rank 0's step traced on fake tensors over a fake 4-rank group (the plan applied, FSDP2 over the rest): its
    parameters, gradients and optimizer state are the closed form's to the byte (the norms replicated over the
    group, the split weights' blocks sharded over the data-parallel ranks)."""
    from memfit.planner.estimate import estimate_run

    settings = ["model=tiny", "model_args.num_kv_heads=4", "tokenizer.kind=char", "optimizer.name=adamw"]
    cfg = load_config(
        None, [*settings, "seq_len=64", "batch_size=1", *overrides], world_size=4, needs_weights=False
    )
    e = estimate_run(cfg, world_size=4)
    assert e.traced_model_states == {k: e.model_states[k] for k in e.traced_model_states}
    assert e.peak_bytes > 0
