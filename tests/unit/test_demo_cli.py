"""``kvsidecar demo`` rejects bad arguments before starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("args", "message"), [
    (["--idle-s", "-1"], "--idle-s must be >= 0"),
    (["--idle-s", "soon"], "invalid float value"),
    (["--no-such-flag"], "unrecognized arguments"),
])  # fmt: skip
def test_bad_demo_arguments_fail_fast_with_a_message(
    args: list[str], message: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", "--out", str(out), *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (out / "demo-results.json").exists()  # nothing ran
