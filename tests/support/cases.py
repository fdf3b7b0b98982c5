"""Input combinations for tests that compare two implementations (C and Python) case by case."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["each_moved_and_random"]


def each_moved_and_random(
    fields: Mapping[str, Sequence[Any]], seed: int, count: int
) -> list[dict[str, Any]]:
    """The base case (every field at its first value), then each field moved alone to
    each other value, then ``count`` random combinations (seeded)."""
    base = {name: values[0] for name, values in fields.items()}
    cases = [dict(base)]
    for name, values in fields.items():
        for value in values[1:]:
            cases.append({**base, name: value})
    rng = random.Random(seed)
    cases += [{name: rng.choice(values) for name, values in fields.items()} for _ in range(count)]
    return cases
