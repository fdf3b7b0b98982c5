"""Physical out-of-memory under overcommit (docs/overcommit.md), over real host memory.

Two engines, each with a virtual capacity of 16 pages, share a stand-in
device of 20 pages: a backend wrapper whose ``map`` raises the allocator's
``DeviceOutOfMemory`` once the device total would be exceeded (what
``CudaBackend`` raises for ``CUDA_ERROR_OUT_OF_MEMORY``). What is mapped is
measured by the host backend (``/proc``), not counted by the wrapper.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from engine_pool import BLOCKS_PER_PAGE, NUM_PAGES, NUM_REGIONS, PAGE_BYTES, Pool, PrefixCache

from allocator import (
    BlockAllocator,
    DeviceOutOfMemory,
    HostBackend,
    PageAllocator,
    PageLayout,
    ThreadGuard,
)
from allocator import _pages as pages_module
from engine_ext import ElasticInstance, EngineBinding, load_engine_settings
from engine_ext.protocol import Status

BUNDLE = PAGE_BYTES * NUM_REGIONS
DEVICE_PAGES = 20  # < 2 x NUM_PAGES: the two engines' virtual capacities overcommit it


class Device:
    """The stand-in device: its total, and the backends that map from it."""

    def __init__(self, total_pages: int) -> None:
        self.total_bytes = total_pages * BUNDLE
        self.backends: list[HostBackend] = []
        self.refusals = 0

    def used_bytes(self) -> int:
        return sum(b.mapped_bytes() for b in self.backends)  # measured, /proc


class OnDevice:
    """A HostBackend whose maps draw from a :class:`Device` (refused when it is full)."""

    def __init__(self, inner: HostBackend, device: Device) -> None:
        self.inner = inner
        self.device = device
        device.backends.append(inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _check(self, count: int) -> None:
        if self.device.used_bytes() + count * BUNDLE > self.device.total_bytes:
            self.device.refusals += 1
            raise DeviceOutOfMemory(f"map of {count} page(s): the device is full")

    def map(self, page: int) -> None:
        self._check(1)
        self.inner.map(page)

    def map_many(self, pages: Sequence[int]) -> None:
        self._check(len(pages))
        self.inner.map_many(pages)


@pytest.fixture
def device() -> Iterator[Device]:
    dev = Device(DEVICE_PAGES)
    yield dev
    for backend in dev.backends:
        backend.release()


def engine_pool(device: Device, name: str) -> Pool:
    layout = PageLayout(page_bytes=PAGE_BYTES, num_pages=NUM_PAGES, num_regions=NUM_REGIONS)
    backend = OnDevice(HostBackend.reserve(layout, name=f"oom-{name}"), device)
    pages = PageAllocator(backend, guard=ThreadGuard(f"oom-{name}"))  # type: ignore[arg-type]
    blocks = BlockAllocator(pages, BLOCKS_PER_PAGE)
    return Pool(backend, pages, blocks, PrefixCache(blocks))  # type: ignore[arg-type]


def instance(pool: Pool, tmp_path: Path, name: str) -> ElasticInstance:
    settings = load_engine_settings(instance_id=name, runtime_dir=tmp_path / name)
    return ElasticInstance(settings, EngineBinding("vllm", "0.33.0", pool.blocks, (pool.cache,)))


def test_a_full_device_refuses_the_allocation_and_changes_nothing(device: Device) -> None:
    a, b = engine_pool(device, "a"), engine_pool(device, "b")
    a.fill(NUM_PAGES)  # engine A maps its whole virtual capacity
    b.fill(DEVICE_PAGES - NUM_PAGES)  # B gets what is left
    before = (b.blocks.num_allocated_blocks, b.pages.num_mapped, b.backend.mapped_bytes())
    assert b.blocks.alloc(BLOCKS_PER_PAGE + 1) is None  # no exception, all or nothing
    assert device.refusals == 1
    assert (b.blocks.num_allocated_blocks, b.pages.num_mapped, b.backend.mapped_bytes()) == before
    assert b.pages.device_full and b.blocks.num_free_blocks == 0  # headroom is what is there
    assert device.used_bytes() == device.total_bytes


def test_limit_reports_device_out_of_memory_then_memory_moves(
    device: Device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pages_module, "DEVICE_RETRY_S", 0.05)
    a, b = engine_pool(device, "a"), engine_pool(device, "b")
    ia, ib = instance(a, tmp_path, "a"), instance(b, tmp_path, "b")
    a.fill(12)
    b.fill(DEVICE_PAGES - 12)
    ib.set_limit(12 * BUNDLE)  # more than the device has left for B
    assert ib.step().status is Status.APPLIED  # 8 pages mapped <= 12: nothing to shrink
    assert b.cache.start([10**6 + i for i in range(BLOCKS_PER_PAGE)]) is None  # device full
    state = ib.step()
    assert (state.status, state.reason) == (Status.DEFERRED, "device_out_of_memory")
    assert state.mapped_bytes == 8 * BUNDLE

    ia.set_limit(4 * BUNDLE)  # the operator moves memory from A to B
    assert ia.step().status is Status.APPLIED  # A's cached pages evicted and unmapped
    assert a.backend.mapped_bytes() == 4 * BUNDLE
    time.sleep(0.06)  # B tries the device again
    b.fill(4)
    assert b.backend.mapped_bytes() == 12 * BUNDLE
    assert ib.step().status is Status.APPLIED
    assert device.used_bytes() == 16 * BUNDLE <= device.total_bytes


def test_random_traffic_never_exceeds_the_device(device: Device, tmp_path: Path) -> None:
    """Both engines allocate and free at random under moving limits: no crash, no excess."""
    rng = random.Random(12)
    pools = [engine_pool(device, "a"), engine_pool(device, "b")]
    insts = [instance(p, tmp_path, n) for p, n in zip(pools, "ab")]
    running: list[list[Any]] = [[], []]
    for _ in range(400):
        side = rng.randrange(2)
        pool, inst = pools[side], insts[side]
        roll = rng.random()
        if roll < 0.5:
            req = pool.cache.start([rng.randrange(10**9) for _ in range(rng.randint(1, 6))])
            if req is not None:
                running[side].append(req)
        elif roll < 0.85 and running[side]:
            pool.cache.finish(running[side].pop(rng.randrange(len(running[side]))))
        else:
            inst.set_limit(rng.choice([None, 2, 6, 10, 16]) and rng.randint(2, 16) * BUNDLE)
        state = inst.step()
        assert state.reason in (None, "evicting", "running_requests", "device_out_of_memory")
        assert device.used_bytes() <= device.total_bytes
    assert device.refusals > 0  # the device really was full at times
