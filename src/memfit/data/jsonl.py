"""JSON Lines, read by one rule wherever memfit reads them (``memfit prepare``'s sources, fine-tuning records).

The rule is what the formats' specifications accept (RFC 8259 for JSON, jsonlines.org for the lines):

- a UTF-8 byte-order mark at the start of the file is skipped (RFC 8259 lets a reader ignore it);
- a line ends only at ``\\n``; a ``\\r`` before it (CRLF files) is JSON whitespace. U+2028, U+2029, U+0085 and
  every other character are text inside a JSON string, never line ends (``str.splitlines`` cuts at all of them);
- a line holding only JSON whitespace is skipped;
- every other line is one JSON value in strict UTF-8, decoded by :func:`json.loads`; what is wrong with a line
  (:class:`LineError`) says the column, and the callers name the file and the line.

Memory is bounded by :data:`LINE_BYTES` per line read, whatever the line's length: :class:`Lines` gives a longer
line's first :data:`LINE_BYTES` and the rest in blocks (:meth:`Lines.rest`), and :func:`scan_long_value` parses such
a line holding at most :data:`SHORT_STRING_BYTES` of any of its strings: the longer ones (a book-sized ``text``
field) are hashed and checked as they stream past, and can be read again, decoded in blocks, by
:func:`decode_string` from their byte range. No released streaming JSON library can hand out one string value in
parts (json-stream 2.5.1 and json-stream-rs-tokenizer 0.5.4 have no ``strings_as_files``; ijson yields whole
strings), so the scan finds string boundaries itself and leaves every decoding and every check to :func:`json.loads`.
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from memfit.data.tokens import text_hash

BOM = codecs.BOM_UTF8
LINE_BYTES = 4 << 20
"""Bytes of a line read at once (4 MiB); a longer line is read on in blocks of :data:`BLOCK_BYTES`."""
BLOCK_BYTES = 1 << 20
"""Bytes of a long line read (and parsed) at once: 1 MiB."""
SHORT_STRING_BYTES = 64 << 10
"""Strings of a long line up to this many bytes (64 KiB) are held while it is parsed; longer ones stream past."""
SKELETON_BYTES = 16 << 20
"""What a long line may hold besides its long strings (16 MiB: keys, numbers, short strings)."""
JSON_WHITESPACE = b" \t\r\n"


class LineError(ValueError):
    """What is wrong with one line (not valid UTF-8, malformed JSON), with the column; the caller names the file
    and line."""


class NotUTF8(LineError):
    """A line that is not valid UTF-8; ``start`` is the offset of its first bad byte, ``byte`` that byte."""

    def __init__(self, data: bytes, start: int) -> None:
        super().__init__(utf8_error(data, start))
        self.start, self.byte = start, data[start]


class MalformedJSON(LineError):
    """A line that is not one JSON value: :func:`json.loads`'s ``msg`` and ``colno``."""

    def __init__(self, msg: str, colno: int) -> None:
        super().__init__(f"malformed JSON ({msg} at column {colno})")
        self.msg, self.colno = msg, colno


def loads(data: bytes) -> Any:
    """The JSON value of one line (its bytes, the ``\\n`` included or not).

    Raises:
        NotUTF8: the line is not valid UTF-8.
        MalformedJSON: it is not one JSON value.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotUTF8(data, exc.start) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedJSON(exc.msg, exc.colno) from None


def utf8_error(data: bytes, start: int, offset: int = 0) -> str:
    """Why bytes are not UTF-8: the first bad byte and its column (``offset``: bytes of the line before ``data``)."""
    return (
        f"not valid UTF-8: byte 0x{data[start]:02x} at column {offset + start + 1}; convert the file to UTF-8 (e.g. "
        f"iconv -f latin1 -t utf-8)"
    )


def is_blank(data: bytes) -> bool:
    """A line of JSON whitespace only (skipped by every reader)."""
    return not data.strip(JSON_WHITESPACE)


class Lines:
    """The lines of a binary stream by the JSON Lines rule, read at most ``limit`` bytes at a time.

    Iterating gives each line's first ``limit`` bytes (its ``\\n`` included when it fits); :attr:`complete` says
    whether that was the whole line, and :meth:`rest` reads what follows. What a caller leaves of a line unread
    is skipped before the next line. :attr:`number` (from 1) and :attr:`offset` (in the stream: a compressed
    file's decompressed bytes) locate the current line.

    Args:
        fh: the stream, at its start.
        limit: bytes of a line read at once (default :data:`LINE_BYTES`).
    """

    def __init__(self, fh: BinaryIO, limit: int | None = None) -> None:
        self.fh, self.limit = fh, LINE_BYTES if limit is None else limit
        self.number = 0
        self.offset = 0
        self.complete = True
        self._read = 0  # bytes of the stream read so far

    def __iter__(self) -> Iterator[bytes]:
        while True:
            for _ in self.rest():  # what the caller left of the line before
                pass
            data = self.fh.readline(self.limit)
            if not data:
                return
            # readline(limit) stops short of the limit without a newline only at the end of the stream
            self.complete = data.endswith(b"\n") or len(data) < self.limit
            self.offset = self._read
            self._read += len(data)
            if self.offset == 0 and data.startswith(BOM):
                data = data[len(BOM) :]
                self.offset = len(BOM)
            self.number += 1
            yield data

    def rest(self) -> Iterator[bytes]:
        """The rest of the current line, in blocks of at most :data:`BLOCK_BYTES` (the last ends with its
        ``\\n``)."""
        size = min(self.limit, BLOCK_BYTES)
        while not self.complete:
            data = self.fh.readline(size)
            self._read += len(data)
            self.complete = data.endswith(b"\n") or len(data) < size
            if data:
                yield data


# ----------------------------------------------------------------------------------------------------------------
# One long line, streaming
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LongString:
    """A string of a long line that was not held: where its content lies and what it holds."""

    start: int
    """Byte offset in the line of its first content byte (after the opening quote)."""
    end: int
    """Byte offset in the line of its closing quote."""
    digest: bytes
    """The :func:`~memfit.data.tokens.text_hash` digest of its decoded text (its split)."""
    chars: int
    """Characters of its decoded text."""
    unicode: bool
    """Its text is Unicode (no lone UTF-16 surrogate written as an escape such as ``\\ud800``)."""


_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


def _escaped(data: bytes, q: int, start: int) -> bool:
    """Whether ``data[q]`` follows an odd run of backslashes (it is escaped), counting back to ``start``, where
    the string's content (or an escape) begins."""
    run = q
    while run > start and data[run - 1] == 0x5C:
        run -= 1
    return (q - run) % 2 == 1


def _string_end(data: bytes, start: int) -> int:
    """The index of the quote that closes the string whose content (or an escape of it) begins at ``start``, or
    -1 when it is not in ``data``."""
    q = data.find(b'"', start)
    while q >= 0 and _escaped(data, q, start):
        q = data.find(b'"', q + 1)
    return q


def _escape_cut(data: bytes, start: int = 0) -> int:
    """The largest ``c <= len(data)`` that splits no escape of JSON string content ``data[start:]`` (which begins
    at an escape boundary) and no surrogate pair written as two escapes."""
    cut = len(data)
    while True:
        q = data.rfind(b"\\", max(start, cut - 6), cut)  # an escape ending at or after ``cut`` starts here
        if q < 0:
            return cut
        run = q
        while run > start and data[run - 1] == 0x5C:
            run -= 1
        if (q - run) % 2:  # q closes an escaped backslash: every escape before ``cut`` is whole
            return cut
        length = 6 if data[q + 1 : q + 2] == b"u" else 2
        if q + length > cut or (q + 6 == cut and _HIGH_SURROGATE.match(data, q)):
            cut = q
            continue
        return cut


class StringDecoder:
    """Decodes the content of one JSON string (the bytes between its quotes, escapes as written) given in blocks
    of any size: :meth:`feed` returns the text of what can be decoded so far, exactly what :func:`json.loads`
    makes of the whole string, split anywhere.

    Args:
        offset: the content's byte offset in its line (for the column in error messages).
    """

    def __init__(self, offset: int = 0) -> None:
        self._carry = b""
        self._utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self._offset = offset  # of the carry's first byte in the line

    def feed(self, data: bytes, final: bool = False) -> str:
        """The text of ``data`` after what was fed before, up to a place that splits no escape.

        Raises:
            LineError: invalid UTF-8, an invalid escape or a control character (as :func:`json.loads` says).
        """
        data = self._carry + data
        cut = len(data) if final else _escape_cut(data)
        head, self._carry = data[:cut], data[cut:]
        try:
            text = self._utf8.decode(head, final)
        except UnicodeDecodeError as exc:  # exc.object: the bytes the decoder held back, then ``head``
            raise LineError(
                utf8_error(exc.object, exc.start, self._offset - len(exc.object) + len(head))
            ) from None
        try:
            decoded = json.loads('"' + text + '"') if "\\" in text or not text.isprintable() else text
        except json.JSONDecodeError as exc:
            column = self._offset + len(text[: max(exc.pos - 1, 0)].encode("utf-8", "surrogatepass")) + 1
            raise LineError(f"malformed JSON ({exc.msg.removesuffix(' at')} at column {column})") from None
        self._offset += cut
        return decoded


class _Scanned:
    """The string being scanned: its content held while short, else decoded, hashed and counted."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.held: bytearray | None = bytearray()
        self.decoder: StringDecoder | None = None
        self.hash = text_hash()
        self.chars = 0
        self.unicode = True

    def add(self, part: bytes) -> None:
        if self.held is not None:
            self.held += part
            if len(self.held) <= SHORT_STRING_BYTES:
                return
            part, self.held, self.decoder = bytes(self.held), None, StringDecoder(self.start)
        self._count(self.decoder.feed(part))

    def finish(self, end: int) -> LongString:
        self._count(self.decoder.feed(b"", final=True))
        return LongString(self.start, end, self.hash.digest(), self.chars, self.unicode)

    def _count(self, text: str) -> None:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            data, self.unicode = text.encode("utf-8", "surrogatepass"), False
        self.hash.update(data)
        self.chars += len(text)


def scan_long_value(blocks: Iterable[bytes]) -> tuple[Any, dict[str, LongString]]:
    """Parse one JSON value given in blocks (a long line), holding at most :data:`SHORT_STRING_BYTES` of any of
    its strings.

    A longer string is decoded as it streams past (so that it is checked as :func:`json.loads` would check it),
    hashed, and left out: the value has a placeholder string in its place, a key of the returned dict.

    Args:
        blocks: the line's bytes, in blocks of any size.

    Returns:
        ``(value, long strings)``: the JSON value, and placeholder -> :class:`LongString`.

    Raises:
        LineError: the line is not valid UTF-8, not one JSON value, or holds more than :data:`SKELETON_BYTES`
            besides its long strings.
    """
    nonce = secrets.token_hex(12)
    skeleton = bytearray()
    longs: dict[str, LongString] = {}
    base = 0  # line offset of data[0]
    carry = b""  # an escape cut at the end of the last block
    string: _Scanned | None = None
    for block in _split(blocks):
        data, i, carry = carry + block, 0, b""
        while i < len(data):
            if string is None:
                quote = data.find(b'"', i)
                stop = len(data) if quote < 0 else quote + 1
                skeleton += data[i:stop]
                if len(skeleton) > SKELETON_BYTES:
                    raise LineError(
                        f"a record holding more than {SKELETON_BYTES >> 20} MiB besides its strings of over "
                        f"{SHORT_STRING_BYTES >> 10} KiB; memfit streams long strings only"
                    )
                i = stop
                if quote >= 0:
                    string = _Scanned(base + i)
                continue
            end = _string_end(data, i)
            if end < 0:  # the string goes on in the next block; an escape cut at the end of this one with it
                cut = _escape_cut(data, i)
                string.add(data[i:cut])
                carry, i = data[cut:], len(data)
                break
            string.add(data[i:end])
            if string.held is not None:  # the closing quote of a short string
                skeleton += string.held + b'"'
            else:
                name = f"{nonce}{len(longs)}"
                longs[name] = string.finish(base + end)
                skeleton += name.encode() + b'"'
            string, i = None, end + 1
        base += len(data) - len(carry)
    if string is not None:
        raise LineError("malformed JSON (Unterminated string starting at the end of the line)")
    try:
        text = skeleton.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(utf8_error(bytes(skeleton), exc.start)) from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"malformed JSON ({exc.msg})") from None
    return value, longs


def _split(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """The blocks, each cut to at most :data:`BLOCK_BYTES` (what is decoded at once)."""
    for block in blocks:
        for start in range(0, len(block), BLOCK_BYTES):
            yield block[start : start + BLOCK_BYTES]


def decode_string(blocks: Iterable[bytes], offset: int = 0) -> Iterator[str]:
    """The text of a JSON string's content (the bytes of a :class:`LongString`'s range, in blocks), in parts.

    Raises:
        LineError: as :meth:`StringDecoder.feed`.
    """
    decoder = StringDecoder(offset)
    for block in blocks:
        text = decoder.feed(block)
        if text:
            yield text
    text = decoder.feed(b"", final=True)
    if text:
        yield text
