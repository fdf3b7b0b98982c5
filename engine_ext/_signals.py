"""Which stop signals a process takes over for its own cleanup."""

from __future__ import annotations

import signal

__all__ = ["at_default"]


def at_default(*signums: int) -> tuple[int, ...]:
    """Those of ``signums`` whose handler is still the default (which ends the process).

    A signal the process was started ignoring stays ignored: ``nohup`` ignores SIGHUP so
    that a closing terminal does not stop the command, and a handler taken for it would
    undo that. One installed by someone else (the engine's own) is theirs to keep."""
    return tuple(s for s in signums if signal.getsignal(s) == signal.SIG_DFL)
