"""The switches of how the step runs: ``activation_offloading`` (saved tensors in host memory) and ``compile``.

Each entry is declared after its checks, candidates and cost (:class:`~memfit.memory.switches.base.Switch`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

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
    check_nothing,
    each,
    flag,
    require,
    value_of,
    when,
)

# ----------------------------------------------------------------------------------------------------------------
# activation_offloading
# ----------------------------------------------------------------------------------------------------------------


def _plan_bool(key: str, *, cuda_only: bool = False) -> Callable[[RunConfig, PlanSpace], tuple[dict, ...]]:
    def plan(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
        if cuda_only and not space.cuda:
            return ({},)
        return each(key, (value_of(cfg, key), False, True))

    return plan


def _prune_offloading(settings: dict[str, Any], cfg: RunConfig) -> bool:
    """Offload activations with full checkpointing only, or as ``cfg`` has it: offloading every saved tensor moves
    ~34 x ``dim`` bytes per token and layer (Korthikanti et al. 2022), which the cost model makes 10-20x slower
    than recomputing them at Llama widths 4096-8192, for about the same device memory."""
    ac, off = settings["activation_checkpointing"], settings["activation_offloading"]
    own = (ac, off) == (cfg.activation_checkpointing, cfg.activation_offloading)
    return off and ac != "full" and not own


def _cost_activation_offloading(on: bool, t: StepTerms) -> None:
    # unconditional: the caller passes the offloaded bytes (0 unless the run offloads on CUDA); out in the forward
    # and back in the backward on a side stream, overlapping the layers' compute, but for the first layer's copy
    # back at the start of the backward, which nothing was prefetched ahead of
    t.overlapped_bytes += 2 * t.offloaded_activation_bytes
    t.moved_bytes += t.offloaded_activation_bytes // t.mcfg.num_layers


ACTIVATION_OFFLOADING = Switch(
    key="activation_offloading",
    baseline=False,
    record="activation_offloading",
    applied="build: memfit.memory.offload.apply_activation_offloading (OffloadSavedTensors around each "
    "decoder layer: saved-tensor hooks to pinned host memory, a side stream, one ahead)",
    check=check_nothing,
    offloads_activations=True,
    activation=True,
    candidates=_plan_bool("activation_offloading", cuda_only=True),
    prune=_prune_offloading,
    label=flag("act_offload"),
    comment=when("saved activations (with ac=full: the checkpoints) in pinned host memory, overlapped"),
    cost=_cost_activation_offloading,
    parity=(
        Parity(
            {"activation_offloading": True, "activation_checkpointing": "full"},
            EXACT,
            why="on CPU nothing moves (the host is the device): the hooks run and hand each tensor back",
        ),
    ),
    doc="tensors saved for backward (with ac=full: the layers' inputs) in pinned host memory, back one ahead",
)


# ----------------------------------------------------------------------------------------------------------------
# compile
# ----------------------------------------------------------------------------------------------------------------


def cxx_compiler() -> str | None:
    """The C++ compiler TorchInductor would build CPU kernels with: ``$CXX``, else ``g++``, else ``clang++`` (its
    path), or ``None`` when there is none."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _check_compile(cfg: RunConfig, target: Target) -> None:
    require(
        not (cfg.compile and cfg.track_memory),
        "compile",
        "cannot be combined with track_memory: the tracker sees each tensor through a dispatch mode, which "
        "compiled kernels bypass. Track the eager step (compile=false), or predict it with `memfit estimate`",
    )
    require(
        not (cfg.compile and target.device == "cpu") or cxx_compiler() is not None,
        "compile",
        "needs a C++ compiler on CPU (TorchInductor builds its CPU kernels with one) and none was found: install "
        "g++ or clang++, name yours in $CXX, or set compile=false",
    )
    require(
        not (cfg.compile and cfg.activation_offloading),
        "compile",
        "cannot be combined with activation_offloading: its saved-tensor hooks move tensors between devices "
        "inside the graph the compiler captures. Turn one of them off",
    )
    require(
        not (target.sharded and cfg.compile and cfg.distributed.strategy == "fsdp1"),
        "compile",
        "does not work with distributed.strategy=fsdp1, which flattens each layer's parameters into one buffer "
        "outside the compiled graph. Use distributed.strategy=fsdp2 (compiled layers are then sharded "
        "per layer, as torchtitan does) or compile=false",
    )


_COMPILED = Parity(
    {"compile": "true"},
    1e-5,
    why="TorchInductor's fused fp32 reductions add in another order than the eager kernels (~1e-7 relative per "
    "op; ten steps carry it to at most ~1e-6 of the loss)",
)


def _cost_compile(on: bool, t: StepTerms) -> None:
    if not on:
        return
    t.matmul_flops_per_second *= t.constants["compiled_compute_speedup"]
    cfg = t.cfg
    if optimizers.step_compiled(
        cfg.optimizer.name,
        cfg.optimizer.implementation,
        in_backward=cfg.optimizer_in_backward,
        sharded=t.world_size > 1,
    ):
        t.update_factor *= t.constants["compiled_update_factor"]
        t.per_tensor = False  # one generated kernel a tensor, no launches of ~10 eager ones


COMPILE = Switch(
    key="compile",
    applied="build: memfit.build.build_training (torch.compile per decoder layer); step: the loss",
    check=_check_compile,
    trace_value=False,
    refusals=(  # and, on a CPU without a C++ compiler, "needs a C++ compiler on CPU"
        Refusal({"compile": True, "track_memory": True}, "cannot be combined with track_memory"),
        Refusal(
            {"compile": True, "activation_offloading": True, "device": "cuda"},
            "cannot be combined with activation_offloading",
        ),
        Refusal(
            {"compile": True, "distributed.strategy": "fsdp1"},
            "does not work with distributed.strategy=fsdp1, which flattens",
            world_size=2,
        ),
    ),
    parity=(_COMPILED,),
    cost=_cost_compile,
    not_planned="the estimate traces the eager step (an upper bound of the compiled one), and what compiling "
    "saves is measured on CPU only (memfit.planner.cost): a compiled config is priced, not proposed",
    doc="torch.compile each decoder layer and the loss (the estimator traces the eager step, an upper bound)",
)
