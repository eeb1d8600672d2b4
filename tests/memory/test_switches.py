"""The registries: every memory switch (:data:`memfit.memory.switches.SWITCHES`) and every optimizer
(:data:`memfit.memory.optimizers.OPTIMIZERS`) is what its entry declares.

For every switch: (a) each declared refusal is refused with its message (exit 2 through the CLI) and every allowed
value is accepted; (c) a planned switch changes the plan's label, has a comment in the plan's YAML, changes the cost
model, and its config is estimated, with the bytes it moves reported apart; (d) docs name it. (b), loss parity
through the CLI at each entry's declared tolerance, is ``tests/test_switch_parity.py``. For every optimizer: its
closed-form state equals the state a real step leaves, and docs name it. A switch or optimizer added without these
parts fails here.
"""

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.config import OptimizerConfig, TrainConfig, load_config
from memfit.errors import ConfigError
from memfit.memory import optimizers, switches
from memfit.memory.optim import build_optimizer, optimizer_state_bytes
from memfit.models.config import DecoderConfig
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.planner import plan as P
from memfit.planner.estimate import estimate_run

DOCS = Path(__file__).parents[2] / "docs"
REFUSALS = [(s.key, r) for s in switches.SWITCHES for r in s.refusals]
PLANNED = switches.planned(world_size=2)
# the sharded switches are estimated on several fake ranks (tens of seconds each): the slow tier checks them
PLANNED_CASES = [
    pytest.param(s, id=s.key, marks=[pytest.mark.slow] if s.key.startswith("distributed.") else [])
    for s in PLANNED
]


def _overrides(settings):
    return [f"{k}={v}" for k, v in settings.items()]


def _ids(pairs):
    return [f"{key}-{i}" for i, (key, _) in enumerate(pairs)]


# ----------------------------------------------------------------------------------------------------------------
# (a) accepted and refused as declared
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "refusal"), REFUSALS, ids=_ids(REFUSALS))
def test_each_declared_conflict_is_refused_with_its_message(key, refusal):
    with pytest.raises(ConfigError) as info:
        load_config(None, _overrides(refusal.settings), world_size=refusal.world_size, needs_weights=False)
    assert str(info.value).startswith(f"config key '{refusal.key or key}': {refusal.message}")


def test_declared_conflicts_exit_2_through_the_cli(capsys):
    for key, refusal in REFUSALS:
        code = main(["estimate", *_overrides(refusal.settings), f"world_size={refusal.world_size}"])
        err = capsys.readouterr().err
        assert code == 2, (key, refusal)
        assert f"memfit: config error: config key '{refusal.key or key}': {refusal.message}" in err


def test_every_entry_that_checks_something_declares_what_it_refuses():
    for s in switches.SWITCHES:
        if s.check is not switches.check_nothing or s.check_model is not None:
            assert s.refusals, f"{s.key}: add Refusal examples of what its check refuses"


@pytest.mark.parametrize("switch", [s for s in switches.SWITCHES if s.choices], ids=lambda s: s.key)
def test_every_allowed_value_is_accepted_and_no_other(switch):
    for value in switch.choices:
        accepted = []
        for device in ("cpu", "cuda"):
            try:
                load_config(None, [f"{switch.key}={value}", f"device={device}"], needs_weights=False)
            except ConfigError:
                continue
            accepted.append(device)
        assert accepted, f"{switch.key}={value} is accepted nowhere"
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{switch.key}=no_such_value"], needs_weights=False)
    listed = ", ".join(str(c) for c in switch.choices)
    assert str(info.value) == f"config key '{switch.key}': 'no_such_value' is not one of {listed}"


def test_every_parity_run_is_a_valid_config():
    for s in switches.SWITCHES:
        assert s.parity or s.no_parity, f"{s.key}: declare a Parity run or why it has none (no_parity)"
        for parity in s.parity:
            load_config(None, ["max_grad_norm=0", *_overrides(parity.settings)])  # as the parity runs have it


# ----------------------------------------------------------------------------------------------------------------
# (c) planned: a label, a comment, a cost, an estimate
# ----------------------------------------------------------------------------------------------------------------


def _base(switch):
    """A CUDA plan's config in which ``switch`` can change on its own (full checkpointing, so that activation
    offloading is planned; LoRA, so that QLoRA is)."""
    world_size = 2 if switch.sharded_only else 1
    # AdamW: the planner keeps the config's update rule, and AdamW's family gives optimizer.name choices
    settings = [
        "device=cuda",
        "activation_checkpointing=full",
        "batch_size=1",
        "seq_len=64",
        "optimizer.name=adamw",
    ]
    if switch.key == "method":
        settings.append("method=lora")
    if switch.key == "tiled_mlp":  # under full checkpointing the tiles' recomputation is free
        settings[1] = "activation_checkpointing=none"
    return load_config(None, settings, world_size=world_size, needs_weights=False), world_size


def _changing_only(switch):
    base, world_size = _base(switch)
    rows = [
        c
        # hybrid sharding is planned across nodes only: the 2 ranks as 2 nodes of 1
        for c in P.candidates(base, world_size, ("fp32", "bf16_mixed", "bf16"), nodes=world_size)
        if switches.changed_keys(c, base, world_size) == (switch.key,)
    ]
    assert rows, f"{switch.key}: the planner never changes it alone"
    return base, world_size, rows


def _cost(cfg, world_size):
    ctx = P._Context(cfg, world_size, 80 * 1024**3, 0.1, None)
    acts = sum(ctx.saved_activations(cfg)) if ctx.offloads_activations(cfg) else 0
    return ctx.cost(cfg, acts, 0)["total"]


@pytest.mark.parametrize("switch", PLANNED_CASES)
def test_every_planned_switch_has_a_label_a_comment_and_a_cost(switch):
    base, world_size, rows = _changing_only(switch)
    base_label = switches.label(switches.values(base, world_size), base)
    for cfg in rows:
        value = switches.value_of(cfg, switch.key)
        assert switches.label(switches.values(cfg, world_size), cfg) != base_label, value
        if value != switches.value_of(TrainConfig(), switch.key):  # the default value goes without saying
            assert switches.comment(switch.key, value), (
                f"{switch.key}={value} has no comment in the plan's YAML"
            )
        assert switch.key in switches.yaml_keys(cfg)
    # its cost rule moves the step's time for some value (fused and foreach AdamW cost the same: for_loop does not)
    others = [switches.with_values(base, {switch.key: v}) for v in switch.choices]
    base_cost = _cost(base, world_size)
    assert any(_cost(cfg, world_size) != base_cost for cfg in rows + others), f"{switch.key} costs nothing"


@pytest.mark.parametrize("switch", PLANNED_CASES)
def test_every_planned_switch_is_estimated(switch):
    _, world_size, rows = _changing_only(switch)
    cfg = rows[0]
    e = estimate_run(cfg, world_size=world_size)
    assert e.peak_bytes > 0
    moved = set(switches.moved_categories(cfg, "cuda").values())
    copies = set(switches.host_copies(cfg, "cuda", e.model_states))
    assert moved | copies <= set(e.unseen), f"{switch.key}: what it moves off the device is reported apart"
    if moved | copies:
        assert e.host_bytes > 0


def test_every_switch_is_planned_or_says_why_not():
    for s in switches.SWITCHES:
        assert (s.candidates is None) == bool(s.not_planned), f"{s.key}: plan it (candidates) or say why not"
        if s.candidates is not None:
            assert s.cost is not None, f"{s.key}: planned without a cost rule"


def test_plan_settings_start_with_the_config_s_own_and_never_repeat():
    cfg = load_config(None, ["device=cuda"], needs_weights=False)
    space = switches.PlanSpace(cuda=True, world_size=1, dtypes=(cfg.dtype,), qlora_possible=False)
    settings = switches.plan_settings(cfg, space)
    first = switches.with_values(cfg, settings[0])
    assert switches.values(first, 1) == switches.values(cfg, 1)
    assert len({repr(sorted(s.items())) for s in settings}) == len(settings)


# ----------------------------------------------------------------------------------------------------------------
# (d) documented
# ----------------------------------------------------------------------------------------------------------------


def test_every_switch_and_optimizer_is_documented():
    text = (DOCS / "memory.md").read_text() + (DOCS / "distributed.md").read_text()
    for s in switches.SWITCHES:
        assert f"`{s.key}" in text, f"{s.key}: no line in docs/memory.md or docs/distributed.md"
        assert s.doc and s.applied, s.key
    memory = (DOCS / "memory.md").read_text()
    for o in optimizers.OPTIMIZERS:
        assert f"`{o.name}`" in memory, f"optimizer {o.name}: no line in docs/memory.md"


# ----------------------------------------------------------------------------------------------------------------
# Optimizers: the closed form is the state a step leaves
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", optimizers.OPTIMIZER_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_closed_form_state_equals_the_state_a_step_leaves(name, dtype, one_thread):
    entry = optimizers.spec(name)
    pytest.importorskip(entry.library)
    mcfg = model_config("tiny")
    model = build_decoder(mcfg, seed=0).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers run unpaged on CPU, and say so
        opt = build_optimizer(model, OptimizerConfig(name=name))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    tensors = optimizers.tensor_infos(
        name,
        [
            (n, tuple(p.shape), p.element_size(), p.ndim)
            for n, p in model.named_parameters()
            if p.requires_grad
        ],
        dim=mcfg.dim,
        num_heads=mcfg.num_heads,
    )
    assert optimizer_state_bytes(opt) == entry.state(tensors)
    quantized = [n for n, p in model.named_parameters() if entry.quantizes and entry.quantizes(p.numel())]
    assert sorted(set(dict(model.named_parameters())) - set(opt.memfit_unquantized_state_params)) == sorted(
        quantized
    )


def test_every_optimizer_is_complete():
    for o in optimizers.OPTIMIZERS:
        assert o.comment and callable(o.factory), o.name
        assert o.library in ("torch", "bitsandbytes", "torchao", "apollo_torch", "adam_mini"), o.name
        assert o.update_factor > 0 and (o.cpu_update_factor is None or o.cpu_update_factor > 0), o.name
        assert set(o.hyperparameters) <= {f.name for f in dataclasses.fields(OptimizerConfig)}, o.name
        assert set(o.model_arguments) <= {f.name for f in dataclasses.fields(DecoderConfig)}, o.name
        assert set(o.implementations) <= set(optimizers.OPTIMIZER_IMPLEMENTATIONS), o.name
