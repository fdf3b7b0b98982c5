"""Checks and run-splitting shared by the backends."""

from __future__ import annotations

from collections.abc import Sequence

from ._errors import AllocatorContractError


def check_pages(pages: Sequence[int], num_pages: int, mapped: bytearray, want: bool) -> list[int]:
    """Return ``pages`` sorted after checking range, duplicates and mapped state.

    ``want`` is the state every page must be in now (``False`` for a map,
    ``True`` for an unmap). Raises before anything changes.
    """
    ordered = sorted(pages)
    previous = -1
    for page in ordered:
        if not 0 <= page < num_pages:
            raise AllocatorContractError(f"page {page} is outside 0..{num_pages - 1}")
        if page == previous:
            raise AllocatorContractError(f"page {page} appears twice in one batch")
        if bool(mapped[page]) is not want:
            state = "already mapped" if mapped[page] else "not mapped"
            raise AllocatorContractError(f"page {page} is {state}")
        previous = page
    return ordered


def runs(ordered: list[int]) -> list[tuple[int, int]]:
    """Split sorted pages into ``(first, count)`` runs of consecutive pages."""
    out: list[tuple[int, int]] = []
    for page in ordered:
        if out and out[-1][0] + out[-1][1] == page:
            first, count = out[-1]
            out[-1] = (first, count + 1)
        else:
            out.append((page, 1))
    return out
