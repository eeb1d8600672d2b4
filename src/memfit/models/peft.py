"""Parameter-efficient fine-tuning, applied to a built :class:`~memfit.models.decoder.Llama` from outside.

The model file knows nothing of these methods: each function here adds parameters to existing submodules and
replaces their ``forward`` on the instance (as activation checkpointing does), so every base parameter keeps its
Hugging Face name (``model.layers.0.self_attn.q_proj.weight``) and full checkpoints still load into
``LlamaForCausalLM``. Everything but the new parameters is frozen (``requires_grad=False``), so gradients and
optimizer state exist only for them (``memfit.memory.optim.param_groups`` skips frozen parameters).

- **LoRA** (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a targeted ``nn.Linear``
  computes ``W x + (alpha / r) * B A dropout(x)`` with ``A`` (r, in) and ``B`` (out, r) trainable and ``W``
  frozen. ``B`` starts at zero, so the model is unchanged at step 0. Memory: 2 small matrices per target, their
  gradients and optimizer state; the activations of the frozen base are still kept for the backward (the input
  gradient flows through ``W``), plus one (B, T, r) tensor per target. :func:`merge_lora` folds the update into
  ``W`` for export; :mod:`memfit.convert.peft_adapter` reads and writes Hugging Face PEFT's adapter
  format.
- **LLaMA-Adapter** (:mod:`memfit.models.adapter`): learned prompt vectors in the top attention layers, gated
  from zero. Its settings (:class:`AdapterSettings`) and the parts every method shares are here.
- **QLoRA** (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): LoRA on a base whose frozen
  decoder linears (``q/k/v/o_proj``, ``gate/up/down_proj``) are stored in 4-bit NormalFloat (NF4) with
  double-quantized block scales, as torchao's ``NF4Tensor`` (the tensor subclass torchtune shards with FSDP2).
  Embeddings, norms and ``lm_head`` keep the parameter dtype. A quantized linear computes ``x @ dequant(W).T``:
  the (out, in) dequantized weight is a temporary of the forward and of the backward (for the input gradient),
  never kept. :func:`merge_lora` dequantizes the base before folding the update in.

A model takes one method: applying a second one (or the same one twice) raises. Both keep the forward free of host
syncs and data-dependent branching, so the training step still runs under ``FakeTensorMode`` on a meta-built model.

Order of use: build the model, load the pretrained weights, apply the method (which freezes the base), then apply
activation checkpointing (any order works) and build the optimizer. A memfit checkpoint of the whole model then
holds the new tensors too (``...q_proj.lora_A``), so resuming applies the method before loading.

Shape letters: B batch, T sequence length, C model width, nh query heads, nkv key/value heads, hd head size,
r LoRA rank, L adapter prompt length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.models import families, moe
from memfit.models.decoder import Decoder
from memfit.models.nf4 import NF4_LUT_SIZE, empty_nf4, in_parts, is_nf4, nf4_layout, to_nf4

LORA_METHODS = ("lora", "qlora")
"""Methods whose settings are ``lora.*`` (QLoRA is LoRA over a 4-bit NormalFloat base)."""
LORA_TARGETS = families.LORA_TARGETS
"""Every linear layer LoRA may adapt, in module order; a family's own are its entry's ``lora_targets``."""
ALL_LORA_TARGETS = tuple(dict.fromkeys(t for f in families.FAMILIES.values() for t in f.lora_targets))
"""Every name ``lora.target_modules`` may hold in some family (Phi-3's ``qkv_proj`` and ``gate_up_proj`` too);
which of them a model takes is its family's (:func:`lora_targets`)."""
"""Linear layers LoRA can adapt (:func:`apply_lora`)."""
"""Names of the linear layers LoRA can adapt (the last component of the module name)."""
ADAPTER_PROMPT_STD = 1.0
"""Standard deviation of the normal initialisation of the LLaMA-Adapter prompt. The prompt feeds ``k_proj`` and
``v_proj`` directly, in place of RMS-normed hidden states whose elements have unit scale, so it starts at that
scale (as Hugging Face PEFT's adaption prompt does); the zero gate keeps the model unchanged at init whatever the
scale. At 0.02 (an embedding's scale) the prompt's values are ~50x too small and the adapter barely learns."""

_LORA_SUFFIXES = (".lora_A", ".lora_B")
ADAPTER_SUFFIXES = (".adapter_prompt", ".adapter_gate")


@dataclass(frozen=True)
class LoraSettings:
    """The hyperparameters a model's LoRA was applied with (kept on the model as ``model.memfit_peft``)."""

    rank: int
    """r: inner size of the low-rank update."""
    alpha: float
    """The update is scaled by ``alpha / rank``."""
    dropout: float
    """Dropout probability on the input of the low-rank path (training mode only)."""
    target_modules: tuple[str, ...]
    """Names (from :data:`LORA_TARGETS`) of the adapted linear layers."""
    target_parameters: tuple[str, ...] = ()
    """Names (from :data:`EXPERT_LORA_TARGETS`) of the adapted stacked expert weights."""

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class QLoraSettings(LoraSettings):
    """LoRA over a base whose decoder linears are NF4 (:func:`apply_qlora`); the LoRA hyperparameters as
    :class:`LoraSettings`."""


@dataclass(frozen=True)
class AdapterSettings:
    """The hyperparameters a model's LLaMA-Adapter was applied with (kept on the model as ``model.memfit_peft``)."""

    prompt_length: int
    """L: learned prompt vectors per adapted layer."""
    layers: tuple[int, ...]
    """Indices of the adapted decoder layers (the top ones)."""


# ----------------------------------------------------------------------------------------------------------------
# Shared: which method, freezing, counting
# ----------------------------------------------------------------------------------------------------------------


def peft_method(model: nn.Module) -> str | None:
    """The method applied to ``model``: ``"lora"``, ``"qlora"``, ``"adapter"``, or None.

    Args:
        model: any module.

    Returns:
        The method's name, or None when neither was applied (or LoRA was merged).
    """
    settings = getattr(model, "memfit_peft", None)
    if isinstance(settings, QLoraSettings):
        return "qlora"
    if isinstance(settings, LoraSettings):
        return "lora"
    if isinstance(settings, AdapterSettings):
        return "adapter"
    return None


def check_no_peft(model: nn.Module, method: str) -> None:
    current = peft_method(model)
    if current is not None:
        raise ValueError(
            f"cannot apply {method}: the model already has {current} applied (a model takes one method, once)"
        )


def freeze_base(model: nn.Module, trainable_names: Iterable[str]) -> None:
    """Make exactly ``trainable_names`` trainable; freeze every other parameter and drop its gradient.

    Args:
        model: the model.
        trainable_names: names as ``model.named_parameters()`` gives them.

    Raises:
        ValueError: a name is not a parameter of the model.
    """
    trainable = set(trainable_names)
    params = dict(model.named_parameters())
    unknown = sorted(trainable - set(params))
    if unknown:
        raise ValueError(f"freeze_base: {unknown[:5]} are not parameters of the model")
    for name, p in params.items():  # a tied parameter appears once
        p.requires_grad_(name in trainable)
        if name not in trainable:
            p.grad = None


def trainable_parameter_summary(model: nn.Module) -> dict[str, int | float]:
    """Counts and bytes of the trainable and of all parameters, for logging (a tied parameter counts once).

    Args:
        model: the model.

    Returns:
        ``trainable_params``, ``total_params`` (element counts), ``trainable_bytes``, ``total_bytes`` (bytes of
        the parameter storages at their dtype) and ``trainable_fraction`` (trainable / total elements).
    """
    trainable = total = trainable_bytes = total_bytes = 0
    for p in model.parameters():
        n, nbytes = p.numel(), p.numel() * p.element_size()
        total += n
        total_bytes += nbytes
        if p.requires_grad:
            trainable += n
            trainable_bytes += nbytes
    return {
        "trainable_params": trainable,
        "total_params": total,
        "trainable_bytes": trainable_bytes,
        "total_bytes": total_bytes,
        "trainable_fraction": trainable / total if total else 0.0,
    }


METHOD_PARAMETERS = ("lora_A", "lora_B", "adapter_prompt", "adapter_gate")
"""Names (last component) of the parameters LoRA and LLaMA-Adapter add."""


@torch.no_grad()
def init_method_parameter_(name: str, tensor: Tensor, seed: int | None = None) -> Tensor:
    """Initialise a LoRA or adapter parameter in place, by its name; what :func:`apply_lora` and
    :func:`apply_adapter` draw, so a sharded run can materialise these parameters after sharding.

    ``lora_A``: kaiming-uniform with ``a = sqrt(5)``; ``lora_B`` and ``adapter_gate``: zeros;
    ``adapter_prompt``: normal(0, :data:`ADAPTER_PROMPT_STD`). Each random one draws from a fresh generator seeded
    with ``seed`` on the tensor's device, so the values are a function of (seed, shape, dtype, device) alone.

    Args:
        name: the parameter's name; its last component must be one of :data:`METHOD_PARAMETERS`.
        tensor: the tensor to fill (a meta tensor is left as it is).
        seed: the run's seed; None draws from the global RNG.

    Returns:
        ``tensor``.

    Raises:
        ValueError: ``name`` is not a LoRA or adapter parameter.
    """
    kind = name.rsplit(".", 1)[-1]
    if kind not in METHOD_PARAMETERS:
        raise ValueError(f"'{name}' is not a LoRA or adapter parameter (one of {METHOD_PARAMETERS})")
    if kind in ("lora_B", "adapter_gate"):
        return nn.init.zeros_(tensor)
    if tensor.is_meta:
        return tensor
    generator = _generator(seed, tensor.device)
    if kind == "lora_A" and tensor.dim() == 3:
        # experts' A (E, r, in): each row drawn as PEFT's nn.Linear(in, E * r) draws it (kaiming's bound, fan_in in)
        std = nn.init.calculate_gain("leaky_relu", math.sqrt(5)) / math.sqrt(tensor.shape[-1])
        return nn.init.uniform_(tensor, -math.sqrt(3.0) * std, math.sqrt(3.0) * std, generator=generator)
    if kind == "lora_A":
        return nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
    return nn.init.normal_(tensor, mean=0.0, std=ADAPTER_PROMPT_STD, generator=generator)


def _generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None or device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


def select_state_dict(model: nn.Module, suffixes: tuple[str, ...]) -> dict[str, Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if n.endswith(suffixes)}


def load_selected(
    model: nn.Module, state_dict: Mapping[str, Tensor], suffixes: tuple[str, ...], what: str
) -> None:
    expected = select_state_dict(model, suffixes)
    if not expected:
        raise ValueError(f"the model has no {what} parameters; apply {what} before loading its state dict")
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{what} state dict does not match the model: missing {missing[:5]} ({len(missing)} in all), "
            f"unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )
    for name, tensor in expected.items():
        if tuple(state_dict[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{what} state dict: '{name}' has shape {tuple(state_dict[name].shape)}, the model expects "
                f"{tuple(tensor.shape)}"
            )
    with torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state_dict[name])


# ----------------------------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------------------------


_OFF = [False]
"""Whether :func:`lora_off` is in effect: every LoRA-adapted module acts with its base weight alone."""


@contextlib.contextmanager
def lora_off() -> Iterator[None]:
    """Within it, every LoRA-adapted linear and experts module computes with its base weights alone (PEFT's
    ``disable_adapter``): a preference objective's reference model is the LoRA / QLoRA policy's own base, with no
    second copy of it (:mod:`memfit.objectives`)."""
    was, _OFF[0] = _OFF[0], True
    try:
        yield
    finally:
        _OFF[0] = was


def _lora_linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """``W x + b + (alpha / r) * B A dropout(x)``, bound to a LoRA-adapted ``nn.Linear`` as its ``forward``.

    Args:
        x: (..., in) activations.

    Returns:
        (..., out).
    """
    settings: LoraSettings = self.memfit_lora
    out = F.linear(x, self.weight, self.bias)  # (..., out)
    if _OFF[0]:
        return out
    h = F.dropout(x, settings.dropout, self.training) if settings.dropout > 0 else x
    down = F.linear(h, self.lora_A) * settings.scale  # (..., r)
    return out + F.linear(down, self.lora_B)  # (..., out)


def lora_targets(model: Decoder, target_modules: Sequence[str]) -> list[tuple[str, nn.Linear]]:
    """The linear layers that ``target_modules`` names, in module order.

    A name of the family's :attr:`~memfit.models.families.Family.lora_aliases` (Phi-3's ``qkv_proj``) stands
    for its parts (``q_proj``, ``k_proj``, ``v_proj``), each adapted on its own.

    Args:
        model: a :class:`~memfit.models.decoder.Llama`.
        target_modules: names from the family's ``lora_targets``.

    Returns:
        ``[(module name, module), ...]``.

    Raises:
        ValueError: an unknown or repeated name (a part named beside its alias too), or an empty list.
    """
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    if not target_modules:
        raise ValueError(f"LoRA target_modules is empty; choose from {', '.join(LORA_TARGETS)}")
    valid = families.family(model.config.family).lora_targets
    for name in target_modules:
        if name not in valid:
            raise ValueError(
                f"unknown LoRA target module {name!r} for the {model.config.family} family; valid: "
                f"{', '.join(valid)}"
            )
    if len(set(target_modules)) != len(target_modules):
        raise ValueError(f"LoRA target_modules repeats a name: {list(target_modules)}")
    aliases = families.family(model.config.family).lora_aliases
    expanded = [part for name in target_modules for part in aliases.get(name, (name,))]
    if len(set(expanded)) != len(expanded):
        raise ValueError(
            f"LoRA target_modules names a layer twice: {list(target_modules)} (for the {model.config.family} "
            f"family {', '.join(f'{a} is {list(p)}' for a, p in aliases.items())})"
        )
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in expanded
    ]


def _checked_lora_targets(
    model: Decoder,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str],
    target_parameters: Sequence[str] = (),
) -> tuple[list[tuple[str, nn.Linear]], list[tuple[str, moe.Experts, tuple[str, ...]]]]:
    """:func:`lora_targets` and :func:`expert_lora_targets` after checking LoRA's hyperparameters (the errors of
    :func:`apply_lora`)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"LoRA alpha must be a positive number, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    experts = expert_lora_targets(model, target_parameters)
    if experts and dropout > 0:
        raise ValueError(
            f"LoRA dropout must be 0 with target_parameters (got {dropout}): a LoRA on a stacked expert weight "
            "has no dropout, as PEFT's target_parameters has none (it could not load the adapter)"
        )
    targets = lora_targets(model, target_modules) if target_modules or not experts else []
    if model.lm_head.weight is model.model.embed_tokens.weight and any(n == "lm_head" for n, _ in targets):
        raise ValueError(
            "LoRA on lm_head is not supported with tied embeddings (tie_word_embeddings): lm_head.weight is "
            "model.embed_tokens.weight, so merging the update would change the input embedding too. Leave "
            "lm_head out of target_modules"
        )
    return targets, experts


EXPERT_LORA_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""The stacked expert weights LoRA may adapt (``lora.target_parameters``), named as PEFT's ``target_parameters``
name them on transformers 5's modules."""


def expert_lora_target(name: str) -> str:
    """The entry of :data:`EXPERT_LORA_TARGETS` that ``name`` names: itself, or its end after a dot as PEFT
    matches ``target_parameters`` (``experts.down_proj``, ``down_proj``).

    Raises:
        ValueError: ``name`` names none of them.
    """
    hits = [t for t in EXPERT_LORA_TARGETS if t == name or t.endswith(f".{name}")]
    if len(hits) != 1:
        raise ValueError(
            f"unknown LoRA target parameter {name!r}; valid: {', '.join(EXPERT_LORA_TARGETS)} (a mixture of "
            "experts' stacked weights)"
        )
    return hits[0]


def expert_lora_targets(
    model: Decoder, target_parameters: Sequence[str]
) -> list[tuple[str, moe.Experts, tuple[str, ...]]]:
    """The experts modules whose stacked weights ``target_parameters`` names, in module order.

    Args:
        model: a decoder.
        target_parameters: names from :data:`EXPERT_LORA_TARGETS` (or their ends, :func:`expert_lora_target`).

    Returns:
        ``[(module name, experts, (attribute, ...)), ...]``, attributes in :data:`EXPERT_LORA_TARGETS`' order;
        empty when ``target_parameters`` is.

    Raises:
        ValueError: an unknown or repeated name, or a model without a mixture of experts.
    """
    if isinstance(target_parameters, str):
        target_parameters = [target_parameters]
    canonical = [expert_lora_target(n) for n in target_parameters]
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"LoRA target_parameters names a weight twice: {list(target_parameters)}")
    if not canonical:
        return []
    attrs = tuple(t.rsplit(".", 1)[-1] for t in EXPERT_LORA_TARGETS if t in canonical)
    found = [(n, m, attrs) for n, m in model.named_modules() if isinstance(m, moe.Experts)]
    if not found:
        raise ValueError(
            f"LoRA target_parameters {list(target_parameters)} adapt a mixture of experts' stacked weights, but "
            f"this {model.config.family} model has no mixture of experts; use target_modules"
        )
    return found


def _lora_experts_forward(self: moe.Experts, xs: Tensor, sizes: list[int]) -> Tensor:
    """:meth:`~memfit.models.moe.Experts.forward` with the LoRA of each adapted stack beside its weight."""
    if _OFF[0]:
        return moe.grouped_experts(xs, self.gate_up_proj, self.down_proj, sizes, None)
    pairs = {name: (holder.lora_A, holder.lora_B) for name, holder in self.lora.items()}
    lora = moe.ExpertsLora(pairs.get("gate_up_proj"), pairs.get("down_proj"), self.memfit_lora.scale)
    return moe.grouped_experts(xs, self.gate_up_proj, self.down_proj, sizes, lora)


def _add_expert_lora(
    experts: moe.Experts, attrs: Sequence[str], settings: LoraSettings, seed: int | None
) -> None:
    """Give ``experts`` a LoRA on each stack in ``attrs``: ``experts.lora.<attr>.lora_A`` (E, r, in) and
    ``lora_B`` (E, out, r), initialised as :func:`init_method_parameter_` draws them."""
    holders = nn.ModuleDict()
    for attr in attrs:
        weight = experts._parameters[attr]  # (E, out, in), NF4 under QLoRA
        num, out, inp = weight.shape
        holder = nn.Module()
        for kind, shape in (("lora_A", (num, settings.rank, inp)), ("lora_B", (num, out, settings.rank))):
            tensor = torch.empty(shape, device=weight.device, dtype=weight.dtype)
            holder.register_parameter(kind, nn.Parameter(init_method_parameter_(kind, tensor, seed)))
        holders[attr] = holder
    experts.lora = holders
    experts.memfit_lora = settings
    experts.forward = types.MethodType(_lora_experts_forward, experts)


def apply_lora(
    model: Decoder,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    seed: int | None = None,
    target_parameters: Sequence[str] = (),
) -> list[str]:
    """Add a LoRA update to the targeted linear layers and stacked expert weights, and freeze everything else.

    Each target gets parameters ``lora_A`` (r, in), kaiming-uniform (``a = sqrt(5)``, as PEFT and
    ``nn.Linear``), and ``lora_B`` (out, r), zeros, on the base weight's device and in its dtype (meta and fake
    tensors included), and its ``forward`` becomes ``W x + (alpha / r) * B A dropout(x)``.

    A stacked expert weight (``target_parameters``: a mixture of experts' ``gate_up_proj`` (E, 2I, C) or
    ``down_proj`` (E, C, I)) gets ``lora_A`` (E, r, in) and ``lora_B`` (E, out, r) under
    ``<experts>.lora.<weight>``: each expert's matrix acts as ``W_e + (alpha / r) * B_e A_e``, as PEFT's
    ``target_parameters`` LoRA does, computed beside each expert's matmul (:class:`memfit.models.moe.ExpertsLora`).

    Args:
        model: a built :class:`~memfit.models.decoder.Llama` (base weights already loaded).
        rank: r, a positive int.
        alpha: scale numerator, > 0; the update is multiplied by ``alpha / rank``.
        dropout: probability in [0, 1) of dropping inputs of the low-rank path while training.
        target_modules: names from :data:`LORA_TARGETS` (may be empty when ``target_parameters`` is not).
        seed: seed of a generator for ``lora_A``'s init; None draws from the global RNG.
        target_parameters: names from :data:`EXPERT_LORA_TARGETS`.

    Returns:
        The names of the new trainable parameters, e.g. ``model.layers.0.self_attn.q_proj.lora_A``,
        ``model.layers.0.mlp.experts.lora.down_proj.lora_B``.

    Raises:
        ValueError: a bad hyperparameter or target name; ``target_parameters`` on a dense model, or with a
            dropout above 0; a method already applied; ``lm_head`` targeted while it
            shares its weight with the token embedding (``tie_word_embeddings``): a merged update would change
            the embedding too, so LoRA on a tied ``lm_head`` is refused (leave it out of ``target_modules``).
    """
    check_no_peft(model, "LoRA")
    targets, experts = _checked_lora_targets(model, rank, alpha, dropout, target_modules, target_parameters)
    adapted = {name.rsplit(".", 1)[-1] for name, _ in targets}  # aliases (qkv_proj) as their parts
    stacks = {f"mlp.experts.{a}" for _, _, attrs in experts for a in attrs}
    settings = LoraSettings(
        rank=rank,
        alpha=float(alpha),
        dropout=float(dropout),
        target_modules=tuple(t for t in LORA_TARGETS if t in adapted),
        target_parameters=tuple(t for t in EXPERT_LORA_TARGETS if t in stacks),
    )
    names = []
    for module_name, linear in targets:
        weight = linear.weight  # (out, in)
        a = torch.empty(rank, linear.in_features, device=weight.device, dtype=weight.dtype)  # (r, in)
        b = torch.empty(linear.out_features, rank, device=weight.device, dtype=weight.dtype)  # (out, r)
        init_method_parameter_("lora_A", a, seed)
        init_method_parameter_("lora_B", b, seed)
        linear.register_parameter("lora_A", nn.Parameter(a))
        linear.register_parameter("lora_B", nn.Parameter(b))
        linear.memfit_lora = settings
        linear.forward = types.MethodType(_lora_linear_forward, linear)
        names += [f"{module_name}.lora_A", f"{module_name}.lora_B"]
    for module_name, module, attrs in experts:
        _add_expert_lora(module, attrs, settings, seed)
        names += [f"{module_name}.lora.{a}.{kind}" for a in attrs for kind in ("lora_A", "lora_B")]
    freeze_base(model, names)
    model.memfit_peft = settings
    return names


def _lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every LoRA-adapted linear layer and experts module."""
    return [
        (n, m) for n, m in model.named_modules() if isinstance(getattr(m, "memfit_lora", None), LoraSettings)
    ]


def lora_settings(model: nn.Module) -> LoraSettings:
    """The hyperparameters LoRA was applied to ``model`` with.

    Args:
        model: any module.

    Returns:
        The :class:`LoraSettings` kept on the model by :func:`apply_lora`.

    Raises:
        ValueError: the model has no LoRA (none was applied, or it was merged).
    """
    settings = getattr(model, "memfit_peft", None)
    if not isinstance(settings, LoraSettings):
        raise ValueError("the model has no LoRA applied (call apply_lora first)")
    return settings


def lora_effective_weight(linear: nn.Linear) -> Tensor:
    """The weight a linear layer acts with: ``W + (alpha / r) B A`` under LoRA, ``W`` otherwise.

    For code that reads a weight instead of calling the module (chunked cross-entropy over ``lm_head``). The
    LoRA case builds a new (out, in) tensor, differentiable in ``lora_A`` and ``lora_B``.

    Args:
        linear: an ``nn.Linear``, adapted or not.

    Returns:
        (out, in).
    """
    settings = getattr(linear, "memfit_lora", None)
    if not isinstance(settings, LoraSettings) or _OFF[0]:
        return linear.weight
    return linear.weight + (linear.lora_B * settings.scale) @ linear.lora_A  # (out, in)


@torch.no_grad()
def merge_lora(model: Decoder) -> None:
    """Fold every LoRA update into its base weight and remove LoRA from the model.

    Under QLoRA every NF4 weight is first dequantized (:func:`dequantize_base_`): the merged model is the
    dequantized base plus the updates, a plain model of the parameter dtype. ``W += (alpha / r) * B @ A`` is
    computed in float32 and cast back to ``W``'s dtype; ``lora_A`` / ``lora_B``
    are deleted and the plain ``nn.Linear.forward`` restored, so the state dict is the base model's again. The
    parameters' ``requires_grad`` flags are left as they are (the base stays frozen).

    Args:
        model: a model :func:`apply_lora` was applied to.

    Raises:
        ValueError: the model has no LoRA.
    """
    settings = lora_settings(model)
    if isinstance(settings, QLoraSettings):
        dequantize_base_(model)
    for _, module in _lora_modules(model):
        if isinstance(module, moe.Experts):
            for attr, holder in module.lora.items():
                weight = module._parameters[attr]  # (E, out, in)
                for e in range(weight.shape[0]):  # one expert's fp32 update at a time
                    delta = (holder.lora_B[e].float() @ holder.lora_A[e].float()) * settings.scale
                    weight[e].copy_((weight[e].float() + delta).to(weight.dtype))
            del module.lora, module.memfit_lora
        else:
            delta = (module.lora_B.float() @ module.lora_A.float()) * settings.scale  # (out, in)
            module.weight.copy_((module.weight.float() + delta).to(module.weight.dtype))
            del module.lora_A, module.lora_B, module.memfit_lora
        del module.forward  # the instance attribute: the class's forward shows through again
    del model.memfit_peft


def lora_state_dict(model: Decoder) -> dict[str, Tensor]:
    """The LoRA tensors only, under memfit (= Hugging Face module) names.

    Args:
        model: a model with LoRA.

    Returns:
        ``{"model.layers.0.self_attn.q_proj.lora_A": (r, in), "...lora_B": (out, r), ...}``, detached, sharing
        storage with the parameters.
    """
    lora_settings(model)
    return select_state_dict(model, _LORA_SUFFIXES)


def load_lora_state_dict(model: Decoder, state_dict: Mapping[str, Tensor]) -> None:
    """Copy a :func:`lora_state_dict` into the model's LoRA parameters (strict).

    Args:
        model: a model with LoRA applied with the same targets and rank.
        state_dict: names as :func:`lora_state_dict` gives them.

    Raises:
        ValueError: the model has no LoRA, a key is missing or unexpected, or a shape differs (nothing copied).
    """
    lora_settings(model)
    load_selected(model, state_dict, _LORA_SUFFIXES, "LoRA")


# ----------------------------------------------------------------------------------------------------------------
# QLoRA: a 4-bit NormalFloat base
# ----------------------------------------------------------------------------------------------------------------

QLORA_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder linears whose frozen weights QLoRA stores in NF4 (every one, adapted by LoRA or not)."""


def nf4_bytes(shape: Sequence[int], dtype: torch.dtype, world_size: int = 1) -> int:
    """Bytes of one weight stored in NF4 by torchao's ``NF4Tensor``, exactly (one rank's shard when sharded).

    ``numel / 2`` (two 4-bit codes a byte) + ``numel / 64`` int8 block scales + one scale of the scales per
    ``scaler_block_size`` blocks, in ``dtype``; and, on every rank, the scales' mean and the 16-entry code table,
    in ``dtype``. FSDP2 splits the first three evenly over the ranks (torchao's ``aten.split`` of an
    ``NF4Tensor``). A weight with a single group of scales (under 16,384 elements) keeps its one scale of the
    scales as a view of a ``scaler_block_size``-element storage (torchao's ``double_quantize_scalers``: a
    one-element slice is already contiguous, so it is not copied), and that storage is what counts.

    Args:
        shape: the weight's (unsharded) shape.
        dtype: the dtype it dequantizes to (the parameter dtype).
        world_size: ranks it is sharded over.

    Returns:
        Bytes.

    Raises:
        ValueError: as :func:`nf4_layout`.
    """
    block, scaler_block = nf4_layout(shape)
    numel = math.prod(shape)
    n_blocks = numel // block
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups = n_blocks // scaler_block
    split = numel // 2 + n_blocks + (scaler_block if groups == 1 else groups) * itemsize
    return split // world_size + (1 + NF4_LUT_SIZE) * itemsize


def check_nf4_sharding(model: nn.Module, world_size: int) -> None:
    """Check that FSDP2 can split every NF4 weight of ``model`` evenly over ``world_size`` ranks on dim 0.

    torchao's ``NF4Tensor`` splits its codes, block scales and scales of scales in equal parts (no padding), so
    the rows and the scales of the scales (one per ``scaler_block_size`` blocks, :func:`nf4_layout`) must both be
    multiples of ``world_size``.

    Raises:
        ValueError: naming the first weight that does not split, and why.
    """
    for name, p in model.named_parameters():
        if not is_nf4(p):
            continue
        block, scaler_block = nf4_layout(p.shape)
        groups = math.prod(p.shape) // block // scaler_block
        parts = []
        if p.shape[0] % world_size:
            parts.append(f"its {p.shape[0]} rows")
        if groups % world_size:
            parts.append(
                f"its {groups} group{'s' if groups != 1 else ''} of {scaler_block} block scales (one scale of the "
                f"scales each)"
            )
        if parts:
            most = math.gcd(p.shape[0], groups)
            fewer = (
                f"Use a number of ranks that divides {most}, or "
                if most > 1
                else "Train it in one process, or "
            )
            raise ValueError(
                f"QLoRA's NF4 weight '{name}' {tuple(p.shape)} does not split evenly over {world_size} ranks: "
                f"FSDP2 splits {' and '.join(parts)} in equal parts. {fewer}use method=lora for a model this small"
            )


QLORA_QUANTIZED_EXPERTS = ("gate_up_proj", "down_proj")
"""A mixture of experts' stacked weights QLoRA stores in NF4 (``mlp.experts.gate_up_proj``, each expert's
(2I, C) a slice of it)."""


def is_qlora_quantized(name: str) -> bool:
    """Whether QLoRA stores the parameter ``name`` in NF4: the weight of a decoder linear in
    :data:`QLORA_QUANTIZED` (``model.layers.3.mlp.down_proj.weight``), or a mixture of experts' stacked weight
    (``model.layers.3.mlp.experts.gate_up_proj``)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "model" or parts[1] != "layers":
        return False
    if parts[-2] == "experts":
        return parts[-1] in QLORA_QUANTIZED_EXPERTS
    return parts[-1] == "weight" and parts[-2] in QLORA_QUANTIZED


def quantized_in_parts(name: str, dtype: torch.dtype, part_numel: int) -> bool:
    """Whether a QLoRA load quantizes the stacked weight ``name`` part by part as its experts are read
    (:class:`memfit.models.nf4.NF4Builder`): an NF4 weight (:func:`is_qlora_quantized`) of a 16-bit ``dtype`` whose
    parts of ``part_numel`` weights are whole NF4 blocks; else it is stacked whole, then quantized. The rule both the
    load (:func:`memfit.build.nf4_stack`) and its prediction (:mod:`memfit.planner.phases`) follow."""
    return is_qlora_quantized(name) and in_parts(dtype, part_numel)


def quantize_for_qlora(name: str, tensor: Tensor) -> Tensor:
    """What a QLoRA load does with each tensor as it is read: NF4 for the weights :func:`is_qlora_quantized`
    names, the tensor unchanged otherwise (a ``transform`` for :func:`memfit.convert.load_pretrained`)."""
    return to_nf4(tensor) if is_qlora_quantized(name) else tensor


def _quantized_linears(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` of every weight QLoRA stores in NF4 (:func:`is_qlora_quantized`)."""
    return [
        (m, attr)
        for n, m in model.named_modules()
        for attr in ("weight", *QLORA_QUANTIZED_EXPERTS)
        if attr in m._parameters and is_qlora_quantized(f"{n}.{attr}")
    ]


@torch.no_grad()
def quantize_base_(model: Decoder) -> int:
    """Store every decoder linear's weight (:data:`QLORA_QUANTIZED`) in NF4, frozen, in place.

    Weights already in NF4 (quantized while loading) are left as they are; meta and fake weights become NF4
    tensors of exact inner shapes (:func:`empty_nf4`).

    Args:
        model: a :class:`~memfit.models.decoder.Llama`.

    Returns:
        How many weights were quantized now.

    Raises:
        ValueError: a weight's size is not a multiple of the NF4 block (:func:`nf4_layout`), checked for every
            weight before any is changed.
    """
    weights = [(m, attr) for m, attr in _quantized_linears(model) if not is_nf4(m._parameters[attr])]
    for module, attr in weights:
        nf4_layout(module._parameters[attr].shape)
    for module, attr in weights:
        module._parameters[attr] = nn.Parameter(to_nf4(module._parameters[attr]), requires_grad=False)
    return len(weights)


@torch.no_grad()
def empty_nf4_(model: nn.Module, device: torch.device) -> int:
    """Give every NF4 weight fresh uninitialised inner tensors on ``device`` (:func:`empty_nf4`): after
    ``Module.to_empty``, which moves only some of an ``NF4Tensor``'s inner tensors; inside a ``FakeTensorMode``
    they are fake (the estimator).

    Returns:
        How many weights were replaced.
    """
    count = 0
    for module, attr, weight in _nf4_weights(model):
        if not hasattr(weight, "_local_tensor"):
            module._parameters[attr] = nn.Parameter(
                empty_nf4(weight.shape, weight.dtype, device), requires_grad=False
            )
            count += 1
    return count


def _nf4_weights(model: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """``(module, attribute, weight)`` of every NF4 weight (a linear's, or a mixture of experts' stack)."""
    return [
        (m, attr, m._parameters[attr])
        for m in model.modules()
        for attr in ("weight", *QLORA_QUANTIZED_EXPERTS)
        if m._parameters.get(attr) is not None and is_nf4(m._parameters[attr])
    ]


@torch.no_grad()
def dequantize_base_(model: nn.Module) -> int:
    """Replace every NF4 weight by its dequantized values (a plain frozen parameter of the NF4 tensor's dtype).

    Returns:
        How many weights were dequantized.
    """
    weights = _nf4_weights(model)
    for module, attr, weight in weights:
        module._parameters[attr] = nn.Parameter(weight.get_original_weight(), requires_grad=False)
    return len(weights)


def apply_qlora(
    model: Decoder,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    seed: int | None = None,
    target_parameters: Sequence[str] = (),
) -> list[str]:
    """QLoRA: store the decoder linears (and stacked experts) in NF4 (:func:`quantize_base_`), then apply LoRA
    (:func:`apply_lora`).

    LoRA's ``lora_A`` / ``lora_B`` take the parameter dtype (the NF4 tensors' dtype) and train in it; everything
    else is frozen.

    Args:
        model: a built :class:`~memfit.models.decoder.Llama`, its base weights loaded (already NF4 when loaded with
            :func:`quantize_for_qlora`) or on the meta device.
        rank, alpha, dropout, target_modules, seed, target_parameters: as :func:`apply_lora`.

    Returns:
        The names of the new trainable parameters.

    Raises:
        ValueError: as :func:`apply_lora` and :func:`quantize_base_` (checked before the model changes).
    """
    check_no_peft(model, "QLoRA")
    _checked_lora_targets(model, rank, alpha, dropout, target_modules, target_parameters)
    quantize_base_(model)
    names = apply_lora(
        model,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        target_modules=target_modules,
        seed=seed,
        target_parameters=target_parameters,
    )
    model.memfit_peft = QLoraSettings(**dataclasses.asdict(model.memfit_peft))
    return names
