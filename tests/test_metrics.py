"""TensorBoard is an extra: a run that did not ask for it says nothing when the package is missing, one that did
says so once, in words (issue 40, item 4)."""

import sys
import warnings

import pytest

from memfit.metrics import TENSORBOARD_MISSING, MetricsLogger


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
