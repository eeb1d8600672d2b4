"""The optimizers that treat trainable tensors apart, as ``torch.optim.Optimizer`` classes memfit can build,
checkpoint and account like any other: the library does the update, this module only routes parameters and keeps
the state in tensors and numbers.

- :class:`MuonWithAdamW`: ``torch.optim.Muon`` on the groups marked ``algorithm: muon`` (the hidden matrices),
  ``torch.optim.AdamW`` on the rest, as one optimizer whose groups and state are the two's own; its Newton-Schulz
  iteration in the dtype :func:`newton_schulz_dtype` picks (:class:`Muon`: torch's, with that dtype);
- :func:`apollo_class`: ``apollo_torch.APOLLOAdamW`` (Zhu et al., "APOLLO: SGD-like Memory, AdamW-level
  Performance", MLSys 2025) with its per-matrix projector kept in the state as a tensor and a seed, so that its
  state dict loads with ``torch.load(weights_only=True)`` and the state walker sees the projection;
- :func:`adam_mini_class`: ``adam_mini.Adam_mini`` (Zhang et al., "Adam-mini: Use Fewer Learning Rates To Gain
  More", ICLR 2025) fed memfit's partition (:func:`memfit.memory.optimizers.part_of`) instead of its own
  matching of parameter names.

Which tensor goes where is decided by :func:`memfit.memory.optimizers.part_of`; :func:`memfit.memory.optim.
param_groups` writes it into each group as ``algorithm``. :func:`low_bit_class` is torchao's low-bit AdamW made to
take a float ``lr``. The entries of :data:`memfit.memory.optimizers.OPTIMIZERS` name these classes as their
factories, so this module sits below that registry and imports nothing of it.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim import _muon

from memfit.errors import ConfigError
from memfit.memory import rounding
from memfit.quiet import quiet_bitsandbytes_import

_GROUP_ONLY = ("params", "param_names")


def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    """``torch.optim``'s contract for a step's closure: called with grad enabled, its result returned (None
    without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def projection_rank(optimizer: str, rank: int, dim: int, shape: tuple[int, ...]) -> int:
    """APOLLO's projection rank of an m x n matrix: ``optimizer.apollo_rank``, or when 0 the variant's default
    (``apollo``: a quarter of the model width, as GaLore's and APOLLO's pretraining runs, 128 at width 512 to 512 at
    2048; ``apollo_mini``: 1), at most ``min(m, n)`` (a smaller matrix is projected to its smaller side)."""
    r = rank or (1 if optimizer == "apollo_mini" else max(1, dim // 4))
    return min(r, *shape)


def _groups(params: Iterable[Any], algorithm: str) -> list[dict]:
    """Parameter groups from ``params`` (tensors: one group of ``algorithm``)."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        return [{"params": groups, "algorithm": algorithm}]
    return groups


NEWTON_SCHULZ_DTYPES = ("auto", "fp32", "bf16")
"""``optimizer.muon_ns_dtype`` values: ``auto`` (:func:`newton_schulz_dtype`), ``fp32``, ``bf16``."""

_AMX_ISAS = (
    "AVX512_CORE_BF16",
    "AVX512_CORE_AMX",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10",
    "DEFAULT",
    "ALL",
)
"""``ONEDNN_MAX_CPU_ISA`` values under which oneDNN still uses the CPU's bf16 instructions (the AMX and AVX10
levels included: every name beginning ``AVX10`` or containing ``AMX``)."""


def cpu_bf16_matmuls_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware: AMX-BF16 tiles (Intel Sapphire Rapids and later) or
    AVX512-BF16 dot products (Cooper Lake, AMD Zen 4), as torch's CPU feature detection (``cpuinfo``) reports
    them, and not capped below those by ``ONEDNN_MAX_CPU_ISA`` (oneDNN, which runs torch's bf16 matmuls on CPU).
    Without them oneDNN converts bf16 to fp32 and back around every product: measured on the 2 cores of this
    project's machine with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``, a 768 x 768 bf16 matmul ran at 38 GFLOP/s against
    1,577 with AMX and 114 in fp32."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa and not (isa in _AMX_ISAS or isa.startswith("AVX10") or "AMX" in isa):
        return False
    cpu = torch.cpu
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def newton_schulz_dtype(setting: str, device_type: str) -> torch.dtype:
    """The dtype of Muon's Newton-Schulz iteration: ``optimizer.muon_ns_dtype`` resolved for the device.

    ``auto`` is bf16 where bf16 matmuls are fast (CUDA; a CPU with :func:`cpu_bf16_matmuls_fast`), as torch's
    Muon always runs it, and fp32 elsewhere: on a CPU without bf16 matrix instructions the iteration's bf16
    matmuls are emulated, ~30-40x slower than fp32 ones.

    Args:
        setting: ``auto``, ``fp32`` or ``bf16``.
        device_type: where the parameters live (``cpu``, ``cuda``, ``meta``: as ``cpu``).

    Raises:
        ValueError: an unknown ``setting`` (config validation refuses it first, naming the key).
    """
    if setting not in NEWTON_SCHULZ_DTYPES:
        raise ValueError(f"muon_ns_dtype must be one of {', '.join(NEWTON_SCHULZ_DTYPES)}, got {setting!r}")
    if setting == "auto":
        setting = "bf16" if device_type == "cuda" or cpu_bf16_matmuls_fast() else "fp32"
    return torch.bfloat16 if setting == "bf16" else torch.float32


def newton_schulz(
    update: torch.Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """torch's Muon orthogonalisation (``torch.optim._muon._zeropower_via_newtonschulz``: the quintic
    Newton-Schulz iteration of Jordan et al. 2024, its coefficients, ``eps`` and transposition rule) in ``dtype``
    instead of always bf16. In bf16 it is torch's, bit for bit (``tests/memory/test_low_state_optimizers.py``).

    Args:
        update: the m x n momentum update (not changed: the cast is worked on, or a copy when ``update`` is
            already in ``dtype``).
        ns_coefficients: the quintic's ``(a, b, c)``.
        ns_steps: iterations (< 100).
        eps: the floor of the Frobenius norm it is divided by first.
        dtype: the iteration's dtype.

    Returns:
        The orthogonalised m x n update in ``dtype``.

    Raises:
        ValueError: as torch's: ``ns_steps >= 100``, ``update`` not 2-D, not three coefficients.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if update.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    x = update.to(dtype)
    fresh = (
        x is not update
    )  # a cast: worked on in place, as torch does; else the caller's (a momentum buffer)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # (n, m): the Gram matrix below is the smaller side's
    norm = x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1 after the division
    x = x.div_(norm) if fresh else x / norm
    for _ in range(ns_steps):
        gram = x @ x.T  # (m, m)
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A
        x = torch.addmm(x, gram_update, x, beta=a)  # a X + (b A + c A A) X
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (its arguments, checks, groups and state) with its Newton-Schulz iteration in
    ``ns_dtype`` (:func:`newton_schulz`); the update is torch's ``_single_tensor_muon``, step for step.

    Args:
        params: 2-D parameters or their groups.
        ns_dtype: the iteration's dtype; ``torch.bfloat16`` is ``torch.optim.Muon`` exactly.
        **kwargs: ``torch.optim.Muon``'s (``lr``, ``momentum``, ``nesterov``, ``ns_steps``, ``adjust_lr_fn``, ...).

    Raises:
        ValueError: as ``torch.optim.Muon`` (a tensor that is not 2-D, a negative ``lr``, ...).
    """

    def __init__(self, params: Iterable[Any], ns_dtype: torch.dtype = torch.bfloat16, **kwargs: Any):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon update of every matrix with a gradient.

        Args:
            closure: called with grad enabled before the update; its result is returned.
        """
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr = _muon._to_scalar(group["lr"])
            momentum = group["momentum"]
            for param, grad, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype
                )
                adjusted_lr = _muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr)
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the groups whose ``algorithm`` is ``muon``, ``torch.optim.AdamW`` on the others.

    One optimizer to the training loop, checkpoints and DCP: ``param_groups`` are both optimizers' groups (the same
    dicts, in the order given), ``state`` is one mapping both write to, and ``state_dict()`` has a plain
    optimizer's layout. Muon keeps one momentum buffer per matrix (Jordan et al. 2024, "Muon: An optimizer for
    hidden layers in neural networks"); its update is orthogonalised by torch's Newton-Schulz iteration, in the
    dtype of ``ns_dtype`` (:func:`newton_schulz_dtype`: bf16 on CUDA and on CPUs with bf16 matrix instructions,
    fp32 on others).

    Args:
        params: parameter groups with ``algorithm`` ``muon`` (2-D tensors only) or ``adamw``.
        lr: learning rate of both (a group's own ``lr`` wins; the training loop sets them each step).
        betas: AdamW's.
        eps: AdamW's.
        momentum: Muon's.
        nesterov: Muon's.
        ns_steps: Muon's Newton-Schulz iterations.
        adjust_lr_fn: Muon's per-shape learning-rate rule, ``match_rms_adamw`` or ``original``.
        ns_dtype: ``optimizer.muon_ns_dtype``: ``auto``, ``fp32`` or ``bf16``, resolved for the device of the
            first matrix (recorded as ``ns_dtype``, a ``torch.dtype``).

    Raises:
        ValueError: a ``muon`` group holds a tensor that is not 2-D (torch's Muon says so), or an unknown
            ``ns_dtype``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_dtype: str = "auto",
    ):
        groups = _groups(params, "muon")
        muon = [g for g in groups if g.get("algorithm") == "muon"]
        adamw = [g for g in groups if g.get("algorithm") != "muon"]
        for g in adamw:
            g["algorithm"] = "adamw"
        first = next((p for g in muon for p in g["params"]), None)
        self.ns_dtype = newton_schulz_dtype(ns_dtype, first.device.type if first is not None else "cpu")
        self._muon = (
            Muon(
                muon,
                ns_dtype=self.ns_dtype,
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
            )
            if muon
            else None
        )
        self._adamw = torch.optim.AdamW(adamw, lr=lr, betas=tuple(betas), eps=eps) if adamw else None
        super().__init__(groups, {"lr": lr})
        self._link()

    def _parts(self) -> Iterator[torch.optim.Optimizer]:
        return (opt for opt in (self._muon, self._adamw) if opt is not None)

    def _link(self) -> None:
        """Point both optimizers at this one's groups and state (after construction and after a load, which
        replaces them)."""
        for opt, algorithm in ((self._muon, "muon"), (self._adamw, "adamw")):
            if opt is not None:
                opt.param_groups = [g for g in self.param_groups if g["algorithm"] == algorithm]
                opt.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step of the matrices and one AdamW step of the rest.

        Args:
            closure: called with grad enabled before the update; its result is returned.
        """
        loss = _closure_loss(closure)
        for opt in self._parts():
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (a plain optimizer's layout) and re-link both optimizers to it."""
        super().load_state_dict(state_dict)
        self._link()


@functools.cache
def apollo_class() -> type[torch.optim.Optimizer]:
    """``apollo_torch.APOLLOAdamW`` for memfit's groups; imports the package (which imports transformers) once."""
    with quiet_bitsandbytes_import():  # it imports bitsandbytes (for its 8-bit variant) and transformers
        from apollo_torch import APOLLOAdamW  # deferred: seconds to import

    class Apollo(APOLLOAdamW):
        """APOLLO on the groups whose ``algorithm`` is ``apollo``, its own AdamW on the rest.

        A projected group is split by projection rank (:func:`projection_rank`: a matrix
        smaller than the rank is projected to its smaller side) and given APOLLO's group settings: random
        projection (``proj: random``, ``proj_type: std``), channel-wise scaling with ``scale`` 1 (``apollo``) or
        tensor-wise with 128 (``apollo_mini``), a new projection every ``update_proj_gap`` steps.

        Between steps each projector is kept in the parameter's state as ``ortho_matrix`` (the r x n or m x r
        projection) and ``projector_seed`` (the seed of the next one) instead of the package's Python object, so
        the state is tensors and numbers: it checkpoints, loads with ``torch.load(weights_only=True)`` and is
        counted as ``optimizer_state``. Each parameter's first seed is its position among the trainable
        parameters (from 1, as the package numbers them), ``first_seed`` for the first.

        Args:
            params: memfit's parameter groups.
            lr: learning rate (the training loop sets each group's).
            betas: AdamW's.
            eps: AdamW's.
            apollo_rank: projection rank; 0: the variant's default.
            apollo_scale: APOLLO's scale alpha (the update is multiplied by ``sqrt(alpha)``); 0: the default.
            update_proj_gap: steps between new projections.
            dim: the model width (the default rank of ``apollo``).
            variant: ``apollo`` or ``apollo_mini``.
            first_seed: the first parameter's seed.
        """

        def __init__(
            self,
            params: Iterable[Any],
            lr: float = 1e-3,
            betas: tuple[float, float] = (0.9, 0.999),
            eps: float = 1e-6,
            apollo_rank: int = 0,
            apollo_scale: float = 0.0,
            update_proj_gap: int = 200,
            dim: int = 0,
            variant: str = "apollo",
            first_seed: int = 1,
        ):
            mini = variant == "apollo_mini"
            settings = {
                "proj": "random",
                "proj_type": "std",
                "scale_type": "tensor" if mini else "channel",
                "scale": apollo_scale or (128.0 if mini else 1.0),
                "update_proj_gap": update_proj_gap,
            }
            order: list[torch.Tensor] = []
            groups = []
            for g in _groups(params, "apollo"):
                order += g["params"]
                if g.get("algorithm") != "apollo":
                    groups.append(g)
                    continue
                names = g.get("param_names", [None] * len(g["params"]))
                by_rank: dict[int, list] = {}
                for name, p in zip(names, g["params"], strict=True):
                    r = projection_rank(variant, apollo_rank, dim, tuple(p.shape))
                    by_rank.setdefault(r, []).append((name, p))
                hyper = {k: v for k, v in g.items() if k not in _GROUP_ONLY}
                for r, members in by_rank.items():
                    group = {**hyper, **settings, "rank": r, "params": [p for _, p in members]}
                    if "param_names" in g:
                        group["param_names"] = [n for n, _ in members]
                    groups.append(group)
            super().__init__(groups, lr=lr, betas=tuple(betas), eps=eps)
            for i, p in enumerate(order):  # the package numbers them in its own group order
                self.state[p]["seed"] = first_seed + i

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            """The package's step, with the projectors rebuilt from the state before it and put back after it."""
            projected = [(g, p) for g in self.param_groups if "rank" in g for p in g["params"]]
            for group, p in projected:
                state = self.state[p]
                if "ortho_matrix" in state:
                    projector = self._initialize_projector(group, state)
                    projector.ortho_matrix = state.pop("ortho_matrix")
                    projector.seed = state.pop("projector_seed")
                    state["projector"] = projector
            try:
                return super().step(closure)
            finally:
                for _, p in projected:
                    projector = self.state[p].pop("projector", None)
                    if projector is not None:
                        self.state[p]["ortho_matrix"] = projector.ortho_matrix
                        self.state[p]["projector_seed"] = projector.seed

    return Apollo


@functools.cache
def adam_mini_class() -> type[torch.optim.Optimizer]:
    """``adam_mini.Adam_mini`` for memfit's groups; imports the package once."""
    from adam_mini import Adam_mini  # deferred: only runs that use it

    tags = {"heads": "@heads", "rows": "@rows", "tensor": "@tensor"}

    class AdamMini(Adam_mini):
        """Adam-mini over memfit's partition: each group's ``algorithm`` (``heads``, ``rows`` or ``tensor``,
        :func:`memfit.memory.optimizers.part_of`) picks the package's branch, by a tag put before the parameter's
        name (the package matches substrings of names; the tags match nothing else). Each parameter becomes a
        group of its own, as the package makes them, with the weight decay of the memfit group it came from.

        ``world_size`` is 1: a 1-D tensor's block norm is this process's (the package would all-gather across
        every visible GPU even in one process).

        Args:
            params: memfit's parameter groups.
            lr: learning rate (the training loop sets each group's).
            betas: Adam's.
            eps: Adam's.
            dim: the model width; with ``num_heads`` it sets the size of a q/k head block, ``dim * dim /
                num_heads``.
            num_heads: query heads.
            num_kv_heads: key/value heads.
            head_dim: the size of one head where it is not ``dim // num_heads`` (Qwen3-0.6B's 128 at width
                1,024 and 16 heads): the package's block of ``dim * dim / n_heads`` elements is then given
                ``n_heads = dim // head_dim``, so that a block is still one head's rows (``head_dim x dim``).

        Raises:
            ConfigError: naming ``optimizer.name``, when ``head_dim`` does not divide ``dim`` (the package's head
                blocks cannot be one head's rows).
        """

        def __init__(
            self,
            params: Iterable[Any],
            lr: float = 1e-3,
            betas: tuple[float, float] = (0.9, 0.999),
            eps: float = 1e-8,
            dim: int = 2048,
            num_heads: int = 32,
            num_kv_heads: int | None = None,
            head_dim: int | None = None,
        ):
            if head_dim is not None and head_dim * num_heads != dim:
                if dim % head_dim:
                    raise ConfigError(
                        f"config key 'optimizer.name': adam_mini keeps one second moment per query/key head, a "
                        f"block of dim x dim / num_heads elements, which is one head's rows only where head_dim "
                        f"divides dim; this model's head_dim {head_dim} does not divide its dim {dim}. Use "
                        f"another optimizer (adamw, adafactor, muon)"
                    )
                num_heads, num_kv_heads = dim // head_dim, None  # blocks of head_dim x dim elements
            named, decays = [], []
            for g in _groups(params, "rows"):
                names = g.get("param_names") or [str(i) for i in range(len(g["params"]))]
                for name, p in zip(names, g["params"], strict=True):
                    named.append((f"{tags[g['algorithm']]}:{name}", p))
                    decays.append(g.get("weight_decay", 0.0))
            super().__init__(
                named,
                lr=lr,
                betas=tuple(betas),
                eps=eps,
                weight_decay=0.0,
                dim=dim,
                n_heads=num_heads,
                n_kv_heads=num_kv_heads,
                verbose=False,
            )
            for group, decay in zip(self.param_groups, decays, strict=True):
                group["weight_decay"] = decay
            self.embd_names, self.output_names, self.wv_names, self.attn_proj_names = (
                set(),
                set(),
                set(),
                set(),
            )
            self.wqk_names, self.mlp_names, self.adam_block_names = {tags["heads"]}, {tags["rows"]}, set()
            self.world_size = 1
            self.check_block_name = False  # its name census prints advice for names it matches itself

    return AdamMini


def apollo_variant(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The class memfit builds for ``optimizer.name`` ``apollo`` or ``apollo_mini`` (its entry's factory)."""
    return functools.partial(apollo_class(), variant=name)


LOW_BIT_CHUNK_ELEMENTS = 2**20
"""Elements of one chunk of a tensor that :func:`low_bit_class`'s eager update handles at a time (4 MiB of fp32):
the update's fp32 temporaries (the dequantized moments, their new values, the denominator, the new parameter)
exist for one chunk at a time instead of for the whole tensor. Measured on a Llama-3.2-3B-shaped full fine-tune of
4 layers on CPU (4-bit AdamW in backward, fp32, 1 x 512 tokens): chunks of 2**22 elements stepped in 76-78 s and
peaked at 6.43 GiB RSS with 0.3-0.6 GiB of glibc's heap free; 2**20, 61-62 s and 6.06 GiB with 0.15-0.22 GiB free
(the temporaries fit the caches and the holes other tensors leave); 2**18, 73-75 s (a Python call per 2**18 values)."""


def _row_chunks(p: torch.Tensor, block_size: int, chunk_elements: int) -> list[tuple[int, int] | None]:
    """``[start, end)`` ranges of ``p``'s first dimension of at most ``chunk_elements`` elements each (one row at the
    least) whose element offsets fall on the quantization blocks of ``block_size`` values (torchao's state tensors
    slice along the first dimension on block boundaries only); ``[None]`` (the whole tensor, unsliced) for a tensor
    that fits in one chunk."""
    if p.dim() < 1 or p.numel() <= chunk_elements:
        return [None]
    rows, row_numel = p.shape[0], max(1, p.numel() // p.shape[0])
    step = block_size // math.gcd(row_numel, block_size)  # rows per block-aligned unit
    size = max(step, chunk_elements // row_numel // step * step)
    return [(s, min(rows, s + size)) for s in range(0, rows, size)]


def traced_chunks(chunks: list, p: torch.Tensor) -> list:
    """The chunks of ``p`` to update: all of them, but on fake tensors (an estimate) only the first and the last.

    The chunks before the last are all of one size, and each one's update allocates its temporaries and frees them
    before the next begins, on views of the parameter, gradient and state: on fake tensors, where no value is
    computed, each makes the very allocations and frees of the first, so the peak and the timeline's bytes are
    those of the first and the last traced alone, with fewer events (a 3B model's tied embedding: 2 chunks traced
    instead of 94; composed == full and every chunk traced == these two, to the byte, tested).
    """
    if len(chunks) > 2 and isinstance(p, FakeTensor):
        return [chunks[0], chunks[-1]]
    return chunks


@functools.cache
def low_bit_class(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """torchao's low-bit AdamW ``base`` (``torchao.optim.AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``), made to accept a
    float ``lr`` and, off CUDA, to update each large tensor chunk by chunk.

    On CUDA torchao compiles its per-tensor update (``torchao.optim.adam.single_param_adam``) into one fused kernel.
    Elsewhere it runs eagerly, and each of its elementwise steps makes an fp32 tensor of the parameter's size: about
    seven fp32 copies of the largest tensor at once (a 3B model's 394M-parameter tied embedding: 10.3 GiB). Here the
    eager update runs the same function on row chunks of :data:`LOW_BIT_CHUNK_ELEMENTS` elements whose boundaries
    fall on the quantization blocks: the same arithmetic element by element and block by block (bit-identical
    results), with temporaries of one chunk. A sharded (``DTensor``) parameter is chunked on its local shard.
    """

    class _LowBitAdamW(base):  # type: ignore[misc, valid-type]
        memfit_rounds_natively = True  # each chunk's update is rounded by memfit_bf16_rounding in _update
        memfit_bf16_rounding = "nearest"  # build_optimizer sets the run's bf16_rounding

        @torch.no_grad()
        def step(self, closure=None):
            # torchao keeps lr as a tensor (so a new value does not recompile); the training loop sets a float.
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
            if self.param_groups[0]["params"][0].device.type == "cuda":
                # compiled whole: torchao's own stochastic rounding (config validation refuses kahan here)
                self.bf16_stochastic_round |= self.memfit_bf16_rounding == "stochastic"
                return super().step(closure)
            loss = _closure_loss(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(group, p)
            return loss

        def create_state(self) -> None:
            """Create now, as zeros, the state the first step would create for each trainable parameter that has
            none (a resumed run's loaded state is kept): the same tensors with the same values, made together
            instead of one parameter at a time between the first backward's temporaries (memory/host.py)."""
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        self._create_state(group, p)

        def _create_state(self, group: dict, p: torch.Tensor) -> dict:
            """``p``'s state, created as torchao's step creates it where it has none."""
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = self._new_buffer(p, True)
                state["exp_avg_sq"] = self._new_buffer(p, False)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = self._new_buffer(p, False)
                rounding.compensation_of(state, p, self.memfit_bf16_rounding)
            return state

        def _update(self, group: dict, p: torch.Tensor) -> None:
            """torchao's per-tensor step (state creation, step count, ``single_param_adam``), chunk by chunk."""
            from torchao.optim.adam import single_param_adam  # deferred: torchao takes seconds to import

            if p.grad.is_sparse:
                raise RuntimeError("Sparse gradient is not supported")
            state = self._create_state(group, p)
            state["step"] += 1
            names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", rounding.COMPENSATION)
            tensors = [_local(p.detach()), _local(p.grad)] + [_local(state.get(n)) for n in names]
            mode = self.memfit_bf16_rounding
            bf16_sr = self.bf16_stochastic_round and p.dtype is torch.bfloat16 and mode == "nearest"
            for chunk in traced_chunks(
                _row_chunks(tensors[0], self.block_size, LOW_BIT_CHUNK_ELEMENTS), tensors[0]
            ):
                # the slices live only through their call: a quantized state's slice carries its own code table
                pc, gc, m, v, vmax, comp = (
                    t if t is None or chunk is None else t[chunk[0] : chunk[1]] for t in tensors
                )
                # bf16_rounding: the chunk's update computed on an fp32 copy of it, rounded back
                with rounding.rounded(pc, mode, comp) as target:
                    single_param_adam(target, gc, state["step"], m, v, vmax, group["lr"], group["betas"][0],
                                      group["betas"][1], group["weight_decay"], group["eps"], self.is_adamw,
                                      bf16_sr)  # fmt: skip
                del pc, gc, m, v, vmax, comp

    _LowBitAdamW.__name__ = _LowBitAdamW.__qualname__ = f"Memfit{base.__name__}"
    return _LowBitAdamW


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A ``DTensor``'s local shard (the update is elementwise, so each rank updates its own), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


__all__ = [
    "NEWTON_SCHULZ_DTYPES",
    "Muon",
    "MuonWithAdamW",
    "adam_mini_class",
    "apollo_class",
    "apollo_variant",
    "cpu_bf16_matmuls_fast",
    "low_bit_class",
    "newton_schulz",
    "newton_schulz_dtype",
    "projection_rank",
]
