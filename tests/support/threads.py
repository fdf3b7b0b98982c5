"""Running one action on a thread of its own (a controller publishing a limit)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["caught_in_thread", "in_foreign_thread"]


def caught_in_thread(
    action: Callable[[], object], *, name: str = "control"
) -> BaseException | None:
    """Run ``action`` on a new thread called ``name``, wait for it, and return what it
    raised (None if nothing)."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            caught.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    return caught[0] if caught else None


def in_foreign_thread(action: Callable[[], object], *, name: str = "control") -> None:
    """:func:`caught_in_thread`, re-raising what ``action`` raised on the calling thread."""
    error = caught_in_thread(action, name=name)
    if error is not None:
        raise error
