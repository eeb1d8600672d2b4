"""Byte units, defined once: GiB is 1024**3 bytes and is labelled GiB; GB (10**9 bytes) appears only where a user
writes it (a budget such as ``24GB``)."""

from __future__ import annotations

import re

from memfit.errors import ConfigError

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

BYTE_UNITS: dict[str, int] = {
    "b": 1,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
"""Units of a size: binary ``KiB``, ``MiB``, ``GiB`` (1024**3 bytes), ``TiB``; decimal ``KB``, ``MB``, ``GB``
(10**9 bytes), ``TB``; ``B``. Case does not matter; the ``i`` does."""


def to_gib(num_bytes: float) -> float:
    """Bytes -> GiB (1024**3 bytes)."""
    return num_bytes / GIB


def format_bytes(n: float) -> str:
    """``24.00 GiB``, ``512.00 MiB`` or ``12.50 KiB`` (binary units: GiB = 1024**3 bytes)."""
    for unit, size in (("GiB", GIB), ("MiB", MIB)):
        if abs(n) >= 0.1 * size or (n == 0 and unit == "GiB"):
            return f"{n / size:.2f} {unit}"
    return f"{n / KIB:.2f} KiB"


def parse_bytes(text: str, key: str = "budget") -> int:
    """Bytes from a size with a unit: ``24GiB`` is 24 * 1024**3, ``24GB`` 24 * 10**9, ``512MiB``, ``1.5TiB``.

    Args:
        text: a number followed by a unit of :data:`BYTE_UNITS` (spaces allowed between them).
        key: the config key to name in errors.

    Returns:
        Bytes, rounded down to an integer.

    Raises:
        ConfigError: naming ``key``, when the text is not a positive number with a known unit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]+)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in BYTE_UNITS:
        raise ConfigError(
            f"config key '{key}': {text!r} is not a size with a unit; write e.g. {key}=24GiB (GiB = 1024**3 "
            f"bytes; also KiB, MiB, TiB) or {key}=24GB (GB = 10**9 bytes; also KB, MB, TB)"
        )
    value = float(match.group(1)) * BYTE_UNITS[unit]
    if value < 1:
        raise ConfigError(f"config key '{key}': must be > 0, got {text!r}")
    return int(value)
