"""Test helpers: a real host-memory pool and the shared toy prefix cache (a Reclaimer)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from allocator import BlockAllocator, HostBackend, PageAllocator
from engine_ext.cpu_harness import ToyPrefixCache

PAGE_BYTES = 64 * 1024  # one page in one region
NUM_REGIONS = 2  # e.g. K and V of one layer
NUM_PAGES = 16
BLOCKS_PER_PAGE = 4
BUNDLE = PAGE_BYTES * NUM_REGIONS


@dataclass
class Request:
    """A running request: the blocks it references, in order."""

    blocks: list[int]
    hashes: list[int]


class PrefixCache(ToyPrefixCache):
    """The shared toy prefix cache (``engine_ext.cpu_harness.ToyPrefixCache``) with requests.

    Every block a request allocates is cached under its content hash at once;
    when the request finishes, its unreferenced blocks stay cached and
    evictable. Engine thread only: it shares the pool's guard.
    """

    def __init__(self, blocks: BlockAllocator) -> None:
        super().__init__(blocks, name="test-prefix-cache")

    def start(self, hashes: Sequence[int]) -> Request | None:
        """Admit a request over ``hashes``: reuse cached blocks, allocate the rest."""
        hits = [self.lookup(h) for h in hashes]
        fresh = self.allocate(sum(1 for b in hits if b is None))
        if fresh is None:
            return None
        it = iter(fresh)
        out = []
        for h, hit in zip(hashes, hits):
            if hit is None:
                block = next(it)
                self.insert(block, h)
            else:
                block = hit
                self.acquire(block)
            out.append(block)
        return Request(out, list(hashes))

    def touch(self, block: int) -> None:
        """A new request hits ``block`` (takes a reference)."""
        self.acquire(block)

    def finish(self, req: Request) -> None:
        """The request ends: its blocks stay cached (evictable once unreferenced)."""
        self.release(req.blocks)


@dataclass
class Pool:
    backend: HostBackend
    pages: PageAllocator
    blocks: BlockAllocator
    cache: PrefixCache
    _hashes: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def fill(self, num_pages: int) -> list[Request]:
        """Run and finish requests that leave ``num_pages`` full pages of cached blocks."""
        reqs = [self.run(BLOCKS_PER_PAGE) for _ in range(num_pages)]
        for req in reqs:
            self.cache.finish(req)
        return reqs

    def run(self, num_blocks: int) -> Request:
        """Start a request over ``num_blocks`` new (uncached) blocks."""
        req = self.cache.start([next(self._hashes) for _ in range(num_blocks)])
        assert req is not None, "the pool is full"
        return req


class TrackingPrefixCache(PrefixCache):
    """The same cache, reporting its evictable blocks to the allocator (as vLLM's pool does).

    Counts its listings: a shrink pass lists the cache (O(evictable)); the
    coordinator's throttle and figures must not.
    """

    def __init__(self, blocks: BlockAllocator) -> None:
        super().__init__(blocks)
        blocks.track_evictable()
        self.num_listings = 0

    def acquire(self, block: int) -> None:
        was = self.is_evictable(block)
        super().acquire(block)
        if was:
            self.blocks.unmark_evictable([block])

    def insert(self, block: int, key: Hashable) -> bool:
        added = super().insert(block, key)
        if added and self.is_evictable(block):
            self.blocks.mark_evictable([block])
        return added

    def release(self, blocks: Iterable[int]) -> None:
        batch = list(blocks)
        before = {b for b in batch if self.is_evictable(b)}
        super().release(batch)
        now = sorted({b for b in batch if b not in before and self.is_evictable(b)})
        if now:
            self.blocks.mark_evictable(now)

    def evictable_blocks(self) -> Iterable[int]:
        self.num_listings += 1
        return super().evictable_blocks()


class ChangeKeyedPrefixCache(PrefixCache):
    """The same cache with a change counter (as SGLang's reclaimers have), not tracking."""

    def __init__(self, blocks: BlockAllocator) -> None:
        super().__init__(blocks)
        self.version = 0
        self.num_listings = 0

    def release(self, blocks: Iterable[int]) -> None:
        super().release(blocks)
        self.version += 1

    def change_key(self) -> int:
        return self.version

    def evictable_blocks(self) -> Iterable[int]:
        self.num_listings += 1
        return super().evictable_blocks()
