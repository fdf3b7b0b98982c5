"""CPU serving harness for vLLM 0.33: the real ``vllm serve`` with no model and no GPU.

Public API (see docs/cpu-harness.md):

* :func:`make_tiny_model_dir` -- a tiny Llama config + locally built tokenizer;
* :func:`make_document` -- text of vocabulary words (one token per word);
* :class:`StubExecutor` -- ``--distributed-executor-backend
  engine_ext.vllm.cpu_harness.StubExecutor``: deterministic tokens computed from
  KV memory on the allocator's ``HostBackend``;
* :func:`launch_vllm_server` -> :class:`VllmServer` -- start ``vllm serve`` on a
  free loopback port, wait for ``/health``; a context manager that tears the
  process group down.

Importing this module imports vLLM (for ``StubExecutor``); the tiny-model and
launcher helpers alone are in light modules for callers that must not.
"""

from __future__ import annotations

from engine_ext.vllm._launcher import VllmServer, free_port, launch_vllm_server
from engine_ext.vllm._stub_executor import StubExecutor
from engine_ext.vllm._tiny_model import TinyModelSpec, make_document, make_tiny_model_dir

__all__ = [
    "StubExecutor",
    "TinyModelSpec",
    "VllmServer",
    "free_port",
    "launch_vllm_server",
    "make_document",
    "make_tiny_model_dir",
]
