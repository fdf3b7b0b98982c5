"""Launch SGLang's real HTTP server on CPU with the stub forward, on a loopback port.

``launch_sglang_server`` starts ``python -m engine_ext.cpu_harness.sglang.serve``
(kvsidecar's launcher + the harness's stand-ins and stub forward) in its own
process group (HTTP server/tokenizer manager, detokenizer and scheduler
processes), waits for ``/health`` and returns a :class:`SglangServer`;
leaving its ``with`` block (or ``stop()``) terminates the whole group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

__all__ = ["CPU_ENV", "KV_MEMFD", "SglangServer", "launch_sglang_server"]

_REPO_ROOT = Path(__file__).resolve().parents[3]
#: Environment every CPU launch needs (no GPU, no hub).
CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "SGLANG_DISABLE_REQUEST_LOGGING": "1",
}
#: Name of the memfd the adapter reserves SGLang's KV cache on (``reserve_kv``).
KV_MEMFD = "kvsidecar-sglang"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SglangServer:
    """A running SGLang server process group. Owned by the thread that launched it."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"

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

    def kv_memfd_bytes(self, name: str = KV_MEMFD) -> int:
        """KV memory committed right now, measured from /proc (the memfd's allocated blocks).

        Independent of the engine's report: finds the KV memfd among the open
        files of the server's process tree (the scheduler process holds it).
        """
        total = 0
        seen: set[tuple[int, int]] = set()
        for pid in self.pids():
            fd_dir = Path(f"/proc/{pid}/fd")
            try:
                entries = list(fd_dir.iterdir())
            except OSError:
                continue
            for entry in entries:
                try:
                    if not os.readlink(entry).startswith(f"/memfd:{name}"):
                        continue
                    st = os.stat(entry)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:  # one memfd, however many fds
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
                        f"the SGLang server exited with {self.proc.returncode} before it was "
                        f"healthy; log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"the SGLang server was not healthy within {timeout_s:.0f}s; log "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the server process only (SGLang forwards shutdown to its children)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers (scheduler, detokenizer)
        return int(self.proc.returncode)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def launch_sglang_server(
    model_dir: str | Path,
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | Path | None = None,
    max_total_tokens: int = 16384,
    page_size: int = 4,
    timeout_s: float = 600.0,
    wait: bool = True,
) -> SglangServer:
    """Start SGLang's server for ``model_dir`` with the stub forward and wait until healthy.

    ``env`` is added to this process's environment (``KVSIDECAR_INSTANCE_ID``,
    ``KVSIDECAR_SIDECAR_URL``, ...); ``extra_args`` go after the defaults, so
    they win. ``max_total_tokens`` sizes the KV pool (virtual: the adapter maps
    pages on demand). The log goes to ``log_path`` (default: a fresh
    temporary directory). ``wait=False`` returns at once (start-up is slow on
    a loaded machine: measure it with :meth:`SglangServer.wait_healthy`).
    """
    port = port or free_port()
    log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="kvs-sglang-")) / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, **CPU_ENV, **(env or {})}
    existing = child_env.get("PYTHONPATH", "")
    child_env["PYTHONPATH"] = os.pathsep.join([str(_REPO_ROOT)] + ([existing] if existing else []))
    args = [
        sys.executable,
        "-m",
        "engine_ext.cpu_harness.sglang.serve",
        "--model-path",
        str(model_dir),
        "--device",
        "cpu",
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--page-size",
        str(page_size),
        "--max-total-tokens",
        str(max_total_tokens),
        "--max-running-requests",
        "16",
        "--chunked-prefill-size",
        "2048",
        "--context-length",
        "4096",
        "--skip-server-warmup",
        "--log-level",
        "warning",
        *extra_args,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, env=child_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = SglangServer(proc, port, log)
    if wait:
        try:
            server.wait_healthy(timeout_s)
        except BaseException:
            server.stop()
            raise
    return server


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
