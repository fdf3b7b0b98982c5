"""The demo's processes: one sidecar and the vLLM and SGLang CPU-harness engines.

Everything is a real process talking HTTP on loopback: the sidecar is
``kvsidecar serve`` on a temporary SQLite file; a vLLM engine is the real
``vllm serve`` (EngineCore busy loop, stub executor), an SGLang engine is
SGLang's real server (HTTP server, tokenizer manager, ``Scheduler`` event
loop, stub forward) started through kvsidecar's launcher. Both keep their KV
cache on the host backend (a memfd measured in ``/proc``) and register with
the sidecar. Owned by the demo's main thread; ``close()`` tears every process
group down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from engine_ext.cpu_harness import (
    ServerProcess,
    free_port,
    launch_sglang_server,
    launch_vllm_server,
)

__all__ = ["Cluster", "EngineKind", "EngineSpec"]

EngineKind = Literal["vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine of the demo."""

    instance_id: str
    reclaim: bool  # False: the baseline "what a user of the old tool saw"
    kv_cache_bytes: int  # virtual KV capacity of a vLLM engine (SGLang: SGLANG_MAX_TOTAL_TOKENS)
    device_id: str | None = None  # KVSIDECAR_DEVICE_ID (the autopilot scenario's host device)
    engine: EngineKind = "vllm"


#: KV capacity of an SGLang engine, in tokens (virtual: pages are mapped on demand);
#: 1 KiB per token with the tiny model, so 16 MiB like the vLLM engines' order of size.
SGLANG_MAX_TOTAL_TOKENS = 16384


class Cluster:
    """A sidecar plus engines, all on loopback, all torn down by ``close()``."""

    def __init__(self, workdir: Path, model_dir: Path) -> None:
        self.workdir = workdir
        self.model_dir = model_dir
        self.sidecar_port = free_port()
        self.sidecar_url = f"http://127.0.0.1:{self.sidecar_port}"
        self.engines: dict[str, ServerProcess] = {}
        self.kinds: dict[str, EngineKind] = {}  # instance -> "vllm" | "sglang"
        self._sidecar: subprocess.Popen[bytes] | None = None
        # a pooled connection is dropped after 2 s idle, before any server here closes it
        # (uvicorn's keep-alive: 5 s in vllm serve, and httpx's default expiry is also
        # 5 s): reusing one the server is closing fails with "Server disconnected"
        self.http = httpx.Client(timeout=60.0, limits=httpx.Limits(keepalive_expiry=2.0))

    # -- sidecar -----------------------------------------------------------
    def start_sidecar(self, timeout_s: float = 30.0) -> None:
        env = {
            **os.environ,
            "KVSIDECAR_HEARTBEAT_TIMEOUT_S": "30",
            # the autopilot scenario's bursts last seconds: react within a few passes
            "KVSIDECAR_AUTOPILOT_INTERVAL_S": "0.1",
            "KVSIDECAR_AUTOPILOT_BUSY_HOLD_S": "0.5",
        }
        env.pop("KVSIDECAR_TOKEN", None)
        with (self.workdir / "sidecar.log").open("wb") as log:  # the child keeps its own fd
            self._sidecar = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sidecar.cli",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.sidecar_port),
                    "--db",
                    str(self.workdir / "sidecar.db"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._sidecar.poll() is not None:
                raise RuntimeError(f"the sidecar exited; see {self.workdir / 'sidecar.log'}")
            try:
                if self.http.get(self.sidecar_url + "/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the sidecar was not healthy within {timeout_s:.0f}s")

    # -- engines -----------------------------------------------------------
    def start_engines(self, specs: list[EngineSpec]) -> None:
        """Start engines side by side; each registers with the sidecar.

        Each process is started and booked in :attr:`engines` at once, then waited for
        here, on the calling thread: an interrupt (Ctrl-C) or a failed start leaves every
        started engine to :meth:`close`, none still starting on a thread of its own.
        """
        for spec in specs:
            self.engines[spec.instance_id] = self._launch(spec)
            self.kinds[spec.instance_id] = spec.engine
        for spec in specs:
            self.engines[spec.instance_id].wait_healthy(self._start_timeout_s(spec))
        for spec in specs:
            self.wait_registered(spec.instance_id)

    @staticmethod
    def _start_timeout_s(spec: EngineSpec) -> float:
        return 900.0 if spec.engine == "sglang" else 300.0  # SGLang: minutes on 2 cores

    def _launch(self, spec: EngineSpec) -> ServerProcess:
        env = {
            "KVSIDECAR_ENABLE": "1",
            "KVSIDECAR_INSTANCE_ID": spec.instance_id,
            "KVSIDECAR_SIDECAR_URL": self.sidecar_url,
            "KVSIDECAR_RUNTIME_DIR": str(self.workdir / "run" / spec.instance_id),
            "KVSIDECAR_RECLAIM": "1" if spec.reclaim else "0",
            "KVSIDECAR_HEARTBEAT_S": "1",
        }
        if spec.device_id is not None:
            env["KVSIDECAR_DEVICE_ID"] = spec.device_id
            # on a budgeted device a running request must not outgrow its limit
            # (docs/limits.md, "Output reservation")
            env["KVSIDECAR_RESERVE_OUTPUT"] = "1"
        if spec.engine == "sglang":
            # event_loop_normal, as docs/sglang.md's measured rows; start-up is minutes on 2 cores
            return launch_sglang_server(
                self.model_dir,
                env=env,
                extra_args=["--disable-overlap-schedule", "--max-running-requests", "8"],
                log_path=self.workdir / f"{spec.instance_id}.log",
                max_total_tokens=SGLANG_MAX_TOTAL_TOKENS,
                timeout_s=self._start_timeout_s(spec),
                wait=False,
            )
        env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes POST /reset_prefix_cache
        return launch_vllm_server(
            self.model_dir,
            env=env,
            kv_cache_bytes=spec.kv_cache_bytes,
            log_path=self.workdir / f"{spec.instance_id}.log",
            extra_args=["--max-num-seqs", "8"],
            timeout_s=self._start_timeout_s(spec),
            wait=False,
        )

    def stop_engines(self, instance_ids: list[str], grace_s: float | None = None) -> None:
        """Stop engines in parallel (an SGLang server takes seconds to end its processes);
        ``grace_s``: SIGKILL after this long (default: each server's own stop timeout)."""
        servers = [self.engines.pop(i) for i in instance_ids if i in self.engines]
        for i in instance_ids:
            self.kinds.pop(i, None)
        if servers:
            with ThreadPoolExecutor(max_workers=len(servers)) as pool:
                list(pool.map(lambda s: s.stop(grace_s), servers))

    def proc_bytes(self, instance_id: str) -> int:
        """The engine's KV memory committed now, from ``/proc`` (its memfd's allocated blocks)."""
        return self.engines[instance_id].kv_memfd_bytes()

    def wait_registered(self, instance_id: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.http.get(f"{self.sidecar_url}/instances/{instance_id}")
            if reply.status_code == 200 and reply.json().get("observed"):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{instance_id} did not register with the sidecar in {timeout_s:.0f}s")

    # -- REST --------------------------------------------------------------
    def instance(self, instance_id: str) -> dict[str, Any]:
        reply = self.http.get(f"{self.sidecar_url}/instances/{instance_id}")
        reply.raise_for_status()
        body: dict[str, Any] = reply.json()
        return body

    def put_limit(self, instance_id: str, limit: int | None, wait_s: float = 0) -> dict[str, Any]:
        """PUT a limit; with ``wait_s`` long-poll until applied (202 at the deadline is fine)."""
        params = {"wait": str(wait_s)} if wait_s else None
        reply = self.http.put(
            f"{self.sidecar_url}/instances/{instance_id}/limit",
            json={"limit": limit},
            params=params,
        )
        if reply.status_code >= 400:
            raise RuntimeError(f"PUT limit {instance_id}: {reply.status_code} {reply.text}")
        body: dict[str, Any] = reply.json()
        return body

    def complete(self, instance_id: str, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
        server = self.engines[instance_id]
        reply = self.http.post(
            server.base_url + "/v1/completions",
            json={
                "model": str(self.model_dir),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
            },
        )
        if reply.status_code != 200:
            raise RuntimeError(
                f"{instance_id}: completion failed {reply.status_code}: {reply.text}"
            )
        body: dict[str, Any] = reply.json()
        return body

    def reset_prefix_cache(self, instance_id: str, timeout_s: float = 30.0) -> None:
        """Empty the engine's prefix cache (vLLM ``/reset_prefix_cache``, SGLang ``/flush_cache``).

        SGLang refuses a flush while requests are still finishing: retried until ``timeout_s``.
        """
        server = self.engines[instance_id]
        path = "/flush_cache" if self.kinds[instance_id] == "sglang" else "/reset_prefix_cache"
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.http.post(server.base_url + path)
            if reply.status_code == 200:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{instance_id}: {path} {reply.status_code}: {reply.text}")
            time.sleep(0.2)

    def close(self, engine_grace_s: float | None = None) -> None:
        self.stop_engines(list(self.engines), engine_grace_s)
        if self._sidecar is not None and self._sidecar.poll() is None:
            os.killpg(self._sidecar.pid, signal.SIGTERM)
            try:
                self._sidecar.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self._sidecar.pid, signal.SIGKILL)
                self._sidecar.wait()
        self.http.close()
