"""Byte sizes on the wire, on the command line and in settings: one parser, one printer."""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = ["MAX_LIMIT_BYTES", "SizeError", "format_size", "parse_limit", "parse_size"]

#: Largest limit accepted anywhere: 1 EiB. Anything larger is a typo.
MAX_LIMIT_BYTES = 1 << 60

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# ASCII digits only ("\d" would take any script's digits); read exactly, never through float
_SIZE_RE = re.compile(
    r"^\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([KMGT]?)(?:I?B|I)?\s*$", re.IGNORECASE | re.ASCII
)
#: Longest number part read (1 EiB has 19 digits; the rest only costs time to refuse).
_MAX_NUMBER_CHARS = 64


class SizeError(ValueError):
    """A size that cannot be read. The message says what forms are accepted."""


def parse_size(value: object) -> int:
    """Read a byte size: an int, or a string like ``512M``, ``2G``, ``1.5GiB``.

    Units ``K``, ``M``, ``G``, ``T`` are powers of 1024 (as kvctl and Docker
    read them), optionally followed by ``B``, ``i`` or ``iB`` in any case.
    The number is read exactly (no float rounding). With a unit, a fraction
    is rounded down to whole bytes; without one it must be whole (``"1.5"``
    is refused like the JSON number ``1.5``), and a non-zero size that comes
    to less than one byte is refused rather than read as 0. Negative, NaN,
    infinite, boolean and oversized values are rejected with :class:`SizeError`.
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
                f"cannot read size {_shown(value)}: use a byte count or a number with a unit "
                "K, M, G or T (powers of 1024), e.g. '512M', '2G', '1.5GiB'"
            )
        num = _read_number(value, m.group(1), m.group(2).upper())
    else:
        raise SizeError(
            f"a size must be a byte count or a string like '512M'; got {type(value).__name__}"
        )
    if num < 0:
        raise SizeError(f"a size cannot be negative; got {value!r}")
    if num > MAX_LIMIT_BYTES:
        raise SizeError(f"size {value!r} is larger than 1 EiB; check the unit")
    return num


def _shown(value: str) -> str:
    """The value as a message shows it: a long one cut short."""
    return repr(value) if len(value) <= 40 else f"{value[:32]!r}... ({len(value)} characters)"


def _read_number(value: str, number: str, unit: str) -> int:
    if len(number) > _MAX_NUMBER_CHARS:
        raise SizeError(f"size {_shown(value)} has too many digits: at most 1 EiB is accepted")
    exact = Fraction(number) * _UNITS[unit]
    whole = exact.numerator // exact.denominator
    if exact != whole and not unit:
        raise SizeError(f"a byte count must be whole; got {value!r} (use a unit, e.g. '1.5G')")
    if whole == 0 and exact != 0:
        raise SizeError(f"size {value!r} is less than one byte; check the unit")
    return whole


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
