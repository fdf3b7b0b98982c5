"""Measure what one process maps of a reservation, from ``/proc/<pid>/maps``.

A rank's view of the KV memfd is one reservation whose pages are made
readable and writable on ``map`` and ``PROT_NONE`` on ``unmap``; the kernel
splits it into VMAs by protection, so the readable bytes inside the range are
what that process maps -- measured by the OS, not counted by us.
"""

from __future__ import annotations

__all__ = ["mapped_ranges", "view_mapped_bytes"]


def mapped_ranges(pid: int | str, start: int, length: int) -> list[tuple[int, int]]:
    """``(first, end)`` byte ranges readable by ``pid`` inside ``[start, start + length)``."""
    end = start + length
    out: list[tuple[int, int]] = []
    with open(f"/proc/{pid}/maps", encoding="ascii") as maps:
        for line in maps:
            span, perms = line.split(maxsplit=2)[:2]
            low_s, high_s = span.split("-")
            low, high = int(low_s, 16), int(high_s, 16)
            if high <= start or low >= end or perms[0] != "r":
                continue
            out.append((max(low, start), min(high, end)))
    return out


def view_mapped_bytes(pid: int | str, start: int, length: int) -> int:
    """Bytes ``pid`` can read inside the range (its mapped KV view)."""
    return sum(high - low for low, high in mapped_ranges(pid, start, length))
