"""The optimizers that keep less state (``muon``, ``adafactor``, ``apollo``, ``apollo_mini``, ``adam_mini``): memfit
only routes parameters to their libraries, so after N steps the weights are those of the library's optimizer built
by hand; the state checkpoints exactly; its bytes are the closed form's, worked out here by hand.

The tiny model (``model_config("tiny")``: dim 64, 4 heads of 16, 2 kv heads, MLP 128, vocabulary 256, untied) has
21 trainable tensors: per layer q, o (64, 64), k, v (32, 64), gate, up (128, 64), down (64, 128) and two norms of
64; the embedding and ``lm_head`` (256, 64); the final norm. Its hidden matrices (the 14 layer projections) hold
73,728 elements; the rest 33,088 (32,768 in the embedding and ``lm_head``, 320 in the five norms).
"""

import io

import pytest
import torch

from memfit.config import OptimizerConfig, load_config
from memfit.errors import ConfigError
from memfit.memory import hybrids, optimizers
from memfit.memory.optim import build_optimizer, describe_partition, optimizer_state_bytes, param_groups
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.planner import plan as P
from memfit.planner.estimate import estimate_run
from memfit.step import train_step

pytestmark = pytest.mark.usefixtures("one_thread")

LOW_STATE = ("muon", "adafactor", "apollo", "apollo_mini", "adam_mini")
LR = {"adafactor": 0.1}  # Adafactor's lr caps a step relative to each parameter's RMS
TINY = model_config("tiny")


def _batch(seed, B=4, T=16, vocab=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _cfg(name, **kw):
    return OptimizerConfig(name=name, lr=kw.pop("lr", LR.get(name, 1e-2)), weight_decay=0.1, **kw)


def _train(model, opt, steps, first=0):
    return [
        train_step(model, opt, [_batch(first + s)], max_grad_norm=0.0, dtype="fp32").loss.item()
        for s in range(steps)
    ]


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _require(name):
    if name.startswith("apollo"):
        pytest.importorskip("apollo_torch")
    if name == "adam_mini":
        pytest.importorskip("adam_mini")


def _named(model, *suffixes, ndim=2):
    return [
        p for n, p in model.named_parameters() if p.ndim == ndim and (not suffixes or n.endswith(suffixes))
    ]


# ----------------------------------------------------------------------------------------------------------------
# The library's optimizer, built by hand, gives the same weights
# ----------------------------------------------------------------------------------------------------------------


def test_muon_is_a_hand_built_torch_muon_and_adamw_pair():
    """Hidden matrices on torch.optim.Muon, the embedding and lm_head (decayed) and the norms (not) on AdamW."""
    model, ref = build_decoder(TINY, seed=0), build_decoder(TINY, seed=0)
    opt = build_optimizer(model, _cfg("muon", muon_ns_dtype="bf16"))  # torch's Newton-Schulz dtype
    hidden = [p for n, p in ref.named_parameters() if p.ndim == 2 and ".layers." in n]
    outer = [p for n, p in ref.named_parameters() if p.ndim == 2 and ".layers." not in n]
    muon = torch.optim.Muon(hidden, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(
        [{"params": outer, "weight_decay": 0.1}, {"params": _named(ref, ndim=1), "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    assert len(hidden) == 14 and len(outer) == 2
    for step in range(3):
        _train(model, opt, 1, step)
        x, y = _batch(step)
        torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        muon.step(), adamw.step()
        muon.zero_grad(), adamw.zero_grad()
    assert _same_weights(model, ref)
    assert not _same_weights(model, build_decoder(TINY, seed=0))


# ----------------------------------------------------------------------------------------------------------------
# Muon's Newton-Schulz iteration in the dtype the hardware is fast at
# ----------------------------------------------------------------------------------------------------------------

NS = (3.4445, -4.7750, 2.0315)  # torch's (Keller Jordan's) quintic coefficients


@pytest.mark.parametrize(
    ("nesterov", "dtype"), [(True, torch.float32), (False, torch.float32), (True, torch.bfloat16)]
)
def test_muon_in_bf16_is_torch_muon_bit_for_bit(nesterov, dtype):
    """memfit's Muon with ``ns_dtype=bf16`` is ``torch.optim.Muon``: weights and momentum buffers identical
    after 3 steps, on wide, tall and square matrices, fp32 and bf16 parameters. (bf16 parameters without
    nesterov: torch's iteration divides the momentum buffer itself in place, its update being the buffer and its
    bf16 cast no copy; memfit's does not, the next test.)"""
    torch.manual_seed(0)
    shapes = [(24, 16), (16, 40), (32, 32)]
    start = [torch.randn(*shape).to(dtype) for shape in shapes]
    ours = [p.clone().requires_grad_() for p in start]
    ref = [p.clone().requires_grad_() for p in start]
    kw = {"lr": 0.02, "nesterov": nesterov, "adjust_lr_fn": "match_rms_adamw"}
    mine, torchs = hybrids.Muon(ours, ns_dtype=torch.bfloat16, **kw), torch.optim.Muon(ref, **kw)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        mine.step(), torchs.step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(mine.state[a]["momentum_buffer"], torchs.state[b]["momentum_buffer"])
    assert not torch.equal(ours[0], start[0])


def test_muon_keeps_the_momentum_of_bf16_parameters_without_nesterov():
    """The buffer after 2 steps is the momentum of the gradients, ``lerp`` by hand (torch's Muon leaves it
    divided by its norm: see above)."""
    torch.manual_seed(0)
    p = torch.randn(16, 24).bfloat16().requires_grad_()
    opt = hybrids.Muon([p], ns_dtype=torch.bfloat16, lr=0.02, nesterov=False)
    expected = torch.zeros_like(p)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        expected.lerp_(p.grad, 1 - 0.95)
        opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], expected)


def test_newton_schulz_in_fp32_is_closer_to_the_float64_iteration():
    """The same iteration in float64 as reference: fp32 is within 1e-6 of it on a 48 x 20 update, bf16 (torch's)
    1e-3 to 2e-2 off (8 bits of mantissa, amplified by the quintic's 5 steps)."""
    g = torch.Generator().manual_seed(0)
    update = torch.randn(48, 20, generator=g, dtype=torch.float64)
    exact = hybrids.newton_schulz(update, NS, 5, 1e-7, torch.float64)
    errors = {
        dtype: (hybrids.newton_schulz(update.float(), NS, 5, 1e-7, dtype).double() - exact).abs().max().item()
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert errors[torch.float32] < 1e-6
    assert 1e-3 < errors[torch.bfloat16] < 2e-2
    assert hybrids.newton_schulz(update.float(), NS, 5, 1e-7, torch.float32).shape == (48, 20)


def test_newton_schulz_leaves_an_update_in_its_own_dtype_alone():
    """Without nesterov the update is the momentum buffer itself; in fp32 there is no cast to work on, so the
    iteration must not divide the buffer in place."""
    buf = torch.randn(8, 12)
    kept = buf.clone()
    out = hybrids.newton_schulz(buf, NS, 5, 1e-7, torch.float32)
    assert torch.equal(buf, kept) and out.dtype == torch.float32 and not torch.equal(out, buf)


def test_muon_ns_dtype_auto_follows_the_hardware(monkeypatch):
    """``auto``: bf16 on CUDA, and on a CPU with bf16 matrix instructions; fp32 on a CPU without them;
    ``fp32`` and ``bf16`` as said; ``ONEDNN_MAX_CPU_ISA`` capped below AVX512-BF16 means no bf16 instructions."""
    assert hybrids.newton_schulz_dtype("auto", "cuda") == torch.bfloat16
    assert hybrids.newton_schulz_dtype("fp32", "cuda") == torch.float32
    assert hybrids.newton_schulz_dtype("bf16", "cpu") == torch.bfloat16
    for fast, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda fast=fast: fast)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda fast=fast: fast)
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        assert hybrids.cpu_bf16_matmuls_fast() is fast
        assert hybrids.newton_schulz_dtype("auto", "cpu") == dtype
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
        assert hybrids.cpu_bf16_matmuls_fast() is fast
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core")
        assert hybrids.cpu_bf16_matmuls_fast() is False
    with pytest.raises(ValueError, match="muon_ns_dtype must be one of auto, fp32, bf16, got 'fp16'"):
        hybrids.newton_schulz_dtype("fp16", "cpu")


@pytest.mark.parametrize("setting", ["fp32", "bf16"])
def test_optimizer_muon_ns_dtype_reaches_the_built_optimizer(setting):
    """``optimizer.muon_ns_dtype`` is the built Muon's; fp32 and bf16 give different weights after a step."""
    model = build_decoder(TINY, seed=0)
    opt = build_optimizer(model, _cfg("muon", muon_ns_dtype=setting))
    expected = torch.float32 if setting == "fp32" else torch.bfloat16
    assert opt.ns_dtype == expected and opt._muon.ns_dtype == expected
    _train(model, opt, 1)
    other = build_decoder(TINY, seed=0)
    _train(
        other, build_optimizer(other, _cfg("muon", muon_ns_dtype="bf16" if setting == "fp32" else "fp32")), 1
    )
    assert not _same_weights(model, other)


def test_adafactor_is_torch_adafactor():
    model, ref = build_decoder(TINY, seed=0), build_decoder(TINY, seed=0)
    opt = build_optimizer(model, _cfg("adafactor"))
    groups = [
        {"params": _named(ref), "weight_decay": 0.1},
        {"params": _named(ref, ndim=1), "weight_decay": 0.0},
    ]
    adafactor = torch.optim.Adafactor(groups, lr=0.1, foreach=True)
    _train(model, opt, 3)
    for step in range(3):
        train_step(ref, adafactor, [_batch(step)], max_grad_norm=0.0, dtype="fp32")
    assert _same_weights(model, ref)


@pytest.mark.parametrize("name", ["apollo", "apollo_mini"])
def test_apollo_is_the_authors_apollo_adamw(name):
    """The package's APOLLOAdamW over the same groups with the authors' settings (APOLLO: rank 16 = width / 4,
    channel-wise, scale 1; Mini: rank 1, tensor-wise, scale 128; random projections, a new one every 2 steps here
    so that one is redrawn)."""
    _require(name)
    from apollo_torch import APOLLOAdamW

    model, ref = build_decoder(TINY, seed=0), build_decoder(TINY, seed=0)
    opt = build_optimizer(model, _cfg(name, update_proj_gap=2))
    mini = name == "apollo_mini"
    settings = {
        "rank": 1 if mini else 16,
        "proj": "random",
        "scale_type": "tensor" if mini else "channel",
        "scale": 128 if mini else 1,
        "update_proj_gap": 2,
        "proj_type": "std",
    }
    groups = [
        {
            "params": [dict(ref.named_parameters())[n] for n in g["param_names"]],
            "weight_decay": g["weight_decay"],
        }
        | (settings if g.get("algorithm") == "apollo" else {})
        for g in param_groups(model, 0.1, name)
    ]
    assert [len(g["params"]) for g in groups] == [2, 14, 5]  # embedding + lm_head, hidden matrices, norms
    package = APOLLOAdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    _train(model, opt, 3)
    for step in range(3):
        train_step(ref, package, [_batch(step)], max_grad_norm=0.0, dtype="fp32")
    assert _same_weights(model, ref)
    assert not _same_weights(model, build_decoder(TINY, seed=0))


def test_adam_mini_is_the_authors_adam_mini_on_llama_names():
    """The package partitions by its own matching of Hugging Face names; memfit feeds it its partition (q/k by
    head, other matrices by row, 1-D tensors whole): the same blocks, the same weights."""
    _require("adam_mini")
    from adam_mini import Adam_mini

    model, ref = build_decoder(TINY, seed=0), build_decoder(TINY, seed=0)
    opt = build_optimizer(model, _cfg("adam_mini"))
    package = Adam_mini(
        ref.named_parameters(),
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        verbose=False,
    )
    _train(model, opt, 3)
    for step in range(3):
        train_step(ref, package, [_batch(step)], max_grad_norm=0.0, dtype="fp32")
    assert _same_weights(model, ref)


def test_adam_mini_blocks_are_heads_where_head_dim_is_not_dim_over_heads():
    """Qwen3-style heads (tiny-qwen3: head_dim 32 at width 64 and 4 heads, not 16): one second moment per query
    head (4) and key head (2), each a block of 32 x 64, in the state and in the closed form; a head size that does
    not divide the width is refused naming optimizer.name."""
    _require("adam_mini")
    mcfg = model_config("tiny-qwen3")
    model = build_decoder(mcfg, seed=0)
    opt = build_optimizer(model, _cfg("adam_mini"))
    _train(model, opt, 1)
    q, k = (model.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.k_proj.weight)
    assert opt.state[q]["vmean"].numel() == 4 and opt.state[k]["vmean"].numel() == 2
    assert opt.state[q]["m"].shape == (4, 32 * 64)
    named = dict(model.named_parameters())
    infos = optimizers.tensor_infos(
        "adam_mini",
        [(n, tuple(p.shape), 4, p.ndim) for n, p in named.items()],
        dim=64,
        num_heads=4,
        head_dim=32,
    )
    blocks = {n: t.blocks for n, t in zip(named, infos, strict=True)}
    assert (
        blocks["model.layers.0.self_attn.q_proj.weight"] == 4
        and blocks["model.layers.0.self_attn.k_proj.weight"] == 2
    )
    assert optimizer_state_bytes(opt) == optimizers.spec("adam_mini").state(infos)
    odd = build_decoder(model_config("tiny", head_dim=24), seed=0)
    with pytest.raises(
        ConfigError, match="config key 'optimizer.name': adam_mini .* head_dim 24 does not divide"
    ):
        build_optimizer(odd, _cfg("adam_mini"))


# ----------------------------------------------------------------------------------------------------------------
# In backward, resume, state bytes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LOW_STATE)
def test_in_backward_takes_the_same_steps(name):
    """One optimizer per parameter updated inside backward: the same weights as one optimizer after the backward
    (APOLLO's seeds numbered as in one optimizer)."""
    _require(name)
    plain, inside = build_decoder(TINY, seed=0), build_decoder(TINY, seed=0)
    cfg = _cfg(name, update_proj_gap=2)
    assert _train(plain, build_optimizer(plain, cfg), 3) == _train(
        inside, build_optimizer(inside, cfg, in_backward=True), 3
    )
    assert _same_weights(plain, inside)


def _save_load(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("name", LOW_STATE)
def test_state_dict_round_trip_resumes_exactly(name, in_backward):
    """state_dict -> torch.save -> torch.load(weights_only=True) -> a fresh optimizer: the next steps are those of
    the uninterrupted one (APOLLO redraws its projection at step 4: the saved seed carries over)."""
    _require(name)
    cfg = _cfg(name, update_proj_gap=2)
    model = build_decoder(TINY, seed=0)
    opt = build_optimizer(model, cfg, in_backward=in_backward)
    _train(model, opt, 3)
    saved = _save_load(opt.state_dict())
    resumed = build_decoder(TINY, seed=1)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = build_optimizer(resumed, cfg, in_backward=in_backward)
    resumed_opt.load_state_dict(saved)
    assert _train(model, opt, 2, first=3) == _train(resumed, resumed_opt, 2, first=3)
    assert _same_weights(model, resumed)
    assert optimizer_state_bytes(opt) == optimizer_state_bytes(resumed_opt)


# by hand, from the shapes in the module doc (fp32: 4 bytes an element)
STATE_BYTES = {
    # hidden matrices: one momentum buffer each (73,728 x 4); the rest AdamW: 2 moments (33,088 x 8) and a 4-byte
    # step for each of its 7 tensors
    "muon": 73_728 * 4 + 33_088 * 8 + 7 * 4,
    # a 4-byte step per tensor (21); per layer rows + columns of q, o 128, k, v 96, gate, up, down 192 = 1,024,
    # the embedding and lm_head 320 each, the five norms a full vector of 64 each
    "adafactor": 21 * 4 + (2 * 1_024 + 2 * 320 + 5 * 64) * 4,
    # rank 1, per matrix: the projection (n for m >= n, else m), two projected moments (2m, else 2n) and a 0-dim
    # norm: q, o 193, k, v 161, gate, up, down 321 -> 1,671 a layer; the rest AdamW's two moments (no step tensor)
    "apollo_mini": 2 * 1_671 * 4 + 33_088 * 8,
    # the first moment of every element (106,816 x 4); second moments: embedding and lm_head 256 rows each, per
    # layer q 4 heads, k 2 heads, v 32 rows, o 64, gate 128, up 128, down 64 (422); the five norms 1 each
    "adam_mini": 106_816 * 4 + (256 + 256 + 2 * 422 + 5) * 4,
}


@pytest.mark.parametrize("name", sorted(STATE_BYTES))
def test_state_bytes_by_hand(name):
    _require(name)
    model = build_decoder(TINY, seed=0)
    opt = build_optimizer(model, _cfg(name))
    _train(model, opt, 1)
    assert optimizer_state_bytes(opt) == STATE_BYTES[name]
    adamw = 106_816 * 8 + 21 * 4
    print(f"{name}: {STATE_BYTES[name]:,} bytes of state, {STATE_BYTES[name] / adamw:.2f} of AdamW's")


# ----------------------------------------------------------------------------------------------------------------
# One partition: groups, banner, closed form; settings; the planner
# ----------------------------------------------------------------------------------------------------------------


def test_one_partition_for_groups_banner_and_closed_form():
    model = build_decoder(TINY, seed=0)
    groups = param_groups(model, 0.1, "muon", adamw_lr_scale=0.5)
    assert [(g["name"], g.get("algorithm"), len(g["params"])) for g in groups] == [
        ("decay", "adamw", 2),
        ("muon", "muon", 14),
        ("no_decay", "adamw", 5),
    ]
    assert [g.get("lr_scale") for g in groups] == [0.5, None, 0.5]  # optimizer.adamw_lr / optimizer.lr
    assert describe_partition(model, "muon") == "muon: 14 matrices (0.1M), adamw: 7 tensors (0.0M)"
    assert describe_partition(model, "adamw") == ""
    named = {n: p for n, p in model.named_parameters()}
    infos = optimizers.tensor_infos(
        "adam_mini", [(n, tuple(p.shape), 4, p.ndim) for n, p in named.items()], dim=64, num_heads=4
    )
    blocks = {n: (t.part, t.blocks) for n, t in zip(named, infos, strict=True)}
    assert blocks["model.layers.0.self_attn.q_proj.weight"] == ("heads", 4)
    assert blocks["model.layers.0.self_attn.k_proj.weight"] == ("heads", 2)
    assert blocks["model.layers.0.mlp.down_proj.weight"] == ("rows", 64)
    assert blocks["model.norm.weight"] == ("tensor", 1)
    assert optimizers.part_of("apollo", "model.layers.1.self_attn.q_proj.lora_A", 2) == "apollo"
    assert optimizers.part_of("muon", "lm_head.weight", 2) == "adamw"
    assert (
        optimizers.apollo_rank("apollo", 0, 4096, (1024, 4096)) == 1024
    )  # width / 4, at most the smaller side
    assert optimizers.apollo_rank("apollo", 0, 4096, (512, 4096)) == 512
    assert optimizers.apollo_rank("apollo_mini", 0, 4096, (1024, 4096)) == 1


def test_the_adamw_group_of_muon_follows_the_schedule_at_its_own_lr():
    from memfit.train import _set_lr

    cfg = load_config(None, ["optimizer.name=muon", "optimizer.lr=0.02", "optimizer.adamw_lr=0.002"])
    opt = build_optimizer(build_decoder(TINY, seed=0), cfg.optimizer)
    lr = _set_lr(cfg, opt, cfg.optimizer.warmup_steps)  # the peak
    assert lr == pytest.approx(0.02)
    assert {g["name"]: pytest.approx(g["lr"]) for g in opt.param_groups} == {
        "decay": 0.002,
        "muon": 0.02,
        "no_decay": 0.002,
    }


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("optimizer.momentum=1.0", "optimizer.momentum"),
        ("optimizer.ns_steps=0", "optimizer.ns_steps"),
        ("optimizer.muon_ns_dtype=fp16", "optimizer.muon_ns_dtype"),
        ("optimizer.adjust_lr_fn=spectral", "optimizer.adjust_lr_fn"),
        ("optimizer.beta2_decay=0.5", "optimizer.beta2_decay"),
        ("optimizer.clipping_threshold=0.5", "optimizer.clipping_threshold"),
        ("optimizer.apollo_rank=-1", "optimizer.apollo_rank"),
        ("optimizer.update_proj_gap=0", "optimizer.update_proj_gap"),
    ],
)
def test_bad_settings_name_their_key(setting, key):
    from memfit.errors import ConfigError

    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(None, [setting])


def test_cpu_offload_is_refused_for_them():
    reason = optimizers.check_optimizer_supported("muon", "cuda", cpu_offload=True)
    assert reason is not None and "offload" in reason and "'muon'" in reason


def test_the_plan_keeps_the_update_rule_unless_allowed():
    cfg = load_config(
        None, ["model=tiny", "tokenizer.kind=char", "optimizer.name=adamw"], needs_weights=False
    )

    def names(**kw):
        return {c.optimizer.name for c in P.candidates(cfg, **kw)}

    assert names() == {"adamw", "adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit"}
    assert names(optimizers=["muon", "apollo_mini", "adamw8bit"]) == {
        "adamw",
        "muon",
        "apollo_mini",
        "adamw8bit",
    }
    muon = load_config(
        None, ["model=tiny", "tokenizer.kind=char", "optimizer.name=muon"], needs_weights=False
    )
    assert {c.optimizer.name for c in P.candidates(muon)} == {"muon"}


def test_the_estimator_counts_the_fp32_iteration_s_temporaries():
    """The estimator traces the real step, so the iteration's dtype is in its peak: the default model at 1 x 8
    tokens peaks in Muon's step, at the widest matrix's iteration (gate/up, 688 x 256, worked on as 256 x 688): its
    cast and the next iterate (256 x 688 each) and the Gram matrix and its polynomial (256 x 256 each), 2 bytes
    more per element in fp32 than in bf16, and the 0-dim norm's 2 bytes."""
    peaks = {}
    for dtype in ("bf16", "fp32"):
        overrides = ["model=shakespeare", "tokenizer.kind=char", "batch_size=1", "seq_len=8", "device=cpu"]
        overrides += ["optimizer.name=muon", f"optimizer.muon_ns_dtype={dtype}"]
        estimate = estimate_run(load_config(None, overrides, needs_weights=False))
        assert estimate.phase == "optimizer_step"
        peaks[dtype] = estimate.peak_bytes, estimate.breakdown["temporaries"]
    more = 2 * (2 * 256 * 688 + 2 * 256 * 256) + 2
    assert peaks["fp32"][0] - peaks["bf16"][0] == more == 966_658
    assert peaks["fp32"][1] - peaks["bf16"][1] == more
