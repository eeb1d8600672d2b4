"""The switches of what trains and in which precision: ``method`` (full, LoRA, QLoRA, adapter) and ``dtype``.

Each entry is declared after its checks, candidates and cost (:class:`~memfit.memory.switches.base.Switch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.errors import ConfigError
from memfit.memory import optimizers, rounding
from memfit.memory.switches.base import (
    DTYPES,
    METHODS,
    Parity,
    PlanSpace,
    Refusal,
    RunConfig,
    StepTerms,
    Switch,
    Target,
    check_nothing,
    checkpointed_layers,
    each,
    require,
)
from memfit.models import nf4 as nf4_format
from memfit.models import peft

if TYPE_CHECKING:
    from memfit.models.config import DecoderConfig


def layer_weights(mcfg: DecoderConfig, active: bool = False) -> float:
    """Weights of one decoder layer's linears: q, k, v, o projections and the SwiGLU MLP's gate, up and down (the
    weights QLoRA stores in NF4, :data:`memfit.models.peft.QLORA_QUANTIZED`); a mixture of experts' every expert
    (as stored and dequantized), or with ``active`` those a token computes with (averaged over the layers)."""
    d, hd = mcfg.dim, mcfg.head_dim
    return 2 * d * mcfg.num_heads * hd + 2 * d * mcfg.num_kv_heads * hd + mcfg.mlp_weights(active)


def dequantize_passes(cfg: RunConfig, num_layers: int) -> float:
    """How many times a step dequantizes each NF4 weight of QLoRA, averaged over the layers (0 for other methods).

    Per micro-batch: once in the forward and once in the backward (the input gradient; frozen weights have no weight
    gradient), and once more in the recomputed forward of a checkpointed layer (``full``: every layer;
    ``every_n``: every n-th; ``selective`` recomputes no matmul, so no dequantization).
    """
    if cfg.method != "qlora":
        return 0.0
    recomputed = 0
    if cfg.activation_checkpointing != "selective":
        recomputed = len(
            checkpointed_layers(
                num_layers, cfg.activation_checkpointing, cfg.activation_checkpointing_interval
            )
        )
    return cfg.gradient_accumulation_steps * (2 + recomputed / num_layers)


# ----------------------------------------------------------------------------------------------------------------
# method
# ----------------------------------------------------------------------------------------------------------------


def _check_method(cfg: RunConfig, target: Target) -> None:
    require(
        not (target.sharded and cfg.method == "qlora" and cfg.distributed.strategy == "fsdp1"),
        "method",
        "qlora does not work with distributed.strategy=fsdp1: FSDP1 flattens a unit's weights into one buffer of "
        "one dtype, which cannot hold NF4 weights. Use distributed.strategy=fsdp2 (which shards torchao's NF4 "
        "tensors as they are)",
    )
    require(
        not (cfg.method in peft.LORA_METHODS and cfg.lora.target_parameters and cfg.lora.dropout > 0),
        "lora.dropout",
        f"must be 0 with lora.target_parameters (got {cfg.lora.dropout}): a LoRA on a stacked expert weight has "
        "no dropout, as PEFT's target_parameters has none (PEFT could not load the adapter). Set lora.dropout=0",
    )


def _check_method_model(cfg: RunConfig, mcfg: DecoderConfig) -> None:
    if cfg.method == "qlora":
        hd = mcfg.head_dim
        block = nf4_format.NF4_BLOCK_SIZE
        shapes = {
            "q_proj/o_proj": (mcfg.num_heads * hd, mcfg.dim),
            "k_proj/v_proj": (mcfg.num_kv_heads * hd, mcfg.dim),
            "gate_proj/up_proj/down_proj": (mcfg.intermediate_size, mcfg.dim),
        }
        for names, (rows, cols) in shapes.items():
            require(
                rows * cols % block == 0,
                "method",
                f"qlora stores each decoder linear in NF4 blocks of {block} weights, but {names} have "
                f"{rows} x {cols} weights, not a multiple of {block}; use method=lora for this model",
            )
    if cfg.method in peft.LORA_METHODS and "lm_head" in cfg.lora.target_modules and mcfg.tie_word_embeddings:
        raise ConfigError(
            "config key 'lora.target_modules': this model ties lm_head to the input embedding, so a LoRA update "
            "of lm_head would also change the embedding when merged; leave lm_head out"
        )
    if cfg.method in peft.LORA_METHODS and cfg.lora.target_parameters and not mcfg.num_moe_layers:
        raise ConfigError(
            f"config key 'lora.target_parameters': adapts a mixture of experts' stacked weights "
            f"({', '.join(cfg.lora.target_parameters)}), but this {mcfg.family} model has none; use "
            "lora.target_modules"
        )
    if cfg.method == "adapter" and cfg.adapter.num_layers > mcfg.num_layers:
        raise ConfigError(
            f"config key 'adapter.num_layers': {cfg.adapter.num_layers} exceeds the model's {mcfg.num_layers} "
            f"layers; use at most {mcfg.num_layers} (0 adapts all)"
        )


def _plan_method(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    lora_to_qlora = cfg.method == "lora" and space.qlora_possible
    return each("method", (cfg.method, "qlora") if lora_to_qlora else (cfg.method,))


def _cost_method(method: str, t: StepTerms) -> None:
    if method == "qlora":
        elements = dequantize_passes(t.cfg, t.mcfg.num_layers) * t.mcfg.num_layers * layer_weights(t.mcfg)
        t.dequantize_bytes = elements * t.constants["nf4_dequantize_bytes_per_element"][t.cfg.dtype]


METHOD = Switch(
    key="method",
    record="method",
    applied=(
        "build: memfit.build.build_model (memfit.models.peft.apply_lora / apply_qlora, "
        "memfit.models.adapter.apply_adapter)"
    ),
    check=_check_method,
    choices=METHODS,
    check_model=_check_method_model,
    activation=True,
    candidates=_plan_method,
    label=lambda v, cfg: "" if v == "full" else v,
    comment=lambda v: {
        "lora": "LoRA: only the low-rank adapters train; the base stays in the parameter dtype",
        "qlora": "LoRA over an NF4 base: ~0.52 B per frozen linear weight, dequantized in every forward/backward",
    }.get(v, ""),
    in_yaml=lambda cfg: cfg.method != "full",  # the default: a pretraining plan's config stays as it was
    cost=_cost_method,
    refusals=(
        Refusal(
            {"method": "qlora", "distributed.strategy": "fsdp1"}, "qlora does not work with", world_size=2
        ),
        Refusal(
            {
                "method": "qlora",
                "model_args.dim": 36,
                "model_args.num_heads": 2,
                "model_args.num_kv_heads": 1,
            },
            "qlora stores each decoder linear in NF4 blocks of 64 weights, but q_proj/o_proj have 36 x 36",
        ),
        Refusal(
            {
                "method": "lora",
                "lora.target_modules": "[q_proj,lm_head]",
                "model_args.tie_word_embeddings": True,
            },
            "this model ties lm_head to the input embedding",
            key="lora.target_modules",
        ),
        Refusal(
            {"method": "lora", "lora.target_parameters": "[mlp.experts.down_proj]"},
            "must be 0 with lora.target_parameters",
            key="lora.dropout",
        ),
        Refusal(
            {"method": "lora", "lora.target_parameters": "[mlp.experts.down_proj]", "lora.dropout": 0},
            "adapts a mixture of experts' stacked weights (mlp.experts.down_proj), but this llama model has none",
            key="lora.target_parameters",
        ),
        Refusal(
            {"method": "adapter", "adapter.num_layers": 99},
            "99 exceeds the model's 6",
            key="adapter.num_layers",
        ),
    ),
    no_parity="fine-tuning methods train other weights than the baseline; tests/models/test_peft.py and "
    "test_qlora.py compare them with Hugging Face PEFT",
    doc="full, lora, qlora (LoRA over a 4-bit NormalFloat base) or adapter",
)


# ----------------------------------------------------------------------------------------------------------------
# dtype
# ----------------------------------------------------------------------------------------------------------------


def _cost_dtype(dtype: str, t: StepTerms) -> None:
    t.matmul_flops_per_second = t.constants["matmul_flops_per_second"][dtype]


DTYPE = Switch(
    key="dtype",
    record="dtype",
    applied="build: memfit.build.PARAM_DTYPES; step: memfit.step.autocast_context (bf16_mixed)",
    check=check_nothing,
    choices=DTYPES,
    activation=True,
    candidates=lambda cfg, space: each("dtype", space.dtypes),
    label=lambda v, cfg: v,
    comment=lambda v: {
        "bf16": "weights, gradients and optimizer state bf16 (loss in fp32)",
        "bf16_mixed": "fp32 weights, gradients and state; forward/backward under bf16 autocast",
        "fp32": "everything fp32",
    }[v],
    cost=_cost_dtype,
    parity=(
        Parity(
            {"dtype": "bf16"},
            0.03,
            relative=True,
            why="bf16 rounds weights, activations and updates to "
            "8 bits of mantissa (2**-8 relative), compounding over steps",
        ),
        Parity({"dtype": "bf16_mixed"}, 0.02, relative=True, why="bf16 matmuls under autocast"),
    ),
    doc="fp32, bf16 (weights, gradients, state in bf16) or bf16_mixed (fp32 states, bf16 autocast)",
)


# ----------------------------------------------------------------------------------------------------------------
# bf16_rounding
# ----------------------------------------------------------------------------------------------------------------

ROUNDING_UPDATE_FACTOR = {
    "cpu": {"nearest": 1.0, "stochastic": 4.8, "kahan": 1.75},
    "cuda": {"nearest": 1.0, "stochastic": 3.3, "kahan": 3.0},
}
"""The optimizer update's time under each ``bf16_rounding``, as a multiple of its time rounding to nearest, by
target. cpu: measured (``bench/bf16_rounding.py --part update``: torch AdamW's step of a 4,096 x 4,096 bf16 weight,
0.026 s to nearest, 4.80x stochastic, whose random draws dominate, 1.75x kahan; torchao's 4-bit update, 1.07 s,
unchanged within 7%). cuda: counted, not measured: the memory-bound update moves 14 bytes per bf16 parameter
(read p, g, m, v; write p, m, v); the fp32 copy, the random int32 and the write back add ~32 bytes (stochastic),
the compensation's read, sum and write ~28 (kahan)."""


def _check_bf16_rounding(cfg: RunConfig, target: Target) -> None:
    if cfg.dtype != "bf16" or cfg.bf16_rounding in ("nearest", "auto"):  # auto takes what the optimizer can
        return
    require(
        not cfg.optimizer.cpu_offload,
        "bf16_rounding",
        f"{cfg.bf16_rounding} cannot be combined with optimizer.cpu_offload: the offloaded update runs on the "
        f"host's fp32 copy of each weight (torchao CPUOffloadOptimizer), which is not rounded. Use "
        f"bf16_rounding=nearest with the offload, or turn it off",
    )
    reason = optimizers.rounding_refusal(cfg.optimizer.name, target.device, cfg.bf16_rounding)
    require(reason is None, "bf16_rounding", str(reason))


def resolved_rounding(cfg: RunConfig, target: str, world_size: int = 1) -> str:
    """The rounding ``cfg``'s bf16 weights take on ``target`` over ``world_size`` ranks (``auto`` resolved:
    :func:`memfit.memory.optimizers.resolve_rounding`)."""
    return optimizers.resolve_rounding(
        cfg.bf16_rounding,
        cfg.optimizer.name,
        target,
        cfg.dtype,
        cpu_offload=cfg.optimizer.cpu_offload,
        sharded=world_size > 1,
    )


def _cost_bf16_rounding(setting: str, t: StepTerms) -> None:
    rounding = resolved_rounding(t.cfg, t.target, t.world_size)
    if rounding != "nearest":
        t.update_factor *= ROUNDING_UPDATE_FACTOR[t.target][rounding]
        t.per_tensor = True  # one optimizer per parameter (memfit.memory.optim.rounded_step)


BF16_ROUNDING = Switch(
    key="bf16_rounding",
    record="bf16_rounding",
    applied="optimizer: memfit.memory.optim.rounded_step (memfit.memory.rounding; torchao's and bitsandbytes' "
    "chunked updates round each chunk themselves)",
    check=_check_bf16_rounding,
    choices=rounding.BF16_ROUNDINGS,
    cost=_cost_bf16_rounding,
    not_planned="a choice of quality, not of memory: the plan keeps the config's and prices it (the trace sees "
    "its fp32 chunk and Kahan's buffer, the cost model its time)",
    refusals=(
        Refusal(
            {
                "dtype": "bf16",
                "bf16_rounding": "kahan",
                "optimizer.name": "adamw",
                "optimizer.cpu_offload": True,
                "max_grad_norm": 0,
                "device": "cuda",
            },
            "kahan cannot be combined with optimizer.cpu_offload",
        ),
    ),
    parity=(
        Parity(
            {"dtype": "bf16", "bf16_rounding": "stochastic"},
            0.03,
            relative=True,
            why="bf16 weights, each update rounded up or down at random (unbiased) instead of to nearest",
        ),
        Parity(
            {"dtype": "bf16", "bf16_rounding": "kahan"},
            0.03,
            relative=True,
            why="bf16 weights with a bf16 compensation buffer: about 16 bits of mantissa between the two",
        ),
    ),
    doc="nearest, stochastic or kahan: how a bf16 weight takes its fp32-computed update (dtype=bf16 only)",
)
