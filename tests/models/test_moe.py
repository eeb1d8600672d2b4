"""Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) against transformers' own classes, and the grouped
experts, the router's load-balancing loss and the routing assumption of :mod:`memfit.models.moe`.

Per family a random tiny config is made with transformers (6 experts, 2 a token; Qwen3-MoE with a dense layer
too), its weights moved off their initial values and written with ``save_pretrained``, which writes one tensor per
expert; memfit must give the same logits (1e-5 in fp32) at 24 and 1,100 tokens and in packed rows, read
transformers 5's fused 3-D layout as well, and export a directory transformers loads back with equal logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from memfit.convert import export_checkpoint, load_pretrained, read_config
from memfit.convert.hf import hf_config_to_decoder
from memfit.errors import CheckpointError
from memfit.models import moe
from memfit.models.decoder import build_decoder
from memfit.models.families import FAMILIES
from memfit.models.presets import model_config
from tests.models.test_families import (
    VOCAB,
    _ids,
    assert_preset_is_the_official_config,
    finetune_and_export,
    packed_rows_diff,
    perturbed,
    save_tiny,
)

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0,
)  # fmt: skip
HF_CONFIGS = {
    # 6 experts of 32, 2 a token, renormalised; layer 1 a dense MLP of 96 (mlp_only_layers)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1],
    ),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=6, num_experts_per_tok=2),
    # OLMoE: q/k norms over the whole projections, the softmax's weights as they are
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return make_hf_dirs(tmp_path_factory)


def make_hf_dirs(tmp_path_factory):
    """A directory of each of :data:`HF_CONFIGS`, written by transformers (one tensor per expert)."""
    out = {}
    for kind, make in HF_CONFIGS.items():
        torch.manual_seed(0)
        model = perturbed(transformers.AutoModelForCausalLM.from_config(make()))
        with torch.no_grad():  # routers far from uniform, so that the experts' choice is not a tie
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0, 0.5)
        out[kind] = save_tiny(model, tmp_path_factory.mktemp(kind))
    return out


def _hf(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
@pytest.mark.parametrize("T", [24, 1100])
def test_logits_equal_transformers(hf_dirs, kind, T):
    ours, _, _ = load_pretrained(hf_dirs[kind])
    assert ours.config.family == kind and ours.config.num_experts == 6
    ids = _ids(T)
    with torch.no_grad():
        assert (_hf(hf_dirs[kind])(ids).logits - ours.eval()(ids)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_packed_rows_equal_each_sample_alone_in_transformers(hf_dirs, kind):
    ours, _, _ = load_pretrained(hf_dirs[kind])
    assert packed_rows_diff(_hf(hf_dirs[kind]), ours) <= 1e-5


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_gradients_equal_transformers(hf_dirs, kind):
    """The grouped experts' backward: every parameter's gradient equals transformers' (1e-5, fp32)."""
    hf = _hf(hf_dirs[kind]).train()
    ours, _, _ = load_pretrained(hf_dirs[kind])
    ids = _ids(40)
    hf(ids).logits.pow(2).mean().backward()
    ours.train()(ids).pow(2).mean().backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - theirs[name].grad).abs().max().item() <= 1e-5, name


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_parameter_names_are_transformers_5_state_dict(hf_dirs, kind):
    ours, _, _ = load_pretrained(hf_dirs[kind])
    hf = _hf(hf_dirs[kind])
    assert set(dict(ours.named_parameters())) == set(hf.state_dict())
    moe_layer = {
        n.removeprefix("model.layers.0.") for n in hf.state_dict() if n.startswith("model.layers.0.")
    }
    assert set(FAMILIES[kind].layer_tensors) <= moe_layer


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_the_fused_3d_layout_of_transformers_5_reads_alike(hf_dirs, tmp_path, kind):
    """A directory whose experts are stored as transformers 5 holds them in memory (``gate_up_proj`` (E, 2I, C),
    ``down_proj`` (E, C, I)) loads to the same weights as the per-expert one."""
    hf = _hf(hf_dirs[kind])
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((hf_dirs[kind] / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in hf.state_dict().items()}, str(fused / "model.safetensors"))
    names = json.dumps(sorted(hf.state_dict()))
    assert "experts.gate_up_proj" in names and "experts.0." not in names
    a, _, _ = load_pretrained(fused)
    b, _, _ = load_pretrained(hf_dirs[kind])
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
def test_export_writes_one_tensor_per_expert_and_loads_back(hf_dirs, tmp_path, kind):
    out = export_checkpoint(hf_dirs[kind], tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == kind
    with (
        safe_open(str(out / "model.safetensors"), "pt") as f,
        safe_open(str(hf_dirs[kind] / "model.safetensors"), "pt") as original,
    ):
        assert set(f.keys()) == set(original.keys())  # save_pretrained's names, expert by expert
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), original.get_tensor(name)), name
    ids = _ids(24)
    with torch.no_grad():
        assert (_hf(out)(ids).logits - _hf(hf_dirs[kind])(ids).logits).abs().max().item() <= 1e-5
    assert read_config(out)[0] == read_config(hf_dirs[kind])[0]


def test_a_missing_expert_is_named(hf_dirs, tmp_path):
    src = hf_dirs["mixtral"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if "experts.3.w3" not in n or "layers.2." not in n}
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"layers\.2\.mlp has 11 of its 12 expert tensors for gate_up_proj"
    ):
        load_pretrained(broken)


# ----------------------------------------------------------------------------------------------------------------
# Router, aux loss, routing assumption


def test_load_balancing_loss_equals_transformers_for_one_layer():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    logits = torch.randn(40, 6)
    probs = torch.softmax(logits, -1)
    _, experts = torch.topk(probs, 2, dim=-1)
    counts = torch.zeros(6, dtype=torch.int64).scatter_add_(
        0, experts.reshape(-1), torch.ones(80, dtype=torch.int64)
    )
    ours = moe.load_balancing_loss(probs, counts)
    theirs = load_balancing_loss_func((logits,), num_experts=6, top_k=2)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_the_aux_loss_adds_its_gradient_to_the_router_only_in_the_backward():
    """With the scale set, the output is unchanged and the router's gradient gains ``scale *
    d(load_balancing_loss)/dW`` exactly; without it, nothing is added."""
    config = model_config("tiny-mixtral", num_layers=1)
    model = build_decoder(config, seed=0)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 16, config.dim)

    def router_grad(scale):
        block.zero_grad()
        with moe.aux_loss_scale(scale):
            y = block(x)
            y.sum().backward()
        return y.detach(), block.gate.weight.grad.clone()

    y0, g0 = router_grad(0.0)
    y1, g1 = router_grad(0.5)
    assert torch.equal(y0, y1)
    probs, _, experts = block.gate(x.reshape(-1, config.dim))
    counts = torch.zeros(8, dtype=torch.int64).scatter_add_(
        0, experts.reshape(-1), torch.ones(32, dtype=torch.int64)
    )
    (extra,) = torch.autograd.grad(moe.load_balancing_loss(probs, counts), block.gate.weight)
    assert torch.allclose(g1 - g0, 0.5 * extra, atol=1e-6)


@pytest.mark.parametrize(
    ("routing", "expected"),
    [
        (moe.Routing("balanced", 1.0), [5, 5, 5, 5, 4, 4, 4, 4]),
        (moe.Routing("balanced", 2.0), [9, 4, 4, 4, 4, 4, 4, 3]),
        (moe.Routing("collapsed"), [18, 18, 0, 0, 0, 0, 0, 0]),
    ],
)
def test_routing_assumptions_give_the_sizes_they_state(routing, expected):
    sizes = routing.sizes(18, 8, 2)
    assert sizes == expected and sum(sizes) == 36


def test_under_fake_tensors_the_experts_route_by_the_assumption():
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    real = moe._GroupedExperts.forward

    def spy(ctx, xs, gate_up, down, sizes, *lora):
        seen.append(list(sizes))
        return real(ctx, xs, gate_up, down, sizes, *lora)

    config = model_config("tiny-qwen3-moe", num_layers=1)
    with (
        FakeTensorMode(),
        moe.routing_assumption(moe.Routing("collapsed")),
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setattr(moe._GroupedExperts, "forward", staticmethod(spy))
        model = build_decoder(config, device="cpu", init=False)
        model(torch.zeros(2, 12, dtype=torch.int64))
    assert seen == [[24, 24, 0, 0, 0, 0, 0, 0]]


# ----------------------------------------------------------------------------------------------------------------
# Presets and refusals

# Qwen/Qwen3-30B-A3B config.json
_QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
OFFICIAL = {
    # published 30.5B, 3.3B active
    "qwen3-30b-a3b": ("qwen3_moe", _QWEN3_30B_A3B, 30_532_122_624, 3.3),
    # Qwen/Qwen3-235B-A22B config.json: published 235B, 22B active
    "qwen3-235b-a22b": (
        "qwen3_moe",
        {**_QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
         "num_hidden_layers": 94, "num_attention_heads": 64},
        235_093_634_560,
        22.2,
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json; published 46.7B, 12.9B active
    "mixtral-8x7b": (
        "mixtral",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
             max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
             router_aux_loss_coef=0.02, tie_word_embeddings=False),
        46_702_792_704,
        12.9,
    ),
    # allenai/OLMoE-1B-7B-0924 config.json; published 6.9B, 1.3B active
    "olmoe-1b-7b": (
        "olmoe",
        dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
             norm_topk_prob=False, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
             router_aux_loss_coef=0.01, clip_qkv=None, tie_word_embeddings=False),
        6_919_161_856,
        1.3,
    ),
}  # fmt: skip
"""Preset -> (model_type, the official config.json's fields, parameters, billions active as published)."""


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_preset_parameters_equal_the_official_config(name):
    model_type, fields, published, active = OFFICIAL[name]
    assert_preset_is_the_official_config(name, model_type, fields, published)
    # the experts a token computes with, to the published figure's rounding (Qwen writes 3.35B as 3.3B)
    assert abs(model_config(name).active_params() / 1e9 - active) < 0.06


@pytest.mark.parametrize(
    ("model_type", "edit", "message"),
    [
        ("qwen2_moe", {}, "model_type is 'qwen2_moe'.*shared experts"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise is 0.1"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv is 8.0"),
        (
            "qwen3_moe",
            {"num_experts_per_tok": 9, "num_experts": 8},
            "num_experts_per_tok is 9, more than the 8",
        ),
    ],
)
def test_what_memfit_does_not_build_is_refused_naming_the_key(model_type, edit, message):
    cfg = {"model_type": model_type, **SMALL, **edit}
    with pytest.raises(CheckpointError, match=message):
        hf_config_to_decoder(cfg)


# ----------------------------------------------------------------------------------------------------------------
# Fine-tuning from the directory, through the CLI


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
@pytest.mark.parametrize("method", ["full", "lora"])
def test_finetune_from_the_directory_and_export_to_transformers(hf_dirs, tmp_path, kind, method):
    finetune_and_export(hf_dirs[kind], tmp_path, method, kind, targets="[q_proj,k_proj,v_proj,o_proj]")


# ----------------------------------------------------------------------------------------------------------------
# Routing in the estimate: real runs forced into each assumption land on its figure


def _forced_router(kind: str):
    """``Router.forward`` with its real work, whose expert choice is then forced: ``balanced`` sends the routed
    rows round-robin (every expert exactly its share), ``collapsed`` sends every token to experts 0 .. k - 1."""
    real = moe.Router.forward

    def forward(self, x):
        probs, weights, experts = real(self, x)
        n, k = experts.shape
        if kind == "balanced":
            forced = torch.arange(n * k, device=x.device).remainder_(self.weight.shape[0]).view(n, k)
        else:
            forced = torch.arange(k, device=x.device).expand(n, k).clone()
        return probs, weights, forced

    return forward


@pytest.mark.parametrize(
    ("kind", "setting"), [("balanced", "estimate.moe_skew=1.0"), ("collapsed", "estimate.moe_bound=true")]
)
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_tracked_peak_of_a_forced_router_is_the_estimate_of_its_routing(
    kind, setting, checkpointing, tmp_path, small_corpus, monkeypatch
):
    """A real pretraining run of a tiny Mixtral (8 experts, 2 a token; the routers train, with their aux loss)
    whose router is forced into the routing an estimate assumes: its tracked peak is the estimate's figure to the
    byte (as every PEAK_CASE of tests/memory/test_estimate.py: the loop's previous loss, norm and token count
    aside), and the other figure is reported beside it."""
    import gc

    from memfit.cli import main
    from memfit.config import load_config
    from memfit.planner.estimate import estimate_run
    from tests.conftest import tiny_run_overrides
    from tests.memory.test_estimate import RUN, measured_peak

    monkeypatch.setattr(moe.Router, "forward", _forced_router(kind))
    run = tiny_run_overrides(
        small_corpus, tmp_path / "run", **RUN, model="tiny-mixtral", activation_checkpointing=checkpointing
    )
    gc.collect()
    gc.disable()
    try:
        assert main(["pretrain", *run]) == 0
    finally:
        gc.enable()
    measured = measured_peak(tmp_path / "run")
    estimate = estimate_run(load_config(None, [*run, setting]))
    assert estimate.routing["assumption"] == kind
    assert estimate.routing["other"]["assumption"] != kind and estimate.routing["other"]["peak_bytes"] > 0
    assert 0 <= measured - estimate.peak_bytes <= 64, (estimate.peak_bytes, measured)


def test_qlora_stores_the_experts_in_nf4_and_trains(hf_dirs, tmp_path):
    """QLoRA on a mixture of experts: the experts' stacks are NF4 (each expert dequantized alone as it computes),
    LoRA on the attention trains, and the loss falls."""
    from memfit.build import load_for_generation
    from memfit.cli import main
    from memfit.models.nf4 import is_nf4
    from tests.conftest import finetune_overrides
    from tests.models.test_families import _losses

    extra = {"method": "qlora", "seq_len": 256, "batch_size": 4, "max_steps": 4, "optimizer.lr": 1e-2,
             "optimizer.warmup_steps": 1, "lora.target_modules": "[q_proj,v_proj]"}  # fmt: skip
    run = tmp_path / "run"
    assert main(["finetune", *finetune_overrides(hf_dirs["qwen3_moe"], run, **extra)]) == 0
    losses = _losses(run)
    assert len(losses) == 4 and losses[-1] < losses[0]
    model, _, _ = load_for_generation(run)
    experts = model.model.layers[0].mlp.experts
    assert is_nf4(experts.gate_up_proj) and is_nf4(experts.down_proj)
    assert experts.gate_up_proj.shape == (6, 64, 64) and not experts.gate_up_proj.requires_grad


@pytest.mark.parametrize(
    ("method", "dtype"), [("qlora", "bf16"), ("qlora", "fp32"), ("full", "fp32"), ("full", "bf16")]
)
def test_the_load_of_experts_one_tensor_each_is_predicted_to_the_byte(hf_dirs, tmp_path, method, dtype):
    """Each layer's experts are stacked as their tensors are read (the stack allocated at its first part, in the
    stored dtype) and handed on whole: the walk of the headers (:func:`memfit.planner.phases.load_peak_bytes`)
    predicts what a tracker sees the real load hold, to the byte. QLoRA in 16 bits quantizes each expert into its
    stack's NF4 codes as it is read (no 16-bit stack exists); in float32 it quantizes each stack as it completes."""
    from torch import nn

    from memfit.build import load_base, run_model_config
    from memfit.config import load_config
    from memfit.memory.tracker import MemoryTracker
    from memfit.planner.phases import load_peak_bytes

    hf = _hf(hf_dirs["mixtral"]).to(torch.bfloat16)
    directory = tmp_path / "bf16"
    hf.save_pretrained(directory)  # one tensor per expert, in bf16
    cfg = load_config(
        None, [f"checkpoint_dir={directory}", f"method={method}", f"dtype={dtype}", "device=cpu"]
    )
    predicted = load_peak_bytes(cfg, run_model_config(cfg))
    tracker = MemoryTracker(nn.Module(), device="cpu", record_timeline=False)
    with tracker:
        model = load_base(cfg, "cpu")
    assert predicted == tracker.peak_bytes
    stack = 6 * 2 * 96 * 64 * 2  # a layer's gate_up stack in bf16: (6, 192, 64)
    assert predicted > stack and model.model.layers[2].mlp.experts.gate_up_proj.shape == (6, 192, 64)


def test_qlora_quantizes_each_expert_as_it_is_read_bit_identical_to_the_whole_stack(hf_dirs, tmp_path):
    """The NF4 stacks a QLoRA load builds expert by expert (:class:`memfit.models.nf4.NF4Builder`) equal
    :func:`memfit.models.nf4.to_nf4` of the whole bf16 stack, inner tensor by inner tensor."""
    from memfit.build import load_base
    from memfit.config import load_config
    from memfit.models.nf4 import is_nf4, to_nf4

    hf = _hf(hf_dirs["qwen3_moe"]).to(torch.bfloat16)
    directory = tmp_path / "bf16"
    hf.save_pretrained(directory)  # one tensor per expert, in bf16
    base = [f"checkpoint_dir={directory}", "dtype=bf16", "device=cpu"]
    quantized = load_base(load_config(None, [*base, "method=qlora"]), "cpu")
    whole = load_base(load_config(None, [*base, "method=full"]), "cpu")
    inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
    checked = 0
    for name, p in quantized.named_parameters():
        if ".experts." in name:
            assert is_nf4(p), name
            reference = to_nf4(whole.get_parameter(name).detach())
            assert all(torch.equal(getattr(p, a), getattr(reference, a)) for a in inner), name
            assert p.shape == reference.shape and p.dtype == torch.bfloat16
            checked += 1
    assert checked == 4  # 2 MoE layers x (gate_up_proj, down_proj)


def test_estimate_reports_the_routing_assumption_and_the_bound(capsys):
    from memfit.cli import main

    args = ["estimate", "model=tiny-mixtral", "model_args.vocab_size=512", "tokenizer.vocab_size=512", "batch_size=2",
            "seq_len=32", "device=cpu"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "routing (mixture of experts): balanced top-k, the busiest expert 2.0x its share" in out
    assert "the bound (every token at the same k experts): peak" in out
    assert main([*args, "estimate.moe_bound=true", "--json"]) == 0
    routing = json.loads(capsys.readouterr().out)["routing"]
    assert routing["assumption"] == "collapsed" and routing["other"]["assumption"] == "balanced"
    assert routing["other"]["peak_gib"] > 0


def test_compile_is_refused_for_a_mixture_of_experts_before_anything_is_allocated(
    tmp_path, small_corpus, capsys
):
    from memfit.cli import main
    from tests.conftest import tiny_run_overrides

    run = tiny_run_overrides(small_corpus, tmp_path / "run", model="tiny-mixtral", compile="true")
    assert main(["pretrain", *run]) == 2
    assert "config key 'compile': a mixture of experts routes by the data" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()
