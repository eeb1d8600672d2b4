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

Reading streams (:func:`read_pieces`), JSON Lines by the rule every memfit reader follows (:mod:`memfit.data.jsonl`:
a byte-order mark skipped, lines cut at ``\n`` only, any character inside a JSON string). Memory is bounded by a
few MiB whatever the size of a file or of one document: a line up to :data:`~memfit.data.jsonl.LINE_BYTES` is
decoded whole, a longer one is parsed as it streams past and its text read again in blocks; a ``.txt`` file is read
a line (or a MiB of a longer line) at a time; a parquet file a row group at a time. A document longer than
:data:`PIECE_CHARS` is yielded in pieces of about that size, cut where the tokenizer's :meth:`~memfit.tokenizer.
Tokenizer.cut` says its ids do not change (``cut``; without one, at line ends), so that it is encoded in pieces
with the ids of encoding it whole. Every bad record is reported with its file and line (or row): malformed JSON, a
record that is not an object, a missing or non-string text field, invalid UTF-8, a text that is not Unicode (a lone
surrogate escape). ``skip_malformed`` skips and counts them instead.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import glob
import gzip
import io
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

from memfit.data.jsonl import (
    LineError,
    Lines,
    LongString,
    decode_string,
    is_blank,
    loads,
    scan_long_value,
    utf8_error,
)
from memfit.data.tokens import is_held_out, is_validation
from memfit.errors import DataError

log = logging.getLogger(__name__)


def default_corpus_path() -> Path:
    """Path of the Tiny Shakespeare text shipped inside the package (1,115,394 bytes, public domain; the main
    job's corpus)."""
    return Path(str(resources.files("memfit") / "assets" / "tinyshakespeare.txt"))


SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt")
"""The input formats ``memfit prepare`` reads (see the module docstring)."""

PIECE_CHARS = 1 << 20
"""A longer document is read (and tokenized) in pieces of about this many characters (see the module docstring)."""
MAX_PIECE_CHARS = 8 * PIECE_CHARS
"""A document the tokenizer cannot be cut at in this many characters (no space between words) is cut there all
the same, with a warning: its ids there may differ from those of encoding it whole."""

Cut = Callable[[str, int], int]
"""Where a part of a document may be cut: :meth:`memfit.tokenizer.Tokenizer.cut`."""


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
    continues: bool = False
    """The piece continues the text of the one before it, cut where the tokenizer allows: it is encoded with
    :meth:`~memfit.tokenizer.Tokenizer.encode_continuation`."""
    offset: int = 0
    """Characters of its document before it (of the held-out tail, for the tail of a ``.txt`` file): where a
    tokenizer's :meth:`~memfit.tokenizer.Tokenizer.cut` is applied to it."""


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
    cut: Cut | None = None,
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
        cut: where a long document may be cut (the tokenizer's :meth:`~memfit.tokenizer.Tokenizer.cut`); None:
            at line ends (when no tokenizer is known yet: the sample a BPE is trained on).

    Yields:
        :class:`Piece` s: a document whole, or a long one in pieces of about :data:`PIECE_CHARS` (empty documents
        are skipped).

    Raises:
        DataError: naming the file and line (or row) of a bad record, unless ``skip_malformed``; a file that cannot
            be read or decompressed.
    """
    counts = counts if counts is not None else ReadCounts()
    cut = cut if cut is not None else _line_end
    try:
        if f.kind == "txt":
            yield from _read_txt(f.path, f.size, val_fraction, skip_malformed, counts, cut)
        elif f.kind == "jsonl":
            yield from _read_jsonl(
                f.path, val_fraction, text_field, skip_malformed, counts, cut, val_hash_max
            )
        else:
            yield from _read_parquet(
                f.path, val_fraction, text_field, skip_malformed, counts, cut, val_hash_max
            )
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read '{f.path}': {exc}") from None
    except Exception as exc:  # the decompressors' own errors (zstandard.ZstdError, gzip.BadGzipFile, ...)
        if type(exc).__module__.split(".")[0] in ("zstandard", "gzip", "pyarrow", "zlib"):
            raise DataError(f"cannot read '{f.path}': {type(exc).__name__}: {exc}") from None
        raise


def _line_end(text: str, offset: int) -> int:
    """The cut without a tokenizer: after the last line end, else anywhere."""
    return text.rfind("\n") + 1 or len(text)


class _Pieces:
    """One document's text, given in parts of any size, as :class:`Piece` s of at most :data:`PIECE_CHARS`, cut
    where ``cut`` allows in the first :data:`PIECE_CHARS` held (``search_all``: in all that is held). Each method
    yields the pieces that are complete; one is held back, to know which is last."""

    def __init__(self, split: str, cut: Cut, where: str, search_all: bool = False) -> None:
        self.split, self.cut, self.where, self.search_all = split, cut, where, search_all
        self.parts: list[str] = []
        self.chars = 0
        self.offset = 0  # characters of the text being cut before ``parts``
        self.starts, self.continues = True, False  # what the next piece is
        self.pending: Piece | None = None
        self.forced = 0  # cuts made where the tokenizer could not be cut (warned of once)

    def add(self, text: str) -> Iterator[Piece]:
        self.parts.append(text)
        self.chars += len(text)
        while self.chars >= PIECE_CHARS:
            held = "".join(self.parts)
            window = held if self.search_all else held[:PIECE_CHARS]
            at = self.cut(window, self.offset)
            if at == 0 and len(held) >= MAX_PIECE_CHARS:
                at, self.forced = PIECE_CHARS, self.forced + 1
                if self.forced == 1:  # once per document
                    log.warning(
                        "%s: a document with no place to cut it for the tokenizer in %d characters (no space "
                        "between words); cut there all the same: its ids there may differ from those of encoding it "
                        "whole",
                        self.where,
                        len(held),
                    )
            if at == 0:
                self.parts = [held]
                return
            yield from self._push(held[:at])
            rest = held[at:]
            self.parts, self.chars, self.offset = [rest] if rest else [], len(rest), self.offset + at

    def restart(self, split: str) -> Iterator[Piece]:
        """What is held becomes a piece; the text that follows is of ``split`` and is encoded afresh (the
        held-out tail of a ``.txt`` file continues its document but is not tokenized with its training part)."""
        held = "".join(self.parts)
        if held:
            yield from self._push(held)
        self.parts, self.chars, self.offset, self.continues, self.split = [], 0, 0, False, split

    def end(self, keep_blank: bool = True) -> Iterator[Piece]:
        """The rest, and the last piece marked as such; a document of whitespace only is dropped unless
        ``keep_blank``."""
        rest = "".join(self.parts)
        if rest and (keep_blank or self.pending is not None or rest.strip()):
            yield from self._push(rest)
        if self.pending is not None:
            yield dataclasses.replace(self.pending, ends=True)

    def _push(self, text: str) -> Iterator[Piece]:
        if self.pending is not None:
            yield self.pending
        self.pending = Piece(text, self.split, self.starts, False, self.continues, self.offset)
        self.starts, self.continues = False, True


def _bad(where: str, why: str, skip: bool, counts: ReadCounts) -> None:
    if not skip:
        raise DataError(
            f"{where}: {why} (skip_malformed=true, in a run data.skip_malformed=true, skips and counts such records)"
        )
    counts.skip(where, why)


_NOT_UNICODE = (
    "the text holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): not Unicode text"
)


def _document(
    text: str, val_fraction: float, cut: Cut, where: str, val_hash_max: int | None = None
) -> Iterator[Piece]:
    """A document read whole: one piece, or pieces when it is long. (The split is checked by the caller.)"""
    split = "val" if is_validation(text, val_fraction, val_hash_max) else "train"
    if len(text) <= PIECE_CHARS:
        yield Piece(text, split, True, True)
        return
    pieces = _Pieces(split, cut, where)
    for start in range(0, len(text), PIECE_CHARS):
        yield from pieces.add(text[start : start + PIECE_CHARS])
    yield from pieces.end()


def _text_of(record: object, text_field: str, where: str, skip: bool, counts: ReadCounts) -> str | None:
    """The record's text, or None when it is bad (reported)."""
    if not isinstance(record, dict):
        _bad(where, f"a record must be a JSON object, got {type(record).__name__}", skip, counts)
        return None
    text = record.get(text_field)
    if not isinstance(text, str):
        why = "has no" if text is None else f"has a non-string ({type(text).__name__})"
        _bad(where, f"the record {why} '{text_field}' field", skip, counts)
        return None
    return text


def _unicode(text: str, where: str, skip: bool, counts: ReadCounts) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        _bad(where, _NOT_UNICODE, skip, counts)
        return False
    return True


def _read_jsonl(
    path: Path,
    val_fraction: float,
    text_field: str,
    skip: bool,
    counts: ReadCounts,
    cut: Cut,
    val_hash_max: int | None = None,
) -> Iterator[Piece]:
    with _open_binary(path) as (fh, file):
        lines = Lines(fh)
        for data in lines:
            counts.position = file.tell()
            where = f"{path}:{lines.number}"
            long: LongString | None = None
            try:
                if lines.complete:
                    if is_blank(data):
                        continue
                    record = loads(data)
                else:  # a long line: parsed as it streams past, its long strings left out
                    record, longs = scan_long_value(itertools.chain([data], lines.rest()))
                    text = record.get(text_field) if isinstance(record, dict) else None
                    long = longs.get(text) if isinstance(text, str) else None
            except LineError as exc:
                _bad(where, str(exc), skip, counts)
                continue
            text = _text_of(record, text_field, where, skip, counts)
            if long is not None:
                if not long.unicode:
                    _bad(where, _NOT_UNICODE, skip, counts)
                    continue
                split = "val" if is_held_out(long.digest, val_fraction, val_hash_max) else "train"
                yield from _read_long_text(path, lines.offset, long, split, cut, where, counts)
            elif text and _unicode(text, where, skip, counts):
                yield from _document(text, val_fraction, cut, where, val_hash_max)


def _read_long_text(
    path: Path, offset: int, long: LongString, split: str, cut: Cut, where: str, counts: ReadCounts
) -> Iterator[Piece]:
    """The text of a long line's string, read again from the file (the line starts at stream byte ``offset``) and
    decoded in blocks."""
    pieces = _Pieces(split, cut, where)
    with _open_binary(path) as (fh, file):
        _skip(fh, offset + long.start)
        blocks = _blocks(fh, long.end - long.start)
        try:
            for text in decode_string(blocks, long.start):
                counts.position = max(counts.position, file.tell())  # progress through the file
                yield from pieces.add(text)
        except LineError as exc:  # the file changed since it was checked
            raise DataError(f"{where}: {exc} (the file changed while it was read)") from None
    yield from pieces.end()


def _skip(fh: BinaryIO, n: int) -> None:
    if fh.seekable():
        fh.seek(n)
        return
    for _ in _blocks(fh, n):
        pass


def _blocks(fh: BinaryIO, n: int) -> Iterator[bytes]:
    """The next ``n`` bytes of ``fh``, in blocks of at most :data:`PIECE_CHARS`."""
    while n > 0:
        data = fh.read(min(PIECE_CHARS, n))
        if not data:
            raise EOFError("the file ended early (it changed while it was read)")
        n -= len(data)
        yield data


def _read_parquet(
    path: Path,
    val_fraction: float,
    text_field: str,
    skip: bool,
    counts: ReadCounts,
    cut: Cut,
    val_hash_max: int | None = None,
) -> Iterator[Piece]:
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
            where = f"{path}: row {row}"
            if not isinstance(value, str):
                what = "null" if value is None else type(value).__name__
                _bad(where, f"'{text_field}' is {what}, not a string", skip, counts)
                continue
            if value:
                yield from _document(value, val_fraction, cut, where, val_hash_max)


def _read_txt(
    path: Path, size: int, val_fraction: float, skip: bool, counts: ReadCounts, cut: Cut
) -> Iterator[Piece]:
    """One document (a byte-order mark at its start left out), read a line at a time (a longer line in blocks of
    :data:`PIECE_CHARS` bytes), in pieces of about :data:`PIECE_CHARS` characters; from the first line end at or
    after byte ``size * (1 - val_fraction)`` on, the pieces are the validation part. The document's first piece
    takes the BOS and its last the EOS: the held-out tail continues the document, it does not start one."""
    at = size - int(size * val_fraction) if val_fraction > 0 else size + 1
    # without a tokenizer, a piece ends at the line end after PIECE_CHARS, as prepare always cut a .txt file (the
    # BPE trained on its sample depends on it)
    pieces = _Pieces("train", cut, str(path), search_all=cut is _line_end)
    split = "train"
    with open(path, "rb") as fh:
        lines = Lines(fh, PIECE_CHARS)
        for data in lines:
            if lines.complete:
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    _bad(f"{path}:{lines.number}", utf8_error(data, exc.start), skip, counts)
                    continue
                yield from pieces.add(line)
            else:  # a long line, decoded in blocks
                decoder, column = codecs.getincrementaldecoder("utf-8")("strict"), 0
                for block in itertools.chain([data], lines.rest()):
                    try:
                        yield from pieces.add(decoder.decode(block, lines.complete))
                    except UnicodeDecodeError as exc:  # exc.object: the bytes held back, then ``block``
                        held_back = len(exc.object) - len(block)
                        why = utf8_error(exc.object, exc.start, column - held_back)
                        _bad(f"{path}:{lines.number}", why, skip, counts)
                        break  # the rest of the line is skipped
                    column += len(block)
            counts.position = fh.tell()
            if split == "train" and counts.position >= at:
                split = "val"
                yield from pieces.restart(split)
    yield from pieces.end(keep_blank=False)
