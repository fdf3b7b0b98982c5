"""Deferred retries and evictable/pinned figures cost O(1) when nothing changed (issue 17).

Operations are counted (listings of the cache, shrink passes), never timed.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
from engine_pool import (
    BLOCKS_PER_PAGE,
    BUNDLE,
    NUM_PAGES,
    NUM_REGIONS,
    PAGE_BYTES,
    ChangeKeyedPrefixCache,
    Pool,
    PrefixCache,
    Request,
    TrackingPrefixCache,
)

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout, ThreadGuard
from engine_ext import CoordinatorConfig, LimitMailbox, ShrinkCoordinator, count_reclaimable_pages
from engine_ext.protocol import EngineState, Status


def _pool(kind: type[PrefixCache]) -> Iterator[Pool]:
    layout = PageLayout(page_bytes=PAGE_BYTES, num_pages=NUM_PAGES, num_regions=NUM_REGIONS)
    backend = HostBackend.reserve(layout, name="engine-ext-counts")
    pages = PageAllocator(backend, guard=ThreadGuard("test-pool"))
    blocks = BlockAllocator(pages, BLOCKS_PER_PAGE)
    try:
        yield Pool(backend, pages, blocks, kind(blocks))
    finally:
        backend.release()


@pytest.fixture
def tracked() -> Iterator[Pool]:
    yield from _pool(TrackingPrefixCache)


@pytest.fixture
def keyed() -> Iterator[Pool]:
    yield from _pool(ChangeKeyedPrefixCache)


def make(pool: Pool, **config: object) -> tuple[LimitMailbox, ShrinkCoordinator]:
    mailbox = LimitMailbox(lambda: None)
    coordinator = ShrinkCoordinator(mailbox, pool.blocks, CoordinatorConfig(**config))  # type: ignore[arg-type]
    coordinator.add_reclaimer(pool.cache)
    return mailbox, coordinator


def listings(pool: Pool) -> int:
    return pool.cache.num_listings  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize("fixture", ["tracked", "keyed"])
def test_a_deferred_retry_with_no_block_event_runs_no_pass(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    pool: Pool = request.getfixturevalue(fixture)
    running = [pool.run(BLOCKS_PER_PAGE) for _ in range(3)]
    # retry_s 0: only the absence of block events may hold a retry back, not the clock
    mailbox, coord = make(pool, deferred_retry_s=0.0)
    mailbox.publish_next(BUNDLE)
    state = coord.step()
    assert (state.status, state.reason) == (Status.DEFERRED, "running_requests")
    passes, listed = state.passes, listings(pool)
    for _ in range(1000):
        assert coord.step().passes == passes
    assert listings(pool) == listed  # not one listing of the cache in 1000 retries
    pool.cache.finish(running[0])  # a block event: the next step runs a pass and evicts
    state = coord.step()
    assert state.passes == passes + 1 and pool.cache.num_evicted == BLOCKS_PER_PAGE
    assert state.mapped_bytes == pool.backend.mapped_bytes() == 2 * BUNDLE


def test_a_pass_lists_the_cache_only_when_a_page_is_all_evictable(tracked: Pool) -> None:
    running = [tracked.run(BLOCKS_PER_PAGE) for _ in range(2)]
    half = tracked.run(BLOCKS_PER_PAGE)
    mailbox, coord = make(tracked, deferred_retry_s=0.0)
    mailbox.publish_next(0)
    coord.step()
    tracked.cache.touch(half.blocks[0])  # still pinned, twice now
    tracked.cache.finish(half)  # a block event, but no page is all evictable
    listed = listings(tracked)
    state = coord.step()
    assert state.reason == "running_requests" and listings(tracked) == listed
    assert running


def _brute_force(pool: Pool) -> tuple[int, int]:
    evictable = [b for b in pool.cache.key_of if b not in pool.cache.refs]
    reclaimable = count_reclaimable_pages(evictable, pool.blocks)
    return reclaimable * BUNDLE, (pool.pages.num_in_use - reclaimable) * BUNDLE


def _traffic(pool: Pool, rng: random.Random, steps: int) -> list[Request]:
    live: list[Request] = []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.45:
            cached = list(pool.cache.by_key)
            hashes = rng.sample(cached, min(len(cached), rng.randint(0, 2))) + [
                rng.randint(10**6, 10**9) for _ in range(rng.randint(1, 3))
            ]
            req = pool.cache.start(hashes)
            if req is not None:
                live.append(req)
        elif roll < 0.8 and live:
            pool.cache.finish(live.pop(rng.randrange(len(live))))
        elif roll < 0.9 and pool.cache.refs:
            pool.cache.touch(rng.choice(sorted(pool.cache.refs)))
        else:
            evictable = [b for b in pool.cache.key_of if b not in pool.cache.refs]
            if evictable:
                pool.cache.evict(rng.sample(evictable, min(len(evictable), 3)))
    return live


@pytest.mark.parametrize("seed", range(6))
def test_figures_after_traffic_match_a_recount_within_one_pass(tracked: Pool, seed: int) -> None:
    rng = random.Random(seed)
    # an hour between rescans: only the O(1) counts can keep the figures right
    mailbox, coord = make(tracked, stats_interval_s=3600.0)
    coord.step()
    for _ in range(20):
        _traffic(tracked, rng, rng.randint(1, 15))
        state = coord.step()  # one pass after the change (idle from here on)
        assert (state.evictable_bytes, state.pinned_bytes) == _brute_force(tracked)
        assert mailbox.latest_state is state  # what the control socket reads
    if rng.random() < 0.5:
        mailbox.publish_next(rng.randint(0, NUM_PAGES) * BUNDLE)
        state = coord.step()
        assert (state.evictable_bytes, state.pinned_bytes) == _brute_force(tracked)


def test_figures_refresh_from_the_engine_thread_only(tracked: Pool) -> None:
    _mailbox, coord = make(tracked)
    coord.step()
    tracked.fill(2)
    errors: list[BaseException] = []

    def foreign() -> None:
        try:
            tracked.blocks.mark_evictable([])
        except BaseException as exc:  # noqa: BLE001 -- handed back to the test
            errors.append(exc)

    tracked.pages.guard.enabled = True
    thread = threading.Thread(target=foreign)
    thread.start()
    thread.join()
    assert len(errors) == 1 and type(errors[0]).__name__ == "ForeignThreadError"
    state: EngineState = coord.step()
    assert state.evictable_bytes == 2 * BUNDLE
