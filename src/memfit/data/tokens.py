"""Prepared token datasets: the on-disk format ``memfit prepare`` writes, and the windows a run draws from it.

A dataset directory holds ``manifest.json`` (format version, token dtype, tokenizer, settings, and per source its
documents, tokens and shards), the tokenizer in ``tokenizer/``, and per source a directory of shards: flat arrays
of token ids (``uint16`` when the vocabulary fits in 16 bits, else ``uint32``), with the tokenizer's BOS before and
its EOS after every document, as Llama pretraining separates documents. Training and validation documents go to
separate shards (``*.train.bin``, ``*.val.bin``); which documents are held out is decided by a hash of each
document's text (:func:`is_validation`), so the split never overlaps and does not move when files are added.

:class:`TokenDataset` memory-maps the shards of one split: a source's shards read as one stream, and a window of
``seq_len + 1`` tokens may span two shards. Only the pages of the windows drawn are ever read, so a run's memory
does not grow with the corpus.

Sampling (:meth:`TokenDataset.window`): the ``i``-th sequence of a global batch picks its source by the mixture
weights and a uniformly random offset in it, from a generator keyed by ``(seed, split, step, micro_step, i)``. The
global batch of a step is thus a pure function of the step, whatever the number of ranks (each rank takes its
slice of the global indices): a resume is exact, and elastic.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.errors import DataError

FORMAT = "memfit-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TRAIN, VAL = 0, 1
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def is_validation(text: str, val_fraction: float) -> bool:
    """Whether a document is held out for validation: the first 8 bytes of its BLAKE2b hash, as a fraction of
    2**64, are below ``val_fraction``. A function of the text alone: stable across runs, files and machines."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def is_dataset(path: str | Path | None) -> bool:
    """Whether ``path`` is a prepared dataset directory (it holds ``manifest.json``)."""
    return path is not None and (Path(path) / MANIFEST).is_file()


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset, checked for format and version.

    Raises:
        DataError: no manifest, not valid JSON, another format, or a newer version.
    """
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f"'{directory}' is not a prepared dataset (no {MANIFEST}); prepare it with memfit prepare --out "
            f"{directory} ... (or finish an interrupted prepare by running it again)"
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(
            f"'{path}' is unreadable or not valid JSON ({exc}); prepare the dataset again"
        ) from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("version"), int):
        raise DataError(f"'{path}' is not a memfit token dataset manifest")
    if manifest["version"] > VERSION:
        raise DataError(
            f"'{path}' has format version {manifest['version']}; this memfit reads version {VERSION} and older"
        )
    return manifest


# ----------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------


class SourceStream:
    """The shards of one source and one split, read as one memory-mapped stream of tokens.

    Raises:
        DataError: a shard is missing or has another size than the manifest says (truncated), naming it.
    """

    def __init__(self, directory: Path, shards: list[dict[str, Any]], dtype: np.dtype) -> None:
        self.paths = [directory / s["file"] for s in shards]
        self.sizes = np.array([int(s["tokens"]) for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])  # token offset of each shard in the stream
        self.num_tokens = int(self.starts[-1])
        self.dtype = dtype
        for path, tokens in zip(self.paths, self.sizes, strict=True):
            if not path.is_file():
                raise DataError(
                    f"shard '{path}' is missing; prepare the dataset again (memfit prepare resumes)"
                )
            if path.stat().st_size != tokens * dtype.itemsize:
                raise DataError(
                    f"shard '{path}' holds {path.stat().st_size} bytes, the manifest says {tokens} tokens of "
                    f"{dtype.itemsize} bytes: it is truncated or changed; prepare the dataset again"
                )
        self._maps: dict[int, np.memmap] = {}

    def _map(self, i: int) -> np.ndarray:
        if i not in self._maps:  # opened on first use: a run touches only the pages of the windows it draws
            self._maps[i] = np.memmap(self.paths[i], dtype=self.dtype, mode="r", shape=(int(self.sizes[i]),))
        return self._maps[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream as int64 (spanning shards where it must)."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            offset = start + filled - int(self.starts[shard])
            take = min(length - filled, int(self.sizes[shard]) - offset)
            out[filled : filled + take] = self._map(shard)[offset : offset + take]
            filled += take
            shard += 1
        return out


@dataclass
class Window:
    """One training sequence: ``inputs`` and ``targets`` of ``T`` tokens, and the source it came from."""

    tokens: np.ndarray
    """``(T + 1,)`` int64."""
    source: int


class TokenDataset:
    """One split of a prepared dataset, with its sources' mixture weights, drawing windows of ``seq_len + 1``.

    Args:
        directory: the dataset directory.
        split: ``train`` or ``val``.
        seq_len: tokens per sequence ``T`` (a window holds ``T + 1``).
        weights: source name -> mixture weight (any scale; 0 leaves a source out); ``None``: proportional to
            each source's tokens in this split.
        manifest: the manifest, when already read.

    Raises:
        DataError: a shard is missing or truncated; a source with a weight is shorter than one window.
    """

    def __init__(
        self,
        directory: str | Path,
        split: str,
        seq_len: int,
        weights: dict[str, float] | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> None:
        self.directory = Path(directory)
        manifest = manifest or read_manifest(directory)
        self.split, self.seq_len = split, seq_len
        dtype = np.dtype(manifest["dtype"])
        self.names: list[str] = []
        self.streams: list[SourceStream] = []
        for name, info in manifest["sources"].items():
            shards = [s for s in info["shards"] if s["split"] == split]
            self.names.append(name)
            self.streams.append(SourceStream(self.directory / name, shards, dtype))
        raw = [
            float(s.num_tokens) if weights is None else float(weights.get(n, 0.0)) for n, s in self._named()
        ]
        for (name, stream), w in zip(self._named(), raw, strict=True):
            if w > 0 and stream.num_tokens < seq_len + 1:
                raise DataError(
                    f"source '{name}' has {stream.num_tokens:,} {split} tokens, fewer than one window of seq_len + 1 "
                    f"= {seq_len + 1}; give it more text, lower seq_len, or set its data.weights to 0"
                )
        total = sum(raw)
        self.weights = np.array([w / total for w in raw]) if total > 0 else np.zeros(len(raw))

    def _named(self) -> list[tuple[str, SourceStream]]:
        return list(zip(self.names, self.streams, strict=True))

    @property
    def num_tokens(self) -> int:
        """Tokens of this split over every source."""
        return sum(s.num_tokens for s in self.streams)

    def window(self, rng: np.random.Generator, source: int | None = None) -> Window:
        """Draw one window: a source by the mixture weights (unless ``source`` is given), then a uniformly random
        start in it."""
        if source is None:
            source = int(rng.choice(len(self.streams), p=self.weights))
        stream = self.streams[source]
        start = int(rng.integers(0, stream.num_tokens - self.seq_len))
        return Window(stream.read(start, self.seq_len + 1), source)

    def batch(
        self, seed: int, split: int, step: int, micro_step: int, indices: range, source: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The sequences ``indices`` of the global batch of ``(step, micro_step)``.

        Args:
            seed: the run's seed.
            split: :data:`TRAIN` or :data:`VAL` (keys the generators apart).
            step, micro_step: the batch's coordinates (validation: the batch number and the source).
            indices: which sequences of the global batch (a rank's slice).
            source: draw every window from this source (validation per source).

        Returns:
            ``(inputs, targets, sources)``: ``(B, T)`` int64 each, and each row's source index.
        """
        windows = [
            self.window(np.random.default_rng([seed, split, step, micro_step, i]), source) for i in indices
        ]
        tokens = torch.from_numpy(np.stack([w.tokens for w in windows]))  # (B, T + 1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), [w.source for w in windows]


def document_ids(inputs: torch.Tensor, bos_id: int | None, eos_id: int | None) -> torch.Tensor:
    """Which document each token of a window belongs to, from the separators: a document starts at each BOS
    (or, without one, after each EOS). For the block-diagonal attention of packed rows (``doc_ids``).

    Args:
        inputs: ``(B, T)`` int64 token ids.
        bos_id, eos_id: the dataset tokenizer's separators (at least one).

    Returns:
        ``(B, T)`` int64, non-decreasing along each row, 0 for the first (partial) document.
    """
    if bos_id is not None:
        starts = inputs == bos_id  # (B, T)
    else:
        starts = torch.zeros_like(inputs, dtype=torch.bool)
        starts[:, 1:] = inputs[:, :-1] == eos_id
    return torch.cumsum(starts.long(), dim=1)
