"""The training step: token-weighted accumulation, determinism, fake-tensor execution, the LR schedule."""

import inspect
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.config import OptimizerConfig, load_config
from memfit.memory.optim import build_optimizer, lr_at, param_groups
from memfit.memory.techniques import IGNORE_INDEX
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.step import evaluate, evaluation_options, train_step, train_step_options


def _model_and_opt(seed=0, dtype=torch.float32):
    model = build_decoder(model_config("tiny"), dtype=dtype, seed=seed)
    return model, build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1))


def _batch(seed, B=4, T=16, vocab=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _max_param_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def test_accumulation_equals_one_big_batch():
    x, y = _batch(1)
    y[0, :10] = IGNORE_INDEX  # uneven token counts across micro-batches: weighting must be by token
    y[3, 2:] = IGNORE_INDEX
    # SGD with lr 1: the parameter change *is* the (clipped) gradient, so parameters compare gradients exactly
    # (AdamW's first step g / (|g| + eps) would amplify rounding noise of near-zero gradients).
    m1, m2 = (build_decoder(model_config("tiny"), seed=0) for _ in range(2))
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=1.0) for m in (m1, m2))
    r1 = train_step(m1, o1, [(x, y)], max_grad_norm=1.0, dtype="fp32")
    r2 = train_step(
        m2, o2, [(x[:1], y[:1]), (x[1:3], y[1:3]), (x[3:], y[3:])], max_grad_norm=1.0, dtype="fp32"
    )
    assert r1.num_tokens.item() == r2.num_tokens.item() == 4 * 16 - 10 - 14
    assert abs(r1.loss.item() - r2.loss.item()) <= 1e-6
    assert abs(r1.grad_norm.item() - r2.grad_norm.item()) <= 1e-5
    assert _max_param_diff(m1, m2) <= 1e-6


def test_loss_is_mean_token_cross_entropy():
    x, y = _batch(2)
    model, opt = _model_and_opt()
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    result = train_step(model, opt, [(x, y)], max_grad_norm=0.0, dtype="fp32")
    assert result.loss.item() == pytest.approx(expected, abs=1e-6)
    assert math.log(256) - 0.5 < expected < math.log(256) + 0.5  # a fresh model is near uniform


def test_gradient_clipping_reports_the_norm_before_clipping():
    x, y = _batch(3)
    m1, o1 = _model_and_opt()
    m2, o2 = _model_and_opt()
    r_clip = train_step(m1, o1, [(x, y)], max_grad_norm=1e-3, dtype="fp32")
    r_free = train_step(m2, o2, [(x, y)], max_grad_norm=0.0, dtype="fp32")
    assert r_clip.grad_norm.item() == pytest.approx(r_free.grad_norm.item(), rel=1e-6)
    assert r_clip.grad_norm.item() > 1e-3
    assert _max_param_diff(m1, m2) > 0  # clipping changed the update


def test_steps_are_deterministic_under_a_seed():
    losses = []
    for _ in range(2):
        model, opt = _model_and_opt(seed=5)
        losses.append(
            [
                train_step(model, opt, [_batch(s)], max_grad_norm=1.0, dtype="fp32").loss.item()
                for s in range(3)
            ]
        )
    assert losses[0] == losses[1]
    assert losses[0][2] < losses[0][0]


@pytest.mark.parametrize("dtype, param_dtype", [("bf16", torch.bfloat16), ("bf16_mixed", torch.float32)])
def test_dtype_policies_keep_what_they_say(dtype, param_dtype):
    model = build_decoder(model_config("tiny"), dtype=param_dtype, seed=0)
    opt = build_optimizer(model, OptimizerConfig())
    result = train_step(model, opt, [_batch(0)], max_grad_norm=1.0, dtype=dtype)
    assert result.loss.dtype == torch.float32 and math.isfinite(result.loss.item())
    p = model.model.layers[0].self_attn.q_proj.weight
    assert p.dtype == param_dtype
    assert opt.state[p]["exp_avg"].dtype == param_dtype and opt.state[p]["exp_avg_sq"].dtype == param_dtype


def test_no_weight_decay_on_norms():
    model = build_decoder(model_config("tiny"), seed=0)
    decay, no_decay = param_groups(model, 0.1)
    assert all("norm" in n for n in no_decay["param_names"])
    assert len(no_decay["param_names"]) == 2 * 2 + 1  # two norms per layer, two layers, the final norm
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert "model.embed_tokens.weight" in decay["param_names"]


def test_lr_schedule_warmup_then_cosine():
    kw = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "max_steps": 110}
    assert lr_at(0, **kw) == pytest.approx(1e-4)
    assert lr_at(9, **kw) == pytest.approx(1e-3)
    assert lr_at(10, **kw) == pytest.approx(1e-3)
    assert lr_at(60, **kw) == pytest.approx(5.5e-4)
    assert lr_at(110, **kw) == pytest.approx(1e-4)


def test_one_step_of_llama3_8b_runs_on_fake_tensors():
    """The very train_step of a run, on a Llama-3-8B-shaped model that exists only as metadata."""
    cfg = model_config("llama3-8b")
    with FakeTensorMode():
        model = build_decoder(cfg, device="cpu", dtype=torch.bfloat16, init=False)
        opt = build_optimizer(model, OptimizerConfig(implementation="for_loop"))
        x = torch.randint(0, cfg.vocab_size, (1, 64))
        result = train_step(model, opt, [(x, x)], max_grad_norm=1.0, dtype="bf16")
        assert result.loss.shape == () and result.grad_norm.shape == ()
        q = model.model.layers[0].self_attn.q_proj.weight
        assert opt.state[q]["exp_avg"].shape == (4096, 4096)
        assert q.grad is None  # zero_grad(set_to_none=True) ran
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_step_and_evaluation_options_are_the_config_keys_of_the_same_name():
    cfg = load_config(None, ["chunked_cross_entropy=4", "dtype=bf16", "moe.router_aux_loss_coef=0"])
    device = torch.device("cpu")
    step = train_step_options(cfg)
    assert step == {
        "max_grad_norm": cfg.max_grad_norm,
        "router_aux_loss_coef": 0.0,  # moe.router_aux_loss_coef: the step's own name for it
        "preference": None,  # objective=next_token
        "dtype": "bf16",
        "chunked_cross_entropy": 4,
        "compile": False,
    }
    assert set(step) <= set(inspect.signature(train_step).parameters)
    options = evaluation_options(cfg, device)
    assert options == {
        "dtype": "bf16", "chunked_cross_entropy": 4, "compile": False, "device": device, "preference": None
    }  # fmt: skip
    assert set(options) == set(inspect.signature(evaluate).parameters) - {"model", "batches"}


def test_resume_notes_name_changed_keys_but_not_keys_newer_than_the_run(small_corpus, tmp_path):
    """A key the checkpoint's run did not have (added to memfit since) ran with what is now its default: no note."""
    from memfit.config import config_to_dict
    from memfit.resume import resume_notes

    from .conftest import tiny_run_overrides

    cfg = load_config(None, tiny_run_overrides(small_corpus, tmp_path, **{"optimizer.lr": 0.001}))
    saved = config_to_dict(cfg)
    saved["optimizer"] = {**saved["optimizer"], "lr": 0.002}
    del saved["optimizer"]["muon_ns_dtype"]  # a run saved before the key existed
    assert resume_notes(cfg, {"config": saved}) == [
        "note: resuming with optimizer.lr=0.001; the checkpoint's run had optimizer.lr=0.002"
    ]


def test_a_cpu_run_creates_the_low_bit_state_before_its_first_step(small_corpus, tmp_path, monkeypatch):
    """A CPU run creates torchao's state before its first step (so it packs in glibc's heap instead of landing
    between the first backward's temporaries: docs/memory.md, "At scale"), every byte of it, and then steps."""
    pytest.importorskip("torchao")
    from memfit import train as train_module
    from memfit.memory.optim import optimizer_state_bytes

    from .conftest import tiny_run_overrides

    seen = []
    real_create, real_step = train_module.create_state, train_module.train_step

    def create(optimizer):
        made = real_create(optimizer)
        seen.append(("create", made, optimizer_state_bytes(optimizer)))
        return made

    def step(model, optimizer, *args, **kwargs):
        seen.append(("step", optimizer_state_bytes(optimizer)))
        return real_step(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(train_module, "create_state", create)
    monkeypatch.setattr(train_module, "train_step", step)
    overrides = tiny_run_overrides(
        small_corpus, tmp_path, max_steps=2, **{"optimizer.name": "torchao_adamw4bit"}
    )
    cfg = load_config(None, [*overrides, "optimizer_in_backward=true", "max_grad_norm=0"])
    train_module.train(cfg)
    (_, made, created), *steps = seen
    assert made == sum(
        1 for _ in build_decoder(model_config("tiny"), seed=0).parameters()
    )  # one per parameter
    assert created > 0 and steps == [("step", created), ("step", created)]
