"""TensorBoard is an extra: a run that did not ask for it says nothing when the package is missing, one that did
says so once, in words (issue 40, item 4)."""

import sys
import warnings

import pytest

from memfit.cli import main
from memfit.metrics import TENSORBOARD_MISSING, MetricsLogger

from .conftest import tiny_run_overrides


@pytest.fixture
def no_tensorboard(monkeypatch):
    """``from torch.utils.tensorboard import SummaryWriter`` raises ImportError, as without the package."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


@pytest.mark.parametrize(("setting", "said"), [(None, ""), (False, ""), (True, TENSORBOARD_MISSING + "\n")])
def test_a_missing_tensorboard_is_mentioned_only_when_asked_for(
    tmp_path, capsys, no_tensorboard, setting, said
):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Python warning (with its source line) in any case
        with MetricsLogger(tmp_path, tensorboard=setting) as log:
            log.log({"step": 1, "loss": 2.5})
    assert capsys.readouterr().out == said + "step 1 | loss 2.5000\n"
    assert not (tmp_path / "tensorboard").exists()


def test_the_note_says_what_is_missing_and_how_to_get_it():
    assert TENSORBOARD_MISSING == (
        "note: tensorboard=true, but the tensorboard package is not installed, so this run writes no "
        "TensorBoard events (pip install tensorboard)"
    )


def test_auto_writes_events_when_the_package_is_installed(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path) as log:
        log.log({"step": 1, "loss": 2.5})
    assert any((tmp_path / "tensorboard").iterdir())


@pytest.mark.parametrize("setting", ["null", "true"])
def test_a_first_run_without_tensorboard_is_quiet_unless_it_asked(
    small_corpus, tmp_path, capsys, no_tensorboard, setting
):
    """The main job's path through the CLI (``tensorboard`` left at its default, null, or asked for)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert (
            main(["pretrain", *tiny_run_overrides(small_corpus, tmp_path / "run", tensorboard=setting)]) == 0
        )
    out, err = capsys.readouterr()
    assert "tensorboard" not in err.lower()
    assert [line for line in out.splitlines() if "tensorboard" in line.lower()] == (
        [TENSORBOARD_MISSING] if setting == "true" else []
    )
