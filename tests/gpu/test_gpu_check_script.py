"""``scripts/gpu-check.sh`` runs in CI against the stand-in driver: driver rows PASS, kernel
rows SKIP with the reason, exit status 0 (on a GPU machine run the script itself)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import fakecuda
import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER_ROWS = (
    "free memory falls and rises with pages",
    "data survives other pages' unmapping",
    "map/unmap latency per 2 MiB page",
    "map/unmap latency per 36-layer bundle",
)
GPU_ROWS = (
    "torch views read and write",
    "attention via block table, others unmapped",
    "CUDA graph replays after unmapping",
    "unmap under queued kernels (fence)",
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_gpu_check_on_the_stand_in_driver() -> None:
    standin = fakecuda.active()
    if standin is None:
        pytest.skip(f"needs the stand-in CUDA driver: {fakecuda.why_not()}")
    proc = _run("--fake-driver", str(standin.path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {
        cells[0]: cells[1:]
        for line in proc.stdout.splitlines()[1:-1]
        for cells in [re.split(r"\s{2,}", line, maxsplit=2)]
    }
    for name in DRIVER_ROWS:
        assert rows[name][0] == "PASS", (name, rows[name])
    for name in GPU_ROWS:
        assert rows[name] == ["SKIP", "GPU only: the stand-in driver runs no kernels"], name
    assert "kvcached A100 per page" in rows["map/unmap latency per 2 MiB page"][1]


def test_gpu_check_without_a_driver_says_why_and_exits_2(tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['cuda'] = None; sys.argv = ['gpu_check']; "
        "sys.path.insert(0, sys.argv[0] or '.'); import runpy; "
        f"runpy.run_path({str(REPO / 'scripts' / 'gpu_check.py')!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot reserve a CudaBackend" in proc.stderr and "cuda-python" in proc.stderr
