"""One engine server process group on a loopback port: start, health, /proc, stop.

Shared by the vLLM and SGLang launchers (``vllm/_launcher.py``,
``sglang/_launcher.py``), which only build the command line and the
environment. The server runs in its own process group (API server and the
engine's children); :meth:`ServerProcess.stop` terminates the whole group.

Each server gets a private ``TMPDIR`` (a short directory under the system
temporary directory, so unix socket paths inside it stay well under the
107-byte limit). The engines put their own ZMQ ipc sockets and lock files
there (vLLM's ``VLLM_RPC_BASE_PATH`` and SGLang's ipc names default to it) and
leave them behind even on a clean shutdown; :meth:`ServerProcess.stop` removes
the directory once the process group is gone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

import httpx

__all__ = ["ServerProcess", "free_port", "start_server"]

_S = TypeVar("_S", bound="ServerProcess")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A running engine server process group. Owned by the thread that launched it.

    Subclasses name the engine (:attr:`engine_name`, for errors) and the KV
    memfd their stub reserves (:attr:`kv_memfd_name`).
    """

    engine_name = "the engine server"
    kv_memfd_name = ""
    health_poll_s = 0.25
    stop_timeout_s = 20.0
    group_exit_timeout_s = 5.0  # after the SIGKILL: how long stop() waits for the group to end

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        port: int,
        log_path: Path,
        tmp_dir: Path | None = None,
    ) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.tmp_dir = tmp_dir  # the server's private TMPDIR (removed by stop())
        self._started()

    def _started(self) -> None:
        """The process was just started (a subclass notes what it will clean up after)."""

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_text()[-num_chars:]

    def pids(self) -> list[int]:
        """The server process and all its descendants alive now."""
        import psutil  # type: ignore[import-untyped]

        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid, *(child.pid for child in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def kv_memfd_bytes(self, name: str | None = None) -> int:
        """KV memory committed right now, measured from /proc (the memfd's allocated blocks).

        Independent of the engine's own report: finds the KV memfd (default
        :attr:`kv_memfd_name`) among the open files of the server's process
        tree, counting each memfd once however many descriptors it has.
        """
        prefix = f"/memfd:{name or self.kv_memfd_name}"
        total = 0
        seen: set[tuple[int, int]] = set()
        for pid in self.pids():
            try:
                entries = list(Path(f"/proc/{pid}/fd").iterdir())
            except OSError:
                continue
            for entry in entries:
                try:
                    if not os.readlink(entry).startswith(prefix):
                        continue
                    st = os.stat(entry)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; raise with the log tail if the server died or timed out."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.engine_name} exited with {self.proc.returncode} before it was "
                        f"healthy; log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(self.health_poll_s)
        self.stop()
        raise TimeoutError(
            f"{self.engine_name} was not healthy within {timeout_s:.0f}s; log "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the server process only (the engine forwards shutdown)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float | None = None) -> int:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers (the engine's children)
        _wait_group_gone(self.proc.pid, self.group_exit_timeout_s)
        self._after_group_gone()
        return int(self.proc.returncode)

    def _after_group_gone(self) -> None:
        """Every process of the group is gone (or the wait gave up): clean up after them."""
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_server(
    kind: type[_S],
    args: Sequence[str],
    env: Mapping[str, str],
    port: int,
    log: Path,
    timeout_s: float,
    *,
    wait: bool = True,
) -> _S:
    """Start ``args`` in a new process group logging to ``log``, with a private ``TMPDIR``
    (module docstring); wait until healthy."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix="kvs-tmp-"))
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen(
                list(args),
                env={**env, "TMPDIR": str(tmp_dir)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    server = kind(proc, port, log, tmp_dir)
    # a server no one stopped (a caller that dropped it after a kill -9): its TMPDIR goes
    # when this process exits, once the server's process is gone
    atexit.register(_remove_when_ended, proc, tmp_dir)
    if wait:
        try:
            server.wait_healthy(timeout_s)
        except BaseException:
            server.stop()
            raise
    return server


def _remove_when_ended(proc: subprocess.Popen[bytes], tmp_dir: Path) -> None:
    if proc.poll() is not None and not _group_alive(proc.pid):
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (zombies do not count), from /proc."""
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) == pgid and fields[0] != b"Z":  # state, ppid, pgrp
                return True
    return False


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Until no process of group ``pgid`` is alive, or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
