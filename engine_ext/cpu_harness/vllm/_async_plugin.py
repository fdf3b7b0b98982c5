"""Keep vLLM's async scheduling on in a CPU ``vllm serve`` (harness only: a vLLM general plugin).

A GPU server with the uni executor runs vLLM's ``AsyncScheduler`` and steps with
``EngineCore.step_with_batch_queue`` by default; vLLM's CPU platform turns async
scheduling off in the config (``CpuPlatform.check_and_update_config``), so the
harness's ``vllm serve`` never runs that loop. ``launch_vllm_server(...,
async_scheduling=True)`` selects ``StubAsyncExecutor``, passes ``--async-scheduling``,
sets :data:`ENV` to ``true`` (``AsyncSchedulingSettings``) and declares :func:`register` under
``vllm.general_plugins`` (a ``*.dist-info`` next to the log, on ``PYTHONPATH``).
vLLM calls it in each of its processes; with :data:`ENV` set it

* wraps ``CpuPlatform.check_and_update_config``: async scheduling stays what the
  config held before the platform's hook (``--async-scheduling``: on; vLLM has already
  refused an executor that does not support it);
* wraps ``EngineCore.step`` and ``EngineCore.step_with_batch_queue`` to log one line
  (:data:`LOOP_LOG`) at the first step: the scheduler class, the batch queue's size
  and the step function the busy loop calls -- what the tests read to know the loop
  under test is the async one.

Nothing in the product imports this module.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["ENV", "LOOP_LOG", "AsyncSchedulingSettings", "register"]

#: The switch the launcher sets (the field below).
ENV = "KVSIDECAR_HARNESS_ASYNC_SCHEDULING"
#: Start of the line logged at the EngineCore's first step.
LOOP_LOG = "cpu harness: EngineCore loop"

#: Under vLLM's logger, so the line goes where vLLM's own go (the server log).
_log = logging.getLogger("vllm.kvsidecar_cpu_harness")
_MARK = "_kvsidecar_harness_async"


class AsyncSchedulingSettings(BaseSettings):
    """The harness plugin's switch (env prefix ``KVSIDECAR_``; set by the launcher)."""

    model_config = SettingsConfigDict(env_prefix="KVSIDECAR_", extra="ignore")

    #: Keep vLLM's async scheduling on in a CPU ``vllm serve`` (module docstring).
    harness_async_scheduling: bool = False


def register() -> None:
    """Apply the wrappers if :data:`ENV` is on; idempotent, a no-op otherwise."""
    if not AsyncSchedulingSettings().harness_async_scheduling:
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.core import EngineCore

    hook = CpuPlatform.__dict__["check_and_update_config"].__func__
    if not getattr(hook, _MARK, False):
        CpuPlatform.check_and_update_config = classmethod(_keep_async(hook))
    # vLLM loads plugins inside EngineCore.__init__, so a wrapper of it would come too
    # late; the step functions are looked up after that (``self.step_fn``)
    for name in ("step", "step_with_batch_queue"):
        step = getattr(EngineCore, name)
        if not getattr(step, _MARK, False):
            setattr(EngineCore, name, _log_first_step(step))


def _keep_async(hook: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(hook)
    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        if wanted and not vllm_config.scheduler_config.async_scheduling:
            vllm_config.scheduler_config.async_scheduling = True
            _log.info("cpu harness: async scheduling kept on despite the CPU platform")

    setattr(check_and_update_config, _MARK, True)
    return check_and_update_config


def _log_first_step(step: Callable[..., Any]) -> Callable[..., Any]:
    logged: list[bool] = []

    @functools.wraps(step)
    def logging_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not logged:
            logged.append(True)
            queue = self.batch_queue
            _log.info(
                "%s: scheduler=%s batch_queue=%s step_fn=%s",
                LOOP_LOG,
                type(self.scheduler).__name__,
                "none" if queue is None else queue.maxlen,
                step.__name__,
            )
        return step(self, *args, **kwargs)

    setattr(logging_step, _MARK, True)
    return logging_step
