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
import sys
import tempfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

from .._server import ServerProcess, free_port, start_server

__all__ = ["STUB_EXECUTOR", "VllmServer", "launch_vllm_server"]

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
    return start_server(VllmServer, args, child_env, port, log, timeout_s)


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
