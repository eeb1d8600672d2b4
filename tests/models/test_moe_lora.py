"""LoRA on a mixture of experts' stacked weights (``lora.target_parameters``) against Hugging Face PEFT's
``target_parameters`` LoRA on transformers 5's own classes: the same logits from the same adapter, the adapter
written in PEFT's layout and read back from it (either order of the two weights), fine-tunes through the CLI
(LoRA and QLoRA) whose adapters and merged exports transformers reproduces, and the refusals.
"""

from __future__ import annotations

import json

import pytest
import torch

from memfit.cli import main
from memfit.convert import load_pretrained
from memfit.convert.peft_adapter import PEFT_CONFIG, PEFT_WEIGHTS, load_peft_adapter, save_peft_adapter
from memfit.models import moe
from memfit.models.peft import EXPERT_LORA_TARGETS, apply_lora, lora_state_dict, merge_lora
from tests.conftest import finetune_overrides
from tests.models.test_families import _ids, _losses
from tests.models.test_moe import HF_CONFIGS, _hf, make_hf_dirs

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

BOTH = list(EXPERT_LORA_TARGETS)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return make_hf_dirs(tmp_path_factory)


def _peft_model(directory, target_parameters, target_modules=("q_proj",), seed=1):
    """transformers' model of ``directory`` under PEFT's LoRA (r 4, alpha 8) with every LoRA tensor random (B
    too, as training would leave it)."""
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=list(target_modules), target_parameters=list(target_parameters)
    )
    model = peft.get_peft_model(_hf(directory), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return model.eval()


@pytest.mark.parametrize("kind", list(HF_CONFIGS))
@pytest.mark.parametrize("order", [BOTH, BOTH[::-1], BOTH[1:]], ids=["gate_up,down", "down,gate_up", "down"])
def test_a_peft_adapter_on_the_experts_gives_peft_logits_and_is_written_back_alike(
    hf_dirs, tmp_path, kind, order
):
    """PEFT writes an adapter of q_proj and the experts' stacks (its ParamWrapper layout: A (E * r, in), B (out,
    r * E), wrapped in ``target_parameters``' order); memfit loads it and gives PEFT's logits (1e-5 in fp32),
    and writes it again with tensors equal to PEFT's under the same keys, which PEFT loads to the same logits."""
    theirs = _peft_model(hf_dirs[kind], order)
    adapter = tmp_path / "peft"
    theirs.save_pretrained(adapter)
    ours, _, _ = load_pretrained(hf_dirs[kind])
    names = load_peft_adapter(ours, adapter)
    assert sum(".experts.lora." in n for n in names) == 2 * len(order) * ours.config.num_moe_layers
    ids = _ids(40)
    with torch.no_grad():
        expected = theirs(ids).logits
        assert (ours.eval()(ids) - expected).abs().max().item() <= 1e-5

    back = save_peft_adapter(ours, tmp_path / "ours")
    written = safetensors_torch.load_file(str(back / PEFT_WEIGHTS))
    original = safetensors_torch.load_file(str(adapter / PEFT_WEIGHTS))
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in written)
    config = json.loads((back / PEFT_CONFIG).read_text())
    assert config["target_parameters"] == [t for t in EXPERT_LORA_TARGETS if t in order]
    again = peft.PeftModel.from_pretrained(_hf(hf_dirs[kind]), back).eval()
    with torch.no_grad():
        assert (again(ids).logits - expected).abs().max().item() <= 1e-5


def test_gradients_of_the_experts_lora_equal_peft(hf_dirs):
    """The grouped experts' backward gives every LoRA tensor PEFT's gradient (1e-5), in PEFT's layout."""
    from memfit.convert.peft_adapter import _from_peft, _stacks, _to_peft

    theirs = _peft_model(hf_dirs["qwen3_moe"], BOTH, target_modules=())
    ours, _, _ = load_pretrained(hf_dirs["qwen3_moe"])
    apply_lora(ours, rank=4, alpha=8, target_modules=(), target_parameters=BOTH)
    with torch.no_grad():  # theirs into ours, through the adapter layout
        mine = {_to_peft(n, t, _stacks(BOTH))[0]: t for n, t in lora_state_dict(ours).items()}
        for key, p in theirs.named_parameters():
            if "lora_" in key:
                name = key.replace(".default", "")
                mine[name].copy_(_from_peft(name, p, _stacks(BOTH), 6)[1])
    ids = _ids(40)
    theirs(ids, labels=ids).loss.backward()
    ours.train()
    logits = ours(ids)
    vocab = logits.shape[-1]
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
    grads = {_to_peft(n, p.grad, _stacks(BOTH))[0]: _to_peft(n, p.grad, _stacks(BOTH))[1]
             for n, p in ours.named_parameters() if p.requires_grad}  # fmt: skip
    theirs_grads = {
        k.replace(".default", ""): p.grad for k, p in theirs.named_parameters() if p.requires_grad
    }
    assert grads.keys() == theirs_grads.keys() and len(grads) == 8  # 2 MoE layers x 2 stacks x (A, B)
    for key, grad in grads.items():
        assert (grad - theirs_grads[key]).abs().max().item() <= 1e-5, key


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_finetune_the_experts_and_export_the_adapter_and_the_merged_model(hf_dirs, tmp_path, method):
    """A fine-tune of LoRA on q_proj and on every expert's gate_up and down stacks through the CLI: the loss falls;
    ``memfit export --adapter-only`` is a PEFT adapter that PEFT applies to the base with memfit's logits, and
    the merged export loads into transformers with memfit's logits (LoRA: 1e-5; QLoRA's base is NF4, so its
    adapter goes on the dequantized base, compared with memfit's merged model)."""
    from memfit.build import load_for_generation

    extra = {"method": method, "seq_len": 256, "batch_size": 4, "max_steps": 6, "optimizer.lr": 1e-2,
             "optimizer.min_lr": 1e-3, "optimizer.warmup_steps": 1, "lora.dropout": 0,
             "lora.target_modules": "[q_proj]", "lora.target_parameters": f"[{','.join(BOTH)}]"}  # fmt: skip
    run = tmp_path / "run"
    assert main(["finetune", *finetune_overrides(hf_dirs["mixtral"], run, **extra)]) == 0
    losses = _losses(run)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05
    model, _, _ = load_for_generation(run)
    experts = model.model.layers[0].mlp.experts
    assert experts.lora.gate_up_proj.lora_A.shape == (6, 8, 64) and experts.lora.down_proj.lora_B.shape == (
        6,
        64,
        8,
    )
    assert experts.lora.down_proj.lora_B.abs().max().item() > 0  # it trained
    ids = _ids(40)
    with torch.no_grad():
        ours = model.eval()(ids)
    adapter = tmp_path / "adapter"
    assert main(["export", "--checkpoint", str(run), "--out", str(adapter), "--adapter-only"]) == 0
    merged = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--out", str(merged)]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        assert (back(ids).logits - ours).abs().max().item() <= (1e-5 if method == "lora" else 2e-2)
    if method == "lora":
        with torch.no_grad():
            applied = peft.PeftModel.from_pretrained(_hf(hf_dirs["mixtral"]), adapter).eval()
            assert (applied(ids).logits - ours).abs().max().item() <= 1e-5


def test_merge_folds_each_experts_update_into_its_weight(hf_dirs):
    ours, _, _ = load_pretrained(hf_dirs["olmoe"])
    apply_lora(ours, rank=4, alpha=8, target_modules=(), target_parameters=BOTH, seed=3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
    ids = _ids(40)
    with torch.no_grad():
        before = ours.eval()(ids)
        merge_lora(ours)
        assert (ours(ids) - before).abs().max().item() <= 1e-5
    assert not [n for n in dict(ours.named_parameters()) if "lora" in n]
    assert "forward" not in vars(ours.model.layers[0].mlp.experts)


def test_the_experts_lora_a_is_drawn_as_peft_draws_it(hf_dirs):
    """Each expert's A rows are kaiming-uniform with fan_in the stack's input width (PEFT's nn.Linear(in, E * r)):
    a generator seeded alike gives PEFT's values."""
    ours, _, _ = load_pretrained(hf_dirs["qwen3_moe"])
    apply_lora(ours, rank=4, alpha=8, target_modules=(), target_parameters=BOTH, seed=5)
    a = ours.model.layers[0].mlp.experts.lora.down_proj.lora_A  # (6, 4, 32)
    linear = torch.nn.Linear(32, 6 * 4, bias=False)
    torch.nn.init.kaiming_uniform_(linear.weight, a=5**0.5, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.reshape(24, 32), linear.weight.detach())
    assert ours.model.layers[0].mlp.experts.lora.down_proj.lora_B.abs().max().item() == 0


@pytest.mark.parametrize(
    ("targets", "dropout", "message"),
    [
        (["mlp.experts.up_proj"], 0.0, "unknown LoRA target parameter 'mlp.experts.up_proj'"),
        (["down_proj", "mlp.experts.down_proj"], 0.0, "names a weight twice"),
        (["mlp.experts.down_proj"], 0.1, "dropout must be 0 with target_parameters"),
    ],
)
def test_bad_expert_targets_are_refused_before_the_model_changes(hf_dirs, targets, dropout, message):
    ours, _, _ = load_pretrained(hf_dirs["mixtral"])
    before = dict(ours.named_parameters())
    with pytest.raises(ValueError, match=message):
        apply_lora(ours, rank=4, dropout=dropout, target_parameters=targets)
    assert dict(ours.named_parameters()) == before and "forward" not in vars(ours.model.layers[0].mlp.experts)


def test_a_dense_model_refuses_expert_targets():
    from memfit.models.decoder import build_decoder
    from memfit.models.presets import model_config

    with pytest.raises(ValueError, match="has no mixture of experts"):
        apply_lora(build_decoder(model_config("tiny")), target_parameters=["mlp.experts.down_proj"])


def test_the_grouped_experts_lora_path_equals_the_merged_weights_in_float64():
    """``W_e + s B_e A_e`` per expert, forward and every gradient, whatever routes where (an expert with none)."""
    torch.manual_seed(0)
    E, C, I, r, s = 5, 16, 12, 3, 0.7  # noqa: E741
    sizes = [10, 0, 15, 5, 10]
    leaf = lambda *shape: torch.randn(*shape, dtype=torch.float64, requires_grad=True)  # noqa: E731
    xs, gu, dn = leaf(40, C), leaf(E, 2 * I, C), leaf(E, C, I)
    a1, b1, a2, b2 = leaf(E, r, C), leaf(E, 2 * I, r), leaf(E, r, I), leaf(E, C, r)
    out = moe.grouped_experts(xs, gu, dn, sizes, moe.ExpertsLora((a1, b1), (a2, b2), s))
    reference = moe.grouped_experts(xs, gu + s * b1 @ a1, dn + s * b2 @ a2, sizes)
    g = torch.randn_like(out)
    leaves = (xs, gu, dn, a1, b1, a2, b2)
    for ours, theirs in zip(
        torch.autograd.grad(out, leaves, g), torch.autograd.grad(reference, leaves, g), strict=True
    ):
        assert (ours - theirs).abs().max().item() <= 1e-10
    assert (out - reference).abs().max().item() <= 1e-10


# every switch that works on a mixture of experts (compile is refused), on a LoRA of the experts' stacks: the
# fast tier runs the tiled MLP (each tile's experts recomputed in the backward, their LoRA gradients returned)
LORA_SWITCH_CASES = {
    "tiled_mlp=4": True,
    "activation_checkpointing=full": False,
    "activation_checkpointing=selective": False,
    "optimizer_in_backward=true": False,
    "chunked_cross_entropy=4": False,
    "activation_offloading=True,activation_checkpointing=full": False,
    "dtype=bf16": False,
    "optimizer.name=adamw8bit": False,
}


@pytest.fixture(scope="module")
def lora_baseline(hf_dirs, tmp_path_factory):
    return _lora_run(hf_dirs["mixtral"], tmp_path_factory.mktemp("lora-base"))


def _lora_run(directory, out, **switches):
    extra = {"method": "lora", "seq_len": 256, "batch_size": 4, "max_steps": 5, "optimizer.lr": 1e-2,
             "optimizer.warmup_steps": 1, "max_grad_norm": 0, "lora.dropout": 0, "lora.target_modules": "[q_proj]",
             "lora.target_parameters": f"[{','.join(BOTH)}]", **switches}  # fmt: skip
    assert main(["finetune", *finetune_overrides(directory, out / "run", **extra)]) == 0
    return _losses(out / "run")


@pytest.mark.parametrize(
    "name", [n if fast else pytest.param(n, marks=pytest.mark.slow) for n, fast in LORA_SWITCH_CASES.items()]
)
def test_switches_keep_their_parity_on_a_lora_of_the_experts(lora_baseline, hf_dirs, tmp_path, name):
    """Each switch's own case (tests/test_switch_parity.py: its tolerance, relative or absolute) on a LoRA
    fine-tune of q_proj and every expert's stacks of the tiny Mixtral, against the run without it."""
    from tests.test_switch_parity import CASES

    parity = CASES[name]
    losses = _lora_run(hf_dirs["mixtral"], tmp_path, **parity.settings)
    assert len(losses) == len(lora_baseline) == 5 and lora_baseline[-1] < lora_baseline[0]
    if parity.relative:
        worst = max(abs(a - b) / b for a, b in zip(losses, lora_baseline, strict=True))
    else:
        worst = max(abs(a - b) for a, b in zip(losses, lora_baseline, strict=True))
    assert worst <= parity.tolerance, (losses, lora_baseline)
