"""What every checkpoint reader of :mod:`memfit.convert` produces and shares: a scan, safetensors files, JSON.

A reader (:mod:`memfit.convert.hf`, :mod:`memfit.convert.meta`, :mod:`memfit.convert.memfit`) turns a checkpoint
directory into a :class:`Scan`: its architecture (:class:`DecoderConfig`), a :class:`PretrainedInfo`, and the list of
its tensors (:class:`Entry`), all known from the file headers before any weight is read, plus a function that then
yields the tensors one at a time. Single safetensors files (Hugging Face's and memfit's) are read here with
``pread`` into memory each tensor owns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from memfit.errors import CheckpointError
from memfit.models.config import DecoderConfig

__all__ = [
    "Entry",
    "PretrainedInfo",
    "Scan",
    "config_file",
    "first_float_dtype",
    "read_json",
    "read_safetensors",
    "safetensors_header",
]

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


@dataclass(frozen=True)
class PretrainedInfo:
    """What a pretrained checkpoint holds besides its architecture (:class:`DecoderConfig`)."""

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


class Stack(Protocol):
    """A tensor filled part by part as a checkpoint's files are read (a mixture of experts' stack of experts)."""

    def put(self, start: int, part: Tensor) -> None:
        """Copy (or quantize) ``part`` into the elements ``start ..`` of the tensor's row-major flattening."""

    def finish(self) -> Tensor:
        """The whole tensor, once every part is in."""


StackFactory = Callable[["Entry", int], "Stack | None"]
"""``stack(entry, part_numel)``: a :class:`Stack` for the stacked tensor ``entry`` filled from parts of
``part_numel`` elements each (QLoRA's NF4 quantized in parts), or None to fill it in the stored dtype. Its parts
arrive in the stored dtype; what ``finish`` gives is kept as it is (not converted, not transformed)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint, known from the file headers before any data is read."""

    name: str  # Hugging Face name
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # as stored
    file: Path  # where it lives (the first shard for Meta tensors split over shards)


@dataclass(frozen=True)
class Scan:
    """A checkpoint's config, info and tensor list, read from headers only; ``read()`` yields the tensors."""

    config: DecoderConfig
    info: PretrainedInfo
    entries: list[Entry]
    read: Callable[..., Iterator[tuple[Entry, Tensor]]]
    """``read()`` yields the tensors; a mixture of experts' scan takes ``read(stack=...)``, a
    :data:`StackFactory` for its stacks."""
    streamed: bool = False
    """``read()`` is :func:`read_safetensors` of ``entries``: each tensor read whole into memory of its own, in file
    order, and no other tensor held meanwhile (what :func:`memfit.convert.load_order` can predict)."""
    stacks: dict[str, tuple[Entry, int]] | None = None
    """A mixture of experts stored one tensor per expert: each stored tensor's name -> the stacked entry it fills
    and how many stored tensors fill that one; ``stored`` lists the files' tensors (what
    :func:`memfit.convert.load_order` walks)."""
    stored: list[Entry] | None = None


def first_float_dtype(entries: list[Entry]) -> torch.dtype | None:
    """The stored dtype of the first floating tensor of ``entries``, or None when none is floating."""
    return next((e.dtype for e in entries if e.dtype is not None and e.dtype.is_floating_point), None)


def config_file(path: Path, name: str) -> Path:
    """``path`` itself if it is a file, else the file ``name`` in the directory ``path``.

    Raises:
        CheckpointError: that file does not exist.
    """
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise CheckpointError(f"'{path}' does not exist; a checkpoint directory holding {name} is expected")
    return path


def read_json(path: Path) -> Any:
    """The parsed JSON of ``path``.

    Raises:
        CheckpointError: the file is missing, unreadable or not valid JSON; the message names it.
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"'{path}' does not exist") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"'{path}' is not valid JSON ({exc}); is it truncated? Re-download it"
        ) from None


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


def safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
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


def read_safetensors(entries: list[Entry]) -> Iterator[tuple[Entry, Tensor]]:
    """Yield the tensors of ``entries`` in order, opening each file once; each tensor owns its memory."""
    by_file: dict[Path, list[Entry]] = {}
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
                    del tensor  # not held while the next one is read: the caller's is the only reference
        except (SafetensorError, OSError) as exc:
            raise _safetensors_error(path, exc) from None
