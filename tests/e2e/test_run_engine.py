"""``python -m engine_ext.cpu_harness.run_engine vllm`` (what compose/cpu-demo.yml's ``live``
services run): healthy, registered with the sidecar under its instance id, serves the
model as ``tiny``, and SIGTERM (or SIGHUP) stops the whole engine process group with exit
code 0.

The SGLang side runs the same launcher as ``tests/e2e/test_sglang_serve.py``; only the
vLLM engine is started here (an SGLang server costs minutes of start-up).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil  # type: ignore[import-untyped]
import pytest
from support import wait_until
from support.hangup import with_default_hangup

from engine_ext.cpu_harness import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_run_engine_serves_registers_and_stops_on_sigterm(
    tmp_path: Path, module_sidecar_url: str, signum: int
) -> None:
    """SIGHUP too (the terminal it was started from closing): by default it ended the
    launcher at once, and the engine, in a session of its own, ran on."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KVSIDECAR_ENABLE": "1",
        "KVSIDECAR_INSTANCE_ID": "vllm-a",
        "KVSIDECAR_SIDECAR_URL": module_sidecar_url,
        "KVSIDECAR_RUNTIME_DIR": str(tmp_path / "run" / "vllm-a"),
        "KVSIDECAR_HEARTBEAT_S": "1",
    }
    cmd = [sys.executable, "-m", "engine_ext.cpu_harness.run_engine", "vllm", "--port", str(port)]
    proc = subprocess.Popen(  # SIGHUP at its default, as from a terminal, even under nohup
        with_default_hangup([*cmd, "--model-dir", str(tmp_path / "model")]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    engine_pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until healthy (or the launcher failed)
        assert f"vllm engine healthy on 127.0.0.1:{port}" in line, line + proc.stdout.read()
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "alpha beta gamma", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        view = wait_until(
            lambda: httpx.get(f"{module_sidecar_url}/instances/vllm-a").json().get("observed"),
            timeout_s=60,
            what="vllm-a registered with the sidecar",
        )
        assert view["mapped_bytes"] > 0
        engine_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert engine_pids
        proc.send_signal(signum)
        assert proc.wait(timeout=120) == 0
        wait_until(
            lambda: not any(psutil.pid_exists(p) and _alive(p) for p in engine_pids),
            timeout_s=60,
            what="every engine process exited",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        for pid in engine_pids:  # a launcher that failed to stop them leaves them to no one
            if psutil.pid_exists(pid) and _alive(pid):
                psutil.Process(pid).kill()


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
