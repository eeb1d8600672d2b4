"""Raw text for ``memfit prepare``: input files grouped into named sources, read as streams of pieces of text.

A source is a name and a list of files, given by path, directory or glob (``--source web=data/cc/*.jsonl.zst``),
or found as a RedPajama-style tree: one directory per source (``--source-tree data/``). Formats, by suffix:

=========================================  ======================================================================
``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``  one JSON record per line; each record's text field (``text`` unless
                                           ``text_field`` says otherwise) is a document; blank lines are skipped
``.parquet``                               a string column (``text`` unless ``text_field`` says otherwise), one
                                           document per row, read by row group
``.txt``                                   UTF-8 text: the whole file is one document
=========================================  ======================================================================

Which text is held out for validation: a record-format document by a hash of its text
(:func:`memfit.data.tokens.is_validation`: stable across runs, files and machines; a small source's minimum,
:mod:`memfit.data.split`, raises its threshold); a ``.txt`` file, being one
document, by its tail: the last ``val_fraction`` of its bytes, cut at a line boundary (as nanoGPT splits a text);
the document's BOS starts its training part and its EOS ends the held-out tail.

Reading streams (:func:`read_pieces`): memory is bounded by one line, one parquet row group or about
:data:`PIECE_CHARS` of a ``.txt`` file, never by the file. Every bad record is reported with its file and line (or
row): malformed JSON, a record that is not an object, a missing or non-string text field, invalid UTF-8.
``skip_malformed`` skips and counts them instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

from memfit.data.tokens import is_validation
from memfit.errors import DataError


def default_corpus_path() -> Path:
    """Path of the Tiny Shakespeare text shipped inside the package (1,115,394 bytes, public domain; the main
    job's corpus)."""
    return Path(str(resources.files("memfit") / "assets" / "tinyshakespeare.txt"))


SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")
"""The input formats ``memfit prepare`` reads (see the module docstring)."""

PIECE_CHARS = 1 << 20
"""A ``.txt`` document is read (and tokenized) in pieces of about this many characters, cut at line ends."""


@dataclass(frozen=True)
class Piece:
    """Text read from an input file: a whole document, or a part of a long ``.txt`` one."""

    text: str
    split: str
    """``train`` or ``val``."""
    starts: bool
    """The piece starts its document (it takes the BOS separator)."""
    ends: bool
    """The piece ends its document (it takes the EOS separator)."""


@dataclass(frozen=True)
class InputFile:
    """One input file of a source, with what identifies its contents (size and modification time)."""

    source: str
    path: Path
    size: int
    mtime_ns: int

    @property
    def kind(self) -> str:
        """``jsonl``, ``parquet`` or ``txt``."""
        return input_kind(self.path)

    def fingerprint(self) -> dict[str, Any]:
        """What a prepared unit records of its input, to redo it when the file changes."""
        return {"path": str(self.path), "size": self.size, "mtime_ns": self.mtime_ns}


def input_kind(path: Path) -> str:
    """The format of ``path`` by its suffix (see :data:`SUFFIXES`).

    Raises:
        DataError: the suffix is not one of :data:`SUFFIXES`.
    """
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".txt"):
        return "txt"
    raise DataError(f"'{path}' is not a file memfit prepare reads; give {', '.join(SUFFIXES)} files")


def _matches(pattern: str) -> list[Path]:
    path = Path(pattern).expanduser()
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(SUFFIXES)]
    elif path.is_file():
        input_kind(path)  # a file named by itself must be of a known format
        found = [path]
    else:
        found = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        found = [p for p in found if p.name.lower().endswith(SUFFIXES)]
    return sorted(p.absolute() for p in found)


def resolve_sources(specs: dict[str, list[str]]) -> dict[str, list[InputFile]]:
    """The files of each source, sorted, checked before anything is read.

    Args:
        specs: source name -> paths, directories (read recursively) or globs.

    Returns:
        source name -> its files, in sorted path order (sources in name order).

    Raises:
        DataError: a source name is not a plain name, a path matches no readable file, a file has an unknown
            suffix, or a source has no file (an empty source).
    """
    out: dict[str, list[InputFile]] = {}
    for name in sorted(specs):
        if not name or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise DataError(f"source name {name!r} must be a plain name (letters, digits, '_', '-', '.')")
        files: list[Path] = []
        for pattern in specs[name]:
            found = _matches(pattern)
            if not found:
                path = Path(pattern).expanduser()
                if path.is_file():  # a file with another suffix
                    input_kind(path)
                raise DataError(
                    f"source '{name}': '{pattern}' matches no {', '.join(SUFFIXES)} file; check the path or glob"
                )
            files += found
        files = sorted(dict.fromkeys(files))
        if not files:
            raise DataError(f"source '{name}' is empty: it has no input file")
        out[name] = [InputFile(name, p, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return out


def source_tree(root: str | Path) -> dict[str, list[str]]:
    """A RedPajama-style tree: each sub-directory of ``root`` that holds input files is a source of that name.

    Raises:
        DataError: ``root`` is not a directory, or holds no such sub-directory.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataError(f"source tree '{root}' is not a directory")
    specs = {d.name: [str(d)] for d in sorted(root.iterdir()) if d.is_dir() and _matches(str(d))}
    if not specs:
        raise DataError(
            f"source tree '{root}' has no sub-directory of {', '.join(SUFFIXES)} files (one per source)"
        )
    return specs


# ----------------------------------------------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ReadCounts:
    """What reading one file found besides its documents."""

    skipped: int = 0
    """Malformed records skipped (``skip_malformed``)."""
    position: int = 0
    """Bytes of the file (as stored: compressed bytes for ``.gz`` / ``.zst``) read so far, for progress."""
    first_skipped: list[str] = field(default_factory=list)
    """Where the first few skipped records are (``file:line: why``)."""

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.first_skipped) < 5:
            self.first_skipped.append(f"{where}: {why}")


@contextlib.contextmanager
def _open_binary(path: Path) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """``(decompressed stream, raw file)``: the raw file's position is the progress through the file."""
    name = path.name.lower()
    with open(path, "rb") as raw:
        if name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as fh:
                yield fh, raw
        elif name.endswith(".zst"):
            import zstandard  # deferred: only for .zst inputs

            with io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=False)) as fh:
                yield fh, raw
        else:
            yield raw, raw


def read_pieces(
    f: InputFile,
    *,
    val_fraction: float,
    text_field: str = "text",
    skip_malformed: bool = False,
    counts: ReadCounts | None = None,
    val_hash_max: int | None = None,
) -> Iterator[Piece]:
    """The text of one input file in file order, streaming, each piece assigned to its split.

    Args:
        f: the file.
        val_fraction: the share held out for validation (see the module docstring).
        text_field: the JSON field or parquet column holding the text.
        skip_malformed: skip (and count in ``counts``) bad records instead of raising.
        counts: receives the skipped records and the progress through the file.
        val_hash_max: a record is also held out when its hash is at most this (its source's minimum,
            :mod:`memfit.data.split`); ``None``: ``val_fraction`` alone.

    Yields:
        :class:`Piece` s (empty documents are skipped).

    Raises:
        DataError: naming the file and line (or row) of a bad record, unless ``skip_malformed``; a file that cannot
            be read or decompressed.
    """
    counts = counts if counts is not None else ReadCounts()
    try:
        if f.kind == "txt":
            yield from _read_txt(f.path, f.size, val_fraction, skip_malformed, counts)
            return
        documents = _read_jsonl if f.kind == "jsonl" else _read_parquet
        for text in documents(f.path, text_field, skip_malformed, counts):
            yield Piece(
                text, "val" if is_validation(text, val_fraction, val_hash_max) else "train", True, True
            )
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read '{f.path}': {exc}") from None
    except Exception as exc:  # the decompressors' own errors (zstandard.ZstdError, gzip.BadGzipFile, ...)
        if type(exc).__module__.split(".")[0] in ("zstandard", "gzip", "pyarrow", "zlib"):
            raise DataError(f"cannot read '{f.path}': {type(exc).__name__}: {exc}") from None
        raise


def _utf8_error(line: bytes, exc: UnicodeDecodeError) -> str:
    return (
        f"not valid UTF-8: byte 0x{line[exc.start]:02x} at column {exc.start + 1}; convert the file to UTF-8 (e.g. "
        f"iconv -f latin1 -t utf-8)"
    )


def _bad(where: str, why: str, skip: bool, counts: ReadCounts) -> None:
    if not skip:
        raise DataError(
            f"{where}: {why} (skip_malformed=true, in a run data.skip_malformed=true, skips and counts such records)"
        )
    counts.skip(where, why)


def _read_jsonl(path: Path, text_field: str, skip: bool, counts: ReadCounts) -> Iterator[str]:
    with _open_binary(path) as (fh, file):
        for number, data in enumerate(fh, start=1):
            counts.position = file.tell()
            where = f"{path}:{number}"
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                _bad(where, _utf8_error(data, exc), skip, counts)
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                _bad(where, f"malformed JSON ({exc.msg} at column {exc.colno})", skip, counts)
                continue
            if not isinstance(record, dict):
                _bad(where, f"a record must be a JSON object, got {type(record).__name__}", skip, counts)
                continue
            text = record.get(text_field)
            if not isinstance(text, str):
                why = "has no" if text is None else f"has a non-string ({type(text).__name__})"
                _bad(where, f"the record {why} '{text_field}' field", skip, counts)
                continue
            if text:
                yield text


def _read_parquet(path: Path, text_field: str, skip: bool, counts: ReadCounts) -> Iterator[str]:
    import pyarrow.parquet as pq  # deferred: only for .parquet inputs

    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"'{path}' has no '{text_field}' column (columns: {', '.join(pf.schema_arrow.names)}); set "
            f"text_field to the column holding the text"
        )
    row = 0
    for group in range(pf.num_row_groups):
        column = pf.read_row_group(group, columns=[text_field]).column(0)
        counts.position = path.stat().st_size * (group + 1) // pf.num_row_groups
        for value in column.to_pylist():
            row += 1
            if not isinstance(value, str):
                what = "null" if value is None else type(value).__name__
                _bad(f"{path}: row {row}", f"'{text_field}' is {what}, not a string", skip, counts)
                continue
            if value:
                yield value


def _read_txt(path: Path, size: int, val_fraction: float, skip: bool, counts: ReadCounts) -> Iterator[Piece]:
    """One document in pieces of about :data:`PIECE_CHARS` cut at line ends; from the first line end at or after
    byte ``size * (1 - val_fraction)`` on, the pieces are the validation part. The document's first piece takes
    the BOS and its last the EOS: the held-out tail continues the document, it does not start one."""
    cut = size - int(size * val_fraction) if val_fraction > 0 else size + 1
    split, first = "train", True
    parts: list[str] = []
    chars = 0
    pending: Piece | None = None  # held back one piece, to know which piece is the last
    with open(path, "rb") as fh:
        for number, data in enumerate(fh, start=1):
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                _bad(f"{path}:{number}", _utf8_error(data, exc), skip, counts)
                continue
            parts.append(line)
            chars += len(line)
            counts.position = fh.tell()
            at_cut = split == "train" and counts.position >= cut
            if chars >= PIECE_CHARS or at_cut:
                if pending is not None:
                    yield pending
                pending = Piece("".join(parts), split, first, False)
                parts, chars, first = [], 0, False
                if at_cut:
                    split = "val"
    if parts and "".join(parts).strip():
        if pending is not None:
            yield pending
        pending = Piece("".join(parts), split, first, False)
    if pending is not None:
        yield dataclasses.replace(pending, ends=True)
