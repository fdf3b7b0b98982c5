"""Allocator cost at scale, by counting operations (never by timing), and batched unmaps.

Timings live in ``bench/bench_scale.py``; these tests count what the
allocator asks of its observer and its backend, on a real memfd.
"""

from __future__ import annotations

import mmap
import random
from collections.abc import Callable, Sequence

import pytest

from allocator import (
    AllocatorContractError,
    BackendError,
    BlockAllocator,
    HostBackend,
    PageAllocator,
    PageLayout,
    PageState,
)

MakeHost = Callable[..., HostBackend]
BPP = 16


class CountingBlocks(BlockAllocator):
    """A BlockAllocator that counts every question the PageAllocator asks it."""

    calls = 0

    def live_blocks(self, page: int) -> int:
        self.calls += 1
        return super().live_blocks(page)

    def fullest_retired(self) -> int:
        self.calls += 1
        return super().fullest_retired()

    def on_retired(self, page: int, retired: bool) -> None:
        self.calls += 1
        super().on_retired(page, retired)


class CountingBackend:
    """A real HostBackend that records each map/unmap call (page lists included)."""

    def __init__(self, inner: HostBackend) -> None:
        self.inner = inner
        self.layout, self.base_address = inner.layout, inner.base_address
        self.unmap_calls: list[list[int]] = []
        self.fail_unmap = False

    def map(self, page: int) -> None:
        self.inner.map(page)

    def map_many(self, pages: Sequence[int]) -> None:
        self.inner.map_many(pages)

    def unmap(self, page: int) -> None:
        self.unmap_many([page])

    def unmap_many(self, pages: Sequence[int]) -> None:
        if self.fail_unmap:
            raise BackendError("injected: munmap failed (errno 12)", errno=12)
        self.unmap_calls.append(list(pages))
        self.inner.unmap_many(pages)

    def is_mapped(self, page: int) -> bool:
        return self.inner.is_mapped(page)

    def mapped_bytes(self) -> int:
        return self.inner.mapped_bytes()

    def release(self) -> None:
        self.inner.release()


def shrink_pass_ops(num_blocks: int, seed: int) -> float:
    """Observer calls per freed page: fill, halve the target, drain to 0 in random order."""
    num_pages = num_blocks // BPP
    layout = PageLayout(mmap.PAGESIZE, num_pages, 1)
    backend = HostBackend.reserve(layout, name="kvsidecar-scale")
    try:
        pages = PageAllocator(backend)
        blocks = CountingBlocks(pages, BPP)
        got = blocks.alloc(num_pages * BPP)
        assert got is not None
        rng = random.Random(seed)
        rng.shuffle(got)
        # leave pages unevenly full so retirement has real choices to make
        blocks.free(got[: len(got) // 4])
        live = got[len(got) // 4 :]
        in_use = pages.num_in_use
        blocks.calls = 0
        pages.set_target(in_use // 2)
        assert pages.num_retired == in_use - in_use // 2
        for block in live:  # one free() per block: every emptied page is its own release
            blocks.free([block])
        assert pages.num_in_use == 0 and pages.num_retired == 0
        assert backend.mapped_bytes() == 0  # measured: every page went back
        return blocks.calls / in_use
    finally:
        backend.release()


def test_shrink_pass_costs_the_same_per_page_at_1k_and_100k_blocks() -> None:
    small = shrink_pass_ops(1024, seed=1)
    large = shrink_pass_ops(100_000, seed=2)
    # a scan of the retired set per release made this ratio ~100 (quadratic pass)
    assert large <= 1.5 * small, (small, large)


def test_the_page_taken_back_is_always_a_fullest_retired_one(make_host: MakeHost) -> None:
    backend = make_host(num_pages=64)
    pages = PageAllocator(backend)
    blocks = BlockAllocator(pages, 8)
    rng = random.Random(7)
    got = blocks.alloc(64 * 8)
    assert got is not None
    rng.shuffle(got)
    blocks.free(got[:200])
    live = set(got[200:])
    pages.set_target(10)
    while live:
        retired_before = {p for p in range(64) if pages.is_retired(p)}
        block = rng.choice(sorted(live))
        live.discard(block)
        emptied_in_use = blocks.occupancy(block // 8) == 1 and block // 8 not in retired_before
        best = max((blocks.occupancy(p) for p in retired_before), default=0)
        blocks.free([block])
        back = {p for p in retired_before if not pages.is_retired(p)} - {block // 8}
        if emptied_in_use and retired_before:
            assert len(back) == 1 and blocks.occupancy(back.pop()) == best
        else:
            assert not back


def test_release_many_unmaps_contiguous_pages_in_one_call(make_host: MakeHost) -> None:
    inner = make_host(num_pages=8)
    backend = CountingBackend(inner)
    pages = PageAllocator(backend)
    blocks = BlockAllocator(pages, 2)
    got = blocks.alloc(8)  # pages 0..3 full
    assert got is not None
    blocks.free(got[:6])  # pages 0, 1, 2 empty in one call
    assert backend.unmap_calls == [[0, 1, 2]]
    assert inner.mapped_bytes() == inner.layout.bundle_bytes  # measured: one page left
    assert [pages.page_state(p) for p in range(4)] == [PageState.UNMAPPED] * 3 + [PageState.IN_USE]


def test_release_many_matches_sequential_releases_while_pages_are_retired(
    make_host: MakeHost,
) -> None:
    inner = make_host(num_pages=8)
    backend = CountingBackend(inner)
    pages = PageAllocator(backend, reserve_pages=1)
    blocks = BlockAllocator(pages, 2)
    got = blocks.alloc(12)  # pages 0..5 full
    assert got is not None
    blocks.free([got[1], got[3], got[5]])  # pages 0, 1, 2 hold one block each
    pages.set_target(3)  # pages 0, 1, 2 retire (fewest blocks)
    assert pages.num_retired == 3
    # page 0 (retired) and pages 3, 4 (in use) empty in one call: page 0 goes, and
    # pages 3 and 4 each take one retired page back; all three unmap in one call
    blocks.free([got[0], got[6], got[7], got[8], got[9]])
    assert backend.unmap_calls == [[0, 3, 4]]
    assert pages.num_retired == 0 and pages.num_in_use == 3
    assert inner.mapped_bytes() == 3 * inner.layout.bundle_bytes


def test_a_batched_unmap_that_unmaps_nothing_parks_the_pages_out_of_service(
    make_host: MakeHost,
) -> None:
    inner = make_host(num_pages=4)
    backend = CountingBackend(inner)
    pages = PageAllocator(backend)
    pages.acquire(), pages.acquire()
    backend.fail_unmap = True  # the whole call fails: nothing unmapped
    with pytest.raises(BackendError, match=r"could not unmap page\(s\) \[0, 1\].*injected"):
        pages.release_many([0, 1])
    # released (they hold no blocks) but still mapped: out of service, counted as mapped
    assert pages.num_in_use == 0 and pages.num_unmap_failed == 2 and pages.num_mapped == 2
    assert [pages.page_state(p) for p in (0, 1)] == [PageState.UNMAP_FAILED] * 2
    assert inner.mapped_bytes() == 2 * inner.layout.bundle_bytes
    assert pages.acquire() == 2  # a parked page is never handed out
    backend.fail_unmap = False
    with pytest.raises(AllocatorContractError, match="twice"):
        pages.release_many([2, 2])
    with pytest.raises(AllocatorContractError, match="UNMAP_FAILED, not in use"):
        pages.release_many([1, 2])
    assert pages.num_in_use == 1 and pages.num_unmap_failed == 2  # bad batches change nothing
    pages.release_many([2])  # a good release retries the parked pages too
    assert pages.num_mapped == 0 and pages.num_unmap_failed == 0 and inner.mapped_bytes() == 0


@pytest.mark.parametrize("reserve", [1, 2, 5])
def test_the_reserve_hands_out_the_lowest_page_first(make_host: MakeHost, reserve: int) -> None:
    backend = make_host(num_pages=8)
    pages = PageAllocator(backend, reserve_pages=reserve)
    blocks = BlockAllocator(pages, 16)
    assert blocks.alloc(1) == [0]  # vLLM's null block must be block 0
    assert pages.page_state(0) is PageState.IN_USE
    more = blocks.alloc(16 * reserve)
    assert more is not None
    assert sorted({b // 16 for b in more}) == list(range(reserve + 1))


def _free_after_eviction_brute(held: list[int], cap: int, bpp: int) -> int:
    """The reference: try every choice of ``cap`` pages among those still in use."""
    from itertools import combinations

    in_use = [n for n in held if n > 0]
    if len(in_use) <= cap:
        return max(0, cap * bpp - sum(in_use))
    return min(sum(bpp - n for n in chosen) for chosen in combinations(in_use, cap))


@pytest.mark.parametrize("tracked", [True, False])
def test_free_after_eviction_matches_the_least_room_of_any_choice(
    make_host: MakeHost, tracked: bool
) -> None:
    """``free_after_eviction`` (SGLang's admission bound while pages are retired) equals
    the least free room over every choice of ``cap`` pages among those still holding
    non-evictable blocks, for random fills, marks and caps."""
    rng = random.Random(7)
    bpp = 4
    for trial in range(60):
        backend = make_host(num_pages=8)
        blocks = BlockAllocator(PageAllocator(backend), bpp)
        if tracked:
            blocks.track_evictable()
        taken = blocks.alloc(rng.randrange(1, blocks.num_blocks + 1))
        assert taken is not None
        dropped = rng.sample(taken, rng.randrange(len(taken)))
        blocks.free(dropped)
        live = sorted(set(taken) - set(dropped))
        evictable = rng.sample(live, rng.randrange(len(live) + 1))
        if tracked:
            blocks.mark_evictable(evictable)
        held = [0] * blocks.pages.num_pages
        for block in set(live) - set(evictable):
            held[block // bpp] += 1
        assert blocks.held_per_page() == (
            held if tracked else [blocks.occupancy(p) for p in range(len(held))]
        )
        for cap in range(blocks.pages.num_pages + 1):
            got = blocks.free_after_eviction(cap, None if tracked else evictable)
            assert got == _free_after_eviction_brute(held, cap, bpp), (trial, cap, held)


@pytest.mark.parametrize(
    ("cap", "unlocked", "message"),
    [
        (-1, None, "cap_pages must be an int in 0..8"),
        (9, None, "cap_pages must be an int in 0..8"),
        (2.0, None, "cap_pages must be an int in 0..8"),
        (2, [0, 32], "32 is not a block id in 0..31"),
        (2, [-1], "-1 is not a block id in 0..31"),
    ],
)
def test_free_after_eviction_rejects_bad_input_and_changes_nothing(
    make_host: MakeHost, cap: object, unlocked: list[int] | None, message: str
) -> None:
    blocks = BlockAllocator(PageAllocator(make_host(num_pages=8)), 4)
    blocks.track_evictable()
    taken = blocks.alloc(10)
    assert taken is not None
    blocks.mark_evictable(taken[:3])
    before = (blocks.held_per_page(), blocks.num_allocated_blocks, blocks.changes)
    with pytest.raises(AllocatorContractError, match=message):
        blocks.free_after_eviction(cap, unlocked)  # type: ignore[arg-type]
    assert (blocks.held_per_page(), blocks.num_allocated_blocks, blocks.changes) == before
