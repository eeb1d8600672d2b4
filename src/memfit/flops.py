"""Model FLOPs utilisation (MFU): the FLOPs a training step must do, over what the device can do at its peak.

**Model FLOPs per token** (:func:`training_flops_per_token`), the PaLM paper's accounting (Chowdhery et al.
2022, appendix B) with the causal half of attention:

- forward: ``2 * N_matmul`` (every weight of the projections, the SwiGLU MLP and ``lm_head`` once per token:
  multiply and add) ``+ 2 * num_layers * T * dim`` (scores and weighted values over the ``T / 2`` earlier
  positions on average; ``nh * hd`` in place of ``dim`` where a family sets ``head_dim``, and a sliding window
  of ``W < T`` keys reads ``W * (1 - W / 2T)`` of them in place of ``T / 2``);
- backward: twice the forward for full training (gradients of the inputs and of the weights); once for a frozen
  base (LoRA / adapter: only the inputs' gradients; the few added weights are not counted).

So a full-training step costs ``6 * N_matmul + 6 * num_layers * T * dim`` per token. Recomputation (activation
checkpointing, chunked cross-entropy) is not counted: MFU measures useful work, so recomputing lowers it. The
embedding lookup is not a matmul and is not counted.

**Peak FLOP/s** (:func:`peak_flops_per_second`): the ``peak_flops`` setting when given; on CUDA the dense peak of
the GPU from :data:`CUDA_PEAK_FLOPS` (vendor data sheets); on CPU a matmul probe of a few tens of ms, taken once per
process, and the best figure the probe ever measured on this machine (cached in :func:`cache_path`): a probe taken
while other work shares the cores reads low, and a ceiling that low would put ``mfu`` above 1. A record whose
``mfu`` is above 1 all the same comes with a warning that says why (:func:`mfu_above_one`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from memfit.models.config import DecoderConfig

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


def training_flops_per_token(mcfg: DecoderConfig, seq_len: int, full: bool = True) -> float:
    """Model FLOPs of one training token (forward + backward), see the module docstring.

    Args:
        mcfg: the architecture.
        seq_len: tokens per sequence ``T`` (attention's cost grows with it).
        full: every weight trains (``method: full``); ``False``: a frozen base (LoRA, adapter).

    Returns:
        FLOPs per token.
    """
    d, hd = mcfg.dim, mcfg.head_dim
    per_layer = 2 * d * mcfg.num_heads * hd + 2 * d * mcfg.num_kv_heads * hd + mcfg.mlp_weights(active=True)
    matmul_weights = mcfg.num_layers * per_layer + d * mcfg.vocab_size
    width = mcfg.num_heads * hd  # dim, unless the family sets head_dim
    attention = 0.0
    for window in mcfg.layer_attended_keys(seq_len):  # local and global layers (Gemma) each by its own window
        if window == seq_len:  # the causal half: T / 2 keys a query on average
            attention += 2.0 * seq_len * width
        else:  # a sliding window of W < T keys: W * (1 - W / 2T) keys a query on average, 4 FLOPs a key and channel
            attention += 4.0 * window * (1.0 - window / (2.0 * seq_len)) * width
    forward = 2.0 * matmul_weights + attention
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
    """The CPU's matmul ceiling for ``dtype`` on this process's threads: the best of this process's probe
    (:func:`measure_cpu_matmul`) and of every probe taken before on this machine with the same threads, dtype and
    torch (:func:`cache_path`), so that a quiet moment's figure stands when the cores are busy now. Measured once
    per process and thread count: 5 timed matmuls the first time on a machine, 1 once a figure is cached (each
    process's probe can still raise it). The probe draws from a generator of its own, so the global random state
    (dropout masks, a resumed run's restored state) is left as it was.

    Args:
        dtype: the dtype policy (``fp32``; ``bf16`` / ``bf16_mixed`` probe bf16).

    Returns:
        FLOP/s.
    """
    kind = "fp32" if dtype == "fp32" else "bf16"
    key = (torch.get_num_threads(), kind)
    if key not in _CPU_PROBE:
        machine = _machine_key(*key)
        rates = _read_cache()
        cached = rates.get(machine)
        cached = float(cached) if isinstance(cached, int | float) and math.isfinite(cached) else None
        measured = measure_cpu_matmul(kind, repeats=5 if cached is None else 1)
        if cached is None or measured > cached:
            _write_cache({**rates, machine: measured})
        _CPU_PROBE[key] = max(measured, cached or 0.0)
    return _CPU_PROBE[key]


def measure_cpu_matmul(kind: str, repeats: int = 5) -> float:
    """The best rate of ``repeats`` timed square matmuls after a warm-up, on operands drawn from a generator of
    its own: 1024 x 1024 for ``fp32`` (2.1 GFLOP each), 256 x 256 for ``bf16`` (which has no matrix units on most
    CPUs).

    Args:
        kind: ``fp32`` or ``bf16``.
        repeats: timed matmuls (>= 1).

    Returns:
        FLOP/s (``2 n**3`` per matmul over its best time).
    """
    tdtype = torch.float32 if kind == "fp32" else torch.bfloat16
    n = 1024 if kind == "fp32" else 256
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, dtype=tdtype, generator=generator)
    b = torch.randn(n, n, dtype=tdtype, generator=generator)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def cache_path() -> Path:
    """The file of the best CPU matmul rates measured on this machine: ``$XDG_CACHE_HOME/memfit/cpu_matmul_flops.json``
    (``~/.cache/memfit/...`` when ``XDG_CACHE_HOME`` is unset or empty). Delete it to measure afresh."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "memfit" / "cpu_matmul_flops.json"


def _machine_key(threads: int, kind: str) -> str:
    """What a CPU matmul rate depends on: the CPU model, its cores, the threads, the dtype and torch's kernels."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model
            )
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cpus | {threads} threads | {kind} | torch {torch.__version__}"


def _read_cache() -> dict[str, float]:
    """The cached rates by machine key; ``{}`` when the cache is missing, unreadable or damaged."""
    try:
        rates = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return rates if isinstance(rates, dict) else {}


def _write_cache(rates: dict[str, float]) -> None:
    """Replace the cache with ``rates`` (atomically); a cache that cannot be written is passed over."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rates, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def mfu_above_one(
    mfu: float, step: int, achieved: float, peak: float, device: torch.device, configured: float
) -> str:
    """The warning of the first step record whose ``mfu`` is above 1: the step's model FLOP/s, the ceiling and
    where it came from, and the key that sets it (``mfu`` itself is logged as measured, not clamped).

    Args:
        mfu: the record's ``mfu``.
        step: its step.
        achieved: the step's model FLOP/s (``tokens_per_second_per_gpu`` times the model FLOPs per token).
        peak: the ceiling ``mfu`` divides by.
        device: the training device.
        configured: the ``peak_flops`` setting (0: not set).

    Returns:
        One line.
    """
    if configured > 0:
        why = f"the peak_flops setting ({configured:.3g} FLOP/s) is below what this device does; raise it"
    elif device.type == "cuda":
        why = (
            f"the data-sheet peak of '{torch.cuda.get_device_name(device)}' (memfit.flops.CUDA_PEAK_FLOPS) is below "
            f"what it does; set peak_flops to the device's peak FLOP/s"
        )
    else:
        why = (
            f"the ceiling is the best CPU matmul probe on this machine (this run's, at its start, or one cached in "
            f"'{cache_path()}'), which read low: other work shared the cores when it ran, or the run's matmuls "
            f"are faster than the probe's; set peak_flops to the CPU's peak FLOP/s for a fixed ceiling"
        )
    return (
        f"warning: mfu {mfu:.2f} at step {step} is above 1: the step did {achieved:.3g} model FLOP/s, the ceiling "
        f"is {peak:.3g} FLOP/s; {why}"
    )
