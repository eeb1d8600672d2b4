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

Sampling (:meth:`TokenDataset.sequence`): sequence ``n`` of the run (``n`` counts every sequence of every global
batch, in order) picks its source by the mixture weights, from a generator keyed by ``(seed, split, n)``, and a
window of that source *without replacement*: the source's tokens are cut into ``W`` windows of ``seq_len`` tokens
(plus the next one, the last target) at a per-epoch random shift, and sequence ``n`` takes window
``permute(n mod W)`` of epoch ``n // W``, a pseudo-random permutation (a Feistel network, :func:`permute`) keyed
by ``(seed, split, source, epoch)``. A single source is thus read exactly once per epoch in a random order, with
no memory kept; a mixture never repeats a window of a source within an epoch. The global batch of a step is a
pure function of the step, whatever the number of ranks (each rank takes its slice of the global indices): a
resume is exact, and elastic.
"""

from __future__ import annotations

import hashlib
import json
import mmap
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


_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's output function (Steele et al. 2014): a 64-bit integer hash."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def hash_key(*values: int) -> int:
    """A 64-bit key from integers (SplitMix64 chained over them)."""
    key = 0
    for value in values:
        key = _splitmix64(key ^ (value & _M64))
    return key


def permute(index: int, size: int, key: int) -> int:
    """Position ``index`` of a pseudo-random permutation of ``range(size)`` keyed by ``key``, in O(1) memory: a
    4-round Feistel network over the smallest even number of bits covering ``size``, cycle-walking until the result
    falls in range (Black and Rogaway 2002, "Ciphers with Arbitrary Finite Domains").

    Args:
        index: in ``[0, size)``.
        size: >= 1.
        key: the permutation's key (:func:`hash_key`).

    Returns:
        An integer in ``[0, size)``; distinct indices give distinct results.
    """
    bits = max(2, (size - 1).bit_length())
    bits += bits % 2
    half = bits // 2
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for r in range(4):
            left, right = right, left ^ (_splitmix64(key ^ (r << 60) ^ right) & mask)
        x = (left << half) | right
        if x < size:
            return x


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def document_hash(text: str) -> int:
    """The hash that decides a document's split: the first 8 bytes of the BLAKE2b hash of its UTF-8 text, as a
    little-endian integer in ``[0, 2**64)``."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def is_validation(text: str, val_fraction: float, val_hash_max: int | None = None) -> bool:
    """Whether a document is held out for validation: its :func:`document_hash`, as a fraction of 2**64, is below
    ``val_fraction``, or (a small source's minimum, :mod:`memfit.data.split`) the hash is at most
    ``val_hash_max``. A function of the text (and its source's ``val_hash_max``) alone: stable across runs, files
    and machines. Nothing is held out when ``val_fraction`` is 0."""
    if val_fraction <= 0:
        return False
    return is_held_out(text_hash(text.encode("utf-8")).digest(), val_fraction, val_hash_max)


def text_hash(data: bytes = b"") -> Any:
    """The hash :func:`is_validation` takes of a document: 8-byte BLAKE2b of its UTF-8, to feed in parts (a
    document read in blocks)."""
    return hashlib.blake2b(data, digest_size=8)


def is_held_out(digest: bytes, val_fraction: float, val_hash_max: int | None = None) -> bool:
    """:func:`is_validation` of the document whose :func:`text_hash` digest is ``digest``."""
    if val_fraction <= 0:
        return False
    h = int.from_bytes(digest, "little")
    return h < val_fraction * 2**64 or (val_hash_max is not None and h <= val_hash_max)


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
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def _map(self, i: int) -> tuple[mmap.mmap, np.ndarray]:
        if i not in self._maps:  # mapped on first use, for random reads: no read-ahead around each window
            with open(self.paths[i], "rb") as fh:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            mapped.madvise(mmap.MADV_RANDOM)
            self._maps[i] = (mapped, np.frombuffer(mapped, dtype=self.dtype))
        return self._maps[i]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream as int64 (spanning shards where it must).

        The pages read are then dropped from this process's mappings (``MADV_DONTNEED``; they stay in the page
        cache), so the process's resident memory does not grow with the windows drawn over a long run.
        """
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            offset = start + filled - int(self.starts[shard])
            take = min(length - filled, int(self.sizes[shard]) - offset)
            mapped, tokens = self._map(shard)
            out[filled : filled + take] = tokens[offset : offset + take]
            first = offset * self.dtype.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
            mapped.madvise(mmap.MADV_DONTNEED, first, (offset + take) * self.dtype.itemsize - first)
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

    def sequence(self, seed: int, split: int, n: int, source: int | None = None) -> Window:
        """Sequence ``n``: a source by the mixture weights (unless ``source`` is given), then a window of it
        without replacement (see the module docstring)."""
        if source is None:
            source = int(np.random.default_rng([seed, split, n]).choice(len(self.streams), p=self.weights))
        stream = self.streams[source]
        T = self.seq_len
        windows = (stream.num_tokens - T) // T  # each window starts at shift + k * T and holds T + 1 tokens
        if windows >= 1:
            epoch, k = divmod(n, windows)
            key = hash_key(seed, split, source, epoch)
            start = key % T + permute(k, windows, key) * T
        else:  # shorter than two windows: any start
            start = int(np.random.default_rng([seed, split, n, 1]).integers(0, stream.num_tokens - T))
        return Window(stream.read(start, T + 1), source)

    def batch(
        self, seed: int, split: int, numbers: range, source: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The sequences ``numbers`` (a rank's rows of a global batch: ``n`` counts every sequence of the run).

        Args:
            seed: the run's seed.
            split: :data:`TRAIN` or :data:`VAL` (keys the draws apart).
            numbers: which sequences.
            source: draw every window from this source (validation per source).

        Returns:
            ``(inputs, targets, sources)``: ``(B, T)`` int64 each, and each row's source index.
        """
        windows = [self.sequence(seed, split, n, source) for n in numbers]
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
