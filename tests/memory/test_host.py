"""Host memory of CPU runs (``memfit.memory.host``): the peak-RSS prediction's arithmetic, in ``estimate_run``,
``memfit estimate``'s report and its JSON; when glibc's mmap threshold is dynamic (freed blocks kept in the heap)
and when the environment fixes it; ``malloc_trim`` after the data is ready. Memory figures only, no timings
(docs/memory.md, "Host memory (RSS) on CPU")."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from memfit.config import load_config
from memfit.memory import host
from memfit.planner.estimate import Estimate, estimate_run
from memfit.planner.report import format_estimate
from memfit.units import GIB, MIB

pytestmark = pytest.mark.usefixtures("one_thread")

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
TINY = ["model=tiny", "tokenizer.kind=char", "tokenizer.vocab_size=65", "batch_size=2", "seq_len=16"]
TINY += ["optimizer.name=adamw"]  # the host model's fits were made with AdamW (left out, from scratch: Muon)


def test_predicted_peak_rss_adds_baseline_runtime_retained_heap_and_tensors():
    assert host.RUNTIME_BYTES == 48 * MIB == 50_331_648
    assert host.HEAP_RETAINED_BYTES == 300 * MIB == 314_572_800
    # the least-memory 78.6M run of docs/memory.md: 590,093,312 traced tensor bytes over a 347 MiB baseline
    # (363,855,872), plus 48 MiB of runtime and 300 MiB of free heap: 1,318,853,632 bytes = 1,257.75 MiB
    tensors, baseline = 590_093_312, 347 * MIB
    rss = host.predict_peak_rss(tensors, baseline, heap_retained_bytes=host.HEAP_RETAINED_BYTES)
    assert rss == 363_855_872 + 50_331_648 + 314_572_800 + 590_093_312 == 1_318_853_632
    # the mmap threshold fixed by the environment: no free heap kept, 1,004,280,832 bytes
    assert host.predict_peak_rss(tensors, baseline, heap_retained_bytes=0) == 1_004_280_832
    assert host.predict_peak_rss(0, 123, heap_retained_bytes=7, runtime_bytes=100) == 230
    with pytest.raises(ValueError, match="non-negative"):
        host.predict_peak_rss(-1, 0, heap_retained_bytes=0)


@pytest.mark.skipif(not GLIBC, reason="glibc's mmap threshold")
def test_a_process_retains_free_heap_in_proportion_to_its_step_up_to_300_mib(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert host.HEAP_RETAINED_FLOOR_BYTES == 32 * MIB and host.HEAP_RETAINED_FRACTION == 0.27
    # docs/memory.md's runs: a 12.3 MiB step (measured 35.5 MiB free), the main job's 562.8 MiB (172.8-183.3)
    assert host.retained_heap_bytes(step_peak_bytes=12_897_484) == 33_554_432 + 3_482_320 == 37_036_752
    assert host.retained_heap_bytes(step_peak_bytes=590_138_982) == 33_554_432 + 159_337_525 == 192_891_957
    # from 993 MiB of tensors up, the most (a 1,630 MiB AdamW step: 299 MiB measured); unknown step: the most
    assert host.retained_heap_bytes(step_peak_bytes=993 * MIB) == host.HEAP_RETAINED_BYTES
    assert host.retained_heap_bytes(step_peak_bytes=1630 * MIB) == host.HEAP_RETAINED_BYTES == 314_572_800
    assert host.retained_heap_bytes() == host.HEAP_RETAINED_BYTES
    # a rank of a sharded run keeps the sharded fit (its base is the most), whatever its step
    assert host.retained_heap_bytes(1, 0, step_peak_bytes=0) == host.HEAP_RETAINED_BYTES
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert host.retained_heap_bytes(step_peak_bytes=590_138_982) == 0


@pytest.mark.skipif(not GLIBC, reason="glibc's mmap threshold")
def test_a_sharded_rank_retains_a_part_of_the_model_and_its_gradients_besides(monkeypatch):
    # the 2-rank full fine-tune: 127,539,456 fp32 parameters (486.5 MiB) and a 32-value fp32 RoPE buffer,
    # as many gradients (its rank's 1.669 GiB traced peak over a 0.29 GiB baseline was predicted 2.04 GiB RSS with
    # 300 MiB of free heap; measured 2.7-3.1 GiB)
    params, grads = 4 * 127_539_456 + 4 * 32, 4 * 127_539_456
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert host.retained_heap_bytes() == host.HEAP_RETAINED_BYTES
    assert host.SHARDED_HEAP_GATHERED_FRACTION == 0.3
    assert host.retained_heap_bytes(params) == 314_572_800 + 153_047_385  # its LoRA fine-tune: 446.0 MiB
    assert host.retained_heap_bytes(params, grads) == 467_620_185 + 510_157_824 == 977_778_009  # 932.5 MiB
    # freed tensors go back to the kernel: nothing kept
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert host.retained_heap_bytes(params, grads) == 0


@pytest.mark.skipif(not GLIBC, reason="glibc's mmap threshold")
def test_the_mmap_threshold_is_dynamic_unless_the_environment_fixes_it():
    assert host.dynamic_mmap_threshold({})
    assert host.dynamic_mmap_threshold({"GLIBC_TUNABLES": "glibc.malloc.check=0", "MALLOC_ARENA_MAX": "2"})
    for env in (
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_TOP_PAD_": "0"},
        {"MALLOC_MMAP_MAX_": "65536"},
        {"GLIBC_TUNABLES": "glibc.malloc.check=0:glibc.malloc.mmap_threshold=131072"},
    ):
        assert not host.dynamic_mmap_threshold(env), env


@pytest.mark.skipif(not GLIBC, reason="glibc's mmap threshold")
def test_a_wide_model_fixes_the_mmap_threshold_and_keeps_no_free_heap(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert host.FIXED_MMAP_THRESHOLD == 131_072 and host.FIXED_MMAP_THRESHOLD_FROM_DIM == 2048
    # auto: adapter fine-tunes of wide models; a full fine-tune's optimizer would fault its temporaries in again
    for method in ("lora", "qlora", "adapter"):
        assert host.fixes_mmap_threshold("auto", 2048, "cpu", method)
        assert not host.fixes_mmap_threshold("auto", 2047, "cpu", method)
    assert not host.fixes_mmap_threshold("auto", 4096, "cpu", "full")
    # a bf16 full fine-tune of a wide model: fixed, above the chunked updates' 4 MiB temporaries
    assert host.fixes_mmap_threshold("auto", 4096, "cpu", "full", dtype="bf16")
    assert not host.fixes_mmap_threshold("auto", 2047, "cpu", "full", dtype="bf16")
    assert host.mmap_threshold_bytes("full", "bf16") == 8 * 2**20 > 4 * 2**20
    assert (
        host.mmap_threshold_bytes("full", "fp32") == host.mmap_threshold_bytes("qlora", "bf16") == 128 * 1024
    )
    assert host.fixes_mmap_threshold("fixed", 64, "cpu", "full")
    assert not host.fixes_mmap_threshold("dynamic", 4096, "cpu", "qlora")
    assert not host.fixes_mmap_threshold(
        "fixed", 4096, "cuda", "full"
    )  # a CUDA run's tensors are not on the C heap
    # the environment's own malloc setting wins: the run leaves it
    assert not host.fixes_mmap_threshold("fixed", 4096, "cpu", "full", {"MALLOC_MMAP_THRESHOLD_": "4194304"})
    with pytest.raises(ValueError, match="mmap_threshold must be one of auto, dynamic, fixed, got 'on'"):
        host.fixes_mmap_threshold("on", 4096, "cpu", "full")
    assert host.retained_heap_bytes(10**9, 10**9, fixed=True) == 0
    # fixed at 8 MiB (a bf16 full fine-tune): its 4 MiB updates and smaller activations keep holes in the heap
    assert host.retained_heap_bytes(fixed=True, threshold=host.BF16_FULL_MMAP_THRESHOLD) == 314_572_800
    # the tiny preset (dim 64): auto leaves the threshold dynamic (32 MiB and 0.27 of its step's tensors of free heap
    # predicted), fixed does not
    auto = estimate_run(load_config(None, [*TINY, "device=cpu"]))
    fixed = estimate_run(load_config(None, [*TINY, "device=cpu", "mmap_threshold=fixed"]))
    assert (
        not auto.fixes_mmap_threshold
        and fixed.fixes_mmap_threshold
        and fixed.to_json()["fixes_mmap_threshold"]
    )
    assert auto.host_peak_rss_bytes - auto.process_baseline_bytes == (
        host.RUNTIME_BYTES + 33_554_432 + int(0.27 * auto.peak_bytes) + auto.peak_bytes
    )
    assert fixed.host_peak_rss_bytes - fixed.process_baseline_bytes == host.RUNTIME_BYTES + fixed.peak_bytes


# a block once the threshold has risen past it: from the heap (dynamic), or mapped on its own (fixed; a request the
# heap's free top can hold is still served from there, as glibc maps only what the heap would have to grow for)
_FIXED = """
import ctypes
from memfit.memory import host
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.free(libc.malloc(8 << 20))  # an 8 MiB block freed: the dynamic threshold rises to 8 MiB
def mapped_for(nbytes):
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(nbytes)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return mapped
dynamic = mapped_for(1 << 20)  # the heap grows by it, and keeps it free at its top
assert host.fix_mmap_threshold()
print(dynamic, mapped_for(4 << 20))  # more than the heap's free top: mapped, as every block over 128 KiB would be
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_fixing_the_mmap_threshold_maps_each_block_over_it_on_its_own():
    dynamic, fixed = map(int, _run_with_glibc_defaults(_FIXED).split())
    assert dynamic == 0  # served from the heap, kept there when freed
    # its own mapping (with malloc's header, rounded up to a page), unmapped at free
    assert fixed == (4 << 20) + 4096


def test_estimate_of_a_cpu_run_adds_the_process_baseline_to_the_traced_peak():
    e = estimate_run(load_config(None, [*TINY, "device=cpu"]))
    assert e.process_baseline_bytes is not None and e.process_baseline_bytes > 0
    step = e.peak_bytes + e.host_bytes
    retained = 33_554_432 + int(0.27 * step) if host.dynamic_mmap_threshold() else 0
    assert e.host_peak_rss_bytes == e.process_baseline_bytes + host.RUNTIME_BYTES + retained + step
    out = e.to_json()
    assert out["host_peak_rss_gib"] * GIB == pytest.approx(e.host_peak_rss_bytes, abs=1)
    assert out["process_baseline_gib"] * GIB == pytest.approx(e.process_baseline_bytes, abs=1)
    # a rank of a sharded run: its heaps also keep the gradients it reduces each step and 0.3 of the parameters it
    # gathers, whole: the tiny preset's 106,816 fp32 gradients (427,264 bytes) and 0.3 of its parameters and RoPE
    # buffer (427,296 bytes), not its 2 ranks' halves: 555,452 bytes
    cfg = load_config(None, [*TINY, "device=cpu"], world_size=2)
    sharded = estimate_run(cfg, world_size=2)
    whole = 4 * 106_816 + (4 * 106_816 + 4 * 8) * 3 // 10 if host.dynamic_mmap_threshold() else 0
    assert not host.dynamic_mmap_threshold() or whole == 555_452
    most = host.HEAP_RETAINED_BYTES if host.dynamic_mmap_threshold() else 0  # the sharded fit's base
    assert sharded.host_peak_rss_bytes == (
        sharded.process_baseline_bytes + host.RUNTIME_BYTES + most + whole + sharded.peak_bytes
    )
    # a CUDA run's peak is on the device: no host RSS is predicted
    cuda = estimate_run(load_config(None, [*TINY, "device=cuda"]))
    assert cuda.host_peak_rss_bytes is None and cuda.to_json()["host_peak_rss_gib"] is None


def _estimate(**fields) -> Estimate:
    """An :class:`Estimate` with round numbers (MiB) for the report's text."""
    base = {
        "peak_bytes": 563 * MIB,
        "breakdown": {"parameters": 300 * MIB, "activations": 263 * MIB},
        "phase": "backward",
        "device_total_bytes": 563 * MIB,
        "host_bytes": 0,
        "unseen": {},
        "model_states": dict.fromkeys(("parameters", "gradients", "optimizer_state"), 0),
        "traced_model_states": dict.fromkeys(("parameters", "gradients", "optimizer_state"), 0),
        "num_params": 1,
        "num_trainable_params": 1,
        "world_size": 1,
        "batch_size": 4,
        "seq_len": 256,
        "seconds": 1.0,
    }
    return Estimate(**{**base, **fields})


def test_report_says_the_predicted_peak_rss_and_its_parts():
    # 1,258 MiB = 347 + 563 + (48 + 300)
    text = format_estimate(_estimate(host_peak_rss_bytes=1258 * MIB, process_baseline_bytes=347 * MIB))
    assert (
        "host peak RSS of the run (CPU): 1.23 GiB = process baseline 0.34 GiB (this process's resident set, "
        "imports done) + tensors 0.55 GiB + 0.34 GiB kept by the C allocator, threads and kernels" in text
    )
    # all under 1 GiB: in MiB, 958 = 347 + 563 + 48
    text = format_estimate(_estimate(host_peak_rss_bytes=958 * MIB, process_baseline_bytes=347 * MIB))
    assert "958.00 MiB = process baseline 347.00 MiB" in text
    assert "+ tensors 563.00 MiB + 48.00 MiB kept by the C allocator" in text
    assert "host peak RSS" not in format_estimate(_estimate())  # a CUDA run's report


# small blocks, as preparing the data leaves them: 100,000 of 1 KiB freed but the last, below the heap's top
_TRIMMED = """
import ctypes
from memfit.memory import host
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
blocks = [libc.malloc(1024) for _ in range(100_000)]
for b in blocks:
    ctypes.memset(b, 1, 1024)
for b in blocks[:-1]:
    libc.free(b)
before = host.process_rss_bytes()
assert host.release_free_heap()
print((before - host.process_rss_bytes()) >> 20)
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim")
def test_releasing_the_free_heap_returns_freed_small_blocks_to_the_kernel():
    assert (
        int(_run_with_glibc_defaults(_TRIMMED)) >= 90
    )  # ~100 MiB freed (1 KiB blocks, with their 16-byte headers), unmapped


def _run_with_glibc_defaults(code: str) -> str:
    """``python -c code`` in an environment without malloc settings (glibc's defaults: a dynamic threshold); its
    standard output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_primitive_caches_are_capped_for_a_mixture_of_experts_on_cpu_unless_set(monkeypatch):
    monkeypatch.delenv(host.ONEDNN_CACHE_ENV, raising=False)
    monkeypatch.delenv(host.TORCH_LRU_CACHE_ENV, raising=False)
    assert host.caps_onednn_cache("cpu", 8) and not host.caps_onednn_cache("cpu", None)
    assert not host.caps_onednn_cache("cuda", 8)
    assert host.cap_onednn_primitive_cache() == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY=0", "LRU_CACHE_CAPACITY=64"]
    assert os.environ[host.ONEDNN_CACHE_ENV] == "0" and os.environ[host.TORCH_LRU_CACHE_ENV] == "64"
    monkeypatch.setenv(host.ONEDNN_CACHE_ENV, "64")  # the user's own settings win
    monkeypatch.setenv(host.TORCH_LRU_CACHE_ENV, "8")
    assert host.cap_onednn_primitive_cache() == []
    assert os.environ[host.ONEDNN_CACHE_ENV] == "64" and os.environ[host.TORCH_LRU_CACHE_ENV] == "8"


@pytest.mark.skipif(not GLIBC, reason="glibc's mmap threshold")
def test_the_tensors_share_of_an_rss_budget_is_the_largest_peak_that_fits(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(host, "process_rss_bytes", lambda: 300 * MIB)

    def rss(tensors: int) -> int:
        retained = host.retained_heap_bytes(step_peak_bytes=tensors)
        return host.predict_peak_rss(tensors, 300 * MIB, heap_retained_bytes=retained)

    # 1 GiB: 300 + 48 + 32 MiB held, and 1.27 bytes of RSS per byte of tensors: 644 MiB / 1.27 = 531,718,854 B
    share = host.tensor_share_bytes(GIB)
    assert share == 531_718_854 and rss(share) <= GIB < rss(share + 1)
    # 3 GiB: past the free heap's most, each byte of tensors one of RSS: 3,072 - 300 - 48 - 300 MiB
    assert host.tensor_share_bytes(3 * GIB) == 2_424 * MIB
    # what the process holds before any tensor (380 MiB): nothing; fixed at 128 KiB: no free heap at all
    assert host.tensor_share_bytes(380 * MIB - 1) == 0 and host.tensor_share_bytes(380 * MIB) == 0
    assert host.tensor_share_bytes(GIB, fixed=True) == GIB - 348 * MIB
