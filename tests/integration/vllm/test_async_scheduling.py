"""vLLM's async scheduling (the default of a GPU server with the uni executor) under limits.

With async scheduling vLLM builds an ``AsyncScheduler`` and the busy loop steps with
``EngineCore.step_with_batch_queue``: step N+1 is scheduled (and its blocks
allocated) before the output of step N is processed, so a request that finishes in
step N was already scheduled again, and its blocks are freed one schedule later than
in the synchronous loop. The same storm as ``test_engine_core_limits`` (limits from a
foreign thread at the top of steps and between a prefix lookup and its allocation,
aborts, /proc checked at every step) runs on that loop with ``StubAsyncExecutor``;
the tokens, computed from the KV memory read back, must be those of the synchronous
engine without limit changes.
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from support.simdevice import SimDevice, device_fence, fenced
from support.threads import in_foreign_thread
from test_engine_core_limits import (
    assert_same_outcomes,
    build_core,
    drain_to_zero,
    drive,
    make_request,
    plugin_env,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from allocator import UnmapFence
from engine_ext.cpu_harness.vllm import _worker
from engine_ext.cpu_harness.vllm.executor import StubAsyncExecutor
from engine_ext.protocol import Status
from engine_ext.vllm import KVMemory, _runtime, publish_kv_memory

pytestmark = pytest.mark.vllm

__all__ = ["SimDevice", "plugin_env"]  # the fixture, and the device test_async_storm uses


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_limits_on_the_async_scheduling_loop_keep_every_token(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch, prefix_caching: bool
) -> None:
    sync_core = build_core(plugin_env, enable_prefix_caching=prefix_caching)
    try:
        assert sync_core.batch_queue is None
        baseline = drive(sync_core, 5, num_steps=600, limits=False, monkeypatch=monkeypatch)
    finally:
        sync_core.shutdown()
    _runtime._runtime = None  # the next EngineCore gets a runtime of its own
    core = build_core(plugin_env, enable_prefix_caching=prefix_caching, executor=StubAsyncExecutor)
    try:
        assert isinstance(core.scheduler, AsyncScheduler) and core.batch_queue is not None
        stressed = drive(core, 5, num_steps=600, limits=True, monkeypatch=monkeypatch)
        state, measured = drain_to_zero(core, lambda: [core.step_fn() for _ in range(3)])
    finally:
        core.shutdown()
    assert stressed.publishes > 100 and stressed.applied_checks > 50
    if prefix_caching:
        assert stressed.races > 20
    assert state.status is Status.APPLIED and state.effective_limit_bytes == state.floor_bytes
    assert measured == state.mapped_bytes == state.floor_bytes, (measured, state)
    assert_same_outcomes(baseline, stressed, min_compared=60)


class _Completes(Future):  # type: ignore[type-arg]
    """A done future whose ``result()`` waits for its step, as vLLM's output future does."""

    def __init__(self, value: Any, device: SimDevice, step: int) -> None:
        super().__init__()
        self.set_result(value)
        self._device, self._step = device, step

    def result(self, timeout: float | None = None) -> Any:
        self._device.point("result")
        self._device.complete_through(self._step)
        return super().result(timeout)


DEVICE = SimDevice()


class SimDeviceExecutor(StubAsyncExecutor):
    """``StubAsyncExecutor`` whose steps stay in flight on :data:`DEVICE`."""

    _step = 0

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        output = self.worker.execute_model(scheduler_output)
        memory = self.worker.memory
        assert memory is not None
        pages: set[int] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            pages |= {memory.page_of(b) for b in self.worker._requests[req_id].block_ids}
        self._step = DEVICE.launch(pages)
        DEVICE.point("execute")
        return _Completes(output, DEVICE, self._step) if non_block else output

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self.worker.sample_tokens(grammar_output)
        DEVICE.point("sample")
        return _Completes(output, DEVICE, self._step) if non_block else output


def sim_fence(
    monkeypatch: pytest.MonkeyPatch, rng: random.Random | None = None
) -> tuple[SimDevice, UnmapFence]:
    """:data:`DEVICE` fresh (``rng``: see :class:`SimDevice`), and the worker's KV backend
    fenced over it (as the GPU path's ``FencedBackend`` over ``CudaBackend``), its unmaps
    checked."""
    device = DEVICE
    device.__init__(rng)  # type: ignore[misc]
    fence = device_fence(device)

    def publish(memory: KVMemory) -> None:
        memory.backend = fenced(memory.backend, device, fence)  # type: ignore[assignment]
        memory.fence = fence
        publish_kv_memory(memory)

    monkeypatch.setattr(_worker, "publish_kv_memory", publish)
    return device, fence


def test_no_page_is_unmapped_under_a_step_still_in_flight(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path's unmap fence on the async loop: the KV backend wrapped in
    ``FencedBackend`` over a simulated device, steps in flight until waited for, limits
    and aborts from ``drive``. No unmap may touch a page of a step not yet finished."""
    device, fence = sim_fence(monkeypatch)
    core = build_core(plugin_env, executor=SimDeviceExecutor)
    try:
        assert core.batch_queue is not None
        run = drive(core, 9, num_steps=800, limits=True, monkeypatch=monkeypatch)
    finally:
        core.shutdown()
    assert run.publishes > 100 and device.unmaps > 50 and fence.recording
    assert not device.violations, device.violations[:5]


def test_an_abort_right_after_the_first_step_from_idle_waits_for_that_step(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch queue's first step after idle returns before any output is processed, so
    no fence was recorded after its launch. A limit and an abort of its request right then
    free and unmap that request's pages: the unmap must wait for the step."""
    device, _ = sim_fence(monkeypatch)
    core = build_core(plugin_env, executor=SimDeviceExecutor)
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None
    instance = runtime.instance
    try:
        # a first request runs to its end; then a limit of 0 while idle unmaps its cached
        # pages (that unmap consumed the last recorded fence)
        core.add_request(*core.preprocess_add_request(make_request("w", [5] * 100, 4)))
        for _ in range(20):
            core.step_fn()
        assert not core.scheduler.has_requests()
        in_foreign_thread(lambda: instance.set_limit(0))
        idle_pass(core)
        unmaps = device.unmaps
        assert unmaps > 0 and not device.in_flight
        in_foreign_thread(lambda: instance.set_limit(None))
        idle_pass(core)
        # from idle: one call schedules and launches r's prefill and returns at once
        core.add_request(*core.preprocess_add_request(make_request("r", [9] * 200, 50)))
        core.step_fn()
        assert device.in_flight and core.batch_queue  # r's step is still running
        in_foreign_thread(lambda: instance.set_limit(0))
        core.abort_requests(["r"])
        for _ in range(5):
            core.step_fn()
        idle_pass(core)
        state = instance.state()
    finally:
        core.shutdown()
    assert device.unmaps > unmaps  # r's pages went back
    assert state.status is Status.APPLIED and state.mapped_bytes == state.floor_bytes
    assert not device.violations, device.violations


def idle_pass(core: Any) -> None:
    """What the busy loop runs when it finds no work (the runtime's idle callback; an
    in-process EngineCore has no busy loop to run it)."""
    runtime = _runtime.current_runtime()
    assert runtime is not None
    runtime._on_idle(core)
