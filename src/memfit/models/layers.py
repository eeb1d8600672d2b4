"""The decoder's position and norm layers: RMSNorm computed chunk of rows by chunk of rows with its own backward,
and rotary position embeddings (RoPE, Su et al. 2021) in Hugging Face's ``rotate_half`` layout, Llama 3.1's
frequency scaling included.

Shape letters: B batch, T sequence length, C width, n heads, hd head size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from memfit.models.config import DecoderConfig
from memfit.models.tiles import representative


def rope_inv_freq(
    config: DecoderConfig, device: torch.device | str | None = None, local: bool = False
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
    uninitialised like every other tensor; ``reset_parameters`` (called by ``Decoder.init_weights`` and
    ``build_decoder``) recomputes it.

    Args:
        config: the model config.
        local: the tables of the local layers (:func:`rope_inv_freq`'s ``local``).
    """

    def __init__(self, config: DecoderConfig, local: bool = False) -> None:
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
