"""Fixtures of the engine_ext core tests (helpers live in engine_pool.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engine_pool import BLOCKS_PER_PAGE, NUM_PAGES, NUM_REGIONS, PAGE_BYTES, Pool, PrefixCache

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout, ThreadGuard


@pytest.fixture
def pool() -> Iterator[Pool]:
    layout = PageLayout(page_bytes=PAGE_BYTES, num_pages=NUM_PAGES, num_regions=NUM_REGIONS)
    backend = HostBackend.reserve(layout, name="engine-ext-test")
    guard = ThreadGuard("test-pool")
    pages = PageAllocator(backend, guard=guard)
    blocks = BlockAllocator(pages, BLOCKS_PER_PAGE)
    try:
        yield Pool(backend, pages, blocks, PrefixCache(blocks))
    finally:
        backend.release()
