"""The decoder that builds every family memfit reads: pre-norm blocks of grouped-query attention with RoPE and a gated
MLP, with the options of :class:`~memfit.models.config.DecoderConfig` (Llama's by default).

Architecture only. Checkpointing, sharding, LoRA, optimizer hooks and dtype policy are applied to a built model
from outside. Submodules are named like Hugging Face's ``LlamaForCausalLM`` (and its families' classes) so that
state dicts load into each other with ``strict=True``.

Shape letters used in comments: B batch, T sequence length, C model width (``dim``), nh query heads, nkv key/value
heads, hd head size (``head_dim``, by default ``dim // num_heads``), W sliding window, I SwiGLU hidden size, V
vocabulary size.

The forward pass has no host syncs and no data-dependent Python branching, so it runs under
``torch._subclasses.fake_tensor.FakeTensorMode`` on a model of any size built on the meta device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.models.attention import document_attention, softcapped_attention
from memfit.models.config import DecoderConfig
from memfit.models.layers import RMSNorm, RotaryEmbedding, apply_rope
from memfit.models.moe import MoE

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of embeddings and linear weights (GPT-2, Llama)."""


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

    def __init__(self, config: DecoderConfig, layer: int = 0) -> None:
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
        self.qk_norm_per_head = config.qk_norm_per_head
        if (
            config.qk_norm
        ):  # Qwen3, Gemma 3: one RMSNorm over hd, shared by the heads; OLMoE: over the projection
            q_width, k_width = config.head_dim, config.head_dim
            if not config.qk_norm_per_head:
                q_width, k_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            self.q_norm = RMSNorm(q_width, config.norm_eps, config.norm_plus_one)
            self.k_norm = RMSNorm(k_width, config.norm_eps, config.norm_plus_one)

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
        q, k = self.q_proj(x), self.k_proj(x)  # (B, T, nh * hd), (B, T, nkv * hd)
        whole = "q_norm" in self._modules and not self.qk_norm_per_head
        if whole:  # OLMoE: the whole projections normed, before the heads are split
            q, k = self.q_norm(q), self.k_norm(k)
        # heads counted from the projections' widths: a tensor-parallel rank holds nh / tp and nkv / tp of them
        hd = self.head_dim
        q = q.view(B, T, q.shape[-1] // hd, hd)  # (B, T, nh, hd)
        k = k.view(B, T, k.shape[-1] // hd, hd)  # (B, T, nkv, hd)
        v = self.v_proj(x)  # (B, T, nkv * hd)
        v = v.view(B, T, v.shape[-1] // hd, hd).transpose(1, 2)  # (B, nkv, T, hd)
        if "q_norm" in self._modules and not whole:  # qk_norm: each head normed over hd, before RoPE
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
        y = y.transpose(1, 2).reshape(B, T, y.shape[1] * y.shape[3])  # (B, T, nh * hd)
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

    def __init__(self, config: DecoderConfig) -> None:
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

    def __init__(self, config: DecoderConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MoE(config) if config.layer_is_moe(layer) else MLP(config)
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


class DecoderModel(nn.Module):
    """The backbone: token embedding, decoder layers and the final norm (HF ``LlamaModel``).

    Args:
        config: the model config.
    """

    def __init__(self, config: DecoderConfig) -> None:
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


class Decoder(nn.Module):
    """Llama causal language model, named like HF ``LlamaForCausalLM`` so state dict keys are identical.

    With ``config.tie_word_embeddings`` the output projection ``lm_head.weight`` is the very Parameter
    ``model.embed_tokens.weight``; it stays tied through ``to``, ``to_empty`` and ``cuda`` (see ``_apply``).

    Args:
        config: the model config.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Point ``lm_head.weight`` at ``model.embed_tokens.weight`` when the config ties them, else nothing.

        Useful after replacing parameters from outside (``load_state_dict(..., assign=True)``).
        """
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Decoder:
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
            doc_ids: None, or (B, T) ids of packed samples (see :meth:`DecoderModel.forward`).
            return_hidden: return the final-normed hidden states instead of the logits (a loss that applies
                ``lm_head.weight`` itself, chunk by chunk, calls the model this way so that wrappers of the whole
                model, such as FSDP, see one forward).
            positions: None, or the tokens' RoPE positions (see :meth:`DecoderModel.forward`).

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
    """Initialise one parameter of a :class:`Decoder` in place, by its name (the rule of :meth:`Decoder.init_weights`).

    :meth:`Decoder.init_weights` calls it for every parameter in ``named_parameters`` order with one generator;
    calling it in the same order on tensors of the same shape, dtype and device draws the same values, which is
    how a sharded run materialises the weights one parameter at a time (:mod:`memfit.distributed`).

    Args:
        name: the parameter's name in the model (``model.layers.0.self_attn.o_proj.weight``, ...).
        tensor: the tensor to fill, of the parameter's shape.
        num_layers: the model's decoder layers (the residual projections' std depends on them).
        generator: random source; None uses the global RNG.
        norm_plus_one: the norms scale by ``1 + weight`` (:attr:`DecoderConfig.norm_plus_one`): zeros, not ones.

    Returns:
        ``tensor``.
    """
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return nn.init.normal_(
            tensor, mean=0.0, std=INIT_STD / math.sqrt(2 * num_layers), generator=generator
        )
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
        return nn.init.zeros_(tensor) if norm_plus_one else nn.init.ones_(tensor)
    if name.endswith(".bias"):  # q/k/v biases (attention_bias)
        return nn.init.zeros_(tensor)
    # embed_tokens, q/k/v_proj, gate/up_proj, lm_head; experts' gate_up_proj and the router (mlp.gate.weight)
    return nn.init.normal_(tensor, mean=0.0, std=INIT_STD, generator=generator)


def build_decoder(
    config: DecoderConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init: bool = True,
    seed: int | None = None,
) -> Decoder:
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
        model = Decoder(config)
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
