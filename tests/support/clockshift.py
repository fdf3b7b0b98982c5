"""Build and use ``clockshift.c``: a process whose wall clock a test steps (LD_PRELOAD).

:func:`build` compiles the shim into a directory; :class:`ClockShift` is the file the
shim reads and the environment that loads it. The shift applies to ``CLOCK_REALTIME``
only (``time.time()``), at the process's next read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("clockshift.c")


def build(out_dir: Path) -> Path:
    """Compile the shim into ``out_dir``; skips the test without a C compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler (cc/gcc) for the wall-clock shim")
    out = out_dir / "libclockshift.so"
    subprocess.run(
        [compiler, "-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-o", str(out), str(SOURCE)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


class ClockShift:
    """The wall-clock shift of the processes started with :attr:`env`."""

    def __init__(self, directory: Path) -> None:
        self.library = build(directory)
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
