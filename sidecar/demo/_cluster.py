"""The demo's processes: one sidecar and the vLLM CPU-harness engines.

Everything is a real process talking HTTP on loopback: the sidecar is
``kvsidecar serve`` on a temporary SQLite file, each engine is the real
``vllm serve`` (EngineCore busy loop, stub executor, KV cache on the host
backend) with the kvsidecar plugin enabled and registered with the sidecar.
Owned by the demo's main thread; ``close()`` tears every process group down.
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
from typing import Any

import httpx

from engine_ext.cpu_harness import VllmServer, free_port, launch_vllm_server

__all__ = ["Cluster", "EngineSpec"]


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine of the demo."""

    instance_id: str
    reclaim: bool  # False: the baseline "what a user of the old tool saw"
    kv_cache_bytes: int  # virtual KV capacity of the engine
    device_id: str | None = None  # KVSIDECAR_DEVICE_ID (the autopilot scenario's host device)


class Cluster:
    """A sidecar plus engines, all on loopback, all torn down by ``close()``."""

    def __init__(self, workdir: Path, model_dir: Path) -> None:
        self.workdir = workdir
        self.model_dir = model_dir
        self.sidecar_port = free_port()
        self.sidecar_url = f"http://127.0.0.1:{self.sidecar_port}"
        self.engines: dict[str, VllmServer] = {}
        self._sidecar: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(timeout=60.0)

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
        """Start engines in parallel; each registers with the sidecar."""
        with ThreadPoolExecutor(max_workers=len(specs)) as pool:
            futures = [(spec, pool.submit(self._launch, spec)) for spec in specs]
        failed: BaseException | None = None
        for spec, future in futures:  # keep every server that started, so close() stops it
            try:
                self.engines[spec.instance_id] = future.result()
            except Exception as exc:  # noqa: BLE001 -- re-raised below, after bookkeeping
                failed = failed or exc
        if failed is not None:
            raise failed
        for spec in specs:
            self.wait_registered(spec.instance_id)

    def _launch(self, spec: EngineSpec) -> VllmServer:
        env = {
            "KVSIDECAR_ENABLE": "1",
            "KVSIDECAR_INSTANCE_ID": spec.instance_id,
            "KVSIDECAR_SIDECAR_URL": self.sidecar_url,
            "KVSIDECAR_RUNTIME_DIR": str(self.workdir / "run" / spec.instance_id),
            "KVSIDECAR_RECLAIM": "1" if spec.reclaim else "0",
            "KVSIDECAR_HEARTBEAT_S": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # exposes POST /reset_prefix_cache
        }
        if spec.device_id is not None:
            env["KVSIDECAR_DEVICE_ID"] = spec.device_id
        return launch_vllm_server(
            self.model_dir,
            env=env,
            kv_cache_bytes=spec.kv_cache_bytes,
            log_path=self.workdir / f"{spec.instance_id}.log",
            extra_args=["--max-num-seqs", "8"],
            timeout_s=300.0,
        )

    def stop_engine(self, instance_id: str) -> None:
        self.engines.pop(instance_id).stop()

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

    def reset_prefix_cache(self, instance_id: str) -> None:
        server = self.engines[instance_id]
        reply = self.http.post(server.base_url + "/reset_prefix_cache")
        if reply.status_code != 200:
            raise RuntimeError(
                f"{instance_id}: reset_prefix_cache {reply.status_code}: {reply.text}"
            )

    def close(self) -> None:
        for instance_id in list(self.engines):
            self.stop_engine(instance_id)
        if self._sidecar is not None and self._sidecar.poll() is None:
            os.killpg(self._sidecar.pid, signal.SIGTERM)
            try:
                self._sidecar.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self._sidecar.pid, signal.SIGKILL)
                self._sidecar.wait()
        self.http.close()
