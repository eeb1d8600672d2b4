"""Checkpoint I/O for pretrained Llama weights: read Hugging Face, Meta and memfit checkpoints, write Hugging Face's.

Formats (:func:`detect_format`):

- ``"hf"``: a Hugging Face ``LlamaForCausalLM`` directory: ``config.json`` and ``model.safetensors``, or the shards
  listed in ``model.safetensors.index.json`` (what ``save_pretrained`` writes). ``config.json`` is read in both the
  transformers 4.x spelling (``rope_theta`` and ``rope_scaling`` at the top level, ``torch_dtype``) and the 5.x one
  (``rope_parameters``, ``dtype``).
- ``"meta"``: Meta's original release: ``params.json`` and ``consolidated.00.pth`` (``.01``, ... for model-parallel
  shards), read with ``torch.load(weights_only=True, mmap=True)``. Tensors are renamed to Hugging Face names,
  shards concatenated, and the rows of ``wq``/``wk`` permuted from Meta's interleaved RoPE layout (channel pairs
  ``(2i, 2i + 1)``) to the ``rotate_half`` layout (``(i, i + hd/2)``) that memfit and transformers use.
- ``"memfit"``: a checkpoint written by memfit (``model.safetensors`` + ``model_config.json``), or a run directory
  holding ``checkpoints/step_*/`` (the newest is read).

:func:`load_pretrained` builds the model on the meta device and materialises it one parameter at a time, straight
from the file into its final dtype and device, so host memory peaks near one copy of the weights in the target
dtype plus one tensor (measured in ``docs/benchmarks.md``, "Loading pretrained weights"). :func:`export_hf` writes
a directory that ``LlamaForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load, atomically and
with one shard in memory at a time; :func:`export_checkpoint` converts any readable checkpoint to it.

Nothing is unpickled beyond tensors (``weights_only=True``) and nothing is downloaded.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import mmap
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from memfit.checkpoint import (
    DCP_DIR,
    MODEL_CONFIG,
    TRAINER_STATE,
    WEIGHTS,
    atomic_directory,
    check_files,
    check_writable,
    is_sharded,
    latest_checkpoint,
    read_model_config,
    read_sharded_weights,
    read_trainer_state,
    resolve_checkpoint,
)
from memfit.errors import CheckpointError
from memfit.models.llama import Llama, LlamaConfig, RopeScaling, build_llama, rope_inv_freq
from memfit.tokenizer import CONFIG_NAME as TOKENIZER_CONFIG
from memfit.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "FORMATS",
    "PretrainedInfo",
    "detect_format",
    "export_checkpoint",
    "export_hf",
    "hf_config_to_llama",
    "hf_to_meta_rows",
    "iter_state_dict",
    "llama_to_hf_config",
    "load_pretrained",
    "meta_to_hf_rows",
    "read_config",
    "read_hf_config",
    "read_meta_params",
]

log = logging.getLogger(__name__)

FORMATS = ("hf", "meta", "memfit")
HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
META_PARAMS = "params.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
"""Bytes per safetensors shard that :func:`export_hf` writes by default (5 GiB, as ``save_pretrained`` does)."""

_META_SHARD = re.compile(r"^consolidated\.(\d+)\.pth$")
_EXPECTED_FORMATS = (
    "a Hugging Face directory (config.json + model.safetensors, or model.safetensors.index.json and its "
    "shards), a Meta directory (params.json + consolidated.00.pth, consolidated.01.pth, ...), or a memfit "
    "checkpoint or run directory (model.safetensors + model_config.json, or checkpoints/step_*/)"
)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PretrainedInfo:
    """What a pretrained checkpoint holds besides its architecture (:class:`LlamaConfig`)."""

    format: str
    """``"hf"``, ``"meta"`` or ``"memfit"``."""
    path: Path
    """The directory the weights are read from (for a memfit run directory, its newest checkpoint)."""
    stored_dtype: torch.dtype | None
    """dtype of the floating tensors in the files (the first one's if they differ); None if the files hold none."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id: ``generation_config.json`` or ``config.json`` for "hf", else the tokenizer's."""
    eos_token_ids: tuple[int, ...] = ()
    """Ids that end generation: ``generation_config.json``'s ``eos_token_id`` (an int or a list) for "hf", else
    the tokenizer's EOS (plus ``<|eom_id|>`` and ``<|eot_id|>`` for a Meta Llama 3 tokenizer, as Meta stops on)."""
    tokenizer_path: Path | None = None
    """The tokenizer directory or file, or None when the checkpoint has no tokenizer."""
    notes: tuple[str, ...] = ()
    """Remarks for the user: values chosen by default, a missing tokenizer, a vocabulary mismatch."""


@dataclass(frozen=True)
class _Entry:
    """One tensor of a checkpoint, known from the file headers before any data is read."""

    name: str  # Hugging Face name
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # as stored
    file: Path  # where it lives (the first shard for Meta tensors split over shards)


@dataclass(frozen=True)
class _Scan:
    """A checkpoint's config, info and tensor list, read from headers only; ``read()`` yields the tensors."""

    config: LlamaConfig
    info: PretrainedInfo
    entries: list[_Entry]
    read: Callable[[], Iterator[tuple[_Entry, Tensor]]]


# ================================================================================================================
# Format detection


def detect_format(path: str | Path) -> str:
    """Which checkpoint format a directory holds.

    Args:
        path: a checkpoint directory (for memfit also a run directory holding ``checkpoints/``).

    Returns:
        ``"hf"`` (``config.json`` + ``*.safetensors``), ``"meta"`` (``params.json`` + ``consolidated.*.pth``) or
        ``"memfit"`` (see :func:`memfit.checkpoint.resolve_checkpoint`).

    Raises:
        CheckpointError: ``path`` does not exist, is a file, or holds none of these; the message lists what was
            expected and what was found. A Hugging Face directory with only pickled ``pytorch_model.bin`` weights
            is refused (memfit does not unpickle untrusted files).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path '{p}' does not exist; expected {_EXPECTED_FORMATS}")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path '{p}' is a file; pass the directory that holds it")
    if (p / HF_CONFIG).is_file():
        if (p / HF_WEIGHTS).is_file() or (p / HF_INDEX).is_file() or any(p.glob("*.safetensors")):
            return "hf"
        if any(p.glob("pytorch_model*.bin")):
            raise CheckpointError(
                f"'{p}' holds pickled pytorch_model*.bin weights only; memfit reads safetensors (it does not "
                f"unpickle untrusted files). Convert once where you trust the file: "
                f"LlamaForCausalLM.from_pretrained('{p}').save_pretrained(OUT, safe_serialization=True)"
            )
    if (p / META_PARAMS).is_file() and any(_META_SHARD.match(f.name) for f in p.iterdir()):
        return "meta"
    if (p / MODEL_CONFIG).is_file() or latest_checkpoint(p) is not None:
        return "memfit"
    found = sorted(f.name + ("/" if f.is_dir() else "") for f in p.iterdir())
    shown = ", ".join(found[:12]) + (f", ... ({len(found)} entries)" if len(found) > 12 else "")
    raise CheckpointError(
        f"'{p}' is not a checkpoint memfit can read; expected {_EXPECTED_FORMATS}. Found: {shown or 'nothing'}"
    )


# ================================================================================================================
# Configs


def read_hf_config(path: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama ``config.json``.

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
            missing, ``model_type`` is not ``"llama"``, ``attention_bias`` or ``mlp_bias`` is true, ``hidden_act``
            is not ``"silu"``, ``head_dim`` differs from ``hidden_size / num_attention_heads``, the rope type is
            neither ``"default"`` nor ``"llama3"``, the weights are quantized, or the values fail validation.
    """
    config, _ = _hf_config_from_file(_config_file(Path(path), HF_CONFIG))
    return config


def read_meta_params(path: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Meta checkpoint (``params.json`` plus the tensor shapes).

    ``params.json`` holds ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads`` (default ``n_heads``),
    ``vocab_size`` (``-1`` in Llama 2: taken from the embedding's shape), ``multiple_of``, ``ffn_dim_multiplier``,
    ``norm_eps`` (default 1e-5), ``rope_theta`` (default 10000) and ``use_scaled_rope`` (Llama 3.1 and 3.2: the
    "llama3" scaling with factor 8, low 1, high 4, original context 8192, as Meta's reference code applies; the
    optional keys ``rope_scaling_factor`` / ``rope_high_freq_factor`` override factor and high). Note that the
    Hugging Face conversions of Llama 3.2 1B/3B use factor 32; a Meta 3.2 download without
    ``rope_scaling_factor`` gets Meta's 8.

    ``intermediate_size`` is taken from the shape of ``w1`` and checked against Meta's rule
    ``multiple_of * ceil(int(ffn_dim_multiplier * int(8 * dim / 3)) / multiple_of)`` when ``multiple_of`` is
    given. The output projection is tied to the embedding when ``output.weight`` is absent or bit-identical to
    ``tok_embeddings.weight``.

    ``params.json`` has no context length (Meta's ``max_seq_len`` is an inference buffer size), so ``max_seq_len``
    is chosen by family: 131072 with ``use_scaled_rope`` (Llama 3.1/3.2), 8192 for Llama 3 (``rope_theta``
    500000 or a vocabulary above 32000), else 4096 (Llama 2). memfit does not enforce it.

    Args:
        path: the checkpoint directory or its ``params.json``.

    Returns:
        The validated config.

    Raises:
        CheckpointError: naming the file and key or tensor, when a file is missing or unreadable, a key is
            missing, shards disagree, or the shapes contradict ``params.json``.
    """
    return _meta_layout(_checkpoint_dir(Path(path), META_PARAMS)).config


def read_config(path: str | Path, fmt: str | None = None) -> tuple[LlamaConfig, PretrainedInfo]:
    """The architecture and metadata of a checkpoint, from its config and tensor headers only (no weights read).

    Use it to estimate or plan a run from a checkpoint: ``build_llama(config, device="meta")``.

    Args:
        path: a checkpoint directory of any format (see :func:`detect_format`).
        fmt: the format, or None to detect it.

    Returns:
        ``(config, info)``. For "meta" and "memfit" the token ids in ``info`` are filled in by
        :func:`load_pretrained`, which reads the tokenizer.

    Raises:
        CheckpointError: see :func:`detect_format`, :func:`read_hf_config` and :func:`read_meta_params`.
    """
    scan = _scan(Path(path), fmt)
    return scan.config, scan.info


def weights_fingerprint(path: str | Path, fmt: str | None = None) -> str:
    """A cheap fingerprint of a checkpoint's weight files, to notice that a base model changed under a LoRA run.

    sha256 over each weight file's name, size and its first and last MiB (not the whole file: a 16 GiB base is
    fingerprinted in milliseconds). A copy or move of the same files keeps the fingerprint; different weights of
    the same shapes change it (their bytes differ within the first MiB of every file).

    Args:
        path: a checkpoint directory of any format.
        fmt: the format, or None to detect it.

    Returns:
        A hex digest.

    Raises:
        CheckpointError: see :func:`detect_format`.
    """
    import hashlib

    digest = hashlib.sha256()
    files = sorted({entry.file for entry in _scan(Path(path), fmt).entries})
    chunk = 1024**2
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(chunk))
            f.seek(max(size - chunk, 0))
            digest.update(f.read(chunk))
    return digest.hexdigest()


def _config_file(path: Path, name: str) -> Path:
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise CheckpointError(f"'{path}' does not exist; a checkpoint directory holding {name} is expected")
    return path


def _checkpoint_dir(path: Path, name: str) -> Path:
    return _config_file(path, name).parent


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"'{path}' does not exist") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"'{path}' is not valid JSON ({exc}); is it truncated? Re-download it"
        ) from None


def _hf_config_from_file(path: Path) -> tuple[LlamaConfig, torch.dtype | None]:
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"'{path}' must hold a JSON object, got {type(cfg).__name__}")
    return hf_config_to_llama(cfg, source=str(path))


def hf_config_to_llama(
    cfg: dict[str, Any], source: str = "config.json"
) -> tuple[LlamaConfig, torch.dtype | None]:
    """Translate a Hugging Face Llama config dict (4.x or 5.x spelling) to a :class:`LlamaConfig`.

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

    model_type = cfg.get("model_type")
    if model_type != "llama":
        raise refuse(
            "model_type", f"is {model_type!r}; memfit reads Llama checkpoints only (model_type 'llama')"
        )
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise refuse(key, "is true; memfit's Llama has no bias terms (Llama 2/3 checkpoints have none)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"is {cfg['hidden_act']!r}; memfit's Llama uses SwiGLU with 'silu'")
    if cfg.get("quantization_config"):
        raise refuse(
            "quantization_config", "is set; quantized checkpoints are not supported: use the bf16 weights"
        )
    sizes = {}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if cfg.get(key) is None:
            raise refuse(key, "is missing; a Llama config.json needs it")
        sizes[key] = cfg[key]
    heads = sizes["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and (
        not isinstance(heads, int) or heads <= 0 or head_dim * heads != sizes["hidden_size"]
    ):
        raise refuse(
            "head_dim",
            f"is {head_dim} but hidden_size / num_attention_heads is {sizes['hidden_size']} / {heads}; memfit's "
            f"Llama needs head_dim == hidden_size / num_attention_heads",
        )
    rope_key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(rope_key) or {}
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
            f"is {rope_type!r}; memfit implements the 'default' and 'llama3' RoPE only",
        )
    num_kv_heads = cfg.get("num_key_value_heads")
    try:
        config = LlamaConfig(
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
        )
    except ValueError as exc:
        raise CheckpointError(f"'{source}': {exc}") from None
    dtype_name = cfg.get("dtype", cfg.get("torch_dtype"))
    return config, _FLOAT_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None


def llama_to_hf_config(
    config: LlamaConfig,
    dtype: torch.dtype | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of a :class:`LlamaConfig` for ``LlamaForCausalLM``.

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
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    rope_scaling = None
    if config.rope_scaling is not None:
        rope_scaling = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
        rope_parameters = {**rope_scaling, "rope_theta": float(config.rope_theta)}
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "rope_parameters": rope_parameters,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": rope_scaling,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if dtype is not None:
        out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


# ================================================================================================================
# Scanning a checkpoint: config, info and the tensor list from headers only


def _scan(path: Path, fmt: str | None) -> _Scan:
    fmt = fmt or detect_format(path)
    if fmt == "hf":
        return _scan_hf(path)
    if fmt == "meta":
        return _scan_meta(path)
    if fmt == "memfit":
        return _scan_memfit(path)
    raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")


def _first_float_dtype(entries: list[_Entry]) -> torch.dtype | None:
    return next((e.dtype for e in entries if e.dtype is not None and e.dtype.is_floating_point), None)


# ---------------------------------------------------------------------------------------------------- safetensors

_PREAD: bool | None = None  # whether this safetensors has the pread backend (0.8 has); found on first use


def _safe_open(path: Path) -> Any:
    """``safe_open`` reading with ``pread`` into owned memory where safetensors supports it.

    The default ``mmap`` backend returns tensors that view the mapped file: every page read stays counted in the
    process's resident memory until the file is closed, which doubles the peak of a load.
    """
    global _PREAD
    if _PREAD is not False:
        try:
            handle = safe_open(str(path), framework="pt", backend="pread")
            _PREAD = True
            return handle
        except TypeError:  # an older safetensors without the backend argument
            _PREAD = False
    return safe_open(str(path), framework="pt")


def _safetensors_error(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"'{path}' is not a complete safetensors file ({exc}); it is truncated or corrupt: download or export it "
        f"again"
    )


def _safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Tensor name -> (shape, dtype), from the header (safetensors checks the data covers the whole file)."""
    try:
        with _safe_open(path) as f:
            out = {}
            for name in f.keys():
                view = f.get_slice(name)
                out[name] = (tuple(view.get_shape()), _SAFETENSORS_DTYPES.get(view.get_dtype()))
            return out
    except (SafetensorError, OSError) as exc:
        raise _safetensors_error(path, exc) from None


def _read_safetensors(entries: list[_Entry]) -> Iterator[tuple[_Entry, Tensor]]:
    """Yield the tensors of ``entries`` in order, opening each file once; each tensor owns its memory."""
    by_file: dict[Path, list[_Entry]] = {}
    for entry in entries:
        by_file.setdefault(entry.file, []).append(entry)
    for path, group in by_file.items():
        try:
            with _safe_open(path) as f:
                for entry in group:
                    tensor = f.get_tensor(entry.name)
                    if not _PREAD:  # mmap backend: copy out of the mapping before it closes
                        tensor = tensor.clone()
                    yield entry, tensor
        except (SafetensorError, OSError) as exc:
            raise _safetensors_error(path, exc) from None


def _safetensors_entries(directory: Path) -> list[_Entry]:
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
        return [_Entry(n, s, d, single) for n, (s, d) in _safetensors_header(single).items()]
    data = _read_json(index)
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
    headers = {s: _safetensors_header(directory / s) for s in shards}  # validates every shard before any read
    entries = []
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise CheckpointError(
                f"'{directory / shard}' lacks tensor '{name}', which '{index}' places there; the shard is from "
                f"another checkpoint or corrupt: download it again"
            )
        shape, dtype = headers[shard][name]
        entries.append(_Entry(name, shape, dtype, directory / shard))
    return entries


# ------------------------------------------------------------------------------------------------------------ hf


def _scan_hf(directory: Path) -> _Scan:
    config_path = _config_file(directory, HF_CONFIG)
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
        stored_dtype=_first_float_dtype(entries) or config_dtype,
        bos_token_id=bos,
        eos_token_ids=eos,
        tokenizer_path=tokenizer_path,
        notes=notes,
    )
    return _Scan(config, info, entries, lambda: _read_safetensors(entries))


def _has_tokenizer_files(directory: Path) -> bool:
    return any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model")) or (
        (directory / TOKENIZER_CONFIG).is_file()
        and "kind" in (_read_json(directory / TOKENIZER_CONFIG) or {})
    )


def _hf_token_ids(directory: Path, config_path: Path) -> tuple[int | None, tuple[int, ...]]:
    """BOS id and EOS ids from generation_config.json, falling back to config.json."""
    sources = [_read_json(config_path)]
    if (directory / HF_GENERATION_CONFIG).is_file():
        sources.insert(0, _read_json(directory / HF_GENERATION_CONFIG))
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


# -------------------------------------------------------------------------------------------------------- memfit


def _scan_memfit(path: Path) -> _Scan:
    ckpt = resolve_checkpoint(path)
    weights = ckpt / WEIGHTS
    if is_sharded(ckpt) and not weights.is_file():
        return _scan_sharded_memfit(ckpt)
    if not weights.is_file():
        if (ckpt / "adapter.safetensors").is_file():
            raise CheckpointError(
                f"checkpoint '{ckpt}' holds LoRA/adapter weights only (adapter.safetensors); its base model is the "
                f"run's checkpoint_dir. Merge the adapters into the base before exporting full weights"
            )
        raise CheckpointError(f"checkpoint '{ckpt}' has no '{WEIGHTS}'; it is incomplete")
    if (ckpt / TRAINER_STATE).is_file():  # catches truncation by the byte sizes recorded when it was written
        check_files(ckpt, read_trainer_state(ckpt), need_optimizer=False)
    config = read_model_config(ckpt)
    entries = [_Entry(n, s, d, weights) for n, (s, d) in _safetensors_header(weights).items()]
    info = _memfit_info(ckpt, entries)
    return _Scan(config, info, entries, lambda: _read_safetensors(entries))


def _memfit_info(ckpt: Path, entries: list[_Entry]) -> PretrainedInfo:
    """What a memfit checkpoint tells besides its tensors: stored dtype and its ``tokenizer/`` directory."""
    tokenizer_dir = ckpt / "tokenizer"
    return PretrainedInfo(
        format="memfit",
        path=ckpt,
        stored_dtype=_first_float_dtype(entries),
        tokenizer_path=tokenizer_dir if tokenizer_dir.is_dir() else None,
        notes=() if tokenizer_dir.is_dir() else (f"no tokenizer directory '{tokenizer_dir}'",),
    )


def _scan_sharded_memfit(ckpt: Path) -> _Scan:
    """A sharded run's checkpoint (``dcp/``): consolidated into one full state dict on this host."""
    state = read_trainer_state(ckpt)
    check_files(ckpt, state, need_optimizer=False)
    if state.get("config", {}).get("method", "full") != "full":
        raise CheckpointError(
            f"checkpoint '{ckpt}' is a sharded LoRA/adapter run's; merge the adapters into the base before exporting "
            f"full weights"
        )
    config = read_model_config(ckpt)
    tensors = read_sharded_weights(ckpt)
    if config.tie_word_embeddings:  # stored once, under the embedding's name (as model.safetensors does)
        tensors.pop("lm_head.weight", None)
    where = ckpt / DCP_DIR / ".metadata"  # what names it (and what a fingerprint hashes)
    entries = [_Entry(n, tuple(t.shape), t.dtype, where) for n, t in tensors.items()]
    info = _memfit_info(ckpt, entries)
    return _Scan(config, info, entries, lambda: ((e, tensors[e.name]) for e in entries))


# ---------------------------------------------------------------------------------------------------------- meta

# Meta name (after "layers.{i}.") -> (Hugging Face name, concatenation dim across model-parallel shards or None
# for a replicated tensor, which heads count permutes the rows: "q", "k" or None).
_META_LAYER_NAMES = {
    "attention.wq.weight": ("self_attn.q_proj.weight", 0, "q"),
    "attention.wk.weight": ("self_attn.k_proj.weight", 0, "k"),
    "attention.wv.weight": ("self_attn.v_proj.weight", 0, None),
    "attention.wo.weight": ("self_attn.o_proj.weight", 1, None),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", 0, None),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", 1, None),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", 0, None),
    "attention_norm.weight": ("input_layernorm.weight", None, None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None, None),
}
_META_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_META_SKIPPED = ("rope.freqs",)  # Llama 2 stores its RoPE table; memfit recomputes it


@dataclass(frozen=True)
class _MetaTensor:
    meta_name: str
    entry: _Entry
    cat_dim: int | None
    heads: int | None  # rows are permuted from Meta's interleaved RoPE layout with this many heads


@dataclass(frozen=True)
class _MetaLayout:
    config: LlamaConfig
    shards: list[Path]
    tensors: list[_MetaTensor]  # rope.freqs and an output.weight tied to the embedding are left out
    stored_dtype: torch.dtype | None
    notes: tuple[str, ...]


def _meta_shard_files(directory: Path) -> list[Path]:
    found = {int(m.group(1)): f for f in directory.iterdir() if (m := _META_SHARD.match(f.name))}
    if not found:
        raise CheckpointError(f"'{directory}' has no consolidated.00.pth; a Meta checkpoint needs it")
    for i in range(max(found) + 1):
        if i not in found:
            raise CheckpointError(
                f"Meta checkpoint '{directory}' has consolidated.{max(found):02d}.pth but lacks "
                f"'{directory / f'consolidated.{i:02d}.pth'}'; the download is incomplete"
            )
    return [found[i] for i in range(len(found))]


def _torch_load(path: Path) -> dict[str, Tensor]:
    """``torch.load`` of a Meta shard: memory-mapped, tensors only."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (
        Exception
    ) as exc:  # zip errors are RuntimeError, unsafe pickles UnpicklingError, short files EOFError
        raise CheckpointError(
            f"'{path}' cannot be read as a PyTorch checkpoint of tensors ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it is truncated, corrupt, or holds objects other "
            f"than tensors (memfit loads with weights_only=True): download it again"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(
            f"'{path}' must hold a dict of tensor name -> tensor, as Meta's consolidated.*.pth do"
        )
    return state


def _meta_hf_name(meta_name: str, path: Path) -> tuple[str, int | None, str | None] | None:
    """Hugging Face name, concatenation dim and permutation of a Meta tensor; None for skipped tensors."""
    if meta_name in _META_SKIPPED:
        return None
    if meta_name == "tok_embeddings.weight":
        return "model.embed_tokens.weight", -1, None  # -1: the split dim is inferred from the shapes
    if meta_name == "norm.weight":
        return "model.norm.weight", None, None
    if meta_name == "output.weight":
        return "lm_head.weight", 0, None
    m = _META_LAYER.match(meta_name)
    if m and m.group(2) in _META_LAYER_NAMES:
        name, dim, heads = _META_LAYER_NAMES[m.group(2)]
        return f"model.layers.{m.group(1)}.{name}", dim, heads
    raise CheckpointError(
        f"'{path}' holds tensor '{meta_name}', which a Meta Llama checkpoint does not have (expected "
        f"tok_embeddings, layers.N.attention.w[qkvo], layers.N.feed_forward.w[123], *_norm, norm, output)"
    )


def _meta_layout(directory: Path) -> _MetaLayout:
    params_path = directory / META_PARAMS
    params = _read_json(params_path)
    if not isinstance(params, dict):
        raise CheckpointError(f"'{params_path}' must hold a JSON object")
    for key in ("dim", "n_layers", "n_heads"):
        if not isinstance(params.get(key), int):
            raise CheckpointError(
                f"'{params_path}': {key} is missing or not an int; Meta's params.json has it"
            )
    dim, n_heads = params["dim"], params["n_heads"]
    n_kv_heads = params.get("n_kv_heads") or n_heads
    shards = _meta_shard_files(directory)
    n = len(shards)

    # Shapes and dtypes of every shard (memory-mapped: nothing is read but the pickled index).
    shard_meta: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] = []
    for path in shards:
        state = _torch_load(path)
        shard_meta.append({k: (tuple(v.shape), v.dtype) for k, v in state.items()})
        del state
    names = list(shard_meta[0])
    for path, meta in zip(shards[1:], shard_meta[1:], strict=True):
        if set(meta) != set(names):
            diff = sorted(set(meta) ^ set(names))
            raise CheckpointError(
                f"'{path}' and '{shards[0]}' hold different tensors ({diff[:3]}); the shards are from different "
                f"checkpoints"
            )
    for key in ("tok_embeddings.weight", "layers.0.feed_forward.w1.weight"):
        if key not in shard_meta[0]:
            raise CheckpointError(f"'{shards[0]}' lacks tensor '{key}'; it is not a Meta Llama checkpoint")

    # The embedding is split along the model width (Llama 2's ParallelEmbedding) or the vocabulary (Llama 3's
    # VocabParallelEmbedding): tell them apart by the width of a shard.
    emb_rows, emb_cols = shard_meta[0]["tok_embeddings.weight"][0]
    if n == 1 or emb_cols == dim:
        emb_dim = 0
    elif emb_cols * n == dim:
        emb_dim = 1
    else:
        raise CheckpointError(
            f"'{shards[0]}': tok_embeddings.weight has shape {(emb_rows, emb_cols)}, which is neither dim "
            f"({dim}, from '{params_path}') nor dim / {n} shards wide"
        )
    vocab_size = sum(m["tok_embeddings.weight"][0][0] for m in shard_meta) if emb_dim == 0 else emb_rows
    if params.get("vocab_size", -1) not in (-1, None, vocab_size):
        raise CheckpointError(
            f"'{params_path}': vocab_size is {params['vocab_size']} but tok_embeddings.weight holds {vocab_size} rows"
        )

    intermediate_size = shard_meta[0]["layers.0.feed_forward.w1.weight"][0][0] * n
    notes: list[str] = []
    if params.get("multiple_of") is not None:
        multiple_of = params["multiple_of"]
        hidden = int(2 * (4 * dim) / 3)
        if params.get("ffn_dim_multiplier") is not None:
            hidden = int(params["ffn_dim_multiplier"] * hidden)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        if hidden != intermediate_size:
            raise CheckpointError(
                f"'{params_path}': multiple_of {multiple_of} and ffn_dim_multiplier "
                f"{params.get('ffn_dim_multiplier')} give a feed-forward size of {hidden}, but "
                f"layers.0.feed_forward.w1.weight has {intermediate_size} rows; params.json and the weights disagree"
            )

    scaling = None
    if params.get("use_scaled_rope"):
        scaling = RopeScaling(
            factor=float(params.get("rope_scaling_factor", 8.0)),
            low_freq_factor=1.0,
            high_freq_factor=float(params.get("rope_high_freq_factor", 4.0)),
            original_max_position_embeddings=8192,
        )
    rope_theta = params.get("rope_theta", 10000.0)
    if scaling is not None:
        max_seq_len = 131072
    elif rope_theta >= 500000 or vocab_size > 32000:
        max_seq_len = 8192
    else:
        max_seq_len = 4096
    notes.append(f"max_seq_len {max_seq_len} chosen by model family (params.json has no context length)")

    # Tied output: absent, or bit-identical to the embedding (Llama 3.2 1B/3B ship a copy).
    tie = "output.weight" not in names
    if not tie and all(m["output.weight"][0] == m["tok_embeddings.weight"][0] for m in shard_meta):
        tie = all(_meta_tensors_equal(p, "output.weight", "tok_embeddings.weight") for p in shards)
    if tie and "output.weight" in names:
        notes.append("output.weight equals tok_embeddings.weight: loaded tied (stored once)")

    try:
        config = LlamaConfig(
            vocab_size=vocab_size,
            dim=dim,
            num_layers=params["n_layers"],
            num_heads=n_heads,
            num_kv_heads=n_kv_heads,
            intermediate_size=intermediate_size,
            norm_eps=params.get("norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_seq_len=max_seq_len,
            tie_word_embeddings=tie,
        )
    except ValueError as exc:
        raise CheckpointError(f"'{params_path}': {exc}") from None

    tensors: list[_MetaTensor] = []
    for meta_name in names:
        mapped = _meta_hf_name(meta_name, shards[0])
        if mapped is None or (tie and meta_name == "output.weight"):
            continue
        hf_name, cat_dim, permute = mapped
        cat_dim = emb_dim if cat_dim == -1 else cat_dim
        shapes = [m[meta_name][0] for m in shard_meta]
        if cat_dim is None or n == 1:
            if any(s != shapes[0] for s in shapes):
                raise CheckpointError(
                    f"'{meta_name}' is replicated in Meta's shards but its shapes differ: {shapes} in '{directory}'"
                )
            shape = shapes[0]
        else:
            shape = list(shapes[0])
            shape[cat_dim] = sum(s[cat_dim] for s in shapes)
            shape = tuple(shape)
        heads = {"q": n_heads, "k": n_kv_heads, None: None}[permute]
        entry = _Entry(hf_name, shape, shard_meta[0][meta_name][1], shards[0])
        tensors.append(_MetaTensor(meta_name, entry, None if n == 1 else cat_dim, heads))
    stored = next((t.entry.dtype for t in tensors if t.entry.dtype.is_floating_point), None)
    return _MetaLayout(config, shards, tensors, stored, tuple(notes))


def _meta_tensors_equal(path: Path, a: str, b: str) -> bool:
    state = _torch_load(path)
    try:
        return torch.equal(state[a], state[b])
    finally:
        _release_pages(path, [state[a], state[b]])
        del state


def meta_to_hf_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Permute the rows of a Meta ``wq``/``wk`` from interleaved RoPE pairs to Hugging Face's rotate_half layout.

    Meta rotates channel pairs ``(2i, 2i + 1)`` of each head; ``rotate_half`` rotates ``(i, i + hd/2)``. This is
    the permutation transformers' ``convert_llama_weights_to_hf`` applies.

    Args:
        weight: (num_heads * hd, C) projection weight in Meta's layout.
        num_heads: query heads for ``wq``, key/value heads for ``wk``.

    Returns:
        (num_heads * hd, C), a new tensor in the rotate_half layout.
    """
    rows, cols = weight.shape
    hd = rows // num_heads
    w = weight.view(num_heads, hd // 2, 2, cols)  # (nh, hd/2, 2, C): pair index, then the pair's two channels
    out = torch.empty(num_heads, 2, hd // 2, cols, dtype=weight.dtype, device=weight.device)
    out.copy_(w.transpose(1, 2))  # (nh, 2, hd/2, C): first channels of the pairs, then the second ones
    return out.view(rows, cols)  # (nh * hd, C)


def hf_to_meta_rows(weight: Tensor, num_heads: int) -> Tensor:
    """The inverse of :func:`meta_to_hf_rows`: rotate_half layout back to Meta's interleaved pairs.

    Args:
        weight: (num_heads * hd, C) in Hugging Face's layout.
        num_heads: query heads for ``q_proj``, key/value heads for ``k_proj``.

    Returns:
        (num_heads * hd, C), a new tensor in Meta's layout.
    """
    rows, cols = weight.shape
    hd = rows // num_heads
    w = weight.view(num_heads, 2, hd // 2, cols)  # (nh, 2, hd/2, C): half, then index within the half
    out = torch.empty(num_heads, hd // 2, 2, cols, dtype=weight.dtype, device=weight.device)
    out.copy_(w.transpose(1, 2))  # (nh, hd/2, 2, C): interleaved pairs
    return out.view(rows, cols)  # (nh * hd, C)


def _scan_meta(path: Path) -> _Scan:
    directory = _checkpoint_dir(path, META_PARAMS)
    layout = _meta_layout(directory)
    notes = list(layout.notes)
    tokenizer_path = next(
        (p for p in (directory / "tokenizer.model", directory.parent / "tokenizer.model") if p.is_file()),
        None,
    )
    if tokenizer_path is None:
        notes.append(f"no tokenizer.model in '{directory}' or its parent")
    elif tokenizer_path.parent != directory:
        notes.append(f"tokenizer read from '{tokenizer_path}' (Meta's Llama 2 layout)")
    info = PretrainedInfo(
        format="meta",
        path=directory,
        stored_dtype=layout.stored_dtype,
        tokenizer_path=tokenizer_path,
        notes=tuple(notes),
    )
    return _Scan(layout.config, info, [t.entry for t in layout.tensors], lambda: _read_meta(layout))


def _read_meta(layout: _MetaLayout) -> Iterator[tuple[_Entry, Tensor]]:
    """Yield the Hugging Face tensors of a Meta checkpoint, concatenated over shards and permuted, one at a time.

    The shards stay memory-mapped; each result is a copy in ordinary memory, after which the pages it was read
    from are handed back to the kernel (Linux), so the mapped files do not add a second copy to the peak.
    """
    states = [_torch_load(p) for p in layout.shards]
    for t in layout.tensors:
        parts = [s.pop(t.meta_name) for s in states]
        whole = parts[0] if t.cat_dim is None else torch.cat(parts, dim=t.cat_dim)  # cat_dim None: one shard
        if t.heads is not None:
            out = meta_to_hf_rows(whole, t.heads)
        elif t.cat_dim is None:
            out = whole.clone()  # own the memory: never hand out a view of the mapped file
        else:
            out = whole
        del whole
        for path, part in zip(layout.shards, parts, strict=True):
            _release_pages(path, [part])
        del parts
        yield t.entry, out
    del states


# Linux: madvise(MADV_DONTNEED) on a private file mapping drops its pages from this process (a later access
# re-reads the file); only ranges inside a mapping of the given file are touched, never anonymous memory.
_MADV_DONTNEED = 4


def _release_pages(path: Path, tensors: list[Tensor]) -> None:
    if sys.platform != "linux" or not tensors:
        return
    try:
        target = str(path.resolve())
        maps = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() == target:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    maps.append((lo, hi))
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        for t in tensors:
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            lo, hi = start // page * page, -(-end // page) * page
            if any(m_lo <= lo and hi <= m_hi for m_lo, m_hi in maps):
                libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
    except (OSError, AttributeError, ValueError):
        pass  # an optimisation only


# ================================================================================================================
# Reading weights


def iter_state_dict(path: str | Path, fmt: str | None = None) -> Iterator[tuple[str, Tensor]]:
    """Yield a checkpoint's tensors one at a time, under Hugging Face ``LlamaForCausalLM`` names, in stored dtype.

    Hugging Face and memfit files are read from safetensors (every shard of an index is checked to exist and to
    hold its tensors before the first tensor is read). Meta shards are memory-mapped, concatenated
    (``wq``/``wk``/``wv``/``w1``/``w3``/``output`` along dim 0, ``wo``/``w2`` along dim 1, ``tok_embeddings`` along
    the split its shapes show; norms are replicated), renamed and ``wq``/``wk`` rows permuted to the rotate_half
    layout (:func:`meta_to_hf_rows`); ``rope.freqs`` and an ``output.weight`` identical to the embedding are
    skipped. Each yielded tensor owns its memory (none views a mapped file).

    Args:
        path: a checkpoint directory (see :func:`detect_format`).
        fmt: the format, or None to detect it.

    Yields:
        ``(name, tensor)`` pairs, e.g. ``("model.layers.0.self_attn.q_proj.weight", (nh * hd, C) tensor)``.

    Raises:
        CheckpointError: a file is missing, truncated or inconsistent; the message names it.
    """
    for entry, tensor in _scan(Path(path), fmt).read():
        yield entry.name, tensor


def load_pretrained(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
    fmt: str | None = None,
) -> tuple[Llama, Tokenizer | None, PretrainedInfo]:
    """Load a pretrained Llama (Hugging Face, Meta or memfit format) and its tokenizer.

    The model is built on the meta device, every tensor's name and shape is checked against it from the file
    headers (before any weight is read), then parameters are materialised one at a time: read, converted to
    ``dtype`` on ``device``, and assigned. Host memory therefore peaks near the weights in ``dtype`` plus one
    tensor as stored, not two copies. A tied ``lm_head`` is the embedding Parameter (a stored ``lm_head.weight``
    is then ignored, as transformers does). The RoPE buffer is recomputed in float32.

    Args:
        path: the checkpoint directory (see :func:`detect_format`).
        device: where the parameters go (``"cpu"``, ``"cuda"``, ...).
        dtype: floating dtype of the parameters; None keeps each tensor's stored dtype.
        fmt: the format, or None to detect it.

    Returns:
        ``(model, tokenizer, info)``: the model in train mode with ``requires_grad`` parameters; the tokenizer
        from :func:`memfit.tokenizer.load_tokenizer` (``tokenizer.json`` with ``tokenizer_config.json``, or
        ``tokenizer.model``: SentencePiece for Llama 2, tiktoken for Llama 3), or None when the checkpoint has no
        tokenizer files (``info.notes`` says so); and :class:`PretrainedInfo`.

    Raises:
        CheckpointError: naming the tensor and the file, when a tensor is missing, unexpected, mis-shaped or not
            floating point, or a file is missing, truncated or inconsistent.
        memfit.tokenizer.TokenizerError: a tokenizer file is corrupt.
        ValueError: ``device`` is meta (use :func:`read_config` and ``build_llama(config, device="meta")``).
    """
    if torch.device(device).type == "meta":
        raise ValueError(
            "load_pretrained reads weights; for a meta model use read_config() and build_llama()"
        )
    return _load(_scan(Path(path), fmt), torch.device(device), dtype)


def pretrained_parameters(path: str | Path, fmt: str | None = None) -> Iterator[tuple[str, Tensor]]:
    """A checkpoint's parameters one at a time, checked first against the model its config describes.

    Every tensor's name, shape and dtype is checked from the file headers *before* this returns (so a bad
    checkpoint fails before anything is allocated); the returned iterator then reads one tensor per step. Tensors
    the model derives or shares (a tied ``lm_head.weight``, ``rotary_emb.inv_freq``) are left out, so the names
    are exactly the model's ``named_parameters()``. A sharded run fills its shards from it
    (:func:`memfit.distributed.materialize_sharded`), holding one whole tensor at a time.

    Args:
        path: a checkpoint directory (see :func:`detect_format`).
        fmt: the format, or None to detect it.

    Returns:
        An iterator of ``(name, tensor)`` in stored dtype, each tensor owning its memory.

    Raises:
        CheckpointError: as :func:`load_pretrained`.
    """
    scan = _scan(Path(path), fmt)
    return _checked_tensors(scan, build_llama(scan.config, device="meta"))


def _checked_tensors(scan: _Scan, model: Llama) -> Iterator[tuple[str, Tensor]]:
    skip = _check_entries(model, scan)  # now, not at the first read

    def tensors() -> Iterator[tuple[str, Tensor]]:
        for entry, tensor in scan.read():
            if entry.name not in skip:
                yield entry.name, tensor
            del tensor  # the caller's copy is the only one left while the next tensor is read

    return tensors()


def _load(
    scan: _Scan, device: torch.device, dtype: torch.dtype | None
) -> tuple[Llama, Tokenizer | None, PretrainedInfo]:
    config = scan.config
    model = build_llama(config, device="meta")
    tensors = _checked_tensors(scan, model)
    tokenizer, info = _load_tokenizer(scan.info, config)  # small, and may fail: before the weights

    # ---- materialise one parameter at a time: read, convert, assign, drop the stored copy
    with torch.no_grad():
        for name, tensor in tensors:
            module_name, _, attr = name.rpartition(".")
            value = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            del tensor
            model.get_submodule(module_name)._parameters[attr] = nn.Parameter(value, requires_grad=True)
    model.tie_weights()
    model.model.rotary_emb.inv_freq = rope_inv_freq(config, device=device)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:  # unreachable after _check_entries; the guard of "never a meta parameter"
        raise CheckpointError(f"'{info.path}': tensors {still_meta[:5]} were not loaded")
    return model, tokenizer, info


def _check_entries(model: Llama, scan: _Scan) -> set[str]:
    """Check names, shapes and dtypes against the meta-built model; return the names to skip (a tied lm_head)."""
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied lm_head.weight is not listed
    where = f"'{scan.info.path}'"
    skip: set[str] = set()
    seen: dict[str, _Entry] = {}
    for e in scan.entries:
        if e.name in seen:
            raise CheckpointError(
                f"tensor '{e.name}' is stored twice: in '{seen[e.name].file}' and '{e.file}'"
            )
        seen[e.name] = e
        if e.name.endswith("rotary_emb.inv_freq"):  # saved by transformers < 4.31; derived from the config
            skip.add(e.name)
            continue
        if e.name == "lm_head.weight" and scan.config.tie_word_embeddings:
            skip.add(e.name)
            shape = expected["model.embed_tokens.weight"]
        elif e.name not in expected:
            raise CheckpointError(
                f"'{e.file}' holds tensor '{e.name}', which a Llama of this config does not have; the weights do "
                f"not belong to this config (LoRA/adapter tensors must be merged first)"
            )
        else:
            shape = expected[e.name]
        if e.shape != shape:
            raise CheckpointError(
                f"'{e.file}': tensor '{e.name}' has shape {e.shape} but the config implies {shape}; the weights "
                f"and the config do not belong together"
            )
        if e.dtype is not None and not e.dtype.is_floating_point:
            raise CheckpointError(
                f"'{e.file}': tensor '{e.name}' is stored as {e.dtype}; quantized checkpoints are not supported"
            )
    missing = [n for n in expected if n not in seen]
    if missing:
        files = sorted({str(e.file.name) for e in scan.entries})
        raise CheckpointError(
            f"checkpoint {where} lacks tensor '{missing[0]}' (shape {expected[missing[0]]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f"; read {', '.join(files[:4])}{'...' if len(files) > 4 else ''}. The checkpoint is incomplete or "
            f"for another architecture"
        )
    return skip


def _load_tokenizer(info: PretrainedInfo, config: LlamaConfig) -> tuple[Tokenizer | None, PretrainedInfo]:
    if info.tokenizer_path is None:
        return None, info
    tokenizer = load_tokenizer(info.tokenizer_path)
    notes = list(info.notes)
    if tokenizer.vocab_size > config.vocab_size:
        notes.append(
            f"the tokenizer has {tokenizer.vocab_size} ids but the embedding only {config.vocab_size} rows"
        )
        log.warning("%s: %s", info.path, notes[-1])
    bos = info.bos_token_id if info.bos_token_id is not None else tokenizer.bos_id
    eos = info.eos_token_ids
    if not eos and tokenizer.eos_id is not None:
        eos = (tokenizer.eos_id,)
        if info.format == "meta" and tokenizer.kind == "tiktoken":  # Meta stops on these too
            eos += tuple(tokenizer.special_tokens[t] for t in ("<|eom_id|>", "<|eot_id|>"))
    return tokenizer, dataclasses.replace(info, bos_token_id=bos, eos_token_ids=eos, notes=tuple(notes))


# ================================================================================================================
# Writing Hugging Face checkpoints


def export_hf(
    model: Llama,
    out_dir: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    generation_config: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face ``LlamaForCausalLM`` directory.

    Files: ``config.json`` (see :func:`llama_to_hf_config`), ``model.safetensors`` or
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
        model: a materialised memfit :class:`Llama` (merge LoRA/adapters first; gather FSDP shards first).
        out_dir: the new directory; it must not exist or be empty.
        tokenizer: written beside the weights, and the source of BOS/EOS ids; None writes no tokenizer.
        dtype: dtype of the stored weights; None keeps the parameters' (the embedding's).
        max_shard_size: bytes per shard (5 GiB = ``5 * 1024**3`` by default); one tensor larger than this gets a
            shard of its own.
        generation_config: keys for ``generation_config.json`` (``eos_token_id`` may be a list) that override
            the BOS/EOS ids taken from the tokenizer.
        chat_template: a Jinja chat template for ``tokenizer_config.json`` (with a tokenizer only).

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: ``out_dir`` exists and is not empty, or is a file, or cannot be written; the model has
            parameters on the meta device or tensors a plain Llama does not have.
        ValueError: ``max_shard_size`` is not positive.
    """
    out = Path(out_dir)
    _check_out_dir(out)
    if not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    config = model.config
    tensors = _export_tensors(model)
    dtype = dtype or tensors["model.embed_tokens.weight"].dtype

    # ---- shard plan: tensors in state-dict order, a new shard when the next one would overflow
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * dtype.itemsize
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

    with atomic_directory(out, "Hugging Face directory") as tmp:  # out is absent or empty (checked above)
        weight_map: dict[str, str] = {}
        total = 0
        for names, file in zip(shards, files, strict=True):
            shard = {n: tensors[n].detach().to(device="cpu", dtype=dtype).contiguous() for n in names}
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in shard.values())
            weight_map.update(dict.fromkeys(names, file))
            del shard
        if len(files) > 1:
            index = {
                "metadata": {
                    "total_size": total,
                    "total_parameters": sum(t.numel() for t in tensors.values()),
                },
                "weight_map": weight_map,
            }
            _write_json(tmp / HF_INDEX, index)
        hf_config = llama_to_hf_config(config, dtype, gen.get("bos_token_id"), gen.get("eos_token_id"))
        _write_json(tmp / HF_CONFIG, hf_config)
        _write_json(tmp / HF_GENERATION_CONFIG, gen)
        if tokenizer is not None:
            _save_hf_tokenizer(tokenizer, tmp, config.max_seq_len, chat_template)
    return out


def export_checkpoint(
    src: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    fmt: str | None = None,
) -> Path:
    """Convert a checkpoint of any readable format (Hugging Face, Meta, memfit) to a Hugging Face directory.

    This is ``memfit export SRC OUT``. The weights pass through memory once, in ``dtype`` (see
    :func:`load_pretrained`); BOS/EOS ids carry over from ``src`` (Llama 3's list of stop ids included).

    Args:
        src: the checkpoint directory (a memfit run directory exports its newest checkpoint).
        out_dir: the new directory; it must not exist or be empty (checked before anything is read).
        dtype: dtype of the written weights; None keeps the stored dtype (float32 if unknown).
        max_shard_size: bytes per shard (default 5 GiB).
        fmt: the format of ``src``, or None to detect it.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: see :func:`load_pretrained` and :func:`export_hf`.
    """
    _check_out_dir(Path(out_dir))
    scan = _scan(Path(src), fmt)
    dtype = dtype or scan.info.stored_dtype or torch.float32
    model, tokenizer, info = _load(scan, torch.device("cpu"), dtype)
    generation: dict[str, Any] = {}
    if info.format == "hf" and (info.path / HF_GENERATION_CONFIG).is_file():  # sampling defaults too
        original = _read_json(info.path / HF_GENERATION_CONFIG)
        generation = dict(original) if isinstance(original, dict) else {}
    generation.update(bos_token_id=info.bos_token_id, eos_token_id=list(info.eos_token_ids) or None)
    return export_hf(
        model,
        out_dir,
        tokenizer=tokenizer,
        dtype=dtype,
        max_shard_size=max_shard_size,
        generation_config=generation,
        chat_template=_chat_template(info.tokenizer_path) if info.format == "hf" else None,
    )


def _chat_template(directory: Path | None) -> str | None:
    """The chat template of a Hugging Face tokenizer directory: chat_template.jinja (transformers 5) or the
    ``chat_template`` of tokenizer_config.json (4.x)."""
    if directory is None or not directory.is_dir():
        return None
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if (directory / TOKENIZER_CONFIG).is_file():
        template = (_read_json(directory / TOKENIZER_CONFIG) or {}).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def _check_out_dir(out: Path) -> None:
    if out.exists():
        if not out.is_dir():
            raise CheckpointError(f"export directory '{out}' is a file; choose a new directory")
        if any(out.iterdir()):
            raise CheckpointError(
                f"export directory '{out}' exists and is not empty; export never overwrites: choose a new "
                f"directory or delete this one"
            )
    check_writable(out)


def _export_tensors(model: Llama) -> dict[str, Tensor]:
    """The model's tensors under HF names, a tied lm_head stored once; checked against a plain Llama."""
    if not isinstance(model, Llama):
        raise TypeError(f"export_hf expects a memfit Llama, got {type(model).__name__}")
    expected = dict(build_llama(model.config, device="meta").named_parameters())
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


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _save_hf_tokenizer(
    tokenizer: Tokenizer, directory: Path, max_seq_len: int, chat_template: str | None
) -> None:
    """memfit's tokenizer files plus what ``AutoTokenizer.from_pretrained`` needs to read the same ids."""
    tokenizer.save(directory)
    config_path = directory / TOKENIZER_CONFIG
    cfg = json.loads(config_path.read_text(encoding="utf-8"))
    cfg.update({"model_max_length": max_seq_len, "clean_up_tokenization_spaces": False})
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    if tokenizer.kind == "tiktoken":  # transformers numbers listed tokens after the ranks: all, in id order
        extra = [t for t, _ in specials]
    else:
        extra = [t for t, _ in specials if t not in (cfg.get("bos_token"), cfg.get("eos_token"))]
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


EXPORT_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def export_run(
    src: str | Path,
    out_dir: str | Path,
    *,
    adapter_only: bool = False,
    dtype: str = "auto",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """``memfit export``: write a memfit run (or any readable checkpoint) as a Hugging Face directory.

    A full fine-tune or pretraining run, a Hugging Face or a Meta checkpoint goes through
    :func:`export_checkpoint`. A LoRA run is loaded as its base (``checkpoint_dir``) plus the trained LoRA weights,
    then merged into the base (``W + (alpha / r) B A``) and exported as a plain ``LlamaForCausalLM``; with
    ``adapter_only`` only the LoRA weights are written, in Hugging Face PEFT's adapter format
    (:func:`memfit.models.peft.save_peft_adapter`).

    Args:
        src: a memfit run or checkpoint directory, or a Hugging Face / Meta checkpoint directory.
        out_dir: the new directory; it must not exist or be empty (checked before anything is read).
        adapter_only: LoRA runs only: write the adapter, not merged weights.
        dtype: ``auto`` (keep the weights' dtype), ``fp32`` or ``bf16``.
        max_shard_size: bytes per safetensors shard.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: ``out_dir`` is not empty; ``src`` is unreadable; ``adapter_only`` for a run without LoRA;
            or a LLaMA-Adapter run, whose prompts and gates have no Hugging Face ``LlamaForCausalLM`` equivalent.
    """
    from memfit.config import config_from_dict

    out = Path(out_dir)
    _check_out_dir(out)
    torch_dtype = EXPORT_DTYPES[dtype]
    method = "full"
    if detect_format(src) == "memfit":
        state = read_trainer_state(resolve_checkpoint(src))
        method = config_from_dict(state.get("config", {}), check=False).method
    if method == "adapter":
        raise CheckpointError(
            f"'{src}' is a LLaMA-Adapter run: its learned prompts and gates have no place in a Hugging Face "
            f"LlamaForCausalLM, so it cannot be exported. Sample from it with memfit generate --checkpoint {src}, "
            f"or fine-tune with method=lora (mergeable) or method=full for an exportable model"
        )
    if method == "full":
        if adapter_only:
            raise CheckpointError(f"--adapter-only applies to LoRA runs; '{src}' holds a full model")
        return export_checkpoint(src, out, dtype=torch_dtype, max_shard_size=max_shard_size)

    from memfit.build import load_for_generation
    from memfit.models.peft import merge_lora, save_peft_adapter

    model, tokenizer, _ = load_for_generation(src)
    if adapter_only:
        base = config_from_dict(state["config"], check=False).checkpoint_dir or ""
        return save_peft_adapter(model, out, base_model_name_or_path=str(base))
    merge_lora(model)
    return export_hf(model, out, tokenizer=tokenizer, dtype=torch_dtype, max_shard_size=max_shard_size)
