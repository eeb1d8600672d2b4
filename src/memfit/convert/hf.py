"""Hugging Face directories of the families memfit builds (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Phi3ForCausalLM``; :mod:`memfit.models.families`): config mapping,
reading, and writing (:func:`export_hf`).

A family whose checkpoints fuse several of memfit's matrices (:attr:`~memfit.models.families.Family.fused`:
Phi-3's ``qkv_proj`` and ``gate_up_proj``) is read split, each fused tensor listed as its parts from the headers
and split as it is read, and written fused again, each fused tensor concatenated as its shard is written.

A directory holds ``config.json`` and ``model.safetensors``, or the shards listed in
``model.safetensors.index.json`` (what ``save_pretrained`` writes). ``config.json`` is read in both the
transformers 4.x spelling (``rope_theta`` and ``rope_scaling`` at the top level, ``torch_dtype``) and the 5.x one
(``rope_parameters``, ``dtype``), and written in both. :func:`export_hf` writes a directory that
``AutoModelForCausalLM.from_pretrained`` (the family's own class) and ``AutoTokenizer.from_pretrained`` load,
atomically and with one shard in memory at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from memfit.checkpoint import atomic_directory, check_writable
from memfit.convert.tensors import (
    Entry,
    PretrainedInfo,
    Scan,
    Stack,
    StackFactory,
    config_file,
    first_float_dtype,
    read_json,
    read_safetensors,
    safetensors_header,
)
from memfit.errors import CheckpointError
from memfit.filemode import give_default_mode
from memfit.models.config import DecoderConfig, RopeScaling
from memfit.models.decoder import Decoder, build_decoder
from memfit.models.families import family, hf_family
from memfit.tokenizer import CONFIG_NAME as TOKENIZER_CONFIG
from memfit.tokenizer import ChatTemplateSource, Tokenizer
from memfit.units import GIB

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "HF_CONFIG",
    "HF_GENERATION_CONFIG",
    "HF_INDEX",
    "HF_WEIGHTS",
    "check_out_dir",
    "export_hf",
    "hf_config_to_decoder",
    "decoder_to_hf_config",
    "config_only",
    "read_hf_config",
    "scan_hf",
    "scan_hf_config",
]

HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * GIB
"""Bytes per safetensors shard that :func:`export_hf` writes by default (5 GiB, as ``save_pretrained`` does)."""

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_UNIMPLEMENTED = {
    "attention_dropout": "dropout inside attention",
    "attn_logit_softcapping": "soft-capping of the attention scores",
    "final_logit_softcapping": "soft-capping of the logits",
    "num_experts": "a mixture of experts",
    "num_local_experts": "a mixture of experts",
}
"""``config.json`` keys that change the computation, which memfit refuses when set (naming the key)."""


# ================================================================================================================
# Configs


def read_hf_config(path: str | Path) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Hugging Face ``config.json`` of a family memfit builds
    (:mod:`memfit.models.families`: Llama, Mistral, Qwen2 / Qwen2.5, Qwen3).

    Reads both spellings: transformers 4.x (``rope_theta`` at the top level, ``rope_scaling`` with ``rope_type``
    or ``type``) and 5.x (``rope_parameters`` holding ``rope_theta`` and the scaling). As transformers does, a
    non-null ``rope_scaling`` takes precedence over ``rope_parameters``, and ``rope_theta`` inside the dict over
    the top-level one. Fields: ``hidden_size`` -> ``dim``, ``num_hidden_layers`` -> ``num_layers``,
    ``num_attention_heads`` -> ``num_heads``, ``num_key_value_heads`` -> ``num_kv_heads`` (default
    ``num_heads``), ``intermediate_size``, ``rms_norm_eps`` -> ``norm_eps`` (default 1e-6, transformers'),
    ``max_position_embeddings`` -> ``max_seq_len`` (default 2048), ``vocab_size``, ``tie_word_embeddings``
    (default False).

    Args:
        path: the checkpoint directory or its ``config.json``.

    Returns:
        The validated config.

    Raises:
        CheckpointError: naming the file and the key, when the file is missing or not JSON, a size key is
            missing, ``model_type`` / ``architectures`` is not a family memfit builds
            (:func:`memfit.models.families.hf_family`: a mixture of experts, Mamba, an unknown type), a field the
            family's entry refuses is set (a bias flag on a family that has none, Qwen's ``use_sliding_window``, a
            per-layer ``layer_types`` pattern), ``hidden_act`` is not ``"silu"``, a computation memfit does not
            implement is asked for (``attention_dropout``, soft-capping, experts), the rope type is neither
            ``"default"`` nor ``"llama3"`` (``"yarn"``, ``"longrope"``, ...), the weights are quantized, or the
            values fail validation.
    """
    config, _ = _hf_config_from_file(config_file(Path(path), HF_CONFIG))
    return config


def _hf_config_from_file(path: Path) -> tuple[DecoderConfig, torch.dtype | None]:
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"'{path}' must hold a JSON object, got {type(cfg).__name__}")
    return hf_config_to_decoder(cfg, source=str(path))


def hf_config_to_decoder(
    cfg: dict[str, Any], source: str = "config.json"
) -> tuple[DecoderConfig, torch.dtype | None]:
    """Translate a Hugging Face config dict (4.x or 5.x spelling) of a family memfit builds to a
    :class:`DecoderConfig`: the shared keys here, the family's own by its entry (:attr:`Family.read`).

    Args:
        cfg: the parsed ``config.json``.
        source: the file, for error messages.

    Returns:
        ``(config, stored_dtype)``; ``stored_dtype`` is ``dtype`` (5.x) or ``torch_dtype`` (4.x) when it names a
        floating dtype, else None.

    Raises:
        CheckpointError: see :func:`read_hf_config`.
    """

    def refuse(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"'{source}': {key} {why}")

    fam = hf_family(cfg.get("model_type"), cfg.get("architectures"), refuse)
    cfg = {**fam.hf_defaults, **cfg}
    if cfg.get("hidden_act", fam.hidden_acts[0]) not in fam.hidden_acts:
        raise refuse(
            "hidden_act", f"is {cfg['hidden_act']!r}; memfit builds {fam.name} with {fam.hidden_acts[0]!r}"
        )
    if cfg.get("quantization_config"):
        raise refuse(
            "quantization_config", "is set; quantized checkpoints are not supported: use the bf16 weights"
        )
    for key in _UNIMPLEMENTED:
        if key not in fam.implements and cfg.get(key) not in (None, False, 0, 0.0):
            raise refuse(
                key, f"is {cfg[key]!r}; memfit's decoder does not implement it ({_UNIMPLEMENTED[key]})"
            )
    family_fields = fam.read(cfg, refuse)
    sizes = {}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if cfg.get(key) is None:
            raise refuse(key, "is missing; a Llama config.json needs it")
        sizes[key] = cfg[key]
    heads = sizes["num_attention_heads"]
    rope_key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = {} if fam.reads_rope else cfg.get(rope_key) or {}  # the family's read maps its own RoPE keys
    if not isinstance(rope, dict):
        raise refuse(rope_key, f"must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise refuse("partial_rotary_factor", f"is {partial}; memfit rotates whole heads (1.0)")
    scaling: RopeScaling | None = None
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if key not in rope:
                raise refuse(f"{rope_key}.{key}", "is missing; the 'llama3' rope type needs it")
        try:
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
                ),
            )
        except (TypeError, ValueError) as exc:
            raise refuse(rope_key, f"is invalid: {exc}") from None
    elif rope_type != "default":
        raise refuse(
            f"{rope_key}.rope_type",
            f"is {rope_type!r}; memfit implements the 'default' and 'llama3' RoPE only (no YaRN, LongRoPE, linear "
            f"or dynamic scaling)",
        )
    num_kv_heads = cfg.get("num_key_value_heads")
    try:
        shared = dict(
            vocab_size=sizes["vocab_size"],
            dim=sizes["hidden_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads if num_kv_heads is None else num_kv_heads,
            intermediate_size=sizes["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            family=fam.name,
        )
        config = DecoderConfig(
            **{**shared, **family_fields}
        )  # a family's own RoPE (reads_rope) replaces the shared
    except ValueError as exc:
        raise CheckpointError(f"'{source}': {exc}") from None
    dtype_name = cfg.get("dtype", cfg.get("torch_dtype"))
    return config, _FLOAT_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None


def decoder_to_hf_config(
    config: DecoderConfig,
    dtype: torch.dtype | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of a :class:`DecoderConfig`, for its family's class (``LlamaForCausalLM``,
    ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``: :attr:`Family.write` adds its keys).

    Readable by transformers 5.x (``rope_parameters``, ``dtype``) and 4.x (top-level ``rope_theta``,
    ``rope_scaling``, ``torch_dtype``): both spellings are written and agree. transformers 5.24 accepts the 4.x
    keys (it folds them into ``rope_parameters``).

    Args:
        config: the architecture.
        dtype: dtype of the stored weights, or None to omit it.
        bos_token_id: BOS id, or None.
        eos_token_id: EOS id or ids, or None.

    Returns:
        A JSON-serialisable dict.
    """
    fam = family(config.family)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    rope_scaling = None
    if config.rope_scaling is not None:
        rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
        rope_parameters = {**rope_scaling, "rope_theta": float(config.rope_theta)}
    out: dict[str, Any] = {
        "architectures": [fam.architectures[0]],
        "model_type": fam.model_types[0],
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "rope_parameters": rope_parameters,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": rope_scaling,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    out.update(fam.write(config))  # after the shared keys: Gemma 3 writes its own RoPE keys
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


# ================================================================================================================
# Reading a Hugging Face directory: config, info and the tensor list from headers only


def scan_hf(directory: Path) -> Scan:
    """A Hugging Face directory's config, info (token ids from ``generation_config.json``, tokenizer files) and
    tensor list, from its config and safetensors headers only."""
    config_path = config_file(directory, HF_CONFIG)
    config, config_dtype = _hf_config_from_file(config_path)
    entries = _safetensors_entries(directory)
    bos, eos = _hf_token_ids(directory, config_path)
    tokenizer_path = directory if _has_tokenizer_files(directory) else None
    notes = (
        () if tokenizer_path else (f"no tokenizer files (tokenizer.json, tokenizer.model) in '{directory}'",)
    )
    info = PretrainedInfo(
        format="hf",
        path=directory,
        stored_dtype=first_float_dtype(entries) or config_dtype,
        bos_token_id=bos,
        eos_token_ids=eos,
        tokenizer_path=tokenizer_path,
        notes=notes,
    )
    if family(config.family).fused:
        return _split_scan(config, info, entries)
    if family(config.family).experts is not None and any(".experts." in e.name for e in entries):
        return _expert_scan(config, info, entries)
    return Scan(config, info, entries, lambda: read_safetensors(entries), streamed=True)


def config_only(directory: Path) -> bool:
    """Whether ``directory`` holds a Hugging Face ``config.json`` and no weights: what ``memfit estimate`` and
    ``plan`` fetch of a Hub model (:data:`memfit.hub.CONFIG_FILES`), or a config copied alone."""
    if not (directory / HF_CONFIG).is_file() or (directory / HF_WEIGHTS).is_file():
        return False
    if any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin")):
        return False
    return True


def scan_hf_config(directory: Path) -> Scan:
    """A Hugging Face directory that holds only ``config.json`` (and perhaps ``model.safetensors.index.json``), read
    as the checkpoint ``save_pretrained`` writes for that config: the tensors the architecture stores under the
    family's checkpoint names (fused, or one per expert, as :func:`export_hf` writes them; a tied ``lm_head``
    stored once), their shapes from the config, their dtype the config's ``dtype`` / ``torch_dtype``, in the order
    the shards are read: the index's (grouped by shard as first named) where there is one, else sorted by name as
    ``model.safetensors`` lists them. What the estimator needs of a load (:func:`memfit.convert.load_order`), with
    no weight on disk; ``read()`` refuses.

    Raises:
        CheckpointError: as :func:`read_hf_config`; the index is not JSON.
    """
    config_path = config_file(directory, HF_CONFIG)
    config, config_dtype = _hf_config_from_file(config_path)
    params = dict(build_decoder(config, device="meta").named_parameters())
    stored = _fuse_for_export(params, config)
    shapes = {
        name: (sum(p.shape[0] for p in t), *t[0].shape[1:]) if isinstance(t, tuple) else tuple(t.shape)
        for name, t in stored.items()
    }
    if config.tie_word_embeddings:  # read and dropped where a checkpoint stores it (the index says so)
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    index = directory / HF_INDEX
    if index.is_file():
        weight_map = (read_json(index) or {}).get("weight_map") or {}
        named = [(n, f) for n, f in weight_map.items() if n in shapes]
    else:
        named = [
            (n, HF_WEIGHTS) for n in sorted(shapes) if n != "lm_head.weight" or not config.tie_word_embeddings
        ]
    entries = [Entry(n, tuple(shapes[n]), config_dtype, directory / f) for n, f in named]
    bos, eos = _hf_token_ids(directory, config_path)
    info = PretrainedInfo(
        format="hf",
        path=directory,
        stored_dtype=config_dtype,
        bos_token_id=bos,
        eos_token_ids=eos,
        tokenizer_path=directory if _has_tokenizer_files(directory) else None,
        notes=(f"'{directory}' holds the config alone: tensors as its config implies, no weights",),
    )

    def refuse(*args: Any, **kwargs: Any) -> Iterator[tuple[Entry, Tensor]]:
        raise CheckpointError(f"'{directory}' holds config.json but no weights; fetch the safetensors first")

    if family(config.family).fused:
        return _split_scan(config, info, entries)
    if family(config.family).experts is not None and any(".experts." in e.name for e in entries):
        return _expert_scan(config, info, entries)
    return Scan(config, info, entries, refuse, streamed=True)


def _expert_names(config: DecoderConfig, layer: int) -> dict[str, tuple[str, int, slice]]:
    """A mixture-of-experts layer's per-expert checkpoint names (:class:`~memfit.models.families.ExpertLayout`)
    -> ``(memfit's stacked tensor, expert, rows)``; the router -> ``(memfit's router, -1, all)``."""
    layout = family(config.family).experts
    prefix, inner = f"model.layers.{layer}.", config.expert_intermediate_size
    gate_up, down = f"{prefix}mlp.experts.gate_up_proj", f"{prefix}mlp.experts.down_proj"
    names = {f"{prefix}{layout.block}.gate.weight": (f"{prefix}mlp.gate.weight", -1, slice(None))}
    for e in range(config.num_experts):
        expert = f"{prefix}{layout.block}.experts.{e}."
        names[f"{expert}{layout.gate}.weight"] = (gate_up, e, slice(0, inner))
        names[f"{expert}{layout.up}.weight"] = (gate_up, e, slice(inner, 2 * inner))
        names[f"{expert}{layout.down}.weight"] = (down, e, slice(None))
    return names


def _expert_scan(config: DecoderConfig, info: PretrainedInfo, stored: list[Entry]) -> Scan:
    """The scan of a mixture of experts stored one tensor per expert (transformers 4.x, the Hub): each layer's
    experts are listed as memfit's two stacked tensors, (E, 2I, C) and (E, C, I), filled expert by expert as the
    files are read and yielded once complete (a layer's stacked tensors in stored dtype are the most held).

    Raises:
        CheckpointError: an expert's tensor has a shape the config does not imply, or a layer lacks some of its
            experts' tensors (naming them and the file).
    """
    names: dict[str, tuple[str, int, slice]] = {}
    for layer in range(config.num_layers):
        if config.layer_is_moe(layer):
            names.update(_expert_names(config, layer))
    C, inner, E = config.dim, config.expert_intermediate_size, config.num_experts  # noqa: N806
    shapes = {"gate_up_proj": (E, 2 * inner, C), "down_proj": (E, C, inner)}
    entries: list[Entry] = []
    parts: dict[str, list[Entry]] = {}  # stacked name -> the stored entries that fill it
    stacked: dict[str, Entry] = {}
    for e in stored:
        if e.name not in names:
            entries.append(e)
            continue
        target, expert, rows = names[e.name]
        if expert < 0:  # the router, renamed
            entries.append(Entry(target, e.shape, e.dtype, e.file))
            continue
        full = shapes[target.rpartition(".")[2]]
        want = (rows.stop - rows.start, C) if rows.stop is not None else full[1:]
        if e.shape != want:
            raise CheckpointError(
                f"'{e.file}': tensor '{e.name}' has shape {e.shape} but the config implies {want}; the weights "
                f"and the config do not belong together"
            )
        if target not in stacked:
            stacked[target] = Entry(target, full, e.dtype, e.file)
            entries.append(stacked[target])
        parts.setdefault(target, []).append(e)
    for target, got in parts.items():
        expected = 2 * E if target.endswith("gate_up_proj") else E
        if len(got) != expected:
            raise CheckpointError(
                f"'{got[0].file}': {target.rpartition('.experts.')[0]} has {len(got)} of its {expected} expert "
                f"tensors for {target.rpartition('.')[2]}; the checkpoint is incomplete"
            )

    def read(stack: StackFactory | None = None) -> Iterator[tuple[Entry, Tensor]]:
        filling: dict[str, tuple[Stack, int]] = {}  # stacked name -> (its stack, parts still missing)
        for e, tensor in read_safetensors(stored):
            if e.name not in names:
                yield e, tensor
                continue
            target, expert, rows = names[e.name]
            if expert < 0:
                yield Entry(target, e.shape, e.dtype, e.file), tensor
                continue
            if target not in filling:
                made = stack(stacked[target], tensor.numel()) if stack is not None else None
                filling[target] = (
                    made or _TensorStack(stacked[target].shape, tensor.dtype),
                    len(parts[target]),
                )
            whole, missing = filling[target]
            _, inner, width = stacked[target].shape
            whole.put((expert * inner + (rows.start or 0)) * width, tensor)  # the part's first element
            del tensor
            if missing == 1:
                del filling[target]
                yield stacked[target], whole.finish()
                del whole
            else:
                filling[target] = (whole, missing - 1)

    fills = {
        name: (stacked[target], len(parts[target]))
        for name, (target, e, _) in names.items()
        if e >= 0 and target in stacked
    }
    return Scan(config, info, entries, read, stacks=fills or None, stored=stored)


class _TensorStack:
    """A stack of experts filled in the stored dtype (what :data:`StackFactory` gives when it makes none)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.whole = torch.empty(shape, dtype=dtype)

    def put(self, start: int, part: Tensor) -> None:
        self.whole.view(-1)[start : start + part.numel()].copy_(part.reshape(-1))

    def finish(self) -> Tensor:
        return self.whole


def _part_rows(config: DecoderConfig) -> dict[str, int]:
    """Rows of each decoder-layer weight under its name in ``model.layers.<i>.`` (a one-layer meta model's)."""
    layer = build_decoder(dataclasses.replace(config, num_layers=1), device="meta").model.layers[0]
    return {n: p.shape[0] for n, p in layer.named_parameters()}


def _split_scan(config: DecoderConfig, info: PretrainedInfo, stored: list[Entry]) -> Scan:
    """The scan of a family whose checkpoints fuse memfit's matrices (:attr:`Family.fused`): each fused tensor
    is listed as its parts, and read once then split, the parts yielded in turn (each owning its memory).

    Raises:
        CheckpointError: a fused tensor's shape is not its parts' (naming the tensor, the file and the parts).
    """
    fusions = dict(family(config.family).fused)
    rows = _part_rows(config)
    entries: list[Entry] = []
    parts_of: dict[str, list[Entry]] = {}  # fused name -> its part entries
    for e in stored:
        prefix, _, suffix = e.name.rpartition(".layers.")
        index, _, local = suffix.partition(".")
        if not prefix or local not in fusions:
            entries.append(e)
            continue
        names = fusions[local]
        sizes = [rows[n] for n in names]
        if len(e.shape) != 2 or e.shape[0] != sum(sizes):
            raise CheckpointError(
                f"'{e.file}': tensor '{e.name}' has shape {e.shape} but the config implies "
                f"({sum(sizes)}, {config.dim}): the rows of {', '.join(n.split('.')[-2] for n in names)} "
                f"({', '.join(map(str, sizes))}); the weights and the config do not belong together"
            )
        parts = [
            Entry(f"{prefix}.layers.{index}.{n}", (r, e.shape[1]), e.dtype, e.file)
            for n, r in zip(names, sizes, strict=True)
        ]
        parts_of[e.name] = parts
        entries += parts

    def read() -> Iterator[tuple[Entry, Tensor]]:
        for e, tensor in read_safetensors(stored):
            if e.name not in parts_of:
                yield e, tensor
                continue
            sizes = [p.shape[0] for p in parts_of[e.name]]
            for part, rows_of_part in zip(parts_of[e.name], tensor.split(sizes, dim=0), strict=True):
                yield part, rows_of_part.clone()  # (rows, C): its own memory, not a view of the fused tensor
            del tensor

    return Scan(config, info, entries, read)


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model")) or (
        (directory / TOKENIZER_CONFIG).is_file() and "kind" in (read_json(directory / TOKENIZER_CONFIG) or {})
    )


def _hf_token_ids(directory: Path, config_path: Path) -> tuple[int | None, tuple[int, ...]]:
    """BOS id and EOS ids from generation_config.json, falling back to config.json."""
    sources = [read_json(config_path)]
    if (directory / HF_GENERATION_CONFIG).is_file():
        sources.insert(0, read_json(directory / HF_GENERATION_CONFIG))
    bos: int | None = None
    eos: tuple[int, ...] = ()
    for src in sources:
        if not isinstance(src, dict):
            continue
        if bos is None and isinstance(src.get("bos_token_id"), int):
            bos = src["bos_token_id"]
        value = src.get("eos_token_id")
        if not eos and value is not None:
            ids = value if isinstance(value, list) else [value]
            eos = tuple(int(i) for i in ids if isinstance(i, int))
    return bos, eos


def _safetensors_entries(directory: Path) -> list[Entry]:
    """The tensors of ``model.safetensors``, or of the shards ``model.safetensors.index.json`` lists."""
    index = directory / HF_INDEX
    if not index.is_file():
        single = directory / HF_WEIGHTS
        if not single.is_file():
            others = sorted(f.name for f in directory.glob("*.safetensors"))
            raise CheckpointError(
                f"'{directory}' has neither {HF_WEIGHTS} nor {HF_INDEX}"
                + (f" (found {', '.join(others[:5])}, which Llama checkpoints do not use)" if others else "")
                + "; the checkpoint is incomplete"
            )
        return [Entry(n, s, d, single) for n, (s, d) in safetensors_header(single).items()]
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"'{index}' has no 'weight_map' of tensor name -> shard file; is it corrupt?")
    shards = list(dict.fromkeys(weight_map.values()))
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise CheckpointError(
            f"shard '{directory / missing[0]}' listed in '{index}' does not exist"
            + (f" ({len(missing)} shards missing: {', '.join(missing[:5])})" if len(missing) > 1 else "")
            + "; the download is incomplete: fetch the missing shard files"
        )
    headers = {s: safetensors_header(directory / s) for s in shards}  # validates every shard before any read
    entries = []
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise CheckpointError(
                f"'{directory / shard}' lacks tensor '{name}', which '{index}' places there; the shard is from "
                f"another checkpoint or corrupt: download it again"
            )
        shape, dtype = headers[shard][name]
        entries.append(Entry(name, shape, dtype, directory / shard))
    return entries


# ================================================================================================================
# Writing Hugging Face checkpoints


def export_hf(
    model: Decoder,
    out_dir: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    generation_config: dict[str, Any] | None = None,
    chat_template: ChatTemplateSource | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face directory of its family (``config.family``: ``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ...).

    Files: ``config.json`` (see :func:`decoder_to_hf_config`), ``model.safetensors`` or
    ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json`` (a tied ``lm_head`` stored
    once, as ``model.embed_tokens.weight``, like ``save_pretrained``), ``generation_config.json`` and the tokenizer.
    The tokenizer's memfit files (:meth:`Tokenizer.save`) are written, with ``tokenizer_config.json`` completed so
    that ``AutoTokenizer.from_pretrained`` loads the same ids: a ``bpe`` tokenizer as ``tokenizer.json``
    (``PreTrainedTokenizerFast``), ``sentencepiece`` and ``tiktoken`` as ``tokenizer.model`` (transformers 5
    converts them; the 256 Llama 3 special tokens are listed), ``gpt2`` as ``vocab.json`` + ``merges.txt``; a
    ``char`` tokenizer has no Hugging Face equivalent and is only readable by memfit.

    Everything is written into a hidden sibling directory, fsync'ed, then renamed to ``out_dir``: an interrupted
    export leaves no partial ``out_dir``. Host memory beyond the model stays under one shard (only when ``dtype``
    or the device differ from the parameters').

    Args:
        model: a materialised memfit :class:`Decoder` (merge LoRA/adapters first; gather FSDP shards first).
        out_dir: the new directory; it must not exist or be empty.
        tokenizer: written beside the weights, and the source of BOS/EOS ids; None writes no tokenizer.
        dtype: dtype of the stored weights; None keeps the parameters' (the embedding's).
        max_shard_size: bytes per shard (5 GiB = ``5 * 1024**3`` by default); one tensor larger than this gets a
            shard of its own.
        generation_config: keys for ``generation_config.json`` (``eos_token_id`` may be a list) that override
            the BOS/EOS ids taken from the tokenizer.
        chat_template: the chat template the directory carries, in place of the tokenizer's own
            (:attr:`Tokenizer.chat_template`, which None keeps; with a tokenizer only). Either is written as
            ``chat_template.jinja``, which transformers 5 reads before ``tokenizer_config.json``, and as the
            ``chat_template`` of ``tokenizer_config.json``, which transformers 4.x reads: the same text in both.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: ``out_dir`` exists and is not empty, or is a file, or cannot be written; the model has
            parameters on the meta device or tensors a plain Llama does not have.
        ValueError: ``max_shard_size`` is not positive.
    """
    out = Path(out_dir)
    check_out_dir(out)
    if not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    config = model.config
    tensors = _fuse_for_export(_export_tensors(model), config)
    dtype = dtype or tensors["model.embed_tokens.weight"].dtype

    # ---- shard plan: tensors in state-dict order, a new shard when the next one would overflow
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = _numel(t) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (
        [HF_WEIGHTS]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    bos = tokenizer.bos_id if tokenizer is not None else None
    eos: int | list[int] | None = tokenizer.eos_id if tokenizer is not None else None
    gen: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": eos}
    gen.update(generation_config or {})
    if isinstance(gen.get("eos_token_id"), (list, tuple)):
        ids = list(gen["eos_token_id"])
        gen["eos_token_id"] = ids[0] if len(ids) == 1 else (ids or None)
    gen = {k: v for k, v in gen.items() if v is not None}

    # out is absent or empty (checked above)
    with atomic_directory(out, "Hugging Face directory", where="--out") as tmp:
        weight_map: dict[str, str] = {}
        total = 0
        for names, file in zip(shards, files, strict=True):
            shard = {n: _stored(tensors[n], dtype) for n in names}
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            give_default_mode(tmp / file)  # save_file leaves 0o600
            total += sum(t.numel() * t.element_size() for t in shard.values())
            weight_map.update(dict.fromkeys(names, file))
            del shard
        if len(files) > 1:
            index = {
                "metadata": {
                    "total_size": total,
                    "total_parameters": sum(_numel(t) for t in tensors.values()),
                },
                "weight_map": weight_map,
            }
            _write_json(tmp / HF_INDEX, index)
        hf_config = decoder_to_hf_config(config, dtype, gen.get("bos_token_id"), gen.get("eos_token_id"))
        _write_json(tmp / HF_CONFIG, hf_config)
        _write_json(tmp / HF_GENERATION_CONFIG, gen)
        if tokenizer is not None:
            if chat_template is not None:  # the caller's tokenizer keeps its own
                tokenizer = copy.copy(tokenizer)
                tokenizer.chat_template = chat_template
            _save_hf_tokenizer(tokenizer, tmp, config.max_seq_len)
    return out


def check_out_dir(out: Path) -> None:
    """Check, before anything is read, that an export can create ``out``.

    Raises:
        CheckpointError: ``out`` is a file, a directory that is not empty, or cannot be written.
    """
    if out.exists():
        if not out.is_dir():
            raise CheckpointError(f"export directory '{out}' is a file; choose a new directory")
        if any(out.iterdir()):
            raise CheckpointError(
                f"export directory '{out}' exists and is not empty; export never overwrites: choose a new "
                f"directory or delete this one"
            )
    check_writable(out)


def _export_tensors(model: Decoder) -> dict[str, Tensor]:
    """The model's tensors under HF names, a tied lm_head stored once; checked against a plain Llama."""
    if not isinstance(model, Decoder):
        raise TypeError(f"export_hf expects a memfit Llama, got {type(model).__name__}")
    expected = dict(build_decoder(model.config, device="meta").named_parameters())
    state = dict(model.named_parameters())
    if model.config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise CheckpointError(
            "the config ties the embeddings but lm_head.weight is a separate tensor; call model.tie_weights() or "
            "set tie_word_embeddings=False"
        )
    unexpected = [n for n in state if n not in expected]
    if unexpected:
        raise CheckpointError(
            f"the model has tensors a plain Llama does not ({unexpected[:3]}); merge LoRA/adapter weights into the "
            f"base model before exporting"
        )
    missing = [n for n in expected if n not in state]
    if missing:
        raise CheckpointError(f"the model lacks tensors {missing[:3]}; it does not match its config")
    on_meta = [n for n, t in state.items() if t.is_meta]
    if on_meta:
        raise CheckpointError(
            f"parameters {on_meta[:3]} are on the meta device; load or initialise weights first"
        )
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        DTensor = ()  # noqa: N806
    if any(isinstance(t, DTensor) for t in state.values()):
        raise CheckpointError(
            "the model is sharded (DTensor parameters); gather a full copy on one rank before exporting"
        )
    return {n: state[n] for n in expected}


def _fuse_for_export(
    tensors: dict[str, Tensor], config: DecoderConfig
) -> dict[str, Tensor | tuple[Tensor, ...]]:
    """The tensors under the family's checkpoint names: the parts of each fused tensor (:attr:`Family.fused`)
    listed once, in the fused tensor's place and row order, to be concatenated as its shard is written."""
    if family(config.family).experts is not None:
        return _unstack_experts(tensors, config)
    fusions = family(config.family).fused
    if not fusions:
        return dict(tensors)
    first_part = {
        f"model.layers.{i}.{parts[0]}": (
            f"model.layers.{i}.{fused}",
            [f"model.layers.{i}.{p}" for p in parts],
        )
        for i in range(config.num_layers)
        for fused, parts in fusions
    }
    in_fusion = {p for _, parts in first_part.values() for p in parts}
    out: dict[str, Tensor | tuple[Tensor, ...]] = {}
    for name, t in tensors.items():
        if name in first_part:
            fused, parts = first_part[name]
            out[fused] = tuple(tensors[p] for p in parts)
        elif name not in in_fusion:
            out[name] = t
    return out


def _unstack_experts(tensors: dict[str, Tensor], config: DecoderConfig) -> dict[str, Tensor]:
    """The tensors under the mixture-of-experts family's checkpoint names, in order: one (I, C) / (C, I) view per
    expert and projection in place of each stacked tensor, the router under its block's name (what
    ``save_pretrained`` writes, and transformers 4.x and 5 both read)."""
    pieces: dict[str, list[tuple[str, int, slice]]] = {}  # memfit's name -> its stored pieces
    for layer in range(config.num_layers):
        if config.layer_is_moe(layer):
            for stored, (target, expert, rows) in _expert_names(config, layer).items():
                pieces.setdefault(target, []).append((stored, expert, rows))
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        for stored, expert, rows in pieces.get(name, [(name, -1, slice(None))]):
            out[stored] = (tensor[expert] if expert >= 0 else tensor)[rows]
    return out


def _numel(t: Tensor | tuple[Tensor, ...]) -> int:
    return sum(p.numel() for p in t) if isinstance(t, tuple) else t.numel()


def _stored(t: Tensor | tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """A tensor as written: on the CPU in ``dtype``; the parts of a fused one concatenated along dim 0."""
    if isinstance(t, tuple):
        return torch.cat([p.detach().to(device="cpu", dtype=dtype) for p in t], dim=0)  # (sum of rows, C)
    return t.detach().to(device="cpu", dtype=dtype).contiguous()


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _save_hf_tokenizer(tokenizer: Tokenizer, directory: Path, max_seq_len: int) -> None:
    """memfit's tokenizer files plus what ``AutoTokenizer.from_pretrained`` needs to read the same ids (and the
    chat template, which :meth:`Tokenizer.save` writes as ``chat_template.jinja``, in the config for 4.x)."""
    tokenizer.save(directory)
    config_path = directory / TOKENIZER_CONFIG
    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    cfg.update({"model_max_length": max_seq_len, "clean_up_tokenization_spaces": False})
    if tokenizer.chat_template is not None:
        cfg["chat_template"] = tokenizer.chat_template.text
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    if tokenizer.kind == "tiktoken":  # transformers numbers listed tokens after the ranks: all, in id order
        extra = [t for t, _ in specials]
    else:
        extra = [t for t, _ in specials if t not in (cfg.get("bos_token"), cfg.get("eos_token"))]
    if tokenizer.kind != "bpe":  # (a tokenizer.json says by its post-processor, which memfit keeps in step)
        cfg["add_bos_token"] = (
            tokenizer.add_bos
        )  # prompts read in transformers as memfit trained on documents
    if tokenizer.kind in ("bpe", "tiktoken"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    elif tokenizer.kind == "gpt2":
        shutil.copyfile(directory / "encoder.json", directory / "vocab.json")
        shutil.copyfile(directory / "vocab.bpe", directory / "merges.txt")
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        cfg["add_prefix_space"] = False
    # sentencepiece: no class, so transformers 5 converts the model generically (its LlamaTokenizer would impose
    # Llama's own normalisation) and 4.x takes the model_type's (LlamaTokenizerFast); char: memfit-only.
    if extra and tokenizer.kind in ("tiktoken", "bpe"):
        cfg["extra_special_tokens"] = extra  # transformers 5
        cfg["additional_special_tokens"] = extra  # transformers 4
    _write_json(config_path, cfg)
