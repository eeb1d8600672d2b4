"""Loss parity through the real CLI: each memory switch, and their combinations, against the baseline run.

Where the arithmetic is the same (update implementation, optimizer in backward, activation checkpointing, chunked
cross-entropy), losses must agree to 1e-6. Where it is not, the tolerance is stated with its reason.
"""

import shutil

import pytest

from memfit.cli import main
from memfit.metrics import read_records

from .conftest import tiny_run_overrides

STEPS = 10


def _run(corpus, out, **switches):
    over = {
        "max_steps": STEPS,
        "checkpoint_every": 0,
        "eval_every": 0,
        "max_grad_norm": 0,
        "sample.max_new_tokens": 0,
        "optimizer.lr": 3e-3,
        **switches,
    }
    assert main(["pretrain", *tiny_run_overrides(corpus, out, **over)]) == 0
    records = read_records(out / "metrics.jsonl")
    return [r["loss"] for r in records if "loss" in r], [r["val_loss"] for r in records if "val_loss" in r]


@pytest.fixture(scope="module")
def baseline(small_corpus, tmp_path_factory):
    return _run(small_corpus, tmp_path_factory.mktemp("base") / "out")


EXACT = {
    "for_loop": {"optimizer.implementation": "for_loop"},
    "fused": {"optimizer.implementation": "fused"},
    "optimizer_in_backward": {"optimizer_in_backward": "true"},
    "activation_checkpointing_full": {"activation_checkpointing": "full"},
    "activation_checkpointing_selective": {"activation_checkpointing": "selective"},
    "activation_checkpointing_every_2": {
        "activation_checkpointing": "every_n",
        "activation_checkpointing_interval": 2,
    },
    "chunked_cross_entropy_4": {"chunked_cross_entropy": 4},
    "in_backward+checkpointing+chunked": {
        "optimizer_in_backward": "true",
        "activation_checkpointing": "full",
        "chunked_cross_entropy": 4,
    },
    "track_memory": {"track_memory": "true"},
}


def _assert_same_losses(run, baseline, tol):
    """Every step's loss and the last validation loss of ``run`` within ``tol`` of the baseline's."""
    losses, val = run
    assert len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses, baseline[0], strict=True)) <= tol
    assert abs(val[-1] - baseline[1][-1]) <= tol


@pytest.mark.parametrize("name", list(EXACT))
def test_same_arithmetic_same_losses(baseline, small_corpus, tmp_path, name):
    _assert_same_losses(_run(small_corpus, tmp_path / "out", **EXACT[name]), baseline, 1e-6)


# torch.compile (TorchInductor) fuses the elementwise ops of a layer and of the loss into generated kernels whose
# fp32 reductions (RMSNorm's mean of squares, the softmax's sum) add in another order than the eager kernels:
# rounding of fp32 sums, ~1e-7 relative per op, which ten steps of training carry to at most ~1e-6 of the loss
COMPILED = {
    "compile": {"compile": "true"},
    "compile+selective+in_backward+chunked": {
        "compile": "true",
        "activation_checkpointing": "selective",
        "optimizer_in_backward": "true",
        "chunked_cross_entropy": 4,
    },
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_run_has_the_eager_losses(baseline, small_corpus, tmp_path, name):
    _assert_same_losses(_run(small_corpus, tmp_path / "out", **COMPILED[name]), baseline, 1e-5)


# Low-bit optimizer state quantizes m and v (block-wise, 8 bits): updates differ from fp32 AdamW by a few percent
# of their size, so after 10 steps at lr 3e-3 the loss moves by up to ~1e-2 of its value. bf16 rounds weights,
# activations and the update to 8 bits of mantissa (relative error 2**-8 = 0.4%), which compounds over steps.
APPROX = {
    "adamw8bit": ({"optimizer.name": "adamw8bit"}, 0.02),
    "in_backward+adamw8bit": ({"optimizer.name": "adamw8bit", "optimizer_in_backward": "true"}, 0.02),
    "bf16": ({"dtype": "bf16"}, 0.03),
    "bf16_mixed": ({"dtype": "bf16_mixed"}, 0.02),
}


@pytest.mark.parametrize("name", list(APPROX))
def test_different_arithmetic_within_stated_tolerance(baseline, small_corpus, tmp_path, name):
    switches, rel_tol = APPROX[name]
    losses, _ = _run(small_corpus, tmp_path / "out", **switches)
    rel = max(abs(a - b) / b for a, b in zip(losses, baseline[0], strict=True))
    assert rel <= rel_tol
    assert losses[-1] < losses[0] - 0.5  # and it trains


@pytest.mark.parametrize(
    "switches",
    [
        {"optimizer_in_backward": "true"},
        {"optimizer_in_backward": "true", "optimizer.name": "adamw8bit", "activation_checkpointing": "full"},
        {"optimizer.name": "torchao_adamw4bit", "chunked_cross_entropy": 3},
    ],
    ids=["in_backward", "in_backward+adamw8bit+ac", "torchao4bit+chunked"],
)
def test_resume_is_exact_with_memory_switches(small_corpus, tmp_path, switches):
    """Stop after step 5 (checkpoint at 5), resume to 10: the same losses as the uninterrupted run."""
    common = {
        "max_steps": STEPS,
        "eval_every": 0,
        "max_grad_norm": 0,
        "sample.max_new_tokens": 0,
        "optimizer.lr": 3e-3,
        "checkpoint_every": 5,
        **switches,
    }
    full = tmp_path / "full"
    assert main(["pretrain", *tiny_run_overrides(small_corpus, full, **common)]) == 0
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / f"step_{STEPS:08d}")
    assert main(["pretrain", *tiny_run_overrides(small_corpus, part, resume="true", **common)]) == 0
    losses = [[r.get("loss") for r in read_records(d / "metrics.jsonl")] for d in (full, part)]
    assert losses[0] == losses[1]
