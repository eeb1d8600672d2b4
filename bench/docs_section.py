"""Rewrite one named section of a markdown file (between ``<!-- name:start -->`` and ``<!-- name:end -->``), so
each benchmark script owns its table in ``docs/benchmarks.md`` and leaves the others alone."""

from __future__ import annotations

from pathlib import Path


def write_section(doc: Path, name: str, section: str) -> None:
    """Replace the ``name`` section of ``doc`` with ``section``, or append it when the markers are absent.

    Args:
        doc: the markdown file (created with a ``# Benchmarks`` title if missing).
        name: the section's marker name, e.g. ``techniques``.
        section: the markdown to put between the markers.
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{start}\n{section}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
