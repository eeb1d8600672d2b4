"""The switches that split the work of a sequence: the loss in chunks (``chunked_cross_entropy``), the MLP in tiles
(``tiled_mlp``) and the sequence over ranks (``distributed.sequence_parallel``, DeepSpeed-Ulysses).

Each entry is declared after its checks, candidates and cost (:class:`~memfit.memory.switches.base.Switch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.memory.switches.base import (
    Parity,
    PlanSpace,
    Refusal,
    RunConfig,
    StepTerms,
    Switch,
    Target,
    auto_or_count,
    each,
    not_with_fsdp1,
    recomputed_layers,
    require,
    when,
    within_tokens,
)
from memfit.models import peft

if TYPE_CHECKING:
    from memfit.models.config import DecoderConfig


# ----------------------------------------------------------------------------------------------------------------
# chunked_cross_entropy
# ----------------------------------------------------------------------------------------------------------------


PLAN_CHUNKS = (0, 8)
"""``chunked_cross_entropy`` values the planner tries; ``auto`` in place of 8 where 8 chunks would hold more
logits each than ``auto``'s (long sequences, large vocabularies: :func:`_plan_chunks`)."""
AUTO_CHUNK_LOGITS = 2**25
"""The most logits of one chunk of ``chunked_cross_entropy: auto`` (:func:`memfit.memory.techniques.loss_chunks`)."""
AUTO_CHUNK_TOKENS = 2048
"""The most tokens of one chunk of ``chunked_cross_entropy: auto``, whatever the vocabulary (a small one would
otherwise make chunks of 16K tokens and more, whose logits grow with the sequence up to there)."""


def _check_chunks(cfg: RunConfig, target: Target) -> None:
    auto_or_count(cfg.chunked_cross_entropy, "chunked_cross_entropy", "chunks")
    not_with_fsdp1(
        cfg,
        target,
        "chunked_cross_entropy",
        "the loss applies lm_head's weight after the model's forward, where FSDP1 has put its flat shard back in "
        "place of the gathered weight. Use distributed.strategy=fsdp2 (which keeps the root's weights gathered "
        "until the backward) or chunked_cross_entropy=0",
    )


def _plan_chunks(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    values = list(PLAN_CHUNKS)
    if space.tokens * space.vocab_size > 8 * AUTO_CHUNK_LOGITS:
        values = [0, "auto"]
    return each("chunked_cross_entropy", (cfg.chunked_cross_entropy, *values))


def defers_head_gradient(cfg: RunConfig, mcfg: Any, world_size: int) -> bool:
    """Whether a run makes the chunked loss's ``lm_head`` weight gradient at the end of the backward (one more
    ``lm_head`` forward; :class:`memfit.memory.techniques.DeferredWeightGradient`): a full fine-tune or
    pretraining of an untied head, the optimizer stepping in the backward, one process."""
    return bool(
        cfg.chunked_cross_entropy
        and cfg.optimizer_in_backward
        and cfg.method == "full"
        and not mcfg.tie_word_embeddings
        and world_size == 1
    )


def _cost_chunks(chunks: int, t: StepTerms) -> None:
    if chunks:
        t.per_token += t.constants["chunked_ce_extra_head_forwards"] * t.flops["head"]
        if defers_head_gradient(t.cfg, t.mcfg, t.world_size):  # the deferred gradient recomputes the logits
            t.per_token += t.flops["head"]


_CHUNKED_LOSS = 5e-6
_CHUNKED_WHY = (
    "the loss and its gradients summed chunk by chunk, in another order: a few float32 ulps of a loss near 5.5 "
    "(4.8e-7 each; over 12 steps on tiny-gemma3 1.4e-6 seen on one CPU, 2.4e-6 on an AMD EPYC, whose kernels "
    "round otherwise)"
)
CHUNKED_CROSS_ENTROPY = Switch(
    key="chunked_cross_entropy",
    baseline=0,
    record="chunked_cross_entropy",
    applied="step: memfit.memory.techniques.chunked_cross_entropy (fused linear cross-entropy)",
    check=_check_chunks,
    check_model=within_tokens("chunked_cross_entropy", "chunks", " (4-16 is typical), or auto"),
    activation=True,
    candidates=_plan_chunks,
    label=lambda v, cfg: f"ce={v}" if v else "",
    comment=when("never materialise the whole (B, T, vocab) logits"),
    cost=_cost_chunks,
    refusals=(
        Refusal({"chunked_cross_entropy": -1}, "must be >= 0 chunks (0 is off) or auto, got -1"),
        Refusal({"chunked_cross_entropy": "many"}, "must be >= 0 chunks (0 is off) or auto, got 'many'"),
        Refusal(
            {"chunked_cross_entropy": 4, "distributed.strategy": "fsdp1"},
            "does not work with distributed.strategy=fsdp1: the loss",
            world_size=2,
        ),
        Refusal({"chunked_cross_entropy": 100_000}, "100000 chunks exceed the 4096 tokens of a micro-batch"),
    ),
    parity=(
        Parity({"chunked_cross_entropy": 4}, _CHUNKED_LOSS, why=_CHUNKED_WHY),
        Parity({"chunked_cross_entropy": "auto"}, _CHUNKED_LOSS, why=_CHUNKED_WHY),
    ),
    doc="the loss in chunks of tokens: the (B, T, vocab_size) logits never exist; auto bounds a chunk's logits",
)


# ----------------------------------------------------------------------------------------------------------------
# tiled_mlp
# ----------------------------------------------------------------------------------------------------------------


PLAN_TILES = (0, "auto")
"""``tiled_mlp`` values the planner tries."""
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


def _check_tiled(cfg: RunConfig, target: Target) -> None:
    auto_or_count(cfg.tiled_mlp, "tiled_mlp", "tiles")
    _check_tiled_compiled(cfg, target)
    not_with_fsdp1(
        cfg,
        target,
        "tiled_mlp",
        "FSDP1 gives the MLP's weights to the forward as views of its flat parameter, not as the module's "
        "parameters, so the tiles' recomputation in the backward cannot return their gradients. Use "
        "distributed.strategy=fsdp2 or tiled_mlp=0",
    )


def _check_tiled_compiled(cfg: RunConfig, target: Target) -> None:
    dropout_inside = (
        cfg.method in peft.LORA_METHODS
        and cfg.lora.dropout > 0
        and any(m in MLP_PROJECTIONS for m in cfg.lora.target_modules)
    )
    require(
        not (cfg.tiled_mlp and cfg.compile and dropout_inside),
        "tiled_mlp",
        "with compile cannot replay LoRA's dropout inside the MLP: the tiles recomputed in the backward would draw "
        "other dropout masks than the forward's, which a compiled graph cannot rewind. Set lora.dropout=0, leave "
        "gate_proj/up_proj/down_proj out of lora.target_modules, or turn compile or tiled_mlp off",
    )


def _cost_tiled(tiles: int | str, t: StepTerms) -> None:
    """Each tile's forward again in the backward: one more MLP forward, but in a layer that full (or every_n)
    checkpointing recomputes, whose recomputation then skips the MLP (memfit.memory.tiled): no more there."""
    if tiles:
        m, cfg = t.mcfg, t.cfg
        recomputed = recomputed_layers(m.num_layers, cfg)  # selective recomputes no matmul
        t.per_token += t.flops["mlp"] * (m.num_layers - recomputed) / m.num_layers


TILED_MLP = Switch(
    key="tiled_mlp",
    baseline=0,
    record="tiled_mlp",
    applied="build: memfit.memory.tiled.apply_tiled_mlp",
    check=_check_tiled,
    check_model=within_tokens("tiled_mlp", "tiles", ", or auto (tiles of about dim tokens)"),
    activation=True,
    candidates=lambda cfg, space: each("tiled_mlp", (cfg.tiled_mlp, *PLAN_TILES)),
    label=lambda v, cfg: "" if not v else ("tiled" if v == "auto" else f"tiled={v}"),
    comment=when("the MLP in tiles of ~dim tokens, each recomputed in backward (free with ac=full)"),
    cost=_cost_tiled,
    refusals=(
        Refusal({"tiled_mlp": -2}, "must be >= 0 tiles (0 is off) or auto, got -2"),
        Refusal(
            {"tiled_mlp": 4, "distributed.strategy": "fsdp1"},
            "does not work with distributed.strategy=fsdp1: FSDP1 gives",
            world_size=2,
        ),
        Refusal({"tiled_mlp": 5000}, "5000 tiles exceed the 4096 tokens of a micro-batch"),
        Refusal(
            {
                "tiled_mlp": 2,
                "compile": True,
                "method": "lora",
                "lora.target_modules": "[q_proj,up_proj]",
            },
            "with compile cannot replay LoRA's dropout inside the MLP",
        ),
    ),
    parity=(
        Parity(
            {"tiled_mlp": 4},
            1e-5,
            why="the MLP's weight gradients add up over the tiles in another order (~1e-7 relative a step)",
        ),
        Parity({"tiled_mlp": "auto", "activation_checkpointing": "full"}, 1e-5, why="as tiled_mlp=4"),
    ),
    doc="the SwiGLU MLP tile by tile over the tokens, each tile recomputed in backward (auto: ~dim tokens a tile)",
)


# ----------------------------------------------------------------------------------------------------------------
# distributed.sequence_parallel
# ----------------------------------------------------------------------------------------------------------------


def kv_heads_sent(num_kv_heads: int, size: int) -> int:
    """Key/value heads each rank exchanges: ``num_kv_heads``, or ``size`` when each is repeated to fill the group.

    Raises:
        ValueError: ``num_kv_heads`` and ``size`` divide neither way.
    """
    if num_kv_heads % size == 0:
        return num_kv_heads
    if size % num_kv_heads == 0:
        return size
    raise ValueError(f"num_kv_heads {num_kv_heads} and sequence_parallel {size}: neither divides the other")


def all_to_all_elements(
    batch_size: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, size: int
) -> int:
    """Elements one rank sends (and receives) in one layer's forward: ``(N - 1) / N`` of its query, key, value and
    attention-output shards (the backward exchanges as many again, a recomputed forward as many again).

    Args:
        batch_size: B.
        seq_len: T, the whole sequence (each rank holds ``T / size`` tokens).
        num_heads: nh.
        num_kv_heads: nkv (repeated to ``size`` heads when fewer, :func:`kv_heads_sent`).
        head_dim: hd.
        size: N, ranks of the sequence-parallel group.

    Returns:
        Elements (multiply by the activation dtype's size for bytes); 0 for ``size`` 1.
    """
    if size == 1:
        return 0
    heads = 2 * num_heads + 2 * kv_heads_sent(num_kv_heads, size)  # q and the output; k and v
    return batch_size * (seq_len // size) * heads * head_dim * (size - 1) // size


def _check_sequence_parallel(cfg: RunConfig, target: Target) -> None:
    sp, key = cfg.distributed.sequence_parallel, "distributed.sequence_parallel"
    require(
        isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1, key, f"must be >= 1 ranks, got {sp!r}"
    )
    if sp == 1:
        return
    require(
        target.world_size % sp == 0 and target.world_size > 1,
        key,
        f"{sp} ranks per sequence need a multiple of {sp} ranks, and the run has {target.world_size}; launch with "
        f"nproc={sp} (or a multiple: the rest is data parallel), or set it to 1",
    )
    require(
        cfg.distributed.strategy == "fsdp2",
        key,
        "needs distributed.strategy=fsdp2: FSDP1 flattens each layer's weights into one buffer, and the attention "
        "exchange is written for FSDP2's per-parameter sharding",
    )
    if cfg.seq_len:  # else the model's max_seq_len, checked with the architecture
        _require_sequence_divides(cfg.seq_len, sp)


def _require_sequence_divides(seq_len: int, sp: int) -> None:
    require(
        seq_len % sp == 0,
        "distributed.sequence_parallel",
        f"seq_len {seq_len} is not divisible by {sp}: each rank holds seq_len / {sp} tokens; use a seq_len that "
        f"is a multiple of {sp}",
    )


def _check_sequence_parallel_model(cfg: RunConfig, mcfg: DecoderConfig) -> None:
    sp, key = cfg.distributed.sequence_parallel, "distributed.sequence_parallel"
    if sp == 1:
        return
    require(
        mcfg.num_heads % sp == 0,
        key,
        f"the model's num_heads {mcfg.num_heads} is not divisible by {sp}: each rank attends with num_heads / "
        f"{sp} heads; use a divisor of {mcfg.num_heads}",
    )
    require(
        mcfg.num_kv_heads % sp == 0 or sp % mcfg.num_kv_heads == 0,
        key,
        f"the model's num_kv_heads {mcfg.num_kv_heads} and {sp} divide neither way: key/value heads are split over "
        f"the ranks or repeated to fill them",
    )
    _require_sequence_divides(cfg.seq_len or mcfg.max_seq_len, sp)


def _plan_sequence_parallel(cfg: RunConfig, space: PlanSpace) -> tuple[dict[str, Any], ...]:
    """The config's own, then every N > 1 dividing ``world_size`` and the model's heads (as Ulysses needs)."""
    key, own = "distributed.sequence_parallel", cfg.distributed.sequence_parallel
    if space.world_size == 1:
        return ({},)
    nh, nkv = space.num_heads, space.num_kv_heads
    sizes = [
        n
        for n in range(2, space.world_size + 1)
        if space.world_size % n == 0 and nh % n == 0 and (nkv % n == 0 or n % nkv == 0)
    ]
    return each(key, (own, 1, *sizes))


def _cost_sequence_parallel(sp: int, t: StepTerms) -> None:
    """Each rank computes ``1 / sp`` of the step (its tokens' linear work, its heads' attention over whole
    sequences) and exchanges q, k, v and the attention output around every layer's attention: in the forward, in
    the backward, and again in a recomputed forward (:func:`all_to_all_elements`)."""
    if sp > 1:
        m, cfg = t.mcfg, t.cfg
        seq_len = t.tokens // (cfg.batch_size * cfg.gradient_accumulation_steps)  # the whole sequence, T
        t.tokens //= sp
        layers = m.num_layers
        recomputed = recomputed_layers(layers, cfg)  # selective keeps the attention output
        passes = 2 * layers + recomputed
        per_layer = all_to_all_elements(cfg.batch_size, seq_len, m.num_heads, m.num_kv_heads, m.head_dim, sp)
        width = 4 if cfg.dtype == "fp32" else 2
        t.exchanged_bytes += int(passes * per_layer * width * cfg.gradient_accumulation_steps)


SEQUENCE_PARALLEL = Switch(
    key="distributed.sequence_parallel",
    applied="build: memfit.memory.ulysses.apply_sequence_parallel (Ulysses all-to-all around attention); data: "
    "memfit.memory.ulysses.shard_batch (each rank's slice of its group's sequences)",
    check=_check_sequence_parallel,
    check_model=_check_sequence_parallel_model,
    activation=True,
    candidates=_plan_sequence_parallel,
    sharded_only=True,
    label=lambda v, cfg: f"sp={v}" if v > 1 else "",
    comment=lambda v: (
        f"each sequence split over {v} ranks: an all-to-all around attention, 1/{v} of the activations"
        if v > 1
        else ""
    ),
    cost=_cost_sequence_parallel,
    refusals=(
        Refusal({"distributed.sequence_parallel": 0}, "must be >= 1 ranks, got 0"),
        Refusal({"distributed.sequence_parallel": 2}, "2 ranks per sequence need a multiple of 2 ranks"),
        Refusal(
            {"distributed.sequence_parallel": 2, "distributed.strategy": "fsdp1"},
            "needs distributed.strategy=fsdp2",
            world_size=2,
        ),
        Refusal(
            {"distributed.sequence_parallel": 2, "seq_len": 255},
            "seq_len 255 is not divisible by 2",
            world_size=2,
        ),
        Refusal(
            {"distributed.sequence_parallel": 3, "seq_len": 255},
            "the model's num_heads 8 is not divisible by 3",
            world_size=3,
        ),
    ),
    no_parity="sharded: tests/test_sequence_parallel.py compares 2 ranks (sp=2) with one process",
    doc="split each sequence over N ranks (DeepSpeed-Ulysses): an all-to-all exchanges tokens for heads around "
    "attention",
)
