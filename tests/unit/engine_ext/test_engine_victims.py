"""Page-aware victim selection (shared by both adapters) on a real block allocator."""

from __future__ import annotations

from engine_pool import BLOCKS_PER_PAGE, Pool

from engine_ext import count_reclaimable_pages, select_victim_pages


def pages_of(pool: Pool, blocks: list[int]) -> set[int]:
    return {pool.blocks.page_of(b) for b in blocks}


def test_page_shared_with_running_request_is_never_chosen(pool: Pool) -> None:
    cached = pool.run(2)
    pool.cache.finish(cached)
    running = pool.run(2)  # best fit: lands on the same page as the cached blocks
    shared = pages_of(pool, cached.blocks)
    assert shared == pages_of(pool, running.blocks)
    full = pool.fill(2)
    chosen = select_victim_pages(
        pool.cache.evictable_blocks(), pool.blocks, 10, pool.cache.is_evictable
    )
    assert {p for p, _ in chosen} == pages_of(pool, [b for r in full for b in r.blocks])
    assert not shared & {p for p, _ in chosen}
    assert count_reclaimable_pages(pool.cache.evictable_blocks(), pool.blocks) == 2


def test_block_referenced_between_listing_and_choice_is_skipped(pool: Pool) -> None:
    reqs = pool.fill(3)
    listing = list(pool.cache.evictable_blocks())  # listed now ...
    hit = reqs[1].blocks[2]
    pool.cache.touch(hit)  # ... then a new request hits one block
    chosen = select_victim_pages(listing, pool.blocks, 10, pool.cache.is_evictable)
    assert pool.blocks.page_of(hit) not in {p for p, _ in chosen}
    assert len(chosen) == 2


def test_at_most_max_pages(pool: Pool) -> None:
    pool.fill(6)
    for max_pages in (0, 1, 4, 6, 9):
        chosen = select_victim_pages(
            pool.cache.evictable_blocks(), pool.blocks, max_pages, pool.cache.is_evictable
        )
        assert len(chosen) == min(max_pages, 6)
        assert all(len(blocks) == BLOCKS_PER_PAGE for _, blocks in chosen)


def test_fewest_blocks_first(pool: Pool) -> None:
    full = pool.fill(2)
    lone = pool.run(1)  # a page of its own with one block: 4x the memory per evicted block
    pool.cache.finish(lone)
    chosen = select_victim_pages(
        pool.cache.evictable_blocks(), pool.blocks, 1, pool.cache.is_evictable
    )
    assert chosen == [(pool.blocks.page_of(lone.blocks[0]), lone.blocks)]
    assert full  # the full pages wait


def test_stale_listing_of_freed_blocks_chooses_nothing_wrong(pool: Pool) -> None:
    reqs = pool.fill(2)
    listing = list(pool.cache.evictable_blocks())
    pool.cache.evict(reqs[0].blocks)  # gone before selection: its page is unmapped
    chosen = select_victim_pages(listing, pool.blocks, 10, pool.cache.is_evictable)
    assert [p for p, _ in chosen] == [pool.blocks.page_of(reqs[1].blocks[0])]
