"""Trace what a CUDA device runs: for ``device=cuda`` estimates, the library paths whose CUDA memory differs from
the CPU path the fake trace would take are traced as they behave on CUDA.

The estimator's trace runs on CPU fake tensors (:mod:`memfit.planner.estimate`). Where a library takes another code
path on CUDA, and that path allocates other bytes, :func:`cuda_paths` swaps in, while the trace runs, a function
that allocates what the CUDA path allocates. Each rule below says what it replaces, which source it reads, and the
bytes the CUDA path allocates.

Rules (torch 2.13, torchao 0.18; each a function of this module):

- :func:`torchao_compiled_update`: torchao's low-bit AdamW compiles its per-parameter update
  (``torchao/optim/adam.py``, ``_AdamBase.step``: ``torch.compile(single_param_adam, fullgraph=True)``) on CUDA;
  the trace would run it eagerly (as on CPU, :mod:`memfit.memory.optim` forces eager there), 28 bytes per
  element of a bf16 weight at its peak (24 for fp32): fp32 copies of the weight, the gradient and both
  dequantized moments, and their intermediates. Compiled, it is a persistent-reduction kernel over the blocks
  (256 elements, 128 for 4-bit) that writes the parameter and the quantized state in place, with only the
  buffers Inductor keeps between kernels: N / 32 bytes for 8-bit and FP8 state, 16 N + N / 16 for 4-bit.
- :func:`sdpa_as_on_cuda`: ``F.scaled_dot_product_attention`` on CUDA picks flash attention (fp16/bf16, no explicit
  mask), else memory-efficient attention (memfit's packed-sample masks, fp32), else the math kernel; on CPU the
  trace picks the CPU flash kernel for all of them. The rule runs the CUDA kernel's own op on the fake tensors, so
  autograd saves what it saves on CUDA: flash, ``rng_state`` (2,) and ``unused`` () uint64 on the device
  (24 bytes a call) besides what CPU flash saves; memory-efficient, the logsumexp padded to a multiple of 32
  queries, the mask padded to a multiple of 8 keys when the sequence length is not one, and the philox
  seed/offset.
- :func:`kv_heads_as_on_cuda`: :func:`memfit.models.decoder.causal_attention` lets SDPA read shared key/value heads
  in place (``enable_gqa``) on CPU, or on CUDA in fp16/bf16; in fp32 on CUDA it expands keys and values to every
  query head (two (B, nh, T, hd) copies, saved for backward by memory-efficient attention). The rule decides as
  on CUDA.

Paths read and found to allocate the same on CUDA as traced (no rule):

- bitsandbytes' optimizer updates (``adamw8bit``, ``paged_adamw8bit``, ``paged_adamw``): ``update_step`` calls
  ``bitsandbytes.functional.optimizer_update_8bit_blockwise`` / ``optimizer_update_32bit``, i.e. the ops
  ``torch.ops.bitsandbytes.optimizer_update_8bit_blockwise`` / ``optimizer_update_32bit``. On CUDA they run
  ``backends/cuda/ops.py``'s ``_optimizer_update_*_impl``: one kernel (``c*_8bit_blockwise_grad_{fp32,fp16,bf16}``,
  ``c*32bit_grad_*``) that updates ``p``, ``state1/2`` and ``absmax1/2`` in place and allocates nothing. A CUDA
  target's trace calls the ops (their one switch: ``memfit.memory.bnb_cpu.BNB_CPU_UPDATES_COMPOSED`` off, by
  :func:`cuda_paths`), whose registered fakes
  (``bitsandbytes/_ops.py``, ``register_fake``) allocate nothing either; a CPU target's trace runs the CPU kernels
  in chunks as a CPU run does (:func:`memfit.memory.bnb_cpu.compose_bnb_cpu_updates`). Paging (``get_paged``,
  unified memory) is split off the device peak by the estimator itself.
- torch ``AdamW`` ``fused``: ``_fused_adamw_`` updates in place on CPU and on CUDA (multi-tensor apply); the step
  counters live on the parameter's device in both.
- torch ``AdamW`` ``foreach`` / ``for_loop``: the same ``_foreach_*`` / per-tensor ops run on both devices (on CPU
  the foreach ops loop over tensors, with the same outputs), so the same temporaries (one parameter-sized set for
  ``foreach``). The fp32 ``step`` counters are hosted on the CPU on CUDA ("special device hosting for step",
  ``torch/optim/adam.py``); the trace counts them on the device: 4 bytes per parameter tensor (1,164 for
  Llama-3-8B), left as is.
- ``clip_grad_norm_``: one 0-dim norm per gradient, then their norm, on both devices.
- SDPA with cuDNN attention (preferred over flash on sm90/sm100 with cuDNN > 9.15): it saves the output and
  fp32 (B, nh, T, 1) statistics (``torch/_meta_registrations.py``, ``meta__scaled_dot_product_cudnn_attention``),
  the bytes of flash's output and logsumexp; the rule traces flash for it.
- autocast (``dtype=bf16_mixed``): CUDA's fp32 list (softmax, log_softmax, pow, rsqrt, sum, ...) is longer than
  the CPU's, but memfit upcasts explicitly where it computes in fp32 (``x.float()`` in RMSNorm, ``logits.float()``
  before the loss): in a bf16_mixed step of the tiny preset, with and without the chunked loss, no op of CUDA's
  fp32 list gets a bf16 input. The ops CUDA casts to bf16 and CPU does not (einsum, mv, addmv, addr,
  chain_matmul, linalg_multi_dot) memfit does not call; linear, matmul and SDPA run in bf16 on both.

Neither device's trace sees memory inside one kernel: workspaces (flash backward's fp32 ``dq_accum`` and, with
grouped-query attention, keys' and values' gradients expanded to every head; split-KV accumulators; cuBLAS's
workspace), which docs/memory.md lists among what no estimate of tensors sees.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from memfit.memory import bnb_cpu, hybrids, offload
from memfit.models import decoder

_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# torchao: the compiled update
# ----------------------------------------------------------------------------------------------------------------


def _local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def compiled_update_buffers(state: Any) -> list[tuple[int, torch.dtype]]:
    """The buffers ``(numel, dtype)`` the compiled update allocates for one quantized moment of a parameter.

    What Inductor (torch 2.13, Triton) keeps in memory between and around its kernels when it compiles torchao 0.18's
    ``single_param_adam`` (``torchao/optim/adam.py``) for a state of ``N`` elements in blocks of ``b``. Read from the
    code Inductor generates for the same graph (``TORCH_LOGS=output_code``), less the buffers a Triton persistent
    reduction keeps in registers (``torch/_inductor/codegen/simd_kernel_features.py``, ``remove_kernel_local``: a
    buffer written and read back at the same index inside one persistent kernel is dropped; blocks of 128 and 256
    elements reduce persistently), and with the 4-bit nibble unpacking as a pointwise ``cat``
    (``torch/_inductor/lowering.py``, ``cat``: only CPU falls back to a materialized concatenation). Not measured on a
    GPU.

    - ``OptimState8bit``: the new block scales, fp32 (N / b): the dequantized moment, its block maximum, the new
      codes (``quantize_8bit_with_qmap``'s search) and the parameter's update fuse into one kernel per block row.
    - ``OptimStateFp8``: the new block scales, fp32 (N / b), likewise.
    - ``OptimState4bit``: the new block scales, fp32 (N / b), and the new codes before packing, int64 (N): the
      packing (``subclass_4bit.py``, ``(codes[::2] << 4) | codes[1::2]``) reads two codes per byte, which a kernel
      over blocks cannot keep in registers.
    - a plain tensor (parameters of < 4,096 elements, or not a multiple of the block): nothing (one pointwise
      kernel).

    Args:
        state: ``exp_avg`` or ``exp_avg_sq`` as torchao keeps it (a DTensor's local shard is read).

    Returns:
        ``[(numel, dtype), ...]``, in the order they are allocated; empty for a plain tensor.
    """
    local = _local(state)
    scale = getattr(local, "scale", None)
    if scale is None:
        return []
    buffers = [(scale.numel(), torch.float32)]
    if type(local).__name__ == "OptimState4bit":
        buffers.append((local.numel(), torch.int64))
    return buffers


def torchao_compiled_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    step: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    IS_ADAMW: bool,  # noqa: N803 - torchao's argument names
    BF16_STOCHASTIC_ROUND: bool,  # noqa: N803
) -> None:
    """torchao's ``single_param_adam`` as compiled on CUDA, for the fake trace: the buffers it holds, nothing else.

    Replaces ``torchao.optim.adam.single_param_adam`` (which ``_AdamBase.step`` looks up at each call and hands to
    ``torch.compile``; on CPU memfit runs it under ``set_stance("force_eager")``). The compiled kernels write ``p``,
    ``exp_avg`` and ``exp_avg_sq`` in place; on fake tensors there are no values to write, so this allocates, for
    the duration of the update, the buffers of :func:`compiled_update_buffers` for both moments, on ``p``'s device,
    and frees them. Per element of a bf16 or fp32 parameter of ``N`` elements: 8-bit and FP8 state, 2 x 4 / 256
    bytes (``N / 32`` in all); 4-bit, 2 x (8 + 4 / 128) (``16 N + N / 16``); unquantized state, 0. Eagerly (what the
    trace ran before) the same update holds 28 bytes per element of a bf16 weight at its peak, 24 of an fp32 one.

    ``max_exp_avg_sq`` (amsgrad, which memfit does not use) and ``BF16_STOCHASTIC_ROUND`` (off in memfit) add no
    buffer here. Arguments as torchao's.
    """
    device = _local(p).device
    buffers = [
        torch.empty(numel, dtype=dtype, device=device)
        for state in (exp_avg, exp_avg_sq)
        for numel, dtype in compiled_update_buffers(state)
    ]
    del buffers


# ----------------------------------------------------------------------------------------------------------------
# torch SDPA: the kernel CUDA picks
# ----------------------------------------------------------------------------------------------------------------


def cuda_sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs on an sm80+ GPU for dense inputs: ``"flash"``,
    ``"efficient"`` or ``"math"``.

    ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (``select_sdp_backend``: flash, then memory-efficient,
    then math), the constraints that memfit's calls can meet:

    - flash (``can_use_flash_attention``): fp16/bf16; no explicit mask (``check_for_attn_mask``); query, key and
      value of one head size <= 256; ``is_causal`` only with as many keys as queries; grouped-query attention in place.
    - memory-efficient (``can_use_mem_efficient_attention``): fp16/bf16/fp32; head sizes a multiple of 8 (fp16/bf16)
      or 4 (fp32; ``minimum_gemm_alignment``); masks taken. Grouped-query attention goes to math here (memfit expands
      keys and values before any call that could land here).
    - math otherwise.

    cuDNN attention, first on sm90/sm100 with cuDNN > 9.15 where it applies, saves the bytes flash saves (see the
    module docstring), so it is not told apart.

    Args:
        query: (B, nh, Tq, hd).
        key: (B, nkv, Tk, hd).
        value: (B, nkv, Tk, hd_v).
        attn_mask: an explicit mask, or None.
        is_causal: SDPA's ``is_causal``.
        enable_gqa: SDPA's ``enable_gqa``.

    Returns:
        ``"flash"``, ``"efficient"`` or ``"math"``.
    """
    hd, hd_k, hd_v = query.size(-1), key.size(-1), value.size(-1)
    gqa = enable_gqa and query.size(-3) != key.size(-3)
    strided = query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    square = query.size(-2) == key.size(-2)
    if (
        attn_mask is None
        and query.dtype in _HALF
        and hd == hd_k == hd_v <= 256
        and (square or not is_causal)
        and strided
    ):
        return "flash"
    alignment = 8 if query.dtype in _HALF else 4
    if (
        query.dtype in (*_HALF, torch.float32)
        and hd == hd_k
        and hd % alignment == 0
        and hd_v % alignment == 0
        and strided
        and not gqa
    ):
        return "efficient"
    return "math"


def _additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """SDPA's ``convert_boolean_attn_mask`` (``aten/src/ATen/native/transformers/attention.cpp``): a bool mask
    becomes an additive one in the query's dtype, ``where(mask, 0, -inf)`` (a new tensor of the mask's shape), on
    every device and kernel."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=attn_mask.device))


def _efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` (``attention.cpp``) for memory-efficient attention: a mask whose strides (but the last)
    are not multiples of 8 elements is copied into one padded to the next multiple of 8 keys and sliced back; then
    expanded (a view) to (B, nh, Tq, Tk)."""
    aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
    if not aligned:
        keys = mask.size(-1)
        mask = F.pad(mask, (0, 8 - keys % 8))[..., :keys]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def sdpa_as_on_cuda(
    original: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention`` that runs, on CPU (fake) tensors, the op CUDA's SDPA runs.

    ``scaled_dot_product_attention`` (``attention.cpp``) on CUDA: the backend :func:`cuda_sdpa_backend` picks, the
    bool mask made additive, then ``aten._scaled_dot_product_flash_attention`` (head size padded to a multiple of 8
    first, as ``pad_last_dim<8>`` does, a no-op for memfit's models), ``aten._scaled_dot_product_efficient_attention``
    (the mask through ``preprocess_mask``; logsumexp only when a gradient is needed) or
    ``aten._scaled_dot_product_attention_math``. On fake tensors those ops run their meta kernels, whose outputs
    are the CUDA kernels' (``torch/_meta_registrations.py``), and autograd saves what it saves on CUDA. What
    each saves for backward beside query, key, value and the output, for (B, nh, T) queries:

    - flash: logsumexp fp32 (B, nh, T) and the uint64 ``rng_state`` (2,) and ``unused`` () on the device: 24 bytes
      more than CPU flash (``flash_api.cpp``, ``mha_fwd``).
    - memory-efficient: logsumexp fp32 (B, nh, ceil(T / 32) * 32); the additive mask, padded to
      (..., ceil(T / 8) * 8) keys when T is not a multiple of 8 (CPU keeps (..., T)); the philox seed and offset,
      8 bytes each (the trace counts them; CUDA keeps them on the host without dropout).
    - math: the softmax probabilities (B, nh, T, T), as the math composite saves them on any device.

    Tensors not on the CPU pass through to the original.

    Args:
        original: the ``F.scaled_dot_product_attention`` to fall back on.

    Returns:
        A function with ``F.scaled_dot_product_attention``'s signature.
    """
    aten = torch.ops.aten

    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if query.device.type != "cpu" or query.dim() != 4:
            return original(*args)
        backend = cuda_sdpa_backend(query, key, value, attn_mask, is_causal, enable_gqa)
        mask = _additive_mask(attn_mask, query.dtype)
        if backend == "flash":
            head = query.size(-1)
            if head % 8:
                scale = scale if scale is not None else 1.0 / math.sqrt(head)
                query, key, value = (F.pad(t, (0, 8 - head % 8)) for t in (query, key, value))
            out = aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
            return out[..., :head]
        if backend == "efficient":
            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            if mask is not None:
                mask = _efficient_mask(mask, query, key)
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]

    return scaled_dot_product_attention


def kv_heads_as_on_cuda(
    original: Callable[..., torch.Tensor],
) -> Callable[..., torch.Tensor]:
    """:func:`memfit.models.decoder.causal_attention`, deciding as on CUDA (``device_type="cuda"``).

    ``causal_attention`` passes ``enable_gqa`` (keys and values of ``nkv`` heads read in place) when ``native_gqa``
    is None and the device is the CPU or the query is fp16/bf16; else it expands them to ``nh`` heads, two
    (B, nh, T, hd) copies that memory-efficient attention saves for backward (and that the expansion's backward sums
    back). The trace's queries are on the CPU; on CUDA only the dtype decides: in fp32, ``2 B nh T hd * 4`` bytes
    per layer more, saved for backward, in place of the (B, nkv, T, hd) keys and values. Rows of packed documents
    (``doc_ids``) and sliding windows shorter than the sequence run their blocks as on CUDA too
    (:func:`memfit.models.attention.document_attention`, recomputed:
    the forward saves only its inputs, each block's backward runs the memory-efficient kernel again).

    Args:
        original: ``causal_attention``.

    Returns:
        A function with its signature.
    """

    def causal_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        native_gqa: bool | None = None,
        doc_ids: torch.Tensor | None = None,
        device_type: str | None = None,
        window: int | None = None,
        **options: float | None,  # scale, softcap (Gemma)
    ) -> torch.Tensor:
        return original(
            q,
            k,
            v,
            native_gqa=native_gqa,
            doc_ids=doc_ids,
            device_type=device_type or "cuda",
            window=window,
            **options,
        )

    return causal_attention


def offloaded_as_from_cuda(device: torch.device) -> torch.device | None:
    """:func:`memfit.memory.offload.offload_host` as from a CUDA device: the trace's (CPU) saved tensors go to
    the ``meta`` device, which the tracker does not count, as a GPU's go to host memory; they come back when the
    backward unpacks them (one ahead, :class:`memfit.memory.offload.OffloadSavedTensors`), so the device's
    timeline is the GPU's, and the host's bytes are :class:`~memfit.memory.offload.OffloadStats`' peak."""
    return torch.device("meta")


# ----------------------------------------------------------------------------------------------------------------
# All rules at once
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cuda_paths(enabled: bool) -> Iterator[None]:
    """While the trace runs, the library paths that allocate differently on CUDA behave as on CUDA.

    Swaps in, until the context exits: ``torch.nn.functional.scaled_dot_product_attention`` (:func:`sdpa_as_on_cuda`),
    ``memfit.models.decoder.causal_attention`` (:func:`kv_heads_as_on_cuda`),
    ``memfit.memory.offload.offload_host`` (:func:`offloaded_as_from_cuda`), and, when torchao's optimizers are
    imported (the estimator imports the optimizer's library before the trace), ``torchao.optim.adam
    .single_param_adam`` (:func:`torchao_compiled_update`) and ``memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS``
    (no chunks: CUDA updates each tensor whole), and ``memfit.memory.bnb_cpu.BNB_CPU_UPDATES_COMPOSED`` (False:
    bitsandbytes' updates call its ops, which allocate nothing, as its CUDA kernels). Each is looked up by name at
    call time by its caller, so the swap reaches it.

    Args:
        enabled: False does nothing (a CPU target: the trace already runs the CPU paths).
    """
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as stack:
        _swap(stack, F, "scaled_dot_product_attention", sdpa_as_on_cuda(F.scaled_dot_product_attention))
        _swap(stack, decoder, "causal_attention", kv_heads_as_on_cuda(decoder.causal_attention))
        _swap(stack, offload, "offload_host", offloaded_as_from_cuda)
        # bitsandbytes' updates through its ops, whose fakes (like CUDA's fused kernels) allocate nothing
        _swap(stack, bnb_cpu, "BNB_CPU_UPDATES_COMPOSED", False)
        adam = sys.modules.get("torchao.optim.adam")
        if adam is not None:
            _swap(stack, adam, "single_param_adam", torchao_compiled_update)
            # on CUDA the whole tensor goes through the compiled update at once: no eager chunks
            _swap(stack, hybrids, "LOW_BIT_CHUNK_ELEMENTS", sys.maxsize)
        yield


def _swap(stack: contextlib.ExitStack, owner: Any, name: str, replacement: Any) -> None:
    """Set ``owner.name`` to ``replacement`` until ``stack`` closes."""
    stack.callback(setattr, owner, name, getattr(owner, name))
    setattr(owner, name, replacement)
