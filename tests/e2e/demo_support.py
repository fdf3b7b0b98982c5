"""Runs ``kvsidecar demo`` the way a person does, for the tests that read its results
(``test_demo.py``, ``test_demo_autopilot.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_demo(out: Path, *args: str, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """``kvsidecar demo --out OUT ARGS`` in a subprocess; its exit code and demo-results.json.

    Fails (with the demo's output tail) when the demo wrote no results or no plot.
    """
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", *args, "--out", str(out)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    results_path = out / "demo-results.json"
    tail = f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert results_path.exists(), f"no demo-results.json; output:\n{tail}"
    assert (out / "demo-mapped.png").stat().st_size > 0, tail
    return proc.returncode, json.loads(results_path.read_text())
