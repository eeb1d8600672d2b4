"""The phases around a run's steps (``memfit.planner.phases``): the load of pretrained weights predicted from the
file headers, to the byte of what a memory tracker sees the real load hold; the save as what the run holds between
steps; both in ``estimate_run``'s resident-set prediction and the pre-flight's (docs/memory.md, "Load and save")."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from memfit.build import load_base, run_model_config
from memfit.config import load_config
from memfit.convert import load_order
from memfit.convert.hf import scan_hf
from memfit.errors import PreflightError
from memfit.memory import host
from memfit.memory.tracker import MemoryTracker
from memfit.planner import estimate as estimate_module
from memfit.planner.estimate import estimate_run
from memfit.planner.phases import load_peak_bytes, nf4_quantization_peak
from memfit.planner.preflight import preflight

pytestmark = pytest.mark.usefixtures("one_thread")

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def _checkpoint(root: Path, dtype: torch.dtype, **sizes: int) -> Path:
    """A tiny tied Llama as transformers writes it (``sizes`` over :data:`HF_CONFIG`), stored in ``dtype``, with a
    stored ``lm_head.weight`` besides (as some exporters write a tied head): read, then dropped."""
    config = {**HF_CONFIG, **sizes}
    transformers = pytest.importorskip("transformers")
    directory = root / f"hf-{str(dtype).split('.')[-1]}"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).split(".")[-1]}))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(dtype)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _tiny_qlora(root: Path, **sizes: int) -> list[str]:
    """The overrides of a tiny QLoRA run of a bf16 checkpoint (the threshold fixed: no free heap predicted)."""
    ckpt = _checkpoint(root, torch.bfloat16, **sizes)
    return [f"checkpoint_dir={ckpt}", "method=qlora", "dtype=fp32", "device=cpu", "batch_size=1", "seq_len=16",
            "optimizer.name=adamw", "mmap_threshold=fixed"]  # fmt: skip


def _tracked_load(cfg) -> tuple[int, nn.Module]:
    tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
    with tracker:
        model = load_base(cfg, "cpu")
    return tracker.peak_bytes, model


@pytest.mark.parametrize(
    ("stored", "method"),
    [(torch.bfloat16, "full"), (torch.float32, "full"), (torch.bfloat16, "qlora"), (torch.float32, "lora")],
)
def test_the_load_peak_is_what_a_tracker_sees_the_real_load_hold(tmp_path, stored, method):
    ckpt = _checkpoint(tmp_path, stored)
    cfg = load_config(None, [f"checkpoint_dir={ckpt}", f"method={method}", "dtype=fp32", "device=cpu"])
    predicted = load_peak_bytes(cfg, run_model_config(cfg))
    tracked, model = _tracked_load(cfg)
    assert predicted == tracked
    # by hand: stored fp32 is kept as read (no copy), and the tied head read first is dropped before the rest, so
    # the peak is the loaded model (90,432 fp32 parameters) as its RoPE buffer is recomputed: the 8 inverse
    # frequencies (head_dim 16 / 2, fp32: 32 bytes) from an int64 arange (64) and its fp32 copy (32)
    params = sum(p.numel() for p in model.parameters())
    if method == "full" and stored == torch.float32:
        assert params == 90_432 and sum(b.nbytes for b in model.buffers()) == 32
        assert predicted == 4 * 90_432 + 32 + 64 + 32
    if method == "full" and stored == torch.bfloat16:  # each bf16 source beside its fp32 copy, at its turn
        assert predicted > 4 * params


def test_the_load_reads_each_tensor_once_and_keeps_none_behind(tmp_path):
    ckpt = _checkpoint(tmp_path, torch.bfloat16)
    order = load_order(ckpt)
    assert order is not None
    names = [e.name for e, _ in order]
    assert [k for e, k in order if e.name == "lm_head.weight"] == [False]  # tied: read, not kept
    assert sorted(names) == sorted({e.name for e in scan_hf(ckpt).entries})
    # the reader drops its own reference once a tensor is handed on: the next read is not made beside it
    scan = scan_hf(ckpt)
    reader = scan.read()
    _, first = next(reader)
    ref = weakref.ref(first)
    del first
    next(reader)
    gc.collect()
    assert ref() is None


def test_nf4_quantization_peak_is_traced_once_per_shape():
    nf4_quantization_peak.cache_clear()
    peak = nf4_quantization_peak((128, 64), torch.float32)
    assert peak > 128 * 64 * 4  # the fp32 input, its scaled copy, the codes and the chunk's comparisons
    assert nf4_quantization_peak((128, 64), torch.float32) == peak
    assert nf4_quantization_peak.cache_info().hits == 1


def test_estimate_of_a_qlora_run_takes_its_load_when_the_load_is_the_peak(tmp_path):
    # a tiny QLoRA run: quantizing a weight (torchao compares values with the 16 codes in chunks) holds more than
    # a step of this model does, so the load decides the resident set, and the pre-flight uses it
    args = _tiny_qlora(tmp_path)
    cfg = load_config(None, args)
    e = estimate_run(cfg)
    assert e.load_peak_bytes == load_peak_bytes(cfg, run_model_config(cfg))
    assert e.load_peak_bytes > e.peak_bytes + e.host_bytes
    assert e.run_peak_bytes == e.load_peak_bytes
    assert e.phase_peaks == {"load": e.load_peak_bytes, "step": e.peak_bytes, "save": e.save_peak_bytes}
    if host.glibc():  # the threshold fixed: no free heap
        assert e.fixes_mmap_threshold
        assert e.host_peak_rss_bytes == e.process_baseline_bytes + host.RUNTIME_BYTES + e.load_peak_bytes
    assert e.to_json()["phase_peaks_gib"]["load"] * 1024**3 == pytest.approx(e.load_peak_bytes, abs=1)


def test_the_save_holds_what_the_run_holds_between_steps():
    # the tiny preset from scratch, AdamW: 427,296 bytes of parameters (with the RoPE buffer) and 854,612 of state
    # (two moments and 27 fp32 step counters) = 1,281,908 bytes; the gradients (427,264 bytes) are gone by then,
    # set to None at the end of the step, as they are with the optimizer step in backward
    tiny = ["model=tiny", "tokenizer.kind=char", "tokenizer.vocab_size=65", "batch_size=2", "seq_len=16"]
    tiny += ["optimizer.name=adamw", "device=cpu"]
    e = estimate_run(load_config(None, tiny))
    assert e.load_peak_bytes is None  # from scratch: nothing to load
    assert (e.model_states["parameters"], e.model_states["optimizer_state"]) == (427_296, 854_612)
    assert e.save_peak_bytes == 427_296 + 854_612 == 1_281_908
    assert e.run_peak_bytes == e.peak_bytes > e.save_peak_bytes
    in_backward = estimate_run(load_config(None, [*tiny, "optimizer_in_backward=true", "max_grad_norm=0"]))
    assert in_backward.save_peak_bytes == 1_281_908
    # CUDA runs: the phases around the step are not predicted
    assert estimate_run(load_config(None, [*tiny[:-1], "device=cuda"])).save_peak_bytes is None


@pytest.mark.skipif(not host.glibc(), reason="glibc's heap")
def test_only_the_steps_hold_their_free_heap(tmp_path, monkeypatch):
    # a full fine-tune of the tiny checkpoint: its load comes before any step's holes and its save gives them back
    # first, so only the step's predicted resident set carries the free heap: under the dynamic threshold 32 MiB and
    # 0.27 of the step's tensors (a small step: far below the 300 MiB most), 300 MiB at bf16's 8 MiB threshold
    # (BF16_FULL_RETAINED_BYTES), none at 128 KiB
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    ckpt = _checkpoint(tmp_path, torch.bfloat16)
    args = [f"checkpoint_dir={ckpt}", "method=full", "device=cpu", "batch_size=1", "seq_len=16",
            "optimizer.name=adamw"]  # fmt: skip
    for extra, retained in (
        (["dtype=fp32", "mmap_threshold=dynamic"], None),
        (["dtype=bf16", "mmap_threshold=fixed"], host.BF16_FULL_RETAINED_BYTES),
        (["dtype=fp32", "mmap_threshold=fixed"], 0),
    ):
        e = estimate_run(load_config(None, [*args, *extra]))
        besides = e.process_baseline_bytes + host.RUNTIME_BYTES
        if retained is None:
            retained = 33_554_432 + int(0.27 * (e.peak_bytes + e.host_bytes))
            assert retained < host.HEAP_RETAINED_BYTES
        assert e.phase_rss_bytes == {
            "load": besides + e.load_peak_bytes,
            "step": besides + retained + e.peak_bytes + e.host_bytes,
            "save": besides + e.save_peak_bytes,
        }
        assert e.host_peak_rss_bytes == max(e.phase_rss_bytes.values())
        assert e.to_json()["phase_rss_gib"]["step"] * 2**30 == pytest.approx(e.phase_rss_bytes["step"], abs=1)
    assert host.BF16_FULL_RETAINED_BYTES == host.HEAP_RETAINED_BYTES == 314_572_800


def test_a_budget_the_steps_fit_but_the_load_does_not_is_refused(tmp_path, monkeypatch):
    # the tiny QLoRA run's load needs more than its step: a memory_budget between the two is refused before
    # anything is allocated, naming the predicted peak resident set (the load's). The process's own resident set
    # is held at 300 MiB, as imports made meanwhile would move it between the estimate and the check.
    for module in (host, estimate_module):
        monkeypatch.setattr(module, "process_rss_bytes", lambda: 300 * 2**20)
    # MLP weights of 2048 x 256: torchao compares their 524,288 values with the 16 codes at once (32 MiB)
    args = _tiny_qlora(tmp_path, hidden_size=256, intermediate_size=2048)
    cfg = load_config(None, args)
    e = estimate_run(cfg)
    assert e.load_peak_bytes - e.peak_bytes > 32 * 2**20
    besides = e.host_peak_rss_bytes - e.load_peak_bytes
    step_rss = besides + e.peak_bytes
    budget_mib = (step_rss + e.host_peak_rss_bytes) // 2 // 2**20
    over = load_config(None, [*args, f"memory_budget={budget_mib}MiB"])
    with pytest.raises(PreflightError, match=f"it needs {e.host_peak_rss_bytes / 2**30:.2f} GiB at its peak"):
        preflight(over, run_model_config(over), 16, torch.device("cpu"))
    fits = load_config(None, [*args, f"memory_budget={e.host_peak_rss_bytes // 2**20 + 64}MiB"])
    assert "pre-flight:" in preflight(fits, run_model_config(fits), 16, torch.device("cpu"))


class _LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of the largest new tensor any op returns inside the mode (views of its inputs are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        seen = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_finite_weights_check_before_a_save_holds_nothing_of_a_weight_s_size(dtype):
    """Before each checkpoint the run checks that its weights are finite; at 3B the check held an absolute copy of
    the fp32 embedding and three boolean masks of its shape (2.57 GiB above the save's prediction). It now reduces
    each weight to two elements, and still finds every kind of non-finite value anywhere in any weight."""
    from memfit.distributed import all_finite

    weights = [torch.randn(300, 64).to(dtype), torch.randn(64).to(dtype), torch.empty(0, dtype=dtype)]
    with _LargestOutput() as mode:
        assert all_finite(weights)
    assert mode.largest <= 2 * weights[0].element_size()  # the least and greatest element of one weight
    for bad in (float("nan"), float("inf"), float("-inf")):
        for which, index in ((0, (299, 63)), (1, (0,))):
            spoiled = [w.clone() for w in weights]
            spoiled[which][index] = bad
            assert not all_finite(spoiled), (bad, which)
    assert all_finite([])
