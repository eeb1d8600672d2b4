"""Checkpoints: atomic writes, keep-last-K, and clear errors for missing or truncated files."""

import json

import pytest
import torch

from memfit import checkpoint as ckpt_io
from memfit.config import OptimizerConfig
from memfit.errors import CheckpointError
from memfit.memory.optim import build_optimizer
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.step import train_step
from memfit.tokenizer import CharTokenizer

TOK = CharTokenizer.from_text("abcdefgh")


def _trained(name="tiny", seed=0):
    cfg = model_config(name, vocab_size=TOK.vocab_size)
    model = build_decoder(cfg, seed=seed)
    opt = build_optimizer(model, OptimizerConfig())
    x = torch.randint(0, TOK.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    train_step(model, opt, [(x[:, :-1], x[:, 1:])], max_grad_norm=1.0, dtype="fp32")
    return cfg, model, opt


def _save(out, step, cfg, model, opt, keep=3):
    return ckpt_io.save_checkpoint(out, step, model, cfg, opt, {"note": "test"}, TOK, keep)


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_round_trip_restores_weights_and_optimizer_exactly(tmp_path, name):
    cfg, model, opt = _trained(name)
    path = _save(tmp_path, 7, cfg, model, opt)
    assert path.name == "step_00000007"
    assert {p.name for p in path.iterdir()} == {
        "model.safetensors",
        "model_config.json",
        "optimizer.pt",
        "trainer_state.json",
        "tokenizer",
    }
    assert ckpt_io.read_model_config(path) == cfg
    model2 = build_decoder(cfg, seed=123)
    opt2 = build_optimizer(model2, OptimizerConfig())
    state = ckpt_io.load_checkpoint(path, model2, opt2)
    assert state["step"] == 7 and state["note"] == "test"
    for (n1, p1), (_, p2) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(p1, p2), n1
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][field], s2["state"][k][field])
    if cfg.tie_word_embeddings:
        assert model2.lm_head.weight is model2.model.embed_tokens.weight


def test_keeps_only_the_last_k(tmp_path):
    cfg, model, opt = _trained()
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, cfg, model, opt, keep=2)
    assert [p.name for p in ckpt_io.list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg, model, opt = _trained()
    good = _save(tmp_path, 1, cfg, model, opt)
    before = (good / "model.safetensors").read_bytes()

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_io.torch, "save", boom)
    with pytest.raises(CheckpointError, match="the disk is full .*step_00000001. is kept"):
        _save(tmp_path, 2, cfg, model, opt)
    assert ckpt_io.latest_checkpoint(tmp_path) == good
    assert (good / "model.safetensors").read_bytes() == before
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]


def test_unfinished_temporary_directories_are_ignored_and_cleaned(tmp_path):
    cfg, model, opt = _trained()
    good = _save(tmp_path, 1, cfg, model, opt)
    stale = tmp_path / "checkpoints" / ".tmp-step_00000002-999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert ckpt_io.latest_checkpoint(tmp_path) == good
    ckpt_io.remove_stale_temporaries(tmp_path)
    assert not stale.exists()


def test_truncated_weights_name_the_file(tmp_path):
    cfg, model, opt = _trained()
    path = _save(tmp_path, 1, cfg, model, opt)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors' is truncated"):
        ckpt_io.load_checkpoint(
            path, build_decoder(cfg), build_optimizer(build_decoder(cfg), OptimizerConfig())
        )


def test_truncated_weights_without_size_record_still_fail_clearly(tmp_path):
    cfg, model, opt = _trained()
    path = _save(tmp_path, 1, cfg, model, opt)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors' are truncated or corrupt"):
        ckpt_io.load_weights(path, build_decoder(cfg))


def test_missing_files_and_corrupt_state(tmp_path):
    cfg, model, opt = _trained()
    path = _save(tmp_path, 1, cfg, model, opt)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="missing 'optimizer.pt'"):
        ckpt_io.load_checkpoint(
            path, build_decoder(cfg), build_optimizer(build_decoder(cfg), OptimizerConfig())
        )
    (path / "trainer_state.json").write_text('{"step": 1, "rng"')
    with pytest.raises(CheckpointError, match="trainer_state.json' is truncated or corrupt"):
        ckpt_io.read_trainer_state(path)


def test_resolve_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        ckpt_io.resolve_checkpoint(tmp_path / "nothing")
    cfg, model, opt = _trained()
    _save(tmp_path, 1, cfg, model, opt)
    last = _save(tmp_path, 2, cfg, model, opt)
    assert ckpt_io.resolve_checkpoint(tmp_path) == last
    assert ckpt_io.resolve_checkpoint(last) == last


def test_weights_of_another_architecture_are_refused(tmp_path):
    cfg, model, opt = _trained()
    path = _save(tmp_path, 1, cfg, model, opt)
    other = build_decoder(model_config("tiny", vocab_size=TOK.vocab_size, intermediate_size=96))
    with pytest.raises(CheckpointError, match="has shape"):
        ckpt_io.load_weights(path, other)


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        ckpt_io.check_writable(blocker / "run")


def test_sizes_are_recorded(tmp_path):
    cfg, model, opt = _trained()
    path = _save(tmp_path, 1, cfg, model, opt)
    sizes = json.loads((path / "trainer_state.json").read_text())["file_sizes"]
    assert sizes["model.safetensors"] == (path / "model.safetensors").stat().st_size


def test_signals_that_arrive_while_a_checkpoint_is_written_take_effect_after_it():
    """SIGTERM / SIGINT raised inside ``save`` would interrupt torch's writers (which can abort the process half-way,
    issue 22 item 9): they are held, then delivered once, in order, to the handlers in place before."""
    import os
    import signal

    seen = []
    previous = {
        s: signal.signal(s, lambda signum, frame: seen.append(signum))
        for s in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        with ckpt_io.signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # Python runs handlers between bytecodes: give them every chance
                sum(range(100))
            assert seen == []
        assert seen == [signal.SIGTERM, signal.SIGINT]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _same(a, b) -> bool:
    """Two optimizer-state values equal to the bit (tensors, numbers, and the dicts bitsandbytes nests them in)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same(a[k], b[k]) for k in a)
        )
    return a == b


def _state(opt):
    return {
        k: {f: v.clone() if isinstance(v, torch.Tensor) else v for f, v in s.items()}
        for k, s in opt.state_dict()["state"].items()
    }


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "muon", "adafactor", "adam_mini", "lion8bit"])
def test_the_optimizer_state_is_laid_out_as_torchs_initialiser_lays_it_out(name):
    """memfit's own initialiser (no import of torch.distributed.checkpoint) against torch's
    ``_init_optim_state``: the same state, entry by entry, to the bit; the weights and the lrs untouched, no
    gradient left; a state that holds tensors is left as it is."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    states = []
    for init in (ckpt_io.init_optimizer_state, _init_optim_state):
        model = build_decoder(model_config("tiny", vocab_size=TOK.vocab_size), seed=0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = build_optimizer(model, OptimizerConfig(name=name))
        lrs = [g["lr"] for g in opt.param_groups]
        init(opt)
        assert [g["lr"] for g in opt.param_groups] == lrs
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        states.append(_state(opt))
        if init is ckpt_io.init_optimizer_state:
            init(opt)  # again: nothing changes
            assert _same(_state(opt), states[0])
    ours, torchs = states
    assert len(ours) > 0 and _same(ours, torchs)
