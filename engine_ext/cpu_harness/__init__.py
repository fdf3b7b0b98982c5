"""The CPU harness: run the real engines' serving and memory paths without a GPU or a model.

Not part of the product path: nothing in ``engine_ext.vllm``, ``engine_ext.sglang``,
the allocator or the sidecar imports it. It stands in for the parts of an
engine that need a GPU model (vLLM's worker and model runner, SGLang's
scheduler process) so the tests, the benchmarks and the CPU demo exercise
the real adapters on a CPU-only machine. See docs/cpu-harness.md.

Public API (everything else in this package is private):

* :func:`make_tiny_model_dir` / :class:`TinyModelSpec` -- a tiny local Llama
  model directory (config + tokenizer, no weights);
* :func:`make_document` -- text of vocabulary words (one word = one token);
* :func:`launch_vllm_server` -> :class:`VllmServer` -- the real ``vllm serve``
  with the stub executor (:data:`STUB_EXECUTOR`) on a free loopback port;
  ``async_scheduling=True`` runs vLLM's async-scheduling loop instead
  (:data:`STUB_ASYNC_EXECUTOR`, kept on despite the CPU platform);
* :func:`free_port` -- a free loopback TCP port;
* :func:`launch_sglang_server` -> :class:`SglangServer` -- SGLang's real HTTP
  server (``python -m engine_ext.cpu_harness.sglang.serve``: kvsidecar's
  launcher with a stub model forward) on a free loopback port;
* :class:`ToyPrefixCache` -- a minimal engine prefix cache over the core's
  ``BlockAllocator`` (a ``Reclaimer``), for driving the core without an engine;
* :class:`StubExecutor` -- the vLLM ``Executor`` behind :data:`STUB_EXECUTOR`
  (importing it imports vLLM);
* :class:`CpuHarness`, :class:`HarnessConfig`, :class:`HarnessRequest`,
  :func:`single_rank_runtime` -- SGLang's memory classes driven like its
  scheduler drives them (importing them imports SGLang).

The engine-bound names are resolved on first access, so ``import
engine_ext.cpu_harness`` imports neither engine (the demo runs in the
sidecar's process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine_ext.cpu_harness._server import ServerProcess, free_port
from engine_ext.cpu_harness._tiny_model import TinyModelSpec, make_document, make_tiny_model_dir
from engine_ext.cpu_harness._toy_cache import ToyPrefixCache
from engine_ext.cpu_harness.sglang._launcher import SglangServer, launch_sglang_server
from engine_ext.cpu_harness.vllm._launcher import (
    STUB_ASYNC_EXECUTOR,
    STUB_EXECUTOR,
    VllmServer,
    launch_vllm_server,
)

if TYPE_CHECKING:
    from engine_ext.cpu_harness.sglang._loop import (
        CpuHarness,
        HarnessConfig,
        HarnessRequest,
        single_rank_runtime,
    )
    from engine_ext.cpu_harness.vllm.executor import StubExecutor

__all__ = [
    "STUB_ASYNC_EXECUTOR",
    "STUB_EXECUTOR",
    "CpuHarness",
    "HarnessConfig",
    "HarnessRequest",
    "ServerProcess",
    "SglangServer",
    "StubExecutor",
    "TinyModelSpec",
    "ToyPrefixCache",
    "VllmServer",
    "free_port",
    "launch_sglang_server",
    "launch_vllm_server",
    "make_document",
    "make_tiny_model_dir",
    "single_rank_runtime",
]

#: name -> module that defines it, for the names whose import loads an engine.
_ENGINE_BOUND = {
    "StubExecutor": "engine_ext.cpu_harness.vllm.executor",
    "CpuHarness": "engine_ext.cpu_harness.sglang._loop",
    "HarnessConfig": "engine_ext.cpu_harness.sglang._loop",
    "HarnessRequest": "engine_ext.cpu_harness.sglang._loop",
    "single_rank_runtime": "engine_ext.cpu_harness.sglang._loop",
}


def __getattr__(name: str) -> Any:
    module = _ENGINE_BOUND.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
