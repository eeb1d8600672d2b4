"""QLoRA: NF4 bytes by hand, a quantized linear against its dequantized weights, only LoRA trains, the loss
against LoRA on the unquantized base within a bound computed from the quantization error, merge, quantize while
loading, fake tensors, memory accounting, FSDP2 split rules and errors.

The tiny preset (vocab 256, dim 64, 2 layers, 4 query / 2 kv heads of 16, SwiGLU 128) has 14 decoder linears:
per layer q_proj (64, 64), k_proj and v_proj (32, 64), o_proj (64, 64), gate_proj and up_proj (128, 64),
down_proj (64, 128).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memfit.config import OptimizerConfig
from memfit.convert import load_pretrained
from memfit.convert.hf import export_hf
from memfit.memory.optim import build_optimizer
from memfit.memory.tracker import MemoryTracker
from memfit.models import nf4 as nf4_format
from memfit.models import peft
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.step import train_step

CFG = model_config("tiny")
B, T = 2, 16
NF4_CODES = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0)
NF4_CODES = NF4_CODES + (0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
# |W - dequant(W)| / absmax of W's block: half the widest gap between adjacent NF4 codes (0.7230 .. 1.0), plus the
# int8 rounding of the block's scale in the double quantization (half a step of 1/128 of the largest deviation of
# a block scale from their mean: at most 1/256 of the scale itself, times |code| <= 1), plus float rounding
NF4_ERROR = max(b - a for a, b in zip(NF4_CODES, NF4_CODES[1:], strict=False)) / 2 + 1 / 256 + 1e-6
TINY_LINEARS = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)] * 2

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (B, T), generator=generator)
    return x, torch.randint(0, CFG.vocab_size, (B, T), generator=generator)


def inner_bytes(weight) -> int:
    return sum(getattr(weight, n).untyped_storage().nbytes() for n in weight.__tensor_flatten__()[0])


def hand_nf4_bytes(rows: int, cols: int, itemsize: int) -> int:
    numel = rows * cols
    blocks = numel // 64
    groups = blocks // math.gcd(blocks, 256)
    factor = (
        blocks if groups == 1 else groups
    )  # one group: a view of its whole row of `blocks` scales is kept
    return numel // 2 + blocks + (factor + 1 + 16) * itemsize


@pytest.mark.parametrize(
    "shape, dtype, expected",
    [
        # 4,096 weights: 2,048 code bytes, 64 int8 scales, one group of 64 scales whose scale of scales is a view
        # of 64 fp32 (torchao keeps the whole row), the mean and 16 codes: 2048 + 64 + (64 + 1 + 16) * 4
        ((64, 64), torch.float32, 2048 + 64 + (64 + 1 + 16) * 4),
        # 262,144 weights: 131,072 code bytes, 4,096 scales in 16 groups of 256: 16 + 1 + 16 bf16 values
        ((256, 1024), torch.bfloat16, 131072 + 4096 + (16 + 1 + 16) * 2),
    ],
)
def test_nf4_bytes_by_hand_equal_the_stored_bytes(shape, dtype, expected):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    quantized = nf4_format.to_nf4(weight)
    assert peft.nf4_bytes(shape, dtype) == expected == inner_bytes(quantized)
    # the meta / fake stand-in has the same inner storages
    assert inner_bytes(nf4_format.empty_nf4(shape, dtype, "cpu")) == expected
    assert quantized.shape == weight.shape and quantized.dtype == dtype


def test_quantized_linear_equals_its_dequantized_linear_and_error_is_bounded():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 64, generator=generator) * 0.02
    quantized = nf4_format.to_nf4(weight)
    dequantized = quantized.get_original_weight()
    blocks = weight.flatten().view(-1, 64)
    error = (dequantized - weight).flatten().view(-1, 64).abs() / blocks.abs().amax(1, keepdim=True)
    assert error.max().item() <= NF4_ERROR
    x = torch.randn(3, 5, 64, generator=generator, requires_grad=True)
    linear = torch.nn.Linear(64, 128, bias=False)
    linear.weight = torch.nn.Parameter(quantized, requires_grad=False)
    out = linear(x)
    torch.testing.assert_close(out, F.linear(x, dequantized), rtol=0, atol=1e-6)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    x2 = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(F.linear(x2, dequantized).square().sum(), x2)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)


def test_qlora_quantizes_every_decoder_linear_and_trains_only_lora():
    model = build_decoder(CFG, seed=0)
    names = peft.apply_qlora(model, target_modules=("q_proj", "v_proj"), seed=1)
    assert peft.peft_method(model) == "qlora"
    params = dict(model.named_parameters())
    quantized = sorted(n for n, p in params.items() if nf4_format.is_nf4(p))
    assert quantized == sorted(n for n in params if peft.is_qlora_quantized(n)) and len(quantized) == 14
    assert all(p.requires_grad == (n in names) for n, p in params.items())
    assert not any(nf4_format.is_nf4(params[n]) for n in ("model.embed_tokens.weight", "lm_head.weight"))
    # step 0 (lora_B = 0) is the dequantized base
    x, _ = batch()
    plain = build_decoder(CFG, seed=0)
    peft.quantize_base_(plain)
    peft.dequantize_base_(plain)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=1e-6)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    before = {n: p.detach().clone() for n, p in params.items() if not nf4_format.is_nf4(p)}
    codes = {n: p.quantized_data.clone() for n, p in params.items() if nf4_format.is_nf4(p)}
    for step in range(2):
        train_step(model, optimizer, [batch(step)], max_grad_norm=0.0, dtype="fp32")
    for n, p in params.items():
        if nf4_format.is_nf4(p):
            assert torch.equal(p.quantized_data, codes[n]) and p.grad is None
        elif n.endswith("lora_B") or n.endswith("lora_A"):
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n


def test_first_loss_against_lora_on_the_unquantized_base_within_the_quantization_bound():
    """QLoRA's loss differs from LoRA's on the full-precision base by the first-order change the quantization
    error makes, sum |dL/dW| * |W - dequant(W)| over the quantized weights (plus a second-order rest, given
    half as much again)."""
    x, y = batch()
    lora = build_decoder(CFG, seed=0)
    peft.apply_lora(lora, target_modules=("q_proj", "v_proj"), seed=1)
    for p in lora.parameters():
        p.requires_grad_(True)
    loss = F.cross_entropy(lora(x).flatten(0, 1), y.flatten())
    loss.backward()
    qlora = build_decoder(CFG, seed=0)
    peft.apply_qlora(qlora, target_modules=("q_proj", "v_proj"), seed=1)
    with torch.no_grad():
        quantized_loss = F.cross_entropy(qlora(x).flatten(0, 1), y.flatten())
    lora_params = dict(lora.named_parameters())
    bound = 0.0
    for name, p in qlora.named_parameters():
        if nf4_format.is_nf4(p):
            full = lora_params[name]
            bound += (full.grad.abs() * (full.detach() - p.get_original_weight()).abs()).sum().item()
    diff = abs(quantized_loss.item() - loss.item())
    assert 0 < diff <= 1.5 * bound, (diff, bound)


def test_merge_dequantizes_then_folds_the_update():
    model = build_decoder(CFG, seed=0)
    peft.apply_qlora(model, target_modules=("q_proj", "down_proj"), seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    x, _ = batch()
    with torch.no_grad():
        before = model(x)
    peft.merge_lora(model)
    assert peft.peft_method(model) is None
    assert not any(nf4_format.is_nf4(p) for p in model.parameters())
    assert sorted(model.state_dict()) == sorted(build_decoder(CFG, device="meta").state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-5)


def test_loading_quantizes_each_weight_as_it_is_read(tmp_path):
    base = build_decoder(CFG, seed=0)
    export_hf(base, tmp_path / "hf")
    seen = []

    def transform(name, tensor):
        seen.append((name, type(tensor).__name__))
        return peft.quantize_for_qlora(name, tensor)

    model = load_pretrained(tmp_path / "hf", transform=transform)[0]
    assert sorted(n for n, _ in seen) == sorted(n for n, _ in base.named_parameters())
    assert all(kind == "Tensor" for _, kind in seen)  # each tensor reaches the transform at full precision
    loaded = dict(model.named_parameters())
    for name, p in base.named_parameters():
        if peft.is_qlora_quantized(name):
            expected = nf4_format.to_nf4(p.detach())
            assert nf4_format.is_nf4(loaded[name]) and not loaded[name].requires_grad
            for inner in expected.__tensor_flatten__()[0]:
                assert torch.equal(getattr(loaded[name], inner), getattr(expected, inner)), (name, inner)
        else:
            assert torch.equal(loaded[name], p) and loaded[name].requires_grad


@pytest.mark.parametrize("dtype, itemsize", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_tracked_parameter_bytes_are_the_nf4_bytes_by_hand(dtype, itemsize):
    model = build_decoder(CFG, seed=0, dtype=dtype)
    names = peft.apply_qlora(model, target_modules=("q_proj",), seed=1)
    optimizer = build_optimizer(model, OptimizerConfig())
    full = [p.numel() for n, p in model.named_parameters() if not nf4_format.is_nf4(p)]
    expected = sum(hand_nf4_bytes(r, c, itemsize) for r, c in TINY_LINEARS)
    expected += sum(full) * itemsize + 4 * (CFG.head_dim // 2)  # + the fp32 RoPE buffer
    with MemoryTracker(model, optimizer) as tracker:
        train_step(model, optimizer, [batch()], max_grad_norm=1.0, dtype="fp32" if itemsize == 4 else "bf16")
    assert tracker.current_breakdown()["parameters"] == expected
    trainable = sum(dict(model.named_parameters())[n].numel() for n in names)
    assert tracker.current_breakdown()["optimizer_state"] == 2 * trainable * itemsize + 4 * len(names)


def test_training_step_runs_on_meta_and_under_fake_tensors():
    meta = build_decoder(CFG, device="meta")
    peft.apply_qlora(meta)
    assert all(p.is_meta for p in meta.parameters() if not nf4_format.is_nf4(p))
    assert all(nf4_format.is_nf4(p) for n, p in meta.named_parameters() if peft.is_qlora_quantized(n))
    with FakeTensorMode():
        model = build_decoder(CFG)
        peft.apply_qlora(model, seed=0)
        optimizer = build_optimizer(model, OptimizerConfig())
        x, y = torch.randint(0, CFG.vocab_size, (B, T)), torch.randint(0, CFG.vocab_size, (B, T))
        result = train_step(model, optimizer, [(x, y)], max_grad_norm=1.0, dtype="fp32")
        assert isinstance(result.loss, FakeTensor)
        assert len(optimizer.state) == sum(p.requires_grad for p in model.parameters())


def test_errors():
    with pytest.raises(ValueError, match="multiple of the block size 64"):
        nf4_format.nf4_layout((10, 10))
    model = build_decoder(CFG, seed=0)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        peft.apply_qlora(model, rank=0)
    assert not any(nf4_format.is_nf4(p) for p in model.parameters())  # nothing changed before the error
    peft.apply_qlora(model)
    with pytest.raises(ValueError, match="already has qlora"):
        peft.apply_lora(model)
    # FSDP2 splits codes, scales and scales of scales evenly: the tiny model's one group of scales does not
    with pytest.raises(ValueError, match="does not split evenly over 2 ranks"):
        peft.check_nf4_sharding(model, 2)
    wide = build_decoder(model_config("tiny", dim=256, intermediate_size=512), device="meta")
    peft.apply_qlora(wide)
    peft.check_nf4_sharding(wide, 2)
    with pytest.raises(ValueError, match="does not split evenly over 4 ranks"):
        peft.check_nf4_sharding(wide, 4)
