"""Hypothesis: random alloc/free/set_target sequences keep every allocator invariant.

The model here is deliberately naive (sets and dicts); the allocator must agree
with it after every step, and the backend's mapped bytes are read from fstat.
"""

from __future__ import annotations

import mmap

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout, PageState

targets = st.one_of(st.none(), st.integers(min_value=0, max_value=10))


class AllocatorMachine(RuleBasedStateMachine):
    """Drives BlockAllocator/PageAllocator over a real memfd with a naive model beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.backend: HostBackend | None = None
        self.live: set[int] = set()
        self.marked: set[int] = set()  # blocks the "cache" marked evictable (naive model)

    @initialize(
        num_pages=st.integers(1, 8),
        num_regions=st.integers(1, 2),
        bpp=st.integers(1, 4),
        reserve=st.integers(0, 2),
    )
    def build(self, num_pages: int, num_regions: int, bpp: int, reserve: int) -> None:
        layout = PageLayout(mmap.PAGESIZE, num_pages, num_regions)
        self.backend = HostBackend.reserve(layout, name="kvsidecar-prop")
        self.pages = PageAllocator(self.backend, reserve_pages=min(reserve, num_pages))
        self.blocks = BlockAllocator(self.pages, bpp)
        self.blocks.track_evictable()
        self.bpp = bpp

    def teardown(self) -> None:
        if self.backend is not None:
            self.backend.release()

    # ------------------------------------------------------------------ rules
    @rule(n=st.integers(0, 12))
    def alloc(self, n: int) -> None:
        retired_before = {p for p in range(self.pages.num_pages) if self.pages.is_retired(p)}
        could = self.blocks.num_free_blocks
        got = self.blocks.alloc(n)
        if n > could:
            assert got is None
            return
        assert got is not None and len(got) == n
        fresh = set(got)
        assert len(fresh) == n, "a block handed out twice in one call"
        assert not fresh & self.live, "a live block handed out again"
        assert not {self.blocks.page_of(b) for b in fresh} & retired_before, (
            "a retired page received a new block"
        )
        self.live |= fresh

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        self.blocks.free(chosen)
        self.live -= set(chosen)
        self.marked -= set(chosen)  # a freed block is no longer evictable

    @precondition(lambda self: bool(self.live - self.marked))
    @rule(data=st.data())
    def mark(self, data: st.DataObject) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(sorted(self.live - self.marked)), min_size=1, unique=True)
        )
        before = self.blocks.changes
        self.blocks.mark_evictable(chosen)
        assert self.blocks.changes > before
        self.marked |= set(chosen)

    @precondition(lambda self: bool(self.marked))
    @rule(data=st.data())
    def unmark(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.marked)), min_size=1, unique=True))
        self.blocks.unmark_evictable(chosen)
        self.marked -= set(chosen)

    @rule(pages=targets)
    def set_target(self, pages: int | None) -> None:
        self.pages.set_target(pages)

    @rule()
    def refill_reserve(self) -> None:  # a safe point
        wanted = self.pages.reserve_wanted()
        free_before = self.pages.num_free_mapped
        assert self.pages.refill_reserve() == wanted
        assert self.pages.reserve_wanted() == 0
        assert self.pages.num_free_mapped == free_before + wanted

    # ------------------------------------------------------------------ invariants
    @invariant()
    def evictable_counts_match_a_recount(self) -> None:
        blocks, bpp = self.blocks, self.bpp
        assert blocks.num_evictable_blocks == len(self.marked)
        reclaimable = sum(
            1
            for p in self._live_pages()
            if all(b in self.marked for b in self.live if b // bpp == p)
        )
        assert blocks.num_reclaimable_pages == reclaimable
        assert all(blocks.is_marked_evictable(b) == (b in self.marked) for b in self.live)
        assert all(
            blocks.evictable_on(p) == sum(1 for b in self.marked if b // bpp == p)
            for p in self._live_pages()
        )

    def _live_pages(self) -> set[int]:
        return {b // self.bpp for b in self.live}

    @invariant()
    def mapped_pages_are_bounded(self) -> None:
        assert self.backend is not None
        measured = self.backend.mapped_bytes()
        bundle = self.backend.layout.bundle_bytes
        assert measured % bundle == 0
        mapped = measured // bundle
        target = self.pages.target_pages
        live_pages = len(self._live_pages())
        bound = live_pages if target is None else max(target, live_pages)
        assert mapped <= bound + self.pages.reserve_pages
        assert mapped == self.pages.num_mapped
        if self.pages.num_retired == 0:
            assert mapped <= self.pages.cap_pages()

    @invariant()
    def counts_add_up(self) -> None:
        pages, blocks, bpp = self.pages, self.blocks, self.bpp
        live_pages = self._live_pages()
        retired = {p for p in range(pages.num_pages) if pages.is_retired(p)}
        assert blocks.num_allocated_blocks == len(self.live)
        assert blocks.num_retired_blocks == sum(1 for b in self.live if b // bpp in retired)
        assert pages.num_in_use == len(live_pages)  # an empty page never stays in use
        assert pages.num_mapped == pages.num_free_mapped + pages.num_in_use
        assert pages.num_retired == max(0, pages.num_in_use - pages.cap_pages())
        if pages.num_retired:
            assert pages.num_free_mapped == 0
        assert pages.num_free_mapped <= pages.reserve_pages
        open_slots = sum(bpp - blocks.occupancy(p) for p in live_pages - retired)
        assert blocks.num_free_blocks == open_slots + pages.headroom_pages() * bpp
        for page in range(pages.num_pages):
            on_page = sorted(b for b in self.live if b // bpp == page)
            assert blocks.blocks_on_page(page) == on_page
            assert blocks.occupancy(page) == len(on_page)
            state = pages.page_state(page)
            assert (state in (PageState.IN_USE, PageState.RETIRED)) == bool(on_page)
            assert self.backend is not None
            assert self.backend.is_mapped(page) == (state is not PageState.UNMAPPED)


TestAllocatorProperties = AllocatorMachine.TestCase
TestAllocatorProperties.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
