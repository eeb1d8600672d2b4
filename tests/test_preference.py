"""Preference tuning (objective dpo, ipo, simpo, orpo on data.format=preference) through the real CLI.

The checkpoint is tests/conftest.py's tiny Hugging Face directory with SmolLM2's ChatML template beside its
tokenizer; the pairs are tests/assets/preference_pairs.jsonl. At ``seq_len`` 256 it keeps 5 of its 12 pairs (7
prompts fill the rows): 4 train and 1 validation pair, so a batch of 4 is the whole training split at every step
and the DPO loss falls from ln 2 (0.693) to 0.064 in 4 steps at lr 2e-3.

What is checked, with the tolerances measured on these runs:

- DPO against a precomputed reference starts at exactly ln 2 (the policy is the reference), logs TRL's metrics,
  writes ``<reference_dir>/<key>.npy``, reuses it bit for bit, resumes bit for bit; an interrupted precompute
  pass resumes to the same table, computing only what is left; the key follows the weights, rows and dtype.
- LoRA and QLoRA DPO (reference: the policy with its LoRA off) start at ln 2, IPO at ``(1 / (2 beta))^2 = 25``;
  SimPO and ORPO train; a resident reference gives the precomputed reference's losses (measured: equal).
- Every memory switch's parity case (:attr:`memfit.memory.switches.Switch.parity`) on a DPO run: fp32 switches
  within :data:`FP32_TOL` (measured <= 3.5e-7 on the steps' losses, <= 1.2e-6 on the validation loss), bf16 and
  8-bit AdamW within their entry's relative tolerance (measured <= 1.1%) and the loss falls.
- 2 ranks (FSDP2, gloo) train what one process does.
- The estimator's traced step peak of a DPO run is the tracked run's, to the byte (what the loop still holds of the
  previous step aside), and its reference pass the real pass's.
- Config refusals name their key; a malformed record is named by file and line before anything is written.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit import reference
from memfit.build import build_training, run_model_config
from memfit.cli import main
from memfit.config import load_config
from memfit.convert.hf import export_hf
from memfit.data.preference import prepare_preference
from memfit.data.run import preference_data
from memfit.data.templates import resolve_template
from memfit.errors import ConfigError
from memfit.memory.switches import SWITCHES
from memfit.memory.tracker import PHASES, MemoryTracker
from memfit.metrics import read_records
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.objectives import ORPO_METRICS, PAIR_METRICS
from memfit.planner.estimate import estimate_run
from memfit.reference import precompute_reference, reference_key
from memfit.step import sequence_logps, train_step_options
from memfit.tokenizer import load_tokenizer, train_bpe
from memfit.units import GIB
from memfit.validation import reference_mode

from .conftest import ASSETS, run_torchrun
from .test_switch_parity import COMBINATIONS

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = ASSETS / "preference_pairs.jsonl"
LN2 = math.log(2.0)
STEPS = 4
SEQ_LEN = 256  # 4 train pairs and 1 validation pair of the 12
FP32_TOL = 1e-5
"""fp32 switch parity on a DPO run: a pair's loss is a function of its rows' summed reply log-probabilities (tens of
tokens, -20 to -1,100 nats, summed in another order by a chunked loss, a tiled MLP or fused AdamW); measured
<= 1.2e-6."""
TOL = 1e-5  # 2 ranks against one process, as tests/test_distributed.py


def _overrides(checkpoint: Path, out: Path, **extra) -> list[str]:
    """A 4-step DPO full fine-tune of the whole training split each step, its reference beside ``out``."""
    base = {
        "checkpoint_dir": checkpoint,
        "data.path": PAIRS,
        "data.format": "preference",
        "objective": "dpo",
        "output_dir": out,
        "preference.reference_dir": out.with_name(f"{out.name}_reference"),
        "seq_len": SEQ_LEN,
        "batch_size": 4,
        "max_steps": STEPS,
        "log_every": 1,
        "eval_every": 0,
        "checkpoint_every": 0,
        "optimizer.lr": 2e-3,
        "optimizer.warmup_steps": 1,
        "max_grad_norm": 0,  # as tests/test_switch_parity.py: the optimizer in backward does not clip
        "sample.max_new_tokens": 0,
        "loss_plot": False,
        "tensorboard": False,
        "progress_bar": False,
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


def _run(checkpoint: Path, out: Path, **extra) -> tuple[list[dict], list[float]]:
    """Run it; the step records and the validation losses."""
    if str(extra.get("compile", "")).lower() == "true":
        torch._dynamo.reset()  # a fresh compiler per compiled run (see tests/test_switch_parity.py)
    assert main(["finetune", *_overrides(checkpoint, out, **extra)]) == 0
    records = read_records(out / "metrics.jsonl")
    return [r for r in records if "loss" in r], [r["val_loss"] for r in records if "val_loss" in r]


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _numbers(record: dict) -> dict:
    """A step record without its timings and memory."""
    timings = ("tokens_per_second_per_gpu", "mfu")
    return {k: v for k, v in record.items() if k not in timings and not k.startswith("peak_memory")}


def _splits(checkpoint: Path, seq_len: int = SEQ_LEN, val_fraction: float = 0.1):
    """The run's pairs as :func:`memfit.data.run.preference_data` prepares them (the defaults' seed and split)."""
    tokenizer = load_tokenizer(checkpoint)
    template = resolve_template("auto", tokenizer)
    return prepare_preference(
        PAIRS, template, tokenizer, max_seq_len=seq_len, val_fraction=val_fraction, seed=1337
    )


@pytest.fixture(scope="module")
def dpo_run(chat_checkpoint, tmp_path_factory) -> dict:
    """The plain DPO full fine-tune with a precomputed reference (checkpoints at steps 2 and 4): every comparison's
    baseline."""
    root = tmp_path_factory.mktemp("dpo")
    out = root / "base"
    records, val = _run(chat_checkpoint, out, checkpoint_every=2)
    return {"out": out, "reference_dir": root / "base_reference", "records": records, "val": val}


# ----------------------------------------------------------------------------------------------------------------
# DPO with a precomputed reference: the loss, the metrics, the stored file, reuse, resume
# ----------------------------------------------------------------------------------------------------------------


def test_dpo_starts_at_ln2_logs_trl_metrics_and_stores_the_reference(dpo_run, chat_checkpoint):
    records = dpo_run["records"]
    losses = _losses(records)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # step 1: the policy is the reference, every pair's reward 0, its loss -log sigmoid(0)
    assert abs(losses[0] - LN2) <= 1e-6
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.1  # the same 4 pairs every step
    for r in records:
        assert set(PAIR_METRICS) <= r.keys() and "nll_loss" not in r
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
    first, last = records[0], records[-1]
    assert abs(first["rewards/chosen"]) <= 1e-5 and abs(first["rewards/rejected"]) <= 1e-5
    assert last["rewards/accuracies"] == 1.0 and last["rewards/margins"] > 3

    # the stored tables: (pairs, 2) float64 [chosen, rejected], under the key of checkpoint, rows and dtype
    splits = _splits(chat_checkpoint)
    directory = dpo_run["reference_dir"]
    tables = {}
    for label, split in (("train", splits.train), ("val", splits.val)):
        key = reference_key(chat_checkpoint, split.fingerprint(), "fp32")
        tables[label] = np.load(directory / f"{key}.npy")
        assert tables[label].shape == (len(split), 2) and tables[label].dtype == np.float64
        side = json.loads((directory / f"{key}.json").read_text())
        assert side["pairs"] == len(split) and side["split"] == label and side["dtype"] == "fp32"
    assert (len(splits.train), len(splits.val)) == (4, 1)
    assert sorted(p.name for p in directory.iterdir() if p.suffix == ".npy") == sorted(
        f"{reference_key(chat_checkpoint, s.fingerprint(), 'fp32')}.npy" for s in (splits.train, splits.val)
    )
    assert not list(directory.glob("*.partial.npz")) and not list(directory.glob(".*tmp"))
    # step 1's policy log-probabilities are the reference's: the means of the table's columns
    means = tables["train"].mean(axis=0)
    assert first["logps/chosen"] == pytest.approx(means[0], rel=1e-6)
    assert first["logps/rejected"] == pytest.approx(means[1], rel=1e-6)


def test_a_second_run_reuses_the_reference_bit_for_bit(dpo_run, chat_checkpoint, tmp_path, capsys):
    directory = dpo_run["reference_dir"]
    stamps = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    capsys.readouterr()
    records, val = _run(
        chat_checkpoint, tmp_path / "again", checkpoint_every=2, **{"preference.reference_dir": directory}
    )
    out = capsys.readouterr().out
    assert out.count("reference log-probabilities of 4 train pairs: reused") == 1
    assert out.count("reference log-probabilities of 1 val pairs: reused") == 1
    assert "computing" not in out
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == stamps
    # every loss, norm and metric bit-identical (the timings and the memory aside)
    assert [_numbers(r) for r in records] == [_numbers(r) for r in dpo_run["records"]]
    assert val == dpo_run["val"]


def test_resume_gives_the_uninterrupted_losses(dpo_run, chat_checkpoint, tmp_path, capsys):
    """Stop after step 2 (checkpoint at 2), resume to 4 with the stored reference gone: the resumed run computes it
    again from checkpoint_dir's weights (not the step-2 weights it resumes), and every loss is the same."""
    part = tmp_path / "part"
    shutil.copytree(dpo_run["out"], part)
    shutil.rmtree(part / "checkpoints" / f"step_{STEPS:08d}")
    capsys.readouterr()
    records, val = _run(chat_checkpoint, part, checkpoint_every=2, resume="true")
    assert "reference log-probabilities of 4 train pairs: computed in" in capsys.readouterr().out
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in dpo_run["records"]
    ]
    assert val == dpo_run["val"]
    directory = dpo_run["reference_dir"]
    for table in directory.glob("*.npy"):  # the same tables, bit for bit
        assert np.array_equal(np.load(table), np.load(part.with_name("part_reference") / table.name))


@pytest.fixture(scope="module")
def seven_pairs(chat_checkpoint):
    """A random tiny model (512 ids) and the 7 pairs of the file that fit 512 tokens, all in one split."""
    model = build_decoder(model_config("tiny", vocab_size=512), seed=0)
    return model, _splits(chat_checkpoint, 512, val_fraction=0.0).train


def _precompute(model, split, directory: Path, batch_size: int) -> np.ndarray:
    return precompute_reference(
        model,
        split,
        batch_size=batch_size,
        device=torch.device("cpu"),
        directory=directory,
        key="pairs",
        step_options={"dtype": "fp32", "chunked_cross_entropy": 0, "compile": False},
    )


class _Interrupted(Exception):
    """The pass stopped from outside (a kill, a preemption)."""


class _Forwards:
    """``memfit.reference.sequence_logps`` counting its calls, raising :class:`_Interrupted` after ``fail_after``
    of them."""

    def __init__(self, fail_after: int | None = None):
        self.calls, self.fail_after = 0, fail_after

    def __call__(self, *args, **kwargs):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise _Interrupted
        self.calls += 1
        return sequence_logps(*args, **kwargs)


def test_an_interrupted_precompute_resumes_to_the_same_table(seven_pairs, tmp_path, monkeypatch):
    """7 pairs in batches of 2: 4 forwards. Interrupted in the third, with a partial file after each batch: the
    rerun computes the last 2 batches only, and the table equals an uninterrupted pass's bit for bit."""
    model, split = seven_pairs
    assert len(split) == 7
    whole = _precompute(model, split, tmp_path / "whole", 2)
    assert whole.shape == (7, 2) and np.isfinite(whole).all()
    monkeypatch.setattr(reference, "SAVE_EVERY_S", 0.0)
    directory = tmp_path / "interrupted"
    monkeypatch.setattr(reference, "sequence_logps", _Forwards(fail_after=2))
    with pytest.raises(_Interrupted):
        _precompute(model, split, directory, 2)
    assert sorted(p.name for p in directory.iterdir()) == ["pairs.partial.npz"]  # no table, no temporary
    with np.load(directory / "pairs.partial.npz") as saved:
        assert np.array_equal(saved["logps"][:4], whole[:4]) and np.isnan(saved["logps"][4:]).all()

    forwards = _Forwards()
    monkeypatch.setattr(reference, "sequence_logps", forwards)
    resumed = _precompute(model, split, directory, 2)
    assert forwards.calls == 2
    assert np.array_equal(resumed, whole)
    assert sorted(p.name for p in directory.iterdir()) == ["pairs.json", "pairs.npy"]
    assert np.array_equal(np.load(directory / "pairs.npy"), whole)
    assert np.array_equal(_precompute(model, split, directory, 2), whole) and forwards.calls == 2  # read


def test_a_partial_pass_resumes_under_another_batch_size(seven_pairs, tmp_path, monkeypatch):
    """Interrupted after 3 batches of 1 pair (pairs 0-2 done), rerun with batch 2 (a smaller batch_size after an
    out-of-memory error, or another reference_batch_size): the pairs left (3-6) are computed, in 2 forwards."""
    model, split = seven_pairs
    whole = _precompute(model, split, tmp_path / "whole", 1)
    monkeypatch.setattr(reference, "SAVE_EVERY_S", 0.0)
    monkeypatch.setattr(reference, "sequence_logps", _Forwards(fail_after=3))
    with pytest.raises(_Interrupted):
        _precompute(model, split, tmp_path / "b", 1)
    forwards = _Forwards()
    monkeypatch.setattr(reference, "sequence_logps", forwards)
    np.testing.assert_allclose(_precompute(model, split, tmp_path / "b", 2), whole, rtol=1e-6)
    assert forwards.calls == 2


def _double_in_place(path: Path, name: str, rows: slice = slice(None)) -> tuple[int, int]:
    """Double rows of an fp32 tensor of a safetensors file where they lie (the file's size and every other byte
    kept); the byte range changed."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8 : 8 + n])[name]
    assert entry["dtype"] == "F32"
    first, last = entry["data_offsets"]
    row = 4 * math.prod(entry["shape"][1:])
    start, stop, _ = rows.indices(entry["shape"][0])
    start, end = 8 + n + first + start * row, 8 + n + first + stop * row
    assert end <= 8 + n + last
    raw[start:end] = (2 * np.frombuffer(bytes(raw[start:end]), dtype=np.float32)).tobytes()
    path.write_bytes(raw)
    return start, end


def test_the_key_follows_the_weights_the_rows_and_the_dtype(chat_checkpoint, tmp_path):
    train = _splits(chat_checkpoint).train.fingerprint()
    key = reference_key(chat_checkpoint, train, "fp32")
    # a copy of the same files keeps it
    copy = shutil.copytree(chat_checkpoint, tmp_path / "copy")
    assert reference_key(copy, train, "fp32") == key
    # other weights of the same shapes
    changed = shutil.copytree(chat_checkpoint, tmp_path / "changed")
    _double_in_place(changed / "model.safetensors", "model.norm.weight")
    assert reference_key(changed, train, "fp32") != key
    # other rows: seq_len 512 keeps 6 train pairs; the validation pair is not cut at either length, so its rows
    # and its key are the same
    longer = _splits(chat_checkpoint, 512)
    assert len(longer.train) == 6
    assert reference_key(chat_checkpoint, longer.train.fingerprint(), "fp32") != key
    assert longer.val.fingerprint() == _splits(chat_checkpoint).val.fingerprint()
    # another dtype policy
    assert reference_key(chat_checkpoint, train, "bf16") != key


def test_the_key_follows_weights_in_the_middle_of_a_file(small_corpus, tmp_path):
    tokenizer = train_bpe(small_corpus.read_text(encoding="utf-8")[:5000], 300)
    a = export_hf(
        build_decoder(model_config("tiny", vocab_size=8192), seed=0), tmp_path / "a", tokenizer=tokenizer
    )
    b = shutil.copytree(a, tmp_path / "b")
    weights = b / "model.safetensors"
    start, end = _double_in_place(weights, "model.embed_tokens.weight", rows=slice(1000, 1064))
    assert 2**20 < start and end < weights.stat().st_size - 2**20  # between the first and the last MiB
    assert reference_key(b, "pairs", "fp32") != reference_key(a, "pairs", "fp32")


# ----------------------------------------------------------------------------------------------------------------
# The other references and objectives
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, first",
    [
        ({"method": "lora"}, LN2),  # reference: the policy with its LoRA off; lora_B starts at 0
        ({"method": "qlora"}, LN2),
        ({"objective": "ipo"}, 25.0),  # (0 - 1 / (2 beta))^2 at beta 0.1
        ({"objective": "simpo"}, None),
        ({"objective": "orpo"}, None),
    ],
    ids=["lora", "qlora", "ipo", "simpo", "orpo"],
)
def test_other_methods_and_objectives_train(extra, first, chat_checkpoint, tmp_path):
    records, val = _run(chat_checkpoint, tmp_path / "out", **extra)
    losses = _losses(records)
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses + val)
    assert losses[-1] < losses[0]  # the same 4 pairs every step
    if first is not None:
        assert abs(losses[0] - first) <= 1e-6 * max(first, 1.0)
    names = PAIR_METRICS + (ORPO_METRICS + ("nll_loss",) if extra.get("objective") == "orpo" else ())
    for r in records:
        assert set(names) <= r.keys() and all(math.isfinite(r[k]) for k in names)
    if extra.get("objective") == "simpo":
        assert "nll_loss" not in records[0]  # cpo_alpha 0
    # only the precomputed reference (IPO's here) is stored
    assert (tmp_path / "out_reference").exists() == (extra.get("objective") == "ipo")


def test_a_resident_reference_gives_the_precomputed_losses(dpo_run, chat_checkpoint, tmp_path):
    records, val = _run(chat_checkpoint, tmp_path / "out", **{"preference.reference": "resident"})
    assert not (tmp_path / "out_reference").exists()
    assert max(abs(a - b) for a, b in zip(_losses(records), _losses(dpo_run["records"]), strict=True)) <= 1e-6
    assert abs(val[-1] - dpo_run["val"][-1]) <= 1e-6


# ----------------------------------------------------------------------------------------------------------------
# Switch parity: every switch's own case, and tests/test_switch_parity.py's combinations
# ----------------------------------------------------------------------------------------------------------------


CASES = {
    **{",".join(f"{k}={v}" for k, v in p.settings.items()): p for s in SWITCHES for p in s.parity},
    **COMBINATIONS,
}
FAST = {
    "optimizer_in_backward=true",
    "activation_checkpointing=full",
    "chunked_cross_entropy=4",
    "tiled_mlp=4",
    "activation_offloading=True,activation_checkpointing=full",
    "dtype=bf16",
}


def _case(name: str):
    return pytest.param(name, marks=[] if name in FAST else [pytest.mark.slow])


@pytest.mark.parametrize("name", [_case(n) for n in CASES])
def test_preference_losses_keep_the_switch_parity(name, dpo_run, chat_checkpoint, tmp_path):
    """Every step's loss and the validation loss within ``max(entry's tolerance, FP32_TOL)`` of the plain DPO run;
    entries of other arithmetic (bf16, 8-bit state) within their relative tolerance, and the loss falls."""
    parity = CASES[name]
    records, val = _run(chat_checkpoint, tmp_path / "out", **parity.settings)
    losses, base = _losses(records), _losses(dpo_run["records"])
    assert len(losses) == STEPS
    if parity.relative:
        assert max(abs(a - b) / b for a, b in zip(losses, base, strict=True)) <= parity.tolerance
        assert losses[-1] < losses[0] - 0.5
    else:
        tol = max(parity.tolerance, FP32_TOL)
        assert max(abs(a - b) for a, b in zip(losses, base, strict=True)) <= tol
        assert abs(val[-1] - dpo_run["val"][-1]) <= tol


# ----------------------------------------------------------------------------------------------------------------
# Sharded: 2 ranks (FSDP2, gloo) against one process
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_ranks_train_what_one_process_does(method, dpo_run, chat_checkpoint, tmp_path):
    """Batch 2 on each of 2 ranks against batch 4 in one process; the precomputed reference (full) is computed
    sharded, each rank a batch of each round, rank 0 writing the table."""
    # LoRA without dropout: its masks would differ between the runs (as tests/test_distributed.py's LoRA runs)
    extra = {"method": method} if method == "full" else {"method": method, "lora.dropout": 0}
    if method == "full":
        single, single_val = dpo_run["records"], dpo_run["val"]
    else:
        single, single_val = _run(chat_checkpoint, tmp_path / "single", **extra)
    sharded = tmp_path / "sharded"
    run_torchrun(["finetune", *_overrides(chat_checkpoint, sharded, batch_size=2, **extra)], timeout=180)
    records = [r for r in read_records(sharded / "metrics.jsonl") if "loss" in r]
    val = [r["val_loss"] for r in read_records(sharded / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for name in ("loss", "grad_norm", *PAIR_METRICS[:3]):
        assert max(abs(a[name] - b[name]) for a, b in zip(records, single, strict=True)) <= TOL, name
    assert abs(val[-1] - single_val[-1]) <= TOL
    if method == "full":
        directory = sharded.with_name("sharded_reference")
        tables = sorted(directory.glob("*.npy"))
        assert [t.name for t in tables] == sorted(t.name for t in dpo_run["reference_dir"].glob("*.npy"))
        for table in tables:  # summed reply log-probabilities of -20 to -1,100 nats
            np.testing.assert_allclose(
                np.load(table), np.load(dpo_run["reference_dir"] / table.name), rtol=1e-6
            )
    else:
        assert not sharded.with_name("sharded_reference").exists()


# ----------------------------------------------------------------------------------------------------------------
# The estimator
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["full", "lora"])
def test_estimate_of_a_preset_preference_run(method, capsys):
    """``memfit estimate`` without a checkpoint: 2B rows a micro-batch, and (full: a precomputed reference) the
    reference pass as a phase of its own."""
    args = {
        "model": "tiny",
        "tokenizer.kind": "char",
        "tokenizer.vocab_size": 65,
        "optimizer.name": "adamw",
        "method": method,
        "objective": "dpo",
        "data.format": "preference",
        "data.path": PAIRS,
        "batch_size": 2,
        "seq_len": 32,
    }
    assert main(["estimate", *[f"{k}={v}" for k, v in args.items()], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_memory_gib"] == pytest.approx(sum(out["breakdown"].values()), rel=1e-12)
    assert out["phase"] in PHASES and out["breakdown"]["activations"] > 0
    assert ("reference" in out["phase_peaks_gib"]) == (method == "full")
    assert (out["batch_size"], out["seq_len"], out["config"]["method"]) == (2, 32, method)


def _long_pairs(path: Path, corpus: Path) -> Path:
    """4 pairs whose every row fills 161 tokens (short prompts, 600-character replies of the corpus), so that each
    batch of the run is ``2B x seq_len`` as the estimator traces it."""
    text = corpus.read_text(encoding="utf-8")
    replies = [text[600 * i : 600 * (i + 1)] for i in range(8)]
    records = [
        {"prompt": f"Recite passage {i}.", "chosen": replies[2 * i], "rejected": replies[2 * i + 1]}
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


ESTIMATE_CASES = {
    "dpo": {},
    "dpo_lora": {"method": "lora"},
    "dpo_resident": {"preference.reference": "resident"},
    "dpo_chunked_checkpointed": {"chunked_cross_entropy": 4, "activation_checkpointing": "full"},
    "orpo": {"objective": "orpo"},
}


@pytest.mark.parametrize(
    "case", [c if c == "dpo" else pytest.param(c, marks=pytest.mark.slow) for c in ESTIMATE_CASES]
)
def test_predicted_peak_of_a_preference_run_is_the_tracked_peak(
    case, chat_checkpoint, small_corpus, tmp_path
):
    """The traced step against ``track_memory``'s breakdown (tests/memory/test_estimate.py), to the byte: the run
    holds one thing the trace does not, the previous step's result (loss, grad_norm: fp32; num_tokens: int64; and
    each of the objective's 0-dim fp32 metrics). A precomputed reference's pass, traced as a phase of its own,
    against the real pass under a tracker: that holds the previous round's results (``2B`` float64 log-probs, the
    ``(1, B, 2)`` float64 gather) and the round's ``(B,)`` int64 pair index besides."""
    data = _long_pairs(tmp_path / "long.jsonl", small_corpus)
    over = {
        "data.path": data,
        "data.val_fraction": 0,
        "seq_len": 160,
        "batch_size": 2,
        "max_steps": 3,
        "track_memory": "true",
        **ESTIMATE_CASES[case],
    }
    run = _overrides(chat_checkpoint, tmp_path / "run", **over)
    cfg = load_config(None, run)
    pairs = preference_data(cfg, load_tokenizer(chat_checkpoint), 160).pairs
    assert pairs.stats.num_truncated == len(pairs.train) == 4  # every row cut to 161 tokens: batches (4, 160)
    gc.collect()
    gc.disable()  # as tests/memory/test_estimate.py: nothing freed by chance between steps
    try:
        assert main(["finetune", *run]) == 0
    finally:
        gc.enable()
    records = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "memory_breakdown" in r]
    assert len(records) == 3
    measured = max(round(sum(r["memory_breakdown"].values()) * GIB) for r in records)
    estimate = estimate_run(cfg)
    metrics = PAIR_METRICS + (ORPO_METRICS + ("nll_loss",) if case == "orpo" else ())
    assert set(metrics) <= records[0].keys()
    assert measured - estimate.peak_bytes == 4 + 4 + 8 + 4 * len(metrics), (measured, estimate.peak_bytes)

    # the reference pass
    if reference_mode(cfg) != "precomputed":
        assert estimate.reference_peak_bytes is None
        return
    built = build_training(cfg, run_model_config(cfg), torch.device("cpu"))
    tracker = MemoryTracker(built.model, built.optimizer, refresh_roles_at_peak=False)
    with tracker:
        precompute_reference(
            built.model,
            pairs.train,
            batch_size=2,
            device=torch.device("cpu"),
            directory=tmp_path / "pass",
            key="pass",
            step_options=train_step_options(cfg),
        )
    B = cfg.batch_size
    assert tracker.peak_bytes - estimate.reference_peak_bytes == 8 * (2 * B + 2 * B) + 8 * B


# ----------------------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------------------


REFUSALS = {
    "dpo_on_dolly": ({"data.format": "dolly", "data.path": ASSETS / "dolly_sample.json"}, "data.format"),
    "pairs_for_next_token": ({"objective": "next_token"}, "objective"),
    "lora_off_without_lora": ({"preference.reference": "lora_off"}, "preference.reference"),
    "simpo_with_a_reference": (
        {"objective": "simpo", "preference.reference": "precomputed"},
        "preference.reference",
    ),
    "packing": ({"data.packing": "true"}, "data.packing"),
    "ipo_label_smoothing": (
        {"objective": "ipo", "preference.label_smoothing": 0.2},
        "preference.label_smoothing",
    ),
    "dpo_cpo_alpha": ({"preference.cpo_alpha": 0.5}, "preference.cpo_alpha"),
    "train_on_prompt": ({"data.train_on_prompt": "true"}, "data.train_on_prompt"),
    "sequence_parallel": ({"distributed.sequence_parallel": 2}, "distributed.sequence_parallel"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_key(case, chat_checkpoint, tmp_path, capsys):
    extra, key = REFUSALS[case]
    args = _overrides(chat_checkpoint, tmp_path / "out", **extra)
    world = 2 if "distributed.sequence_parallel" in extra else 1
    with pytest.raises(ConfigError, match=rf"^config key '{key}': "):
        load_config(None, args, world_size=world)
    if world == 1:  # the CLI: exit status 2, the message on stderr, nothing written
        assert main(["finetune", *args]) == 2
        assert f"config key '{key}': " in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_a_malformed_record_is_named_before_anything_is_written(chat_checkpoint, tmp_path, capsys):
    lines = PAIRS.read_text(encoding="utf-8").splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + lines[1] + '{"prompt": "hi", "chosen": "a"}\n' + lines[2], encoding="utf-8")
    out = tmp_path / "out"
    assert main(["finetune", *_overrides(chat_checkpoint, out, **{"data.path": bad})]) == 1
    err = capsys.readouterr().err
    assert f"'{bad}' record 2 (0-based; line 3) is malformed: missing field 'rejected'" in err
    assert "data.skip_malformed" in err
    assert not out.exists() and not out.with_name("out_reference").exists()
