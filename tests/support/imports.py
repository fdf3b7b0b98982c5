"""What importing something loads, measured in a fresh interpreter (``sys.modules`` clean)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["REPO", "loaded_after"]

REPO = Path(__file__).resolve().parents[2]


def loaded_after(*modules: str, then: str = "") -> list[str]:
    """Module names in ``sys.modules`` of a fresh interpreter after importing ``modules``.

    ``then`` is Python code run after the imports (e.g. touching lazy attributes);
    the interpreter runs in the repository root, so our packages are importable.
    """
    code = (
        "import json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    __import__(name)\n"
        f"{then}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    loaded: list[str] = json.loads(proc.stdout.splitlines()[-1])
    return loaded
