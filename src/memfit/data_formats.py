"""The schema of instruction / chat data and preference pairs: their record formats, their fields and the prompt
templates.

The data layer reads records with it (:mod:`memfit.data.instruct`, :mod:`memfit.data.preference`) and config
validation checks ``data.format``, ``data.template`` and ``data.column_map`` against it, so it sits below both,
outside the data package: config imports no module of :mod:`memfit.data`, whose modules import config.
"""

from __future__ import annotations

from memfit.errors import DataError

INSTRUCT_FORMATS = ("alpaca", "dolly", "sharegpt", "openai")
"""Record formats of instruction / chat data (:mod:`memfit.data.instruct`)."""
PREFERENCE_FORMAT = "preference"
"""The record format of preference pairs: ``prompt``, ``chosen``, ``rejected`` (:mod:`memfit.data.preference`)."""
DATA_FORMATS = ("text", *INSTRUCT_FORMATS, PREFERENCE_FORMAT)
"""The values of ``data.format``: a text corpus, instruction / chat records, or preference pairs."""
TEMPLATES = ("alpaca", "llama2-chat", "llama3-chat", "chatml")
"""memfit's built-in prompt templates of instruction / chat data and of ``memfit generate``."""
TEMPLATE_CHOICES = ("auto", *TEMPLATES)
"""The values of ``data.template``: ``auto`` (the checkpoint's own chat template where its tokenizer has one, else
:data:`DEFAULT_TEMPLATE`) or a built-in template."""
DEFAULT_TEMPLATE = "alpaca"
"""What ``data.template=auto`` renders with when the tokenizer has no chat template."""

INSTRUCT_COLUMNS: dict[str, dict[str, str]] = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output"},
    "dolly": {"instruction": "instruction", "input": "context", "output": "response"},
    "sharegpt": {"conversations": "conversations", "from": "from", "value": "value"},
    "openai": {"messages": "messages", "role": "role", "content": "content"},
}
"""Each instruction format's fields, by canonical name -> the name in the file; ``data.column_map`` overrides the
right-hand side."""
PREFERENCE_COLUMNS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
"""The fields of a preference pair, canonical name -> the name in the file; ``data.column_map`` overrides the
right-hand side."""
DOLLY_ALIASES = {"context": "input", "response": "output"}
"""Dolly's own field names, accepted as ``column_map`` keys beside the canonical Alpaca ones."""


def format_columns(fmt: str, column_map: dict[str, str] | None) -> dict[str, str]:
    """A record format's fields (canonical name -> name in the file) with ``column_map`` applied.

    Args:
        fmt: One of :data:`INSTRUCT_FORMATS`, or :data:`PREFERENCE_FORMAT`.
        column_map: Canonical name -> the name in the file, for the fields to rename.

    Returns:
        Every field of the format, canonical name -> name in the file.

    Raises:
        DataError: unknown format, a ``column_map`` key that is not a field of the format, or an empty name.
    """
    if fmt == PREFERENCE_FORMAT:
        columns = dict(PREFERENCE_COLUMNS)
    elif fmt in INSTRUCT_FORMATS:
        columns = dict(INSTRUCT_COLUMNS[fmt])
    else:
        known = (*INSTRUCT_FORMATS, PREFERENCE_FORMAT)
        raise DataError(f"unknown data format {fmt!r}; expected one of {', '.join(known)}")
    for key, name in (column_map or {}).items():
        canonical = DOLLY_ALIASES.get(key, key) if fmt == "dolly" else key
        if canonical not in columns:
            raise DataError(
                f"column_map key {key!r} is not a field of the {fmt} format; its fields are "
                f"{', '.join(columns)} (map each to the name used in your file)"
            )
        if not isinstance(name, str) or not name:
            raise DataError(f"column_map[{key!r}] must be a non-empty field name, got {name!r}")
        columns[canonical] = name
    return columns
