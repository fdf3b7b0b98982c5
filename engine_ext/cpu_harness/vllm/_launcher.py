"""Launch the real ``vllm serve`` on CPU with the stub executor, on a loopback port.

``launch_vllm_server`` starts ``python -m vllm.entrypoints.cli.main serve`` in
its own process group (API server + EngineCore child), waits for ``/health``
and returns a :class:`VllmServer`; leaving its ``with`` block (or ``stop()``)
terminates the whole group. The kvsidecar plugin is made visible to the
child even when the project is not installed: a ``*.dist-info`` with the
``vllm.general_plugins`` entry point is written next to the log and put on
``PYTHONPATH`` (an installed project already declares it in pyproject.toml).
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
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

__all__ = ["STUB_EXECUTOR", "VllmServer", "free_port", "launch_vllm_server"]

_REPO_ROOT = Path(__file__).resolve().parents[3]
_ENTRY_POINT = "kvsidecar = engine_ext.vllm.plugin:register"
#: ``--distributed-executor-backend`` value that selects the stub executor (vLLM imports it).
STUB_EXECUTOR = "engine_ext.cpu_harness.vllm.executor.StubExecutor"
#: Environment every CPU launch needs (no GPU, no hub).
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServer:
    """A running ``vllm serve`` process group. Owned by the thread that launched it."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def kv_memfd_bytes(self, name: str = "kvsidecar-stub-kv") -> int:
        """KV memory committed right now, measured from /proc (the memfd's allocated blocks).

        Independent of the engine's own report: looks for the stub worker's memfd
        among the open files of the server's process tree.
        """
        import psutil  # type: ignore[import-untyped]

        total = 0
        for proc in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]:
            fd_dir = Path(f"/proc/{proc.pid}/fd")
            try:
                entries = list(fd_dir.iterdir())
            except OSError:
                continue
            for entry in entries:
                try:
                    if os.readlink(entry).startswith(f"/memfd:{name}"):
                        total += os.stat(entry).st_blocks * 512
                except OSError:
                    continue
        return total

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; raise with the log tail if the server died or timed out."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"vllm serve exited with {self.proc.returncode} before it was healthy; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        self.stop()
        raise TimeoutError(
            f"vllm serve was not healthy within {timeout_s:.0f}s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers (EngineCore child)
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


def launch_vllm_server(
    model_dir: str | Path,
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | Path | None = None,
    kv_cache_bytes: int = 64 << 20,
    timeout_s: float = 180.0,
) -> VllmServer:
    """Start ``vllm serve MODEL_DIR`` with the stub executor and wait until healthy.

    ``env`` is added to this process's environment (e.g. ``KVSIDECAR_ENABLE=1``,
    ``KVSIDECAR_INSTANCE_ID``); ``extra_args`` go after the defaults, so they win.
    ``kv_cache_bytes`` is the KV capacity (virtual with the plugin on: only used
    pages are mapped; all of it mapped at the first step with the plugin off).
    The log goes to ``log_path`` (default: a fresh temporary directory).
    """
    port = port or free_port()
    log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="kvs-vllm-")) / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, **CPU_ENV, **(env or {})}
    child_env["PYTHONPATH"] = _pythonpath(child_env.get("PYTHONPATH", ""), log.parent)
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--distributed-executor-backend",
        STUB_EXECUTOR,
        "--load-format",
        "dummy",
        "--dtype",
        "float16",
        "--block-size",
        "16",
        "--max-model-len",
        "4096",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--disable-log-stats",
        *extra_args,
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, env=child_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = VllmServer(proc, port, log)
    try:
        server.wait_healthy(timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def _pythonpath(existing: str, scratch: Path) -> str:
    parts = [str(_REPO_ROOT)]
    if not _plugin_installed():
        dist = scratch / "kvsidecar_plugin-0.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kvsidecar-plugin\nVersion: 0\n"
        )
        (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{_ENTRY_POINT}\n")
        parts.append(str(scratch))
    return os.pathsep.join(parts + ([existing] if existing else []))


def _plugin_installed() -> bool:
    return any(ep.name == "kvsidecar" for ep in metadata.entry_points(group="vllm.general_plugins"))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
