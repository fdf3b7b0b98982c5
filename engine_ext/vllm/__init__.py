"""kvsidecar's vLLM 0.33 adapter.

Entry points: ``engine_ext.vllm.plugin:register`` (the ``vllm.general_plugins``
entry point) and ``engine_ext.vllm.cpu_harness`` (CPU serving harness). This
package's ``__init__`` imports nothing from vLLM, so it is cheap to import.
"""

from __future__ import annotations

from engine_ext.vllm._launcher import VllmServer, free_port, launch_vllm_server
from engine_ext.vllm._settings import VllmSettings
from engine_ext.vllm._tiny_model import TinyModelSpec, make_document, make_tiny_model_dir

__all__ = [
    "TinyModelSpec",
    "VllmServer",
    "VllmSettings",
    "free_port",
    "launch_vllm_server",
    "make_document",
    "make_tiny_model_dir",
]
