"""CudaBackend on the stand-in CUDA driver (tests/fakecuda): what a GPU machine cannot force.

The stand-in's memory is host memory: ``cuMemGetInfo`` (``device_free_bytes``)
and the stand-in's own counter of live physical allocations are the
independent measures, fault injection makes driver calls fail, and the call
counters show what one map or unmap costs in driver calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import fakecuda
import pytest

from allocator import (
    AllocatorContractError,
    BackendError,
    BlockAllocator,
    CudaBackend,
    DeviceOutOfMemory,
    FencedBackend,
    PageAllocator,
    PageLayout,
    ThreadGuard,
    UnmapFence,
    map_or_free_cache,
)

MiB = 1 << 20
PAGE = 2 * MiB
DEFAULT_TOTAL = 4096 * MiB


@pytest.fixture
def make(fc: fakecuda.FakeCuda) -> Iterator[Callable[..., CudaBackend]]:
    made: list[CudaBackend] = []

    def make_backend(num_pages: int = 8, num_regions: int = 2, **kw: int) -> CudaBackend:
        backend = CudaBackend.reserve(PageLayout(PAGE, num_pages, num_regions), **kw)
        made.append(backend)
        return backend

    yield make_backend
    fc.heal()
    for backend in made:
        backend.release()


def _held(fc: fakecuda.FakeCuda) -> int:
    return fc.used_bytes()


# ---------------------------------------------------------------- out of memory, overcommit
def test_out_of_memory_is_a_clear_error_and_leaks_nothing(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    backend = make(16, 2, spare_handles=0)
    fc.set_total_bytes(fc.used_bytes() + 10 * PAGE)  # room for 5 bundles of 2 regions
    backend.map_many([0, 1])
    used, free = fc.used_bytes(), backend.device_free_bytes()
    with pytest.raises(
        DeviceOutOfMemory,
        match=r"out of memory: mapping 4 page\(s\) needs 16 "
        r"MiB and the device has 12 MiB free",
    ):
        backend.map_many([3, 4, 5, 6])
    assert fc.used_bytes() == used and backend.device_free_bytes() == free
    assert [p for p in range(16) if backend.is_mapped(p)] == [0, 1]
    assert backend.mapped_bytes() == backend.held_bytes() == 2 * backend.layout.bundle_bytes
    backend.map_many([3, 4, 5])  # what fits still maps
    assert backend.device_free_bytes() == 0


def test_out_of_memory_in_a_later_region_rolls_the_page_back(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    backend = make(4, 3)  # default spares: one bundle
    fc.set_total_bytes(fc.used_bytes() + 2 * PAGE)  # two of the three regions fit
    before = fc.num_mappings()
    with pytest.raises(DeviceOutOfMemory, match="needs 6 MiB and the device has 4 MiB free"):
        backend.map(0)
    assert not backend.is_mapped(0) and backend.mapped_bytes() == 0
    assert fc.num_mappings() == before  # the two regions that were mapped are unmapped again
    assert backend.held_bytes() == 0  # and their handles released: memory is short


def test_two_overcommitted_pools_share_the_device_and_never_exceed_it(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    """Virtual 2 x 48 MiB on a 64 MiB device: memory follows the targets from one to the other."""
    base = fc.used_bytes()
    device = 32 * PAGE
    fc.set_total_bytes(base + device)
    pools = []
    for _ in range(2):
        backend = make(24, 1)
        pages = PageAllocator(backend)
        pools.append((backend, pages, BlockAllocator(pages, 4)))
    (a, pa, ba), (b, pb, bb) = pools
    assert 2 * a.layout.total_bytes > device

    def check() -> None:
        used = fc.used_bytes() - base
        assert used <= device
        assert used == a.held_bytes() + b.held_bytes()
        assert a.device_free_bytes() == device - used

    got_a = ba.alloc(4 * 24)  # A alone: all its 24 pages
    assert got_a is not None and a.mapped_bytes() == 24 * PAGE
    check()
    got_b = bb.alloc(4 * 8)  # B: what is left
    assert got_b is not None
    check()
    # the device is full: B's allocation is refused (no exception), B holds, A is intact
    assert bb.alloc(4) is None and pb.device_full and bb.num_free_blocks == 0
    check()
    assert pb.num_mapped == 8 and a.mapped_bytes() == 24 * PAGE
    # The limits move: A down to 4 pages, B up to everything it has.
    pa.set_target(4)
    pb.set_target(None)
    ba.free(got_a[: 4 * 20])
    assert a.mapped_bytes() == 4 * PAGE
    check()
    more = bb.alloc(4 * 16)  # B takes what A gave back (A keeps one spare page)
    assert more is not None and pb.num_mapped == 24
    check()
    assert fc.used_bytes() - base == 24 * PAGE + 4 * PAGE + a.held_bytes() - a.mapped_bytes()
    # and back again
    bb.free(more)
    pb.set_target(8)
    pa.set_target(None)
    again = ba.alloc(4 * 20)
    assert again is not None and pa.num_mapped == 24
    check()


# ---------------------------------------------------------------- bugs (fail on the old code)
def test_a_failing_unmap_leaves_the_page_mapped_and_a_retry_frees_it(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    backend = make(4, 3, spare_handles=0)
    before = fc.used_bytes()
    backend.map_many([1, 2])
    fc.fail("cuMemUnmap", after=1, count=1)  # region 1 of page 1 fails
    with pytest.raises(BackendError, match="cuMemUnmap failed"):
        backend.unmap(1)
    assert backend.is_mapped(1)  # the books say what the driver holds
    assert backend.mapped_bytes() == 4 * PAGE  # page 1 region 1 + page 2's three
    assert fc.used_bytes() - before == backend.held_bytes() == 4 * PAGE
    backend.unmap(1)  # the retry unmaps the one region left
    assert not backend.is_mapped(1)
    assert fc.used_bytes() - before == backend.mapped_bytes() == 3 * PAGE


def test_release_after_a_failing_unmap_still_frees_the_range(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    backend = make(4, 2)
    before = fc.used_bytes()
    backend.map_many([0, 3])
    fc.fail("cuMemUnmap", count=1)
    fc.reset_calls()
    with pytest.raises(BackendError, match="call release\\(\\) again"):
        backend.release()
    with pytest.raises(AllocatorContractError, match="release\\(\\) again"):
        backend.map(1)
    assert fc.calls("cuMemAddressFree") == 0  # a range with mappings in it cannot be freed
    backend.release()
    assert fc.calls("cuMemAddressFree") == 1 and fc.calls("cuDevicePrimaryCtxRelease") == 1
    assert fc.used_bytes() == before
    backend.release()  # idempotent once done
    assert fc.calls("cuDevicePrimaryCtxRelease") == 1


def test_a_failing_release_call_keeps_the_handle_for_a_retry(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    backend = make(4, 1, spare_handles=0)
    before = fc.used_bytes()
    backend.map(2)
    fc.fail("cuMemRelease", count=1)
    backend.unmap(2)  # the unmap itself worked
    assert not backend.is_mapped(2) and backend.mapped_bytes() == 0
    assert backend.held_bytes() == fc.used_bytes() - before == PAGE
    backend.trim_spares()
    assert backend.held_bytes() == 0 and fc.used_bytes() == before


def test_device_free_bytes_works_from_a_thread_without_a_context(
    make: Callable[..., CudaBackend],
) -> None:
    backend = make(4, 1)
    backend.map(0)
    here = backend.device_free_bytes()
    got: list[int | BaseException] = []

    def other() -> None:
        try:
            got.append(backend.device_free_bytes())
            got.append(backend.device_free_bytes())
        except BackendError as exc:  # reported below
            got.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert got == [here, here]
    assert backend.device_free_bytes() == here  # this thread's context untouched


def test_priming_out_of_memory_frees_the_cache_once_then_says_so(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    cache = make(8, 1, spare_handles=0)  # stands for torch's caching allocator
    kv = make(8, 2, spare_handles=0)
    fc.set_total_bytes(fc.used_bytes() + 16 * PAGE)
    cache.map_many(range(8))
    emptied: list[int] = []

    def empty_cache() -> None:
        emptied.append(1)
        cache.unmap_many(range(8))

    map_or_free_cache(kv, range(4), empty_cache)  # 8 pages needed, 8 free: no retry
    assert emptied == []
    kv.unmap_many(range(4))
    map_or_free_cache(kv, range(8), empty_cache)  # 16 needed: the cache goes, then it fits
    assert emptied == [1] and kv.mapped_bytes() == 16 * PAGE
    kv.unmap_many(range(8))
    cache.map_many(range(8))
    fc.set_total_bytes(fc.used_bytes() + 2 * PAGE)
    with pytest.raises(DeviceOutOfMemory, match="even after freeing cached device memory"):
        map_or_free_cache(kv, range(8), lambda: None)
    assert kv.mapped_bytes() == 0


# ---------------------------------------------------------------- spare handles: driver calls
def test_a_map_after_an_unmap_makes_no_cuMemCreate(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    regions = 4
    backend = make(8, regions)
    backend.map_many([0, 1])
    fc.reset_calls()
    backend.unmap(1)
    assert (fc.calls("cuMemUnmap"), fc.calls("cuMemRelease")) == (regions, 0)
    assert backend.held_bytes() - backend.mapped_bytes() == backend.layout.bundle_bytes
    fc.reset_calls()
    backend.map(5)
    assert (fc.calls("cuMemCreate"), fc.calls("cuMemMap"), fc.calls("cuMemSetAccess")) == (
        0,
        regions,
        regions,
    )
    fc.reset_calls()
    backend.unmap_many([0, 5])  # two bundles: one kept, one released
    assert (fc.calls("cuMemUnmap"), fc.calls("cuMemRelease")) == (2 * regions, regions)
    backend.trim_spares()
    assert backend.held_bytes() == 0


def test_spares_are_given_back_by_release(fc: fakecuda.FakeCuda) -> None:
    before = fc.used_bytes()
    with CudaBackend.reserve(PageLayout(PAGE, 4, 2)) as backend:
        backend.map_many([0, 1])
        backend.unmap_many([0, 1])
        assert fc.used_bytes() - before == backend.layout.bundle_bytes
    assert fc.used_bytes() == before


# ---------------------------------------------------------------- the unmap fence
class _Event:
    """A device event that notes, at each synchronize, whether page 3 was still mapped."""

    def __init__(self, backend: CudaBackend, log: list[str]) -> None:
        self.backend, self.log = backend, log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append(
            f"wait(mapped={self.backend.is_mapped(3)},held={self.backend.mapped_bytes() // PAGE})"
        )


def test_fenced_cuda_backend_waits_for_the_event_before_the_driver_unmaps(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    backend = make(8, 1)
    log: list[str] = []
    fence = UnmapFence(lambda: _Event(backend, log), lambda: log.append("device-sync"))
    pages = PageAllocator(FencedBackend(backend, fence), guard=ThreadGuard("t"))
    blocks = BlockAllocator(pages, 1)
    got = blocks.alloc(4)
    assert got is not None
    fence.record()  # the forward pass that read them
    pages.set_target(0)
    fc.reset_calls()
    blocks.free([3])
    assert log == ["record", "record", "wait(mapped=True,held=4)"]  # recorded again, waited
    assert fc.calls("cuMemUnmap") == 1 and not backend.is_mapped(3)


class _FaultedEvent(_Event):
    """Its synchronize fails as torch's does after a kernel fault (RuntimeError)."""

    broken = True

    def synchronize(self) -> None:
        super().synchronize()
        if _FaultedEvent.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failing_fence_wait_unmaps_nothing_and_keeps_the_books(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event wait before an unmap fails (the device faulted): nothing may be unmapped
    (queued work may still use it), the error is a BackendError the page allocator books
    (pages out of service, still mapped, retried), never a RuntimeError that leaves pages
    in use with no blocks in them."""
    backend = make(8, 2)
    base_maps = fc.num_mappings()
    log: list[str] = []
    fence = UnmapFence(lambda: _FaultedEvent(backend, log), lambda: log.append("device-sync"))
    guard = ThreadGuard("t")
    guard.bind_current()
    pages = PageAllocator(FencedBackend(backend, fence), guard=guard)
    blocks = BlockAllocator(pages, 1, guard=guard)
    got = blocks.alloc(4)
    assert got is not None
    fence.record()
    with pytest.raises(BackendError, match="restart the engine") as info:
        blocks.free(got)
    assert "illegal memory access" in str(info.value)
    assert blocks.num_allocated_blocks == 0
    assert fc.num_mappings() - base_maps == 2 * 4  # nothing unmapped: the wait failed
    assert [pages.page_state(p).name for p in range(4)] == ["UNMAP_FAILED"] * 4
    assert pages.num_mapped == 4 and backend.mapped_bytes() == 4 * backend.layout.bundle_bytes
    monkeypatch.setattr(_FaultedEvent, "broken", False)
    pages.set_target(None)  # a limit change retries the unmaps, waiting first
    assert log[-1] == "wait(mapped=True,held=8)"
    assert fc.num_mappings() == base_maps and pages.num_mapped == 0


# ---------------------------------------------------------------- adversarial
@pytest.mark.parametrize("seed", [2026, 7, 99, 12345])
def test_random_driver_failures_never_split_the_books_from_the_driver(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend], seed: int
) -> None:
    """Random map/unmap/trim with random injected failures (unmap, release, create, map,
    access, out of memory): after every call the backend's books equal what the driver holds."""
    import random

    rng = random.Random(seed)
    base_used, base_maps = fc.used_bytes(), fc.num_mappings()
    backend = make(12, 3, spare_handles=rng.choice([0, 3, 6]))
    victims = ["cuMemUnmap", "cuMemRelease", "cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    errors = 0
    for _step in range(300):
        if rng.random() < 0.3:
            err = fakecuda.CUDA_ERROR_OUT_OF_MEMORY if rng.random() < 0.3 else 1
            fc.fail(rng.choice(victims), after=rng.randint(0, 4), count=rng.randint(1, 2), err=err)
        mapped = [p for p in range(12) if backend.is_mapped(p)]
        free = [p for p in range(12) if p not in mapped]
        try:
            roll = rng.random()
            if roll < 0.45 and free:
                backend.map_many(rng.sample(free, rng.randint(1, min(4, len(free)))))
            elif roll < 0.9 and mapped:
                backend.unmap_many(rng.sample(mapped, rng.randint(1, min(4, len(mapped)))))
            else:
                backend.trim_spares(rng.randint(0, 2))
        except BackendError:
            errors += 1
        regions_mapped = sum(h is not None for hs in backend._handles if hs for h in hs)
        assert fc.num_mappings() - base_maps == regions_mapped
        assert backend.mapped_bytes() == regions_mapped * PAGE
        assert fc.used_bytes() - base_used == backend.held_bytes()
    fc.heal()
    assert errors > 20
    backend.release()
    assert fc.used_bytes() == base_used and fc.num_mappings() == base_maps


def test_touching_an_unmapped_page_faults(fc: fakecuda.FakeCuda) -> None:
    """The stand-in faults like a GPU does (illegal address): data checks that pass mean it."""
    import signal
    import subprocess
    import sys

    code = (
        "import ctypes, sys; sys.path[:0] = sys.argv[1:3]; import fakecuda; fakecuda.preload()\n"
        "from allocator import CudaBackend, PageLayout\n"
        "b = CudaBackend.reserve(PageLayout(2 << 20, 2, 1)); b.map_many([0, 1])\n"
        "ctypes.memset(b.base_address, 7, 2 << 20); b.unmap(0)\n"
        "assert ctypes.string_at(b.base_address + (2 << 20), 1) == b'\\x00'\n"
        "print('before', flush=True); ctypes.string_at(b.base_address, 1); print('after')\n"
    )
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", code, str(repo / "tests"), str(repo)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout == "before\n", proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGSEGV


# ---------------------------------------------------------------- failed rollbacks
def test_a_map_whose_rollback_fails_leaves_the_page_unmapped_for_the_page_allocator(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    """The third region's map fails and the rollback cannot unmap the first: the page
    allocator saw the map fail, so the page must not be mapped for it either, and the next
    map of that page (or a trim) unmaps what was left before mapping again."""
    backend = make(4, 3, spare_handles=0)
    pages = PageAllocator(backend, guard=ThreadGuard("t"))
    pages.guard.bind_current()
    base_maps, base_used = fc.num_mappings(), fc.used_bytes()
    fc.fail("cuMemMap", after=2)  # region 2 of the page
    fc.fail("cuMemUnmap", count=1)  # the rollback of region 0
    assert pages.acquire() is None and pages.refused_by_device  # a refusal, never a raise
    assert pages.num_mapped == 0
    assert not any(backend.is_mapped(p) for p in range(4))  # the books agree: nothing mapped
    assert fc.num_mappings() - base_maps == 1  # ... and the driver still holds one region
    assert backend.mapped_bytes() == PAGE and fc.used_bytes() - base_used == backend.held_bytes()
    fc.heal()
    pages.set_target(None)  # a limit change tries the device again (no DEVICE_RETRY_S wait)
    page = pages.acquire()  # the same page: the leftover region is unmapped first
    assert page is not None and backend.is_mapped(page) and pages.num_mapped == 1
    assert fc.num_mappings() - base_maps == 3 and backend.mapped_bytes() == 3 * PAGE
    pages.release(page)
    assert fc.num_mappings() == base_maps and backend.mapped_bytes() == 0


def test_a_trim_finishes_a_failed_rollback(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    backend = make(4, 2, spare_handles=0)
    base_maps = fc.num_mappings()
    fc.fail("cuMemMap", after=1)
    fc.fail("cuMemUnmap", count=1)
    with pytest.raises(BackendError):
        backend.map_many([1, 2])
    assert not backend.is_mapped(1) and fc.num_mappings() - base_maps == 1
    fc.heal()
    backend.trim_spares()
    assert fc.num_mappings() == base_maps and backend.mapped_bytes() == 0


@pytest.mark.parametrize("seed", [3, 41, 2027])
def test_random_faults_never_split_the_page_allocator_from_the_backend(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend], seed: int
) -> None:
    """Blocks allocated and freed through PageAllocator/BlockAllocator over CudaBackend with
    random map failures whose rollback unmaps fail too: after every call a page is mapped for
    the page allocator exactly when the backend says so, and the driver holds what the books
    count. (Unmap failures on the free path: test_allocator_unmap_failures.py.)"""
    import random

    rng = random.Random(seed)
    base_maps, base_used = fc.num_mappings(), fc.used_bytes()
    backend = make(10, 3, spare_handles=rng.choice([0, 3]))
    guard = ThreadGuard("t")
    guard.bind_current()
    pages = PageAllocator(backend, guard=guard)
    blocks = BlockAllocator(pages, 4, guard=guard)
    held: list[int] = []
    errors = 0
    for _ in range(400):
        fc.heal()  # unmap faults only inside a failing map's rollback (see below)
        pages.set_target(None)  # a failed map holds the cap for a while: try the device now
        freeing = bool(held) and rng.random() < 0.45
        if not freeing and rng.random() < 0.35:
            if rng.random() < 0.3:
                fc.fail("cuMemCreate", after=rng.randint(0, 3))  # nothing to roll back
            else:  # a later region of the first new page, or its access: a rollback follows
                victim = rng.choice(["cuMemMap", "cuMemSetAccess"])
                fc.fail(victim, after=rng.randint(1, 2) if victim == "cuMemMap" else 0)
                if rng.random() < 0.6:  # ... and the rollback's first unmap fails too
                    fc.fail("cuMemUnmap")
        try:
            if freeing:
                rng.shuffle(held)
                count = rng.randint(1, len(held))
                blocks.free(held[:count])
                del held[:count]
            else:
                got = blocks.alloc(rng.randint(1, 6))
                if got is not None:
                    held.extend(got)
                elif blocks.refused_by_device:  # a failed map: refused, rolled back
                    errors += 1
        except BackendError:
            errors += 1
        for page in range(10):
            assert (pages.page_state(page).name != "UNMAPPED") == backend.is_mapped(page), page
        regions = sum(h is not None for hs in backend._handles if hs for h in hs)
        assert fc.num_mappings() - base_maps == regions == backend.mapped_bytes() // PAGE
        assert fc.used_bytes() - base_used == backend.held_bytes()
    fc.heal()
    assert errors > 10
    blocks.free(held)
    backend.trim_spares()
    assert blocks.num_allocated_blocks == 0, [pages.page_state(p).name for p in range(10)]
    assert fc.num_mappings() == base_maps, [pages.page_state(p).name for p in range(10)]


# ---------------------------------------------------------------- reservation and context
def test_a_failing_context_release_is_retried_by_the_next_release(fc: fakecuda.FakeCuda) -> None:
    refs, ranges = fc.primary_refs(0), fc.num_reservations()
    backend = CudaBackend.reserve(PageLayout(PAGE, 4, 2))
    backend.map_many([0, 1])
    assert fc.primary_refs(0) == refs + 1
    fc.fail("cuDevicePrimaryCtxRelease", count=1)
    with pytest.raises(BackendError, match=r"cuDevicePrimaryCtxRelease failed.*release\(\) again"):
        backend.release()
    assert fc.num_reservations() == ranges and backend.held_bytes() == 0  # the rest went back
    with pytest.raises(AllocatorContractError, match=r"release\(\) again"):
        backend.map(2)
    backend.release()  # the retry gives the context back
    assert fc.primary_refs(0) == refs
    backend.release()  # and is idempotent once done
    assert fc.primary_refs(0) == refs


def test_a_reservation_the_address_space_refuses_is_not_a_device_out_of_memory(
    fc: fakecuda.FakeCuda,
) -> None:
    """``cuMemAddressReserve`` answers CUDA_ERROR_OUT_OF_MEMORY when the *virtual* range is
    too large: no device memory is involved, so freeing some (what DeviceOutOfMemory asks
    for) cannot help; the error names the size and says to reserve less."""
    refs, ranges = fc.primary_refs(0), fc.num_reservations()
    fc.fail("cuMemAddressReserve", count=1, err=fakecuda.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(BackendError) as info:
        CudaBackend.reserve(PageLayout(PAGE, 512, 4))
    assert not isinstance(info.value, DeviceOutOfMemory)
    assert "4096 MiB of virtual address space" in str(info.value)
    assert "fewer pages or regions" in str(info.value)
    assert fc.primary_refs(0) == refs and fc.num_reservations() == ranges  # nothing kept
    with CudaBackend.reserve(PageLayout(PAGE, 512, 4)) as backend:  # the next one works
        backend.map(0)


def test_a_failed_map_keeps_no_handle_beyond_the_spare_cap(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    """spare_handles=0: a handle whose cuMemMap failed is released at once, as an unmapped
    one is (a backend told to keep no spares holds no device memory it does not map)."""
    backend = make(4, 2, spare_handles=0)
    before = fc.used_bytes()
    fc.fail("cuMemMap", after=1, count=1)  # region 1 of page 0
    with pytest.raises(BackendError, match="cuMemMap failed"):
        backend.map(0)
    assert backend.held_bytes() == backend.mapped_bytes() == 0
    assert fc.used_bytes() == before
    backend.map(0)
    assert backend.held_bytes() == fc.used_bytes() - before == backend.layout.bundle_bytes


# ---------------------------------------------------------------- what cuda-bindings raises
UNKNOWN_RESULT = 12345  # a code cuda-bindings has no CUresult for: it raises ValueError


@pytest.mark.parametrize(
    ("victim", "after"),
    [
        ("cuMemSetAccess", 1),  # region 1 of the first run (pages 0, 1): both pages mapped
        ("cuMemMap", 3),  # region 1 of page 1: page 0 and region 0 of page 1 are mapped
        ("cuMemCreate", 2),  # page 1's first handle
    ],
)
def test_a_foreign_exception_while_mapping_rolls_back_like_a_backend_error(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend], victim: str, after: int
) -> None:
    """A driver result cuda-bindings cannot decode raises ``ValueError`` out of the binding,
    not a BackendError: the pages mapped so far are unmapped all the same, no handle beyond
    the spare cap is kept, the caller gets a BackendError saying what to do, and the next
    map works."""
    backend = make(8, 2, spare_handles=0)
    used, maps = fc.used_bytes(), fc.num_mappings()
    fc.fail(victim, after=after, count=1, err=UNKNOWN_RESULT)
    with pytest.raises(BackendError, match=r"cuda-bindings raised ValueError.*nothing was mapped"):
        backend.map_many([0, 1, 3])
    assert not any(backend.is_mapped(p) for p in range(8))
    assert backend.mapped_bytes() == backend.held_bytes() == 0
    assert fc.num_mappings() == maps and fc.used_bytes() == used
    base, size = backend.base_address, backend.layout.page_bytes
    assert not any(fc.mapped_at(base + page * size) for page in (0, 1, 3))
    backend.map_many([0, 1, 3])
    assert fc.num_mappings() - maps == 6 and backend.mapped_bytes() == 6 * PAGE


def test_a_foreign_exception_from_a_rollback_unmap_leaves_the_page_stuck_not_lost(
    fc: fakecuda.FakeCuda, make: Callable[..., CudaBackend]
) -> None:
    """The rollback's own cuMemUnmap raising ValueError: the page is kept in the books as
    a failed rollback (its handle counted, the driver's mapping with it) and a trim undoes it."""
    backend = make(4, 2, spare_handles=0)
    used, maps = fc.used_bytes(), fc.num_mappings()
    fc.fail("cuMemMap", after=1, count=1)  # region 1 of page 0
    fc.fail("cuMemUnmap", count=1, err=UNKNOWN_RESULT)  # its rollback of region 0
    with pytest.raises(BackendError, match="cuMemMap failed"):
        backend.map(0)
    assert not backend.is_mapped(0)
    assert fc.num_mappings() - maps == 1 and backend.mapped_bytes() == PAGE
    assert fc.used_bytes() - used == backend.held_bytes()
    backend.trim_spares()
    assert fc.num_mappings() == maps and backend.held_bytes() == 0 and fc.used_bytes() == used


# ---------------------------------------------------------------- the calling thread's context
def _in_fresh_thread(work: Callable[[], None]) -> None:
    """Run ``work`` on a new thread (no CUDA context current there) and re-raise its error."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 -- handed to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_the_constructing_thread_keeps_its_context_and_every_call_still_works(
    fc: fakecuda.FakeCuda,
) -> None:
    """Reserving used to leave the device's context current on the constructing thread.
    Now the thread has what it had (none) after the constructor and after each call, and
    calls work even on a driver that wants a current context for every cuMem* call."""
    fc.set_strict_ctx(True)
    refs = fc.primary_refs(0)

    def work() -> None:
        assert fc.current_context() == 0
        backend = CudaBackend.reserve(PageLayout(PAGE, 4, 2))
        assert fc.current_context() == 0
        backend.map_many([0, 1])
        backend.unmap(1)
        backend.map(2)
        backend.unmap_many([0])
        backend.trim_spares()
        assert fc.current_context() == 0
        assert backend.mapped_bytes() == backend.layout.bundle_bytes
        backend.release()
        assert fc.current_context() == 0
        backend.release()  # idempotent, context or not

    _in_fresh_thread(work)
    assert fc.primary_refs(0) == refs


def test_a_constructor_that_fails_puts_the_threads_context_back(fc: fakecuda.FakeCuda) -> None:
    refs = fc.primary_refs(0)

    def work() -> None:
        fc.fail("cuMemAddressReserve", count=1)
        with pytest.raises(BackendError, match="virtual address space"):
            CudaBackend.reserve(PageLayout(PAGE, 4, 2))
        assert fc.current_context() == 0

    _in_fresh_thread(work)
    assert fc.primary_refs(0) == refs


def test_a_refused_context_release_after_a_failed_start_keeps_the_error_and_logs_the_leak(
    fc: fakecuda.FakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    refs = fc.primary_refs(0)
    fc.fail("cuMemAddressReserve", count=1, err=fakecuda.CUDA_ERROR_OUT_OF_MEMORY)
    fc.fail("cuDevicePrimaryCtxRelease", count=1)
    with (
        caplog.at_level("WARNING", logger="allocator._cuda"),
        pytest.raises(BackendError, match="virtual address space"),  # the start's own error
    ):
        CudaBackend.reserve(PageLayout(PAGE, 4, 2))
    leaks = [r.getMessage() for r in caplog.records if r.name == "allocator._cuda"]
    assert len(leaks) == 1 and "primary context failed too" in leaks[0]
    assert "cuDevicePrimaryCtxRelease failed" in leaks[0]
    assert fc.primary_refs(0) == refs + 1  # the leak the line reports
    fc.lib.cuDevicePrimaryCtxRelease(0)  # (give it back for the next tests)
    assert fc.primary_refs(0) == refs
