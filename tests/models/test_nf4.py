"""memfit's NF4 quantization (:mod:`memfit.models.nf4`) against torchao's ``to_nf4``: bit-identical inner tensors,
for 2-D weights and a mixture of experts' 3-D stacks (quantized as their rows flattened), and one expert's slice
dequantized alone equal to the whole dequantized and indexed."""

from __future__ import annotations

import pytest
import torch

from memfit.models import nf4

INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def _same(ours, theirs) -> None:
    assert (ours.block_size, ours.n_blocks, ours.scaler_block_size) == (
        theirs.block_size,
        theirs.n_blocks,
        theirs.scaler_block_size,
    )
    for name in INNER:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(96, 64), (256, 512), (8, 128)])
def test_to_nf4_is_torchao_s_bit_for_bit(dtype, shape, monkeypatch):
    monkeypatch.setattr(nf4, "CHUNK_ELEMENTS", 4096)  # several chunks
    torch.manual_seed(0)
    weight = (torch.randn(shape) * torch.rand(shape[0], 1) * 3).to(dtype)
    weight[0, :64] = 0  # a block of zeros (its scale is 0: 0 / 0 codes as torchao does)
    weight[1, 3] = weight[1].abs().max() * 4  # an outlier: its block's other values near 0
    ours = nf4.to_nf4(weight)
    theirs = nf4.nf4_module().to_nf4(weight, *nf4.nf4_layout(shape))
    _same(ours, theirs)
    assert ours.shape == weight.shape and torch.equal(
        ours.get_original_weight(), theirs.get_original_weight()
    )


def test_every_bf16_value_takes_torchao_s_code():
    """The table covers all 65,536 bit patterns, infinities and NaNs included, as torchao codes them."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    expected = nf4.nf4_module().NF4Tensor.quantize_tensor_nearest(every, nf4._codes(torch.bfloat16, "cpu"))
    table = nf4.code_table(torch.bfloat16, torch.device("cpu"))
    assert torch.equal(table[every.view(torch.int16).to(torch.int32) & 0xFFFF].long(), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_stack_of_experts_is_its_rows_flattened_and_each_expert_dequantizes_alone(dtype):
    torch.manual_seed(1)
    stack = torch.randn(6, 96, 64).to(dtype)  # 6 experts of (96, 64): 576 blocks, groups of 64 block scales
    ours = nf4.to_nf4(stack)
    theirs = nf4.nf4_module().to_nf4(stack.view(-1, 64), *nf4.nf4_layout(stack.shape))
    _same(ours, theirs)
    assert ours.shape == stack.shape
    whole = ours.get_original_weight()
    assert whole.shape == stack.shape
    for e in range(6):
        assert torch.equal(nf4.nf4_rows(ours, e), whole[e])


def test_fake_and_meta_weights_get_empty_inner_tensors_of_the_exact_sizes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.models.peft import nf4_bytes

    with FakeTensorMode():
        made = nf4.to_nf4(torch.empty(4, 128, 64, dtype=torch.bfloat16))
    size = sum(getattr(made, n).numel() * getattr(made, n).element_size() for n in INNER)
    assert made.shape == (4, 128, 64) and size == nf4_bytes((4, 128, 64), torch.bfloat16)
