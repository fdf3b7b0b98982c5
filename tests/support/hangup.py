"""Start a command with SIGHUP at its default, as from a terminal.

A test run under ``nohup`` (or a CI runner that ignores SIGHUP) hands the ignored
disposition down to every child, and an ignored SIGHUP must stay ignored (``nohup``
means it): the tests of what a hangup does start their process through this, so they
test what a terminal's child gets.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["with_default_hangup"]

_EXEC = (
    "import os, signal, sys; "
    "signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def with_default_hangup(argv: Sequence[str]) -> list[str]:
    """``argv`` (an absolute executable first) run with SIGHUP reset to its default; the
    exec keeps the pid, so the caller's process is the command's."""
    return [sys.executable, "-c", _EXEC, *argv]
