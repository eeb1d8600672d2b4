"""Attention within packed documents without a (T, T) tensor (:mod:`memfit.models.attention`): equal to SDPA with
the dense block-diagonal causal mask, forward and gradients, on both block kernels; memory linear in T."""

import pytest
import torch
import torch.nn.functional as F

from memfit.memory.tracker import MemoryTracker
from memfit.models import attention
from memfit.models.attention import block_mask, document_attention, query_block


def dense_reference(q, k, v, doc_ids):
    """SDPA with the dense (B, 1, T, T) mask, keys and values expanded: the computation being replaced."""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    mask = (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None]  # (B, 1, T, T)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qkv(B, nh, nkv, T, hd, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, T, n, hd) memory, as the model's projections make them, viewed as (B, n, T, hd)
    q = torch.randn(B, T, nh, hd, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, nkv, hd, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, nkv, hd, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
    return q, k, v


def random_documents(B, T, seed=0, mean_length=40):
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(B, T, generator=g) < 1 / mean_length
    return torch.cumsum(starts.long(), dim=1)  # (B, T), contiguous ids


def test_query_block_bounds_the_mask_and_is_a_power_of_two():
    assert query_block(1, 4096) == 1024  # 1024 x 4096 = 2^22 elements
    assert query_block(1, 65536) == 256  # 256 x 65536 = 2^24
    assert query_block(4, 1 << 20) == 128  # the floor, even where the mask is then larger
    assert query_block(2, 100) == 100  # never more than the sequence
    assert block_mask(torch.zeros(2, 300, dtype=torch.long), 256, 300, torch.float32).shape == (2, 1, 44, 300)


@pytest.mark.parametrize("recompute", [False, True], ids=["with_lse", "recomputed"])
@pytest.mark.parametrize(
    "B, nh, nkv, T, hd",
    [(2, 4, 2, 300, 16), (1, 4, 4, 1100, 8), (1, 8, 1, 129, 16)],
    ids=["gqa", "mha", "mqa"],
)
def test_equals_the_dense_mask_forward_and_backward(recompute, B, nh, nkv, T, hd, monkeypatch):
    monkeypatch.setattr(attention, "MAX_QUERY_BLOCK", 128)  # several blocks, the last one short
    monkeypatch.setattr(attention, "MIN_QUERY_BLOCK", 64)
    q, k, v = qkv(B, nh, nkv, T, hd)
    doc_ids = random_documents(B, T)
    out = document_attention(q, k, v, doc_ids, recompute=recompute)
    ref = dense_reference(q, k, v, doc_ids)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    assert out.transpose(
        1, 2
    ).is_contiguous()  # (B, T, nh, hd) memory: the model's reshape to (B, T, C) is a view
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_bf16_keys_and_values_gradients_are_summed_in_fp32():
    q, k, v = qkv(1, 4, 2, 512, 16, torch.bfloat16)
    doc_ids = random_documents(1, 512, mean_length=200)
    out = document_attention(q, k, v, doc_ids)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(dense_reference(q32, k32, v32, doc_ids), (q32, k32, v32), grad.float())
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, rtol=0.02, atol=0.02)


def test_one_document_per_row_is_plain_causal_attention():
    q, k, v = qkv(2, 4, 2, 200, 16)
    out = document_attention(q, k, v, torch.zeros(2, 200, dtype=torch.long))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("recompute", [False, True], ids=["with_lse", "recomputed"])
def test_no_tensor_of_t_by_t_elements_in_forward_and_backward(recompute):
    """At T = 4,096 the tracker sees every allocation of the forward and backward: none has T x T elements."""
    T = 4096
    q, k, v = qkv(1, 2, 1, T, 8)
    doc_ids = random_documents(1, T, mean_length=500)
    largest = 0

    class Largest(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal largest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    largest = max(largest, t.untyped_storage().nbytes() // t.element_size())
            return out

    with MemoryTracker(torch.nn.Module()) as tracker, Largest():
        out = document_attention(q, k, v, doc_ids, recompute=recompute)
        out.sum().backward()
    assert largest < T * T // 2, largest  # one block's mask: 1,024 x 4,096
    assert tracker.peak_bytes < 64 * 2**20
