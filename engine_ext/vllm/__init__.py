"""kvsidecar's vLLM 0.33 adapter.

* :func:`register` -- the ``vllm.general_plugins`` entry point
  (``engine_ext.vllm.plugin:register``, declared in pyproject.toml): checks the
  version, applies the patch table, records the settings.
* :class:`VllmSettings` / :func:`load_vllm_settings` -- what only this adapter
  reads (``KVSIDECAR_*``).
* :class:`KVMemory`, :func:`publish_kv_memory`, :func:`clear_kv_memory` -- the
  hand-off of the worker's KV reservation to the elastic block pool: a worker
  that runs in the EngineCore process (vLLM's on GPU, the CPU harness's stub,
  ``engine_ext.cpu_harness``) publishes its reservation here before the
  scheduler is built.

This package's ``__init__`` imports nothing from vLLM, so it is cheap to import.
"""

from __future__ import annotations

from engine_ext.vllm._kv_memory import KVMemory, clear_kv_memory, publish_kv_memory
from engine_ext.vllm._settings import VllmSettings, load_vllm_settings
from engine_ext.vllm.plugin import register

__all__ = [
    "KVMemory",
    "VllmSettings",
    "clear_kv_memory",
    "load_vllm_settings",
    "publish_kv_memory",
    "register",
]
