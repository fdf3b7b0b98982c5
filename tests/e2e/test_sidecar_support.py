"""Helpers for the sidecar e2e tests (no tests here): real servers on loopback / unix sockets.

* :class:`ThreadedSidecar` (from ``tests/support``): the real app in a thread;
* :class:`SidecarProcess` runs ``kvsidecar serve`` as a child process (for ``kill -9``);
* :class:`SocketEngine` is the real engine control socket (:class:`engine_ext.ControlServer`)
  and mailbox, with the engine thread's pass played by the test.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

import httpx
from support import ThreadedSidecar, free_port  # noqa: F401 -- re-exported for the sidecar tests

from engine_ext import ControlServer, LimitMailbox, PublishResult
from engine_ext.protocol import EngineState, RegisterBody, Status

ROOT = Path(__file__).resolve().parents[2]


class SidecarProcess:
    """``python -m sidecar.cli serve`` as a child process on a fixed port.

    ``port``: a given port (a restarted sidecar where its engines look for it);
    ``log_path``: its stderr goes to that file (read into :attr:`stderr` at the
    end) instead of a pipe, for a long-lived sidecar that logs more than a pipe holds.
    """

    def __init__(
        self,
        db: Path,
        env: dict[str, str] | None = None,
        *,
        port: int | None = None,
        log_path: Path | None = None,
        wrapper: list[str] | None = None,
    ) -> None:
        self.db = db
        self.wrapper = wrapper or []  # a command the server runs under (it execs its args)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr = ""  # what the process wrote on stderr, once it has ended

    def start(self) -> SidecarProcess:
        log = None if self.log_path is None else self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                *self.wrapper,
                sys.executable,
                "-m",
                "sidecar.cli",
                "serve",
                "--port",
                str(self.port),
                "--db",
                str(self.db),
            ],
            env=self.env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if log is None else log,
        )
        if log is not None:
            log.close()  # the child has its own descriptor
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                self._reap()
                raise RuntimeError(self.stderr)
            if time.monotonic() > deadline:
                raise RuntimeError("kvsidecar serve did not answer /healthz")
            time.sleep(0.05)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self._reap()

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s), then collect stderr into :attr:`stderr`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reap()

    def _reap(self) -> None:
        """The process has ended: read its stderr pipe to the end and close it (an open
        pipe left to the garbage collector is a ResourceWarning, an error in the tests)."""
        assert self.proc is not None
        pipe = self.proc.stderr
        if pipe is not None and not pipe.closed:
            self.stderr += pipe.read().decode(errors="replace")
            pipe.close()
        elif self.log_path is not None and self.log_path.exists():
            self.stderr = self.log_path.read_text(errors="replace")


def db_rows(db: Path) -> list[tuple[Any, ...]]:
    """Every row of the instances table, read straight from the file (read-only)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT * FROM instances ORDER BY id").fetchall()
    finally:
        conn.close()


class _RecordingMailbox(LimitMailbox):
    """The real mailbox, plus a record of every publish (what the sidecar pushed)."""

    def __init__(self) -> None:
        super().__init__()
        self.pushes: list[tuple[int | None, int]] = []
        self.pushed = threading.Event()
        self.hold: threading.Event | None = None  # when set: a push waits for it (slow engine)
        self.holding = threading.Event()  # a push is being held

    def publish(self, limit_bytes: int | None, revision: int) -> PublishResult:
        hold = self.hold
        if hold is not None:
            self.holding.set()
            hold.wait(30)
        result = super().publish(limit_bytes, revision)
        self.pushes.append((limit_bytes, revision))
        self.pushed.set()
        return result


class SocketEngine:
    """The real engine control socket and mailbox; :meth:`engine_pass` plays the engine thread.

    ``mapped_bytes`` is what the fake engine maps; a pass takes the newest target
    and reports ``applied`` when mapped fits under it, else ``deferred``.
    """

    def __init__(self, socket_path: Path, mapped_bytes: int, device_total_bytes: int) -> None:
        self.socket_path = socket_path
        self.mailbox = _RecordingMailbox()
        self.mapped_bytes = mapped_bytes
        self.device_total_bytes = device_total_bytes
        self.passes = 0  # counted like the real coordinator: the sidecar orders reports by it
        self.server = ControlServer(str(socket_path), self.mailbox)
        self.mailbox.set_state(
            EngineState(
                status=Status.APPLIED, mapped_bytes=mapped_bytes, capacity_bytes=device_total_bytes
            )
        )

    def __enter__(self) -> Self:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def register_body(self) -> dict[str, Any]:
        return json.loads(
            RegisterBody(
                engine="test",
                engine_version="0",
                socket_path=str(self.socket_path),
                device_total_bytes=self.device_total_bytes,
                state=self.mailbox.latest_state,
            ).model_dump_json()
        )

    def engine_pass(self, *, mapped_bytes: int | None = None) -> EngineState:
        """Take the newest target, 'evict' down to ``mapped_bytes``, return the new state."""
        if mapped_bytes is not None:
            self.mapped_bytes = mapped_bytes
        self.mailbox.take()
        self.passes += 1
        target = self.mailbox.desired
        over = 0 if target.limit_bytes is None else max(0, self.mapped_bytes - target.limit_bytes)
        state = EngineState(
            status=Status.DEFERRED if over else Status.APPLIED,
            revision=target.revision,
            limit_bytes=target.limit_bytes,
            mapped_bytes=self.mapped_bytes,
            overage_bytes=over,
            reason="evicting" if over else None,
            capacity_bytes=self.device_total_bytes,
            passes=self.passes,
        )
        self.mailbox.set_state(state)
        return state
