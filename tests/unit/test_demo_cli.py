"""``kvsidecar demo`` rejects bad arguments before starting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--idle-s", "-1"], "--idle-s must be >= 0"),
        (["--idle-s", "soon"], "invalid float value"),
        (["--autopilot", "--output-tokens", "0"], "--output-tokens must be between 1 and 2048"),
        (["--output-tokens", "5000"], "--output-tokens must be between 1 and 2048"),
        (["--output-tokens", "many"], "invalid int value"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_demo_arguments_fail_fast_with_a_message(
    args: list[str], message: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (out / "demo-results.json").exists()  # nothing ran


def test_an_output_directory_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    """``--out /proc/nope`` ended in a FileNotFoundError traceback (80 lines)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in ("/proc/kvsidecar-nope", str(blocker / "out")):
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "demo", "--quick", "--out", out],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"kvsidecar demo: cannot create --out {out!r}: ")


def test_demo_help_lists_its_options() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--out", "--idle-s", "--quick", "--keep-workdir"):
        assert option in proc.stdout


# Runs the real CLI in a process where vllm, sglang and torch cannot be imported, as in an
# install of kvsidecar without the demo's extras (a meta-path finder that refuses those names).
_WITHOUT_ENGINES = """
import importlib.abc, sys
ABSENT = sys.argv[2].split(',')
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ABSENT:
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, _Absent())
from sidecar.cli import main
sys.argv = ['kvsidecar', 'demo', '--out', sys.argv[1]]
main()
"""


@pytest.mark.parametrize(
    ("absent", "named", "not_named"),
    [
        (
            "vllm,sglang,torch",
            ["vLLM 0.33 (vllm)", "SGLang 0.5.23 (sglang)", "PyTorch (torch)"],
            [],
        ),
        ("sglang", ["SGLang 0.5.23 (sglang)"], ["vLLM 0.33 (vllm)", "PyTorch (torch)"]),
    ],
)
def test_demo_without_its_dependencies_says_what_to_install_and_leaves_nothing(
    tmp_path: Path, absent: str, named: list[str], not_named: list[str]
) -> None:
    out = tmp_path / "out"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ENGINES, str(out), absent],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert all(n in proc.stderr for n in named), proc.stderr
    assert not any(n in proc.stderr for n in not_named), proc.stderr
    assert "pip install 'kvsidecar[vllm,sglang]'" in proc.stderr
    assert "scripts/dev.sh demo" in proc.stderr
    assert not out.exists() and list(scratch.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]
