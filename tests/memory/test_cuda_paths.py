"""``memfit.planner.cuda_paths``: a ``device=cuda`` estimate traces the library paths CUDA runs, each rule's bytes
stated by hand; bitsandbytes' update, already traced as on CUDA, is pinned too.

Sizes: ``N`` elements of a parameter; SDPA inputs (B, nh, T, hd) queries and (B, nkv, T, hd) keys and values.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memfit.config import OptimizerConfig, load_config
from memfit.memory.optim import build_optimizer
from memfit.memory.tracker import MemoryTracker
from memfit.models import decoder
from memfit.planner.cuda_paths import cuda_paths, cuda_sdpa_backend
from memfit.planner.estimate import estimate_run
from memfit.planner.fake_trace import fake_mode

pytestmark = pytest.mark.usefixtures("one_thread")


def stepped(name: str, *shapes: tuple[int, int], enabled: bool, dtype=torch.bfloat16) -> MemoryTracker:
    """The tracker of the second optimizer step (the first creates the state) of ``name`` over bf16 weights of
    ``shapes``, on fake tensors, with the CUDA paths ``enabled`` or not."""
    with warnings.catch_warnings(), fake_mode(name) as fake, fake:
        warnings.simplefilter("ignore")
        model = nn.Sequential(*(nn.Linear(cols, rows, bias=False, dtype=dtype) for rows, cols in shapes))
        optimizer = build_optimizer(model, OptimizerConfig(name=name, lr=1e-3, weight_decay=0.1))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        tracker = MemoryTracker(model, optimizer)
        with cuda_paths(enabled), tracker:
            optimizer.step()
    return tracker


# ----------------------------------------------------------------------------------------------------------------
# bitsandbytes: its op (nothing allocated) on CUDA, its CPU kernel's ops on CPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw"])
def test_bitsandbytes_update_allocates_nothing_as_its_cuda_kernel(name):
    """The 8-bit blockwise (and 32-bit) update is one CUDA kernel writing p, the moments and absmax in place; a
    CUDA target's trace calls the op, whose registered fake allocates nothing either: 0 bytes of temporaries."""
    tracker = stepped(name, (1024, 256), enabled=True)
    assert tracker.category_peaks["temporaries"] == 0


@pytest.mark.parametrize(
    "name, dtype, per_element",
    [("adamw8bit", torch.bfloat16, 24), ("adamw8bit", torch.float32, 20), ("paged_adamw", torch.bfloat16, 16),
     ("paged_adamw", torch.float32, 12)],
)  # fmt: skip
def test_a_cpu_trace_runs_bitsandbytes_cpu_kernel(name, dtype, per_element):
    """A CPU target's trace runs bitsandbytes' CPU kernel's ops (memory.bnb_cpu.compose_bnb_cpu_updates), here on
    one chunk. 8-bit AdamW holds fp32 copies of both dequantized moments, of the gradient and (bf16 weights) of
    the parameter, and computes the denominator ``state2.sqrt() / correction2`` with the square root still live:
    24 bytes per element of bf16 weights, 20 of fp32 ones (``p.float()`` is the parameter itself). 32-bit AdamW
    updates its fp32 moments in place: the gradient's copy, the parameter's (bf16), then ``state2.sqrt() + eps``
    with the root live and the quotient: 16 and 12 bytes."""
    n = 1024 * 256
    tracker = stepped(name, (1024, 256), enabled=False, dtype=dtype)
    assert tracker.category_peaks["temporaries"] == per_element * n


# ----------------------------------------------------------------------------------------------------------------
# torchao: the compiled update
# ----------------------------------------------------------------------------------------------------------------

N = 1024 * 1024  # memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS: the eager update runs it in one chunk


@pytest.mark.parametrize(
    "name, compiled",
    [
        ("torchao_adamw8bit", 2 * 4 * N // 256),  # two moments' new block scales, fp32
        ("torchao_adamw_fp8", 2 * 4 * N // 256),
        ("torchao_adamw4bit", 2 * (8 * N + 4 * N // 128)),  # + the int64 codes before packing, per moment
    ],
)
def test_torchao_update_holds_the_compiled_kernels_buffers(name, compiled):
    """On CUDA torchao compiles the update: the trace holds only the buffers Inductor keeps (see
    ``compiled_update_buffers``). Eagerly (a CPU target) it holds 28 bytes per element of a bf16 weight at its
    peak: p, grad, the two dequantized moments and three more fp32 intermediates, and three 0-dim fp32 scalars
    (the two bias corrections and ``lr * weight_decay``)."""
    assert stepped(name, (1024, 1024), enabled=True).category_peaks["temporaries"] == compiled
    assert stepped(name, (1024, 1024), enabled=False).category_peaks["temporaries"] == 28 * N + 3 * 4


@pytest.mark.parametrize("name", ["torchao_adamw8bit", "torchao_adamw4bit"])
def test_torchao_unquantized_state_update_is_one_pointwise_kernel(name):
    """A weight under 4,096 elements keeps plain state; its compiled update is one pointwise kernel: 0 bytes."""
    assert stepped(name, (100, 10), enabled=True).category_peaks["temporaries"] == 0


# ----------------------------------------------------------------------------------------------------------------
# SDPA: the kernel CUDA picks, and what it saves for backward
# ----------------------------------------------------------------------------------------------------------------


def qkv(b: int, nh: int, nkv: int, t: int, hd: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    shapes = ((b, nh, t, hd), (b, nkv, t, hd), (b, nkv, t, hd))
    return tuple(torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    storages: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[id(st)] = st
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(st.nbytes() for st in storages.values())


def test_cuda_sdpa_backend_follows_sdp_utils():
    bf16 = qkv(2, 4, 2, 16, 16, torch.bfloat16)
    fp32 = qkv(2, 4, 4, 16, 16, torch.float32)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    assert cuda_sdpa_backend(*bf16, is_causal=True, enable_gqa=True) == "flash"
    assert cuda_sdpa_backend(*qkv(2, 4, 4, 16, 16, torch.bfloat16), attn_mask=mask) == "efficient"
    assert cuda_sdpa_backend(*fp32, is_causal=True) == "efficient"  # flash takes fp16/bf16 only
    assert cuda_sdpa_backend(*qkv(2, 4, 4, 16, 12, torch.bfloat16), attn_mask=mask) == "math"  # 12 % 8
    assert cuda_sdpa_backend(*qkv(2, 4, 2, 16, 16, torch.float32), enable_gqa=True) == "math"
    assert cuda_sdpa_backend(*qkv(2, 4, 4, 16, 512, torch.bfloat16)) == "efficient"  # flash: head <= 256


B, NH, NKV, HD = 2, 4, 2, 16


@pytest.mark.parametrize(
    "dtype, t, masked, on_cpu, on_cuda",
    [
        # bf16, causal, grouped-query: CPU flash and CUDA flash both save q, k, v (nkv heads), out and the fp32
        # logsumexp (B, nh, T); CUDA flash adds its uint64 rng_state (2,) and unused () on the device
        (
            torch.bfloat16, 16, False,
            2 * (2 * B * NH * 16 * HD + 2 * B * NKV * 16 * HD) + 4 * B * NH * 16,
            2 * (2 * B * NH * 16 * HD + 2 * B * NKV * 16 * HD) + 4 * B * NH * 16 + 16 + 8,
        ),
        # bf16, packed documents, T = 12 (memfit.models.attention, no mask kept): on CPU q, k, v (nkv heads), the
        # document ids (B, T) int64, the output and its fp32 logsumexp (B, nh, T); on CUDA, where the backward
        # recomputes each block, only q, k, v and the ids
        (
            torch.bfloat16, 12, True,
            2 * (2 * B * NH * 12 * HD + 2 * B * NKV * 12 * HD) + 8 * B * 12 + 4 * B * NH * 12,
            2 * (B * NH * 12 * HD + 2 * B * NKV * 12 * HD) + 8 * B * 12,
        ),
        # fp32, causal, grouped-query, T = 40: on CUDA memfit expands keys and values (2 copies of (B, nh, T, hd))
        # and the memory-efficient kernel pads the logsumexp to 64 queries
        (
            torch.float32, 40, False,
            4 * (2 * B * NH * 40 * HD + 2 * B * NKV * 40 * HD) + 4 * B * NH * 40,
            4 * 4 * B * NH * 40 * HD + 4 * B * NH * 64 + 16,
        ),
    ],
)  # fmt: skip
def test_attention_saves_what_the_cuda_kernel_saves(dtype, t, masked, on_cpu, on_cuda):
    """memfit's attention (``causal_attention``) on fake tensors saves, for backward, the bytes by hand."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = qkv(B, NH, NKV, t, HD, dtype)
        doc_ids = torch.zeros(B, t, dtype=torch.long) if masked else None
        assert saved_bytes(lambda: decoder.causal_attention(q, k, v, doc_ids=doc_ids)) == on_cpu
        with cuda_paths(True):
            assert saved_bytes(lambda: decoder.causal_attention(q, k, v, doc_ids=doc_ids)) == on_cuda
            y = decoder.causal_attention(q, k, v, doc_ids=doc_ids)
            y.sum().backward()  # the CUDA kernels' backward runs on fake tensors too
        assert y.shape == q.shape and k.grad.shape == k.shape


def test_cuda_paths_swaps_only_while_entered():
    import torchao.optim.adam as adam  # noqa: F401 - torchao imported: its update is swapped too

    originals = (F.scaled_dot_product_attention, decoder.causal_attention, adam.single_param_adam)
    with cuda_paths(False):
        assert (F.scaled_dot_product_attention, decoder.causal_attention, adam.single_param_adam) == originals
    with cuda_paths(True):
        swapped = (F.scaled_dot_product_attention, decoder.causal_attention, adam.single_param_adam)
        assert all(a is not b for a, b in zip(swapped, originals, strict=True))
    assert (F.scaled_dot_product_attention, decoder.causal_attention, adam.single_param_adam) == originals
    from memfit.memory import hybrids

    # off CUDA torchao's eager update runs chunk by chunk; a CUDA run updates each tensor whole (compiled)
    chunk = hybrids.LOW_BIT_CHUNK_ELEMENTS
    with cuda_paths(True):
        assert hybrids.LOW_BIT_CHUNK_ELEMENTS > 2**62
    assert hybrids.LOW_BIT_CHUNK_ELEMENTS == chunk == 2**20


# ----------------------------------------------------------------------------------------------------------------
# End to end: device=cuda vs device=cpu estimates of the tiny preset
# ----------------------------------------------------------------------------------------------------------------

# the tiny preset: vocab 256, dim 64, 2 layers, 4 query / 2 kv heads of 16; fp32 unless said
TINY = {"model": "tiny", "tokenizer.kind": "char", "tokenizer.vocab_size": 65, "optimizer.name": "adamw"}
LAYERS, EMBEDDING = 2, 256 * 64


def estimates(**overrides):
    """``estimate_run`` of the tiny run with ``overrides``, on CPU and on CUDA."""
    items = {**TINY, "batch_size": 1, "seq_len": 16, **overrides}
    args = [f"{k}={v}" for k, v in items.items()]
    return tuple(estimate_run(load_config(None, [*args, f"device={d}"])) for d in ("cpu", "cuda"))


def test_bitsandbytes_estimates_differ_on_cuda_by_the_cpu_kernel_alone(monkeypatch):
    """A CUDA estimate calls bitsandbytes' op (no temporaries), a CPU one runs its CPU kernel: the CPU peak moves
    to the update of the 256 x 64 embedding (or lm_head, as large), with the kernel's 20 bytes per fp32 element;
    with the CPU kernel off the two estimates are the same to the byte."""
    from memfit.memory import bnb_cpu

    cpu, cuda = estimates(**{"optimizer.name": "adamw8bit"})
    assert cpu.phase == "optimizer_step" and cuda.phase == "backward"
    assert cpu.breakdown["temporaries"] >= 20 * EMBEDDING > cuda.breakdown["temporaries"]
    monkeypatch.setattr(bnb_cpu, "BNB_CPU_UPDATES_COMPOSED", False)
    as_on_cuda, _ = estimates(**{"optimizer.name": "adamw8bit"})
    assert (cuda.peak_bytes, cuda.breakdown, cuda.phase) == (
        as_on_cuda.peak_bytes, as_on_cuda.breakdown, as_on_cuda.phase
    )  # fmt: skip


def test_torchao_4bit_estimate_on_cuda_holds_the_compiled_buffers_at_its_peak():
    """Both peaks are in the update of the 256 x 64 embedding (or lm_head, as large): eagerly 24 bytes per fp32
    element (``p.float()`` and ``grad.float()`` are the tensors themselves) and the three scalars; compiled, the
    int64 codes and the fp32 scales of both moments."""
    cpu, cuda = estimates(**{"optimizer.name": "torchao_adamw4bit"})
    assert cpu.phase == cuda.phase == "optimizer_step"
    n = EMBEDDING
    assert cpu.peak_bytes - cuda.peak_bytes == (24 * n + 3 * 4) - 2 * (8 * n + 4 * n // 128)


@pytest.mark.parametrize(
    "dtype, per_layer",
    [
        # keys and values expanded to 4 heads instead of 2, the logsumexp padded from 40 to 64 queries, the
        # philox seed and offset
        ("fp32", 2 * 4 * (NH - NKV) * 40 * HD * 4 + 4 * NH * (64 - 40) * 4 + 16),
        ("bf16", 16 + 8),  # flash on both; CUDA's rng_state and unused
    ],
)
def test_attention_on_cuda_adds_the_cuda_kernels_saved_bytes_at_the_peak(dtype, per_layer):
    """Batch 4 x 40 tokens: the peak is at the start of backward, with both layers' saved attention inputs."""
    cpu, cuda = estimates(batch_size=4, seq_len=40, dtype=dtype)
    assert cpu.phase == cuda.phase == "backward"
    assert cuda.peak_bytes - cpu.peak_bytes == LAYERS * per_layer
    assert cuda.breakdown["activations"] - cpu.breakdown["activations"] == LAYERS * per_layer
