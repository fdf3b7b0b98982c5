"""Static checks as tests: ruff (lint and format) and mypy --strict on our packages (pyproject config)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_ruff_is_clean() -> None:
    pytest.importorskip("ruff", reason="ruff is in the dev extra (scripts/dev.sh installs it)")
    proc = _run("ruff", "check", "allocator", "engine_ext", "sidecar", "tests", "bench", "scripts")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_applied() -> None:
    """One formatter for the whole tree (pyproject [tool.ruff]); run ``ruff format .``."""
    pytest.importorskip("ruff", reason="ruff is in the dev extra (scripts/dev.sh installs it)")
    proc = _run("ruff", "format", "--check", ".")
    assert proc.returncode == 0, "run `ruff format .`:\n" + proc.stdout + proc.stderr


@pytest.mark.slow
def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra (scripts/dev.sh installs it)")
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
