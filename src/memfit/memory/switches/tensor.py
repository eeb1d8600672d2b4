"""The switch that splits every layer over ranks: ``distributed.tensor_parallel`` (Megatron-LM's tensor parallelism
with sequence parallelism between the layers' halves, through ``torch.distributed.tensor.parallel``).

The entry is declared after its checks, candidates and cost (:class:`~memfit.memory.switches.base.Switch`); the
implementation is :mod:`memfit.memory.tensor_parallel`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.memory.switches.base import (
    PlanSpace,
    Refusal,
    RunConfig,
    StepTerms,
    Switch,
    Target,
    each,
    recomputed_layers,
    require,
    value_of,
)

if TYPE_CHECKING:
    from memfit.models.config import DecoderConfig

KEY = "distributed.tensor_parallel"


def tensor_parallel_elements(batch_size: int, seq_len: int, dim: int, size: int) -> int:
    """Elements one rank sends in one layer's forward: two all-gathers (before attention and the MLP) and two
    reduce-scatters (after them) of the ``(B, T, C)`` activations, each ``(N - 1) / N`` of the whole tensor in a
    ring (the backward sends as many again, with the roles swapped; a recomputed forward as many again).

    Args:
        batch_size: B.
        seq_len: T, the whole sequence (each rank holds ``T / N`` tokens of the residual stream).
        dim: C, the model width.
        size: N, ranks of the tensor-parallel group.

    Returns:
        Elements (multiply by the activation dtype's size for bytes); 0 for ``size`` 1.
    """
    if size == 1:
        return 0
    return 4 * batch_size * seq_len * dim * (size - 1) // size


def _check_tensor_parallel(cfg: RunConfig, target: Target) -> None:
    tp = cfg.distributed.tensor_parallel
    require(
        isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1, KEY, f"must be >= 1 ranks, got {tp!r}"
    )
    if tp == 1:
        return
    replicate = value_of(cfg, "distributed.replicate")
    require(
        target.world_size > 1 and target.world_size % (tp * replicate) == 0,
        KEY,
        f"{tp} ranks per tensor-parallel group"
        + (f" x {replicate} replicas" if replicate > 1 else "")
        + f" need a multiple of {tp * replicate} ranks, and the run has {target.world_size}; launch with "
        f"nproc={tp * replicate} (or a multiple: the rest is FSDP2 sharding), or set it to 1",
    )
    require(
        cfg.distributed.strategy == "fsdp2",
        KEY,
        "needs distributed.strategy=fsdp2: FSDP1 flattens each layer's weights into one buffer, which cannot hold "
        "the tensor-parallel DTensors; use fsdp2 or tensor_parallel=1",
    )
    require(
        cfg.distributed.sequence_parallel == 1,
        KEY,
        "and distributed.sequence_parallel (Ulysses) would both split each sequence over the same ranks; choose "
        "one: tensor_parallel splits the layers' weights and activations, sequence_parallel only the activations",
    )
    for key, why in (
        ("chunked_cross_entropy", "the chunked loss applies lm_head's whole weight to whole hidden states"),
        ("tiled_mlp", "the tiled MLP cuts the tokens that tensor parallelism all-gathers"),
        ("compile", "compile of the tensor-parallel layers is not tested on memfit's CPU tier"),
        ("activation_offloading", "offloading DTensor activations is not tested (it needs CUDA)"),
    ):
        require(
            not value_of(cfg, key),
            KEY,
            f"does not work with {key}: {why}. Tensor parallelism already splits the loss over the vocabulary and "
            f"the MLP's hidden units; set {key} off or tensor_parallel=1",
        )
    require(
        cfg.method in ("full", "lora"),
        KEY,
        f"does not work with method={cfg.method}: "
        + (
            "QLoRA's NF4 weights are not split into DTensor rows and columns"
            if cfg.method == "qlora"
            else "the adapter's prompts and gates are not split over the heads"
        )
        + "; use method=full or lora, or tensor_parallel=1",
    )


def architecture_refusal(mcfg: DecoderConfig, size: int) -> str | None:
    """Why the tensor-parallel plan cannot split an architecture ``size`` ways, or ``None`` when it can: the heads
    (``num_heads`` and ``num_kv_heads`` divisible by ``size``), a mixture of experts, q/k norms over the whole
    projection (OLMoE's). Config validation refuses with it, and so does
    :func:`memfit.memory.tensor_parallel.apply_tensor_parallel`."""
    if mcfg.num_heads % size or mcfg.num_kv_heads % size:
        return (
            f"the model's num_heads {mcfg.num_heads} and num_kv_heads {mcfg.num_kv_heads} must both be divisible "
            f"by tensor_parallel {size}: each rank computes num_heads / {size} query heads and num_kv_heads / "
            f"{size} key/value heads; use a common divisor of them"
        )
    if mcfg.num_experts is not None:
        return (
            "a mixture of experts is not split by tensor parallelism (its stacked experts and router are not "
            "sharded over the group); shard it with FSDP2 alone (tensor_parallel=1)"
        )
    if mcfg.qk_norm and not mcfg.qk_norm_per_head:
        return (
            "the model's q/k norms span the whole projection (OLMoE's), which needs every head on one rank; use "
            "tensor_parallel=1"
        )
    return None


def _check_tensor_parallel_model(cfg: RunConfig, mcfg: DecoderConfig) -> None:
    tp = cfg.distributed.tensor_parallel
    if tp == 1:
        return
    refusal = architecture_refusal(mcfg, tp)
    require(refusal is None, KEY, refusal or "")


def _plan_tensor_parallel(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    """The config's own, then every T > 1 dividing ``world_size`` and both of the model's head counts."""
    own = cfg.distributed.tensor_parallel
    if space.world_size == 1:
        return ({},)
    nh, nkv = space.num_heads, space.num_kv_heads
    sizes = [
        n
        for n in range(2, space.world_size + 1)
        if space.world_size % n == 0 and nh % n == 0 and nkv and nkv % n == 0
    ]
    return each(KEY, (own, 1, *sizes))


def _cost_tensor_parallel(tp: int, t: StepTerms) -> None:
    """Each rank computes ``1 / tp`` of every matmul of the step (its heads, its hidden units, its vocabulary
    columns) and all-gathers / reduce-scatters the ``(B, T, C)`` activations around attention and the MLP of every
    layer, in the forward, the backward and a recomputed forward (:func:`tensor_parallel_elements`), plus the
    embedding's reduce-scatter and ``lm_head``'s all-gather; none of it overlaps compute."""
    if tp > 1:
        m, cfg = t.mcfg, t.cfg
        seq_len = t.tokens // (cfg.batch_size * cfg.gradient_accumulation_steps)  # the whole sequence, T
        t.tokens //= tp
        layers = m.num_layers
        recomputed = recomputed_layers(layers, cfg)
        per_layer = tensor_parallel_elements(cfg.batch_size, seq_len, m.dim, tp)
        ends = 2 * (per_layer // 4)  # the embedding's and lm_head's, forward and backward
        width = 4 if cfg.dtype == "fp32" else 2
        t.exchanged_bytes += int(
            ((2 * layers + recomputed) * per_layer + ends) * width * cfg.gradient_accumulation_steps
        )


TENSOR_PARALLEL = Switch(
    key=KEY,
    applied="build: memfit.memory.tensor_parallel.apply_tensor_parallel (torch.distributed.tensor.parallel); "
    "step: loss_parallel over the vocabulary; data: a tensor-parallel group shares its sequences",
    check=_check_tensor_parallel,
    check_model=_check_tensor_parallel_model,
    activation=True,
    candidates=_plan_tensor_parallel,
    sharded_only=True,
    label=lambda v, cfg: f"tp={v}" if v > 1 else "",
    comment=lambda v: (
        f"each layer split over {v} ranks (heads, MLP units, vocabulary): 1/{v} of its weights and activations, "
        f"2 all-gathers + 2 reduce-scatters of (B, T, C) a layer"
        if v > 1
        else ""
    ),
    cost=_cost_tensor_parallel,
    refusals=(
        Refusal({KEY: 0}, "must be >= 1 ranks, got 0"),
        Refusal({KEY: 2}, "2 ranks per tensor-parallel group need a multiple of 2 ranks"),
        Refusal({KEY: 2, "distributed.strategy": "fsdp1"}, "needs distributed.strategy=fsdp2", world_size=2),
        Refusal(
            {KEY: 2, "distributed.sequence_parallel": 2},
            "and distributed.sequence_parallel (Ulysses) would both split",
            world_size=4,
        ),
        Refusal(
            {KEY: 2, "chunked_cross_entropy": 4}, "does not work with chunked_cross_entropy", world_size=2
        ),
        Refusal({KEY: 2, "tiled_mlp": 4}, "does not work with tiled_mlp", world_size=2),
        Refusal({KEY: 2, "compile": True}, "does not work with compile", world_size=2),
        Refusal(
            {KEY: 2, "activation_offloading": True, "device": "cuda"},
            "does not work with activation_offloading",
            world_size=2,
        ),
        Refusal({KEY: 2, "method": "qlora"}, "does not work with method=qlora", world_size=2),
        Refusal({KEY: 2, "method": "adapter"}, "does not work with method=adapter", world_size=2),
        Refusal({KEY: 3}, "the model's num_heads 8 and num_kv_heads", world_size=3),
    ),
    no_parity="sharded: tests/test_tensor_parallel.py compares 4 ranks (tp=2 x fsdp 2, tp=4) with one process",
    doc="split every layer over T ranks (Megatron-LM): heads and MLP units column/row-wise, the residual stream "
    "along the sequence, the loss over the vocabulary",
)
