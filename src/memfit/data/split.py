"""Which text a prepared dataset holds out for validation, source by source: a hash of each document's text, with a
minimum per source.

``val_fraction`` of a large source is plenty; of a small one it can be nothing (the 287 documents of
``mixed_corpus`` at 0.01 hold out none). So a source whose held-out text comes to fewer than
:data:`VAL_MIN_CHARS` characters also holds out its documents of smallest hash, in ascending order, until it has
that many characters (about one window of 2,048 tokens at 8 characters a token, four at 2), as long as the held-out
part stays within half of the source's text (a source of one document holds out nothing, and ``memfit prepare``
says so). The rule is still a threshold on the same hash (:func:`memfit.data.tokens.is_validation`), raised for the
source: a record is held out when its hash is below ``val_fraction * 2**64`` or at most the source's
``val_hash_max``. A source that the hash alone gives enough keeps ``val_hash_max = None``: its bytes are those of a
dataset prepared before the minimum existed. ``val_fraction = 0`` holds out nothing anywhere.

:func:`plan_source` decides it before anything is written, reading (not tokenizing) the source's documents in file
order and hashing them. It stops as soon as the held-out text reaches the minimum, about
``VAL_MIN_CHARS / val_fraction`` characters in, so a large source is read only a little; a source that needs the
minimum is small, and is read to its end, keeping only the few candidates of smallest hash. The result depends on
the source's files alone (not on their order, the workers or the machines), so every machine of a multi-node
prepare decides the same. A ``.txt`` file (one document, whose tail is held out) is not read: its tail counts as
``val_fraction`` of its bytes, and the minimum only ever adds record documents.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from memfit.config import PrepareConfig
from memfit.data.sources import InputFile, Piece, read_pieces
from memfit.errors import DataError

VAL_MIN_CHARS = 16_384
"""Characters of text each source holds out at least (see the module docstring)."""


@dataclass(frozen=True)
class SourceSplit:
    """How one source is split, and what deciding it found."""

    val_hash_max: int | None
    """Records whose hash is at most this are held out besides those ``val_fraction`` holds out; ``None``: none."""
    held_documents: int
    """Documents held out (a ``.txt`` file with a tail counts one), so far as the reading went."""
    held_chars: int
    """Characters held out (a ``.txt`` file's tail: ``val_fraction`` of its bytes), so far as the reading went."""
    documents: int | None = None
    """Documents of the source, when it was read to its end (it needed the minimum), else ``None``."""
    added: int = 0
    """Documents the minimum added to those of ``val_fraction``."""

    def note(self, name: str, val_fraction: float) -> str | None:
        """One line for the user when the minimum changed the split or the source has no validation text."""
        if val_fraction <= 0 or self.documents is None:
            return None
        docs = f"{self.documents:,} document{'s' * (self.documents != 1)}"
        hashed = self.held_documents - self.added
        if self.held_chars == 0:
            return (
                f"note: source '{name}' has no validation split: val_fraction={val_fraction:g} holds out none of its "
                f"{docs}, and the minimum per source cannot hold one out without taking more than half of its "
                f"text; a run reports no val_loss/{name}"
            )
        if not self.added:
            return None
        return (
            f"note: source '{name}': val_fraction={val_fraction:g} holds out {hashed:,} of its {docs}; it holds out "
            f"{f'{self.added:,} more' if hashed else f'the {self.added:,}'} of smallest hash ({self.held_chars:,} "
            f"characters; the minimum per source is {VAL_MIN_CHARS:,})"
        )


def no_text(name: str, files: list[str]) -> DataError:
    """The error for a source whose files hold no document."""
    listed = ", ".join(f"'{f}'" for f in files)
    return DataError(f"source '{name}' has no text: {listed} hold{'s' * (len(files) == 1)} no document")


def plan_source(
    name: str, files: list[InputFile], *, val_fraction: float, text_field: str, skip_malformed: bool
) -> SourceSplit:
    """Decide a source's split (see the module docstring), reading its documents until it is decided.

    Args:
        name: the source.
        files: its files, in order.
        val_fraction: the share held out by the hash.
        text_field: the JSON field or parquet column holding the text.
        skip_malformed: skip bad records instead of raising.

    Returns:
        The :class:`SourceSplit`.

    Raises:
        DataError: the source holds no document (every file empty); a bad record read on the way, naming its file
            and line (unless ``skip_malformed``); a file that cannot be read.
    """
    held_docs = held_chars = documents = total_chars = 0
    need = VAL_MIN_CHARS
    # (-hash, characters): a max-heap of the training documents of smallest hash, as many as the minimum needs
    candidates: list[tuple[int, int]] = []
    candidate_chars = 0
    for f in files:
        if f.kind == "txt":  # one document, its tail held out; read no further than whether it has text
            tail = int(f.size * val_fraction)
            empty = (
                documents == 0 and next(_pieces(f, val_fraction, text_field, skip_malformed), None) is None
            )
            if empty:
                continue
            documents += 1
            total_chars += f.size
            held_docs += tail > 0
            held_chars += tail
        else:
            hasher, chars = hashlib.blake2b(digest_size=8), 0
            for piece in _pieces(f, val_fraction, text_field, skip_malformed):
                hasher.update(piece.text.encode("utf-8"))
                chars += len(piece.text)
                if not piece.ends:
                    continue
                documents += 1
                total_chars += chars
                if piece.split == "val":
                    held_docs, held_chars = held_docs + 1, held_chars + chars
                elif val_fraction > 0:
                    heapq.heappush(candidates, (-int.from_bytes(hasher.digest(), "little"), chars))
                    candidate_chars += chars
                hasher, chars = hashlib.blake2b(digest_size=8), 0
                if val_fraction <= 0 or held_chars >= VAL_MIN_CHARS:
                    break
                need = VAL_MIN_CHARS - held_chars
                while len(candidates) > 1 and candidate_chars - candidates[0][1] >= need:  # not needed
                    candidate_chars -= heapq.heappop(candidates)[1]
        if documents and (val_fraction <= 0 or held_chars >= VAL_MIN_CHARS):
            return SourceSplit(None, held_docs, held_chars)
    if documents == 0:
        raise no_text(name, [str(f.path) for f in files])
    val_hash_max, added = None, 0
    for negative, chars in sorted(candidates, reverse=True):  # ascending hash
        if held_chars >= VAL_MIN_CHARS or 2 * (held_chars + chars) > total_chars:
            break
        val_hash_max, added = -negative, added + 1
        held_docs, held_chars = held_docs + 1, held_chars + chars
    return SourceSplit(val_hash_max, held_docs, held_chars, documents, added)


def source_splits(
    files: dict[str, list[InputFile]], cfg: PrepareConfig, manifest: dict[str, Any] | None
) -> dict[str, SourceSplit]:
    """Each source's split (:mod:`memfit.data.split`): as the manifest of this dataset records it when the source's
    files are unchanged since (a no-op run reads nothing), else decided by reading the source.

    Raises:
        DataError: a source holds no document; a bad record met on the way.
    """
    known = manifest.get("sources", {}) if isinstance(manifest, dict) else {}
    splits = {}
    for name, inputs in files.items():
        entry = known.get(name) if isinstance(known.get(name), dict) else {}
        fingerprints = [f.fingerprint() for f in inputs]
        # a manifest's file entry is the file's fingerprint with what became of it (unit, documents, tokens)
        listed = [{k: f.get(k) for k in fingerprints[0]} for f in entry.get("files", [])] if inputs else []
        if "val_hash_max" in entry and listed == fingerprints:
            splits[name] = SourceSplit(entry["val_hash_max"], entry["val"]["documents"], 0)
            continue
        splits[name] = plan_source(
            name,
            inputs,
            val_fraction=cfg.val_fraction,
            text_field=cfg.text_field,
            skip_malformed=cfg.skip_malformed,
        )
    return splits


def _pieces(f: InputFile, val_fraction: float, text_field: str, skip_malformed: bool) -> Iterator[Piece]:
    return read_pieces(f, val_fraction=val_fraction, text_field=text_field, skip_malformed=skip_malformed)
