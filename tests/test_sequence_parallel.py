"""Sequence parallelism (``distributed.sequence_parallel``, DeepSpeed-Ulysses) through the real CLI under torchrun
on CPU (gloo): 2 ranks sharing each sequence (sp=2) train exactly what one process does on the same sequences
(losses, gradient norms, validation losses, final weights), with every long-context switch and with LoRA on packed
instruction rows; a SIGKILLed run resumes exactly, and its checkpoint resumes in one process. In-process: each
rank's slice of a batch, and the all-to-all volume the cost model charges, counted in a traced step by hand."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.cli import main
from memfit.config import load_config
from memfit.errors import ConfigError
from memfit.memory import switches
from memfit.memory.ulysses import shard_batch
from memfit.metrics import read_records
from memfit.models.decoder import packed_positions

from .conftest import finetune_overrides, kill_launch, run_torchrun, tiny_run_overrides
from .test_distributed import (
    LORA,
    RUN,
    TOL,
    _assert_same_run,
    _interrupted_at_step_3,
    _losses,
    finetune_diffs,
)

SP2 = {"distributed.sequence_parallel": 2}


def _overrides(corpus: Path, out: Path, **extra) -> list[str]:
    extra = {k.replace("__", "."): v for k, v in {**RUN, **extra}.items()}
    return tiny_run_overrides(corpus, out, **extra)


LONG_CONTEXT = {
    "chunked_cross_entropy": 4,
    "tiled_mlp": 3,
    "activation_checkpointing": "full",
    "activation_offloading": "true",
}


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, small_corpus) -> dict[str, Path]:
    """One-process references with the same batch_size 4 a sequence-parallel group shares: plain, and the
    long-context switches with the optimizer in backward."""
    root = tmp_path_factory.mktemp("single")
    runs = {
        "plain": {},
        "long_context": {**LONG_CONTEXT, "optimizer_in_backward": "true", "max_grad_norm": 0},
    }
    for name, extra in runs.items():
        assert main(["pretrain", *_overrides(small_corpus, root / name, batch_size=4, **extra)]) == 0
    assert main(["pretrain", *_overrides(small_corpus, root / "batch8", batch_size=8)]) == 0
    return {**{name: root / name for name in runs}, "batch8": root / "batch8"}


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory, small_corpus) -> tuple[Path, str]:
    """2 ranks, sp=2 (one data-parallel group), batch_size 4: checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("sp") / "run"
    proc = run_torchrun(["pretrain", *_overrides(small_corpus, out, batch_size=4, **SP2)])
    return out, proc.stdout


@pytest.mark.slow
def test_two_ranks_sharing_each_sequence_train_what_one_process_does(sp_run, single_runs):
    out, stdout = sp_run
    _assert_same_run(out, single_runs["plain"])
    assert (
        "1 data-parallel x 2 sequence-parallel ranks (fsdp2 over all 2; 16 tokens of each sequence a rank)"
        in (stdout)
    )
    assert stdout.count("final validation loss") == 1
    assert (out / "checkpoints" / "step_00000004" / "dcp" / ".metadata").is_file()
    # the checkpoint is an ordinary sharded one: one process samples from it
    assert main(["generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "8"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-gemma2", "tiny-mistral"])
def test_on_other_families(model, small_corpus, tmp_path):
    """Sequence parallelism on windowed attention (Mistral's, Gemma 2's local layers beside its global ones and
    soft-capped scores): each rank holds all positions of its heads after the all-to-all, so one process's
    numbers."""
    single, out = tmp_path / "single", tmp_path / "sp"
    assert main(["pretrain", *_overrides(small_corpus, single, batch_size=4, model=model)]) == 0
    run_torchrun(["pretrain", *_overrides(small_corpus, out, batch_size=4, model=model, **SP2)])
    _assert_same_run(out, single)


@pytest.mark.slow
def test_with_every_long_context_switch_and_the_optimizer_in_backward(single_runs, small_corpus, tmp_path):
    """Full checkpointing recomputes each layer's forward in the backward, all-to-alls included (every rank in
    the same order); the tiled MLP and the chunked loss run on the rank's tokens; offloading hooks around each
    layer; the optimizer steps in backward after FSDP2's reduce-scatter; ``track_memory`` names the fullest rank."""
    out = tmp_path / "long_context"
    extra = {
        **LONG_CONTEXT,
        "optimizer_in_backward": "true",
        "max_grad_norm": 0,
        "track_memory": "true",
        **SP2,
    }
    run_torchrun(["pretrain", *_overrides(small_corpus, out, batch_size=4, **extra)])
    _assert_same_run(
        out, single_runs["long_context"]
    )  # tracked here, untracked there: tracking changes nothing
    tracked = [r for r in read_records(out / "metrics.jsonl") if "memory_breakdown" in r]
    assert len(tracked) == RUN["max_steps"]
    assert all(r["memory_peak_rank"] in (0, 1) and r["memory_breakdown"]["activations"] > 0 for r in tracked)


@pytest.mark.slow
def test_compiled(single_runs, small_corpus, tmp_path):
    """compile=true: each decoder layer is compiled with its all-to-alls (functional collectives trace into the
    graph): the same losses as one eager process."""
    out = tmp_path / "compiled"
    run_torchrun(
        ["pretrain", *_overrides(small_corpus, out, batch_size=4, compile="true", **SP2)], timeout=400
    )
    _assert_same_run(out, single_runs["plain"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "sp, reference",
    [(2, "batch8"), (4, "plain")],
    ids=["2x2-mesh", "sp4-kv-heads-repeated"],
)
def test_four_ranks(sp, reference, single_runs, small_corpus, tmp_path):
    """4 ranks: a 2-D mesh of 2 data-parallel groups x 2 ranks a sequence (the global batch: 2 x 4 sequences,
    as one process with batch 8), and one group of 4, where the tiny model's 2 key/value heads are each repeated
    to fill the 4 ranks."""
    out = tmp_path / f"sp{sp}"
    extra = {"distributed.sequence_parallel": sp}
    proc = run_torchrun(
        ["pretrain", *_overrides(small_corpus, out, batch_size=4, **extra)], nproc=4, timeout=180
    )
    assert f"{4 // sp} data-parallel x {sp} sequence-parallel ranks" in proc.stdout
    _assert_same_run(out, single_runs[reference])


@pytest.mark.slow
def test_lora_on_packed_instruction_rows(hf_checkpoint, tmp_path):
    """LoRA on Dolly records packed into rows (document masks and positions that restart per sample, kept global
    across the ranks' halves), the rows padded to an even length; the gathered adapter equals one process's."""
    extra = {
        **{k: v for k, v in LORA.items()},
        "data.packing": "true",
        "seq_len": 256,
        "max_steps": 4,
        "eval_every": 2,
        "checkpoint_every": 2,
    }
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    assert main(["finetune", *finetune_overrides(hf_checkpoint, single, batch_size=2, **extra)]) == 0
    proc = run_torchrun(
        ["finetune", *finetune_overrides(hf_checkpoint, sharded, batch_size=2, **extra, **SP2)]
    )
    assert "2 sequence-parallel ranks" in proc.stdout
    diffs, w1 = finetune_diffs(sharded, single)
    print(f"max |sp=2 - 1 process| (LoRA, packed): {diffs}")
    assert all(d <= TOL for d in diffs.values()), diffs
    assert all(w1[k].abs().max() > 0 for k in w1 if k.endswith("lora_B"))  # it trained


@pytest.mark.slow
def test_its_checkpoint_resumes_in_one_process_on_the_same_sequences(
    sp_run, single_runs, small_corpus, tmp_path
):
    """Elastic: sp=2 on 2 ranks -> one process with the same batch_size (the same sequences a step)."""
    out = _interrupted_at_step_3(sp_run[0], tmp_path / "one")
    assert main(["pretrain", *_overrides(small_corpus, out, batch_size=4, resume="true")]) == 0
    resumed, reference = _losses(out), _losses(single_runs["plain"])
    assert [s for s, _ in resumed] == [s for s, _ in reference] == [1, 2, 3, 4]
    diff = max(abs(a - b) for (_, a), (_, b) in zip(resumed, reference, strict=True))
    print(f"max |resumed in 1 process - 1 process| loss: {diff}")
    assert diff <= TOL


def _last_by_step(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(out / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow
def test_a_sigkilled_run_resumes_exactly(small_corpus, tmp_path):
    """``memfit pretrain nproc=2 distributed.sequence_parallel=2`` killed (SIGKILL, launcher and workers) after
    its second checkpoint, then resumed: the losses of an uninterrupted sp=2 run, to the bit."""
    run = dict(max_steps=10, eval_every=0, checkpoint_every=2, sample__max_new_tokens=0, seq_len=64, **SP2)
    reference = tmp_path / "reference"
    run_torchrun(["pretrain", *_overrides(small_corpus, reference, batch_size=4, **run)], timeout=180)
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [
        sys.executable,
        "-m",
        "memfit",
        "pretrain",
        "nproc=2",
        *_overrides(small_corpus, out, batch_size=4, **run),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 150
    while not (out / "checkpoints" / "step_00000004").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 4"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher; its workers, in sessions of their own, below
    kill_launch(proc, [])
    done = _last_by_step(out)
    assert max(done) < run["max_steps"], "killed too late to test a resume"
    over = _overrides(small_corpus, out, batch_size=4, resume="true", **run)
    assert "resuming at step" in run_torchrun(["pretrain", *over], timeout=180).stdout
    assert _last_by_step(out) == _last_by_step(reference)


# ----------------------------------------------------------------------------------------------------------------
# In one process: the batch slices, the refusals, the all-to-all volume
# ----------------------------------------------------------------------------------------------------------------


def test_shard_batch_keeps_positions_and_documents_global():
    B, T = 2, 10
    inputs = torch.arange(B * T).reshape(B, T)
    targets = inputs + 1
    doc_ids = torch.tensor([[0] * 3 + [1] * 5 + [2] * 2, [0] * 9 + [1]])
    parts = [shard_batch((inputs, targets, doc_ids), r, 4) for r in range(4)]  # 10 -> padded to 12
    assert torch.equal(torch.cat([p[0] for p in parts], 1)[:, :T], inputs)
    assert torch.equal(torch.cat([p[0] for p in parts], 1)[:, T:], torch.zeros(B, 2, dtype=torch.long))
    assert (torch.cat([p[1] for p in parts], 1)[:, T:] == -100).all()  # padding counts nowhere
    assert all(p[2].shape == (B, 12) for p in parts)  # every rank: the whole rows' documents
    assert (
        torch.equal(parts[0][2][:, :T], doc_ids)
        and (parts[0][2][:, T:] == doc_ids.amax(1, keepdim=True) + 1).all()
    )
    whole = packed_positions(parts[0][2])
    assert torch.equal(torch.cat([p[3] for p in parts], 1), whole)
    assert parts[1][3].tolist() == [[0, 1, 2], [3, 4, 5]]  # tokens 3..5: doc 1 starts at 3; row 2 still doc 0
    plain = [shard_batch((inputs, targets), r, 2) for r in range(2)]
    assert plain[1][2] is None and plain[1][3].tolist() == [5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (
            {"distributed.sequence_parallel": 4},
            2,
            "4 ranks per sequence need a multiple of 4 ranks, and the run has 2",
        ),
        ({"distributed.sequence_parallel": 2, "seq_len": 33}, 2, "seq_len 33 is not divisible by 2"),
        (
            {"distributed.sequence_parallel": 3, "model": "tiny", "seq_len": 96},
            3,
            "num_heads 4 is not divisible",
        ),
        (
            {
                "distributed.sequence_parallel": 2,
                "model": "tiny",
                "model_args.num_kv_heads": 1,
                "seq_len": 96,
            },
            6,
            None,
        ),
    ],
)
def test_refusals_name_the_key(overrides, world_size, message):
    args = [f"{k}={v}" for k, v in {"tokenizer.kind": "char", **overrides}.items()]
    if message is None:  # 1 kv head repeated over 2 ranks: accepted (world 6 = 3 data-parallel x 2)
        load_config(None, args, world_size=world_size, needs_weights=False)
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, args, world_size=world_size, needs_weights=False)
    assert str(info.value).startswith("config key 'distributed.sequence_parallel': ")
    assert message in str(info.value)


class _CountAllToAll(TorchDispatchMode):
    """Elements passed to all-to-all collectives (forward and backward) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_to_all" in str(func):
            self.calls.append(args[0].numel())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sp, kv_sent", [(2, 2), (4, 4)])  # tiny: 4 heads, 2 kv heads (split; repeated to 4)
def test_all_to_all_volume_by_hand(sp, kv_sent):
    """One traced training step on rank 0 of a fake process group: the elements sent through the all-to-alls
    are, per layer, B * T/N * hd * (2 nh + 2 kv heads sent) in the forward, as many in the backward and again in
    the recomputed forward (full checkpointing); the cost model's closed form is that times (N - 1) / N (what
    leaves the rank)."""
    from memfit.build import build_training, run_model_config
    from memfit.planner.fake_trace import fake_ids, fake_process_group
    from memfit.step import train_step, train_step_options

    B, T = 2, 64
    args = [
        "model=tiny",
        "tokenizer.kind=char",
        f"seq_len={T}",
        f"batch_size={B}",
        "activation_checkpointing=full",
    ]
    cfg = load_config(
        None, [*args, f"distributed.sequence_parallel={sp}"], world_size=sp, needs_weights=False
    )
    mcfg = run_model_config(cfg)
    counter = _CountAllToAll()
    with fake_process_group(sp):
        built = build_training(cfg, mcfg, torch.device("cpu"), world_size=sp)
        batch = shard_batch((fake_ids(B, T, mcfg.vocab_size), fake_ids(B, T, mcfg.vocab_size)), 0, sp)
        with counter:
            train_step(built.model, built.optimizer, [batch], **train_step_options(cfg))
    hd, nh, L = mcfg.head_dim, mcfg.num_heads, mcfg.num_layers
    per_layer = B * (T // sp) * hd * (2 * nh + 2 * kv_sent)  # q, o: nh heads; k, v: kv_sent heads
    assert sum(counter.calls) == 3 * L * per_layer  # forward, recomputed forward, backward
    assert len(counter.calls) == 3 * L * 4
    assert switches.all_to_all_elements(B, T, nh, mcfg.num_kv_heads, hd, sp) == per_layer * (sp - 1) // sp
    # the cost model: 1/N of the compute, and those bytes at the interconnect
    from memfit.planner.cost import CostRequest, step_cost

    states = {"trainable_parameters": 0, "parameters": 0, "gradients": 0}
    one = step_cost(
        CostRequest(
            load_config(None, args, needs_weights=False), mcfg, world_size=1, seq_len=T, states=states
        )
    )
    split = step_cost(CostRequest(cfg, mcfg, world_size=sp, seq_len=T, states=states))
    assert split["compute"] == pytest.approx(one["compute"] / sp)
    assert split["exchange"] == pytest.approx(3 * L * per_layer * (sp - 1) / sp * 4 / 200e9)
