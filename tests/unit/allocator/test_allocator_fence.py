"""UnmapFence + FencedBackend: an unmap waits for the last recorded device work (CPU).

The backend is a real HostBackend (its ``mapped_bytes`` is measured from
``/proc``); the event is a stand-in that notes, when waited on, what the
backend still had mapped, so the order "wait, then unmap" is observed on the
memory itself.
"""

from __future__ import annotations

import logging
import mmap
import random

import pytest

from allocator import (
    BlockAllocator,
    FencedBackend,
    HostBackend,
    PageAllocator,
    PageLayout,
    UnmapFence,
)

PAGE = mmap.PAGESIZE


class _Event:
    def __init__(self, backend: HostBackend, log: list[str]) -> None:
        self.backend, self.log = backend, log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append(f"wait:{self.backend.mapped_bytes() // PAGE}")


@pytest.fixture
def host() -> HostBackend:
    backend = HostBackend.reserve(PageLayout(PAGE, 16, 1))
    yield backend  # type: ignore[misc]
    backend.release()


def _fence(backend: HostBackend, log: list[str]) -> UnmapFence:
    return UnmapFence(
        lambda: _Event(backend, log), lambda: log.append(f"sync:{backend.mapped_bytes() // PAGE}")
    )


def test_unmap_records_the_event_again_and_waits_with_the_memory_still_there(
    host: HostBackend,
) -> None:
    log: list[str] = []
    fence = _fence(host, log)
    fenced = FencedBackend(host, fence)
    fenced.map_many([0, 1, 2])
    fence.record()
    fenced.unmap_many([1, 2])
    # recorded again at the wait, waited while all three pages were still resident
    assert log == ["record", "record", "wait:3"]
    assert host.mapped_bytes() == PAGE
    fenced.unmap(0)  # every unmap waits for what was launched up to it
    assert log == ["record", "record", "wait:3", "record", "wait:1"]
    assert fence.waits_on_event == 2 and fence.device_syncs == 0


class _Queue:
    """A device queue: launches complete only when an event recorded after them is waited."""

    def __init__(self) -> None:
        self.launched = self.done = 0

    def event(self) -> _QueueEvent:
        return _QueueEvent(self)


class _QueueEvent:
    def __init__(self, queue: _Queue) -> None:
        self.queue, self.mark = queue, 0

    def record(self) -> None:
        self.mark = self.queue.launched

    def synchronize(self) -> None:
        self.queue.done = max(self.queue.done, self.mark)


def test_an_unmap_waits_for_a_launch_no_record_followed(host: HostBackend) -> None:
    """vLLM's batch queue and SGLang's overlap loop: a forward launched from idle is not
    followed by a record before an abort frees its blocks. The unmap still waits for it."""
    queue = _Queue()
    fence = UnmapFence(queue.event, lambda: setattr(queue, "done", queue.launched))
    fenced = FencedBackend(host, fence)
    fenced.map_many([0, 1])
    queue.launched += 1  # step 1
    fence.record()
    fenced.unmap(1)  # waits for step 1
    assert queue.done == 1
    queue.launched += 1  # step 2, from idle: no record after it
    fenced.unmap(0)
    assert queue.done == 2, "a page was unmapped under a step still in flight"


def test_without_any_record_every_unmap_syncs_the_device_first(host: HostBackend) -> None:
    log: list[str] = []
    fenced = FencedBackend(host, _fence(host, log))
    fenced.map_many([4, 5])
    fenced.unmap(4)
    fenced.unmap(5)
    fenced.unmap_many([])  # nothing to unmap: no wait
    assert log == ["sync:2", "sync:1"]


def test_release_waits_too(host: HostBackend) -> None:
    log: list[str] = []
    fence = _fence(host, log)
    fenced = FencedBackend(host, fence)
    fenced.map(7)
    fence.record()
    fenced.release()
    assert log == ["record", "record", "wait:1"] and host.mapped_bytes() == 0


def test_random_steps_never_unmap_past_an_unwaited_record(host: HostBackend) -> None:
    """Forward passes (record) and shrinks (free + unmap) interleaved at random."""
    rng = random.Random(11)
    log: list[str] = []
    fence = _fence(host, log)
    pages = PageAllocator(FencedBackend(host, fence))
    blocks = BlockAllocator(pages, 2)
    held: list[int] = []
    ever = False
    for _ in range(400):
        action = rng.random()
        if action < 0.4:
            got = blocks.alloc(rng.randint(1, 4))
            held.extend(got or [])
        elif action < 0.6:
            fence.record()
            ever = True
        elif held:
            rng.shuffle(held)
            cut = rng.randint(1, len(held))
            before, seen = host.mapped_bytes(), len(log)
            blocks.free(held[:cut])
            del held[:cut]
            new = [entry for entry in log[seen:] if entry != "record"]
            if host.mapped_bytes() == before:
                assert new == []
            elif not ever:
                assert new[0] == f"sync:{before // PAGE}"  # then one sync per further unmap
            else:
                assert new[0] == f"wait:{before // PAGE}"  # waited with everything resident
                assert all(entry.startswith("wait:") for entry in new)
    assert fence.waits_on_event > 0


class _FlakyEvent(_Event):
    """A stand-in event whose ``record`` fails when told (torch raises RuntimeError)."""

    fail_record = False

    def record(self) -> None:
        if _FlakyEvent.fail_record:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().record()


@pytest.mark.parametrize("first", [True, False])
def test_after_a_failed_record_the_next_wait_syncs_the_whole_device(
    host: HostBackend, monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    """The forward pass launched before a failed record is behind no event: the next unmap
    must not trust the old (already waited) one, it syncs the device as before any record."""
    log: list[str] = []
    fence = UnmapFence(lambda: _FlakyEvent(host, log), lambda: log.append("device-sync"))
    fenced = FencedBackend(host, fence)
    fenced.map_many([0, 1])
    if not first:
        fence.record()
        fenced.unmap(1)  # waits on that event
        fenced.map(1)
    log.clear()
    monkeypatch.setattr(_FlakyEvent, "fail_record", True)
    fence.record()  # never raises into the engine's step
    assert fence.record_failures == 1
    fenced.unmap(1)
    assert log == ["device-sync"]
    monkeypatch.setattr(_FlakyEvent, "fail_record", False)
    fence.record()  # recording works again: back to event waits
    fenced.unmap(0)
    assert log == ["device-sync", "record", "record", "wait:1"]


def test_a_record_that_fails_inside_the_wait_syncs_the_whole_device(
    host: HostBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    fence = UnmapFence(lambda: _FlakyEvent(host, log), lambda: log.append("device-sync"))
    fenced = FencedBackend(host, fence)
    fenced.map_many([0, 1])
    fence.record()
    monkeypatch.setattr(_FlakyEvent, "fail_record", True)
    fenced.unmap(1)
    assert log == ["record", "device-sync"] and fence.record_failures == 1


def test_failed_records_never_raise_and_are_logged_once_per_interval(
    host: HostBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A device in error fails the record at every step: one warning saying what to do,
    not one per step (the interval is far from over within the test)."""
    log: list[str] = []
    fence = UnmapFence(lambda: _FlakyEvent(host, log), lambda: log.append("device-sync"))
    monkeypatch.setattr(_FlakyEvent, "fail_record", True)
    with caplog.at_level(logging.WARNING, logger="allocator._fence"):
        for _ in range(5):
            fence.record()
    assert fence.record_failures == 5
    warnings = [r for r in caplog.records if r.name == "allocator._fence"]
    assert len(warnings) == 1
    assert "illegal memory access" in warnings[0].getMessage()
    assert "restart the engine" in warnings[0].getMessage()


def test_an_event_that_cannot_be_made_is_a_failed_record(host: HostBackend) -> None:
    """``torch.cuda.Event()`` itself raising (a context in error) is a failed record too."""
    log: list[str] = []

    def make_event() -> _Event:
        raise RuntimeError("CUDA error: unspecified launch failure")

    fence = UnmapFence(make_event, lambda: log.append("device-sync"))
    fenced = FencedBackend(host, fence)
    fenced.map(0)
    fence.record()
    assert fence.record_failures == 1 and not fence.recording
    fenced.unmap(0)
    assert log == ["device-sync"]
