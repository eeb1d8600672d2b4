"""The Llama architecture (Llama 2, Llama 3, 3.1, 3.2): RMSNorm, RoPE, grouped-query attention, SwiGLU.

With the options the other families memfit builds need (:mod:`memfit.models.families`), each a field of
:class:`LlamaConfig` whose default is Llama's: an explicit ``head_dim`` (Mistral, Qwen3), biases on the q, k and v
projections (Qwen2), an RMSNorm of each query and key head before RoPE (Qwen3), a sliding attention window
(Mistral v0.1), and Gemma 2/3's: GeGLU, ``(1 + w)`` norms before and after attention and MLP, embeddings times
``sqrt(dim)``, ``query_pre_attn_scalar``, local and global layers (``layer_types``) with their own RoPE bases,
soft-capped attention scores and logits.

Architecture only. Checkpointing, sharding, LoRA, optimizer hooks and dtype policy are applied to a built model
from outside. Submodules are named like Hugging Face's ``LlamaForCausalLM`` so that state dicts load into each
other with ``strict=True``.

Shape letters used in comments: B batch, T sequence length, C model width (``dim``), nh query heads, nkv key/value
heads, hd head size (``head_dim``, by default ``dim // num_heads``), W sliding window, I SwiGLU hidden size, V
vocabulary size.

The forward pass has no host syncs and no data-dependent Python branching, so it runs under
``torch._subclasses.fake_tensor.FakeTensorMode`` on a model of any size built on the meta device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.models.attention import document_attention, softcapped_attention
from memfit.models.tiles import representative

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of embeddings and linear weights (GPT-2, Llama)."""
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
"""Values of :attr:`LlamaConfig.mlp_activation`."""
LAYER_TYPES = ("sliding_attention", "full_attention")
"""Values in :attr:`LlamaConfig.layer_types` (transformers' names)."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 ("llama3") RoPE frequency scaling, the ``rope_scaling`` block of a Llama 3.1/3.2 config.json.

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept, those longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and those in between are
    interpolated smoothly.
    """

    factor: float = 8.0
    """Divisor of the low frequencies."""
    low_freq_factor: float = 1.0
    """``original_max_position_embeddings / low_freq_factor`` is the wavelength above which frequencies are scaled."""
    high_freq_factor: float = 4.0
    """``original_max_position_embeddings / high_freq_factor`` is the wavelength below which nothing changes."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pretrained with before the extension."""

    def __post_init__(self) -> None:
        """Validate the fields.

        Raises:
            ValueError: naming the field, when a factor or the context length is not positive, or when
                ``high_freq_factor <= low_freq_factor`` (the smoothing would divide by zero).
        """
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RopeScaling.{name} must be positive, got {getattr(self, name)!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must be greater than "
                f"low_freq_factor ({self.low_freq_factor})"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama model; named sizes live in ``memfit.models.presets``.

    Raises:
        ValueError: naming the field, from ``__post_init__``, when a size is not a positive int, ``norm_eps`` or
            ``rope_theta`` is not positive, ``dim`` is not divisible by ``num_heads``, ``num_heads`` is not
            divisible by ``num_kv_heads``, the head size is odd (RoPE rotates pairs), ``head_dim`` or
            ``sliding_window`` is neither None nor a positive int, or ``rope_scaling`` is neither None, a
            ``RopeScaling`` nor a dict of its fields. (Without an explicit ``head_dim``, ``dim`` must be divisible
            by ``num_heads``.)
    """

    vocab_size: int
    """Number of token ids, V."""
    dim: int
    """Hidden size C (HF ``hidden_size``)."""
    num_layers: int
    """Number of decoder layers (HF ``num_hidden_layers``)."""
    num_heads: int
    """Number of query heads nh (HF ``num_attention_heads``)."""
    num_kv_heads: int
    """Number of key/value heads nkv for grouped-query attention; ``== num_heads`` is plain multi-head attention."""
    intermediate_size: int
    """SwiGLU hidden size I."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (HF ``rms_norm_eps``)."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 frequency scaling, or None for plain RoPE. A dict of ``RopeScaling`` fields is converted."""
    max_seq_len: int = 2048
    """Context length the model is meant for (HF ``max_position_embeddings``); not enforced in ``forward``."""
    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    head_dim: int | None = None
    """Size of one attention head, hd; None (the default) is ``dim // num_heads``, which ``__post_init__`` writes
    here (so ``dataclasses.replace(config, dim=...)`` keeps the old head size: pass ``head_dim=None`` too).
    Mistral and Qwen3 checkpoints set it explicitly (Qwen3-8B: 128 with ``dim // num_heads`` = 128, Qwen3-0.6B:
    128 where it would be 64)."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2 / Qwen2.5); ``o_proj`` and the MLP never have one."""
    qk_norm: bool = False
    """RMSNorm of each query and key head (a weight of hd each, ``q_norm`` and ``k_norm``) before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Each query attends to at most this many keys, itself and the ``sliding_window - 1`` before it, in every
    layer (Mistral v0.1: 4096); None attends to all earlier keys."""
    family: str = "llama"
    """The checkpoint family (:mod:`memfit.models.families`): which Hugging Face ``model_type`` and
    ``architectures`` an export writes. The computation is set by the fields above and below alone."""
    mlp_activation: str = "silu"
    """The gate's activation in the gated MLP: ``"silu"`` (SwiGLU, Llama's) or ``"gelu_tanh"`` (GeGLU with the
    tanh approximation of GELU, Gemma's ``gelu_pytorch_tanh``)."""
    norm_plus_one: bool = False
    """Every RMSNorm scales by ``1 + weight`` in fp32 and casts after (Gemma), rather than ``weight`` times the
    normed rows cast to the input dtype (Llama); its weights start at zeros."""
    sandwich_norms: bool = False
    """Norms before and after attention and MLP (Gemma 2/3): ``x + post_attention_layernorm(attn(
    input_layernorm(x)))``, then ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``."""
    scale_embeddings: bool = False
    """The token embeddings are multiplied by ``sqrt(dim)`` (rounded to fp32, then to the embedding's dtype, as
    transformers' Gemma does); a tied ``lm_head`` uses the unscaled matrix."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma: 256); None is ``head_dim ** -0.5``."""
    attn_logit_softcapping: float | None = None
    """Attention scores are capped to ``cap * tanh(scores / cap)`` before the mask and softmax (Gemma 2: 50.0)."""
    final_logit_softcapping: float | None = None
    """Logits are capped to ``cap * tanh(logits / cap)`` (Gemma 2: 30.0): in ``forward``, in the chunked
    cross-entropy and so in generation."""
    layer_types: tuple[str, ...] | None = None
    """Per layer ``"sliding_attention"`` (a local layer: the ``sliding_window``, RoPE base
    ``rope_local_base_freq``) or ``"full_attention"`` (a global layer: every earlier key, ``rope_theta`` and
    ``rope_linear_factor``); None makes every layer alike (``sliding_window`` in each when set)."""
    rope_local_base_freq: float | None = None
    """RoPE base of the local layers (Gemma 3: 10,000 where the global layers' is 1,000,000); None is
    ``rope_theta``."""
    rope_linear_factor: float | None = None
    """Linear RoPE scaling of the global layers (every layer's without ``layer_types``): positions divided by it
    (Gemma 3 4B: 8.0); None scales nothing."""

    def __post_init__(self) -> None:
        """Validate the fields and convert a dict ``rope_scaling`` to ``RopeScaling``.

        Raises:
            ValueError: see the class docstring.
        """
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_seq_len"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        for name in ("head_dim", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"LlamaConfig.{name} must be None or a positive int, got {value!r}")
        derived = self.head_dim is None
        if derived:
            if self.dim % self.num_heads != 0:
                raise ValueError(
                    f"LlamaConfig.dim ({self.dim}) must be divisible by num_heads ({self.num_heads}), or head_dim "
                    f"given"
                )
            object.__setattr__(self, "head_dim", self.dim // self.num_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"LlamaConfig.{'dim // num_heads' if derived else 'head_dim'} ({self.head_dim}) must be even: RoPE "
                f"rotates pairs of channels"
            )
        if isinstance(self.rope_scaling, dict):
            known = {f.name for f in fields(RopeScaling)}
            unknown = sorted(set(self.rope_scaling) - known)
            if unknown:
                raise ValueError(
                    f"LlamaConfig.rope_scaling has unknown keys {unknown}; known: {sorted(known)}"
                )
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"LlamaConfig.rope_scaling must be None, a RopeScaling or a dict, got {self.rope_scaling!r}"
            )
        self._check_gemma_fields()

    def _check_gemma_fields(self) -> None:
        """Validate the fields of Gemma's options (``mlp_activation`` ... ``rope_linear_factor``).

        Raises:
            ValueError: naming the field: an unknown ``mlp_activation``, a scalar or cap that is not a positive
                number, ``layer_types`` not of ``num_layers`` known kinds, or local layers without a
                ``sliding_window``.
        """
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"LlamaConfig.mlp_activation must be one of {list(MLP_ACTIVATIONS)}, got {self.mlp_activation!r}"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_base_freq", "rope_linear_factor"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ValueError(f"LlamaConfig.{name} must be None or a positive number, got {value!r}")
        if self.layer_types is not None:
            kinds = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", kinds)
            if len(kinds) != self.num_layers or set(kinds) - set(LAYER_TYPES):
                raise ValueError(
                    f"LlamaConfig.layer_types must hold {self.num_layers} (num_layers) of {list(LAYER_TYPES)}, got "
                    f"{list(kinds)}"
                )
            if "sliding_attention" in kinds and self.sliding_window is None:
                raise ValueError(
                    "LlamaConfig.layer_types has sliding_attention layers but sliding_window is None"
                )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer ``layer``: ``sliding_window`` on a local layer (every layer without
        ``layer_types``), None on a global one."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_is_local(self, layer: int) -> bool:
        """Whether layer ``layer`` takes the local RoPE tables (``rope_local_base_freq``, a ``layer_types``
        pattern)."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def layer_attended_keys(self, seq_len: int) -> tuple[int, ...]:
        """Keys the last query of a sequence of ``seq_len`` tokens attends to, in each layer.

        Args:
            seq_len: tokens per sequence T.

        Returns:
            Per layer T, or W on a layer whose sliding window W is shorter than T.
        """
        windows = (self.layer_window(i) for i in range(self.num_layers))
        return tuple(seq_len if w is None else min(seq_len, w) for w in windows)

    def attended_keys(self, seq_len: int) -> int:
        """Keys the last query of a sequence of ``seq_len`` tokens attends to: ``min(seq_len, sliding_window)``.

        Args:
            seq_len: tokens per sequence T.

        Returns:
            T, or W when a sliding window shorter than T caps it.
        """
        return seq_len if self.sliding_window is None else min(seq_len, self.sliding_window)

    def num_params(self) -> int:
        """Number of parameters in closed form, the tied embedding counted once.

        Returns:
            The count that ``sum(p.numel() for p in Llama(config).parameters())`` gives.
        """
        C, hd, I = self.dim, self.head_dim, self.intermediate_size  # noqa: E741
        attention = C * self.num_heads * hd * 2 + C * self.num_kv_heads * hd * 2  # q, o + k, v
        if self.attention_bias:
            attention += (self.num_heads + 2 * self.num_kv_heads) * hd  # q, k, v biases
        if self.qk_norm:
            attention += 2 * hd  # q_norm, k_norm
        mlp = 3 * C * I  # gate, up, down
        layer = attention + mlp + (4 if self.sandwich_norms else 2) * C  # + the RMSNorms
        embeddings = self.vocab_size * C * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + C  # + final RMSNorm


def rope_inv_freq(
    config: LlamaConfig, device: torch.device | str | None = None, local: bool = False
) -> Tensor:
    """RoPE inverse frequencies, computed in float32 exactly as Hugging Face does (including "llama3" scaling).

    Args:
        config: the model config; uses ``head_dim``, ``rope_theta``, ``rope_scaling`` and
            ``rope_linear_factor``, or ``rope_local_base_freq`` alone for the local layers.
        device: where to put the result (meta works).
        local: the tables of the local (``sliding_attention``) layers: base ``rope_local_base_freq``, unscaled.

    Returns:
        Float32 tensor of shape (hd // 2,): ``theta ** (-2i / hd)``, scaled when ``config.rope_scaling`` is set,
        divided by ``rope_linear_factor`` when it is.
    """
    hd = config.head_dim
    exponent = torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd  # (hd/2,)
    if local:
        return 1.0 / (config.rope_local_base_freq**exponent)  # (hd/2,)
    inv_freq = 1.0 / (config.rope_theta**exponent)  # (hd/2,)
    if config.rope_linear_factor is not None:  # transformers' "linear" rope type
        inv_freq = inv_freq / config.rope_linear_factor
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (hd/2,)
    # Long wavelengths are divided by the factor, short ones kept, the ones in between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


NORM_CHUNK_ELEMENTS = 2**24
"""Elements of one chunk of rows that :class:`RMSNorm` normalises at a time (64 MiB of fp32): its fp32 work exists
for one chunk at a time, whatever the sequence length."""


def _norm_chunks(rows: Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``rows`` (N, C) of at most :data:`NORM_CHUNK_ELEMENTS` elements each, those a loop
    runs (:func:`memfit.models.tiles.representative`)."""
    n, width = rows.shape
    size = max(1, NORM_CHUNK_ELEMENTS // width)
    chunks = [(s, min(n, s + size)) for s in range(0, n, size)]
    return [chunks[i] for i in representative(len(chunks), rows)]


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` chunk of rows by chunk of rows, keeping for the
    backward only ``x`` (which the caller keeps anyway: the residual stream) and the per-row ``rsqrt`` in fp32.

    Autograd of the plain expression keeps the fp32 copy of ``x`` and the normalised rows, ``8 * dim`` bytes per
    token beside ``x`` in bf16, and its backward makes several fp32 ``(rows, dim)`` tensors at once; here fp32 work
    exists for one chunk (:data:`NORM_CHUNK_ELEMENTS`) at a time, forward and backward. Same arithmetic: the output
    is bit-identical, the gradients agree to fp32 rounding.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, plus_one=False):  # noqa: D102 (autograd's signature)
        rows = x.reshape(-1, x.shape[-1])  # (N, C)
        dtype = x.dtype if plus_one else torch.promote_types(weight.dtype, x.dtype)
        out = torch.empty(rows.shape, dtype=dtype, device=x.device)  # (N, C)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)  # (N, 1)
        scale = weight.float() + 1.0 if plus_one else None  # (C,) Gemma's (1 + w) in fp32
        for s, e in _norm_chunks(rows):
            x32 = rows[s:e].float()  # (n, C): a copy in low precision, ``rows[s:e]`` itself in fp32
            torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps), out=rstd[s:e])
            if plus_one:  # ``(normed * (1 + w)).to(x.dtype)``: the product in fp32, cast after (Gemma)
                out[s:e] = (x32 * rstd[s:e]) * scale
            else:  # ``weight * normed.to(x.dtype)`` written straight into the output: no temporary of the product
                torch.mul(weight, (x32 * rstd[s:e]).to(x.dtype), out=out[s:e])
        ctx.save_for_backward(x, weight, rstd)
        ctx.plus_one = plus_one
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        x, weight, rstd = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])  # (N, C)
        grads = grad_out.reshape(-1, grad_out.shape[-1])  # (N, C)
        need_x, need_weight = ctx.needs_input_grad[:2]
        plus_one = ctx.plus_one
        grad_x = torch.empty_like(rows) if need_x else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        scale = weight.float() + 1.0 if plus_one else None  # (C,)
        for s, e in _norm_chunks(rows):
            # (n, C) fp32: x / rms(x), a new tensor (scaled in place below)
            normed = rows[s:e].float() * rstd[s:e]
            g = grads[s:e]
            if need_weight and plus_one:  # d/dw of normed * (1 + w), in fp32
                grad_weight += (g.float() * normed).sum(0)
            elif (
                need_weight
            ):  # the product in the output's dtype, summed over rows in fp32 (as autograd's sum does)
                grad_weight += (g * normed.to(x.dtype)).sum(0, dtype=torch.float32)
            if need_x:
                # (n, C): d loss / d normed (the cast's gradient is a cast back)
                dn = g.float() * scale if plus_one else (g * weight).float()
                # d/dx of x * rstd(x): rstd * (dn - normed * mean(dn * normed)), written into grad_x (cast there)
                mean = (dn * normed).mean(-1, keepdim=True)  # (n, 1)
                torch.mul(dn.sub_(normed.mul_(mean)), rstd[s:e], out=grad_x[s:e])
        return (
            grad_x.view_as(x) if need_x else None,
            grad_weight.to(weight.dtype) if need_weight else None,
            None,
            None,
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back to the input dtype before the scale (like HF).

    Computed chunk of rows by chunk of rows with a backward of its own (:class:`_RMSNormFunction`): the same
    numbers as the plain expression, without its fp32 copies of the whole input (16 KiB per token for Llama-3-8B's
    width, twice a layer) between forward and backward.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square.
        plus_one: scale by ``1 + weight`` in fp32 and cast after (Gemma's norm; its weight starts at zeros).
    """

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise the last dimension.

        Args:
            x: (..., C) activations of any floating dtype.

        Returns:
            (..., C), ``weight * (x / rms(x))`` with the normalisation done in float32 (``plus_one``:
            ``(1 + weight) * (x / rms(x))`` all in float32, in ``x``'s dtype).
        """
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.plus_one)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", plus_one" if self.plus_one else "")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables in Hugging Face's ``rotate_half`` layout: ``cat(freqs, freqs)``.

    ``inv_freq`` is a non-persistent float32 buffer: it is derived from the config, so it is not in the state dict,
    and a dtype cast of the model (``model.to(torch.bfloat16)``) leaves it in float32. ``to_empty`` leaves it
    uninitialised like every other tensor; ``reset_parameters`` (called by ``Llama.init_weights`` and
    ``build_llama``) recomputes it.

    Args:
        config: the model config.
        local: the tables of the local layers (:func:`rope_inv_freq`'s ``local``).
    """

    def __init__(self, config: LlamaConfig, local: bool = False) -> None:
        super().__init__()
        self.config = config
        self.local = local
        self.register_buffer("inv_freq", rope_inv_freq(config, local=local), persistent=False)

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute ``inv_freq`` in float32 on ``device`` (default: the device it lives on)."""
        device = self.inv_freq.device if device is None else device
        self.inv_freq = rope_inv_freq(self.config, device=device, local=self.local)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RotaryEmbedding:
        # nn.Module.to(dtype) casts floating buffers too; keep the frequencies in float32 (moves still apply).
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != inv_freq.dtype:
            self.inv_freq = inv_freq.to(device=self.inv_freq.device)
        return self

    def forward(self, positions: int | Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Cosine and sine tables for the given positions.

        Args:
            positions: T (positions ``0 .. T - 1``), a (T,) int tensor of positions, or a (B, T) one (packed
                sequences, where each sample's positions restart at 0).
            dtype: dtype of the activations the tables multiply.

        Returns:
            ``(cos, sin)``, each (T, hd) for an int or a (T,) tensor, or (B, 1, T, hd) for a (B, T) tensor
            (broadcasting over heads); computed in float32 and cast to ``dtype``.
        """
        if isinstance(positions, int):
            pos = torch.arange(positions, device=self.inv_freq.device, dtype=torch.float32)  # (T,)
        elif positions.dim() == 1:
            pos = positions.float()  # (T,)
        else:
            pos = positions.float()[:, None, :]  # (B, 1, T)
        freqs = pos[..., None] * self.inv_freq.float()  # (T, hd/2) or (B, 1, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd) or (B, 1, T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class _RopeFunction(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` (``rotate_half``: ``(x1, x2) -> (-x2, x1)`` over the halves of hd) and its
    gradient ``g * cos - rotate_half(g * sin)``, each as one full-size product and two half-size ones updated in
    place: autograd of the plain expression runs five full-size kernels forward (the two products, the negation,
    the concatenation, the sum) and as many backward; this takes ~2/3 of its time on CPU. Bit-identical to it,
    forward and backward (the same products, summed in the same pairs); keeps only ``cos`` and ``sin`` for the
    backward.
    """

    @staticmethod
    def forward(ctx, x, cos, sin):  # noqa: D102 (autograd's signature)
        h = x.shape[-1] // 2
        out = x * cos  # (..., hd)
        out[..., :h].sub_(x[..., h:] * sin[..., :h])  # x1 cos - x2 sin
        out[..., h:].add_(x[..., :h] * sin[..., h:])  # x2 cos + x1 sin
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        cos, sin = ctx.saved_tensors
        h = grad_out.shape[-1] // 2
        grad_x = grad_out * cos  # (..., hd)
        grad_x[..., :h].add_(grad_out[..., h:] * sin[..., h:])  # g1 cos + g2 sin
        grad_x[..., h:].sub_(grad_out[..., :h] * sin[..., :h])  # g2 cos - g1 sin
        return grad_x, None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate query or key heads by their position: ``x * cos + rotate_half(x) * sin`` (:class:`_RopeFunction`).

    Args:
        x: (B, n, T, hd) queries or keys.
        cos: (T, hd) or (B, 1, T, hd) (:class:`RotaryEmbedding`).
        sin: same shape as ``cos``.

    Returns:
        (B, n, T, hd).
    """
    return _RopeFunction.apply(x, cos, sin)


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    native_gqa: bool | None = None,
    doc_ids: Tensor | None = None,
    device_type: str | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal ``F.scaled_dot_product_attention`` where each group of nh // nkv query heads shares a kv head.

    With ``enable_gqa=True`` the kernel reads the shared heads in place, but only some kernels support it: the CPU
    flash kernel and, on CUDA, the flash kernel (fp16/bf16). Elsewhere (CUDA in float32, for one) SDPA would fall
    back to the math kernel, which materialises the (B, nh, T, T) scores; there keys and values are expanded to
    nh heads instead, (B, nh, T, hd) copies that keep the memory-efficient kernels eligible.

    Rows that pack several documents (``doc_ids``) attend within each document, in blocks of queries without a
    (T, T) mask (:func:`memfit.models.attention.document_attention`). So does a sliding ``window`` shorter than
    the sequence: each block of queries reads only the keys its window reaches. A window of T or more keys is
    plain causal attention, and takes the plain path.

    Args:
        q: (B, nh, T, hd) queries.
        k: (B, nkv, T, hd) keys; nkv divides nh.
        v: (B, nkv, T, hd) values.
        native_gqa: True passes ``enable_gqa``, False expands; None picks as described above, from the device
            type and dtype only (no data dependence).
        doc_ids: None for plain causal attention, or (B, T) int ids of the documents packed into each row: a query
            attends to the keys before it in its own document.
        device_type: the device whose kernels decide (``native_gqa`` and the document blocks' kernel); default
            ``q``'s. The estimator passes ``cuda`` to trace a GPU run on CPU tensors.
        window: None, or W: query t attends to the keys ``(t - W, t]`` only (Mistral's ``sliding_window``).
        scale: the scores' factor; None is ``hd ** -0.5`` (Gemma: ``query_pre_attn_scalar ** -0.5``).
        softcap: None, or the cap of Gemma 2's scores, ``cap * tanh(scores / cap)`` before the mask: SDPA has no
            such option, so the scores are computed a block of queries at a time
            (:func:`memfit.models.attention.softcapped_attention`), never a (T, T) tensor.

    Returns:
        (B, nh, T, hd).
    """
    device_type = device_type or q.device.type
    if window is not None and window >= q.shape[2]:
        window = None  # the window reaches every earlier key: plain causal attention
    if softcap is not None:
        return softcapped_attention(q, k, v, doc_ids, window=window, scale=scale, softcap=softcap)
    if doc_ids is not None or window is not None:
        return document_attention(
            q, k, v, doc_ids, recompute=device_type != "cpu", window=window, scale=scale
        )
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    if nkv == nh:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if native_gqa is None:
        native_gqa = device_type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)
    if not native_gqa:
        k = k[:, :, None].expand(B, nkv, nh // nkv, T, hd).reshape(B, nh, T, hd)  # (B, nh, T, hd)
        v = v[:, :, None].expand(B, nkv, nh // nkv, T, hd).reshape(B, nh, T, hd)  # (B, nh, T, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=native_gqa, scale=scale)


def packed_positions(doc_ids: Tensor) -> Tensor:
    """Position of each token within its own sample, for rows that pack several samples.

    Args:
        doc_ids: (B, T) int; tokens of one sample share an id and are contiguous.

    Returns:
        (B, T) int64 positions, restarting at 0 where the id changes.
    """
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)  # (B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # (B, T)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_of_doc = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T)
    return idx - start_of_doc


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE (see ``causal_attention``), optionally with q/k/v biases,
    per-head q/k RMSNorm and a sliding window (``config.attention_bias``, ``qk_norm``, ``sliding_window``).

    Args:
        config: the model config.
        layer: the layer's index (its window and RoPE tables follow ``config.layer_types``).
    """

    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.layer_window(layer)
        # None: SDPA's own hd ** -0.5 (Llama); Gemma's query_pre_attn_scalar ** -0.5 as transformers computes it
        self.scaling = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.dim, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.dim, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.dim, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.dim, bias=False)
        if config.qk_norm:  # Qwen3, Gemma 3: one RMSNorm over hd, shared by the heads
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_plus_one)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_plus_one)

    def project_qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of ``x``, with RoPE applied to queries and keys.

        Args:
            x: (B, T, C) normed hidden states.
            cos: (T, hd) or (B, 1, T, hd) RoPE table.
            sin: same shape as ``cos``.

        Returns:
            ``(q, k, v)``: (B, nh, T, hd), (B, nkv, T, hd), (B, nkv, T, hd).
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, nh, hd)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, nkv, hd)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if "q_norm" in self._modules:  # qk_norm: each head normed over hd, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """Attend causally over the sequence.

        Args:
            x: (B, T, C) normed hidden states.
            cos: (T, hd) or (B, 1, T, hd) RoPE table.
            sin: same shape as ``cos``.
            doc_ids: None (causal), or (B, T) ids of packed documents (see :func:`causal_attention`).

        Returns:
            (B, T, C).
        """
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        y = self.attend(q, k, v, doc_ids)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, nh * hd)
        return self.o_proj(y)  # (B, T, C)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """:func:`causal_attention` (looked up at call time) with this layer's window, scale and soft-cap.

        Args:
            q: (B, nh, T, hd) queries.
            k: (B, nkv, T, hd) keys.
            v: (B, nkv, T, hd) values.
            doc_ids: None, or (B, T) ids of packed documents.

        Returns:
            (B, nh, T, hd).
        """
        options = {}
        if self.scaling is not None or self.softcap is not None:  # Llama's call is left as it was
            options = {"scale": self.scaling, "softcap": self.softcap}
        return causal_attention(q, k, v, doc_ids=doc_ids, window=self.sliding_window, **options)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; GeGLU, ``down(gelu_tanh(gate(x)) * up(x))``, with
    ``config.mlp_activation == "gelu_tanh"`` (Gemma).

    Args:
        config: the model config.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gelu = config.mlp_activation == "gelu_tanh"
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the feed-forward.

        Args:
            x: (B, T, C).

        Returns:
            (B, T, C); the hidden activations are (B, T, I).
        """
        gate = self.gate_proj(x)  # (B, T, I)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with ``config.sandwich_norms``
    (Gemma) ``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``.

    Args:
        config: the model config.
        layer: the layer's index (:class:`Attention`).
    """

    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        plus_one = config.norm_plus_one
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps, plus_one)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps, plus_one)
        if config.sandwich_norms:  # named as transformers' Gemma2DecoderLayer names them
            self.pre_feedforward_layernorm = RMSNorm(config.dim, config.norm_eps, plus_one)
            self.post_feedforward_layernorm = RMSNorm(config.dim, config.norm_eps, plus_one)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """Apply the block.

        Args:
            x: (B, T, C) residual stream.
            cos: (T, hd) or (B, 1, T, hd) RoPE table.
            sin: same shape as ``cos``.
            doc_ids: None (causal), or (B, T) ids of packed documents.

        Returns:
            (B, T, C) residual stream.
        """
        if "pre_feedforward_layernorm" in self._modules:  # sandwich_norms: the norm after is on the branch
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, doc_ids))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, doc_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The backbone: token embedding, decoder layers and the final norm (HF ``LlamaModel``).

    Args:
        config: the model config.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_plus_one)
        self.rotary_emb = RotaryEmbedding(config)
        # the layers that take the local RoPE tables (Gemma 3's base of 10,000 on its sliding layers)
        self.local_rope = tuple(
            config.rope_local_base_freq is not None and config.layer_is_local(i)
            for i in range(config.num_layers)
        )
        if any(self.local_rope):
            self.rotary_emb_local = RotaryEmbedding(config, local=True)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute every RoPE buffer (the global tables', and the local ones' where there are) on ``device``
        (default: where each lives)."""
        self.rotary_emb.reset_parameters(device)
        if "rotary_emb_local" in self._modules:
            self.rotary_emb_local.reset_parameters(device)

    def forward(
        self, input_ids: Tensor, doc_ids: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """Run the backbone.

        Args:
            input_ids: (B, T) int64 token ids.
            doc_ids: None, or (B, T) int ids of the samples packed into each row: attention stays within a sample
                and positions restart at 0 for each (so a packed row computes exactly what its samples would alone).
            positions: None (positions ``0 .. T - 1``, or per sample with ``doc_ids``), or the tokens' RoPE
                positions, (T,) or (B, T) int64 (HF's ``position_ids``: a sequence-parallel rank holds a slice of
                its rows, whose ``doc_ids`` are then the whole rows').

        Returns:
            (B, T, C) final-normed hidden states, in the dtype of the embedding.
        """
        x = self.embed_tokens(input_ids)  # (B, T, C)
        if self.config.scale_embeddings:  # Gemma: sqrt(C) in fp32, cast to the embedding's dtype
            x = x * torch.full((), self.config.dim**0.5, dtype=torch.float32, device=x.device).to(x.dtype)
        if positions is None:  # an int T, or each packed sample's own positions
            positions = input_ids.shape[1] if doc_ids is None else packed_positions(doc_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)  # (T, hd) or (B, 1, T, hd) each
        tables = [(cos, sin)] * len(self.layers)
        if "rotary_emb_local" in self._modules:
            local = self.rotary_emb_local(positions, x.dtype)
            tables = [local if is_local else (cos, sin) for is_local in self.local_rope]
        for layer, (cos, sin) in zip(self.layers, tables, strict=True):
            x = layer(x, cos, sin, doc_ids)  # (B, T, C)
        return self.norm(x)


class Llama(nn.Module):
    """Llama causal language model, named like HF ``LlamaForCausalLM`` so state dict keys are identical.

    With ``config.tie_word_embeddings`` the output projection ``lm_head.weight`` is the very Parameter
    ``model.embed_tokens.weight``; it stays tied through ``to``, ``to_empty`` and ``cuda`` (see ``_apply``).

    Args:
        config: the model config.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Point ``lm_head.weight`` at ``model.embed_tokens.weight`` when the config ties them, else nothing.

        Useful after replacing parameters from outside (``load_state_dict(..., assign=True)``).
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Llama:
        # nn.Module._apply converts each module's parameters separately, which would allocate the shared matrix
        # twice and untie it (to_empty does); convert it once, through the embedding, and tie again.
        if not self.config.tie_word_embeddings:
            return super()._apply(fn, recurse)
        self.lm_head._parameters["weight"] = None
        try:
            super()._apply(fn, recurse)
        finally:
            self.tie_weights()
        return self

    def forward(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None = None,
        return_hidden: bool = False,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Compute next-token logits, or the hidden states ``lm_head`` would project.

        Args:
            input_ids: (B, T) int64 token ids.
            doc_ids: None, or (B, T) ids of packed samples (see :meth:`LlamaModel.forward`).
            return_hidden: return the final-normed hidden states instead of the logits (a loss that applies
                ``lm_head.weight`` itself, chunk by chunk, calls the model this way so that wrappers of the whole
                model, such as FSDP, see one forward).
            positions: None, or the tokens' RoPE positions (see :meth:`LlamaModel.forward`).

        Returns:
            (B, T, V) logits, or (B, T, C) hidden states with ``return_hidden``; in the dtype of the parameters.
        """
        hidden = self.model(input_ids, doc_ids, positions)  # (B, T, C)
        if return_hidden:
            return hidden
        return softcap_logits(self.lm_head(hidden), self.config.final_logit_softcapping)  # (B, T, V)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise a materialised model (for instance after ``to_empty``) in place.

        Embeddings and linear weights are drawn from normal(0, 0.02), except the projections that write into the
        residual stream (``o_proj`` and ``down_proj``), whose std is ``0.02 / sqrt(2 * num_layers)`` (GPT-2's
        scaling, which keeps the residual stream's variance from growing with depth). RMSNorm weights are ones, biases
        zeros, and the RoPE buffer is recomputed. Tensors are visited in ``named_parameters`` order, so the result is a
        function of the generator's (or the global RNG's) state alone.

        Args:
            generator: random source; None uses the global RNG (seed it with ``torch.manual_seed``). It must live
                on the parameters' device.
        """
        for name, param in self.named_parameters():  # a tied weight is visited once
            init_parameter_(name, param, self.config.num_layers, generator, self.config.norm_plus_one)
        self.model.reset_rope()


def softcap_logits(logits: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(logits / cap)`` in the logits' dtype, in transformers' order (Gemma 2's
    ``final_logit_softcapping``); the logits themselves when ``cap`` is None.

    Args:
        logits: (..., V).
        cap: the cap, or None.

    Returns:
        (..., V).
    """
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


@torch.no_grad()
def init_parameter_(
    name: str,
    tensor: Tensor,
    num_layers: int,
    generator: torch.Generator | None = None,
    norm_plus_one: bool = False,
) -> Tensor:
    """Initialise one parameter of a :class:`Llama` in place, by its name (the rule of :meth:`Llama.init_weights`).

    :meth:`Llama.init_weights` calls it for every parameter in ``named_parameters`` order with one generator;
    calling it in the same order on tensors of the same shape, dtype and device draws the same values, which is
    how a sharded run materialises the weights one parameter at a time (:mod:`memfit.distributed`).

    Args:
        name: the parameter's name in the model (``model.layers.0.self_attn.o_proj.weight``, ...).
        tensor: the tensor to fill, of the parameter's shape.
        num_layers: the model's decoder layers (the residual projections' std depends on them).
        generator: random source; None uses the global RNG.
        norm_plus_one: the norms scale by ``1 + weight`` (:attr:`LlamaConfig.norm_plus_one`): zeros, not ones.

    Returns:
        ``tensor``.
    """
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return nn.init.normal_(
            tensor, mean=0.0, std=INIT_STD / math.sqrt(2 * num_layers), generator=generator
        )
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
        return nn.init.zeros_(tensor) if norm_plus_one else nn.init.ones_(tensor)
    if name.endswith(".bias"):  # q/k/v biases (attention_bias)
        return nn.init.zeros_(tensor)
    # embed_tokens, q/k/v_proj, gate/up_proj, lm_head
    return nn.init.normal_(tensor, mean=0.0, std=INIT_STD, generator=generator)


def build_llama(
    config: LlamaConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    seed: int | None = None,
) -> Llama:
    """Build a model on the meta device, then allocate each parameter once, in ``dtype``, on ``device``.

    No float32 copy is ever made, and the same call works under ``FakeTensorMode`` (where ``Module.to_empty``
    cannot swap fake parameters), so estimates build the model exactly as training does.

    Args:
        config: the model config.
        device: where to allocate; ``"meta"`` allocates nothing (for estimates, or to shard before allocating).
        dtype: floating dtype of the parameters. The RoPE buffer stays float32; its tables are cast to the
            activation dtype in ``forward``.
        init: run ``init_weights`` (not on meta). With False the parameters are uninitialised memory, to be
            overwritten by ``load_state_dict``; the RoPE buffer is computed either way.
        seed: seed of a fresh generator on ``device`` for ``init_weights``; None draws from the global RNG.

    Returns:
        The model, in train mode.
    """
    with torch.device("meta"):
        model = Llama(config)
    allocated: dict[int, nn.Parameter] = {}  # id of a meta parameter -> its allocation; a tied one is shared
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in allocated:
                data = torch.empty_like(param, device=device, dtype=dtype)
                allocated[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = allocated[id(param)]
    model.model.reset_rope(device)  # float32
    if init and torch.device(device).type != "meta":
        generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        model.init_weights(generator)
    return model
