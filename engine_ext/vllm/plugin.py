"""The ``vllm.general_plugins`` entry point (declared in pyproject.toml).

vLLM calls :func:`register` once per process (API server, EngineCore,
workers). Off unless ``KVSIDECAR_ENABLE=1``. When on, it checks the vLLM
version against the patch table (refusing to start outside it), applies the
patches, and records the settings; threads and sockets start later, in the
EngineCore process (see ``_runtime``). Module import is cheap and has no side
effects: vLLM logs and *skips* a plugin whose import fails.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["SHUTDOWN_WINDOW_S", "register"]

#: Seconds vLLM's process manager lets the EngineCore run after SIGTERM before it
#: kills it (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``; vLLM 0.33's default is 0: an
#: immediate SIGKILL, which raced the EngineCore's removal of its control socket and
#: runtime dir, seen in CI). An upper bound: the EngineCore exits as soon as it is done.
SHUTDOWN_WINDOW_S = "5"

_log = logging.getLogger("engine_ext.vllm.plugin")


def register() -> None:
    """Enable kvsidecar in this vLLM process if ``KVSIDECAR_ENABLE=1``; idempotent."""
    from engine_ext import load_engine_settings

    engine = load_engine_settings()
    if not engine.enable:
        return
    import vllm

    from engine_ext.vllm._instance_id import export_default_instance_id
    from engine_ext.vllm._patches import apply_patches
    from engine_ext.vllm._runtime import configure
    from engine_ext.vllm._settings import load_vllm_settings

    vllm_settings = load_vllm_settings()  # bad values refuse to start before anything changes
    changed = apply_patches(vllm.__version__).targets
    if engine.instance_id is None:
        export_default_instance_id(sys.argv, os.environ)
        engine = load_engine_settings()
    configure(engine, vllm_settings)
    # the operator's value wins; read by vLLM when the API server shuts its EngineCore down
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", SHUTDOWN_WINDOW_S)
    if changed:
        _log.info(
            "kvsidecar enabled for vLLM %s (patched %s)", vllm.__version__, ", ".join(changed)
        )
