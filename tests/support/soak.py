"""Opt-in soaks: the seeds a randomized test runs when ``KVSIDECAR_SOAK`` asks for more."""

from __future__ import annotations

import os

__all__ = ["soak_seeds"]


def soak_seeds() -> range | None:
    """``KVSIDECAR_SOAK=<first>:<count>`` (count 1 if left out): those seeds; unset: None.

    A malformed value raises ``ValueError`` naming the variable (at collection).
    """
    value = os.environ.get("KVSIDECAR_SOAK", "").strip()
    if not value:
        return None
    first, _, count = value.partition(":")
    try:
        seeds = range(int(first), int(first) + int(count or 1))
    except ValueError:
        raise ValueError(f"KVSIDECAR_SOAK={value!r}: expected <first seed>:<count>") from None
    if not seeds:
        raise ValueError(f"KVSIDECAR_SOAK={value!r}: the count must be at least 1")
    return seeds
