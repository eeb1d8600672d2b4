"""Every verb refuses a memfit checkpoint that lacks one of its files in the same words, naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from memfit.cli import main
from tests.conftest import tiny_run_overrides


@pytest.fixture(scope="module")
def finished(tmp_path_factory, small_corpus) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    over = {"max_steps": 2, "checkpoint_every": 0, "eval_every": 0, "sample.max_new_tokens": 0}
    assert main(["pretrain", *tiny_run_overrides(small_corpus, out, **over)]) == 0
    return out


def _verbs(ckpt: Path, small_corpus: Path, tmp_path: Path) -> dict[str, list[str]]:
    finetune = tiny_run_overrides(small_corpus, tmp_path / "ft", max_steps=1, **{"sample.max_new_tokens": 0})
    finetune = [o for o in finetune if not o.startswith(("model=", "tokenizer.kind="))]
    return {
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "A", "--max-new-tokens", "2"],
        "export": ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")],
        "finetune": ["finetune", f"checkpoint_dir={ckpt}", *finetune],
    }


@pytest.mark.parametrize(
    "name", ["model_config.json", "model.safetensors", "trainer_state.json", "tokenizer"]
)
@pytest.mark.parametrize("verb", ["generate", "export", "finetune", "resume"])
def test_a_missing_file_is_named_the_same_way_by_every_verb(
    finished, small_corpus, tmp_path, capsys, name, verb
):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    ckpt = run / "checkpoints" / "step_00000002"
    target = ckpt / name
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    if verb == "resume":
        argv = ["pretrain", *tiny_run_overrides(small_corpus, run, resume="true", max_steps=4)]
    else:
        argv = _verbs(ckpt, small_corpus, tmp_path)[verb]
    assert main(argv) == 1
    err = capsys.readouterr().err
    shown = name + ("/" if name == "tokenizer" else "")
    assert (
        f"memfit: error: checkpoint '{ckpt}' is missing '{shown}'; it is incomplete: memfit writes a " in err
    )
    assert "Traceback" not in err
