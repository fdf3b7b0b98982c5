"""``python -m engine_ext.cpu_harness.run_engine`` rejects bad arguments before starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tgi", "--port", "8000"], "invalid choice: 'tgi'"),
        (["vllm"], "the following arguments are required: --port"),
        (["sglang", "--port", "0"], "--port 0: must be 1-65535"),
        (["vllm", "--port", "http"], "invalid int value"),
    ],
)
def test_bad_arguments_exit_2_with_a_message_and_write_no_model(
    args: list[str], message: str, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine_ext.cpu_harness.run_engine",
            *args,
            "--model-dir",
            str(model),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not model.exists()
