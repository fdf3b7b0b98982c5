"""An unmap that fails part-way through a batch: the page books follow what really happened.

``unmap_many`` is not all or nothing (each backend tries every page, then
raises), so ``PageAllocator`` books exactly the pages the backend unmapped and
parks the others as ``UNMAP_FAILED`` (no blocks, never handed out, counted as
mapped, unmapped again by the next release or limit change). Checked against
independent measures: ``/proc/self/maps`` and the memfd's committed bytes on
the host backend, the stand-in CUDA driver's own mapping table on CudaBackend.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import fakecuda
import pytest

from allocator import (
    BackendError,
    BlockAllocator,
    CudaBackend,
    HostBackend,
    PageAllocator,
    PageLayout,
    PageState,
    ThreadGuard,
)
from allocator import _libc as libc

MakeHost = Callable[..., HostBackend]
PAGE = 2 << 20  # the stand-in's granularity


def proc_perms(address: int) -> str:
    """The permissions /proc/self/maps shows for ``address`` (``rw-s``, ``---s``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return perms
    raise AssertionError(f"{address:#x} is not in /proc/self/maps")


def host_regions_open(backend: HostBackend, page: int) -> list[bool]:
    """Per region, whether ``page`` is readable and writable there (from /proc)."""
    layout = backend.layout
    return [
        proc_perms(backend.base_address + layout.page_offset(region, page)).startswith("rw")
        for region in range(layout.num_regions)
    ]


@pytest.fixture
def fail_close_at(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Make ``mprotect(PROT_NONE)`` of any range covering an address fail (EINVAL)."""
    real = libc.close_range

    def arm(address: int) -> None:
        def close_range(addr: int, length: int) -> None:
            if addr <= address < addr + length:
                raise BackendError(f"injected: mprotect({addr:#x}) failed (errno 22)", errno=22)
            real(addr, length)

        monkeypatch.setattr(libc, "close_range", close_range)

    return arm


def test_host_a_failing_region_mid_batch_is_booked_exactly(
    make_host: MakeHost, fail_close_at: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make_host(num_pages=8, num_regions=2)
    layout = backend.layout
    pages = PageAllocator(backend)
    blocks = BlockAllocator(pages, 2)
    got = blocks.alloc(12)  # pages 0..5 full
    assert got is not None
    # region 1 of page 2 will not close: pages 0, 2, 4 are three runs of one unmap_many
    fail_close_at(backend.base_address + layout.page_offset(1, 2))
    with pytest.raises(BackendError, match=r"could not unmap page\(s\) \[2\] of 3.*injected"):
        blocks.free([b for b in got if b // 2 in (0, 2, 4)])
    states = [pages.page_state(p) for p in range(6)]
    assert states == [
        PageState.UNMAPPED,
        PageState.IN_USE,
        PageState.UNMAP_FAILED,
        PageState.IN_USE,
        PageState.UNMAPPED,
        PageState.IN_USE,
    ]
    # every book says what /proc says: a page is unmapped exactly when no region is open
    for page in range(8):
        open_regions = host_regions_open(backend, page)
        assert backend.is_mapped(page) == any(open_regions), page
        assert (pages.page_state(page) is not PageState.UNMAPPED) == any(open_regions), page
    assert host_regions_open(backend, 2) == [False, True]  # region 0 went, region 1 stayed
    # measured: three whole pages and the one region still committed
    assert backend.mapped_bytes() == 3 * layout.bundle_bytes + layout.page_bytes
    assert pages.num_mapped == 4 and pages.num_unmap_failed == 1
    again = blocks.alloc(2)  # a parked page is never handed out (page 0, unmapped, comes back)
    assert again is not None and {b // 2 for b in again} == {0}
    monkeypatch.undo()  # the driver heals: the next release unmaps the parked page too
    blocks.free(again)
    assert pages.page_state(2) is PageState.UNMAPPED and pages.num_unmap_failed == 0
    assert host_regions_open(backend, 2) == [False, False]
    blocks.free([b for b in got if b // 2 in (1, 3, 5)])
    assert pages.num_mapped == 0 and backend.mapped_bytes() == 0  # nothing leaked


def test_host_a_failing_unmap_of_the_reserve_never_hands_out_a_closed_page(
    make_host: MakeHost, fail_close_at: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make_host(num_pages=8, num_regions=2)
    layout = backend.layout
    pages = PageAllocator(backend, reserve_pages=3)  # pages 0, 1, 2 mapped, free
    # region 0 of page 1: the reserve is one run, so its region 0 stays open (region 1 closes)
    fail_close_at(backend.base_address + layout.page_offset(0, 1))
    with pytest.raises(BackendError, match=r"could not unmap page\(s\) \[0, 1, 2\]"):
        pages.set_target(0)
    assert [pages.page_state(p) for p in range(3)] == [PageState.UNMAP_FAILED] * 3
    assert pages.num_free_mapped == 0 and pages.headroom_pages() == 0
    for page in range(8):
        assert backend.is_mapped(page) == any(host_regions_open(backend, page)), page
    assert host_regions_open(backend, 1) == [True, False]
    assert backend.mapped_bytes() == 3 * layout.page_bytes  # measured: region 0 of each
    with pytest.raises(BackendError, match="injected"):
        pages.set_target(5)  # the retry fails again; the reserve refills beside the parked
    assert pages.num_unmap_failed == 3 and pages.num_free_mapped == 2
    page = pages.acquire()
    assert page == 3 and all(host_regions_open(backend, page))
    monkeypatch.undo()
    pages.set_target(None)  # a limit change retries the unmap (and refills the reserve)
    assert pages.num_unmap_failed == 0
    for p in range(8):
        assert (pages.page_state(p) is not PageState.UNMAPPED) == all(
            host_regions_open(backend, p)
        ), p
    pages.release(page)
    pages.set_target(0)
    assert pages.num_mapped == 0 and backend.mapped_bytes() == 0


# ---------------------------------------------------------------- the stand-in CUDA driver
@pytest.fixture
def make_cuda(fc: fakecuda.FakeCuda) -> Iterator[Callable[..., CudaBackend]]:
    made: list[CudaBackend] = []

    def make(num_pages: int = 8, num_regions: int = 3, **kw: int) -> CudaBackend:
        backend = CudaBackend.reserve(PageLayout(PAGE, num_pages, num_regions), **kw)
        made.append(backend)
        return backend

    yield make
    fc.heal()
    for backend in made:
        backend.release()


def driver_regions(fc: fakecuda.FakeCuda, backend: CudaBackend, page: int) -> list[bool]:
    layout = backend.layout
    return [
        fc.mapped_at(backend.base_address + layout.page_offset(region, page))
        for region in range(layout.num_regions)
    ]


def check_books(fc: fakecuda.FakeCuda, backend: CudaBackend, pages: PageAllocator) -> None:
    """Every book against the driver: per page, and the bytes held."""
    for page in range(backend.layout.num_pages):
        held = any(driver_regions(fc, backend, page))
        assert backend.is_mapped(page) == held, page
        assert (pages.page_state(page) is not PageState.UNMAPPED) == held, page


def test_cuda_a_failing_unmap_mid_batch_is_booked_exactly(
    fc: fakecuda.FakeCuda, make_cuda: Callable[..., CudaBackend]
) -> None:
    base_used, base_maps = fc.used_bytes(), fc.num_mappings()
    backend = make_cuda(8, 3, spare_handles=0)
    guard = ThreadGuard("t")
    guard.bind_current()
    pages = PageAllocator(backend, guard=guard)
    blocks = BlockAllocator(pages, 1, guard=guard)
    got = blocks.alloc(6)  # pages 0..5
    assert got is not None
    # the unmap of [0, 2, 4]: page 0's three regions, page 2 region 0, then region 1 fails
    fc.fail("cuMemUnmap", after=4)
    with pytest.raises(BackendError, match=r"could not unmap page\(s\) \[2\] of 3"):
        blocks.free([0, 2, 4])
    check_books(fc, backend, pages)
    assert driver_regions(fc, backend, 2) == [False, True, False]
    assert pages.page_state(2) is PageState.UNMAP_FAILED
    assert [pages.page_state(p) for p in (0, 4)] == [PageState.UNMAPPED] * 2
    assert fc.num_mappings() - base_maps == 3 * 3 + 1 == backend.mapped_bytes() // PAGE
    assert fc.used_bytes() - base_used == backend.held_bytes()
    again = blocks.alloc(2)  # pages 0 and 4 come back, never the parked page 2
    assert again is not None and 2 not in again
    check_books(fc, backend, pages)
    fc.heal()
    blocks.free(again)  # the release retries the parked page
    check_books(fc, backend, pages)
    assert pages.num_unmap_failed == 0
    blocks.free([1, 3, 5])
    assert fc.num_mappings() == base_maps and fc.used_bytes() == base_used  # nothing leaked


@pytest.mark.parametrize("seed", [5, 77, 2028])
def test_cuda_random_unmap_faults_on_the_free_path_never_split_the_books(
    fc: fakecuda.FakeCuda, make_cuda: Callable[..., CudaBackend], seed: int
) -> None:
    """Random allocs, frees and limit changes through Block/PageAllocator with random
    ``cuMemUnmap`` failures on the free and shrink paths: after every call each page's
    state agrees with the driver's mapping table, and the driver holds what the books count."""
    rng = random.Random(seed)
    base_used, base_maps = fc.used_bytes(), fc.num_mappings()
    backend = make_cuda(10, 3, spare_handles=rng.choice([0, 3]))
    guard = ThreadGuard("t")
    guard.bind_current()
    pages = PageAllocator(backend, reserve_pages=rng.choice([0, 2]), guard=guard)
    blocks = BlockAllocator(pages, rng.choice([1, 2]), guard=guard)
    held: list[int] = []
    errors = 0
    for _ in range(300):
        fc.heal()
        if rng.random() < 0.5:
            fc.fail("cuMemUnmap", after=rng.randint(0, 6), count=rng.randint(1, 3))
        roll = rng.random()
        try:
            if roll < 0.45 and held:
                rng.shuffle(held)
                count = rng.randint(1, len(held))
                batch, held = held[:count], held[count:]
                blocks.free(batch)  # the blocks are freed even when an unmap fails
            elif roll < 0.85:
                got = blocks.alloc(rng.randint(1, 7))
                if got is not None:
                    held.extend(got)
            else:
                pages.set_target(rng.choice([None, 0, 2, 5]))
        except BackendError:
            errors += 1
        check_books(fc, backend, pages)
        regions = sum(h is not None for hs in backend._handles if hs for h in hs)
        assert fc.num_mappings() - base_maps == regions == backend.mapped_bytes() // PAGE
        assert fc.used_bytes() - base_used == backend.held_bytes()
        assert blocks.num_allocated_blocks == len(held)
        assert pages.num_unmap_failed == sum(
            pages.page_state(p) is PageState.UNMAP_FAILED for p in range(10)
        )
    fc.heal()
    assert errors > 10
    blocks.free(held)
    pages.set_target(0)  # retries whatever is parked, unmaps the reserve
    backend.trim_spares()
    assert pages.num_mapped == 0 and pages.num_unmap_failed == 0
    assert fc.num_mappings() == base_maps and fc.used_bytes() == base_used  # nothing leaked


def _failing_close_at(
    monkeypatch: pytest.MonkeyPatch, backend: HostBackend, page: int, page_bytes: int
) -> None:
    """``close_range`` (mprotect PROT_NONE) refuses every span holding ``page``."""
    bad = backend.base_address + page * page_bytes
    real = libc.close_range

    def close_range(addr: int, length: int) -> None:
        if addr <= bad < addr + length:
            raise BackendError("injected: mprotect(PROT_NONE) failed (errno 12)", errno=12)
        real(addr, length)

    monkeypatch.setattr(libc, "close_range", close_range)


def test_alloc_above_target_keeps_its_blocks_when_putting_the_target_back_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Putting the target back drops a reserve page whose unmap fails: the blocks handed
    out are still returned (they were lost: allocated, on a retired page, never freed)."""
    import mmap

    backend = HostBackend.reserve(PageLayout(mmap.PAGESIZE, 8), name="kvs-test-above")
    pages = PageAllocator(backend, reserve_pages=2)
    blocks = BlockAllocator(pages, 1)
    assert blocks.alloc(3) == [0, 1, 2]  # pages 0, 1, 2; the reserve refilled (3, 4)
    pages.set_target(3)
    _failing_close_at(monkeypatch, backend, 4, mmap.PAGESIZE)
    ids = blocks.alloc_above_target(1)
    assert ids is not None and len(ids) == 1
    live = [b for b in range(blocks.num_blocks) if blocks.is_allocated(b)]
    assert sorted(live) == sorted([0, 1, 2, *ids])  # every allocated block is the caller's
    assert pages.target_pages == 3
    monkeypatch.undo()
    blocks.free([0, 1, 2, *ids])
    pages.set_target(0)
    assert pages.num_mapped == 0 and backend.mapped_bytes() == 0


def test_alloc_above_target_puts_the_target_back_when_lifting_it_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page out of service (its unmap failed) makes lifting the target raise: the
    target must come back all the same (it stayed lifted, and later allocations mapped
    past the limit)."""
    import mmap

    backend = HostBackend.reserve(PageLayout(mmap.PAGESIZE, 8), name="kvs-test-above")
    pages = PageAllocator(backend)
    blocks = BlockAllocator(pages, 1)
    assert blocks.alloc(3) == [0, 1, 2]
    pages.set_target(3)
    _failing_close_at(monkeypatch, backend, 1, mmap.PAGESIZE)
    with pytest.raises(BackendError):
        blocks.free([1])  # page 1 empties; its unmap fails: out of service
    assert pages.num_unmap_failed == 1
    ids = blocks.alloc_above_target(1)
    assert ids is not None and pages.target_pages == 3
    monkeypatch.undo()
    assert blocks.alloc(4) is None  # under the target: no page past the limit
    assert pages.target_pages == 3 and pages.num_mapped <= 4


# ------------------------------------------------- a failed map whose rollback fails too
def _fail_open_at(monkeypatch: pytest.MonkeyPatch, address: int) -> None:
    """Make ``mprotect(READ|WRITE)`` of any range covering ``address`` fail (ENOMEM)."""
    real = libc.open_range

    def open_range(addr: int, length: int) -> None:
        if addr <= address < addr + length:
            raise BackendError(f"injected: mprotect({addr:#x}, RW) failed (errno 12)", errno=12)
        real(addr, length)

    monkeypatch.setattr(libc, "open_range", open_range)


def test_host_a_map_whose_rollback_fails_is_dropped_later_and_never_booked(
    make_host: MakeHost, fail_close_at: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Region 1 of a fresh page will not open, and the rollback cannot close region 0: the
    map's own error is the one raised, the page is not mapped for anybody (the page allocator
    saw a refusal), and what the rollback left open and committed (measured in /proc and in
    the memfd) is dropped by the next trim, with no leftover after the faults heal."""
    backend = make_host(num_pages=4, num_regions=2)
    layout = backend.layout
    pages = PageAllocator(backend)
    _fail_open_at(monkeypatch, backend.base_address + layout.page_offset(1, 0))
    fail_close_at(backend.base_address + layout.page_offset(0, 0))
    with pytest.raises(BackendError, match=r"RW\) failed"):  # the map's error, not the rollback's
        backend.map(0)
    assert not backend.is_mapped(0) and backend.num_mapped_pages == 0
    assert backend.num_stuck_pages == 1
    assert host_regions_open(backend, 0) == [True, False]  # what the rollback could not close
    assert backend.mapped_bytes() >= layout.page_bytes  # region 0 is still committed
    assert pages.acquire() is None and pages.refused_by_device  # a refusal, nothing booked
    assert pages.num_mapped == 0
    monkeypatch.undo()  # the faults heal
    backend.trim_spares()  # what PageAllocator calls after each unmap
    assert backend.num_stuck_pages == 0
    assert host_regions_open(backend, 0) == [False, False] and backend.mapped_bytes() == 0
    pages.set_target(None)  # try the device again now
    page = pages.acquire()
    assert page is not None and all(host_regions_open(backend, page))
    pages.release(page)
    assert backend.mapped_bytes() == 0 and not any(host_regions_open(backend, 0))


def test_host_a_stuck_page_is_dropped_before_it_is_mapped_again(
    make_host: MakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """map_many over two runs: the second run's map fails and rolling back the first run
    fails too. Those pages are stuck, not mapped; mapping one of them again first drops what
    was left, then maps it whole."""
    backend = make_host(num_pages=6, num_regions=1)
    layout = backend.layout
    real_close = libc.close_range
    closes = {"fail": True}

    def close_range(addr: int, length: int) -> None:
        if closes["fail"]:
            raise BackendError("injected: mprotect(PROT_NONE) failed (errno 22)", errno=22)
        real_close(addr, length)

    _fail_open_at(monkeypatch, backend.base_address + layout.page_offset(0, 4))
    monkeypatch.setattr(libc, "close_range", close_range)
    with pytest.raises(BackendError, match=r"RW\) failed"):
        backend.map_many([0, 1, 4])  # runs [0, 1] (opened) and [4] (fails to open)
    assert [backend.is_mapped(p) for p in range(6)] == [False] * 6
    assert backend.num_stuck_pages == 3  # [0, 1] could not close; 4 was committed, not closed
    assert host_regions_open(backend, 0) == [True] and host_regions_open(backend, 1) == [True]
    closes["fail"] = False
    backend.map(1)  # page 1's leftovers are dropped first, then it is mapped whole
    assert backend.is_mapped(1) and backend.num_mapped_pages == 1
    assert backend.num_stuck_pages == 2
    monkeypatch.undo()
    backend.trim_spares()
    assert backend.num_stuck_pages == 0
    assert [any(host_regions_open(backend, p)) for p in range(6)] == [
        False, True, False, False, False, False
    ]  # fmt: skip
    assert backend.mapped_bytes() == layout.bundle_bytes  # only page 1 is committed
    backend.unmap(1)
    assert backend.mapped_bytes() == 0
