"""Helpers for the SGLang integration tests (imported by name; conftest holds the fixtures)."""

from __future__ import annotations

import queue
import random
import threading
from typing import Any

import pytest
from support.simdevice import SimDevice, device_fence, fenced

from allocator import DeviceOutOfMemory, PageAllocator, UnmapFence
from engine_ext import count_reclaimable_pages
from engine_ext.cpu_harness import CpuHarness
from engine_ext.cpu_harness.sglang import _loop as harness_loop
from engine_ext.protocol import Status
from sidecar._reports import report_problem


def prompt(i: int, length: int = 40) -> list[int]:
    """A prompt unlikely to share a prefix with ``prompt(j)``; ids stay exact in fp16."""
    return [(i * 37 + j * 11 + 1) % 2000 for j in range(length)]


def fill(harness: CpuHarness, num: int, start: int = 0, new_tokens: int = 5) -> None:
    """Run ``num`` distinct requests to completion: their KV stays in the tree cache."""
    for i in range(start, start + num):
        harness.submit(prompt(i), max_new_tokens=new_tokens)
    harness.run_until_idle()


class LimitThread:
    """A controller thread that publishes the limits the scheduler thread hands it.

    The hand-off makes the point of publication reproducible (fixed seed),
    while the publish itself runs on a foreign thread, as the control socket's does.
    """

    def __init__(self, harness: CpuHarness) -> None:
        self.harness = harness
        self.inbox: queue.Queue[tuple[int | None] | None] = queue.Queue()
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="limit-controller", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.inbox.get()) is not None:
            try:
                self.harness.pool.set_limit(item[0])
            except BaseException as exc:  # noqa: BLE001 -- reported by the test
                self.errors.append(exc)
            self.done.set()

    def publish(self, limit: int | None) -> None:
        self.done.clear()
        self.inbox.put((limit,))
        assert self.done.wait(10), "the controller thread did not publish"

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(10)


def check_state(h: CpuHarness) -> bool:
    """What a reader of the socket may rely on, checked now: ``available_size() >= 0``,
    the state passes the sidecar's report checks, its mapped bytes follow the memfd
    (within one page bundle: fresh after the iteration's allocations and frees, not one
    iteration late), and ``applied`` only at or under the effective limit as measured.
    Returns whether the state said ``applied``."""
    available = h.token_to_kv_pool_allocator.available_size()
    assert available >= 0, f"available_size() = {available}"
    state = h.pool.state()
    # every state passes the sidecar's report checks (a refused report goes stale there)
    assert report_problem(state, state.limit_bytes, state.revision) is None, state
    measured = h.mapped_bytes()
    assert abs(state.mapped_bytes - measured) <= h.bundle_bytes, (state, measured)
    if state.status is not Status.APPLIED:
        return False
    effective = state.effective_limit_bytes
    assert effective is None or measured <= effective, (
        f"applied but /proc-measured {measured} > effective limit {effective}"
    )
    return True


def check_counts(h: CpuHarness, where: str) -> None:
    """The block allocator's incremental evictable marks against an independent recount:
    a full scan of SGLang's tree (the blocks of every unlocked node)."""
    reclaimer: Any = h.pool.reclaimer
    scan = reclaimer.scan_unlocked()
    blocks = h.blocks
    marked = {b for b in range(blocks.num_blocks) if blocks.is_marked_evictable(b)}
    assert marked == set(scan), where
    assert blocks.num_evictable_blocks == len(scan), where
    assert blocks.num_reclaimable_pages == count_reclaimable_pages(scan, blocks), where
    assert blocks.num_evictable_blocks * h.config.page_size == h.tree_cache.evictable_size()
    per_page: dict[int, int] = {}
    for b in scan:
        per_page[b // blocks.blocks_per_page] = per_page.get(b // blocks.blocks_per_page, 0) + 1
    assert all(blocks.evictable_on(p) == per_page.get(p, 0) for p in range(h.pages.num_pages)), (
        where
    )
    counts = h.pool.counts
    assert counts is not None and counts.num_resyncs == 0, f"{where}: drift repaired by a scan"


class CappedDevice:
    """Forwards to a backend; refuses maps beyond ``total_pages`` mapped pages (measured):
    a device that another engine fills."""

    def __init__(self, inner: Any, total_pages: int) -> None:
        self.inner = inner
        self.total_pages = total_pages
        self.refusals = 0
        # besides the foreign thread's random moments, another engine sometimes fills the
        # device right before a map (seeded): the race is met in every run, not by luck
        self.just_before = random.Random(33)
        self.racing = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def map_many(self, pages: Any) -> None:
        total = self.total_pages
        if self.racing and self.just_before.random() < 0.3:
            total = len(self.inner.mapped_pages())  # full at this very map
        if len(self.inner.mapped_pages()) + len(pages) > total:
            self.refusals += 1
            raise DeviceOutOfMemory(f"no device memory for {len(pages)} page(s)")
        self.inner.map_many(pages)

    def map(self, page: int) -> None:
        self.map_many([page])


def on_sim_device(
    monkeypatch: pytest.MonkeyPatch, device: SimDevice, *, total_pages: int | None = None
) -> list[tuple[UnmapFence, CappedDevice | None]]:
    """Harnesses built from now on keep their KV on ``device``: the reservation behind a
    ``FencedBackend`` over an ``UnmapFence`` whose event lives on the device (as
    ``_kv_placement`` wraps a ``CudaBackend``), every unmap checked against the batches
    in flight; with ``total_pages``, maps beyond that many pages are refused
    (:class:`CappedDevice`, not racing). Returns, per harness, its fence and capped
    device; set ``harness.device`` too."""
    made: list[tuple[UnmapFence, CappedDevice | None]] = []

    def pages(backend: Any, **kwargs: Any) -> PageAllocator:
        capped = None
        if total_pages is not None:
            capped = CappedDevice(backend, total_pages)
            capped.racing = False
            backend = capped
        fence = device_fence(device)
        made.append((fence, capped))
        return PageAllocator(fenced(backend, device, fence), **kwargs)

    monkeypatch.setattr(harness_loop, "PageAllocator", pages)
    return made
