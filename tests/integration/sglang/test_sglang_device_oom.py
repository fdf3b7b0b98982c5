"""The device fills between SGLang's admission (or decode check) and the allocation, with
nothing cached to fall back on: the request waits (or is retracted, as on a full device),
SGLang's scheduler never sees "Prefill out of memory".

SGLang's memory classes (CPU harness) over a host reservation whose "device" refuses
maps beyond a page count that a foreign thread (another engine) moves at random moments.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sglang_support import prompt

from allocator import DeviceOutOfMemory, PageAllocator
from allocator import _pages as allocator_pages
from engine_ext.cpu_harness import CpuHarness
from engine_ext.cpu_harness.sglang import _loop as cpu_harness

Make = Callable[..., CpuHarness]


class _Device:
    """Forwards to a backend; refuses maps beyond ``total_pages`` mapped pages (measured)."""

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


def test_a_device_filling_under_admission_never_fails_an_allocation(
    make_harness: Make, cache_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    devices: list[_Device] = []

    def pages(backend: Any, **kwargs: Any) -> PageAllocator:
        device = _Device(backend, total_pages=10_000)
        devices.append(device)
        return PageAllocator(device, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_harness, "PageAllocator", pages)
    # after a refusal the allocator holds at what is mapped for DEVICE_RETRY_S (1 s): retry
    # sooner here, so the device is probed (and the race met) at many more allocations
    monkeypatch.setattr(allocator_pages, "DEVICE_RETRY_S", 0.02)
    h = make_harness(cache_kind)
    (device,) = devices
    allocator = h.token_to_kv_pool_allocator
    rng = random.Random(31)
    stop = threading.Event()

    def other_engine() -> None:
        other = random.Random(32)
        while not stop.is_set():
            device.total_pages = other.choice((2, 3, 4, 6, 10, 10_000))
            time.sleep(other.uniform(0, 0.003))

    requests = []
    seen_device_wait = 0
    thread = threading.Thread(target=other_engine, name="other-engine")
    thread.start()
    try:
        for _ in range(2500):
            if rng.random() < 0.3:
                requests.append(
                    h.submit(
                        prompt(rng.randrange(40), length=rng.randrange(20, 90)),
                        max_new_tokens=rng.randrange(1, 30),
                    )
                )
            h.iterate()  # RuntimeError here: "Prefill out of memory" / a failed decode
            state = h.pool.state()
            assert allocator.available_size() >= 0
            if state.waiting_reason == "device_out_of_memory":
                seen_device_wait += 1
                assert state.num_waiting_requests >= 1 and state.waiting_bytes > 0
    finally:
        stop.set()
        thread.join()
    device.total_pages = 10_000
    device.racing = False
    h.run_until_idle()
    assert all(r.done for r in requests)
    assert device.refusals >= 5 and allocator.num_device_refusals >= 5  # the race was met
    assert seen_device_wait > 0
    h.pool.before_schedule()
    assert h.pool.state().waiting_reason is None
