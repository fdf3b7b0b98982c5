"""Every ``curl`` and ``kvctl`` line of README.md, run against a live sidecar and engine.

The engine is the real ``vllm serve`` on the CPU harness, registered as
``llama-a`` (the id the README uses); only the sidecar's address is rewritten.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
README_URL = "http://127.0.0.1:8570"


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    lines = [ln.strip() for b in blocks for ln in b.splitlines()]
    return [ln for ln in lines if ln.startswith(("curl ", "kvctl "))]


def test_readme_has_the_tour() -> None:
    cmds = readme_commands()
    assert sum(c.startswith("curl ") for c in cmds) >= 4
    assert sum(c.startswith("kvctl ") for c in cmds) >= 4


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from engine_ext.cpu_harness import free_port, launch_vllm_server, make_tiny_model_dir

    work = tmp_path_factory.mktemp("readme")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KVSIDECAR_TOKEN", None)
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sidecar.cli",
            "serve",
            "--port",
            str(port),
            "--db",
            str(work / "sidecar.db"),
        ],
        env=env,
        start_new_session=True,
    )
    try:
        _wait_http(url + "/healthz")
        engine_env = {
            "KVSIDECAR_ENABLE": "1",
            "KVSIDECAR_INSTANCE_ID": "llama-a",
            "KVSIDECAR_DEVICE_ID": "host0",  # the README's autopilot section
            "KVSIDECAR_SIDECAR_URL": url,
            "KVSIDECAR_HEARTBEAT_S": "1",
            "KVSIDECAR_RUNTIME_DIR": str(work / "run"),
        }
        with launch_vllm_server(
            make_tiny_model_dir(work / "model"), env=engine_env, log_path=work / "engine.log"
        ) as server:
            # a little prefix cache so the limits have something to reclaim
            httpx.post(
                server.base_url + "/v1/completions",
                timeout=60,
                json={"model": str(work / "model"), "prompt": "hello " * 300, "max_tokens": 4},
            )
            _wait_http(url + "/instances/llama-a")
            yield url
    finally:
        sidecar.terminate()
        sidecar.wait(15)


def _wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@pytest.mark.parametrize("command", readme_commands())
def test_readme_line_works(live: str, command: str) -> None:
    argv = shlex.split(command.replace(README_URL, live))
    if argv[0] == "curl":
        argv = ["curl", "--fail-with-body", "--max-time", "30", *argv[1:]]
    elif shutil.which("kvctl") is None:
        argv = [sys.executable, "-m", "sidecar.kvctl", *argv[1:]]
    env = {**os.environ, "KVSIDECAR_URL": live, "PYTHONPATH": str(REPO)}
    env.pop("KVSIDECAR_TOKEN", None)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, (
        f"{command!r} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
