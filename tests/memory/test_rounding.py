"""``bf16_rounding``: stochastic rounding is unbiased, Kahan's compensation keeps what nearest loses, every optimizer
computes its bf16 update in fp32 and rounds it, chunk by chunk where the update is elementwise, and the estimate
and the closed form see its bytes."""

from __future__ import annotations

import json
import math
import shutil
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.cli import main
from memfit.config import OptimizerConfig
from memfit.memory import hybrids, optimizers, rounding
from memfit.memory.optim import build_optimizer, optimizer_state_bytes
from memfit.metrics import read_records
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from tests.conftest import tiny_run_overrides

# ----------------------------------------------------------------------------------------------------------------
# The rounding itself
# ----------------------------------------------------------------------------------------------------------------


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each fp32 value of ``x`` (toward zero and away from it)."""
    bits = x.view(torch.int32)
    down = (bits & -65536).view(torch.float32)
    up = ((bits & -65536) + 65536).view(torch.float32)
    return down, up


@pytest.mark.parametrize(
    "value", [1.0 + 0.3 * 2**-7, -3.0 - 0.71 * 2**-6, 1e-3 * (1 + 0.05 * 2**-7), 7.5e4 + 13]
)
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(value):
    """Each draw is one of the two bf16 neighbours; the mean of n = 400,000 draws is the fp32 value within 5
    standard errors (the spread of one draw is gap * sqrt(q (1 - q)), q the fraction toward the upper one)."""
    torch.manual_seed(0)
    n = 400_000
    x = torch.full((n,), value, dtype=torch.float32)
    out = rounding.stochastic_round_(torch.empty(n, dtype=torch.bfloat16), x).float()
    down, up = (t[0].item() for t in _neighbours(x))
    assert set(out.unique().tolist()) == {down, up}
    q = (value - down) / (up - down)
    assert abs(out.eq(up).double().mean().item() - q) < 5 * math.sqrt(q * (1 - q) / n)
    standard_error = abs(up - down) * math.sqrt(q * (1 - q) / n)
    assert abs(out.double().mean().item() - value) < 5 * standard_error


def test_stochastic_rounding_keeps_bf16_values_infinities_and_nan():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, -1.0e-38], dtype=torch.bfloat16)
    special = torch.tensor([math.inf, -math.inf, math.nan])
    for _ in range(20):
        assert torch.equal(rounding.stochastic_round_(torch.empty_like(exact), exact.float()), exact)
        out = rounding.stochastic_round_(torch.empty(3, dtype=torch.bfloat16), special).float()
        assert out[0] == math.inf and out[1] == -math.inf and out[2].isnan()


def test_stochastic_rounding_is_seeded_by_the_global_generator():
    x = torch.rand(1000) * 1e-2 + 1
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append(rounding.stochastic_round_(torch.empty(1000, dtype=torch.bfloat16), x))
    assert torch.equal(*draws)


def test_kahan_keeps_what_nearest_loses():
    """300 additions of 1e-4 to 1.0 in bf16 (a gap of 2**-7 at 1): nearest stays at 1 and loses all 0.03; the weight
    plus its bf16 compensation ends within 1e-3 of 1.03 (measured 9e-4: the compensation's own rounding, 2**-9 of
    it, repeats the same way each step), 30 times closer."""
    p_nearest = torch.ones(4, dtype=torch.bfloat16)
    p_kahan, comp = torch.ones(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    for _ in range(300):
        with rounding.rounded(p_nearest, "nearest") as target:
            target.add_(1e-4)
        with rounding.rounded(p_kahan, "kahan", comp) as target:
            target.add_(1e-4)
    assert torch.equal(p_nearest, torch.ones(4, dtype=torch.bfloat16))
    total = p_kahan.double() + comp.double()
    assert ((total - (1 + 300e-4)).abs() < 1e-3).all(), total


# ----------------------------------------------------------------------------------------------------------------
# Every optimizer: the update in fp32, rounded
# ----------------------------------------------------------------------------------------------------------------


def _tiny(dtype=torch.bfloat16):
    mcfg = model_config("tiny")
    return mcfg, build_decoder(mcfg, seed=0).to(dtype)


def _steps(model, opt, steps: int, *, in_backward: bool, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    losses = []
    for _ in range(steps):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        if not in_backward:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", optimizers.OPTIMIZER_NAMES)
@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_every_optimizer_rounds_its_bf16_update(name, mode, one_thread, monkeypatch):
    """Three steps of a tiny bf16 model: the loss falls, the weights stay bf16 and move, each update is the same
    in backward and after it (kahan: to the bit; its draws aside, stochastic too), and the state holds exactly
    the closed form's bytes (plus kahan's bf16 buffer per weight)."""
    entry = optimizers.spec(name)
    pytest.importorskip(entry.library)
    monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", 4096)  # several chunks of the tiny embedding
    results = {}
    for in_backward in (False, True):
        mcfg, model = _tiny()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # paged optimizers run unpaged on CPU, and say so
            opt = build_optimizer(
                model, OptimizerConfig(name=name, lr=1e-3), in_backward=in_backward, rounding=mode
            )
            losses = _steps(model, opt, 3, in_backward=in_backward)
        assert losses[-1] < losses[0], losses
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
        results[in_backward] = {n: p.detach().clone() for n, p in model.named_parameters()}
        tensors = optimizers.tensor_infos(
            name,
            [(n, tuple(p.shape), p.element_size(), p.ndim) for n, p in model.named_parameters()],
            dim=mcfg.dim,
            num_heads=mcfg.num_heads,
        )
        kahan = sum(rounding.compensation_bytes(mode, t.numel, t.size) for t in tensors)
        assert optimizer_state_bytes(opt) == entry.state(tensors) + kahan
    if mode == "kahan":
        for n, p in results[True].items():
            assert torch.equal(p, results[False][n]), n


def test_stochastic_updates_that_nearest_cancels_survive_on_average(one_thread):
    """AdamW with a constant gradient moves each weight by ~lr a step. At 1e-4 a step from 1.0 (a bf16 gap of
    2**-7), nearest never moves; stochastic rounding (the weights) and kahan (the weights plus their compensation)
    follow the fp32 run: the mean over 4,096 weights within 1e-4 of it after 50 steps (the fp32 run moved by
    5e-3)."""
    finals = {}
    for mode, dtype in (("nearest", torch.bfloat16), ("stochastic", torch.bfloat16), ("kahan", torch.bfloat16),
                        ("nearest", torch.float32)):  # fmt: skip
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.ones(64, 64, dtype=dtype))
        opt = build_optimizer(
            torch.nn.ParameterDict({"w": p}),
            OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.0),
            rounding=mode,
        )
        for _ in range(50):
            p.grad = torch.full_like(p, 0.5)
            opt.step()
        value = p.detach().double()
        if mode == "kahan":  # the weight and its compensation: what the next update starts from
            value += opt.state[p][rounding.COMPENSATION].double()
        finals[(mode, str(dtype))] = value.mean().item()
    reference = finals[("nearest", "torch.float32")]
    assert abs(reference - (1 - 50e-4)) < 1e-5
    assert finals[("nearest", "torch.bfloat16")] == 1.0
    assert abs(finals[("stochastic", "torch.bfloat16")] - reference) < 1e-4
    assert abs(finals[("kahan", "torch.bfloat16")] - reference) < 1e-4


class _Float32Allocations(TorchDispatchMode):
    """The largest fp32 tensor any op makes (elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t._base is None:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "torchao_adamw4bit"])
def test_an_elementwise_update_holds_fp32_copies_of_one_chunk(name, monkeypatch, one_thread):
    """A (512, 64) bf16 weight updated in chunks of 4,096 elements: no fp32 tensor of more than one chunk is made;
    the update is that of one whole-tensor chunk, to the bit (kahan: deterministic)."""
    pytest.importorskip(optimizers.spec(name).library)
    weights = []
    for chunk in (4096, 2**20):
        monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", chunk)
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(512, 64, dtype=torch.bfloat16))
        opt = build_optimizer(torch.nn.ParameterDict({"w": p}), OptimizerConfig(name=name), rounding="kahan")
        for _ in range(2):
            p.grad = torch.randn_like(p)
            mode = _Float32Allocations()
            with mode:
                opt.step()
        if chunk == 4096:
            assert 0 < mode.largest <= 4096, mode.largest
        weights.append(p.detach().clone())
    assert torch.equal(*weights)


def test_a_resumed_state_keeps_the_compensation(one_thread):
    """Kahan's buffer is optimizer state: it goes through ``state_dict`` and back, and the steps after a load are
    those of the uninterrupted optimizer, to the bit."""
    runs = []
    for reload in (False, True):
        mcfg, model = _tiny()
        opt = build_optimizer(model, OptimizerConfig(name="adamw", lr=1e-3), rounding="kahan")
        _steps(model, opt, 2, in_backward=False)
        if reload:
            saved = opt.state_dict()
            assert any(rounding.COMPENSATION in s for s in saved["state"].values())
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            _, model = _tiny()
            model.load_state_dict(weights)
            opt = build_optimizer(model, OptimizerConfig(name="adamw", lr=1e-3), rounding="kahan")
            opt.load_state_dict(saved)
        _steps(model, opt, 2, in_backward=False, seed=1)
        runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for n, p in runs[0].items():
        assert torch.equal(p, runs[1][n]), n


# ----------------------------------------------------------------------------------------------------------------
# Through the CLI: a run resumes to the same losses; the estimate sees the bytes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
def test_a_resumed_bf16_run_logs_the_same_losses(mode, small_corpus, tmp_path):
    """8 steps of a tiny bf16 run with a checkpoint at step 4, resumed from it: steps 5-8 log the losses of the
    uninterrupted run to the bit (stochastic rounding draws from the global generator the checkpoint restores; the
    compensation is optimizer state)."""
    extra = {"dtype": "bf16", "bf16_rounding": mode, "max_steps": 8, "checkpoint_every": 4}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["pretrain", *tiny_run_overrides(small_corpus, whole, **extra)]) == 0
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000008")
    records = [r for r in read_records(resumed / "metrics.jsonl") if r["step"] <= 4]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["pretrain", *tiny_run_overrides(small_corpus, resumed, resume="true", **extra)]) == 0
    losses = [[(r["step"], r["loss"]) for r in read_records(out / "metrics.jsonl") if "loss" in r]
              for out in (whole, resumed)]  # fmt: skip
    assert losses[0] == losses[1] and len(losses[0]) == 8


def test_chunked_adafactor_is_torch_s_update(monkeypatch, one_thread):
    """memfit's Adafactor in chunks (its rounded path, here on fp32 weights, which it updates in place) against
    torch's on the same weights and gradients, 4 steps: matrices of 3 chunks, a vector, a mixture of experts' 3-D
    stack (chunks of whole experts), weight decay and the update clipping (d = 1) both active. The scalars are fp32
    tensors instead of Python floats: equal to 1e-6."""
    from memfit.memory.adafactor import Adafactor

    monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", 700)
    torch.manual_seed(0)
    shapes = [(48, 32), (40,), (7, 100), (5, 12, 20)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    mine = Adafactor(ours, lr=1e-2, weight_decay=0.1, d=1.0)
    mine.memfit_bf16_rounding = "stochastic"  # the chunked path; fp32 weights are updated in place
    ref = torch.optim.Adafactor(theirs, lr=1e-2, weight_decay=0.1, d=1.0)
    for _ in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        mine.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(mine.state.values(), ref.state.values(), strict=True):
        assert set(a) == set(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
