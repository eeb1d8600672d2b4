"""The switches of the optimizer step: ``optimizer.name`` (its entries: :mod:`memfit.memory.optimizers`),
``optimizer.implementation``, ``optimizer_in_backward`` and ``optimizer.cpu_offload``.

Each entry is declared after its checks, candidates and cost (:class:`~memfit.memory.switches.base.Switch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memfit.memory import optimizers
from memfit.memory.switches.base import (
    EXACT,
    Parity,
    PlanSpace,
    Refusal,
    RunConfig,
    StepTerms,
    Switch,
    Target,
    flag,
    host_on_cuda,
    moves_state,
    require,
    value_of,
    when,
)


def _plan_unclipped(key: str) -> Callable[[RunConfig, PlanSpace], tuple[dict[str, Any], ...]]:
    """Off and on (with ``max_grad_norm=0``, which it needs, unless ``cfg`` has it on already)."""

    def plan(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
        own = value_of(cfg, key)
        # the planner never changes the batch of a step: in backward only when there is nothing to accumulate
        on = key != "optimizer_in_backward" or cfg.gradient_accumulation_steps == 1
        values = (own, False) + ((True,) if on else ())
        return tuple(
            {key: v, **({"max_grad_norm": 0.0} if v and not own else {})} for v in dict.fromkeys(values)
        )

    return plan


# ----------------------------------------------------------------------------------------------------------------
# optimizer.name
# ----------------------------------------------------------------------------------------------------------------


def _check_optimizer_name(cfg: RunConfig, target: Target) -> None:
    opt = cfg.optimizer
    reason = optimizers.check_optimizer_supported(
        opt.name,
        target.device,
        cpu_offload=opt.cpu_offload,
        in_backward=cfg.optimizer_in_backward,
        max_grad_norm=cfg.max_grad_norm,
    )
    require(
        reason is None,
        "optimizer.cpu_offload" if opt.cpu_offload and reason and "offload" in reason else "optimizer.name",
        str(reason),
    )
    if target.sharded:
        reason = optimizers.sharded_refusal(opt.name, strategy=cfg.distributed.strategy, dtype=cfg.dtype)
        require(reason is None, "optimizer.name", str(reason))


def _plan_optimizer(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    """``cfg``'s optimizer, then the registry's planned ones that keep its update rule, or those the user allows
    (``space.optimizers``, any update rule); paged ones only on CUDA, where paging differs; AdamW with ``cfg``'s
    implementation and ``fused``."""
    pairs = [(cfg.optimizer.name, cfg.optimizer.implementation)]
    rule = optimizers.spec(cfg.optimizer.name).update_rule
    for spec in optimizers.OPTIMIZERS:
        allowed = (
            spec.planned and spec.update_rule == rule
            if space.optimizers is None
            else spec.name in space.optimizers
        )
        if not allowed or (spec.paged and not space.cuda):
            continue  # on CPU paged state is ordinary memory: the same as the unpaged optimizer
        impls = (cfg.optimizer.implementation,) + (("fused",) if "fused" in spec.implementations else ())
        pairs += [(spec.name, impl) for impl in impls]
    return tuple(
        {"optimizer.name": name, "optimizer.implementation": impl} for name, impl in dict.fromkeys(pairs)
    )


def _device_of(cfg: RunConfig) -> str:
    """``cpu`` or ``cuda``: where ``cfg.device`` puts the run (``auto``: CUDA when torch sees one)."""
    if cfg.device in ("cpu", "cuda"):
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _prune_rounding(view: dict[str, Any], cfg: RunConfig) -> bool:
    """Skip a combination whose bf16 weights would round to nearest where the config's round better: the plan
    trades memory for speed, never the weights' updates (``auto`` takes stochastic rounding wherever the optimizer
    can; bitsandbytes on CUDA and ``optimizer.cpu_offload`` cannot)."""
    if view.get("dtype") != "bf16":
        return False
    device = _device_of(cfg)
    own = optimizers.resolve_rounding(
        cfg.bf16_rounding, cfg.optimizer.name, device, "bf16", cpu_offload=cfg.optimizer.cpu_offload
    )
    planned = optimizers.resolve_rounding(
        cfg.bf16_rounding,
        view["optimizer.name"],
        device,
        "bf16",
        cpu_offload=bool(view.get("optimizer.cpu_offload")),
    )
    return own != "nearest" and planned == "nearest"


def _label_optimizer(name: str, cfg: RunConfig) -> str:
    spec = optimizers.spec(name)
    return f"{name}:{cfg.optimizer.implementation}" if spec.implementations else name


def _cost_optimizer(name: str, t: StepTerms) -> None:
    t.update_factor = t.constants["optimizer_update_factor"].get(name, 1.0)
    t.moved_bytes += 2 * t.paged_out_bytes


OPTIMIZER_NAME = Switch(
    key="optimizer.name",
    baseline="adamw",
    record="optimizer",
    applied="optimizer: memfit.memory.optim.build_optimizer (entries: memfit.memory.optimizers.OPTIMIZERS)",
    check=_check_optimizer_name,
    choices=optimizers.OPTIMIZER_NAMES,
    candidates=_plan_optimizer,
    prune=_prune_rounding,
    label=_label_optimizer,
    comment=lambda v: optimizers.spec(v).comment if v in optimizers.OPTIMIZER_NAMES else "",
    cost=_cost_optimizer,
    refusals=(
        Refusal(
            {"optimizer.name": "paged_adamw8bit"},
            "'paged_adamw8bit' (bitsandbytes) does not",
            world_size=2,
        ),
        Refusal(
            {"optimizer.name": "torchao_adamw8bit", "dtype": "bf16"},
            "'torchao_adamw8bit' with",
            world_size=2,
        ),
        Refusal(
            {"optimizer.name": "torchao_adamw4bit", "distributed.strategy": "fsdp1"},
            "'torchao_adamw4bit' does not work with distributed.strategy=fsdp1",
            world_size=2,
        ),
        Refusal(
            {"optimizer.name": "muon", "distributed.strategy": "fsdp1"},
            "'muon' does not work with distributed.strategy=fsdp1",
            world_size=2,
        ),
        Refusal({"optimizer.name": "apollo_mini"}, "'apollo_mini' does not work sharded", world_size=2),
        Refusal({"optimizer.name": "adafactor"}, "'adafactor' does not work sharded", world_size=2),
    ),
    parity=(
        Parity(
            {"optimizer.name": "adamw8bit"},
            0.02,
            relative=True,
            why="8-bit block-wise state quantizes m and v: updates differ by a few percent",
        ),
    ),
    doc="the optimizer and the bytes of state it keeps (memfit.memory.optimizers)",
)


# ----------------------------------------------------------------------------------------------------------------
# optimizer.implementation
# ----------------------------------------------------------------------------------------------------------------


def _check_implementation(cfg: RunConfig, target: Target) -> None:
    known = optimizers.spec(cfg.optimizer.name).implementations
    require(
        not known or cfg.optimizer.implementation in known,
        "optimizer.implementation",
        f"{cfg.optimizer.implementation!r} is not one of {cfg.optimizer.name}'s: {', '.join(known)}",
    )


def _changed_implementation(cfg: RunConfig, base: RunConfig) -> bool:
    if not optimizers.spec(cfg.optimizer.name).implementations:
        return False  # only AdamW has implementations
    return cfg.optimizer.implementation != base.optimizer.implementation


def _cost_implementation(impl: str, t: StepTerms) -> None:
    if optimizers.spec(t.cfg.optimizer.name).implementations and impl == "for_loop":
        t.per_tensor = True


OPTIMIZER_IMPLEMENTATION = Switch(
    key="optimizer.implementation",
    baseline="fused",
    record="optimizer_implementation",
    applied="optimizer: memfit.memory.optim.build_optimizer (torch.optim.AdamW foreach / for_loop / fused)",
    check=_check_implementation,
    choices=optimizers.OPTIMIZER_IMPLEMENTATIONS,
    candidates=lambda cfg, space: ({},),  # planned in pairs with optimizer.name (_plan_optimizer)
    changed=_changed_implementation,
    in_yaml=lambda cfg: bool(optimizers.spec(cfg.optimizer.name).implementations),
    comment=lambda v: {
        "fused": "one fused kernel: fewest temporaries, fastest",
        "foreach": "multi-tensor: one parameter-sized set of temporaries at the step",
        "for_loop": "one tensor at a time",
    }[v],
    cost=_cost_implementation,
    refusals=(
        Refusal(
            {"optimizer.name": "adafactor", "optimizer.implementation": "fused"},
            "'fused' is not one of adafactor's: foreach, for_loop",
        ),
    ),
    parity=(
        Parity({"optimizer.implementation": "for_loop"}, EXACT),
        Parity({"optimizer.implementation": "fused"}, EXACT),
    ),
    doc="AdamW's foreach (multi-tensor), for_loop (one tensor at a time) or fused kernel",
)


# ----------------------------------------------------------------------------------------------------------------
# optimizer_in_backward
# ----------------------------------------------------------------------------------------------------------------


def _check_in_backward(cfg: RunConfig, target: Target) -> None:
    if cfg.optimizer_in_backward:
        require(
            cfg.gradient_accumulation_steps == 1,
            "optimizer_in_backward",
            "needs gradient_accumulation_steps=1: each update runs as soon as a parameter's gradient of one "
            "micro-batch is ready, so gradients cannot accumulate over micro-batches; raise batch_size instead",
        )
        require(
            cfg.max_grad_norm == 0,
            "optimizer_in_backward",
            "cannot clip by the global gradient norm (max_grad_norm > 0): each parameter is updated before the "
            "other gradients exist. Set max_grad_norm=0 (grad_norm is still reported) or turn the switch off",
        )
    require(
        not (target.sharded and cfg.optimizer_in_backward and cfg.distributed.strategy == "fsdp1"),
        "optimizer_in_backward",
        "does not work with distributed.strategy=fsdp1: FSDP1 reduces gradients into flat shards after autograd "
        "has run the per-parameter hooks, so the updates would see unreduced gradients. Use "
        "distributed.strategy=fsdp2 (which runs the hooks after its reduce-scatter) or turn the switch off",
    )


def _cost_in_backward(on: bool, t: StepTerms) -> None:
    if on:
        t.per_tensor = True


OPTIMIZER_IN_BACKWARD = Switch(
    key="optimizer_in_backward",
    baseline=False,
    record="optimizer_in_backward",
    applied="optimizer: memfit.memory.optim.OptimizerInBackward (per-parameter updates in backward hooks)",
    check=_check_in_backward,
    activation=True,
    candidates=_plan_unclipped("optimizer_in_backward"),
    label=flag("in_bwd"),
    comment=when("no gradient memory; needs gradient_accumulation_steps == 1"),
    cost=_cost_in_backward,
    refusals=(
        Refusal({"optimizer_in_backward": True}, "cannot clip by the global gradient norm"),
        Refusal(
            {"optimizer_in_backward": True, "max_grad_norm": 0, "gradient_accumulation_steps": 2},
            "needs gradient_accumulation_steps=1",
        ),
        Refusal(
            {"optimizer_in_backward": True, "max_grad_norm": 0, "distributed.strategy": "fsdp1"},
            "does not work with distributed.strategy=fsdp1: FSDP1 reduces",
            world_size=2,
        ),
    ),
    parity=(Parity({"optimizer_in_backward": "true"}, EXACT),),
    doc="each parameter's update runs in backward as soon as its gradient is ready, then the gradient is freed",
)


# ----------------------------------------------------------------------------------------------------------------
# optimizer.cpu_offload
# ----------------------------------------------------------------------------------------------------------------


def _check_optimizer_offload(cfg: RunConfig, target: Target) -> None:
    # the device and the combinations with the optimizer: optimizers.check_optimizer_supported (optimizer.name)
    require(
        not (target.sharded and cfg.optimizer.cpu_offload),
        "optimizer.cpu_offload",
        "is not supported sharded; use distributed.cpu_offload, which offloads the shards and their optimizer "
        "step to the host",
    )


def _cost_optimizer_offload(on: bool, t: StepTerms) -> None:
    if on:
        t.host_update = True
        t.moved_bytes += 2 * t.states["trainable_parameters"]  # gradients out, updated parameters in


OPTIMIZER_CPU_OFFLOAD = Switch(
    key="optimizer.cpu_offload",
    baseline=False,
    record="optimizer_cpu_offload",
    applied="optimizer: memfit.memory.optim.build_optimizer (torchao CPUOffloadOptimizer)",
    check=_check_optimizer_offload,
    trace_value=False,
    moves=moves_state,
    # torchao CPUOffloadOptimizer: a pinned host copy of every trainable parameter and of its gradient
    host_bytes=host_on_cuda(
        {"host_parameter_copies": "trainable_parameters", "host_gradient_copies": "gradients"}
    ),
    candidates=_plan_unclipped("optimizer.cpu_offload"),
    label=flag("opt_offload"),
    comment=when("state and update on the host (torchao CPUOffloadOptimizer)"),
    cost=_cost_optimizer_offload,
    refusals=(  # the device and the optimizer: optimizers.check_optimizer_supported, via optimizer.name's check
        Refusal(
            {"optimizer.cpu_offload": True, "max_grad_norm": 0},
            "optimizer.cpu_offload moves optimizer state",
        ),
        Refusal(
            {
                "optimizer.cpu_offload": True,
                "max_grad_norm": 0,
                "device": "cuda",
                "optimizer.name": "paged_adamw",
            },
            "optimizer.cpu_offload cannot be combined with 'paged_adamw'",
        ),
        Refusal(
            {
                "optimizer.cpu_offload": True,
                "max_grad_norm": 0,
                "device": "cuda",
                "optimizer_in_backward": True,
            },
            "optimizer.cpu_offload cannot be combined with optimizer_in_backward",
        ),
        Refusal(
            {"optimizer.cpu_offload": True, "device": "cuda"},
            "optimizer.cpu_offload cannot clip gradients",
        ),
        Refusal(
            {"optimizer.cpu_offload": True, "max_grad_norm": 0, "device": "cuda"},
            "is not supported sharded",
            world_size=2,
        ),
    ),
    no_parity="CUDA only (torchao's CPUOffloadOptimizer); not run on CPU",
    doc="optimizer state and the update on the host (CUDA only)",
)
