"""Long context on one device: tiled MLP, the loss's chunks sized in tokens, offloaded checkpoints and attention
without a (T, T) tensor: the same numbers as without them, and the bytes they save counted by hand."""

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.build import build_training, run_model_config
from memfit.config import load_config
from memfit.memory import offload
from memfit.memory.offload import apply_activation_offloading
from memfit.memory.techniques import apply_activation_checkpointing, loss_chunks
from memfit.memory.tiled import apply_tiled_mlp, mlp_tiles
from memfit.memory.tracker import MemoryTracker
from memfit.models import adapter, peft
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.planner.estimate import estimate_run
from memfit.step import loss_sum, train_step, train_step_options

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = model_config("tiny")  # dim 64, 2 layers, 4/2 heads, SwiGLU 128, vocab 256


def _batch(B=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss_and_grads(model, x, y, doc_ids=None):
    loss = loss_sum(model(x, doc_ids), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _method(model, method):
    if method == "lora":
        peft.apply_lora(
            model, rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "gate_proj", "down_proj"), seed=0
        )
    elif method == "qlora":
        peft.apply_qlora(model, rank=4, alpha=8, dropout=0.0, target_modules=("up_proj", "down_proj"), seed=0)
    elif method == "adapter":
        adapter.apply_adapter(model, prompt_length=3, seed=0)
        for (
            name,
            p,
        ) in model.named_parameters():  # the gate starts at 0: open it so the adapter is in the loss
            if name.endswith("adapter_gate"):
                p.data.fill_(0.5)
    return model


# ----------------------------------------------------------------------------------------------------------------
# How many tiles and chunks
# ----------------------------------------------------------------------------------------------------------------


def test_tiles_and_chunks_are_functions_of_the_shapes():
    assert (
        mlp_tiles("auto", tokens=8192, dim=4096) == 2
    )  # tiles of ~dim tokens (Arctic Long Sequence Training)
    assert mlp_tiles("auto", tokens=500_000, dim=4096) == 123
    assert mlp_tiles(8, tokens=5, dim=64) == 5 and mlp_tiles(3, tokens=100, dim=64) == 3
    # auto: at most 2^25 logits (261 tokens for Llama 3's 128,256 ids) and 2,048 tokens a chunk; counts as given
    assert loss_chunks("auto", tokens=131_072, vocab_size=128_256) == 501
    assert 131_072 / 501 * 128_256 <= 2**25
    assert loss_chunks("auto", tokens=16_384, vocab_size=2048) == 8 and loss_chunks("auto", 2000, 2048) == 1
    assert loss_chunks(8, tokens=4096, vocab_size=2048) == 8 and loss_chunks(0, 10, 10) == 0


# ----------------------------------------------------------------------------------------------------------------
# Tiled MLP: the same loss and gradients, in every method and checkpointing mode
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "adapter"])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(method, ac):
    x, y = _batch()
    ref = _method(build_decoder(TINY, seed=0), method)
    apply_activation_checkpointing(ref, ac)
    want_loss, want = _loss_and_grads(ref, x, y)
    model = _method(build_decoder(TINY, seed=0), method)
    assert apply_tiled_mlp(model, 5) == TINY.num_layers  # 48 tokens in 5 tiles: the last one shorter
    apply_activation_checkpointing(model, ac)
    loss, got = _loss_and_grads(model, x, y)
    assert (
        got.keys() == want.keys() and got
    )  # the same parameters got gradients (only the method's, unless full)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for name in want:  # each tile's weight gradients summed: fp32 rounding of the order, ~1e-7 relative
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]


def test_tiled_mlp_under_bf16_autocast_recomputes_in_bf16():
    """The backward recomputes each tile under the forward's autocast, so the gradients are those of the bf16
    forward it differentiates (not of an fp32 one)."""
    x, y = _batch()
    results = []
    for tiles in (0, 3):
        model = build_decoder(TINY, seed=0)
        apply_tiled_mlp(model, tiles)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_sum(model(x), y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_loss, want), (loss, got) = results
    torch.testing.assert_close(loss, want_loss, rtol=2e-3, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0.02, atol=2e-3, msg=name)


def test_tiled_mlp_hands_each_parameter_one_gradient():
    """The tiles' weight gradients reach each parameter summed, once: a post-accumulate hook (the optimizer in
    backward's) fires once per parameter, with the whole gradient."""
    x, y = _batch()
    model = build_decoder(TINY, seed=0)
    apply_tiled_mlp(model, 4)
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            functools.partial(lambda n, _p: calls.update({n: calls.get(n, 0) + 1}), name)
        )
    loss_sum(model(x), y).backward()
    assert set(calls.values()) == {1} and len(calls) == len(list(model.parameters()))


@pytest.mark.parametrize("ac, forwards", [("none", 2), ("full", 2), ("selective", 2)])
def test_a_checkpointed_layer_s_recomputation_skips_the_tiles(ac, forwards, monkeypatch):
    """Each tile runs once in the forward and once in the backward; the recomputation of a checkpointed layer
    (which needs the MLP's input, not its output) does not run them again: untiled, full checkpointing runs the MLP
    twice as well (forward, recomputation)."""
    from memfit.memory import tiled

    calls = []
    plain = tiled._untiled
    monkeypatch.setattr(tiled, "_untiled", lambda module, x: calls.append(len(x)) or plain(module, x))
    x, y = _batch()
    model = build_decoder(TINY, seed=0)
    apply_tiled_mlp(model, 3)
    apply_activation_checkpointing(model, ac)
    loss_sum(model(x), y).backward()
    assert len(calls) == forwards * 3 * TINY.num_layers and sum(calls) == forwards * 48 * TINY.num_layers


def test_tiled_mlp_holds_swiglu_tensors_for_one_tile_at_a_time():
    """No tensor of the MLP's width has more rows than a tile: at 4 tiles of 256 x 2 tokens, at most 128 rows."""
    x, y = _batch(B=2, T=256)

    class Widest(TorchDispatchMode):
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == TINY.intermediate_size:
                    Widest.rows = max(Widest.rows, t.numel() // t.shape[-1])
            return out

    for tiles, rows in ((0, 512), (4, 128)):
        model = build_decoder(TINY, seed=0)
        apply_tiled_mlp(model, tiles)
        Widest.rows = 0
        with Widest():
            loss_sum(model(x), y).backward()
        assert Widest.rows == rows


def test_tiled_mlp_saves_only_its_input_for_backward():
    """By hand, for one layer's MLP on (B, T) tokens in fp32: untiled it saves its input (B T, dim) and four
    (B T, intermediate) tensors (gate and up outputs, SiLU's output, down_proj's input); tiled, its input alone."""
    B, T = 2, 16
    x = torch.randn(B, T, TINY.dim, requires_grad=True)
    for tiles, nbytes in (
        (0, 4 * B * T * (TINY.dim + 4 * TINY.intermediate_size)),
        (4, 4 * B * T * TINY.dim),
    ):
        model = build_decoder(TINY, seed=0)
        apply_tiled_mlp(model, tiles)
        storages = {}

        def pack(t, storages=storages):
            if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
                storages[id(t.untyped_storage())] = t.untyped_storage()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model.layers[0].mlp(x)
        assert sum(s.nbytes() for s in storages.values()) == nbytes


# ----------------------------------------------------------------------------------------------------------------
# Nothing of T x T elements in a step, and the peak linear in T
# ----------------------------------------------------------------------------------------------------------------


class _Largest(TorchDispatchMode):
    """The most elements of one tensor that an op made."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.untyped_storage().nbytes() // t.element_size())
        return out


def _tracked_step(T, packed, **switches):
    overrides = [
        "model=tiny",
        "tokenizer.kind=char",
        f"model_args.max_seq_len={T}",
        f"seq_len={T}",
        "batch_size=1",
        "activation_checkpointing=full",
        "optimizer.name=adamw",  # the bytes by hand below are AdamW's (left out, a run from scratch gets Muon)
        *(f"{k}={v}" for k, v in switches.items()),
    ]
    cfg = load_config(None, overrides, needs_weights=False)
    built = build_training(cfg, run_model_config(cfg), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T + 1), generator=g)
    doc_ids = torch.cumsum((torch.rand(1, T, generator=g) < 1 / 300).long(), 1) if packed else None
    batch = [(ids[:, :-1], ids[:, 1:], doc_ids)]
    train_step(built.model, built.optimizer, batch, **train_step_options(cfg))  # the state exists from here
    largest = _Largest()
    with MemoryTracker(built.model, built.optimizer) as tracker, largest:
        train_step(built.model, built.optimizer, batch, tracker=tracker, **train_step_options(cfg))
    return tracker.peak_bytes, tracker.peak_breakdown, largest.numel


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed_documents"])
def test_no_tensor_of_t_by_t_elements_in_a_step_at_4096(packed):
    """The whole step (forward, loss, backward, AdamW) at T = 4,096, causal and with packed documents: the tracker
    and a dispatch mode see every allocation; none has T x T elements (the largest: one block's mask,
    1,024 x 4,096)."""
    T = 4096
    _, _, numel = _tracked_step(T, packed, chunked_cross_entropy="auto")
    assert numel < T * T // 2, numel


@pytest.mark.parametrize("packed", [False, True], ids=["window", "window+packed_documents"])
def test_a_sliding_window_caps_the_keys_a_block_reads(packed):
    """Mistral's window (here 256 keys, tiny-mistral at T = 4,096): the whole step's largest tensor is one block's
    mask over the keys its window reaches, 1,024 x (1,024 + 255) elements, where the packed path's without a
    window is 1,024 x 4,096 (and the causal path's largest, the logits, 4,096 x 256)."""
    T, W = 4096, 256
    _, _, numel = _tracked_step(T, packed, model="tiny-mistral", **{"model_args.sliding_window": W})
    assert numel == 1024 * (1024 + W - 1), numel  # the windowed blocks ran, and nothing is larger


def test_tracked_peak_of_packed_documents_grows_linearly():
    """With document ids (``data.cross_document_attention: false``) the tracked peak at most ~doubles when T
    doubles: x2.6 then x3.1 per doubling with the dense mask before (issue 24), linear now."""
    peaks = [
        _tracked_step(T, True, chunked_cross_entropy="auto", tiled_mlp="auto")[0] for T in (1024, 2048, 4096)
    ]
    assert peaks[1] / peaks[0] <= 2.05 and peaks[2] / peaks[1] <= 2.05, peaks


# ----------------------------------------------------------------------------------------------------------------
# Offloaded checkpoints
# ----------------------------------------------------------------------------------------------------------------


def test_offloading_on_cpu_hands_tensors_back_as_they_are():
    """On CPU the host is the device: the hooks run around every layer, move nothing, and change no number."""
    x, y = _batch()
    ref = build_decoder(TINY, seed=0)
    apply_activation_checkpointing(ref, "full")
    want_loss, want = _loss_and_grads(ref, x, y)
    model = build_decoder(TINY, seed=0)
    apply_activation_checkpointing(model, "full")
    assert apply_activation_offloading(model) == TINY.num_layers
    offload.OffloadStats.reset()
    loss, got = _loss_and_grads(model, x, y)
    assert offload.OffloadStats.peak == 0
    assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("rope_first", [False, True])
def test_offloading_brings_back_each_layer_s_input_one_layer_ahead(monkeypatch, rope_first):
    """The backward of layer k brings back layer k - 1's input, and no other: the RoPE tables every layer saves
    (packed once, with layer 0's input) are fetched when the last layer needs them and start no copy ahead, so
    layer 0's input is not brought back at the start of the backward (to be held through all of it)."""
    monkeypatch.setattr(offload, "offload_host", lambda device: torch.device("cpu"))  # a host apart, on CPU
    hooks = offload.OffloadSavedTensors()
    rope = torch.randn(64, 16), torch.randn(64, 16)  # 4 KiB each: over MIN_OFFLOAD_BYTES
    inputs = [torch.randn(2, 64, 8) for _ in range(4)]
    packed = [[hooks._pack(x), hooks._pack(rope[0]), hooks._pack(rope[1])] for x in inputs]
    assert all(p[1] is packed[0][1] and p[2] is packed[0][2] for p in packed)  # saved again: packed once
    for layer in reversed(range(4)):
        x, cos, sin = packed[layer]
        for item in (cos, sin, x) if rope_first else (x, cos, sin):
            assert hooks._unpack(item) is not None
        assert [p[0].back is not None for p in packed] == [k >= layer - 1 for k in range(4)], layer


def _estimate(**over):
    base = {
        "model": "tiny",
        "tokenizer.kind": "char",
        "model_args.max_seq_len": 2048,
        "model_args.num_layers": 6,
        "seq_len": 2048,
        "batch_size": 2,
        "device": "cuda",
        "activation_checkpointing": "full",
        "chunked_cross_entropy": "auto",
        "tiled_mlp": "auto",
        "optimizer.name": "adamw",
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in {**base, **over}.items()], needs_weights=False)
    return estimate_run(cfg)


def test_estimate_moves_the_checkpoints_to_the_host_by_hand():
    """A CUDA run's offloaded checkpoints, traced: the host holds every layer's input, 6 x (2, 2048, 64) fp32, and
    the RoPE tables every layer's checkpoint keeps, once: 2 x (2048, 16) fp32. On the device, in the backward,
    at most three inputs at a time (the one being recomputed, the next one in flight, the last one until autograd
    drops it): the peak falls by the others' bytes, less the gradients that exist at a later peak."""
    B, T, L, C, hd = 2, 2048, 6, 64, 16
    on, off = _estimate(activation_offloading=True), _estimate()
    inputs = L * B * T * C * 4
    assert on.unseen["offloaded_activations"] == on.host_bytes == inputs + 2 * T * hd * 4
    assert off.host_bytes == 0 and "offloaded_activations" not in off.unseen
    assert off.peak_bytes - on.peak_bytes >= (L - 3) * B * T * C * 4 - on.model_states["gradients"]
    assert on.peak_bytes >= on.model_states["parameters"] + 2 * B * T * C * 4


def test_offloading_is_traced_only_where_there_is_a_host_apart():
    cpu = _estimate(device="cpu", activation_offloading=True)
    assert cpu.host_bytes == 0 and cpu.peak_bytes == _estimate(device="cpu").peak_bytes


def test_estimate_of_tiled_mlp_by_hand():
    """Without checkpointing, tiling the MLP saves 4 x intermediate x 4 bytes per token and layer (the (B T, I)
    tensors an untiled SwiGLU keeps for backward): the traced peak (in the backward) falls by at least that of the
    layers not yet differentiated."""
    B, T, L, inner = 2, 2048, 6, 128
    untiled = _estimate(activation_checkpointing="none", tiled_mlp=0)
    tiled = _estimate(activation_checkpointing="none", tiled_mlp=4)
    assert untiled.peak_bytes - tiled.peak_bytes >= (L - 1) * B * T * 4 * inner * 4
