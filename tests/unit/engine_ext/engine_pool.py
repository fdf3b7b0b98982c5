"""Test helpers: a real host-memory pool and a small real prefix cache (a Reclaimer)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from allocator import BlockAllocator, HostBackend, PageAllocator

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


class PrefixCache:
    """A tiny prefix cache over :class:`BlockAllocator` (a real ``Reclaimer``).

    Blocks are keyed by a content hash. A request references its blocks (ref
    count); when it finishes, hashed blocks with no references stay cached and
    evictable. Engine thread only: it shares the pool's guard.
    """

    name = "test-prefix-cache"

    def __init__(self, blocks: BlockAllocator) -> None:
        self.blocks = blocks
        self.guard = blocks.guard
        self.refs: dict[int, int] = {}  # block -> running requests referencing it
        self.by_hash: dict[int, int] = {}  # content hash -> cached block
        self.hash_of: dict[int, int] = {}  # cached block -> content hash
        self.num_evicted = 0

    def start(self, hashes: Sequence[int]) -> Request | None:
        """Admit a request over ``hashes``: reuse cached blocks, allocate the rest."""
        self.guard.check()
        hits = [self.by_hash.get(h) for h in hashes]
        fresh = self.blocks.alloc(sum(1 for b in hits if b is None))
        if fresh is None:
            return None
        it = iter(fresh)
        out = []
        for h, hit in zip(hashes, hits):
            block = hit if hit is not None else next(it)
            if hit is None:
                self.by_hash[h] = block
                self.hash_of[block] = h
            self.refs[block] = self.refs.get(block, 0) + 1
            out.append(block)
        return Request(out, list(hashes))

    def touch(self, block: int) -> None:
        """A new request hits ``block`` (takes a reference)."""
        self.guard.check()
        self.refs[block] = self.refs.get(block, 0) + 1

    def finish(self, req: Request) -> None:
        """The request ends: its blocks stay cached (evictable once unreferenced)."""
        self.guard.check()
        for block in req.blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]

    # -- Reclaimer ------------------------------------------------------------------
    def evictable_blocks(self) -> Iterable[int]:
        return [b for b in self.hash_of if b not in self.refs]

    def is_evictable(self, block: int) -> bool:
        return block in self.hash_of and block not in self.refs

    def evict(self, blocks: Sequence[int]) -> int:
        self.guard.check()
        for block in blocks:
            assert self.is_evictable(block), f"asked to evict referenced block {block}"
        for block in blocks:
            del self.by_hash[self.hash_of.pop(block)]
        self.blocks.free(blocks)
        self.num_evicted += len(blocks)
        return len(blocks)


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
