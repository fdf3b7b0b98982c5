"""bench/bench_vllm.py refuses option combinations it cannot honour, before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_windows_with_step_procs_is_refused_before_any_work(tmp_path: Path) -> None:
    windows = tmp_path / "windows.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_vllm.py"),
            "--step-only",
            "--step-procs",
            "--windows",
            str(windows),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--windows needs the engines in one process" in proc.stderr
    assert "leave out --step-procs" in proc.stderr
    assert not windows.exists()  # refused before the rounds, so nothing was written
    assert "round" not in proc.stdout.lower()
