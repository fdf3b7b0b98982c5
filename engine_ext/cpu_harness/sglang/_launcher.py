"""Launch SGLang's real HTTP server on CPU with the stub forward, on a loopback port.

``launch_sglang_server`` starts ``python -m engine_ext.cpu_harness.sglang.serve``
(kvsidecar's launcher + the harness's stand-ins and stub forward) in its own
process group (HTTP server/tokenizer manager, detokenizer and scheduler
processes), waits for ``/health`` and returns a :class:`SglangServer`;
leaving its ``with`` block (or ``stop()``) terminates the whole group.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._server import ServerProcess, free_port, start_server

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


#: SGLang 0.5's load-snapshot files (``managers/load_snapshot.py``): one per server, named
#: after a random instance id, never unlinked by the server itself (its CI sweeps them).
_LOADS_SHM_PREFIX = "sglang_loads_"
_SHM_DIR = Path("/dev/shm")


class SglangServer(ServerProcess):
    """A running SGLang server process group (HTTP server/tokenizer manager, detokenizer,
    scheduler).

    :meth:`stop` also unlinks the load-snapshot file the server left in ``/dev/shm``: any
    such file that appeared while it ran and that no live process holds open or mapped
    (another server's is held by its writer for that server's whole life).
    """

    engine_name = "the SGLang server"
    kv_memfd_name = KV_MEMFD
    health_poll_s = 0.5
    stop_timeout_s = 30.0

    def _started(self) -> None:
        self._shm_before = _loads_shm()

    def created_shm(self) -> set[Path]:
        """The load-snapshot files in ``/dev/shm`` that appeared since this server started."""
        return _loads_shm() - self._shm_before

    def _after_group_gone(self) -> None:
        super()._after_group_gone()
        new = self.created_shm()
        if not new:
            return
        held = _held_paths({str(path) for path in new})
        for path in new - {Path(p) for p in held}:
            path.unlink(missing_ok=True)


def _loads_shm() -> set[Path]:
    try:
        return {
            _SHM_DIR / name for name in os.listdir(_SHM_DIR) if name.startswith(_LOADS_SHM_PREFIX)
        }
    except OSError:
        return set()


def _held_paths(paths: set[str]) -> set[str]:
    """Those of ``paths`` some live process holds open (``/proc/*/fd``) or mapped
    (``/proc/*/maps``)."""
    held: set[str] = set()
    with os.scandir("/proc") as entries:
        pids = [entry.name for entry in entries if entry.name.isdigit()]
    for pid in pids:
        try:
            with os.scandir(f"/proc/{pid}/fd") as fds:
                for fd in fds:
                    try:
                        target = os.readlink(fd.path)
                    except OSError:
                        continue
                    if target in paths:
                        held.add(target)
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    if "/dev/shm/" in line:
                        target = line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)")
                        if target in paths:
                            held.add(target)
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return held


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
    return start_server(SglangServer, args, child_env, port, log, timeout_s, wait=wait)
