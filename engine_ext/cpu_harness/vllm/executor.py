"""``StubExecutor``: a vLLM ``Executor`` that runs the model-free ``StubWorker`` in-process.

Selected with ``--distributed-executor-backend engine_ext.cpu_harness.vllm.executor.StubExecutor``
(vLLM resolves any other string by import, ``vllm/v1/executor/abstract.py``
``Executor.get_class``). Like ``UniProcExecutor`` it runs its one worker in the
EngineCore process, on the busy-loop thread; RPCs are plain method calls.
No model is loaded, so start-up takes seconds on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm.v1.executor.abstract import Executor

from engine_ext.vllm import load_vllm_settings

from ._multirank import make_stub_worker
from ._worker import StubWorker

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput

__all__ = ["StubAsyncExecutor", "StubExecutor"]


class StubExecutor(Executor):  # type: ignore[misc]  # vLLM is untyped here (pyproject)
    """World size 1, no model: owns one ``StubWorker``. Busy-loop thread only."""

    worker: StubWorker

    def _init_executor(self) -> None:
        if self.parallel_config.world_size != 1:
            raise ValueError(
                "StubExecutor runs one in-process worker: use tensor/pipeline parallel size 1"
            )
        settings = load_vllm_settings()
        self.worker = make_stub_worker(self.vllm_config, settings.page_bytes)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        del timeout  # runs inline
        try:
            result = [self._call(method, args, kwargs or {})]
        except Exception as exc:
            if not non_block:
                raise
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return failed
        if not non_block:
            return result
        done: Future[Any] = Future()
        done.set_result(result)
        return done

    def _call(
        self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if callable(method):
            return method(self.worker, *args, **kwargs)
        target = getattr(self.worker, method, None)
        if target is None:
            raise NotImplementedError(
                f"the CPU stub worker has no RPC {method!r}; it serves generation only "
                "(use a real executor for this feature)"
            )
        return target(*args, **kwargs)

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        self.worker.initialize_from_config(kv_cache_configs[0])

    def compile_or_warm_up_model(self) -> None:
        self.worker.compile_or_warm_up_model()

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        output = self.worker.execute_model(scheduler_output)
        if not non_block:
            return output
        done: Future[ModelRunnerOutput | None] = Future()
        done.set_result(output)
        return done

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        output = self.worker.sample_tokens(grammar_output)
        if not non_block:
            return output
        done: Future[ModelRunnerOutput] = Future()
        done.set_result(output)
        return done

    def take_draft_token_ids(self) -> None:
        return None

    def check_health(self) -> None:
        return None  # in-process: healthy while the process runs

    def shutdown(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()


class StubAsyncExecutor(StubExecutor):
    """``StubExecutor`` that supports vLLM's async scheduling, as ``UniProcExecutor`` does
    (a GPU server's default). vLLM then builds its ``AsyncScheduler`` and steps with
    ``EngineCore.step_with_batch_queue``: step N+1 is scheduled before the output of step
    N is processed, and a request that finishes in step N was already scheduled in N+1.
    The futures are done when returned (the work runs inline, in order), so this checks
    the order of vLLM's calls around kvsidecar's hooks, not concurrent device work.

    Selected with ``--distributed-executor-backend
    engine_ext.cpu_harness.vllm.executor.StubAsyncExecutor``.
    """

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True
