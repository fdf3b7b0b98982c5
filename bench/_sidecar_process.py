"""``kvsidecar serve`` as a child process for the benches that time it over HTTP.

One copy of what each of them did: a free loopback port, a database in a fresh
directory, the log in a file there (or nowhere), and a wait for ``/healthz``.
Imported as a sibling module (``python bench/NAME.py`` puts ``bench/`` on the path).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine_ext.cpu_harness import free_port

__all__ = ["SidecarProcess"]


class SidecarProcess:
    """Started by the constructor (ready once it returns), stopped by :meth:`stop`."""

    def __init__(
        self, env: Mapping[str, str] | None = None, *, keep_log: bool = True, start_s: float = 60
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-sidecar-"))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self.dir / "sidecar.log"
        full_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "KVSIDECAR_DB_PATH": str(self.dir / "sidecar.db"),
            "KVSIDECAR_PORT": str(port),
            **(env or {}),
        }
        self._log = self.log_path.open("wb") if keep_log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve"],
            env=full_env,
            stdout=self._log,
            stderr=self._log,
        )
        deadline = time.monotonic() + start_s
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                where = f"; log {self.log_path}" if keep_log else ""
                raise SystemExit(f"the sidecar did not start (python -m sidecar.cli serve){where}")
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not isinstance(self._log, int):
            self._log.close()
