"""Running one action on a thread of its own (a controller publishing a limit)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["in_foreign_thread"]


def in_foreign_thread(action: Callable[[], object], *, name: str = "control") -> None:
    """Run ``action`` on a new thread called ``name`` and wait for it; re-raise what it
    raised here, on the calling (engine) thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
            errors.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
