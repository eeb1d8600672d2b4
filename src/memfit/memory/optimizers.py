"""The optimizers behind ``optimizer.name``, one declared entry each: what every layer of memfit needs to know of one.

An :class:`Optimizer` entry holds the factory of its class (what :func:`memfit.memory.optim.build_optimizer`
constructs) and its library, the keyword arguments it takes, the bytes of state it keeps in closed form
(:attr:`Optimizer.state`, which :func:`memfit.planner.closed_form.model_state_bytes_closed_form` sums and
``tests/memory/test_switches.py`` holds against the real state), which tensors it keeps unquantized, whether it
pages its state and supports ``implementation``, where it runs (sharded, CUDA capability), its share of the
planner's cost model (:attr:`Optimizer.update_factor`) and its one-line comment in ``memfit plan``'s YAML.

=====================  ==================================================================================
``adamw``              torch.optim.AdamW: m and v in the parameter dtype (8 bytes/parameter in fp32).
``adamw8bit``          bitsandbytes AdamW8bit: m and v as 8-bit codes with one fp32 absmax per 256 values
                       (~2.03 bytes/parameter); tensors of fewer than 4,096 elements keep fp32 state.
``paged_adamw8bit``    as ``adamw8bit``, and on CUDA the state of tensors of >= 100,000 elements lives in
                       unified (managed) memory that the driver pages out to host RAM under memory pressure.
                       On CPU it runs unpaged (a warning says so).
``paged_adamw``        bitsandbytes 32-bit AdamW (8 bytes/parameter), paged as above.
``lion8bit``           bitsandbytes Lion8bit (Chen et al. 2023, "Symbolic Discovery of Optimization
                       Algorithms"): one moment as 8-bit codes (~1.02 bytes/parameter); small tensors fp32.
``torchao_adamw8bit``  torchao AdamW8bit: 8-bit codes, one fp32 scale per 256 values and a 256-entry fp32
                       code table per state tensor; tensors of fewer than 4,096 elements, or whose size is
                       not a multiple of 256, keep unquantized state in the parameter dtype.
``torchao_adamw4bit``  torchao AdamW4bit: 4-bit codes (two per byte), one fp32 scale per 128 values
                       (~1.06 bytes/parameter); threshold 4,096 elements and a multiple of 128.
``torchao_adamw_fp8``  torchao AdamWFp8: float8 e4m3 codes, one fp32 scale per 256 values; threshold as
                       ``torchao_adamw8bit``. On CUDA it needs compute capability >= 8.9.
``muon``               torch.optim.Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu et al.
                       2025) on the hidden matrices: one momentum buffer (4 bytes/parameter in fp32), the
                       update orthogonalised by a Newton-Schulz iteration; the embedding, ``lm_head`` and
                       1-D tensors on torch AdamW, as in nanochat, Moonlight and torchtitan.
``adafactor``          torch.optim.Adafactor (Shazeer and Stern 2018): a factored second moment (a row and a
                       column vector per matrix, a full one per 1-D tensor), no first moment, a 4-byte step.
``apollo``             APOLLO (Zhu et al., MLSys 2025; ``apollo-torch``, the authors' package) on the hidden
                       matrices: AdamW moments of a random rank-r projection of the gradient (r x n or m x r
                       each) and the r x n (m x r) projection; channel-wise scaling. Other tensors: its AdamW.
``apollo_mini``        APOLLO-Mini: as ``apollo`` with rank 1 and one tensor-wise scale (~0 bytes/parameter).
``adam_mini``          Adam-mini (Zhang et al., ICLR 2025; ``adam-mini``, the authors' package): AdamW's first
                       moment and one second-moment value per block: per head for q/k, per row (output
                       neuron, token) for the other matrices, per tensor for 1-D ones (~4 bytes/parameter).
=====================  ==================================================================================

Which trainable tensors each algorithm of a hybrid takes (Muon, APOLLO, Adam-mini's blocks) is decided here,
once, by :func:`part_of`: the training banner, the optimizer's parameter groups and the closed form all read it.

Adding an optimizer is one entry in :data:`OPTIMIZERS`, its factory included; ``tests/memory/test_switches.py``
checks its closed form against a real step and its line in docs/memory.md.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from memfit.memory import adafactor, bnb_cpu, hybrids
from memfit.memory.hybrids import projection_rank as apollo_rank  # APOLLO's rule, where its class is
from memfit.quiet import quiet_bitsandbytes_import, quiet_torchao_import

OPTIMIZER_IMPLEMENTATIONS = ("foreach", "for_loop", "fused")
"""``optimizer.implementation`` values (torch AdamW's ``foreach`` / ``fused`` flags)."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps 32-bit state for tensors with fewer elements than this (its ``min_8bit_size``)."""
BNB_PAGED_MIN_NUMEL = 100_000
"""bitsandbytes' paged optimizers page the state of tensors of at least this many elements (its
``get_state_buffer``); smaller tensors' state, every absmax and the code tables are ordinary device memory."""
TORCHAO_MIN_QUANTIZED_SIZE = 4096
"""torchao keeps unquantized state for tensors with fewer elements than this (hard-coded in its ``_new_buffer``)."""


class TensorInfo(NamedTuple):
    """One trainable tensor of one rank, as the closed forms of :attr:`Optimizer.state` see it."""

    numel: int
    """Elements of this rank's part of it."""
    size: int
    """Bytes per element (the parameter dtype's)."""
    shape: tuple[int, ...] = ()
    """This rank's shape of it (``()``: not known; only the optimizers that factor or project need it)."""
    part: str = ""
    """Which algorithm of the optimizer takes it (:func:`part_of`): ``muon`` / ``apollo`` / ``adamw`` for the
    hybrids, ``heads`` / ``rows`` / ``tensor`` for Adam-mini's blocks, else the optimizer's name."""
    blocks: int = 0
    """APOLLO: the projection rank r of this matrix; Adam-mini: its number of second-moment values."""


Tensors = list[TensorInfo]
"""Trainable tensors of one rank."""


# ----------------------------------------------------------------------------------------------------------------
# State in closed form, by library
# ----------------------------------------------------------------------------------------------------------------


def _torch_adamw_state(tensors: Tensors) -> int:
    """Two moments in the parameter dtype and a 4-byte fp32 ``step`` tensor per parameter."""
    return sum(2 * t.numel * t.size + 4 for t in tensors)


def _muon_state(tensors: Tensors) -> int:
    """torch Muon: one momentum buffer in the parameter dtype per matrix (no ``step``); torch AdamW for the rest."""
    return sum(t.numel * t.size if t.part == "muon" else 2 * t.numel * t.size + 4 for t in tensors)


def _adafactor_state(tensors: Tensors) -> int:
    """torch Adafactor: a 4-byte fp32 ``step`` per tensor; for a tensor of >= 2 dims a row vector (``numel /
    shape[-1]`` elements) and a column vector (``numel / shape[-2]``) of the second moment, else a full one, in the
    parameter dtype."""
    total = 0
    for t in tensors:
        if len(t.shape) >= 2:
            total += 4 + (t.numel // t.shape[-1] + t.numel // t.shape[-2]) * t.size
        else:
            total += 4 + t.numel * t.size
    return total


def _apollo_state(tensors: Tensors) -> int:
    """APOLLO: for a projected m x n matrix of rank r, the projection (r x n when m >= n, else m x r) and AdamW's
    two moments of the projected gradient (m x r, else r x n), and a 0-dim norm (``scaled_grad``), all in the
    parameter dtype; its AdamW for the rest (two full moments; ``step`` and ``seed`` are Python numbers)."""
    total = 0
    for t in tensors:
        if t.part == "apollo":
            (m, n), r = t.shape, t.blocks
            projection, projected = (r * n, m * r) if m >= n else (m * r, r * n)
            total += (projection + 2 * projected + 1) * t.size
        else:
            total += 2 * t.numel * t.size
    return total


def _adam_mini_state(tensors: Tensors) -> int:
    """Adam-mini: the first moment in the parameter dtype, and one second-moment value per block (``blocks``) in
    the parameter dtype; its counters are Python numbers."""
    return sum((t.numel + t.blocks) * t.size for t in tensors)


def _bnb_state(moments: int, bits: int) -> Callable[[Tensors], int]:
    """bitsandbytes: ``moments`` fp32 moments per tensor (``bits`` 32), or block-wise 8-bit ones for tensors of >=
    :data:`BNB_MIN_8BIT_SIZE` elements: ``moments`` uint8 codes and one fp32 absmax per 256-element block each,
    plus ``moments`` 256-entry fp32 quantization maps shared by all tensors; no ``step`` tensor (it is kept in the
    param group)."""

    def state(tensors: Tensors) -> int:
        total = 0
        if bits == 8 and any(t.numel >= BNB_MIN_8BIT_SIZE for t in tensors):
            total += moments * 256 * 4
        for numel, *_ in tensors:
            if bits == 8 and numel >= BNB_MIN_8BIT_SIZE:
                total += moments * (numel + -(-numel // 256) * 4)
            else:
                total += moments * numel * 4
        return total

    return state


def _torchao_state(code_bits: int, block: int, table_entries: int) -> Callable[[Tensors], int]:
    """torchao low-bit AdamW: tensors of >= :data:`TORCHAO_MIN_QUANTIZED_SIZE` elements whose size is a multiple of
    ``block`` keep two moments of ``code_bits``-bit codes with one fp32 scale per block each and their own copy of
    the code table (``table_entries`` fp32 entries per moment); others keep moments in the parameter dtype. Every
    tensor has a 4-byte ``step``."""

    def state(tensors: Tensors) -> int:
        total = 0
        for numel, size, *_ in tensors:
            if _torchao_quantizes(block)(numel):
                total += int(2 * numel * code_bits / 8) + 2 * (numel // block) * 4 + 4 + 2 * table_entries * 4
            else:
                total += 2 * numel * size + 4
        return total

    return state


def _bnb_quantizes(numel: int) -> bool:
    return numel >= BNB_MIN_8BIT_SIZE


def _torchao_quantizes(block: int) -> Callable[[int], bool]:
    return lambda numel: numel >= TORCHAO_MIN_QUANTIZED_SIZE and numel % block == 0


# ----------------------------------------------------------------------------------------------------------------
# Where they run, by library
# ----------------------------------------------------------------------------------------------------------------


def _bnb_sharded(name: str, strategy: str, dtype: str) -> str | None:
    return (
        f"{name!r} (bitsandbytes) does not work sharded: its kernels take plain tensors, not the "
        f"DTensor shards FSDP2 gives the optimizer. Use torchao_adamw8bit or torchao_adamw4bit (the same "
        f"block-wise quantized AdamW state, DTensor-aware) with distributed.strategy=fsdp2"
    )


def _torchao_sharded(name: str, strategy: str, dtype: str) -> str | None:
    if dtype == "bf16":
        return (
            f"{name!r} with dtype=bf16 fails on FSDP2's bf16 shards (torchao's quantized update mixes a "
            f"bf16 shard with fp32 state: 'expected dtype torch.bfloat16 for end'). Use dtype=bf16_mixed (fp32 shards, "
            f"bf16 compute) or torchao with one process"
        )
    if strategy == "fsdp1":
        return (
            f"{name!r} does not work with distributed.strategy=fsdp1: FSDP1's checkpoints concatenate "
            f"optimizer state, which torchao's quantized state tensors do not support. Use distributed.strategy=fsdp2"
        )
    return None


def _reshaping_sharded(name: str, strategy: str, dtype: str) -> str | None:
    """Muon and Adam-mini need each tensor's shape: FSDP1 flattens a unit's parameters into one 1-D buffer (their
    shapes are gone). FSDP2 keeps DTensor shards of the real shapes, whose whole-matrix operations (Muon's
    Newton-Schulz products, Adam-mini's block norms) DTensor gathers or reduces over the ranks, as torchtitan's
    distributed Muon gathers each matrix: ``tests/test_distributed.py`` holds them equal to one process."""
    if strategy == "fsdp1":
        return (
            f"{name!r} does not work with distributed.strategy=fsdp1: FSDP1 flattens each unit's parameters into "
            f"one 1-D buffer, so the matrix shapes {name} works on are gone. Use distributed.strategy=fsdp2"
        )
    return None


def _adafactor_sharded(name: str, strategy: str, dtype: str) -> str | None:
    return (
        f"{name!r} does not work sharded: torch's Adafactor updates its factored second moment in place from row "
        f"and column norms, which on FSDP2's DTensor shards are partial sums over the ranks that DTensor cannot "
        f"update in place ('in-place operations that require placement changes are not supported'); FSDP1 "
        f"flattens the matrices it factors. Use adam_mini or muon sharded, or adafactor in one process"
    )


def _apollo_sharded(name: str, strategy: str, dtype: str) -> str | None:
    return (
        f"{name!r} does not work sharded: APOLLO (apollo-torch) projects each gradient with a plain random matrix "
        f"drawn for the parameter's shape, which cannot multiply the DTensor shard FSDP2 gives it (nor FSDP1's flat "
        f"buffer), and its scaling factors need whole rows and columns. Use muon or adam_mini (whose whole-matrix "
        f"steps DTensor gathers) or torchao_adamw4bit sharded, or apollo in one process"
    )


def _fp8_capability(device_type: str) -> str | None:
    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return (
                f"torchao_adamw_fp8 compiles float8 (e4m3) casts that need CUDA compute capability >= 8.9 "
                f"(Ada, Hopper); this GPU is {major}.{minor}. Use torchao_adamw8bit (same memory) instead"
            )
    return None


# ----------------------------------------------------------------------------------------------------------------
# Which algorithm takes which tensor
# ----------------------------------------------------------------------------------------------------------------


def parameter_role(param_name: str, ndim: int) -> str:
    """What a trainable tensor is to an optimizer that treats tensors apart.

    Args:
        param_name: its name in ``named_parameters`` (Hugging Face layout: ``model.embed_tokens.weight``,
            ``lm_head.weight``, ``model.layers.0.self_attn.q_proj.weight``, ``...q_proj.lora_A``).
        ndim: its number of dimensions (before FSDP1 flattens it).

    Returns:
        ``embedding``, ``output`` (``lm_head``), ``matrix`` (any other 2-D tensor: a decoder layer's projections,
        LoRA's A and B, the adapter's prompt), ``experts`` (a mixture of experts' stacked (E, m, n) matrices,
        which Muon and APOLLO leave to AdamW) or ``vector`` (norm weights, the adapter's gates).
    """
    if ndim == 3:
        return "experts"
    if ndim != 2:
        return "vector"
    if param_name.endswith("embed_tokens.weight"):
        return "embedding"
    if param_name.endswith("lm_head.weight"):
        return "output"
    return "matrix"


def _hidden_matrices(algorithm: str) -> Callable[[str, int], str]:
    """Muon's and APOLLO's split: the hidden matrices to ``algorithm``, the embedding, ``lm_head`` and 1-D tensors
    to AdamW (Jordan et al. 2024; torchtitan, nanochat; APOLLO's ``attn``/``mlp`` target modules)."""
    return lambda name, ndim: algorithm if parameter_role(name, ndim) == "matrix" else "adamw"


def _adam_mini_blocks(name: str, ndim: int) -> str:
    """Adam-mini's partition (Zhang et al. 2025, section 3): query and key weights by head, other matrices by row
    (an output neuron; a token for the embedding and ``lm_head``), every 1-D tensor as one block."""
    if parameter_role(name, ndim) == "matrix" and name.endswith(("q_proj.weight", "k_proj.weight")):
        return "heads"
    return "rows" if ndim == 2 else "tensor"


def part_of(optimizer: str, param_name: str, ndim: int) -> str:
    """Which algorithm of ``optimizer`` takes a trainable tensor: THE split of the hybrids, which the parameter
    groups, the training banner and the closed form all read.

    Returns:
        ``muon`` / ``apollo`` / ``adamw`` for ``muon``, ``apollo``, ``apollo_mini``; ``heads`` / ``rows`` /
        ``tensor`` for ``adam_mini``; ``optimizer`` itself for the others.
    """
    entry = spec(optimizer)
    return entry.partition(param_name, ndim) if entry.partition is not None else optimizer


def tensor_infos(
    optimizer: str,
    params: Iterable[tuple[str, tuple[int, ...], int, int]],
    *,
    rank: int = 0,
    dim: int = 0,
    num_heads: int = 1,
    head_dim: int | None = None,
) -> Tensors:
    """The trainable tensors of one rank as the closed forms see them.

    Args:
        optimizer: ``optimizer.name``.
        params: ``(name, this rank's shape, element size, ndim before any flattening)`` per trainable tensor.
        rank: ``optimizer.apollo_rank`` (0: the variant's default).
        dim: the model width (APOLLO's default rank, Adam-mini's head size ``dim * dim / num_heads``).
        num_heads: the model's query heads.
        head_dim: the size of one head (Adam-mini's q/k blocks are ``head_dim x dim``); default
            ``dim // num_heads``.

    Returns:
        One :class:`TensorInfo` each, in ``params`` order.
    """
    out = []
    for name, shape, size, ndim in params:
        part = part_of(optimizer, name, ndim)
        numel = math.prod(shape)
        blocks = 0
        if part == "apollo":
            blocks = apollo_rank(optimizer, rank, dim, shape)
        elif part == "heads":
            blocks = numel // (dim * (head_dim or dim // num_heads))
        elif part == "rows":
            blocks = shape[0]
        elif part == "tensor":
            blocks = 1
        out.append(TensorInfo(numel, size, tuple(shape), part, blocks))
    return out


def _newton_schulz_flops(tensors: Tensors, settings: Any) -> float:
    """Muon's Newton-Schulz iteration on each m x n matrix (m <= n after a transpose): per step X X^T (2 m^2 n),
    the quintic's A A (2 m^3) and B X (2 m^2 n) FLOPs."""
    total = 0.0
    for t in tensors:
        if t.part == "muon":
            m, n = sorted(t.shape)
            total += settings.ns_steps * (4.0 * m * m * n + 2.0 * m**3)
    return total


def _newton_schulz_dtype(settings: Any, device_type: str, dtype: str) -> str:
    """Muon's iteration runs in ``optimizer.muon_ns_dtype`` (``auto``: as :func:`memfit.memory.hybrids.
    newton_schulz_dtype` resolves it for ``device_type`` on this machine), whatever the parameters' dtype."""
    resolved = hybrids.newton_schulz_dtype(getattr(settings, "muon_ns_dtype", "auto"), device_type)
    return "bf16" if resolved == torch.bfloat16 else "fp32"


def _parameter_dtype(settings: Any, device_type: str, dtype: str) -> str:
    """APOLLO projects in the parameters' dtype: bf16 under ``dtype: bf16``, fp32 under ``fp32`` and
    ``bf16_mixed`` (fp32 parameters)."""
    return "bf16" if dtype == "bf16" else "fp32"


def _projection_flops(tensors: Tensors, settings: Any) -> float:
    """APOLLO's projection of each m x n gradient to rank r: one (m x n) by (n x r) product, 2 m n r FLOPs."""
    return sum(2.0 * t.numel * t.blocks for t in tensors if t.part == "apollo")


# ----------------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer:
    """One ``optimizer.name``: its library call and what the config, the estimator and the planner need of it."""

    name: str
    """The ``optimizer.name`` value."""
    library: str
    """``torch``, ``bitsandbytes``, ``torchao``, ``apollo_torch`` or ``adam_mini``: the package its class comes
    from (:func:`check_optimizer_supported` says when it is not installed; the estimator's fake mode reads it)."""
    factory: Callable[[], Callable[..., torch.optim.Optimizer]]
    """Returns the class :func:`memfit.memory.optim.build_optimizer` constructs (or a callable building one),
    importing its library when first called: ``torch.optim``'s, ``bitsandbytes.optim``'s, torchao's low-bit AdamW
    made to take a float ``lr`` (:func:`memfit.memory.hybrids.low_bit_class`), or :mod:`memfit.memory.hybrids`'
    own around ``torch.optim.Muon``, ``apollo_torch.APOLLOAdamW`` and ``adam_mini.Adam_mini``."""
    state: Callable[[Tensors], int]
    """Bytes of state it keeps for trainable tensors given as ``(numel, element_size)``."""
    comment: str
    """The one line beside ``optimizer.name`` in ``memfit plan``'s YAML."""
    quantizes: Callable[[int], bool] | None = None
    """``numel -> bool``: whether a tensor of that size gets quantized state; ``None``: full-precision state."""
    hyperparameters: tuple[str, ...] = ("lr", "betas", "eps")
    """The fields of :class:`memfit.config.OptimizerConfig` passed to the class (weight decay is per group)."""
    arguments: tuple[tuple[str, str], ...] = ()
    """``(config field, keyword)`` where the class names a hyperparameter otherwise (Adafactor's ``d``)."""
    model_arguments: tuple[str, ...] = ()
    """Fields of the model's :class:`~memfit.models.decoder.DecoderConfig` passed too (``dim``, ``num_heads``, ...)."""
    update_rule: str = "adamw"
    """The update it computes (quantized or paged state computes the same one): ``memfit plan`` keeps the config's
    update rule unless ``--optimizers`` allows others."""
    partition: Callable[[str, int], str] | None = None
    """``(parameter name, ndim) -> algorithm`` for an optimizer that treats tensors apart (:func:`part_of`)."""
    update_flops: Callable[[Tensors, Any], float] | None = None
    """``(tensors, optimizer settings) -> matmul FLOPs`` of one update beyond AdamW's elementwise work (Muon's
    Newton-Schulz iteration, APOLLO's projection), charged at the matmul rate by :mod:`memfit.planner.cost`."""
    update_dtype: Callable[[Any, str, str], str] = _parameter_dtype
    """``(optimizer settings, device type, dtype policy) -> "bf16" | "fp32"``: the dtype of the matmuls of
    :attr:`update_flops`, which picks their rate (``optimizer_matmul_flops_per_second``) in the cost model."""
    implementations: tuple[str, ...] = ()
    """The ``optimizer.implementation`` values it takes; ``()``: the setting does not apply."""
    paged_bytes_per_element: int = 0
    """> 0: a paged optimizer; on CUDA the state of tensors of >= :data:`BNB_PAGED_MIN_NUMEL` elements (this many
    bytes per element) lives in unified memory, outside the caching allocator."""
    planned: bool = False
    """``memfit plan`` tries it."""
    update_factor: float = 1.0
    """Its update's time as a multiple of AdamW's at the same dtype, on CUDA (:mod:`memfit.planner.cost`)."""
    cpu_update_factor: float | None = None
    """The same on CPU; ``None``: as on CUDA."""
    sharded: Callable[[str, str, str], str | None] | None = None
    """``(name, strategy, dtype) -> why it cannot run sharded``, or ``None``; the entry itself ``None``: it can."""
    device: Callable[[str], str | None] | None = None
    """``device_type -> why it cannot run there``, or ``None`` (checked on this machine's GPU)."""
    compiled_step: bool = False
    """``compile: true`` compiles its ``step`` too (:func:`step_compiles`): a torch optimizer that TorchDynamo
    traces whole, whose per-tensor update becomes one generated kernel."""

    @property
    def paged(self) -> bool:
        return self.paged_bytes_per_element > 0

    def paged_state(self, tensors: Tensors) -> int:
        """Bytes of state a paged optimizer keeps in CUDA unified memory (0 for the others)."""
        per = self.paged_bytes_per_element
        return sum(per * t.numel for t in tensors if t.numel >= BNB_PAGED_MIN_NUMEL)


def _bitsandbytes() -> Any:
    """``bitsandbytes.optim``, imported when an entry's factory is first called (it takes seconds)."""
    with quiet_bitsandbytes_import():
        import bitsandbytes as bnb
        import bitsandbytes.backends.cpu.ops as cpu_ops

    bnb_cpu.compose_bnb_cpu_updates(bnb.functional, cpu_ops)  # CPU updates in chunks, seen by the tracker
    return bnb.optim


def _torchao() -> Any:
    """``torchao.optim``, imported when an entry's factory is first called (it takes seconds)."""
    with quiet_torchao_import():
        import torchao.optim

    return torchao.optim


_BNB_ADAMW8BIT = _bnb_state(moments=2, bits=8)
_BNB_CPU = 7.0
"""bitsandbytes' 8-bit update on CPU as a multiple of torch AdamW's modelled update (``bench/peers.py``, ``--grid
speed``, 2026-12-03): the least-memory rows (paged 8-bit in backward + checkpointing) took 0.58 s (25.6M) and 1.1 s
(78.6M) a step more than checkpointing with AdamW, against AdamW's modelled 0.07 and 0.22 s: 6.6-9x. The earlier
1.4 was the ratio of a whole step's time; it kept the plan's tokens/s 22-37% too high on those rows."""
_TORCHAO_BITS = (
    1.4  # bitsandbytes' whole 8-bit step over torch's on CPU, assumed for the update on CUDA (docs/memory.md)
)

OPTIMIZERS: tuple[Optimizer, ...] = (
    Optimizer(
        "adamw",
        "torch",
        lambda: torch.optim.AdamW,
        _torch_adamw_state,
        "torch AdamW: 2 moments in the parameter dtype",
        implementations=OPTIMIZER_IMPLEMENTATIONS,
        planned=True,
        compiled_step=True,
    ),
    Optimizer(
        "adamw8bit",
        "bitsandbytes",
        lambda: bnb_cpu.rounding_class(_bitsandbytes().AdamW8bit),
        _BNB_ADAMW8BIT,
        "bitsandbytes 8-bit AdamW: ~2 bytes/parameter of state",
        quantizes=_bnb_quantizes,
        planned=True,
        update_factor=1.4,
        cpu_update_factor=_BNB_CPU,
        sharded=_bnb_sharded,
    ),
    Optimizer(
        "paged_adamw8bit",
        "bitsandbytes",
        lambda: bnb_cpu.rounding_class(_bitsandbytes().PagedAdamW8bit),
        _BNB_ADAMW8BIT,
        "8-bit state in CUDA unified memory: the driver pages it to host RAM when short",
        quantizes=_bnb_quantizes,
        paged_bytes_per_element=2,  # such a tensor is always above bitsandbytes' 8-bit threshold
        planned=True,
        update_factor=1.4,
        cpu_update_factor=_BNB_CPU,
        sharded=_bnb_sharded,
    ),
    Optimizer(
        "paged_adamw",
        "bitsandbytes",
        lambda: bnb_cpu.rounding_class(_bitsandbytes().PagedAdamW),
        _bnb_state(moments=2, bits=32),
        "32-bit state in CUDA unified memory",
        paged_bytes_per_element=2 * 4,
        sharded=_bnb_sharded,
    ),
    Optimizer(
        "torchao_adamw8bit",
        "torchao",
        lambda: hybrids.low_bit_class(_torchao().AdamW8bit),
        _torchao_state(code_bits=8, block=256, table_entries=256),
        "torchao 8-bit AdamW: ~2 bytes/parameter of state",
        quantizes=_torchao_quantizes(256),
        planned=True,
        update_factor=_TORCHAO_BITS,
        cpu_update_factor=8.0,  # eager on CPU (docs/memory.md)
        sharded=_torchao_sharded,
    ),
    Optimizer(
        "torchao_adamw4bit",
        "torchao",
        lambda: hybrids.low_bit_class(_torchao().AdamW4bit),
        _torchao_state(code_bits=4, block=128, table_entries=16),
        "torchao 4-bit AdamW: ~1 byte/parameter of state",
        quantizes=_torchao_quantizes(128),
        planned=True,
        update_factor=_TORCHAO_BITS,
        cpu_update_factor=8.0,
        sharded=_torchao_sharded,
    ),
    Optimizer(
        "torchao_adamw_fp8",
        "torchao",
        lambda: hybrids.low_bit_class(_torchao().AdamWFp8),
        _torchao_state(code_bits=8, block=256, table_entries=0),
        "torchao fp8 AdamW state: ~2 bytes/parameter",
        quantizes=_torchao_quantizes(256),
        update_factor=_TORCHAO_BITS,
        cpu_update_factor=8.0,
        sharded=_torchao_sharded,
        device=_fp8_capability,
    ),
    Optimizer(
        "lion8bit",
        "bitsandbytes",
        lambda: bnb_cpu.rounding_class(_bitsandbytes().Lion8bit),
        _bnb_state(moments=1, bits=8),
        "bitsandbytes 8-bit Lion: one moment, ~1 byte/parameter of state",
        quantizes=_bnb_quantizes,
        hyperparameters=("lr", "betas"),  # Lion has no epsilon
        update_factor=1.4,  # bitsandbytes' 8-bit kernel, as AdamW8bit's (not measured apart)
        sharded=_bnb_sharded,
        update_rule="lion",
    ),
    Optimizer(
        "muon",
        "torch",
        lambda: hybrids.MuonWithAdamW,
        _muon_state,
        "torch Muon on the hidden matrices (one momentum buffer), AdamW on the rest",
        hyperparameters=(
            "lr",
            "betas",
            "eps",
            "momentum",
            "nesterov",
            "ns_steps",
            "adjust_lr_fn",
            "adamw_lr",
            "muon_ns_dtype",
        ),
        arguments=(("muon_ns_dtype", "ns_dtype"),),
        update_rule="muon",
        partition=_hidden_matrices("muon"),
        update_flops=_newton_schulz_flops,
        update_dtype=_newton_schulz_dtype,
        sharded=_reshaping_sharded,
    ),
    Optimizer(
        "adafactor",
        "torch",
        lambda: adafactor.Adafactor,
        _adafactor_state,
        "torch Adafactor: a factored second moment, no first moment",
        hyperparameters=("lr", "beta2_decay", "clipping_threshold"),
        arguments=(("clipping_threshold", "d"),),
        implementations=("foreach", "for_loop"),
        update_rule="adafactor",
        sharded=_adafactor_sharded,
    ),
    *(
        Optimizer(
            name,
            "apollo_torch",
            functools.partial(hybrids.apollo_variant, name),
            _apollo_state,
            comment,
            hyperparameters=("lr", "betas", "eps", "apollo_rank", "apollo_scale", "update_proj_gap"),
            model_arguments=("dim",),
            update_rule="apollo",
            partition=_hidden_matrices("apollo"),
            update_flops=_projection_flops,
            sharded=_apollo_sharded,
        )
        for name, comment in (
            (
                "apollo",
                "APOLLO: AdamW moments of a rank-r random projection of each hidden matrix's gradient",
            ),
            (
                "apollo_mini",
                "APOLLO-Mini: rank-1 projection, one scale per tensor: ~0 bytes/parameter of state",
            ),
        )
    ),
    Optimizer(
        "adam_mini",
        "adam_mini",
        hybrids.adam_mini_class,
        _adam_mini_state,
        "Adam-mini: AdamW's first moment, one second moment per head / row / tensor",
        model_arguments=("dim", "num_heads", "num_kv_heads", "head_dim"),
        update_rule="adam_mini",
        partition=_adam_mini_blocks,
        sharded=_reshaping_sharded,
    ),
)
"""Every optimizer, in the order config errors list them."""

OPTIMIZERS_BY_NAME: dict[str, Optimizer] = {o.name: o for o in OPTIMIZERS}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS_BY_NAME)
"""``optimizer.name`` values."""


_PACKAGES = {"bitsandbytes": "bitsandbytes", "apollo_torch": "apollo-torch", "adam_mini": "adam-mini"}
"""Import name -> PyPI name of the optional optimizer packages torch does not ship."""


def spec(name: str) -> Optimizer:
    """The entry of ``optimizer.name`` ``name``.

    Raises:
        KeyError: no such optimizer (config validation refuses it first).
    """
    return OPTIMIZERS_BY_NAME[name]


def step_compiled(name: str, implementation: str, *, in_backward: bool, sharded: bool) -> bool:
    """Whether ``compile: true`` compiles the step of optimizer ``name`` (PyTorch's recipe "Compiling the optimizer
    with torch.compile"): an entry with ``compiled_step``, ``implementation`` ``for_loop``, not in backward (its
    updates run inside backward, one optimizer a tensor) and not sharded (FSDP2's ``DTensor`` shards stay eager).

    ``fused`` is one kernel a tensor already. ``foreach`` stays eager: TorchDynamo specialises its learning rate
    (a Python float scaling the ``_foreach_`` ops), so a schedule that sets a new one every step would recompile
    every step; ``for_loop``'s becomes a graph input after one recompile. Measured on 2 CPU cores
    (docs/benchmarks.md, "peers-speed"): the compiled for-loop update takes about half the eager one's time; the
    first step compiles it (seconds to tens of seconds on a CPU, cached by Inductor for the next run). The cost
    model's ``compile`` rule and :func:`step_compiles` both ask this.
    """
    entry = OPTIMIZERS_BY_NAME.get(name)
    return (
        entry is not None
        and entry.compiled_step
        and implementation == "for_loop"
        and not in_backward
        and not sharded
    )


def step_compiles(optimizer: torch.optim.Optimizer) -> bool:
    """:func:`step_compiled` for a built optimizer: its class is exactly an entry's torch class (so not
    :class:`~memfit.memory.optim.OptimizerInBackward` nor a hybrid), its implementation read from its groups'
    ``fused`` and ``foreach`` flags, sharded when a parameter is not a plain tensor."""
    entry = next(
        (
            o
            for o in OPTIMIZERS
            if o.library == "torch" and o.compiled_step and type(optimizer) is o.factory()
        ),
        None,
    )
    if entry is None:
        return False
    groups = optimizer.param_groups
    if any(group.get("fused") for group in groups):
        implementation = "fused"
    elif any(group.get("foreach") is not False for group in groups):
        implementation = "foreach"
    else:
        implementation = "for_loop"
    sharded = any(
        type(p) not in (torch.Tensor, torch.nn.Parameter) for group in groups for p in group["params"]
    )
    return step_compiled(entry.name, implementation, in_backward=False, sharded=sharded)


def update_factors(target: str) -> dict[str, float]:
    """``{name: update factor}`` on ``target`` (``cuda`` or ``cpu``): the cost model's ``optimizer_update_factor``."""
    return {
        o.name: o.cpu_update_factor
        if target == "cpu" and o.cpu_update_factor is not None
        else o.update_factor
        for o in OPTIMIZERS
    }


def sharded_refusal(name: str, *, strategy: str, dtype: str) -> str | None:
    """Why ``name`` cannot run sharded with ``strategy`` and ``dtype``, or ``None`` when it can."""
    entry = spec(name)
    return entry.sharded(name, strategy, dtype) if entry.sharded is not None else None


def rounding_refusal(name: str, device_type: str, rounding: str) -> str | None:
    """Why optimizer ``name`` cannot round bf16 weights by ``rounding`` (``bf16_rounding``) on ``device_type``, or
    ``None`` when it can: every optimizer can on CPU; on CUDA bitsandbytes' fused kernel writes the weight itself
    (nearest only) and torchao's compiled update has stochastic rounding but no Kahan compensation."""
    if rounding == "nearest" or device_type != "cuda" or name not in OPTIMIZERS_BY_NAME:
        return None
    library = spec(name).library
    if library == "bitsandbytes":
        return (
            f"{name!r} (bitsandbytes) cannot round bf16 weights by bf16_rounding={rounding} on CUDA: its fused "
            f"kernel writes the bf16 weight itself, rounded to nearest. Use torchao_adamw8bit or torchao_adamw4bit "
            f"(the same block-wise state), or bf16_rounding=nearest"
        )
    if library == "torchao" and rounding == "kahan":
        return (
            f"{name!r} compiles its CUDA update whole, which keeps no Kahan compensation; use "
            f"bf16_rounding=stochastic (torchao's own stochastic rounding there) or nearest"
        )
    return None


def resolve_rounding(
    setting: str, name: str, device_type: str, dtype: str, *, cpu_offload: bool = False, sharded: bool = False
) -> str:
    """The rounding a run's bf16 weights take: ``nearest`` unless ``dtype`` is ``bf16``; ``auto`` is
    ``stochastic`` where optimizer ``name`` can round so on ``device_type`` (:func:`rounding_refusal`), without
    ``optimizer.cpu_offload`` and in one process, else ``nearest`` (bitsandbytes' fused CUDA kernel, torchao's
    offloaded update; a sharded run, whose rounded per-parameter steps the estimator does not compose from a few
    layers yet: asked for, ``stochastic`` and ``kahan`` run sharded, and are traced whole); any other setting is
    itself.

    Args:
        setting: ``bf16_rounding``.
        name: ``optimizer.name``.
        device_type: ``cpu`` or ``cuda``, where the run's parameters live.
        dtype: the run's ``dtype``.
        cpu_offload: ``optimizer.cpu_offload``.
        sharded: the run has more than one rank.
    """
    if dtype != "bf16":
        return "nearest"
    if setting != "auto":
        return setting
    if cpu_offload or sharded or rounding_refusal(name, device_type, "stochastic") is not None:
        return "nearest"
    return "stochastic"


def check_optimizer_supported(
    name: str,
    device_type: str,
    *,
    cpu_offload: bool = False,
    in_backward: bool = False,
    max_grad_norm: float = 0.0,
    rounding: str = "nearest",
) -> str | None:
    """Why the optimizer ``name`` cannot run as asked, or ``None`` when it can. Allocates nothing.

    Config validation calls this before anything is built; :func:`memfit.memory.optim.build_optimizer` raises
    ``ValueError`` with the same reason. Every reason that concerns ``cpu_offload`` contains the word "offload".

    Args:
        name: ``optimizer.name``.
        device_type: where the parameters live: ``"cpu"`` or ``"cuda"``.
        cpu_offload: ``optimizer.cpu_offload`` (torchao ``CPUOffloadOptimizer``).
        in_backward: the step runs inside backward (:class:`memfit.memory.optim.OptimizerInBackward`).
        max_grad_norm: the clipping threshold of the run; 0 is no clipping.
        rounding: ``bf16_rounding`` of a ``dtype: bf16`` run (``nearest`` otherwise).

    Returns:
        A sentence saying what is wrong and what to do instead, or ``None``.
    """
    if name not in OPTIMIZERS_BY_NAME:
        return f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_NAMES)}"
    entry = spec(name)
    if entry.library in _PACKAGES and importlib.util.find_spec(entry.library) is None:
        return (
            f"optimizer {name!r} needs {_PACKAGES[entry.library]}, which is not installed "
            f"(pip install {_PACKAGES[entry.library]})"
        )
    if (entry.library == "torchao" or cpu_offload) and importlib.util.find_spec("torchao") is None:
        what = "optimizer.cpu_offload" if cpu_offload else f"optimizer {name!r}"
        return f"{what} needs torchao, which is not installed (pip install torchao)"
    if entry.device is not None and (reason := entry.device(device_type)) is not None:
        return reason
    if (reason := rounding_refusal(name, device_type, rounding)) is not None:
        return reason
    if cpu_offload:
        if entry.update_rule not in ("adamw", "lion"):
            return (
                f"optimizer.cpu_offload cannot be combined with {name!r}: torchao's CPUOffloadOptimizer gives "
                f"each parameter an optimizer of its own over a copy on the host, which memfit verified for the "
                f"AdamW family only (it has no CUDA device to verify {name} there). Turn cpu_offload off: "
                f"{name}'s state is already small"
            )
        if device_type != "cuda":
            return (
                "optimizer.cpu_offload moves optimizer state and the update from GPU memory to host memory "
                "(torchao CPUOffloadOptimizer) and needs a CUDA device; on CPU the state already lives in host "
                "memory. Turn cpu_offload off, or shrink the state with a low-bit optimizer (adamw8bit, "
                "torchao_adamw4bit)"
            )
        if entry.paged:
            return (
                f"optimizer.cpu_offload cannot be combined with {name!r}: paging keeps the state in CUDA unified "
                f"memory, offload keeps it in pinned host memory. Use one: cpu_offload with adamw or adamw8bit, "
                f"or {name!r} without offload"
            )
        if in_backward:
            return (
                "optimizer.cpu_offload cannot be combined with optimizer_in_backward: the offloaded update runs on "
                "the CPU after backward, from gradients copied during backward. Turn one of them off"
            )
        if max_grad_norm > 0:
            return (
                "optimizer.cpu_offload cannot clip gradients (max_grad_norm > 0): each gradient is copied to the "
                "host as soon as backward produces it, before the global norm is known, so clipping would not "
                "reach the update. Set max_grad_norm=0 (grad_norm is still reported) or turn cpu_offload off"
            )
    return None
