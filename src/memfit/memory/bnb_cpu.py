"""bitsandbytes' optimizers on CPU: their updates in chunks that memfit's tracker and estimates see, and their state
created before the first step.

bitsandbytes' 8-bit and 32-bit optimizers update each tensor through one op. On CUDA it is one fused kernel that
allocates nothing; on CPU it runs Python kernels (``bitsandbytes/backends/cpu/ops.py``) whose fp32 temporaries are
the size of the whole tensor, inside the op where no dispatch mode sees them. :func:`compose_bnb_cpu_updates` runs
those kernels on chunks, as Python; :func:`create_bnb_state` makes the state up front, as
:func:`memfit.memory.optim.create_state` does for every optimizer that can.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from memfit.memory import hybrids, rounding

_ROUNDING: list[tuple[str, torch.Tensor | None]] = []
"""``(bf16_rounding, Kahan compensation)`` of the parameter whose update runs now (:func:`rounding_class`), read by
the chunked kernels of :func:`compose_bnb_cpu_updates`."""

BNB_CPU_UPDATES_COMPOSED = True
"""Whether :func:`compose_bnb_cpu_updates`' wrappers run bitsandbytes' CPU update kernels on chunks of CPU tensors
(True), or call its ops whole (False: what :func:`memfit.planner.cuda_paths.cuda_paths` sets while an estimate
traces a CUDA run on CPU fake tensors, where the op's fake, like CUDA's fused kernel, allocates nothing)."""
BNB_BLOCK = 256
"""The values per absmax of bitsandbytes' blockwise 8-bit optimizer state (its ``blocksize``, fixed)."""


def _flat_chunks(numel: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of a flat tensor of ``numel`` values, each as long as
    :data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS` (a multiple of :data:`BNB_BLOCK`, so that each chunk holds
    whole blocks of the 8-bit state), the last one shorter."""
    size = max(BNB_BLOCK, hybrids.LOW_BIT_CHUNK_ELEMENTS // BNB_BLOCK * BNB_BLOCK)
    return [(a, min(numel, a + size)) for a in range(0, numel, size)]


def _composes(p: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether a bitsandbytes update of ``p`` runs as its CPU kernel on flat chunks: on a plain CPU tensor (not a
    ``DTensor`` shard) whose gradient and state are contiguous tensors of its shape."""
    return (
        BNB_CPU_UPDATES_COMPOSED
        and p.device.type == "cpu"
        and not hasattr(p, "to_local")
        and p.is_contiguous()
        and all(t is None or (t.shape == p.shape and t.is_contiguous()) for t in tensors)
    )


def _flat(t: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if t is None else t.view(-1)[a:b]


def _blocks(absmax: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if absmax is None else absmax[a // BNB_BLOCK : -(-b // BNB_BLOCK)]


def compose_bnb_cpu_updates(functional: Any, cpu_ops: Any) -> None:
    """Make bitsandbytes' optimizer updates of CPU tensors run its CPU kernels chunk by chunk, as Python over torch
    ops (once per process; a no-op when done, or when this bitsandbytes has no such kernels).

    bitsandbytes' 8-bit and 32-bit optimizers call ``bitsandbytes.functional.optimizer_update_8bit_blockwise`` and
    ``optimizer_update_32bit`` for each tensor. On CUDA each is one fused kernel that allocates nothing. On CPU the
    op runs ``backends/cpu/ops.py``'s Python kernels, which dequantize both moments to fp32 and copy the gradient
    and compute the denominator: about 20 bytes of fp32 temporaries per element of the tensor at once (8-bit AdamW;
    12 for the 32-bit one), 7.37 GiB measured for a 3B model's 394M-parameter tied embedding
    (``bench/bnb_cpu_update.py``). Through the op, those
    temporaries were invisible to memfit's tracker and to an estimate (whose fake op allocates nothing), so a CPU
    estimate of an 8-bit AdamW run left them out.

    The wrappers installed here run the same kernels on flat chunks of
    :data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS` values that hold whole quantization blocks of
    :data:`BNB_BLOCK` values (the same arithmetic element by element and block by block: bit-identical results),
    so the temporaries are one chunk's, and call them as Python, so that the tracker and an estimate see them (on
    fake tensors only the first and the last chunk run: :func:`memfit.memory.hybrids.traced_chunks`). An update
    they cannot slice (a ``DTensor`` shard, AdEMAMix's stacked state, LAMB's or LARS's norm over the whole
    update) calls the op whole, as before.

    Args:
        functional: ``bitsandbytes.functional``.
        cpu_ops: ``bitsandbytes.backends.cpu.ops``.
    """
    kernel8 = getattr(cpu_ops, "_optimizer_update_8bit_blockwise_cpu", None)
    kernel32 = getattr(cpu_ops, "_optimizer_update_32bit_cpu", None)
    if getattr(functional, "memfit_composed", False) or kernel8 is None or kernel32 is None:
        return
    fused8, fused32 = functional.optimizer_update_8bit_blockwise, functional.optimizer_update_32bit

    @functools.wraps(fused8)
    def optimizer_update_8bit_blockwise(
        optimizer_name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2, absmax1,
        absmax2, weight_decay=0.0, gnorm_scale=1.0, skip_zeros=False,
    ):  # fmt: skip
        args = (beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2)
        mode, comp = _ROUNDING[-1] if _ROUNDING else ("nearest", None)
        if not _composes(p, g, state1, state2):
            with rounding.rounded(p, mode, comp) as target:
                fused8(optimizer_name, g, target, state1, state2, *args, absmax1, absmax2, weight_decay,
                       gnorm_scale=gnorm_scale, skip_zeros=skip_zeros)  # fmt: skip
            return None
        for a, b in hybrids.traced_chunks(_flat_chunks(p.numel()), p):
            with rounding.rounded(_flat(p, a, b), mode, _flat(comp, a, b)) as target:
                kernel8(optimizer_name, _flat(g, a, b), target, _flat(state1, a, b), _flat(state2, a, b), *args,
                        _blocks(absmax1, a, b), _blocks(absmax2, a, b), weight_decay, gnorm_scale,
                        skip_zeros)  # fmt: skip
        return None

    @functools.wraps(fused32)
    def optimizer_update_32bit(
        optimizer_name, g, p, state1, beta1, eps, step, lr, state2=None, beta2=0.0, beta3=0.0, alpha=0.0,
        weight_decay=0.0, gnorm_scale=1.0, unorm_vec=None, max_unorm=0.0, skip_zeros=False,
    ):  # fmt: skip
        mode, comp = _ROUNDING[-1] if _ROUNDING else ("nearest", None)
        if max_unorm > 0.0 or not _composes(p, g, state1, state2):
            with rounding.rounded(p, mode, comp) as target:
                fused32(optimizer_name, g, target, state1, beta1, eps, step, lr, state2, beta2, beta3, alpha,
                        weight_decay, gnorm_scale, unorm_vec, max_unorm=max_unorm,
                        skip_zeros=skip_zeros)  # fmt: skip
            return None
        hyper = (beta1, beta2, beta3, alpha, eps, weight_decay, step, lr, gnorm_scale, skip_zeros)
        for a, b in hybrids.traced_chunks(_flat_chunks(p.numel()), p):
            # no norm of the update (max_unorm 0): unorm_vec None, param_norm 0.0, as bitsandbytes passes them
            with rounding.rounded(_flat(p, a, b), mode, _flat(comp, a, b)) as target:
                kernel32(optimizer_name, _flat(g, a, b), target, _flat(state1, a, b), _flat(state2, a, b), None,
                         0.0, 0.0, *hyper)  # fmt: skip
        return None

    functional.optimizer_update_8bit_blockwise = optimizer_update_8bit_blockwise
    functional.optimizer_update_32bit = optimizer_update_32bit
    functional.memfit_composed = True


@functools.cache
def rounding_class(base: type) -> type:
    """bitsandbytes' optimizer class ``base`` whose update of a bf16 parameter is computed on an fp32 copy of each
    chunk and rounded back by its ``memfit_bf16_rounding`` (:mod:`memfit.memory.rounding`; set by
    :func:`memfit.memory.optim.build_optimizer`): the kernels of :func:`compose_bnb_cpu_updates` read the rule and
    the Kahan compensation of the parameter it updates. On CUDA the fused kernel writes the bf16 weight itself,
    rounded to nearest; config validation refuses another rule there."""

    class _Rounded(base):  # type: ignore[misc, valid-type]
        memfit_rounds_natively = True
        memfit_bf16_rounding = "nearest"

        def update_step(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> Any:
            mode = self.memfit_bf16_rounding
            if mode == "nearest" or p.dtype != torch.bfloat16:
                return super().update_step(group, p, gindex, pindex)
            _ROUNDING.append((mode, rounding.compensation_of(self.state[p], p, mode)))
            try:
                return super().update_step(group, p, gindex, pindex)
            finally:
                _ROUNDING.pop()

    _Rounded.__name__ = _Rounded.__qualname__ = base.__name__
    return _Rounded


def create_bnb_state(optimizer: Any) -> bool:
    """Create now, as its step would, the state of each trainable parameter of a bitsandbytes optimizer
    (``bitsandbytes.optim.optimizer.Optimizer8bit``: its first-step set-up, then ``init_state`` where a parameter has
    none; a loaded state is kept). The state is zeros either way: the first step then finds it and updates it.

    Args:
        optimizer: any optimizer; only bitsandbytes' (those with ``init_state`` and its first-step set-up) are
            touched.

    Returns:
        False for an optimizer that is not bitsandbytes' (nothing done).
    """
    if not all(hasattr(optimizer, a) for a in ("init_state", "initialized", "check_overrides", "to_gpu")):
        return False
    if not optimizer.initialized:  # what its step does first
        optimizer.check_overrides()
        optimizer.to_gpu()
        optimizer.initialized = True
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            if p.requires_grad and len(optimizer.state[p]) == 0:
                optimizer.init_state(group, p, gindex, pindex)
    return True


__all__ = [
    "BNB_BLOCK",
    "BNB_CPU_UPDATES_COMPOSED",
    "compose_bnb_cpu_updates",
    "create_bnb_state",
    "rounding_class",
]
