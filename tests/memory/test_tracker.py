"""MemoryTracker against bytes counted by hand on the tiny Llama (fp32, so 4 bytes per element).

The tiny preset (vocab 256, dim 64, 2 layers, 4 query / 2 kv heads, SwiGLU 128) has P = 106,816 parameters in
21 tensors (embedding, lm_head, final norm, and per layer q, k, v, o, gate, up, down and two norms) and one
buffer, RoPE's ``inv_freq`` of head_dim / 2 = 8 fp32 values, which the tracker counts with the parameters.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memfit.config import OptimizerConfig
from memfit.memory.optim import build_optimizer
from memfit.memory.techniques import apply_activation_checkpointing
from memfit.memory.timeline import plot_timeline
from memfit.memory.tracker import CATEGORIES, PHASES, MemoryTracker, model_state_bytes
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.step import train_step

CFG = model_config("tiny")
P = 106_816  # parameters of the tiny preset (checked against the closed form and the model below)
NUM_PARAM_TENSORS = 21
BUFFER_BYTES = 4 * (CFG.head_dim // 2)  # inv_freq, fp32
PARAM_BYTES = 4 * P + BUFFER_BYTES
ADAMW_STATE_BYTES = 8 * P + 4 * NUM_PARAM_TENSORS  # exp_avg + exp_avg_sq in fp32, one fp32 `step` per tensor
B, T = 2, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def make(implementation: str = "foreach", in_backward: bool = False):
    """The tiny model, its AdamW, and one (inputs, targets) batch; under a FakeTensorMode too."""
    model = build_decoder(CFG, seed=0)
    optimizer = build_optimizer(
        model, OptimizerConfig(implementation=implementation), in_backward=in_backward
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (B, T), generator=generator)
    y = torch.randint(0, CFG.vocab_size, (B, T), generator=generator)
    return model, optimizer, [(x, y)]


def tracked_step(model, optimizer, batches, tracker: MemoryTracker | None = None) -> MemoryTracker:
    tracker = tracker or MemoryTracker(model, optimizer)
    with tracker:
        train_step(model, optimizer, batches, max_grad_norm=0.0, dtype="fp32", tracker=tracker)
    return tracker


def phase_entries(tracker: MemoryTracker, phase: str) -> list[dict[str, int]]:
    return [b for _, p, b in tracker.timeline if p == phase]


def test_hand_counts_match_the_model():
    model, _, _ = make()
    assert CFG.num_params() == P == sum(p.numel() for p in model.parameters())
    assert len(list(model.parameters())) == NUM_PARAM_TENSORS
    assert sum(b.numel() * b.element_size() for b in model.buffers()) == BUFFER_BYTES


@pytest.mark.parametrize("implementation", ["foreach", "for_loop"])
def test_one_adamw_step_by_category(implementation):
    model, optimizer, batches = make(implementation)
    tracker = tracked_step(model, optimizer, batches)

    now = tracker.current_breakdown()
    assert now["parameters"] == PARAM_BYTES
    assert now["gradients"] == 0  # zero_grad(set_to_none=True)
    assert now["optimizer_state"] == ADAMW_STATE_BYTES
    assert now["activations"] == 0
    assert model_state_bytes(model, optimizer) == {
        "parameters": PARAM_BYTES, "gradients": 0, "optimizer_state": ADAMW_STATE_BYTES,
    }  # fmt: skip

    # The first step's peak is in the optimizer step: all gradients alive beside the new state.
    assert tracker.peak_phase == "optimizer_step"
    assert tracker.peak_breakdown["gradients"] == 4 * P
    assert tracker.peak_breakdown["parameters"] == PARAM_BYTES
    assert tracker.peak_breakdown["activations"] == 0
    # AdamW initialises and updates one parameter group at a time: at the peak (in the update of the decay
    # group, the 16 matrices) the state of the no-decay group (5 RMSNorm weights of 64) does not exist yet
    decay_numel = P - 5 * CFG.dim
    assert tracker.peak_breakdown["optimizer_state"] == 8 * decay_numel + 4 * 16
    assert tracker.peak_bytes == sum(tracker.peak_breakdown.values())
    assert tracker.peak_bytes == max(sum(b.values()) for _, _, b in tracker.timeline)
    assert {p for _, p, _ in tracker.timeline} <= set(PHASES)
    summary = tracker.summary_gib()
    assert summary["phase"] == "optimizer_step"
    assert summary["peak_gib"] == tracker.peak_bytes / 1024**3
    assert summary["breakdown_gib"]["gradients"] == 4 * P / 1024**3


def test_foreach_holds_a_parameter_sized_set_of_temporaries_and_for_loop_does_not():
    largest = max(p.numel() for p in make()[0].parameters())
    peaks = {}
    for implementation in ("foreach", "for_loop"):
        model, optimizer, batches = make(implementation)
        tracked_step(model, optimizer, batches)  # step 1 creates the state
        tracker = tracked_step(model, optimizer, batches)  # step 2: the steady state
        assert tracker.current_breakdown()["optimizer_state"] == ADAMW_STATE_BYTES
        peaks[implementation] = max(b["temporaries"] for b in phase_entries(tracker, "optimizer_step"))
    assert peaks["foreach"] >= 0.9 * 4 * P
    # for_loop: sqrt(v) and its quotient for one tensor, plus the previous tensor's denominator
    assert peaks["for_loop"] <= 3 * 4 * largest + 4096
    assert peaks["for_loop"] < 0.5 * peaks["foreach"]


@pytest.mark.parametrize("name", ["torchao_adamw8bit", "adamw8bit"])
def test_low_bit_optimizer_state_by_hand(name):
    pytest.importorskip("torchao" if name.startswith("torchao") else "bitsandbytes")
    model, _, batches = make()
    optimizer = build_optimizer(model, OptimizerConfig(name=name))
    tracker = tracked_step(model, optimizer, batches)
    # Both quantize the moments of tensors of >= 4096 elements (all of those here are multiples of the 256-value
    # block): 1 byte per element plus one fp32 scale per block; smaller tensors keep fp32 moments.
    numels = [p.numel() for p in model.parameters()]
    quantized = sum(n for n in numels if n >= 4096)
    assert quantized == 98_304 and all(n % 256 == 0 for n in numels if n >= 4096)
    moments = 2 * (quantized + 4 * quantized // 256) + 2 * 4 * (P - quantized)
    if name == "torchao_adamw8bit":
        # tensor subclasses (codes, scale, qmap via __tensor_flatten__): a 256-entry fp32 code table per
        # quantized moment, and an fp32 `step` tensor per parameter
        expected = moments + 2 * sum(n >= 4096 for n in numels) * 256 * 4 + 4 * NUM_PARAM_TENSORS
    else:
        # bitsandbytes: plain uint8 / fp32 tensors, two code tables shared by every parameter (counted once),
        # `step` a Python int
        expected = moments + 2 * 256 * 4
    assert tracker.current_breakdown()["optimizer_state"] == expected
    assert model_state_bytes(model, optimizer)["optimizer_state"] == expected


def test_storage_resized_outside_ops_is_followed():
    model = nn.Linear(4, 4, bias=False)
    with MemoryTracker(model) as tracker:
        t = torch.ones(1000)
        assert tracker.current_breakdown()["temporaries"] == 4000
        t.untyped_storage().resize_(0)  # as FSDP frees unsharded parameters: no tensor op sees it
        assert tracker.current_breakdown()["temporaries"] == 0
        tracker.set_phase("forward")
        t.untyped_storage().resize_(400)
        torch.zeros(())  # the first op of a new phase checks sizes
        assert tracker.timeline[-1][2]["temporaries"] == 400 + 4


def test_storage_resize_is_followed_at_once_and_only_while_tracking():
    model = nn.Linear(4, 4, bias=False)
    with MemoryTracker(model) as tracker:
        t = torch.ones(1000)
        t.untyped_storage().resize_(0)  # FSDP's free_storage, within one phase
        torch.zeros(())
        assert tracker.timeline[-1][2]["temporaries"] == 4
        t.untyped_storage().resize_(400)  # FSDP's alloc_storage before an all-gather's copy-out
        torch.zeros(())
        assert tracker.timeline[-1][2]["temporaries"] == 400 + 4
        assert tracker.categories == tuple(c for c in CATEGORIES if c != "unsharded_parameters")
    assert "resize_" not in torch.UntypedStorage.__dict__  # the class is as it was


def test_only_the_model_device_counts():
    model = nn.Linear(4, 4, bias=False)
    with MemoryTracker(model) as tracker:
        on_meta = torch.empty(1000, device="meta") + 1  # noqa: F841 (alive, on another device)
        on_cpu = torch.empty(10) + 1  # noqa: F841
        assert tracker.current_breakdown()["temporaries"] == 40
    assert model_state_bytes(model, device="meta")["parameters"] == 0
    assert MemoryTracker(model, device="meta").device == torch.device("meta")


def test_activations_end_of_forward_are_reproducible_and_freed_by_backward():
    ends = []
    for _ in range(2):
        model, optimizer, batches = make()
        tracker = tracked_step(model, optimizer, batches)
        end_of_forward = phase_entries(tracker, "forward")[-1]
        ends.append(end_of_forward["activations"])
        # the loss saves at least the log-softmax of the logits, (B*T, V) fp32
        assert end_of_forward["activations"] >= 4 * B * T * CFG.vocab_size
        assert end_of_forward["gradients"] == 0
        assert max(b["activations"] for b in phase_entries(tracker, "optimizer_step")) == 0
        assert max(b["gradients"] for b in phase_entries(tracker, "forward")) == 0
    assert ends[0] == ends[1] > 0


def test_activations_are_exactly_the_tensors_saved_for_backward():
    batch, n_in, n_hidden, n_out = 8, 32, 48, 16
    model = nn.Sequential(
        nn.Linear(n_in, n_hidden, bias=False), nn.ReLU(), nn.Linear(n_hidden, n_out, bias=False)
    )
    x = torch.randn(batch, n_in)
    with MemoryTracker(model) as tracker:
        loss = model(x).sum()
        saved = tracker.current_breakdown()
        loss.backward()
    # linear 1 saves its input x, ReLU its output, which linear 2 saves too (one storage); weights are parameters
    assert saved["activations"] == 4 * batch * (n_in + n_hidden)
    assert saved["parameters"] == 4 * (n_in * n_hidden + n_hidden * n_out)
    after = tracker.current_breakdown()
    assert after["activations"] == 0
    assert after["gradients"] == 4 * (n_in * n_hidden + n_hidden * n_out)


def test_fake_tensor_mode_gives_the_real_numbers():
    real_model, real_optimizer, real_batches = make()
    real = tracked_step(real_model, real_optimizer, real_batches)
    with FakeTensorMode():
        model, optimizer, batches = make()
        assert isinstance(next(model.parameters()), FakeTensor)
        fake = tracked_step(model, optimizer, batches)
        now = fake.current_breakdown()
    assert now == real.current_breakdown()
    assert now["parameters"] == PARAM_BYTES
    assert now["optimizer_state"] == ADAMW_STATE_BYTES
    assert fake.peak_breakdown == real.peak_breakdown
    assert fake.peak_phase == real.peak_phase
    # op for op alike up to the optimizer step (the fake run's gradient norm takes another path: per-tensor norms)
    for phase in ("forward", "backward"):
        assert phase_entries(fake, phase) == phase_entries(real, phase)


def test_activation_checkpointing_keeps_less_and_recomputes_in_backward():
    plain_model, plain_optimizer, plain_batches = make()
    plain = tracked_step(plain_model, plain_optimizer, plain_batches)
    model, optimizer, batches = make()
    assert apply_activation_checkpointing(model, "full") == [0, 1]
    checkpointed = tracked_step(model, optimizer, batches)
    kept = {name: phase_entries(t, "forward")[-1]["activations"] for name, t in
            (("plain", plain), ("checkpointed", checkpointed))}  # fmt: skip
    assert 0 < kept["checkpointed"] < kept["plain"]
    # recomputed activations appear in the backward, above what the forward kept
    assert max(b["activations"] for b in phase_entries(checkpointed, "backward")) > kept["checkpointed"]
    assert checkpointed.current_breakdown() == plain.current_breakdown()


def test_optimizer_in_backward_never_holds_all_gradients():
    model, optimizer, batches = make(in_backward=True)
    tracker = tracked_step(model, optimizer, batches)
    now = tracker.current_breakdown()
    assert now["optimizer_state"] == ADAMW_STATE_BYTES  # found through the per-parameter optimizers
    assert now["gradients"] == 0
    largest = max(p.numel() for p in model.parameters())
    assert max(b["gradients"] for _, _, b in tracker.timeline) <= 4 * largest
    assert "optimizer_step" in {p for _, p, _ in tracker.timeline}


def test_tracking_changes_no_number():
    model_a, opt_a, batches = make()
    model_b, opt_b, _ = make()
    for _ in range(2):
        train_step(model_a, opt_a, batches, max_grad_norm=1.0, dtype="fp32")
        with MemoryTracker(model_b, opt_b) as tracker:
            train_step(model_b, opt_b, batches, max_grad_norm=1.0, dtype="fp32", tracker=tracker)
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
    # the tracker left no hook behind
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_phases_and_reset_peak():
    model, optimizer, batches = make()
    tracker = tracked_step(model, optimizer, batches)
    with pytest.raises(ValueError, match="unknown phase"):
        tracker.set_phase("warmup")
    tracker.set_phase("other")
    with tracker.phase("forward"):
        assert tracker._base_phase == "forward"
    assert tracker._base_phase == "other"
    first_peak = tracker.peak_bytes
    tracker.reset_peak()
    assert tracker.peak_bytes == sum(tracker.current_breakdown().values()) < first_peak
    # without marks from the loop, the phases come from the model's forward, autograd and Optimizer.step
    model, optimizer, ((x, y),) = make()
    with MemoryTracker(model, optimizer) as tracker:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    phases = [p for _, p, _ in tracker.timeline]
    order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert order == ["forward", "backward", "optimizer_step"]


def test_tracking_costs_less_than_ten_untracked_steps():
    model, optimizer, _ = make()
    generator = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, CFG.vocab_size, (4, 32), generator=generator) for _ in range(2))]
    tracker = MemoryTracker(model, optimizer, record_timeline=False)
    plain, tracked = [], []
    tracked_step(model, optimizer, batches, tracker)
    for _ in range(8):  # CPU time, interleaved, best of 8: robust to a busy machine
        start = time.process_time()
        train_step(model, optimizer, batches, max_grad_norm=0.0, dtype="fp32")
        plain.append(time.process_time() - start)
        start = time.process_time()
        tracked_step(model, optimizer, batches, tracker)
        tracked.append(time.process_time() - start)
    assert min(tracked) < 10 * min(plain)


def test_plot_timeline_writes_a_png(tmp_path):
    tracker = tracked_step(*make())
    path = plot_timeline(tracker.timeline, tmp_path / "plots" / "memory.png", title="tiny, one step")
    assert path == tmp_path / "plots" / "memory.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="empty"):
        plot_timeline([], tmp_path / "empty.png")
    assert set(tracker.timeline[0][2]) == set(CATEGORIES)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_counts_device_memory_within_the_allocator_peak():
    model = build_decoder(CFG, device="cuda", seed=0)
    optimizer = build_optimizer(model, OptimizerConfig(implementation="foreach"))
    x = torch.randint(0, CFG.vocab_size, (B, T), device="cuda")
    batches = [(x, x.roll(-1, dims=1))]
    tracked_step(model, optimizer, batches)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    tracker = tracked_step(model, optimizer, batches)
    torch.cuda.synchronize()
    now = tracker.current_breakdown()
    assert now["parameters"] == PARAM_BYTES
    assert now["optimizer_state"] == 8 * P  # AdamW keeps its `step` counters on the host: not device memory
    # storages at their nbytes never exceed what the caching allocator handed out (it rounds up, adds workspaces)
    assert tracker.peak_bytes <= torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("in_backward", [False, True])
def test_allocations_replay_the_live_bytes(in_backward):
    """record_allocations: summing the allocation events in order gives, after each recorded op, exactly the live
    bytes the tracker recorded, and at the end the bytes still live; so the highest running sum is the peak."""
    model, optimizer, batches = make(in_backward=in_backward)
    tracker = tracked_step(model, optimizer, batches)  # the first step creates the state
    tracker = tracked_step(
        model, optimizer, batches, MemoryTracker(model, optimizer, record_allocations=True)
    )
    live, peak, sizes = 0, 0, {}
    for op, entry, nbytes in tracker.allocations:
        if op == "alloc":
            assert id(entry) not in sizes
            sizes[id(entry)] = nbytes
            live += nbytes
        else:
            live -= sizes.pop(id(entry))
        peak = max(peak, live)
    assert peak == tracker.peak_bytes
    assert live == sum(tracker.current_breakdown().values())
    resized = MemoryTracker(nn.Linear(4, 4, bias=False), record_allocations=True)
    with resized:
        t = torch.ones(1000)
        t.untyped_storage().resize_(0)
        torch.zeros(())
    ops = [(op, nbytes) for op, _, nbytes in resized.allocations if nbytes != 64]  # not the weight
    assert ops[:3] == [("alloc", 4000), ("free", 0), ("alloc", 0)]
