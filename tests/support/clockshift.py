"""A process whose wall clock a test steps: ``clockshift.c``, loaded with LD_PRELOAD.

:class:`ClockShift` builds the shim and holds the file it reads and the environment that
loads it. The shift applies to ``CLOCK_REALTIME`` only (``time.time()``), at the
process's next read.
"""

from __future__ import annotations

import os
from pathlib import Path

from .preload import build


class ClockShift:
    """The wall-clock shift of the processes started with :attr:`env`."""

    def __init__(self, directory: Path) -> None:
        self.library = build("clockshift", directory)
        self.file = directory / "clockshift"
        self.set(0.0)

    @property
    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": str(self.library), "KVS_CLOCKSHIFT_FILE": str(self.file)}

    def set(self, seconds: float) -> None:
        """Step the wall clock to real time + ``seconds`` (atomic for a reader)."""
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(f"{seconds!r}\n")
        os.replace(tmp, self.file)
