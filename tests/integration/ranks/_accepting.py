"""Rank processes a test starts itself (a lying, garbling or wrapped rank), accepted as
``RankGroup.spawn`` accepts its own: listen, start them, accept every hello, remove the
socket."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

from engine_ext.ranks import RankGroup
from engine_ext.ranks._group import _accept, _listen

Procs = list[subprocess.Popen[bytes]]


def accept_ranks(
    path: str, start: Callable[[], Procs], *, count: int | None = None
) -> tuple[RankGroup, Procs]:
    """Listen on ``path``, run ``start`` (it starts the rank processes and returns them),
    accept ``count`` ranks (default: one per process) and return the group with them."""
    listener = _listen(path)
    procs: Procs = []
    try:
        procs = start()
        ranks = _accept(listener, len(procs) if count is None else count, procs, 30.0)
    finally:
        listener.close()
        os.unlink(path)
    return RankGroup(ranks, procs), procs
