"""The optimizers behind ``optimizer.name``, one declared entry each: what every layer of memfit needs to know of one.

An :class:`Optimizer` entry holds its library and class (the constructor :func:`memfit.memory.optim.build_optimizer`
calls), the keyword arguments it takes, the bytes of state it keeps in closed form (:attr:`Optimizer.state`, which
:func:`memfit.planner.closed_form.model_state_bytes_closed_form` sums and ``tests/memory/test_switches.py`` holds
against the real state), which tensors it keeps unquantized, whether it pages its state and supports ``implementation``,
where it runs (sharded, CUDA capability), its share of the planner's cost model (:attr:`Optimizer.update_factor`)
and its one-line comment in ``memfit plan``'s YAML.

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
=====================  ==================================================================================

Adding an optimizer is one entry in :data:`OPTIMIZERS` (and, for a library memfit does not call yet, its import
in :func:`memfit.memory.optim._optimizer_class`); ``tests/memory/test_switches.py`` checks its closed form against a
real step and its line in docs/memory.md.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

OPTIMIZER_IMPLEMENTATIONS = ("foreach", "for_loop", "fused")
"""``optimizer.implementation`` values (torch AdamW's ``foreach`` / ``fused`` flags)."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps 32-bit state for tensors with fewer elements than this (its ``min_8bit_size``)."""
BNB_PAGED_MIN_NUMEL = 100_000
"""bitsandbytes' paged optimizers page the state of tensors of at least this many elements (its
``get_state_buffer``); smaller tensors' state, every absmax and the code tables are ordinary device memory."""
TORCHAO_MIN_QUANTIZED_SIZE = 4096
"""torchao keeps unquantized state for tensors with fewer elements than this (hard-coded in its ``_new_buffer``)."""

Tensors = list[tuple[int, int]]
"""Trainable tensors of one rank as ``(numel, element_size in bytes)``."""


# ----------------------------------------------------------------------------------------------------------------
# State in closed form, by library
# ----------------------------------------------------------------------------------------------------------------


def _torch_adamw_state(tensors: Tensors) -> int:
    """Two moments in the parameter dtype and a 4-byte fp32 ``step`` tensor per parameter."""
    return sum(2 * numel * size + 4 for numel, size in tensors)


def _bnb_state(moments: int, bits: int) -> Callable[[Tensors], int]:
    """bitsandbytes: ``moments`` fp32 moments per tensor (``bits`` 32), or block-wise 8-bit ones for tensors of >=
    :data:`BNB_MIN_8BIT_SIZE` elements: ``moments`` uint8 codes and one fp32 absmax per 256-element block each,
    plus ``moments`` 256-entry fp32 quantization maps shared by all tensors; no ``step`` tensor (it is kept in the
    param group)."""

    def state(tensors: Tensors) -> int:
        total = 0
        if bits == 8 and any(n >= BNB_MIN_8BIT_SIZE for n, _ in tensors):
            total += moments * 256 * 4
        for numel, _ in tensors:
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
        for numel, size in tensors:
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
# The registry
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer:
    """One ``optimizer.name``: its library call and what the config, the estimator and the planner need of it."""

    name: str
    """The ``optimizer.name`` value."""
    library: str
    """``torch``, ``bitsandbytes`` or ``torchao``: the package its class comes from (imported when used)."""
    class_name: str
    """The class in ``torch.optim``, ``bitsandbytes.optim`` or ``torchao.optim``."""
    state: Callable[[Tensors], int]
    """Bytes of state it keeps for trainable tensors given as ``(numel, element_size)``."""
    comment: str
    """The one line beside ``optimizer.name`` in ``memfit plan``'s YAML."""
    quantizes: Callable[[int], bool] | None = None
    """``numel -> bool``: whether a tensor of that size gets quantized state; ``None``: full-precision state."""
    hyperparameters: tuple[str, ...] = ("lr", "betas", "eps")
    """The fields of :class:`memfit.config.OptimizerConfig` passed to the class (weight decay is per group)."""
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

    @property
    def paged(self) -> bool:
        return self.paged_bytes_per_element > 0

    def paged_state(self, tensors: Tensors) -> int:
        """Bytes of state a paged optimizer keeps in CUDA unified memory (0 for the others)."""
        per = self.paged_bytes_per_element
        return sum(per * numel for numel, _ in tensors if numel >= BNB_PAGED_MIN_NUMEL)


_BNB_ADAMW8BIT = _bnb_state(moments=2, bits=8)
_TORCHAO_BITS = (
    1.4  # bitsandbytes' 8-bit step measured 1.4x torch's AdamW on CPU; assumed on CUDA (docs/memory.md)
)

OPTIMIZERS: tuple[Optimizer, ...] = (
    Optimizer(
        "adamw",
        "torch",
        "AdamW",
        _torch_adamw_state,
        "torch AdamW: 2 moments in the parameter dtype",
        implementations=OPTIMIZER_IMPLEMENTATIONS,
        planned=True,
    ),
    Optimizer(
        "adamw8bit",
        "bitsandbytes",
        "AdamW8bit",
        _BNB_ADAMW8BIT,
        "bitsandbytes 8-bit AdamW: ~2 bytes/parameter of state",
        quantizes=_bnb_quantizes,
        planned=True,
        update_factor=1.4,
        sharded=_bnb_sharded,
    ),
    Optimizer(
        "paged_adamw8bit",
        "bitsandbytes",
        "PagedAdamW8bit",
        _BNB_ADAMW8BIT,
        "8-bit state in CUDA unified memory: the driver pages it to host RAM when short",
        quantizes=_bnb_quantizes,
        paged_bytes_per_element=2,  # such a tensor is always above bitsandbytes' 8-bit threshold
        planned=True,
        update_factor=1.4,
        sharded=_bnb_sharded,
    ),
    Optimizer(
        "paged_adamw",
        "bitsandbytes",
        "PagedAdamW",
        _bnb_state(moments=2, bits=32),
        "32-bit state in CUDA unified memory",
        paged_bytes_per_element=2 * 4,
        sharded=_bnb_sharded,
    ),
    Optimizer(
        "torchao_adamw8bit",
        "torchao",
        "AdamW8bit",
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
        "AdamW4bit",
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
        "AdamWFp8",
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
        "Lion8bit",
        _bnb_state(moments=1, bits=8),
        "bitsandbytes 8-bit Lion: one moment, ~1 byte/parameter of state",
        quantizes=_bnb_quantizes,
        hyperparameters=("lr", "betas"),  # Lion has no epsilon
        update_factor=1.4,  # bitsandbytes' 8-bit kernel, as AdamW8bit's (not measured apart)
        sharded=_bnb_sharded,
    ),
)
"""Every optimizer, in the order config errors list them."""

OPTIMIZERS_BY_NAME: dict[str, Optimizer] = {o.name: o for o in OPTIMIZERS}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS_BY_NAME)
"""``optimizer.name`` values."""


def spec(name: str) -> Optimizer:
    """The entry of ``optimizer.name`` ``name``.

    Raises:
        KeyError: no such optimizer (config validation refuses it first).
    """
    return OPTIMIZERS_BY_NAME[name]


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


def check_optimizer_supported(
    name: str,
    device_type: str,
    *,
    cpu_offload: bool = False,
    in_backward: bool = False,
    max_grad_norm: float = 0.0,
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

    Returns:
        A sentence saying what is wrong and what to do instead, or ``None``.
    """
    if name not in OPTIMIZERS_BY_NAME:
        return f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_NAMES)}"
    entry = spec(name)
    if entry.library == "bitsandbytes" and importlib.util.find_spec("bitsandbytes") is None:
        return f"optimizer {name!r} needs bitsandbytes, which is not installed (pip install bitsandbytes)"
    if (entry.library == "torchao" or cpu_offload) and importlib.util.find_spec("torchao") is None:
        what = "optimizer.cpu_offload" if cpu_offload else f"optimizer {name!r}"
        return f"{what} needs torchao, which is not installed (pip install torchao)"
    if entry.device is not None and (reason := entry.device(device_type)) is not None:
        return reason
    if cpu_offload:
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
