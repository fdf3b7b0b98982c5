"""Measure what one process maps of a reservation, from ``/proc/<pid>/maps``.

A rank's view of the KV memfd is one reservation whose pages are made
readable and writable on ``map`` and ``PROT_NONE`` on ``unmap``; the kernel
splits it into VMAs by protection, so the readable bytes inside the range are
what that process maps -- measured by the OS, not counted by us.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

__all__ = ["file_view_bytes", "mapped_ranges", "memfd_view", "view_mapped_bytes"]


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


def _readable_mappings(pid: int | str) -> Iterator[tuple[list[str], int]]:
    """Every readable mapping in ``/proc/<pid>/maps`` that maps a file: its fields (address
    range, perms, offset, device, inode, path) and its length."""
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or parts[1][0] != "r":
                continue
            low_s, high_s = parts[0].split("-")
            yield parts, int(high_s, 16) - int(low_s, 16)


def memfd_view(pid: int | str, name: str) -> list[tuple[int, int]]:
    """``(file_offset, length)`` of every readable mapping ``pid`` holds of memfd ``name``.

    Independent of any counter: the kernel's own list of the process's
    mappings, matched by the memfd's name (``/memfd:<name> (deleted)``).
    """
    prefix = f"/memfd:{name}"
    return [
        (int(parts[2], 16), length)
        for parts, length in _readable_mappings(pid)
        if len(parts) == 6 and parts[5].startswith(prefix)
    ]


def file_view_bytes(pid: int | str, device: int, inode: int) -> int:
    """Bytes ``pid`` can read of the file ``(device, inode)`` (the KV memfd, by identity).

    The kernel's own list again; a memfd is matched by its inode, not its name
    (names need not be unique). Raises ``OSError`` if the process is gone."""
    dev = f"{os.major(device):02x}:{os.minor(device):02x}"
    return sum(
        length
        for parts, length in _readable_mappings(pid)
        if parts[3] == dev and int(parts[4]) == inode
    )
