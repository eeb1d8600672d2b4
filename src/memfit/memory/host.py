"""Host memory of a CPU run: what glibc's allocator keeps resident, the process's resident set, and the prediction
of a CPU run's peak RSS (docs/memory.md, "Host memory (RSS) on CPU").

On CPU, torch takes tensor storage from the C library's ``malloc``. glibc serves a request of at least its mmap
threshold (128 KiB) with its own ``mmap``, returned to the kernel on ``free``; smaller ones come from its heaps,
which keep freed memory resident for reuse. By default the threshold is *dynamic*: each time an mmapped block is
freed, the threshold rises to that block's size (up to 32 MiB on 64-bit). A training step frees megabyte-sized
activations within its first milliseconds, so from then on almost every activation, gradient and temporary comes
from the heap, and the heap keeps what the step frees: measured, ~300 MiB of free heap resident at the peak of the
runs of docs/memory.md (:data:`HEAP_RETAINED_BYTES`). In exchange no step pays to fault its memory in again: with
the threshold held at 128 KiB (``MALLOC_MMAP_THRESHOLD_=131072`` in the environment, or ``mallopt``) the peak RSS falls
by those ~300 MiB but the step of a small model takes 1.4-1.65x as long on CPU: every step faults its temporaries
in again.

At scale the trade depends on the step. A large model's long-lived tensors (QLoRA's NF4 codes, LoRA's gradients)
are as small as a step's temporaries, so once the threshold has risen they are served from the heap between the
temporaries, and the holes between them are never given back: an 8B-shaped QLoRA run of 8 layers held 1.84 GiB free
in its heap at its peak (``mallinfo2``), growing step by step, and peaked at 8.25 GiB RSS, 1.3 GiB over the
prediction. With the threshold fixed it peaked at 6.65 GiB (0.6% from the tensors' prediction) at the same step
time: its big temporaries, the dequantized weights and the matmuls' outputs, are over 32 MiB and mapped anyway. A
full fine-tune is the opposite case: its optimizer updates every weight through temporaries of a few MiB each, and a
Llama-3.2-3B-shaped one of 4 layers (torchao 4-bit AdamW in backward) stepped in 165 s instead of 75 s with the
threshold fixed. So a CPU run fixes the threshold itself where its model is wide and only adapters are trained
(``mmap_threshold: auto``, the default: :func:`fixes_mmap_threshold`), and the estimator predicts no free heap for it.
A full fine-tune keeps the threshold dynamic and leaves fewer holes instead: it creates its optimizer state before
its first step (:func:`memfit.memory.optim.create_state`), not between the first backward's temporaries, and
torchao's eager update makes temporaries of 4 MiB (:data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS`). A bf16
full fine-tune of a wide model fixes it at 8 MiB (:data:`BF16_FULL_MMAP_THRESHOLD`), above those temporaries, and
keeps a measured ~300 MiB beside its tensors at its steps' peaks (:data:`BF16_FULL_RETAINED_BYTES`).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

MMAP_THRESHOLD_SETTINGS = ("auto", "dynamic", "fixed")
"""The values of ``mmap_threshold`` (:func:`fixes_mmap_threshold`); config validation takes them from here (memory
modules import no config: config imports the memory registries)."""

HEAP_RETAINED_BYTES = 300 * 1024**2
"""The most free memory glibc's heaps hold at a one-process run's peak under the dynamic mmap threshold: a step
whose tensors peak at 993 MiB or more (:func:`retained_heap_bytes`). Measured as peak RSS - baseline - traced peak -
:data:`RUNTIME_BYTES`: 299 MiB for a 78.6M-parameter model's plain AdamW step (1,630 MiB of tensors), 306 and 273 MiB
on the two smaller runs of docs/memory.md's first table. The Llama-3.2-3B full fine-tune of docs/benchmarks.md ("The
largest model on 24 GiB") kept ~0.7 GiB, its peak RSS 2.5% above the prediction."""

HEAP_RETAINED_FLOOR_BYTES = 32 * 1024**2
"""The free heap of a one-process step with (almost) no tensors: what the run's own Python objects, data and first
step leave in glibc's heaps (:func:`retained_heap_bytes`; 35.5 MiB measured for a 12.3 MiB step)."""

HEAP_RETAINED_FRACTION = 0.27
"""The free heap a one-process step holds per byte of its traced tensor peak, beyond
:data:`HEAP_RETAINED_FLOOR_BYTES` and up to :data:`HEAP_RETAINED_BYTES` (:func:`retained_heap_bytes`). Once glibc's
dynamic threshold has risen to the sizes a step frees, its tensors below 32 MiB are served from the heap, and the
holes between them scale with them. Fitted on six pretraining and fine-tuning steps of 12 to 570 MiB (docs/memory.md,
"Host memory (RSS) on CPU"), each within 18 MiB of the line."""

RUNTIME_BYTES = 48 * 1024**2
"""Bytes a training process holds beyond its imports, its tensors and the allocator's free memory once it steps:
the pages of the compute kernels (oneDNN, MKL, OpenMP) touched by the first step, the stacks of torch's worker
threads and of the RSS sampler, the tokenizer and the memory-mapped batches, heap blocks of small tensors. Measured
with the mmap threshold held (no free heap) on the three runs of docs/memory.md: 52, 36 and 80 MiB."""

FIXED_MMAP_THRESHOLD = 128 * 1024
"""The mmap threshold a run fixes (``mallopt(M_MMAP_THRESHOLD)``): glibc's own initial value, under which the runs of
docs/memory.md keep no free heap."""

FIXED_MMAP_THRESHOLD_FROM_DIM = 2048
"""``mmap_threshold: auto`` fixes the threshold for adapter fine-tunes (LoRA, QLoRA, adapter) of models of at least
this hidden size (``dim``): their step's temporaries are the matmuls' and the dequantized weights', whose cost of
faulting in again falls as ~1/dim against the arithmetic (1.4-1.65x the step time at dim 256 and 768,
docs/memory.md; none measurable for QLoRA at dim 4,096), while the heap's holes grow to gigabytes."""

BF16_FULL_MMAP_THRESHOLD = 8 * 1024**2
"""The mmap threshold ``mmap_threshold: auto`` fixes for a bf16 full fine-tune of a model at least
:data:`FIXED_MMAP_THRESHOLD_FROM_DIM` wide: above the chunked updates' temporaries (2**20 fp32 elements, 4 MiB), which
the heap serves and reuses hole for hole, and below a layer's activations and checkpoints (a 2,048-token hidden state
of dim 4,096 is 16 MiB), which glibc's dynamic threshold (risen to 32 MiB) would leave in the heap between
temporaries. A Llama-3.1-8B-shaped stand-in with 4 layers (bf16 Adafactor in the backward, ac=full, 1 x 2048): peak
RSS 5.59 -> 5.23 GiB, the free heap at the peak 0.48 -> 0.12 GiB, steps as fast (docs/memory.md)."""

BF16_FULL_RETAINED_BYTES = 300 * 1024**2
"""Bytes a bf16 full fine-tune that fixes the threshold at :data:`BF16_FULL_MMAP_THRESHOLD` holds at its step's peak
beyond its tensors, :data:`RUNTIME_BYTES` and its baseline: its chunked updates' temporaries (4 MiB) and its
sub-8-MiB activations stay in the heap, and the holes between them with them. Measured as peak RSS - prediction
without it on the four such rows of docs/benchmarks.md: Llama-3.1-8B 0.27 GiB, Qwen3-8B 0.35, OLMoE-1B-7B 0.17,
Llama-3.2-3B DPO 0.39 (mean 0.30); a 4-layer stand-in of the last held 0.38 GiB free in its heap at its peak
(``mallinfo2``), 0.11 with the threshold at 4 MiB (its steps 22% slower), 0.02 at 128 KiB (43% slower). A replay of
the traced step's own allocations through a model of glibc's heap leaves only 0.03 GiB of it free at the 28-layer
step's peak: the holes are made around the step (loading, the data, the first step), by blocks no trace holds. Only
the steps hold it: the load comes before it, and a checkpoint's save gives it back first
(:func:`release_free_heap`)."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_TUNABLES = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")


def glibc() -> bool:
    """Whether this process's C library is glibc (Linux)."""
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def dynamic_mmap_threshold(environ: Mapping[str, str] | None = None) -> bool:
    """Whether glibc's mmap threshold of a process started with ``environ`` is dynamic: on glibc, unless the
    environment sets the threshold, the trim threshold, the top pad or the mmap count (``MALLOC_*_`` or
    ``glibc.malloc.*`` in ``GLIBC_TUNABLES``), any of which fixes it (glibc's ``mallopt``).

    Args:
        environ: the environment; default this process's.
    """
    env = os.environ if environ is None else environ
    if not glibc():
        return False
    tunables = env.get("GLIBC_TUNABLES", "")
    return not any(env.get(k) for k in _MALLOC_SETTINGS) and not any(
        f"glibc.malloc.{t}=" in tunables for t in _TUNABLES
    )


def fixes_mmap_threshold(
    setting: str,
    dim: int,
    device_type: str,
    method: str,
    environ: Mapping[str, str] | None = None,
    dtype: str = "fp32",
) -> bool:
    """Whether a run fixes glibc's mmap threshold at :data:`FIXED_MMAP_THRESHOLD` when it starts
    (:func:`fix_mmap_threshold`): a CPU run on glibc whose environment leaves malloc's settings alone
    (:func:`dynamic_mmap_threshold`), with ``mmap_threshold: fixed``, or ``auto``, an adapter method or a bf16 full
    fine-tune and a model at least :data:`FIXED_MMAP_THRESHOLD_FROM_DIM` wide (the threshold:
    :func:`mmap_threshold_bytes`). The estimator asks the same question, and predicts no free heap where the answer
    is yes at 128 KiB (:func:`retained_heap_bytes`).

    Args:
        setting: the config key ``mmap_threshold``: ``auto``, ``dynamic`` or ``fixed``.
        dim: the model's hidden size.
        device_type: ``cpu`` or ``cuda`` (a CUDA run's tensors are not on the C heap: never).
        method: the config key ``method`` (``full`` trains every weight: ``auto`` leaves the threshold dynamic
            unless ``dtype`` is bf16).
        environ: the environment; default this process's.
        dtype: the config key ``dtype``.

    Raises:
        ValueError: ``setting`` is not one of :data:`MMAP_THRESHOLD_SETTINGS`.
    """
    if setting not in MMAP_THRESHOLD_SETTINGS:
        raise ValueError(
            f"mmap_threshold must be one of {', '.join(MMAP_THRESHOLD_SETTINGS)}, got {setting!r}"
        )
    if device_type != "cpu" or setting == "dynamic" or not dynamic_mmap_threshold(environ):
        return False
    wide = dim >= FIXED_MMAP_THRESHOLD_FROM_DIM
    return setting == "fixed" or (wide and (method != "full" or dtype == "bf16"))


def mmap_threshold_bytes(method: str, dtype: str) -> int:
    """The threshold a run that fixes it (:func:`fixes_mmap_threshold`) fixes: :data:`BF16_FULL_MMAP_THRESHOLD` for a
    bf16 full fine-tune, else :data:`FIXED_MMAP_THRESHOLD`."""
    return BF16_FULL_MMAP_THRESHOLD if method == "full" and dtype == "bf16" else FIXED_MMAP_THRESHOLD


def fix_mmap_threshold(threshold: int = FIXED_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for the rest of the process (``mallopt``): from now on every
    request of at least that size gets its own ``mmap``, given back to the kernel when freed, and the threshold no
    longer rises. Blocks the heaps hold already stay there.

    Args:
        threshold: bytes; glibc takes at most 32 MiB on 64-bit.

    Returns:
        Whether it was set (``False`` off glibc).
    """
    mallopt = _glibc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold) == 1


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
"""oneDNN's environment variable for the primitives it keeps (1,024 by default), read when it makes its first."""
TORCH_LRU_CACHE_ENV = "LRU_CACHE_CAPACITY"
"""torch's environment variable for the oneDNN matmul primitives its CPU kernels keep, one per shape (ideep's LRU
cache, 1,024 by default), read at its first CPU bf16 matmul."""
TORCH_LRU_CACHE_CAPACITY = 64
"""What a mixture of experts on CPU leaves torch's LRU cache (:data:`TORCH_LRU_CACHE_ENV`): a dense model's few
shapes a step (~146 KiB an entry, measured: 9 MiB at most)."""


def caps_onednn_cache(device_type: str, num_experts: int | None) -> bool:
    """Whether a run caps the caches of matmul primitives (:func:`cap_onednn_primitive_cache`): a mixture of experts
    on CPU.

    Each expert's matmul has as many rows as tokens reached it, a new shape at almost every expert and step, and two
    caches keep a primitive per shape, up to 1,024 each: oneDNN's own (a 4-layer stand-in of Qwen3-30B-A3B's QLoRA
    step held 0.35 GiB more resident memory after 4 steps than its tensors need, 3.25 -> 3.60 GiB, none of it a
    tensor and none of it free heap; without the cache 3.09 -> 3.26 GiB at the same speed), and torch's LRU cache of
    the oneDNN matmuls it runs (``LRU_CACHE_CAPACITY``): 1,000 row counts of a (m, 2048) x (2048, 2048) bf16 matmul
    and its weight gradient left 0.29 GiB of anonymous memory outside malloc with oneDNN's cache off, 0.02 GiB with
    torch's at 1; a 4-layer stand-in of OLMoE-1B-7B's bf16 full fine-tune peaked at 5.72 GiB (predicted 5.24),
    its resident set growing step by step as new shapes came, and at 5.32 GiB with torch's cache at 64, as fast.
    A dense model's shapes repeat, so its caches stay small.
    """
    return device_type == "cpu" and num_experts is not None


def cap_onednn_primitive_cache(capacity: int = 0, lru_capacity: int = TORCH_LRU_CACHE_CAPACITY) -> list[str]:
    """Keep at most ``capacity`` oneDNN primitives (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ``lru_capacity`` in
    torch's LRU cache of oneDNN matmuls (``LRU_CACHE_CAPACITY``), each unless the environment sets it already. They
    take effect only before the process's first oneDNN primitive (its first CPU bf16 matmul).

    Returns:
        ``NAME=VALUE`` of each variable this set.
    """
    made = []
    for name, value in ((ONEDNN_CACHE_ENV, capacity), (TORCH_LRU_CACHE_ENV, lru_capacity)):
        if name not in os.environ:
            os.environ[name] = str(value)
            made.append(f"{name}={value}")
    return made


def release_free_heap() -> bool:
    """Give the free memory inside glibc's heaps back to the kernel (``malloc_trim(0)``). Called before each
    checkpoint (the steps' free heap would come on top of the save) and once after the data is ready: preparing it
    in the run (training the BPE tokenizer, tokenizing the corpus) builds and frees millions of small Python
    objects, which leaves ~140 MiB of free heap resident below live blocks, where the heap's top cannot be trimmed
    (the main job's peak RSS: 1,371 -> 1,252 MiB).

    Returns:
        Whether any memory was released (``False`` off glibc).
    """
    malloc_trim = _glibc_function("malloc_trim", (ctypes.c_size_t,))
    return malloc_trim is not None and malloc_trim(0) == 1


def _glibc_function(name: str, argtypes: tuple[Any, ...]) -> Any:
    """glibc's ``int name(argtypes)`` from this process's C library, or ``None`` off glibc or where it is missing."""
    if not glibc():
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def process_rss_bytes() -> int | None:
    """This process's resident set now, in bytes (Linux ``/proc/self/statm``), or ``None`` where it cannot be read.
    Opens the file per read: a few microseconds, and no descriptor is held."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def predict_peak_rss(
    tensor_peak_bytes: int,
    baseline_bytes: int,
    *,
    heap_retained_bytes: int,
    runtime_bytes: int = RUNTIME_BYTES,
) -> int:
    """A CPU run's peak resident set: the process's baseline (interpreter, torch, memfit and the optimizer library
    imported, their code and data pages), plus what stepping adds outside tensors (:data:`RUNTIME_BYTES`), plus the
    free memory the allocator keeps (:data:`HEAP_RETAINED_BYTES` under glibc's dynamic mmap threshold, else 0),
    plus the traced peak of live tensors.

    Args:
        tensor_peak_bytes: the traced peak of live tensor bytes (:attr:`memfit.planner.estimate.Estimate.peak_bytes`
            plus the host bytes of the run).
        baseline_bytes: the resident set of a process that has imported what the run imports and holds no tensors.
        heap_retained_bytes: free memory the allocator holds at the peak.
        runtime_bytes: what a stepping process holds beyond imports, tensors and the allocator's free memory.

    Returns:
        Bytes.

    Raises:
        ValueError: a negative argument.
    """
    if min(tensor_peak_bytes, baseline_bytes, heap_retained_bytes, runtime_bytes) < 0:
        raise ValueError(
            f"predict_peak_rss needs non-negative numbers, got tensor_peak_bytes={tensor_peak_bytes}, "
            f"baseline_bytes={baseline_bytes}, heap_retained_bytes={heap_retained_bytes}, "
            f"runtime_bytes={runtime_bytes}"
        )
    return baseline_bytes + runtime_bytes + heap_retained_bytes + tensor_peak_bytes


SHARDED_HEAP_GATHERED_FRACTION = 0.3
"""The free heap a rank of a sharded CPU run holds at its peak beyond :data:`HEAP_RETAINED_BYTES`, per byte of the
parameters it all-gathers each step (one per byte of the gradients it reduce-scatters; :func:`retained_heap_bytes`).
Fitted on the runs listed there."""


def retained_heap_bytes(
    gathered_parameter_bytes: int = 0,
    reduced_gradient_bytes: int = 0,
    *,
    fixed: bool = False,
    threshold: int = FIXED_MMAP_THRESHOLD,
    step_peak_bytes: int | None = None,
) -> int:
    """Bytes of free memory glibc's heaps will hold at the peak of this process's steps, under a dynamic mmap
    threshold (where the run fixes it, ``fixed``, :func:`fixes_mmap_threshold`: 0 at :data:`FIXED_MMAP_THRESHOLD`,
    :data:`BF16_FULL_RETAINED_BYTES` at a higher ``threshold``).

    One process: :data:`HEAP_RETAINED_FLOOR_BYTES` plus :data:`HEAP_RETAINED_FRACTION` of the step's traced tensor
    peak ``step_peak_bytes``, at most :data:`HEAP_RETAINED_BYTES` (the most, when the step is not known). A rank of
    a sharded CPU run: :data:`HEAP_RETAINED_BYTES`, plus the gradients it reduce-scatters each step and
    :data:`SHARDED_HEAP_GATHERED_FRACTION` of the parameters it all-gathers.

    Every step a rank gathers every parameter and reduce-scatters every gradient, group by group, through flat
    buffers: FSDP2's all-gather output and gloo's flat all-gather output; FSDP2's reduce-scatter input, gloo's clone
    of it and the reduce-scatter output, which stays as the sharded gradients until the next step. Once the
    threshold has risen, glibc serves them from its heaps, between shorter- and longer-lived blocks, and the heaps
    keep the holes (``malloc_info`` at a peak: most of the free memory in the main arena, 48 MiB in each of gloo's
    two threads' arenas). Fitted on 2-rank gloo runs of 10 steps on an otherwise idle machine, two runs each (free
    heap = peak RSS - process baseline - :data:`RUNTIME_BYTES` - traced peak, per rank; the same runs with
    ``MALLOC_MMAP_THRESHOLD_=131072`` came within 2.5% of the prediction without any free heap): a full fine-tune of
    a 127.5M-parameter fp32 model (486.5 MiB of parameters, as many of gradients) 660-1,128 MiB over its 4 ranks
    (mean 911), its LoRA fine-tune (no gradient of size) 379-505 MiB (mean 448); predicted 932 and 446 MiB. A
    fitted figure, not a law: the holes follow the threads' timing, so one rank's peak RSS can be 10% off (the
    two ranks of one full fine-tune: 2.65 and 3.11 GiB); on a machine loaded 5-6x over its cores the same runs held
    900-1,140 and 465-740 MiB, and the holes grow over the first 3-4 steps (560-850 MiB in runs of 3-4 steps).

    Args:
        gathered_parameter_bytes: a rank of a sharded run: bytes of the whole model's parameters (unsharded),
            which it all-gathers each step; 0 for one process.
        reduced_gradient_bytes: a rank of a sharded run: bytes of the whole model's gradients (unsharded), which it
            reduce-scatters each step (those of the trainable parameters); 0 for one process.
        fixed: the run fixes the threshold when it starts (:func:`fixes_mmap_threshold`).
        threshold: the threshold it fixes, bytes (:func:`mmap_threshold_bytes`).
        step_peak_bytes: one process: the traced peak of the step's live tensors, bytes; ``None`` (not known yet:
            the planner's budget, the pre-flight's fallback) gives the most, :data:`HEAP_RETAINED_BYTES`.

    Returns:
        Bytes.
    """
    if fixed:
        return BF16_FULL_RETAINED_BYTES if threshold > FIXED_MMAP_THRESHOLD else 0
    if not dynamic_mmap_threshold():
        return 0
    if gathered_parameter_bytes == 0 and reduced_gradient_bytes == 0 and step_peak_bytes is not None:
        scaled = HEAP_RETAINED_FLOOR_BYTES + int(HEAP_RETAINED_FRACTION * step_peak_bytes)
        return min(HEAP_RETAINED_BYTES, scaled)
    return (
        HEAP_RETAINED_BYTES
        + int(SHARDED_HEAP_GATHERED_FRACTION * gathered_parameter_bytes)
        + reduced_gradient_bytes
    )


def process_overhead_bytes(
    gathered_parameter_bytes: int = 0,
    reduced_gradient_bytes: int = 0,
    *,
    fixed: bool = False,
    threshold: int = FIXED_MMAP_THRESHOLD,
    step_peak_bytes: int | None = None,
) -> int:
    """What a CPU training process holds at its peak besides its tensors, predicted from this process: its resident
    set now (imports; call it from a process that has imported memfit's training path and no model) plus
    :data:`RUNTIME_BYTES` plus :func:`retained_heap_bytes` (of the arguments: a rank of a sharded run's whole-model
    parameter and gradient bytes, 0 for one process; ``fixed``: the run fixes the mmap threshold, at
    ``threshold``; ``step_peak_bytes``: the step's tensor peak where known, ``None`` for the most, 0 for what the
    process holds before any tensor). What :func:`predict_peak_rss` adds to a traced step's peak."""
    retained = retained_heap_bytes(
        gathered_parameter_bytes,
        reduced_gradient_bytes,
        fixed=fixed,
        threshold=threshold,
        step_peak_bytes=step_peak_bytes,
    )
    return predict_peak_rss(0, process_rss_bytes() or 0, heap_retained_bytes=retained)


def tensor_share_bytes(
    rss_budget_bytes: int,
    gathered_parameter_bytes: int = 0,
    reduced_gradient_bytes: int = 0,
    *,
    fixed: bool = False,
    threshold: int = FIXED_MMAP_THRESHOLD,
) -> int:
    """The largest traced tensor peak whose predicted peak RSS (:func:`predict_peak_rss` over this process's resident
    set, with the free heap :func:`retained_heap_bytes` predicts for that peak) stays within ``rss_budget_bytes``:
    what a planner compares traced peaks with, for a budget of RSS. 0 when even no tensor fits. The predicted RSS
    grows with the peak (by 1.27 per byte up to the free heap's most, then by 1), so it is found by bisection.

    Args:
        rss_budget_bytes: the peak resident set allowed, bytes.
        gathered_parameter_bytes, reduced_gradient_bytes, fixed, threshold: as :func:`retained_heap_bytes`.

    Returns:
        Bytes of tensors.
    """
    baseline = process_rss_bytes() or 0

    def rss(tensors: int) -> int:
        retained = retained_heap_bytes(
            gathered_parameter_bytes,
            reduced_gradient_bytes,
            fixed=fixed,
            threshold=threshold,
            step_peak_bytes=tensors,
        )
        return predict_peak_rss(tensors, baseline, heap_retained_bytes=retained)

    low, high = 0, max(0, rss_budget_bytes)
    if rss(0) > rss_budget_bytes:
        return 0
    while low < high:  # rss(low) fits; the answer is in [low, high]
        middle = (low + high + 1) // 2
        low, high = (middle, high) if rss(middle) <= rss_budget_bytes else (low, middle - 1)
    return low
