"""Optimizers by name, the optimizer step inside backward, and optimizer-state accounting, on the tiny Llama.

The tiny model (``model_config("tiny")``) has 106,816 parameters in 21 tensors: 12 of >= 4,096 elements
(embeddings and lm_head 16,384; q/o projections 4,096; gate/up/down 8,192) holding 98,304 parameters, and 9 small
ones (k/v projections 2,048; five RMSNorm weights of 64) holding 8,512.
"""

import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memfit.config import OptimizerConfig
from memfit.memory.optim import (
    OptimizerInBackward,
    build_optimizer,
    create_state,
    optimizer_state_bytes,
    optimizer_state_tensors,
    unquantized_state_params,
)
from memfit.memory.optimizers import OPTIMIZER_NAMES, check_optimizer_supported
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.step import train_step

NUM_PARAMS = 106_816
NUM_TENSORS = 21
QUANTIZED_NUMEL = 98_304  # the 12 tensors of >= 4,096 elements (all multiples of 256)
SMALL = [
    f"model.layers.{i}.{n}"
    for i in range(2)
    for n in (
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
]
SMALL_NAMES = sorted([*SMALL, "model.norm.weight"])
LOW_BIT = ("adamw8bit", "paged_adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit", "torchao_adamw_fp8")


pytestmark = pytest.mark.usefixtures("one_thread")


def _require(name):
    """Skip when the package behind optimizer ``name`` is not installed (they are optional dependencies)."""
    if name in ("adamw8bit", "paged_adamw8bit", "paged_adamw"):
        pytest.importorskip("bitsandbytes")
    if name.startswith("torchao"):
        pytest.importorskip("torchao")
    if name.startswith("apollo"):
        pytest.importorskip("apollo_torch")
    if name == "adam_mini":
        pytest.importorskip("adam_mini")


def _batch(seed, B=4, T=16, vocab=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _backward(model, seed):
    x, y = _batch(seed)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach()


def _set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def _max_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


# Adafactor's lr caps a step relative to each parameter's RMS (~0.02 here), not an absolute step
LR = {"adafactor": 0.1}


def _cfg(name="adamw", **kw):
    lr = kw.pop("lr", LR.get(name, 1e-2))
    return OptimizerConfig(name=name, lr=lr, weight_decay=kw.pop("weight_decay", 0.1), **kw)


# ----------------------------------------------------------------------------------------------------------------
# torch AdamW implementations
# ----------------------------------------------------------------------------------------------------------------


def test_adamw_implementations_agree():
    """foreach and for_loop are bit-identical after 3 steps; fused differs by at most 5.4e-7 (measured)."""
    models = {}
    for impl in ("foreach", "for_loop", "fused"):
        model = build_decoder(model_config("tiny"), seed=0)
        opt = build_optimizer(model, _cfg(implementation=impl))
        for step in range(3):
            train_step(model, opt, [_batch(step)], max_grad_norm=0.0, dtype="fp32")
        models[impl] = model
    ref = build_decoder(model_config("tiny"), seed=0)
    assert _max_diff(models["foreach"], ref) > 1e-3  # the steps did move the weights
    assert all(
        torch.equal(a, b)
        for a, b in zip(models["foreach"].parameters(), models["for_loop"].parameters(), strict=True)
    )
    assert _max_diff(models["foreach"], models["fused"]) <= 1e-6


@pytest.mark.slow
def test_compile_compiles_the_for_loop_adamw_step_with_the_same_updates():
    """compile=True: AdamW's step gets graphs of its own (a fused AdamW's does not), made by the first two steps
    (the second recompiles once with the learning rate as a graph input) and none after, though the warm-up sets a
    new lr every step (a foreach AdamW would recompile at every one: it stays eager); the weights move as in the
    eager step (the generated kernels' arithmetic, within 2e-5)."""
    from torch._dynamo.utils import counters

    def graphs():
        return counters["stats"]["unique_graphs"]

    def run(implementation, compile_):
        model = build_decoder(model_config("tiny"), seed=0)
        opt = build_optimizer(model, _cfg(implementation=implementation))
        made = []
        for step in range(5):
            _set_lr(opt, 1e-2 * (step + 1) / 5)  # a warm-up: a new lr every step
            before = graphs()
            train_step(model, opt, [_batch(step)], max_grad_norm=1.0, dtype="fp32", compile=compile_)
            made.append(graphs() - before)
        return model, made

    torch._dynamo.reset()
    eager, _ = run("for_loop", False)
    compiled_model, made = run("for_loop", True)
    torch._dynamo.reset()
    _, made_fused = run("fused", True)  # the loss alone is compiled
    assert made == [2, 1, 0, 0, 0] and made_fused == [1, 0, 0, 0, 0]
    assert _max_diff(eager, build_decoder(model_config("tiny"), seed=0)) > 1e-3
    # the generated kernels' arithmetic: 1.36e-5 after the 5 steps on this kind of machine's AMD EPYC (2026-12-05,
    # at 2e5fa89 as at later commits), below 1e-5 where the test was written
    assert _max_diff(eager, compiled_model) <= 2e-5


def test_which_optimizer_steps_compile():
    from memfit.memory.optimizers import step_compiled, step_compiles

    # the rule from a config (the cost model's question)
    assert step_compiled("adamw", "for_loop", in_backward=False, sharded=False)
    assert not step_compiled("adamw", "for_loop", in_backward=True, sharded=False)
    assert not step_compiled("adamw", "for_loop", in_backward=False, sharded=True)
    assert not step_compiled("adamw8bit", "for_loop", in_backward=False, sharded=False)
    model = build_decoder(model_config("tiny"), seed=0)
    assert step_compiles(build_optimizer(model, _cfg(implementation="for_loop")))
    # foreach would recompile at each new lr
    assert not step_compiles(build_optimizer(model, _cfg(implementation="foreach")))
    assert not step_compiles(build_optimizer(model, _cfg(implementation="fused")))  # one kernel already
    assert not step_compiles(build_optimizer(model, _cfg(), in_backward=True))  # updates inside backward
    assert not step_compiles(build_optimizer(model, _cfg("muon")))  # a hybrid (Muon + AdamW groups)


# ----------------------------------------------------------------------------------------------------------------
# OptimizerInBackward against the reference optimizer
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_in_backward_matches_adamw(preset, impl):
    """Same parameters (measured: bit-identical) and the same global grad norm (measured: 1.2e-7 relative)."""
    ref_model, model = (build_decoder(model_config(preset), seed=0) for _ in range(2))
    ref_opt = build_optimizer(ref_model, _cfg(implementation=impl))
    opt = build_optimizer(model, _cfg(implementation=impl), in_backward=True)
    assert isinstance(opt, OptimizerInBackward)
    assert (
        [g["name"] for g in opt.param_groups]
        == [g["name"] for g in ref_opt.param_groups]
        == ["decay", "no_decay"]
    )
    assert [g["param_names"] for g in opt.param_groups] == [g["param_names"] for g in ref_opt.param_groups]
    for step, lr in enumerate([1e-2, 5e-3, 2e-3]):  # a schedule, set as the training loop sets it
        _set_lr(ref_opt, lr)
        _set_lr(opt, lr)
        _backward(ref_model, step)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()])
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        _backward(model, step)  # the hooks update the weights here
        assert all(p.grad is None for p in model.parameters())
        grad_norm = opt.consume_grad_norm()
        opt.step()  # documented no-ops
        opt.zero_grad()
        assert grad_norm.shape == () and grad_norm.dtype == torch.float32
        assert abs(grad_norm.item() / ref_norm.item() - 1) <= 1e-6
        assert _max_diff(ref_model, model) <= 1e-6
    assert len(opt.state) == len(ref_opt.state) == len(list(model.parameters()))
    q = model.model.layers[0].self_attn.q_proj.weight
    assert opt.state[q]["exp_avg"].shape == q.shape and opt.state[q]["step"].item() == 3
    assert opt.consume_grad_norm().item() == 0.0  # consumed: starts again from 0


def test_in_backward_holds_one_gradient_at_a_time():
    model = build_decoder(model_config("tiny"), seed=0)
    params = list(model.parameters())
    alive_at_hook = []
    for p in params:  # registered first, so each runs just before the optimizer's hook on the same parameter
        p.register_post_accumulate_grad_hook(
            lambda p_: alive_at_hook.append((p_.grad is not None, sum(q.grad is not None for q in params)))
        )
    opt = build_optimizer(model, _cfg(), in_backward=True)
    _backward(model, 0)
    assert len(alive_at_hook) == NUM_TENSORS
    assert alive_at_hook == [(True, 1)] * NUM_TENSORS  # its own gradient, and no other
    assert all(p.grad is None for p in params)
    assert all(opt.state[p]["step"].item() == 1 for p in params)

    opt.remove_hooks()  # afterwards backward leaves gradients and updates nothing
    before = [p.detach().clone() for p in params]
    _backward(model, 1)
    assert all(p.grad is not None for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def _save_load(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _clone_model(model, preset="tiny"):
    clone = build_decoder(model_config(preset), seed=1)
    clone.load_state_dict(model.state_dict())
    return clone


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "torchao_adamw8bit"])
def test_in_backward_resume_is_exact(name):
    """state_dict -> torch.save -> torch.load(weights_only=True) -> a fresh wrapper: the next step is identical."""
    _require(name)
    model = build_decoder(model_config("tiny"), seed=0)
    opt = build_optimizer(model, _cfg(name), in_backward=True)
    for step in range(2):
        _backward(model, step)
    saved = _save_load(opt.state_dict())
    assert sorted(saved["state"]) == list(range(NUM_TENSORS))
    assert [len(g["params"]) for g in saved["param_groups"]] == [16, 5]

    resumed = _clone_model(model)
    resumed_opt = build_optimizer(resumed, _cfg(name, lr=0.5), in_backward=True)  # lr comes from the state
    resumed_opt.load_state_dict(saved)
    assert [g["lr"] for g in resumed_opt.param_groups] == [1e-2, 1e-2]
    for m in (model, resumed):
        _backward(m, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))
    assert _max_diff(model, build_decoder(model_config("tiny"), seed=0)) > 1e-3


def test_in_backward_loads_a_plain_adamw_state_dict():
    """Its state_dict has a plain optimizer's layout: a run can switch optimizer_in_backward on at a resume."""
    ref_model = build_decoder(model_config("tiny"), seed=0)
    ref_opt = build_optimizer(ref_model, _cfg())
    for step in range(2):
        train_step(ref_model, ref_opt, [_batch(step)], max_grad_norm=0.0, dtype="fp32")
    model = _clone_model(ref_model)
    opt = build_optimizer(model, _cfg(), in_backward=True)
    opt.load_state_dict(_save_load(ref_opt.state_dict()))
    train_step(ref_model, ref_opt, [_batch(2)], max_grad_norm=0.0, dtype="fp32")
    _backward(model, 2)
    assert _max_diff(ref_model, model) <= 1e-6


def test_in_backward_load_rejects_another_model():
    opt = build_optimizer(build_decoder(model_config("tiny"), seed=0), _cfg(), in_backward=True)
    other = build_decoder(model_config("tiny", num_layers=1), seed=0)
    with pytest.raises(ValueError, match="group of 9 parameters where the optimizer has 16"):
        opt.load_state_dict(build_optimizer(other, _cfg(), in_backward=True).state_dict())


def test_in_backward_honours_the_lr_of_param_groups():
    # lr = 0: weights stay exactly as they were (the moments still advance)
    model = build_decoder(model_config("tiny"), seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, _cfg(lr=1.0), in_backward=True)
    _set_lr(opt, 0.0)
    _backward(model, 0)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(
        opt.state[p]["step"].item() == 1 and opt.state[p]["exp_avg"].abs().max() > 0
        for p in model.parameters()
    )

    # AdamW's first update is linear in lr: twice the lr, twice the change (to 1.2e-7 of rounding, measured)
    deltas = []
    for lr in (1e-3, 2e-3):
        model = build_decoder(model_config("tiny"), seed=0)
        opt = build_optimizer(model, _cfg(lr=1.0), in_backward=True)
        _set_lr(opt, lr)
        _backward(model, 0)
        deltas.append([p.detach() - b for p, b in zip(model.parameters(), before, strict=True)])
    for d1, d2 in zip(*deltas, strict=True):
        assert d1.abs().max() > 1e-4  # ~lr: not the constructor's lr of 1.0
        torch.testing.assert_close(d2, 2 * d1, rtol=0, atol=1e-6)


def test_in_backward_runs_under_fake_tensors():
    """The estimator's path: train_step with the hooks, on a model that exists only as metadata."""
    with FakeTensorMode():
        model = build_decoder(model_config("tiny"), seed=0)
        opt = build_optimizer(model, _cfg(), in_backward=True)
        x = torch.randint(0, 256, (2, 16))
        result = train_step(model, opt, [(x, x)], max_grad_norm=0.0, dtype="fp32")
        assert result.loss.shape == () and result.grad_norm.shape == ()
        assert all(p.grad is None for p in model.parameters())
        q = model.model.layers[0].self_attn.q_proj.weight
        assert opt.state[q]["exp_avg"].shape == q.shape
        assert optimizer_state_bytes(opt) == 8 * NUM_PARAMS + 4 * NUM_TENSORS  # as for real tensors


def test_in_backward_with_bitsandbytes_adamw8bit():
    _require("adamw8bit")
    model = build_decoder(model_config("tiny"), seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, _cfg("adamw8bit"), in_backward=True)
    losses = [
        train_step(model, opt, [_batch(0)], max_grad_norm=0.0, dtype="fp32").loss.item() for _ in range(5)
    ]
    assert losses[-1] < losses[0] - 1.0  # measured 5.559 -> 3.862
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert opt.state[model.lm_head.weight]["state1"].dtype == torch.uint8
    assert opt.state[model.model.norm.weight]["state1"].dtype == torch.float32
    # one pair of code tables shared by all 21 per-parameter optimizers, as in a single optimizer
    assert optimizer_state_bytes(opt) == optimizer_state_bytes(_trained("adamw8bit")[1])


# ----------------------------------------------------------------------------------------------------------------
# Every optimizer by name
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_trains_on_cpu(name, in_backward):
    _require(name)
    assert check_optimizer_supported(name, "cpu") is None
    model = build_decoder(model_config("tiny"), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = build_optimizer(model, _cfg(name), in_backward=in_backward)
        losses = [
            train_step(model, opt, [_batch(0)], max_grad_norm=0.0, dtype="fp32").loss.item() for _ in range(5)
        ]
    assert all(math.isfinite(v) for v in losses)
    assert (
        losses[-1] < losses[0] - 1.0
    )  # measured 5.559 -> 3.86 (3.92 for 4-bit state; 1.16 to 2.98 for others)
    paged = [str(w.message) for w in caught if "paged" in str(w.message).lower()]
    if name.startswith("paged_"):
        assert len(paged) == 1, paged  # memfit's, once; bitsandbytes' own per-optimizer warning is silenced
        assert paged[0].startswith(f"optimizer.name='{name}' runs unpaged on CPU") and "unified" in paged[0]
    else:
        assert paged == []


def _trained(name, steps=1, in_backward=False, **cfg_kw):
    """The tiny model and its optimizer ``name`` after ``steps`` training steps."""
    model = build_decoder(model_config("tiny"), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = build_optimizer(model, _cfg(name, **cfg_kw), in_backward=in_backward)
    for step in range(steps):
        train_step(model, opt, [_batch(step)], max_grad_norm=0.0, dtype="fp32")
    return model, opt


@pytest.mark.parametrize("name", LOW_BIT)
def test_unquantized_state_params_match_the_state(name):
    _require(name)
    model, opt = _trained(name)
    assert sorted(opt.memfit_unquantized_state_params) == SMALL_NAMES
    names = dict(model.named_parameters())
    for pname, p in names.items():
        state = opt.state[p]
        if name.startswith("torchao"):
            quantized = is_traceable_wrapper_subclass(state["exp_avg"])
        else:
            quantized = state["state1"].dtype == torch.uint8
        assert quantized == (pname not in opt.memfit_unquantized_state_params), pname
    assert unquantized_state_params(model, "adamw") == list(names)


@pytest.mark.parametrize("name", ["adamw8bit", "torchao_adamw4bit"])
def test_plain_low_bit_resume_is_exact(name):
    """What checkpoint.py does: optimizer.state_dict() through torch.save / torch.load(weights_only=True)."""
    _require(name)
    model, opt = _trained(name, steps=2)
    resumed_model = _clone_model(model)
    resumed = build_optimizer(resumed_model, _cfg(name))
    resumed.load_state_dict(_save_load(opt.state_dict()))
    for m, o in ((model, opt), (resumed_model, resumed)):
        _set_lr(o, 5e-3)  # a float, as the training loop sets it (torchao keeps a tensor)
        train_step(m, o, [_batch(2)], max_grad_norm=0.0, dtype="fp32")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True))


# ----------------------------------------------------------------------------------------------------------------
# Optimizer-state bytes
# ----------------------------------------------------------------------------------------------------------------


def test_optimizer_state_bytes_adamw_is_8_bytes_per_parameter():
    """fp32 m and v (8 bytes/parameter) plus one 4-byte fp32 step tensor per parameter tensor."""
    assert optimizer_state_bytes(build_optimizer(build_decoder(model_config("tiny"), seed=0), _cfg())) == 0
    for impl in ("foreach", "fused"):
        for in_backward in (False, True):
            _, opt = _trained("adamw", implementation=impl, in_backward=in_backward)
            assert optimizer_state_bytes(opt) == 8 * NUM_PARAMS + 4 * NUM_TENSORS == 854_612
    assert optimizer_state_bytes(opt, device_type="cuda") == 0


def _blocks(numel, block):
    return -(-numel // block)


def test_optimizer_state_bytes_bitsandbytes_8bit():
    """Per quantized tensor: 2 uint8 codes/param + 2 fp32 absmax per block of 256; the two 256-entry fp32 code
    tables are shared by all tensors; small tensors keep fp32 m and v (8 bytes/param); step is a Python int."""
    _require("adamw8bit")
    model, opt = _trained("adamw8bit")
    shapes = {n: p.numel() for n, p in model.named_parameters()}
    expected = 2 * 256 * 4  # the shared code tables
    for numel in shapes.values():
        if numel >= 4096:
            expected += 2 * numel + 2 * 4 * _blocks(numel, 256)
        else:
            expected += 8 * numel
    assert expected == 2 * QUANTIZED_NUMEL + 8 * QUANTIZED_NUMEL // 256 + 2048 + 8 * (
        NUM_PARAMS - QUANTIZED_NUMEL
    )
    assert optimizer_state_bytes(opt) == expected == 269_824  # 2.53 bytes/parameter


@pytest.mark.parametrize(
    "name, code_bytes_per_param, block, table_entries, total",
    [
        ("torchao_adamw8bit", 1.0, 256, 256, 292_436),
        ("torchao_adamw4bit", 0.5, 128, 16, 174_164),
        ("torchao_adamw_fp8", 1.0, 256, 0, 267_860),
    ],
)
def test_optimizer_state_bytes_torchao(name, code_bytes_per_param, block, table_entries, total):
    """Per quantized state tensor (m and v): codes + one fp32 scale per block + its own fp32 code table; small
    tensors keep m and v unquantized (fp32 here: 8 bytes/param); a 4-byte fp32 step tensor per parameter."""
    _require(name)
    model, opt = _trained(name)
    expected = 4 * NUM_TENSORS
    for p in model.parameters():
        if p.numel() >= 4096 and p.numel() % block == 0:
            expected += 2 * (
                int(code_bytes_per_param * p.numel()) + 4 * p.numel() // block + 4 * table_entries
            )
        else:
            expected += 8 * p.numel()
    assert optimizer_state_bytes(opt) == expected == total


# ----------------------------------------------------------------------------------------------------------------
# What is refused, and why
# ----------------------------------------------------------------------------------------------------------------


def test_unsupported_combinations_say_why():
    _require("paged_adamw8bit")
    _require("torchao_adamw8bit")
    assert "unknown optimizer 'sgd'" in check_optimizer_supported("sgd", "cpu")
    reason = check_optimizer_supported("adamw", "cpu", cpu_offload=True)
    assert "needs a CUDA device" in reason and "offload" in reason
    assert "offload" in check_optimizer_supported("paged_adamw8bit", "cuda", cpu_offload=True)
    assert "optimizer_in_backward" in check_optimizer_supported(
        "adamw", "cuda", cpu_offload=True, in_backward=True
    )
    assert "max_grad_norm" in check_optimizer_supported("adamw", "cuda", cpu_offload=True, max_grad_norm=1.0)
    assert check_optimizer_supported("torchao_adamw_fp8", "cpu") is None

    cfg = _cfg()
    cfg.cpu_offload = True  # read with getattr: works before and after the field exists
    with pytest.raises(ValueError, match="cpu_offload .* needs a CUDA device"):
        build_optimizer(build_decoder(model_config("tiny"), seed=0), cfg)
    with pytest.raises(ValueError, match="unknown optimizer.implementation 'fast'"):
        build_optimizer(build_decoder(model_config("tiny"), seed=0), _cfg(implementation="fast"))


# ----------------------------------------------------------------------------------------------------------------
# CUDA only
# ----------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_cpu_offload_trains_with_state_in_host_memory():
    _require("torchao_adamw8bit")
    model = build_decoder(model_config("tiny"), device="cuda", seed=0)
    cfg = _cfg()
    cfg.cpu_offload = True
    opt = build_optimizer(model, cfg)
    x, y = (t.cuda() for t in _batch(0))
    losses = [train_step(model, opt, [(x, y)], max_grad_norm=0.0, dtype="fp32").loss.item() for _ in range(5)]
    assert losses[-1] < losses[0] - 1.0
    # tensors of >= 4,096 elements are stepped on the CPU; the small ones stay on the GPU (foreach AdamW keeps
    # every step counter on the CPU)
    assert optimizer_state_bytes(opt, device_type="cpu") == 8 * QUANTIZED_NUMEL + 4 * NUM_TENSORS
    assert optimizer_state_bytes(opt, device_type="cuda") == 8 * (NUM_PARAMS - QUANTIZED_NUMEL)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["paged_adamw8bit", "torchao_adamw8bit"])
def test_low_bit_on_cuda_matches_cpu_accounting(name):
    _require(name)
    if check_optimizer_supported(name, "cuda") is not None:
        pytest.skip(check_optimizer_supported(name, "cuda"))
    model = build_decoder(model_config("tiny"), device="cuda", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = build_optimizer(model, _cfg(name), in_backward=True)
    assert not [w for w in caught if "unpaged" in str(w.message)]
    x, y = (t.cuda() for t in _batch(0))
    losses = [train_step(model, opt, [(x, y)], max_grad_norm=0.0, dtype="fp32").loss.item() for _ in range(5)]
    assert losses[-1] < losses[0] - 1.0
    assert optimizer_state_bytes(opt) == optimizer_state_bytes(_trained(name, in_backward=True)[1])


# ----------------------------------------------------------------------------------------------------------------
# torchao's low-bit AdamW off CUDA: large tensors updated chunk by chunk (memory.hybrids.low_bit_class)
# ----------------------------------------------------------------------------------------------------------------

TORCHAO = ("torchao_adamw8bit", "torchao_adamw4bit", "torchao_adamw_fp8")
CHUNK = 4096  # elements of a chunk in these tests (LOW_BIT_CHUNK_ELEMENTS is 2**20)


def _torchao_base(name):
    import torchao.optim as ao

    return {
        "torchao_adamw8bit": ao.AdamW8bit,
        "torchao_adamw4bit": ao.AdamW4bit,
        "torchao_adamw_fp8": ao.AdamWFp8,
    }[name]


def _low_bit_steps(cls, weights, grads, eager_whole=False):
    """``len(grads)`` steps of ``cls`` on copies of ``weights``; with ``eager_whole`` torchao's own step, eager."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = cls(params, lr=torch.tensor(1e-2), weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        if eager_whole:
            with torch.compiler.set_stance("force_eager"):
                opt.step()
        else:
            opt.step()
    return params, opt


@pytest.mark.parametrize("name", TORCHAO)
def test_low_bit_update_in_chunks_is_bit_identical_to_torchaos_whole_tensor_update(name, monkeypatch):
    """Chunks on quantization-block boundaries run the same arithmetic element by element and block by block."""
    pytest.importorskip("torchao")
    from memfit.memory import hybrids

    monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", CHUNK)
    g = torch.Generator().manual_seed(0)
    # (rows, cols): 20 chunks of 2 rows; a row of 320 (blocks of 128 and 256 span rows: 4 / 2 rows a unit); one
    # tensor below torchao's 4,096-element threshold (plain fp32 state, one piece)
    shapes = [(40, 2048), (64, 320), (30, 100)]
    weights = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    chunked, opt = _low_bit_steps(hybrids.low_bit_class(_torchao_base(name)), weights, grads)
    whole, ref = _low_bit_steps(_torchao_base(name), weights, grads, eager_whole=True)
    assert len(hybrids._row_chunks(chunked[0], opt.block_size, CHUNK)) == 20
    for a, b in zip(chunked, whole, strict=True):
        assert torch.equal(a, b)
    for pa, pb in zip(chunked, whole, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[pa][key].dequantize() if hasattr(opt.state[pa][key], "dequantize")
                               else opt.state[pa][key],
                               ref.state[pb][key].dequantize() if hasattr(ref.state[pb][key], "dequantize")
                               else ref.state[pb][key])  # fmt: skip


FAST_CHUNK_CASES = {("torchao_adamw4bit", "true"), ("adamw8bit", "true")}


@pytest.mark.parametrize(
    "name, in_bwd",
    [
        ("torchao_adamw4bit", "true"),
        pytest.param("torchao_adamw4bit", "false", marks=pytest.mark.slow),
        pytest.param("torchao_adamw8bit", "true", marks=pytest.mark.slow),
        ("adamw8bit", "true"),  # bitsandbytes' CPU kernel (bnb_cpu.compose_bnb_cpu_updates)
    ],
)
def test_an_estimate_traces_two_chunks_of_a_low_bit_update_and_gets_every_chunk_s_bytes(
    name, in_bwd, monkeypatch
):
    """On fake tensors only a tensor's first and last chunks are updated (hybrids.traced_chunks): the estimate's
    peak, breakdown and category peaks are those of updating every chunk, to the byte, composed and whole, in the
    backward (in_bwd) and after it."""
    _require(name)
    from memfit.config import load_config
    from memfit.memory import hybrids
    from memfit.planner.estimate import estimate_run

    monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", CHUNK)  # the tiny model's matrices: 4 to 64 chunks
    seen = []
    traced = hybrids.traced_chunks
    monkeypatch.setattr(
        hybrids, "traced_chunks", lambda chunks, p: seen.append(len(chunks)) or traced(chunks, p)
    )
    cfg = load_config(
        None,
        f"model=tiny tokenizer.kind=char batch_size=2 seq_len=16 device=cpu optimizer.name={name} "
        f"optimizer_in_backward={in_bwd} max_grad_norm=0 model_args.num_layers=5".split(),
    )
    answers = {}
    # the fast case: two chunks composed against every chunk traced whole; the slow ones all four
    cases = [(False, True), (True, False)] if (name, in_bwd) in FAST_CHUNK_CASES else None
    for every in (False, True):
        if every:
            monkeypatch.setattr(hybrids, "traced_chunks", lambda chunks, p: chunks)
        for compose in (True, False):
            if cases is None or (every, compose) in cases:
                e = estimate_run(cfg, compose=compose)
                answers[every, compose] = (e.peak_bytes, e.phase, e.breakdown, e.trace.get("composed"))
    assert answers[False, True][3] is True and answers[True, False][3] is False
    assert len({(a[0], a[1], tuple(a[2].items())) for a in answers.values()}) == 1, answers
    assert max(seen) > 2  # some tensor had more chunks than the two traced


def test_row_chunks_cover_the_rows_on_block_boundaries_within_the_chunk_size():
    from memfit.memory.hybrids import _row_chunks

    for rows, cols, block in [(40, 2048, 256), (64, 320, 128), (7, 5000, 128), (3000, 3, 256)]:
        chunks = _row_chunks(torch.empty(rows, cols), block, CHUNK)
        assert chunks[0][0] == 0 and chunks[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
        # every boundary but the end falls on a block; a chunk holds at most CHUNK elements unless one
        # block-aligned unit of rows is larger (7 x 5000: one row a chunk)
        unit = block // math.gcd(cols, block)
        assert all(s * cols % block == 0 for s, _ in chunks)
        assert all((e - s) * cols <= max(CHUNK, unit * cols) for s, e in chunks)
    assert _row_chunks(torch.empty(64, 64), 128, CHUNK) == [None]  # one chunk: the tensor whole
    assert _row_chunks(torch.empty(()), 128, CHUNK) == [None]


def _update_temporaries(cls, rows):
    """The temporaries at the peak of the second step (the first creates the state) of ``cls`` over one fp32
    (rows, 256) parameter, as memfit's tracker sees them (bytes)."""
    from memfit.memory.tracker import MemoryTracker

    p = torch.nn.Parameter(torch.randn(rows, 256))
    opt = cls([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    p.grad = torch.randn_like(p)
    with MemoryTracker(torch.nn.ParameterList([p]), opt) as tracker:
        opt.step()
    return tracker.peak_breakdown["temporaries"]


@pytest.mark.parametrize("name", ["torchao_adamw8bit", "torchao_adamw4bit"])
def test_chunked_low_bit_update_holds_the_temporaries_of_one_chunk(name, monkeypatch):
    """The update of a tensor of 2 to 16 chunks holds, at its peak, the temporaries that updating one chunk-sized
    tensor whole holds (torchao's eager update makes several fp32 copies of the parameter: of a chunk now, not of
    the whole tensor), plus the code tables of the chunk's two moment slices (torchao's slice of a quantized state
    clones its table: 256 fp32 values for 8 bits, 16 for 4 bits)."""
    pytest.importorskip("torchao")
    from memfit.memory import hybrids

    monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", CHUNK)
    cls = hybrids.low_bit_class(_torchao_base(name))

    one_chunk = _update_temporaries(cls, CHUNK // 256)
    assert one_chunk >= 5 * CHUNK * 4  # five or more fp32 chunk-sized temporaries: what chunking bounds
    tables = 2 * 4 * (256 if name == "torchao_adamw8bit" else 16)
    for chunks in (2, 3, 16):
        assert _update_temporaries(cls, chunks * CHUNK // 256) == one_chunk + tables


# ----------------------------------------------------------------------------------------------------------------
# bitsandbytes' updates on CPU: its CPU kernels, chunk by chunk, seen by the tracker (bnb_cpu.compose_bnb_cpu_updates)
# ----------------------------------------------------------------------------------------------------------------

BNB = {"adamw8bit": "AdamW8bit", "lion8bit": "Lion8bit", "paged_adamw": "PagedAdamW"}
BNB_FP32_TEMPORARIES = {"adamw8bit": 5, "lion8bit": 5, "paged_adamw": 3}
"""fp32 temporaries of one chunk's size at the CPU update's peak, read from bitsandbytes' backends/cpu/ops.py:
8-bit AdamW, both moments dequantized, the gradient's scaled copy, the square root and the denominator; Lion, the
moment dequantized, the gradient's copy, the moment times beta1, their sum and its sign; 32-bit AdamW (its moments
updated in place), the gradient's copy, the square root and its sum with eps, and the update (the sum freed)."""


def _bnb_class(name):
    from memfit.memory.optimizers import _bitsandbytes

    return getattr(_bitsandbytes(), BNB[name])  # memfit's import: the wrappers installed


def _bnb_steps(cls, weights, grads):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = cls(params, lr=1e-2, weight_decay=0.1)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("name", list(BNB))
def test_bnb_cpu_update_in_chunks_is_bit_identical_to_its_op_on_the_whole_tensor(name, monkeypatch):
    """Flat chunks that hold whole blocks of 256 values run bitsandbytes' CPU kernel's arithmetic element by element
    and block by block: the parameters and the state after 3 steps equal those of its op on whole tensors."""
    _require("paged_adamw")
    from memfit.memory import bnb_cpu, hybrids

    cls = _bnb_class(name)
    monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", CHUNK)
    g = torch.Generator().manual_seed(0)
    # 20 chunks; 9,900 values: 2 chunks and a last one of 1,708 values, its last block of 172 values; one tensor
    # under bitsandbytes' 4,096-element threshold (32-bit state)
    shapes = [(40, 2048), (33, 300), (30, 100)]
    weights = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    chunked, opt = _bnb_steps(cls, weights, grads)
    monkeypatch.setattr(bnb_cpu, "BNB_CPU_UPDATES_COMPOSED", False)
    whole, ref = _bnb_steps(cls, weights, grads)
    assert len(bnb_cpu._flat_chunks(40 * 2048)) == 20 and bnb_cpu._flat_chunks(9900)[-1] == (8192, 9900)
    for a, b in zip(chunked, whole, strict=True):
        assert torch.equal(a, b)
        state = [k for k, v in opt.state[a].items() if isinstance(v, torch.Tensor)]
        assert "state1" in state and all(torch.equal(opt.state[a][k], ref.state[b][k]) for k in state)


@pytest.mark.parametrize("name", list(BNB))
def test_bnb_cpu_update_holds_the_temporaries_of_one_chunk_and_the_tracker_sees_them(name, monkeypatch):
    """The CPU update of a tensor of 1 to 16 chunks holds, at its peak, the fp32 temporaries of one chunk, exactly
    (BNB_FP32_TEMPORARIES), where bitsandbytes' op on the whole tensor held them for every value, unseen by the
    tracker; under cuda_paths (an estimate of a CUDA run) the op runs whole again and allocates nothing seen."""
    _require("paged_adamw")
    from memfit.memory import bnb_cpu, hybrids
    from memfit.planner.cuda_paths import cuda_paths

    cls = _bnb_class(name)
    monkeypatch.setattr(hybrids, "LOW_BIT_CHUNK_ELEMENTS", CHUNK)

    one_chunk = BNB_FP32_TEMPORARIES[name] * 4 * CHUNK
    for chunks in (1, 2, 3, 16):
        assert _update_temporaries(cls, chunks * CHUNK // 256) == one_chunk
    with cuda_paths(True):
        assert _update_temporaries(cls, 2 * CHUNK // 256) == 0
    assert bnb_cpu.BNB_CPU_UPDATES_COMPOSED  # restored


@pytest.mark.parametrize("name", ["torchao_adamw4bit", "adamw8bit"])
@pytest.mark.parametrize(
    "in_backward", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["in_bwd", "step"]
)
def test_low_bit_state_created_before_the_first_step_is_the_state_the_step_creates(name, in_backward):
    """create_state (a CPU run calls it before its first step, so the state packs densely in glibc's heap) makes
    the state the first step would make: the same bytes before any step, the same steps to the bit after; a
    resumed run's loaded state is kept, and an optimizer without the method is left alone. torchao's low-bit AdamW
    as memfit builds it, and bitsandbytes' optimizers (their own init_state)."""
    _require(name)
    runs = {}
    for early in (False, True):
        model = build_decoder(model_config("tiny"), seed=0)
        opt = build_optimizer(model, _cfg(name), in_backward=in_backward)
        if early:
            assert optimizer_state_bytes(opt) == 0
            made = create_state(opt)
            assert made == (sum(1 for _ in model.parameters()) if in_backward else 1)
            before = optimizer_state_bytes(opt)
        for step in range(3):
            train_step(model, opt, [_batch(step)], max_grad_norm=0.0, dtype="fp32")
        runs[early] = (model, opt)
    lazy_model, lazy_opt = runs[False]
    early_model, early_opt = runs[True]
    assert before == optimizer_state_bytes(lazy_opt) > 0
    for a, b in zip(lazy_model.parameters(), early_model.parameters(), strict=True):
        assert torch.equal(a, b)
    state = _save_load(early_opt.state_dict())
    resumed_model = _clone_model(early_model)
    resumed = build_optimizer(resumed_model, _cfg(name), in_backward=in_backward)
    resumed.load_state_dict(state)
    kept = [id(t) for t in optimizer_state_tensors(resumed)]
    create_state(resumed)
    assert [id(t) for t in optimizer_state_tensors(resumed)] == kept
    plain = build_optimizer(build_decoder(model_config("tiny"), seed=0), _cfg("adamw"))
    assert create_state(plain) == 0 and optimizer_state_bytes(plain) == 0


def test_the_squared_gradient_norm_of_a_bf16_tensor_is_summed_in_fp32_chunks():
    """``vector_norm(dtype=float32)`` of a large bf16 gradient converts all of it inside its kernel (2 GiB for Llama
    3's head, unseen by the estimate; and its sum drifted by 19% there): the optimizer in the backward sums fp32
    chunks of LOW_BIT_CHUNK_ELEMENTS instead, each an op of its own, to within 1e-4 of the float64 sum."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.memory.hybrids import LOW_BIT_CHUNK_ELEMENTS
    from memfit.memory.optim import squared_norm

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32:
                Largest.numel = max(Largest.numel, out.numel())
            return out

    g = (
        torch.randn(3 * LOW_BIT_CHUNK_ELEMENTS // 1024 + 7, 1024, generator=torch.Generator().manual_seed(0))
        * 0.01
    )
    g = g.bfloat16()
    with Largest():
        sq = squared_norm(g)
    assert Largest.numel == LOW_BIT_CHUNK_ELEMENTS
    reference = g.double().square().sum()
    assert sq.dtype == torch.float32 and sq.dim() == 0
    assert abs(float(sq) - float(reference)) <= 1e-4 * float(reference)  # fp32 sums of 2**20 squares
    fp32 = g.float()
    assert torch.equal(squared_norm(fp32), torch.linalg.vector_norm(fp32, dtype=torch.float32).square())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_adafactor_s_state_made_before_the_first_step_is_the_state_the_step_makes(rounding):
    """``create_state`` (a CPU run calls it before its first step, so that the state does not land between the first
    backward's temporaries in glibc's heap) makes torch's own zeros, and the steps after it are the same to the bit."""
    from memfit.memory.adafactor import Adafactor
    from memfit.memory.optim import create_state

    def run(early: bool):
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(6, 5).bfloat16()),
            torch.nn.Parameter(torch.randn(5).bfloat16()),
        ]
        opt = Adafactor(params, lr=1e-2)
        opt.memfit_bf16_rounding = rounding
        if early:
            assert create_state(opt) == 1
            made = {k: (v.shape, v.dtype) for k, v in opt.state[params[0]].items()}
            assert made == {"step": (torch.Size([]), torch.float32), "row_var": ((6, 1), torch.bfloat16),
                            "col_var": ((1, 5), torch.bfloat16)}  # fmt: skip
            assert set(opt.state[params[1]]) == {"step", "variance"}
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape).bfloat16()
            opt.step()
        return [p.detach().clone() for p in params], opt.state_dict()["state"]

    (early, early_state), (lazy, lazy_state) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(early, lazy, strict=True))
    for i in lazy_state:
        assert all(torch.equal(early_state[i][k], lazy_state[i][k]) for k in lazy_state[i])
