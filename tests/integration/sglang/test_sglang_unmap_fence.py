"""The unmap fence on SGLang's memory classes (CPU harness): recorded after every batch,
and every unmap waits on the recorded event, never on a device-wide sync.

The harness's reservation is wrapped as ``_kv_placement`` wraps a CudaBackend
(``FencedBackend`` over an ``UnmapFence``); the event is a stand-in that logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sglang_support import prompt

from allocator import FencedBackend, PageAllocator, UnmapFence
from engine_ext.cpu_harness import CpuHarness
from engine_ext.cpu_harness.sglang import _loop as cpu_harness
from engine_ext.sglang._patches import Session, _wrap_process_batch_result
from engine_ext.sglang._runtime import ATTR

Make = Callable[..., CpuHarness]


class _Event:
    def __init__(self, backend: Any, log: list[str]) -> None:
        self._backend, self._log = backend, log

    def record(self) -> None:
        self._log.append("record")

    def synchronize(self) -> None:
        self._log.append("wait")


def _fenced(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> list[UnmapFence]:
    made: list[UnmapFence] = []

    def pages(backend: Any, **kwargs: Any) -> PageAllocator:
        fence = UnmapFence(lambda: _Event(backend, log), lambda: log.append("device-sync"))
        original = backend.unmap_many

        def unmap_many(page_ids: Any) -> None:
            log.append("unmap")
            original(page_ids)

        backend.unmap_many = unmap_many
        made.append(fence)
        return PageAllocator(FencedBackend(backend, fence), **kwargs)

    monkeypatch.setattr(cpu_harness, "PageAllocator", pages)
    return made


def test_fence_recorded_every_batch_and_unmaps_wait_on_it(
    make_harness: Make, any_cache_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    made = _fenced(monkeypatch, log)
    h = make_harness(any_cache_kind)
    fence = made[0]
    assert h.pool.fence is fence
    batches = 0
    for i in range(12):
        h.submit(prompt(i, length=60), max_new_tokens=20)
        if i % 4 == 3:
            h.pool.set_limit(h.bundle_bytes)  # most cached pages must go
        if i % 4 == 1:
            h.pool.set_limit(None)
        for _ in range(6):
            forward = bool(h.waiting or h.running)
            before = log.count("record")
            h.iterate()
            batches += forward and log.count("record") > before
    h.pool.set_limit(None)  # let what waits under the last limit finish
    h.run_until_idle()
    h.pool.set_limit(0)
    h.idle_until(lambda: h.mapped_bytes() == 0)
    assert batches > 0 and log.count("record") >= batches
    assert "unmap" in log and "device-sync" not in log
    assert fence.device_syncs == 0 and fence.waits_on_event > 0
    for index, what in enumerate(log):
        if what == "unmap":
            before = [w for w in log[:index] if w in ("record", "wait")]
            assert before and before[-1] == "wait", log[max(0, index - 4) : index + 1]


def test_process_batch_result_patch_records_before_the_result_is_processed(
    make_harness: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    _fenced(monkeypatch, log)
    h = make_harness("radix")

    class Scheduler:  # the real wrapper, applied to a stand-in scheduler holding the pool
        def process_batch_result(self, batch: object, result: object) -> str:
            log.append("process")
            return "done"

    wrapped = _wrap_process_batch_result(
        Scheduler.process_batch_result, Session(h.pool.instance.settings, "0.5.23", print)
    )
    scheduler = Scheduler()
    setattr(scheduler, ATTR, h.pool)
    assert wrapped(scheduler, object(), object()) == "done"
    assert log == ["record", "process"]
    assert wrapped(Scheduler(), object(), object()) == "done"  # no pool: passes through
    assert log == ["record", "process", "process"]


def test_the_overlap_loops_forward_stream_is_where_the_fence_records_also_at_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang's overlap loop launches on ``scheduler.forward_stream``: the batch-end record
    and the record an unmap makes before its wait both go there (an event on the current
    stream would not cover the forward queued on the other one). ``torch.cuda.stream``
    is a stand-in that notes which stream is current (CPU torch has none)."""
    import contextlib

    import torch

    from engine_ext.sglang._runtime import SglangRuntime

    current: list[object] = ["default"]
    seen: list[object] = []

    @contextlib.contextmanager
    def stream(s: object) -> Any:
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    class Event:
        def record(self) -> None:
            seen.append(current[-1])

        def synchronize(self) -> None:
            seen.append("wait")

    monkeypatch.setattr(torch.cuda, "stream", stream)
    forward = object()
    fence = UnmapFence(Event, lambda: seen.append("device-sync"))

    class Holder:  # what after_batch reads of the runtime
        scheduler = type("S", (), {"forward_stream": forward})()

    Holder.fence = fence  # type: ignore[attr-defined]
    SglangRuntime.after_batch(Holder())  # type: ignore[arg-type]
    fence.wait()
    assert seen == [forward, forward, "wait"]
