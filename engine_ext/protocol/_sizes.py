"""Byte sizes on the wire, on the command line and in settings: one parser, one printer."""

from __future__ import annotations

import math
import re

__all__ = ["MAX_LIMIT_BYTES", "SizeError", "format_size", "parse_limit", "parse_size"]

#: Largest limit accepted anywhere: 1 EiB. Anything larger is a typo.
MAX_LIMIT_BYTES = 1 << 60

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([KMGT]?)(?:I?B|I)?\s*$", re.IGNORECASE)


class SizeError(ValueError):
    """A size that cannot be read. The message says what forms are accepted."""


def parse_size(value: object) -> int:
    """Read a byte size: an int, or a string like ``512M``, ``2G``, ``1.5GiB``.

    Units ``K``, ``M``, ``G``, ``T`` are powers of 1024 (as kvctl and Docker
    read them), optionally followed by ``B``, ``i`` or ``iB`` in any case.
    Fractions are rounded down to whole bytes. Negative, NaN, infinite,
    boolean and oversized values are rejected with :class:`SizeError`.
    """
    if isinstance(value, bool):
        raise SizeError("a size must be a byte count or a string like '512M'; got a boolean")
    if isinstance(value, int):
        num = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise SizeError(f"a size must be a finite number of bytes; got {value!r}")
        if value != int(value):
            raise SizeError(f"a byte count must be whole; got {value!r} (use a unit, e.g. '1.5G')")
        num = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None:
            raise SizeError(
                f"cannot read size {value!r}: use a byte count or a number with a unit "
                "K, M, G or T (powers of 1024), e.g. '512M', '2G', '1.5GiB'"
            )
        num = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise SizeError(
            f"a size must be a byte count or a string like '512M'; got {type(value).__name__}"
        )
    if num < 0:
        raise SizeError(f"a size cannot be negative; got {value!r}")
    if num > MAX_LIMIT_BYTES:
        raise SizeError(f"size {value!r} is larger than 1 EiB; check the unit")
    return num


def parse_limit(value: object) -> int | None:
    """A limit: a size, or ``None``/``"none"``/``"unlimited"`` for no limit."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in {"none", "null", "unlimited"}:
        return None
    return parse_size(value)


def format_size(num_bytes: int | None) -> str:
    """Human form of a byte count (``1.5GiB``); ``unlimited`` for None."""
    if num_bytes is None:
        return "unlimited"
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.4g}{unit}"
    return f"{num_bytes}B"
