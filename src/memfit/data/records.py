"""Reading instruction and chat records: JSON, JSON Lines and the Hugging Face datasets' own layouts (Alpaca,
Dolly, ShareGPT, OpenAI messages) into conversations, each malformed record named by its file and line.

Split from :mod:`memfit.data.instruct`, which templates, masks and packs what this reads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from memfit.data.chat_template import ROLES
from memfit.data.jsonl import Lines, MalformedJSON, NotUTF8, is_blank
from memfit.data.jsonl import loads as jsonl_loads
from memfit.data_formats import format_columns
from memfit.errors import DataError

log = logging.getLogger(__name__)

T = TypeVar("T")

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


# ----------------------------------------------------------------------------------------------------------------
# Loading records


@dataclass(frozen=True)
class _Record:
    """One loaded conversation and where it came from (for error messages)."""

    index: int
    line: int | None
    messages: list[dict[str, str]]

    def where(self, path: Path) -> str:
        return record_where(path, self.index, self.line)


def record_where(path: Path, index: int, line: int | None) -> str:
    return f"'{path}' record {index} (0-based" + (f"; line {line})" if line is not None else ")")


class Malformed(Exception):
    """A record that cannot become a conversation; the message says what is wrong with it."""


def load_conversations(
    path: str | Path,
    fmt: str,
    *,
    column_map: dict[str, str] | None = None,
    skip_malformed: bool = False,
) -> tuple[list[list[dict[str, str]]], int]:
    """Read instruction or chat records as conversations.

    Formats (field names as in the file, renamed by ``column_map``):

    - ``alpaca``: ``instruction``, ``input`` (optional, may be empty), ``output`` -> ``[user, assistant]``; a
      non-empty input is kept on the user message under ``"input"``.
    - ``dolly``: ``instruction``, ``context``, ``response``: Alpaca with ``column_map={"input": "context",
      "output": "response"}`` (Dolly's other fields, such as ``category``, are ignored).
    - ``sharegpt``: ``conversations``: ``[{"from": "human" | "user" | "gpt" | "assistant" | "system", "value"}]``.
    - ``openai``: ``messages``: ``[{"role": "system" | "user" | "assistant", "content"}]``.

    A record is malformed when it is not a JSON object, a field is missing or not a string, a role is unknown, the
    conversation is empty or has no assistant turn, or (JSONL) its line is not valid JSON.

    Args:
        path: A ``.json`` file (a list of records, or a single record as an object) or a ``.jsonl`` file.
        fmt: One of :data:`memfit.data_formats.INSTRUCT_FORMATS`.
        column_map: Canonical field name -> field name in the file, for example ``{"instruction": "question"}``.
            Canonical names: ``instruction``, ``input``, ``output`` (alpaca, dolly; dolly also accepts
            ``context`` and ``response``), ``conversations``, ``from``, ``value`` (sharegpt), ``messages``,
            ``role``, ``content`` (openai).
        skip_malformed: Skip malformed records and count them (a warning logs how many and the first reasons)
            instead of raising.

    Returns:
        ``(conversations, num_skipped)``: the conversations in file order, each a list of message dicts, and the
        number of malformed records skipped.

    Raises:
        DataError: The file is missing, unreadable, not UTF-8, not valid JSON (``.json``), of another extension,
            or holds no record; ``fmt`` or a ``column_map`` key is unknown; or, without ``skip_malformed``, a
            record is malformed (the message names the file, the record index, the line for JSONL, and what is
            wrong); or every record is malformed.
    """
    records, skipped = load_records(Path(path), fmt, column_map, skip_malformed)
    return [r.messages for r in records], skipped


def read_utf8(path: Path, what: str = "corpus file", encoding: str = "utf-8") -> str:
    """Read a file as strict UTF-8 (``encoding="utf-8-sig"`` also drops a byte-order mark).

    Args:
        path: the file.
        what: how errors name it ("corpus file", "data file").
        encoding: ``utf-8`` or ``utf-8-sig``.

    Raises:
        DataError: the file is unreadable or not valid UTF-8 (the message gives line and column).
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {what} '{path}': {exc.strerror}") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(
            f"{what} '{path}' is not valid UTF-8: byte 0x{raw[exc.start]:02x} at line {line}, column {col} "
            f"(byte offset {exc.start}). Convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) and run again."
        ) from None


def read_raw(path: Path) -> list[tuple[int | None, Any]]:
    """``[(line or None, parsed record or Malformed), ...]`` for every record of the file."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl"):
        raise DataError(
            f"data file '{path}' has extension {path.suffix!r}; expected .json (a list of records) or .jsonl "
            "(one record per line)"
        )
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist")
    if suffix == ".jsonl":
        return _read_jsonl(path)
    text = read_utf8(path, "data file", encoding="utf-8-sig")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ""
        if exc.msg == "Extra data":
            hint = "; it looks like JSON Lines (one record per line): rename it to .jsonl"
        raise DataError(
            f"data file '{path}' is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}{hint}"
        ) from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise DataError(
            f"data file '{path}' holds a JSON {type(data).__name__}; expected a list of records or one record object"
        )
    if not data:
        raise DataError(f"data file '{path}' holds no records")
    return [(None, item) for item in data]


def _read_jsonl(path: Path) -> list[tuple[int | None, Any]]:
    """The records of a ``.jsonl`` file by memfit's JSON Lines rule (:mod:`memfit.data.jsonl`: a byte-order mark
    skipped, lines cut at ``\\n`` only, so U+2028 and the like inside a string are text)."""
    out: list[tuple[int | None, Any]] = []
    try:
        with open(path, "rb") as fh:
            lines = Lines(fh, limit=1 << 62)  # fine-tuning records are read whole
            for data in lines:
                if is_blank(data):
                    continue
                try:
                    out.append((lines.number, jsonl_loads(data)))
                except MalformedJSON as exc:
                    out.append((lines.number, Malformed(f"invalid JSON: {exc.msg} at column {exc.colno}")))
                except NotUTF8 as exc:
                    raise DataError(
                        f"data file '{path}' is not valid UTF-8: byte 0x{exc.byte:02x} at line {lines.number}, "
                        f"column {exc.start + 1} (byte offset {lines.offset + exc.start}). Convert it to UTF-8 "
                        f"(e.g. iconv -f latin1 -t utf-8) and run again."
                    ) from None
    except OSError as exc:
        raise DataError(f"cannot read data file '{path}': {exc.strerror}") from None
    if not out:
        raise DataError(f"data file '{path}' holds no records")
    return out


def valid_records(
    path: Path, fmt: str, convert: Callable[[Any], T], skip_malformed: bool
) -> tuple[list[tuple[int, int | None, T]], int]:
    """Every record of ``path`` (:func:`read_raw`) through ``convert``, which raises :class:`Malformed` for a bad
    one: a malformed record raises, naming the file, the record and its line, or with ``skip_malformed`` is skipped
    and counted (a warning logs how many and the first reasons).

    Returns:
        ``([(index, line, converted), ...], num_malformed)`` in file order.

    Raises:
        DataError: as :func:`read_raw`; a malformed record without ``skip_malformed``; no valid record at all.
    """
    out: list[tuple[int, int | None, T]] = []
    reasons: list[str] = []
    for index, (line, item) in enumerate(read_raw(path)):
        try:
            if isinstance(item, Malformed):
                raise item
            converted = convert(item)
        except Malformed as exc:
            message = f"{record_where(path, index, line)} is malformed: {exc}"
            if not skip_malformed:
                raise DataError(f"{message} (set data.skip_malformed to skip such records)") from None
            reasons.append(message)
            continue
        out.append((index, line, converted))
    if reasons:
        log.warning(
            "skipped %d malformed record(s) of '%s'; first: %s", len(reasons), path, "; ".join(reasons[:3])
        )
    if not out:
        raise DataError(
            f"data file '{path}' holds no valid {fmt} record ({len(reasons)} malformed, skipped); the first: "
            f"{reasons[0]}"
        )
    return out, len(reasons)


def load_records(
    path: Path, fmt: str, column_map: dict[str, str] | None, skip_malformed: bool
) -> tuple[list[_Record], int]:
    columns = format_columns(fmt, column_map)
    valid, skipped = valid_records(path, fmt, lambda item: _to_messages(item, fmt, columns), skip_malformed)
    return [_Record(index, line, messages) for index, line, messages in valid], skipped


def _field(obj: dict, name: str, what: str, optional: bool = False) -> str | None:
    """``obj[name]``, a string; ``what`` is the canonical name, shown when the file's name differs."""
    label = repr(name) if name == what else f"{name!r} (the {what})"
    if name not in obj or (optional and obj[name] is None):
        if optional:
            return None
        have = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise Malformed(f"missing field {label}; fields present: {have} (rename with column_map)")
    value = obj[name]
    if not isinstance(value, str):
        raise Malformed(f"field {label} must be a string, got {type(value).__name__} {value!r:.40}")
    return value


def _to_messages(item: Any, fmt: str, columns: dict[str, str]) -> list[dict[str, str]]:
    if not isinstance(item, dict):
        raise Malformed(f"a record must be a JSON object, got {type(item).__name__} {item!r:.40}")
    if fmt in ("alpaca", "dolly"):
        instruction = _field(item, columns["instruction"], "instruction")
        context = _field(item, columns["input"], "input", optional=True)
        output = _field(item, columns["output"], "output")
        user = {"role": "user", "content": instruction}
        if context:
            user["input"] = context
        return [user, {"role": "assistant", "content": output}]

    key, role_key, text_key = (
        ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    )
    if columns[key] not in item:
        raise Malformed(f"missing field {columns[key]!r} (the list of turns) (rename with column_map)")
    turns = item[columns[key]]
    if not isinstance(turns, list):
        raise Malformed(f"field {columns[key]!r} is a {type(turns).__name__}, not a list of turns")
    if not turns:
        raise Malformed("the conversation is empty")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Malformed(f"turn {t} is a {type(turn).__name__}, not an object")
        try:
            role = _field(turn, columns[role_key], role_key)
            content = _field(turn, columns[text_key], text_key)
        except Malformed as exc:
            raise Malformed(f"turn {t}: {exc}") from None
        if fmt == "sharegpt":
            if role not in _SHAREGPT_ROLES:
                raise Malformed(
                    f"turn {t} has unknown speaker {role!r}; expected one of {', '.join(_SHAREGPT_ROLES)}"
                )
            role = _SHAREGPT_ROLES[role]
        elif role not in ROLES:
            raise Malformed(f"turn {t} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise Malformed("the conversation has no assistant turn (nothing to train on)")
    return messages
