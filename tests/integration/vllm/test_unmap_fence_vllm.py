"""The unmap fence on vLLM's real ``EngineCore``: recorded after every forward pass, and
every unmap waits on the recorded event, never on a device-wide sync.

The CPU reservation is wrapped the way the GPU path wraps its CudaBackend
(``FencedBackend`` over an ``UnmapFence``); the event is a stand-in that logs
when it is recorded and waited on, and what the kernel reports mapped then.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

import fakecuda
from test_engine_core_limits import (
    build_core,
    in_foreign_thread,
    make_request,
    plugin_env,
)

from allocator import FencedBackend, UnmapFence
from engine_ext.vllm import _runtime
from engine_ext.vllm._kv_memory import claim_kv_memory

pytestmark = pytest.mark.vllm
__all__ = ["plugin_env"]


def _fence_the_claim(
    monkeypatch: pytest.MonkeyPatch, fence_for: Callable[[Any], UnmapFence]
) -> list[UnmapFence]:
    """The pool claims the KV memory wrapped as the GPU path wraps it (``FencedBackend``
    over the fence ``fence_for(backend)`` makes); returns the list the fence goes in."""
    made: list[UnmapFence] = []

    def claim() -> Any:
        memory = claim_kv_memory()
        assert memory is not None
        fence = fence_for(memory.backend)
        memory.backend = FencedBackend(memory.backend, fence)
        memory.fence = fence
        made.append(fence)
        return memory

    monkeypatch.setattr(_runtime, "claim_kv_memory", claim)
    return made


class _Event:
    """A device event stand-in: logs record/synchronize with the bytes mapped at that time."""

    def __init__(self, backend: Any, log: list[tuple[str, int]]) -> None:
        self._backend, self._log = backend, log

    def record(self) -> None:
        self._log.append(("record", self._backend.mapped_bytes()))

    def synchronize(self) -> None:
        self._log.append(("wait", self._backend.mapped_bytes()))


def test_fence_recorded_every_step_and_unmaps_wait_on_it(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[tuple[str, int]] = []
    unmapped: list[int] = []

    def fence_for(inner: Any) -> UnmapFence:
        original = inner.unmap_many

        def unmap_many(pages: Any) -> None:  # after the fence's wait, in the log's order
            unmapped.extend(pages)
            log.append(("unmap", inner.mapped_bytes()))
            original(pages)

        inner.unmap_many = unmap_many
        return UnmapFence(lambda: _Event(inner, log), lambda: log.append(("device-sync", 0)))

    made = _fence_the_claim(monkeypatch, fence_for)
    core = build_core(plugin_env)
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and made
    fence, instance = made[0], runtime.instance
    bundle = instance.state().page_bundle_bytes
    rng = random.Random(4)
    stepped = 0
    try:
        docs = [[rng.randrange(10, 3000) for _ in range(rng.randrange(40, 200))] for _ in range(6)]
        for i in range(60):
            if i % 3 == 0:
                tokens = rng.choice(docs) + [rng.randrange(10, 3000) for _ in range(5)]
                core.add_request(
                    *core.preprocess_add_request(
                        make_request(f"r{i}", tokens, rng.randrange(1, 20))
                    )
                )
            if i % 7 == 3:  # shrink from the control thread: cached pages are unmapped
                limit = max(0, instance.state().mapped_bytes - 2 * bundle)
                in_foreign_thread(lambda limit=limit: instance.set_limit(limit))
            if i % 7 == 6:
                in_foreign_thread(lambda: instance.set_limit(None))
            if core.scheduler.has_requests():
                stepped += 1
            core.step()
        while core.scheduler.has_requests():
            stepped += 1
            core.step()
        in_foreign_thread(lambda: instance.set_limit(0))
        runtime.safe_point()  # idle: the cached pages go too
    finally:
        core.shutdown()
    records = [entry for entry in log if entry[0] == "record"]
    # once per step that ran the scheduler's output, and once more at each wait
    assert len(records) == stepped + fence.waits_on_event and stepped > 0
    assert unmapped  # the limits unmapped pages
    assert ("device-sync", 0) not in log  # every unmap waited on the event, none synced
    assert fence.device_syncs == 0 and fence.waits_on_event > 0
    for index, (what, mapped) in enumerate(log):
        if what == "unmap":  # recorded then, and waited for, right before this unmap
            before = [w for w, _ in log[:index] if w in ("record", "wait", "unmap")]
            assert before[-2:] == ["record", "wait"], log[max(0, index - 4) : index + 1]


class _DriverEvent:
    """``torch.cuda.Event``'s two calls over the driver (cuda-bindings on the stand-in
    libcuda), raising ``RuntimeError`` on a CUDA error as torch does."""

    def __init__(self, drv: Any) -> None:
        self._drv = drv
        self._event = _checked(drv.cuEventCreate(0), "cuEventCreate")[0]

    def record(self) -> None:
        _checked(self._drv.cuEventRecord(self._event, 0), "cuEventRecord")

    def synchronize(self) -> None:
        _checked(self._drv.cuEventSynchronize(self._event), "cuEventSynchronize")


def _checked(result: Any, what: str) -> tuple[Any, ...]:
    if int(result[0]) != 0:
        raise RuntimeError(f"CUDA error: {what} returned {result[0]!r}")
    return tuple(result[1:])


@pytest.fixture
def driver_thread(fc: fakecuda.FakeCuda) -> Any:
    """cuda-bindings over the stand-in, device 0's primary context current on this thread."""
    from cuda.bindings import driver as drv

    _checked(drv.cuInit(0), "cuInit")
    (dev,) = _checked(drv.cuDeviceGet(0), "cuDeviceGet")
    (ctx,) = _checked(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    (previous,) = _checked(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    _checked(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    yield drv
    drv.cuCtxSetCurrent(previous)
    drv.cuDevicePrimaryCtxRelease(dev)


def test_a_failed_event_record_never_ends_the_engine(
    plugin_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    fc: fakecuda.FakeCuda,
    driver_thread: Any,
) -> None:
    """The driver refuses ``cuEventRecord`` once, inside ``update_from_output``: the step
    goes on (it used to raise there, which ends vLLM's EngineCore), and the next unmap
    syncs the whole device (``cuCtxSynchronize``) instead of trusting a stale event."""
    drv = driver_thread

    def synchronize_device() -> None:
        _checked(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    made = _fence_the_claim(
        monkeypatch, lambda _inner: UnmapFence(lambda: _DriverEvent(drv), synchronize_device)
    )
    core = build_core(plugin_env)
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and made
    fence, instance = made[0], runtime.instance
    fc.reset_calls()
    fc.fail("cuEventRecord", after=2, count=1)  # the third step's record
    rng = random.Random(7)
    try:
        for i in range(4):
            tokens = [rng.randrange(10, 3000) for _ in range(rng.randrange(60, 200))]
            core.add_request(*core.preprocess_add_request(make_request(f"r{i}", tokens, 8)))
        steps = 0
        while core.scheduler.has_requests():
            core.step()  # the failed record raised out of here
            steps += 1
        assert steps > 3 and fc.calls("cuEventRecord") == steps
        assert fence.record_failures == 1
        in_foreign_thread(lambda: instance.set_limit(0))
        runtime.safe_point()  # idle: the cached pages are unmapped
    finally:
        core.shutdown()
    state = instance.state()
    assert state.mapped_bytes == state.floor_bytes  # everything above the floor was unmapped
    # the first unmap after the failed record synced the device, every other one waited
    # on the event (without the failure: no device sync at all, the test above)
    assert fence.device_syncs == 1 and fc.calls("cuCtxSynchronize") == 1
    assert fence.waits_on_event > 0
