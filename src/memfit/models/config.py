"""The decoder's hyperparameters: :class:`DecoderConfig`, one frozen dataclass for every family memfit builds.

Its defaults are Llama's (Llama 2, 3, 3.1, 3.2); each other field is an option a family needs
(:mod:`memfit.models.families`): an explicit ``head_dim`` (Mistral, Qwen3), biases on the q, k and v projections
(Qwen2), an RMSNorm of each query and key head before RoPE (Qwen3), a sliding attention window (Mistral v0.1), and
Gemma 2/3's GeGLU, ``(1 + w)`` norms before and after attention and MLP, embeddings times ``sqrt(dim)``,
``query_pre_attn_scalar``, local and global layers (``layer_types``) with their own RoPE bases, soft-capped
attention scores and logits. Named sizes live in :mod:`memfit.models.presets`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MLP_ACTIVATIONS = ("silu", "gelu_tanh")
"""Values of :attr:`DecoderConfig.mlp_activation`."""
LAYER_TYPES = ("sliding_attention", "full_attention")
"""Values in :attr:`DecoderConfig.layer_types` (transformers' names)."""


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
class DecoderConfig:
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
    qk_norm_per_head: bool = True
    """With ``qk_norm``: one norm of hd shared by the heads (Qwen3, Gemma 3); False norms the whole projection,
    a weight of ``nh * hd`` for the queries and ``nkv * hd`` for the keys (OLMoE)."""
    num_experts: int | None = None
    """Experts E of a mixture-of-experts feed-forward (:mod:`memfit.models.moe`; HF ``num_experts``, Mixtral's
    ``num_local_experts``); None is a dense model."""
    num_experts_per_tok: int | None = None
    """Experts k each token is routed to (HF ``num_experts_per_tok``); required with ``num_experts``."""
    moe_intermediate_size: int | None = None
    """Hidden size of one expert (Qwen3-MoE's ``moe_intermediate_size``); None is ``intermediate_size`` (Mixtral,
    OLMoE)."""
    norm_topk_prob: bool = False
    """The k routing weights are renormalised to sum to 1 (Qwen3-MoE, Mixtral); False keeps the softmax's
    (OLMoE)."""
    router_aux_loss_coef: float = 0.0
    """The checkpoint's weight of the load-balancing loss (HF ``router_aux_loss_coef``); the run decides whether
    it applies (``moe.router_aux_loss_coef``)."""
    dense_layers: tuple[int, ...] = ()
    """Layers whose feed-forward is a dense MLP of ``intermediate_size`` in a mixture-of-experts model (Qwen3-MoE's
    ``mlp_only_layers``)."""

    def __post_init__(self) -> None:
        """Validate the fields and convert a dict ``rope_scaling`` to ``RopeScaling``.

        Raises:
            ValueError: see the class docstring.
        """
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_seq_len"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive number, got {value!r}")
        for name in ("head_dim", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"DecoderConfig.{name} must be None or a positive int, got {value!r}")
        derived = self.head_dim is None
        if derived:
            if self.dim % self.num_heads != 0:
                raise ValueError(
                    f"DecoderConfig.dim ({self.dim}) must be divisible by num_heads ({self.num_heads}), or head_dim "
                    f"given"
                )
            object.__setattr__(self, "head_dim", self.dim // self.num_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"DecoderConfig.num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"DecoderConfig.{'dim // num_heads' if derived else 'head_dim'} ({self.head_dim}) must be even: RoPE "
                f"rotates pairs of channels"
            )
        if isinstance(self.rope_scaling, dict):
            known = {f.name for f in fields(RopeScaling)}
            unknown = sorted(set(self.rope_scaling) - known)
            if unknown:
                raise ValueError(
                    f"DecoderConfig.rope_scaling has unknown keys {unknown}; known: {sorted(known)}"
                )
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"DecoderConfig.rope_scaling must be None, a RopeScaling or a dict, got {self.rope_scaling!r}"
            )
        self._check_gemma_fields()
        self._check_moe_fields()

    def _check_moe_fields(self) -> None:
        """Validate the mixture-of-experts fields (``num_experts`` ... ``dense_layers``).

        Raises:
            ValueError: naming the field: a size that is not a positive int, ``num_experts_per_tok`` missing or
                above ``num_experts``, experts' fields on a dense model, a negative aux-loss weight, or a dense
                layer out of range.
        """
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"DecoderConfig.{name} must be None or a positive int, got {value!r}")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.num_experts is None:
            if self.num_experts_per_tok is not None or self.dense_layers:
                raise ValueError(
                    "DecoderConfig.num_experts_per_tok and dense_layers need num_experts (a mixture of experts)"
                )
            return
        if self.num_experts_per_tok is None or self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"DecoderConfig.num_experts_per_tok must be set and at most num_experts ({self.num_experts}), got "
                f"{self.num_experts_per_tok!r}"
            )
        if self.mlp_activation != "silu":
            raise ValueError("DecoderConfig.mlp_activation must be 'silu' in a mixture of experts")
        if isinstance(self.router_aux_loss_coef, bool) or not self.router_aux_loss_coef >= 0:
            raise ValueError(
                f"DecoderConfig.router_aux_loss_coef must be a number >= 0, got {self.router_aux_loss_coef!r}"
            )
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"DecoderConfig.dense_layers {bad} are not layers of 0 .. {self.num_layers - 1}")

    @property
    def expert_intermediate_size(self) -> int:
        """Hidden size I of one expert: ``moe_intermediate_size``, else ``intermediate_size``."""
        return self.moe_intermediate_size or self.intermediate_size

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward is a mixture of experts."""
        return self.num_experts is not None and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        """Layers whose feed-forward is a mixture of experts (0 on a dense model)."""
        return sum(self.layer_is_moe(i) for i in range(self.num_layers))

    def mlp_weights(self, active: bool = True) -> float:
        """Matmul weights of one layer's feed-forward, averaged over the layers: ``3 * dim * intermediate_size``
        for a dense one; a mixture of experts' ``3 * dim * I`` per expert (the ``num_experts_per_tok`` a token
        computes with when ``active``, else all ``num_experts``, as stored) plus its router's ``dim * E``."""
        dense = 3 * self.dim * self.intermediate_size
        moe = self.num_moe_layers
        if not moe:
            return float(dense)
        experts = self.num_experts_per_tok if active else self.num_experts
        per_moe = experts * 3 * self.dim * self.expert_intermediate_size + self.dim * self.num_experts
        return ((self.num_layers - moe) * dense + moe * per_moe) / self.num_layers

    def active_params(self) -> int:
        """Parameters one token computes with: :meth:`num_params` less the experts it is not routed to.

        Returns:
            ``num_params()`` for a dense model; with experts, each MoE layer counts ``num_experts_per_tok``
            experts' weights of its ``num_experts``.
        """
        if self.num_experts is None:
            return self.num_params()
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * self.dim * self.expert_intermediate_size
        return self.num_params() - self.num_moe_layers * idle

    def _check_gemma_fields(self) -> None:
        """Validate the fields of Gemma's options (``mlp_activation`` ... ``rope_linear_factor``).

        Raises:
            ValueError: naming the field: an unknown ``mlp_activation``, a scalar or cap that is not a positive
                number, ``layer_types`` not of ``num_layers`` known kinds, or local layers without a
                ``sliding_window``.
        """
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"DecoderConfig.mlp_activation must be one of {list(MLP_ACTIVATIONS)}, got {self.mlp_activation!r}"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_base_freq", "rope_linear_factor"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ValueError(f"DecoderConfig.{name} must be None or a positive number, got {value!r}")
        if self.layer_types is not None:
            kinds = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", kinds)
            if len(kinds) != self.num_layers or set(kinds) - set(LAYER_TYPES):
                raise ValueError(
                    f"DecoderConfig.layer_types must hold {self.num_layers} (num_layers) of {list(LAYER_TYPES)}, got "
                    f"{list(kinds)}"
                )
            if "sliding_attention" in kinds and self.sliding_window is None:
                raise ValueError(
                    "DecoderConfig.layer_types has sliding_attention layers but sliding_window is None"
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
            The count that ``sum(p.numel() for p in Decoder(config).parameters())`` gives.
        """
        C, hd, I = self.dim, self.head_dim, self.intermediate_size  # noqa: E741
        attention = C * self.num_heads * hd * 2 + C * self.num_kv_heads * hd * 2  # q, o + k, v
        if self.attention_bias:
            attention += (self.num_heads + 2 * self.num_kv_heads) * hd  # q, k, v biases
        if self.qk_norm:  # q_norm, k_norm: per head, or over the whole projections
            attention += 2 * hd if self.qk_norm_per_head else (self.num_heads + self.num_kv_heads) * hd
        layer = attention + (4 if self.sandwich_norms else 2) * C  # + the RMSNorms
        embeddings = self.vocab_size * C * (1 if self.tie_word_embeddings else 2)
        moe_layers = self.num_moe_layers
        # dense MLPs (gate, up, down); experts' gate_up and down, and the router
        mlp = (self.num_layers - moe_layers) * 3 * C * I
        if moe_layers:
            mlp += moe_layers * self.num_experts * (3 * C * self.expert_intermediate_size + C)
        return embeddings + self.num_layers * layer + mlp + C  # + final RMSNorm
