"""The main job through the real CLI on a tiny model: records, checkpoints, exact resume, generation, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.metrics import read_records

from .conftest import tiny_run_overrides

TRAIN_FIELDS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_second_per_gpu",
    "mfu",
    "peak_memory_active",
    "peak_memory_alloc",
    "peak_memory_reserved",
    "peak_memory_rss",
}


def _losses(out: Path) -> tuple[list, list]:
    records = read_records(out / "metrics.jsonl")
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return train, val


def _main_job(corpus: Path, out: Path, **extra) -> list[str]:
    """The tiny run with everything the main job does once in a while, checked here: validation and a checkpoint
    every 4 steps, the sample and the loss plot."""
    over = {"eval_every": 4, "checkpoint_every": 4, "sample.max_new_tokens": 16, "loss_plot": True}
    return tiny_run_overrides(corpus, out, **{**over, **extra})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, small_corpus):
    out = tmp_path_factory.mktemp("run") / "out"
    assert main(["pretrain", *_main_job(small_corpus, out)]) == 0
    return out


def test_run_writes_records_checkpoints_plot(finished_run):
    records = read_records(finished_run / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    for r in train:
        assert set(r) == TRAIN_FIELDS
        assert r["peak_memory_active"] is None  # no CUDA allocator on CPU
        assert 0 < r["peak_memory_rss"] < 8 and r["tokens_per_second_per_gpu"] > 0
    assert [(r["step"]) for r in records if "val_loss" in r] == [4, 8, 12]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert [p.name for p in sorted((finished_run / "checkpoints").iterdir())] == [
        "step_00000004",
        "step_00000008",
        "step_00000012",
    ]
    assert (finished_run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (finished_run / "wandb").exists()  # wandb is off by default
    state = json.loads((finished_run / "checkpoints" / "step_00000012" / "trainer_state.json").read_text())
    assert state["step"] == 12 and state["config"]["model"] == "tiny"


def test_a_run_from_scratch_without_an_optimizer_trains_with_muon(small_corpus, tmp_path, capsys):
    """The main job's default (config.default_optimizer): Muon on the hidden matrices, AdamW on the rest, said in
    the banner and recorded in the checkpoint's config (so a resume keeps it)."""
    overrides = [
        o for o in tiny_run_overrides(small_corpus, tmp_path / "run") if not o.startswith("optimizer.name=")
    ]
    assert main(["pretrain", *overrides, "max_steps=8", "checkpoint_every=8"]) == 0
    banner = capsys.readouterr().out
    # the tiny model: 2 layers x 7 matrices (dim 64, kv 32, SwiGLU 128); embedding, head and 5 norms on AdamW
    assert "optimizer muon (muon: 14 matrices (0.1M), adamw: 7 tensors" in banner, banner
    state = json.loads(
        (tmp_path / "run" / "checkpoints" / "step_00000008" / "trainer_state.json").read_text()
    )
    assert state["config"]["optimizer"]["name"] == "muon"
    train, _ = _losses(tmp_path / "run")
    assert train[-1][1] < train[0][1] - 0.3  # 5.546 -> 5.132 measured


def test_resuming_with_another_optimizer_names_the_key(finished_run, small_corpus, tmp_path, capsys):
    """The run trained with AdamW; a config that leaves optimizer.name out now means Muon: refused, naming the key
    and the run's optimizer, before anything is loaded."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    overrides = [
        o for o in tiny_run_overrides(small_corpus, out, resume="true") if not o.startswith("optimizer.name=")
    ]
    assert main(["pretrain", *overrides]) == 2
    err = capsys.readouterr().err
    assert "config key 'optimizer.name'" in err and "trained with 'adamw'" in err and "asks for 'muon'" in err


def test_generate_continues_the_prompt_deterministically(finished_run, capsys):
    args = ["generate", "--checkpoint", str(finished_run), "--prompt", "ROMEO:", "--max-new-tokens", "24"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("ROMEO:") and len(first.strip()) > len("ROMEO:")


def test_same_seed_same_losses(finished_run, small_corpus, tmp_path):
    out = tmp_path / "again"
    assert main(["pretrain", *_main_job(small_corpus, out)]) == 0
    assert _losses(out) == _losses(finished_run)


def test_resume_from_a_checkpoint_logs_the_same_losses(finished_run, small_corpus, tmp_path):
    """A run killed at step 10 (last checkpoint: step 8) resumes to exactly the uninterrupted numbers."""
    out = tmp_path / "interrupted"
    shutil.copytree(finished_run, out)
    # the state a kill at step 10 leaves: checkpoints 4 and 8, records up to step 10, no final artefacts
    shutil.rmtree(out / "checkpoints" / "step_00000012")
    records = [r for r in read_records(out / "metrics.jsonl") if r["step"] <= 10]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["pretrain", *_main_job(small_corpus, out, resume="true")]) == 0
    assert _losses(out) == _losses(finished_run)


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_is_exact(small_corpus, tmp_path):
    ref = tmp_path / "ref"
    over = dict(max_steps=120, checkpoint_every=7, eval_every=30, log_every=1)
    assert main(["pretrain", *tiny_run_overrides(small_corpus, ref, **over)]) == 0

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "memfit", "pretrain", *tiny_run_overrides(small_corpus, out, **over)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoints" / "step_00000014").exists():
        time.sleep(0.01)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / "checkpoints").exists()
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, resume="true", **over)]) == 0
    assert _losses(out) == _losses(ref)


def test_a_second_run_does_not_overwrite_the_first(finished_run, small_corpus, capsys):
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    assert main(["pretrain", *_main_job(small_corpus, finished_run)]) == 1
    assert "resume=true" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "corpus.txt' does not exist"),
        (b"", "corpus.txt' holds no document"),
        (b"To be\nor \xff not", "corpus.txt:2: not valid UTF-8: byte 0xff at column 4"),
        (b"To be or not.\n" * 2, "fewer than one window"),
    ],
    ids=["missing", "empty", "invalid-utf8", "too-short"],
)
def test_bad_corpus_is_one_clear_error(tmp_path, capsys, content, expected):
    corpus = tmp_path / "corpus.txt"
    if content is not None:
        corpus.write_bytes(content)
    assert main(["pretrain", *tiny_run_overrides(corpus, tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_unwritable_output_dir(tmp_path, small_corpus, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["pretrain", *tiny_run_overrides(small_corpus, tmp_path / "file" / "out")]) == 1
    assert "is a file, not a directory" in capsys.readouterr().err


def test_generate_from_missing_or_truncated_checkpoint(finished_run, tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "A"]) == 1
    assert "does not exist" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(finished_run / "checkpoints" / "step_00000012", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["generate", "--checkpoint", str(broken), "--prompt", "A"]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors' is truncated" in err


def test_resume_with_a_truncated_latest_checkpoint_says_what_to_do(
    finished_run, small_corpus, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    opt = out / "checkpoints" / "step_00000012" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:100])
    assert main(["pretrain", *_main_job(small_corpus, out, resume="true", max_steps=16)]) == 1
    err = capsys.readouterr().err
    assert "optimizer.pt' is truncated" in err and "Delete" in err


def test_track_memory_adds_the_breakdown_and_a_timeline(small_corpus, tmp_path):
    out = tmp_path / "tracked"
    over = {"track_memory": "true", "max_steps": 4, "checkpoint_every": 0, "eval_every": 0, "log_every": 2}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **over)]) == 0
    train = [r for r in read_records(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        b = r["memory_breakdown"]
        assert set(b) == {"parameters", "gradients", "optimizer_state", "activations", "temporaries"}
        # tiny model, char vocabulary: 4 bytes per parameter and 8 of AdamW state (+ 4-byte step counters)
        from memfit.models.presets import model_config

        num_params = model_config("tiny").num_params()
        assert b["parameters"] * 1024**3 >= 4 * num_params
        assert b["optimizer_state"] * 1024**3 >= 8 * num_params
        assert r["memory_peak_phase"] in {"forward", "backward", "optimizer_step"}
    assert (out / "memory_timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_resuming_a_finished_run_adds_nothing(finished_run, small_corpus, tmp_path, capsys):
    out = tmp_path / "done"
    shutil.copytree(finished_run, out)
    before = (out / "metrics.jsonl").read_text()
    assert main(["pretrain", *_main_job(small_corpus, out, resume="true")]) == 0
    assert "already complete at step 12" in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == before
    assert [p.name for p in sorted((out / "checkpoints").iterdir())][-1] == "step_00000012"


def test_resume_with_another_tokenizer_is_refused(finished_run, small_corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    shutil.copytree(finished_run, out)
    gpt2 = Path(__file__).parent / "assets"
    over = _main_job(small_corpus, out, resume="true", max_steps=16, **{"tokenizer.kind": "file"})
    assert main(["pretrain", *over, f"tokenizer.path={gpt2}"]) == 2
    assert "config key 'tokenizer'" in capsys.readouterr().err


def test_cached_token_files_follow_the_tokenizer_settings(small_corpus, tmp_path, capsys):
    out = tmp_path / "cache"
    common = {"max_steps": 2, "checkpoint_every": 0, "eval_every": 0, "sample.max_new_tokens": 0}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **common)]) == 0
    shutil.rmtree(out / "checkpoints")  # a new run in the same directory, with a BPE tokenizer this time
    bpe = {**common, "tokenizer.kind": "bpe", "tokenizer.vocab_size": 300, "model_args.vocab_size": 512}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **bpe)]) == 0
    assert "tokenizer bpe (300 ids)" in capsys.readouterr().out


def test_generate_shows_the_prompt_as_given_and_no_special_tokens(finished_run, capsys):
    prompt = "Zé€ and"
    assert (
        main(["generate", "--checkpoint", str(finished_run), "--prompt", prompt, "--max-new-tokens", "80"])
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith(prompt)
    assert "<unk>" not in text and "<bos>" not in text and "<eos>" not in text


def test_bad_corpus_creates_no_output_dir(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["pretrain", *tiny_run_overrides(tmp_path / "missing.txt", out)]) == 1
    assert not out.exists()


def test_sentencepiece_continuation_keeps_its_leading_space():
    """SentencePiece drops the space that starts a continuation decoded alone; generate decodes prompt and
    continuation together, so the text is the decoding of all ids."""
    import torch

    from memfit.generate import generate_text
    from memfit.models.decoder import build_decoder
    from memfit.models.presets import model_config
    from memfit.tokenizer import load_tokenizer
    from tests.conftest import ASSETS

    tokenizer = load_tokenizer(ASSETS / "sentencepiece_2k.model")
    model = build_decoder(model_config("tiny", vocab_size=tokenizer.vocab_size), seed=0).eval()
    prompt = "What is a llama?"
    text = generate_text(model, tokenizer, prompt, max_new_tokens=8, temperature=0, top_k=0)
    ids = tokenizer.encode(prompt, bos=True)  # Llama 2's SentencePiece reads text with BOS first
    with torch.no_grad():
        for _ in range(8):
            nxt = int(model(torch.tensor([ids]))[0, -1, : tokenizer.vocab_size].argmax())
            ids.append(nxt)
            if nxt == tokenizer.eos_id:
                break
    specials = set(tokenizer.special_tokens.values())
    assert text == tokenizer.decode([i for i in ids if i not in specials])
    assert text.startswith(prompt)
