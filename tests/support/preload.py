"""Build the LD_PRELOAD test shims in ``tests/support`` (``clockshift.c``, ``slowdns.c``):
libc calls a test bends in a child process, never in the test's own."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def build(name: str, out_dir: Path) -> Path:
    """Compile ``tests/support/<name>.c`` into ``out_dir/lib<name>.so``; skips the test
    without a C compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip(f"needs a C compiler (cc/gcc) for the {name} shim")
    out = out_dir / f"lib{name}.so"
    subprocess.run(
        [
            compiler,
            "-O2",
            "-Wall",
            "-Wextra",
            "-shared",
            "-fPIC",
            "-o",
            str(out),
            str(HERE / f"{name}.c"),
            "-ldl",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out
