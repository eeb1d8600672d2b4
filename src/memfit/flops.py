"""Model FLOPs utilisation (MFU): the FLOPs a training step must do, over what the device can do at its peak.

**Model FLOPs per token** (:func:`training_flops_per_token`), the PaLM paper's accounting (Chowdhery et al.
2022, appendix B) with the causal half of attention:

- forward: ``2 * N_matmul`` (every weight of the projections, the SwiGLU MLP and ``lm_head`` once per token:
  multiply and add) ``+ 2 * num_layers * T * dim`` (scores and weighted values over the ``T / 2`` earlier
  positions on average);
- backward: twice the forward for full training (gradients of the inputs and of the weights); once for a frozen
  base (LoRA / adapter: only the inputs' gradients; the few added weights are not counted).

So a full-training step costs ``6 * N_matmul + 6 * num_layers * T * dim`` per token. Recomputation (activation
checkpointing, chunked cross-entropy) is not counted: MFU measures useful work, so recomputing lowers it. The
embedding lookup is not a matmul and is not counted.

**Peak FLOP/s** (:func:`peak_flops_per_second`): the ``peak_flops`` setting when given; on CUDA the dense peak of
the GPU from :data:`CUDA_PEAK_FLOPS` (vendor data sheets); on CPU a matmul probe of a few tens of ms, taken once per
process.
"""

from __future__ import annotations

import time

import torch

from memfit.models.llama import LlamaConfig

# dense (not 2:4 sparse) peak FLOP/s from the vendors' data sheets: (bf16 / fp16 tensor cores, fp32 matmuls as
# torch runs them by default: TF32 off, so plain fp32 FMA units)
CUDA_PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 67e12),
    "H100 PCIe": (756e12, 51e12),
    "H100": (989e12, 67e12),  # SXM ("NVIDIA H100 80GB HBM3")
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "L40": (181e12, 90.5e12),
    "L4": (121e12, 30.3e12),
    "A10G": (70e12, 31.2e12),
    "A10": (125e12, 31.2e12),
    "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12),
    "V100": (125e12, 15.7e12),
    "T4": (65e12, 8.1e12),
}
"""GPU name fragment (matched in that order against ``torch.cuda.get_device_name``) -> (bf16, fp32) peak."""

_CPU_PROBE: dict[tuple[int, str], float] = {}  # (threads, dtype) -> FLOP/s


def training_flops_per_token(mcfg: LlamaConfig, seq_len: int, full: bool = True) -> float:
    """Model FLOPs of one training token (forward + backward), see the module docstring.

    Args:
        mcfg: the architecture.
        seq_len: tokens per sequence ``T`` (attention's cost grows with it).
        full: every weight trains (``method: full``); ``False``: a frozen base (LoRA, adapter).

    Returns:
        FLOPs per token.
    """
    d, hd = mcfg.dim, mcfg.dim // mcfg.num_heads
    per_layer = 2 * d * mcfg.num_heads * hd + 2 * d * mcfg.num_kv_heads * hd + 3 * d * mcfg.intermediate_size
    matmul_weights = mcfg.num_layers * per_layer + d * mcfg.vocab_size
    forward = 2.0 * matmul_weights + 2.0 * mcfg.num_layers * seq_len * d
    return forward * (3.0 if full else 2.0)


def peak_flops_per_second(device: torch.device, dtype: str, configured: float = 0.0) -> float | None:
    """The device's peak FLOP/s for ``dtype``'s matmuls.

    Args:
        device: the training device.
        dtype: the dtype policy (``fp32`` uses the fp32 peak, ``bf16`` / ``bf16_mixed`` the bf16 one).
        configured: the ``peak_flops`` setting; > 0 is returned as it is.

    Returns:
        FLOP/s, or ``None`` for a GPU missing from :data:`CUDA_PEAK_FLOPS` (set ``peak_flops``).
    """
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (bf16, fp32) in CUDA_PEAK_FLOPS.items():
            if fragment in name:
                return fp32 if dtype == "fp32" else bf16
        return None
    return cpu_matmul_flops_per_second(dtype)


def cpu_matmul_flops_per_second(dtype: str = "fp32") -> float:
    """The best rate of a 1024 x 1024 x 1024 matmul on this process's CPU threads (best of 5, after a warm-up):
    the ceiling the training step's matmuls can reach. Measured once per process and thread count, on operands
    drawn from a generator of its own: the global random state (dropout masks, a resumed run's restored state) is
    left as it was."""
    key = (torch.get_num_threads(), "fp32" if dtype == "fp32" else "bf16")
    if key not in _CPU_PROBE:
        tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
        n = 1024 if dtype == "fp32" else 256  # bf16 has no matrix units on most CPUs: a small probe
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, dtype=tdtype, generator=generator)
        b = torch.randn(n, n, dtype=tdtype, generator=generator)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        _CPU_PROBE[key] = 2.0 * n**3 / best
    return _CPU_PROBE[key]
