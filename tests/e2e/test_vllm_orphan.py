"""``kill -9`` of the real ``vllm serve`` API server: its EngineCore must not live on.

vLLM 0.33's EngineCore has no check of its own for the server that started it:
after the server died by ``kill -9`` (or the OOM killer) the EngineCore and its
rank processes stayed up for good, holding their KV memory and the runtime dir,
and a restart with the same instance id was refused while they lived. With the
extension on, the EngineCore notices (a pidfd of its parent) and ends as on
SIGTERM. Measured from ``/proc``: the processes and the memfd are gone, and so is
the runtime dir.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support import wait_until

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

import psutil

from engine_ext.cpu_harness import launch_vllm_server, make_tiny_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_9_of_the_api_server_ends_its_engine_core_and_ranks(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "model")
    runtime = tmp_path / "run"
    server = launch_vllm_server(
        model_dir,
        env={
            "KVSIDECAR_ENABLE": "1",
            "KVSIDECAR_INSTANCE_ID": "orphan",
            "KVSIDECAR_RUNTIME_DIR": str(runtime),
            "KVSIDECAR_STUB_TP": "2",  # rank processes too: they must end with the core
        },
        extra_args=["--max-num-seqs", "4"],
        log_path=tmp_path / "serve.log",
    )
    try:
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        assert len(tree) >= 3, [p.cmdline() for p in tree]  # EngineCore and two ranks
        assert (runtime / "orphan" / "control.sock").exists()
        os.kill(server.proc.pid, signal.SIGKILL)  # the API server only
        server.proc.wait(timeout=30)
        wait_until(
            lambda: not any(_alive(p.pid) for p in tree),
            timeout_s=60,
            what="the EngineCore and its ranks to end after their API server was killed",
        )
        assert not (runtime / "orphan").exists(), sorted(p.name for p in runtime.rglob("*"))
        assert "is gone; ending this EngineCore" in server.log_tail(200_000)
    finally:
        server.stop()
        for proc in psutil.Process().children(recursive=True):  # nothing of it may linger
            if proc.pid != os.getpid() and "vllm" in " ".join(proc.cmdline()):
                proc.kill()
