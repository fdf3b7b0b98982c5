"""Waiting on state, never on time: the one polling helper of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T], *, timeout_s: float = 10.0, period_s: float = 0.02, what: str = ""
) -> T:
    """Call ``probe`` until it returns something truthy and return that.

    The timeout only bounds a failing test (it is never what a test asserts):
    past it, raise ``AssertionError`` naming ``what`` and the last value seen.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not met within {timeout_s:g}s: {what or probe!r} (last value {value!r})"
            )
        time.sleep(period_s)
