"""Launch the real ``vllm serve`` on CPU with the stub executor, on a loopback port.

``launch_vllm_server`` starts ``python -m vllm.entrypoints.cli.main serve`` in
its own process group (API server + EngineCore child), waits for ``/health``
and returns a :class:`VllmServer`; leaving its ``with`` block (or ``stop()``)
terminates the whole group. The kvsidecar plugin is made visible to the
child even when the project is not installed: a ``*.dist-info`` with the
``vllm.general_plugins`` entry point is written next to the log and put on
``PYTHONPATH`` (an installed project already declares it in pyproject.toml).

``async_scheduling=True`` runs vLLM's async-scheduling loop (``AsyncScheduler``,
``step_with_batch_queue``), a GPU server's default, which vLLM's CPU platform turns
off: it selects :data:`STUB_ASYNC_EXECUTOR`, passes ``--async-scheduling`` and
declares the harness's own plugin (``_async_plugin``, enabled by its variable) the
same way, which keeps the flag on and logs the loop the EngineCore built.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

from .._server import ServerProcess, free_port, start_server

__all__ = ["STUB_ASYNC_EXECUTOR", "STUB_EXECUTOR", "VllmServer", "launch_vllm_server"]

_REPO_ROOT = Path(__file__).resolve().parents[3]
_ENTRY_POINT = "kvsidecar = engine_ext.vllm.plugin:register"
#: ``--distributed-executor-backend`` value that selects the stub executor (vLLM imports it).
STUB_EXECUTOR = "engine_ext.cpu_harness.vllm.executor.StubExecutor"
#: The same with async scheduling supported (``launch_vllm_server(async_scheduling=True)``).
STUB_ASYNC_EXECUTOR = "engine_ext.cpu_harness.vllm.executor.StubAsyncExecutor"
#: The harness plugin that keeps async scheduling on, and its switch (``_async_plugin``;
#: named here so the launcher imports no vLLM).
_ASYNC_ENTRY_POINT = "kvsidecar-cpu-harness = engine_ext.cpu_harness.vllm._async_plugin:register"
_ASYNC_ENV = "KVSIDECAR_HARNESS_ASYNC_SCHEDULING"
#: Environment every CPU launch needs (no GPU, no hub).
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


class VllmServer(ServerProcess):
    """A running ``vllm serve`` process group (API server + EngineCore child)."""

    engine_name = "vllm serve"
    kv_memfd_name = "kvsidecar-stub-kv"


def launch_vllm_server(
    model_dir: str | Path,
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | Path | None = None,
    kv_cache_bytes: int = 64 << 20,
    timeout_s: float = 180.0,
    async_scheduling: bool = False,
    wait: bool = True,
) -> VllmServer:
    """Start ``vllm serve MODEL_DIR`` with the stub executor and wait until healthy.

    ``env`` is added to this process's environment (e.g. ``KVSIDECAR_ENABLE=1``,
    ``KVSIDECAR_INSTANCE_ID``); ``extra_args`` go after the defaults, so they win.
    ``kv_cache_bytes`` is the KV capacity (virtual with the plugin on: only used
    pages are mapped; all of it mapped at the first step with the plugin off).
    The log goes to ``log_path`` (default: a fresh temporary directory).
    ``async_scheduling``: run vLLM's async-scheduling loop (module docstring).
    ``wait=False`` returns at once; then call :meth:`VllmServer.wait_healthy`.
    """
    port = port or free_port()
    log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="kvs-vllm-")) / "serve.log"
    child_env = {**os.environ, **CPU_ENV, **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    child_env["PYTHONPATH"] = _pythonpath(
        child_env.get("PYTHONPATH", ""), log.parent, async_scheduling=async_scheduling
    )
    child_env[_ASYNC_ENV] = "true" if async_scheduling else "false"
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
        STUB_ASYNC_EXECUTOR if async_scheduling else STUB_EXECUTOR,
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
        *(["--async-scheduling"] if async_scheduling else []),
        *extra_args,
    ]
    return start_server(VllmServer, args, child_env, port, log, timeout_s, wait=wait)


def _pythonpath(existing: str, scratch: Path, *, async_scheduling: bool) -> str:
    parts = [str(_REPO_ROOT)]
    declared = False
    if not _plugin_installed():
        _declare_plugin(scratch, "kvsidecar_plugin", _ENTRY_POINT)
        declared = True
    if async_scheduling:
        _declare_plugin(scratch, "kvsidecar_cpu_harness", _ASYNC_ENTRY_POINT)
        declared = True
    if declared:
        parts.append(str(scratch))
    return os.pathsep.join(parts + ([existing] if existing else []))


def _declare_plugin(scratch: Path, dist_name: str, entry_point: str) -> None:
    """A ``*.dist-info`` in ``scratch`` declaring ``entry_point`` under ``vllm.general_plugins``."""
    dist = scratch / f"{dist_name}-0.dist-info"
    dist.mkdir(exist_ok=True)
    name = dist_name.replace("_", "-")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{entry_point}\n")


def _plugin_installed() -> bool:
    return any(ep.name == "kvsidecar" for ep in metadata.entry_points(group="vllm.general_plugins"))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
