"""Ctrl-C during ``kvsidecar demo``: it stops at once, says so, and leaves nothing behind.

A terminal's Ctrl-C reaches the demo's own process group only; the engines and the
sidecar run in process groups of their own, so the demo must stop them itself.
Measured from ``/proc`` (processes, ``/tmp``, ``/dev/shm``), not from the demo's word.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest
from demo_support import REPO
from support import wait_until
from support.hangup import with_default_hangup

_STOP_BOUND_S = 15.0  # the engines' SIGTERM grace after Ctrl-C is 2 s; vLLM's own is 20 s


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _engines_starting(demo: psutil.Process) -> bool:
    lines = []
    for child in demo.children(recursive=True):
        try:
            lines.append(" ".join(child.cmdline()))
        except psutil.Error:
            continue
    return any("vllm.entrypoints" in line for line in lines) and any(
        "cpu_harness.sglang.serve" in line for line in lines
    )


def _temp_entries() -> set[str]:
    tmp = Path(tempfile.gettempdir())
    found = {str(p) for p in tmp.iterdir() if p.name.startswith(("kvs-tmp-", "kvsidecar-demo-"))}
    shm = Path("/dev/shm")
    if shm.is_dir():
        found |= {str(p) for p in shm.iterdir() if p.name.startswith("sglang_loads_")}
    return found


@pytest.mark.parametrize("how", ["ctrl-c", "kill", "hangup"])
def test_ctrl_c_while_the_engines_start_stops_everything_at_once(tmp_path: Path, how: str) -> None:
    """Ctrl-C (SIGINT to the demo's group), ``kill`` (SIGTERM to the demo alone) and a
    closing terminal (SIGHUP to its group) all stop everything. SIGTERM and SIGHUP ended
    the demo at once before, and its engines and sidecar, in sessions of their own, ran
    on for good."""
    before = _temp_entries()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    out = tmp_path / "out"
    with subprocess.Popen(
        # SIGHUP at its default, as from a terminal, even if this run ignores it (nohup)
        with_default_hangup(
            [sys.executable, "-m", "sidecar.cli", "demo", "--quick", "--out", str(out)]
        ),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, as a shell's foreground job
    ) as proc:
        demo = psutil.Process(proc.pid)
        try:
            wait_until(lambda: _engines_starting(demo), timeout_s=120, what="both engines started")
            time.sleep(2)  # into their start-up (vLLM ignores SIGTERM while EngineCore starts)
            started = [p for p in demo.children(recursive=True) if _alive(p)]
            if how == "ctrl-c":
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the demo's group only
            elif how == "kill":
                os.kill(proc.pid, signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGHUP)  # a closing terminal: its foreground group
            t0 = time.monotonic()
            output, _ = proc.communicate(timeout=60)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            for child in demo.children(recursive=True) if proc.poll() is None else []:
                child.kill()
    try:
        assert proc.returncode != 0, output[-3000:]
        assert "interrupted" in output, output[-3000:]
        assert took < _STOP_BOUND_S, f"the demo took {took:.1f}s to stop after Ctrl-C"
        time.sleep(0.5)  # the engines' children, SIGKILLed, are reaped by init
        survivors = [p for p in started if _alive(p)]
        assert survivors == [], [" ".join(p.cmdline()) for p in survivors]
        left = sorted(_temp_entries() - before)
        assert left == [], left
    finally:  # a demo that failed to stop them must not leave them to the next tests
        for survivor in started:
            if _alive(survivor):
                survivor.kill()
