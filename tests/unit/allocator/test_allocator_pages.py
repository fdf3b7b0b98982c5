"""PageAllocator and BlockAllocator on a real HostBackend: targets, reserve, retirement."""

from __future__ import annotations

import mmap
import types
from collections.abc import Callable, Sequence

import pytest

import allocator._pages as pages_module
from allocator import (
    AllocatorConfigError,
    AllocatorContractError,
    BackendError,
    BlockAllocator,
    DeviceOutOfMemory,
    HostBackend,
    PageAllocator,
    PageLayout,
    PageState,
)

MakeHost = Callable[..., HostBackend]


def measured_pages(backend: HostBackend) -> int:
    bytes_ = backend.mapped_bytes()
    assert bytes_ % backend.layout.bundle_bytes == 0
    return bytes_ // backend.layout.bundle_bytes


def stack(
    make_host: MakeHost, *, pages: int = 8, bpp: int = 4, reserve: int = 0, regions: int = 2
) -> tuple[HostBackend, PageAllocator, BlockAllocator]:
    backend = make_host(num_pages=pages, num_regions=regions)
    page_alloc = PageAllocator(backend, reserve_pages=reserve)
    return backend, page_alloc, BlockAllocator(page_alloc, bpp)


def test_reserve_is_premapped_and_counted(make_host: MakeHost) -> None:
    backend, pages, blocks = stack(make_host, reserve=2)
    assert measured_pages(backend) == 2 == pages.num_mapped == pages.num_free_mapped
    assert blocks.num_free_blocks == 8 * 4
    got = blocks.alloc(1)
    assert got is not None
    assert measured_pages(backend) == 2  # came out of the reserve: no new mapping
    blocks.free(got)
    assert pages.num_free_mapped == 2 and pages.num_in_use == 0


def test_blocks_fill_the_fullest_partly_used_page_first(make_host: MakeHost) -> None:
    _, pages, blocks = stack(make_host, bpp=4)
    first = blocks.alloc(8)  # pages 0 and 1, full
    assert first is not None and sorted({blocks.page_of(b) for b in first}) == [0, 1]
    blocks.free([first[0]])  # page 0 holds 3
    blocks.free(first[4:6])  # page 1 holds 2
    one = blocks.alloc(1)
    assert one is not None and blocks.page_of(one[0]) == 0  # fullest partly used page
    two = blocks.alloc(3)
    assert two is not None
    assert sorted(blocks.page_of(b) for b in two) == [1, 1, 2]  # page 1 first, then a new page
    assert pages.num_in_use == 3
    assert blocks.occupancy(1) == 4 and blocks.blocks_on_page(2) == [two[-1]]


def test_alloc_is_all_or_nothing(make_host: MakeHost) -> None:
    backend, pages, blocks = stack(make_host, pages=4, bpp=4)
    pages.set_target(2)
    assert blocks.alloc(9) is None
    assert blocks.num_allocated_blocks == 0 and measured_pages(backend) == 0
    got = blocks.alloc(8)
    assert got is not None and len(set(got)) == 8
    assert blocks.alloc(1) is None
    assert blocks.alloc(0) == []


def test_lower_target_unmaps_free_pages_at_once_and_zero_is_valid(make_host: MakeHost) -> None:
    backend, pages, blocks = stack(make_host, reserve=3)
    assert measured_pages(backend) == 3
    pages.set_target(1)
    assert measured_pages(backend) == 1
    pages.set_target(0)
    assert measured_pages(backend) == 0
    assert blocks.alloc(1) is None and blocks.num_free_blocks == 0
    pages.set_target(None)
    assert measured_pages(backend) == 3  # the reserve comes back


def test_in_use_pages_above_target_retire_and_unmap_when_emptied(make_host: MakeHost) -> None:
    backend, pages, blocks = stack(make_host, bpp=4)
    got = blocks.alloc(4 + 4 + 1)  # page 0 full, page 1 full, page 2 holds 1
    assert got is not None
    blocks.free(got[4:7])  # page 1 now holds 1 block, page 0 four, page 2 one
    pages.set_target(1)
    # two pages must retire: the ones with fewest live blocks (1 and 2), not page 0
    assert {p for p in range(8) if pages.is_retired(p)} == {1, 2}
    assert blocks.num_retired_blocks == 2
    assert measured_pages(backend) == 3  # running blocks keep them mapped for now
    assert blocks.alloc(1) is None  # page 0 is full; retired pages take nothing
    blocks.free([got[7]])  # page 1 empties -> unmapped, not recycled
    assert pages.page_state(1) is PageState.UNMAPPED
    assert measured_pages(backend) == 2 and pages.num_retired == 1
    blocks.free([got[8]])
    assert measured_pages(backend) == 1 and pages.num_retired == 0
    assert blocks.num_free_blocks == 0


def test_emptied_page_is_unmapped_while_others_are_retired(make_host: MakeHost) -> None:
    backend, pages, blocks = stack(make_host, bpp=2)
    got = blocks.alloc(5)  # pages 0, 1 full; page 2 holds 1
    assert got is not None
    pages.set_target(2)  # page 2 (fewest blocks) retires
    assert pages.is_retired(2)
    blocks.free(got[0:2])  # page 0 empties: unmapped, and page 2 comes back into service
    assert pages.page_state(0) is PageState.UNMAPPED
    assert not pages.is_retired(2) and pages.num_retired == 0
    assert measured_pages(backend) == 2
    again = blocks.alloc(1)
    assert again is not None and blocks.page_of(again[0]) == 2


def test_raising_the_target_takes_retired_pages_back(make_host: MakeHost) -> None:
    _, pages, blocks = stack(make_host, bpp=2)
    got = blocks.alloc(3)
    assert got is not None
    pages.set_target(0)
    assert pages.num_retired == 2 and blocks.num_retired_blocks == 3
    pages.set_target(1)
    assert pages.num_retired == 1 and not pages.is_retired(0)  # the fuller page returns first
    pages.set_target(None)
    assert pages.num_retired == 0 and blocks.num_retired_blocks == 0
    more = blocks.alloc(1)
    assert more is not None and blocks.page_of(more[0]) == 1


def test_bad_calls_raise_and_change_nothing(make_host: MakeHost) -> None:
    backend, pages, blocks = stack(make_host)
    got = blocks.alloc(3)
    assert got is not None
    snapshot = (blocks.num_allocated_blocks, blocks.num_free_blocks, measured_pages(backend))
    for bad in ([got[0], got[0]], [got[0], 31], [got[0], 999], [got[0], -1]):
        with pytest.raises(AllocatorContractError):
            blocks.free(bad)
        assert (
            blocks.num_allocated_blocks,
            blocks.num_free_blocks,
            measured_pages(backend),
        ) == snapshot
        assert all(blocks.is_allocated(b) for b in got)
    with pytest.raises(AllocatorContractError):
        blocks.alloc(-1)
    with pytest.raises(AllocatorContractError):
        pages.set_target(-1)
    with pytest.raises(AllocatorContractError, match="not in use"):
        pages.release(5)
    for query in (
        blocks.occupancy,
        blocks.blocks_on_page,
        pages.page_state,
        pages.is_retired,
        backend.is_mapped,
    ):
        with pytest.raises(AllocatorContractError, match="outside"):
            query(-1)
        with pytest.raises(AllocatorContractError, match="outside"):
            query(8)
    assert pages.target_pages is None
    with pytest.raises(AllocatorContractError, match="already serves"):
        BlockAllocator(pages, 4)


def test_configuration_errors_say_what_works(make_host: MakeHost) -> None:
    with pytest.raises(AllocatorConfigError, match="capacity of zero"):
        PageLayout(mmap.PAGESIZE, 0)
    with pytest.raises(AllocatorConfigError, match="page_bytes >= 8192"):
        PageLayout(4096, 4).blocks_per_page(8192)
    assert PageLayout(16384, 4).blocks_per_page(5000) == 3
    backend = make_host(num_pages=4)
    with pytest.raises(AllocatorConfigError, match="between 0 and the capacity"):
        PageAllocator(backend, reserve_pages=5)
    with pytest.raises(AllocatorConfigError, match="blocks_per_page"):
        BlockAllocator(PageAllocator(backend), 0)


def test_layout_geometry() -> None:
    layout = PageLayout(8192, 10, 3)
    assert layout.region_bytes == 81920
    assert layout.bundle_bytes == 24576
    assert layout.total_bytes == 245760
    assert layout.page_offset(2, 4) == 2 * 81920 + 4 * 8192
    with pytest.raises(IndexError):
        layout.page_offset(3, 0)


class FailingMaps:
    """A real HostBackend whose ``map`` of one chosen page fails (fault injection)."""

    def __init__(self, inner: HostBackend, bad_page: int) -> None:
        self.inner, self.bad_page = inner, bad_page
        self.layout, self.base_address = inner.layout, inner.base_address

    def map(self, page: int) -> None:
        if page == self.bad_page:
            raise BackendError("injected: fallocate failed (errno 28)", errno=28)
        self.inner.map(page)

    def map_many(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.map(page)

    def unmap(self, page: int) -> None:
        self.inner.unmap(page)

    def unmap_many(self, pages: Sequence[int]) -> None:
        self.inner.unmap_many(pages)

    def is_mapped(self, page: int) -> bool:
        return self.inner.is_mapped(page)

    def mapped_bytes(self) -> int:
        return self.inner.mapped_bytes()

    def release(self) -> None:
        self.inner.release()


def test_a_failed_map_rolls_the_whole_alloc_back(make_host: MakeHost) -> None:
    inner = make_host(num_pages=4)
    backend = FailingMaps(inner, bad_page=2)
    pages = PageAllocator(backend)
    blocks = BlockAllocator(pages, 2)
    first = blocks.alloc(1)  # page 0, half full
    assert first is not None
    # fills page 0, maps page 1, then page 2 fails: a refusal (None), as for a device out of
    # memory: an exception here would end the engine (its allocation path)
    assert blocks.alloc(4) is None and blocks.refused_by_device
    assert blocks.num_allocated_blocks == 1 and blocks.blocks_on_page(0) == first
    assert pages.num_in_use == 1 and pages.page_state(1) is PageState.UNMAPPED
    assert pages.page_state(2) is PageState.UNMAPPED
    assert inner.mapped_bytes() == inner.layout.bundle_bytes  # measured: page 1 went back
    assert pages.device_full  # the cap holds at what is mapped for DEVICE_RETRY_S
    backend.bad_page = -1
    pages.set_target(None)  # a limit change tries the device again at once
    again = blocks.alloc(4)
    assert again is not None and blocks.num_allocated_blocks == 5


def test_a_bad_evictable_mark_raises_and_leaves_counts_matching_the_flags(
    make_host: Callable[..., HostBackend],
) -> None:
    """One flag per block (free / allocated / marked): a wrong mark or unmark names the
    block, and the counts still agree with the blocks marked before it."""
    pages = PageAllocator(make_host(num_pages=4))
    blocks = BlockAllocator(pages, 4)
    blocks.track_evictable()
    got = blocks.alloc(4)
    assert got is not None
    free_block = 4  # page 1: never handed out
    with pytest.raises(AllocatorContractError, match="not allocated"):
        blocks.mark_evictable([got[0], got[1], free_block, got[2]])
    assert blocks.num_evictable_blocks == 2
    assert [blocks.is_marked_evictable(b) for b in got] == [True, True, False, False]
    with pytest.raises(AllocatorContractError, match="already marked"):
        blocks.mark_evictable([got[2], got[1]])
    assert blocks.num_evictable_blocks == 3 and blocks.num_reclaimable_pages == 0
    blocks.mark_evictable([got[3]])
    assert blocks.num_reclaimable_pages == 1  # the page's every block is evictable
    with pytest.raises(AllocatorContractError, match="not marked"):
        blocks.unmark_evictable([got[3], free_block])
    assert blocks.num_evictable_blocks == 3 and blocks.num_reclaimable_pages == 0
    assert blocks.is_allocated(got[3]) and not blocks.is_marked_evictable(got[3])
    blocks.free(got)  # marked or not, every allocated block can be freed
    assert blocks.num_evictable_blocks == 0 and blocks.num_allocated_blocks == 0
    assert pages.num_mapped == 0


class _Refusing:
    """The host backend with maps the test can make fail (device full, or another error)."""

    def __init__(self, inner: HostBackend) -> None:
        self.inner = inner
        self.error: BackendError | None = None

    def map_many(self, pages: Sequence[int]) -> None:
        if self.error is not None:
            raise self.error
        self.inner.map_many(pages)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_refill_reserve_maps_what_acquire_took_within_the_target(make_host: MakeHost) -> None:
    backend, pages, blocks = stack(make_host, reserve=2)  # 8 pages of 4 blocks
    got = blocks.alloc(12)  # 3 pages: the 2 reserve pages, then one map
    assert got is not None and measured_pages(backend) == 3 and pages.num_free_mapped == 0
    assert pages.reserve_wanted() == 2
    assert pages.refill_reserve() == 2
    assert measured_pages(backend) == pages.num_mapped == 5 and pages.num_free_mapped == 2
    assert pages.refill_reserve() == 0 and measured_pages(backend) == 5  # already full
    more = blocks.alloc(4)  # a page out of the reserve: nothing mapped
    assert more is not None and measured_pages(backend) == 5
    pages.set_target(5)  # 4 in use + 1 free: the target leaves no room for a second
    assert pages.reserve_wanted() == 0 and pages.refill_reserve() == 0
    assert measured_pages(backend) == 5
    pages.set_target(2)  # 2 pages retired: no reserve while any is
    assert pages.num_retired == 2 and measured_pages(backend) == 4
    assert pages.reserve_wanted() == 0 and pages.refill_reserve() == 0
    assert measured_pages(backend) == 4


def test_refill_reserve_on_a_full_device_holds_the_cap(
    make_host: MakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = make_host(num_pages=8)
    backend = _Refusing(host)
    pages = PageAllocator(backend, reserve_pages=2)  # type: ignore[arg-type]
    blocks = BlockAllocator(pages, 4)
    assert blocks.alloc(8) is not None and pages.num_free_mapped == 0
    backend.error = DeviceOutOfMemory("the test says the device is full")
    assert pages.refill_reserve() == 0  # not raised: a safe point must not end the engine
    assert pages.device_full and pages.cap_pages() == 2 == measured_pages(host)
    assert pages.reserve_wanted() == 0  # held at what is mapped until the device is tried again
    backend.error = BackendError("the test's map failed")
    pages.set_target(None)  # limits moved: the device is tried again (the refill in it fails)
    assert not pages.device_full and pages.refill_reserve() == 0  # fails: logged, not raised
    assert measured_pages(host) == 2 and pages.reserve_wanted() == 2
    backend.error = None
    assert pages.refill_reserve() == 0  # held: a failing backend is not retried every step
    real = pages_module.time.monotonic
    monkeypatch.setattr(
        pages_module,
        "time",
        types.SimpleNamespace(monotonic=lambda: real() + pages_module.DEVICE_RETRY_S),
    )
    assert pages.refill_reserve() == 2 and measured_pages(host) == 4 == pages.num_mapped


def test_alloc_above_target_serves_a_running_request_and_retires_the_page(
    make_host: MakeHost,
) -> None:
    backend, pages, blocks = stack(make_host)
    held = blocks.alloc(8)  # pages 0 and 1 full
    assert held is not None
    pages.set_target(2)
    assert blocks.alloc(1) is None  # an admission: nothing under the target
    got = blocks.alloc_above_target(1)
    assert got is not None and blocks.page_of(got[0]) == 2
    assert pages.target_pages == 2  # put back at once
    assert measured_pages(backend) == 3 and pages.num_retired == 1  # the page above it
    assert blocks.alloc(1) is None  # the retired page takes no new block
    blocks.free(got)  # its last block goes: unmapped
    assert measured_pages(backend) == 2 and pages.num_retired == 0
