"""Hugging Face PEFT's LoRA adapter directories: write one from a LoRA model, load one into a base model.

A directory holds ``adapter_config.json`` and ``adapter_model.safetensors``, as ``PeftModel.save_pretrained``
writes them and ``peft.PeftModel.from_pretrained`` reads them. The LoRA itself (applying, merging, its state dict)
is :mod:`memfit.models.peft`, which does no file I/O.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from memfit.checkpoint import atomic_directory
from memfit.errors import CheckpointError
from memfit.filemode import give_default_mode
from memfit.models.decoder import Decoder
from memfit.models.families import family
from memfit.models.peft import (
    EXPERT_LORA_TARGETS,
    LoraSettings,
    apply_lora,
    expert_lora_target,
    load_lora_state_dict,
    lora_settings,
    lora_state_dict,
)

__all__ = ["PEFT_CONFIG", "PEFT_PREFIX", "PEFT_WEIGHTS", "load_peft_adapter", "save_peft_adapter"]

PEFT_WEIGHTS = "adapter_model.safetensors"
"""File name of the adapter tensors in Hugging Face PEFT's format."""
PEFT_CONFIG = "adapter_config.json"
"""File name of the adapter config in Hugging Face PEFT's format."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModelForCausalLM`` puts before the base model's module names."""


def _peft_config(settings: LoraSettings, base_model_name_or_path: str) -> dict[str, Any]:
    """``adapter_config.json`` as Hugging Face PEFT's ``LoraConfig.save_pretrained`` writes it."""
    alpha = int(settings.alpha) if float(settings.alpha).is_integer() else settings.alpha
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": settings.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": settings.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(settings.target_modules),
        "target_parameters": list(settings.target_parameters) or None,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


_EXPERTS_LORA = ".experts.lora."
"""What memfit's name of a stacked expert weight's LoRA holds: ``model.layers.0.mlp.experts.lora.down_proj.lora_A``."""


def _to_peft(name: str, tensor: Tensor, order: list[str]) -> tuple[str, Tensor]:
    """PEFT's key and tensor for one of memfit's LoRA tensors.

    A linear's ``<module>.lora_A`` (r, in) is ``base_model.model.<module>.lora_A.weight`` as it is. A stacked
    expert weight's is PEFT's ``ParamWrapper``'s: ``A`` (E, r, in) is ``lora_A.weight`` (E * r, in), expert e's rows
    ``e * r .. e * r + r - 1``; ``B`` (E, out, r) is ``lora_B.weight`` (out, r * E), expert e's columns
    ``e, e + E, ...``. PEFT wraps the experts module once per targeted weight, in the module's parameter order
    (transformers registers ``gate_up_proj`` first), the first innermost: with both weights targeted,
    ``gate_up_proj``'s tensors are under ``<experts>.base_layer.`` and ``down_proj``'s under ``<experts>.``.

    Args:
        name: memfit's name of the tensor.
        tensor: the tensor.
        order: the targeted stacks' attribute names, innermost first (:func:`_stacks`).
    """
    module, which = name.rsplit(".", 1)  # which: lora_A or lora_B
    if _EXPERTS_LORA not in module:
        return f"{PEFT_PREFIX}{module}.{which}.weight", tensor
    experts, weight = module.split(_EXPERTS_LORA)
    wrapper = "base_layer." * (len(order) - 1 - order.index(weight))
    if which == "lora_A":
        flat = tensor.reshape(-1, tensor.shape[-1])  # (E * r, in)
    else:
        flat = tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)  # (out, r * E)
    return f"{PEFT_PREFIX}{experts}.experts.{wrapper}{which}.weight", flat


def _from_peft(key: str, tensor: Tensor, order: list[str], experts: int) -> tuple[str, Tensor]:
    """memfit's name and tensor for one of PEFT's adapter tensors (the inverse of :func:`_to_peft`)."""
    name = key.removeprefix(PEFT_PREFIX).removesuffix(".weight")
    module, which = name.rsplit(".", 1)
    if not module.endswith(".experts") and ".experts.base_layer" not in module:
        return name, tensor
    nest = module.count("base_layer")
    if nest >= len(order):
        raise ValueError(f"'{key}': {nest} wrappers deep, but target_parameters names {len(order)} weights")
    weight = order[len(order) - 1 - nest]
    owner = module.split(".experts")[0]
    if which == "lora_A":
        local = tensor.reshape(experts, -1, tensor.shape[-1])  # (E, r, in)
    else:
        local = tensor.reshape(tensor.shape[0], -1, experts).permute(2, 0, 1).contiguous()  # (E, out, r)
    return f"{owner}{_EXPERTS_LORA}{weight}.{which}", local


def _stacks(target_parameters: list[str] | tuple[str, ...]) -> list[str]:
    """The attribute names of the targeted stacks in the experts module's parameter order, the order PEFT wraps
    them in whatever the config lists (``["gate_up_proj", "down_proj"]``)."""
    return [t.rsplit(".", 1)[-1] for t in EXPERT_LORA_TARGETS if t in target_parameters]


def save_peft_adapter(model: Decoder, out_dir: str | Path, *, base_model_name_or_path: str = "") -> Path:
    """Write the LoRA adapter alone in Hugging Face PEFT's format, atomically.

    ``adapter_model.safetensors`` holds ``base_model.model.<module>.lora_A.weight`` (r, in) and
    ``...lora_B.weight`` (out, r) for every target; ``adapter_config.json`` holds ``peft_type`` LORA, ``r``,
    ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``target_parameters`` (a mixture of experts' stacked
    weights, in PEFT's ``ParamWrapper`` layout: :func:`_to_peft`), ``task_type`` CAUSAL_LM, ... so that
    ``peft.PeftModel.from_pretrained(LlamaForCausalLM..., out_dir)`` loads it. Both files are written into a
    temporary sibling directory which is then renamed to ``out_dir`` (replacing an existing one).

    Args:
        model: a model with LoRA.
        out_dir: the adapter directory to create.
        base_model_name_or_path: recorded in the config (the Hub id or path of the base model).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: the model has no LoRA.
        CheckpointError: a LoRA on a part of a matrix the family's checkpoints fuse (Phi-3's q/k/v_proj of
            ``qkv_proj``, gate/up_proj of ``gate_up_proj``), which PEFT's format cannot hold; or writing failed (an
            existing ``out_dir`` is untouched).
    """
    settings = lora_settings(model)
    _check_unfused_targets(model.config.family, settings)
    tensors = {}
    for name, tensor in lora_state_dict(model).items():
        key, value = _to_peft(name, tensor, _stacks(settings.target_parameters))
        tensors[key] = value.cpu().contiguous()
    out = Path(out_dir)
    with atomic_directory(out, "adapter", where="--out") as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        give_default_mode(tmp / PEFT_WEIGHTS)  # save_file leaves 0o600
        config = _peft_config(settings, base_model_name_or_path)
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _check_unfused_targets(family_name: str, settings: LoraSettings) -> None:
    """Refuse a LoRA on a part of a fused matrix: PEFT's adapter of Phi-3's ``qkv_proj`` is one ``A`` (r, C)
    shared by q, k and v and one ``B`` (q + k + v rows, r), which memfit's three LoRAs, each with an ``A`` of
    its own, are not (their update ``B_q A_q; B_k A_k; B_v A_v`` has rank up to 3r)."""
    fam = family(family_name)
    fused = {part.split(".")[-2]: name.split(".")[-2] for name, parts in fam.fused for part in parts}
    hit = [t for t in settings.target_modules if t in fused]
    if hit:
        raise CheckpointError(
            f"the LoRA adapts {', '.join(hit)}, parts of the {fam.name} checkpoint's fused "
            f"{', '.join(dict.fromkeys(fused[t] for t in hit))}: memfit gives each part a LoRA of its own, which "
            f"PEFT's adapter format (one lora_A shared by the fused matrix) cannot hold. Export the merged model "
            f"(memfit export without --adapter-only), or adapt only "
            f"{', '.join(t for t in fam.lora_targets if t not in fused and t not in fam.lora_aliases)}"
        )


def load_peft_adapter(model: Decoder, adapter_dir: str | Path, *, seed: int | None = None) -> list[str]:
    """Apply LoRA as a Hugging Face PEFT adapter directory describes, and load its tensors.

    Args:
        model: a base model without any method applied.
        adapter_dir: a directory with ``adapter_config.json`` and ``adapter_model.safetensors`` (as
            :func:`save_peft_adapter` or PEFT write them).
        seed: unused by the result (every tensor is overwritten); passed to :func:`~memfit.models.peft.apply_lora`.

    Returns:
        The names of the LoRA parameters (as :func:`~memfit.models.peft.apply_lora`).

    Raises:
        CheckpointError: a file is missing or unreadable.
        ValueError: the config asks for what memfit's LoRA does not do (DoRA, rsLoRA, per-layer ranks, biases,
            ``fan_in_fan_out``, extra saved modules, a regex ``target_modules``), or the tensors do not match.
    """
    adapter_dir = Path(adapter_dir)
    try:
        config = json.loads((adapter_dir / PEFT_CONFIG).read_text())
        tensors = load_file(str(adapter_dir / PEFT_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the PEFT adapter in '{adapter_dir}' ({exc})") from None
    if config.get("peft_type") != "LORA":
        raise ValueError(f"'{adapter_dir / PEFT_CONFIG}': peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "modules_to_save": None,
    }
    for key, plain in unsupported.items():
        if config.get(key, plain) not in (plain, None):
            raise ValueError(
                f"'{adapter_dir / PEFT_CONFIG}': {key}={config[key]!r} is not supported by memfit"
            )
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(
            f"'{adapter_dir / PEFT_CONFIG}': target_modules must be a list of names, got {targets!r}"
        )
    parameters = config.get("target_parameters") or []
    try:
        parameters = [expert_lora_target(n) for n in parameters]
    except ValueError as exc:
        raise ValueError(f"'{adapter_dir / PEFT_CONFIG}': target_parameters: {exc}") from None
    names = apply_lora(
        model,
        rank=config["r"],
        alpha=config["lora_alpha"],
        dropout=config.get("lora_dropout", 0.0),
        target_modules=targets,
        seed=seed,
        target_parameters=parameters,
    )
    order, experts = _stacks(parameters), model.config.num_experts or 1
    state_dict = dict(_from_peft(key, tensor, order, experts) for key, tensor in tensors.items())
    load_lora_state_dict(model, state_dict)
    return names
