"""A toy engine prefix cache over the core's ``BlockAllocator`` (a real ``Reclaimer``).

It stands in for an engine's prefix cache where no engine runs: the engine-core
tests, the rank-process tests and the core benchmarks drive the real
allocator, coordinator and reclaim path through it. The engines' own caches
(vLLM's ``BlockPool``, SGLang's radix trees) are adapted in
``engine_ext.vllm`` / ``engine_ext.sglang``; this one has no engine behind it.

A block is *referenced* (running requests hold it), *cached* (registered
under a content key, so a later request can hit it), or both. A cached block
nobody references is *evictable*; evictable blocks are kept in the order they
became evictable, oldest first (LRU), which is the order
:meth:`ToyPrefixCache.evictable_blocks` lists them and the order
``allocate(..., make_room=True)`` evicts them in (what an engine does to make
room without kvsidecar; :meth:`~ToyPrefixCache.evict_oldest` evicts one). An unreferenced block that is not cached goes back
to the allocator at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from allocator import BlockAllocator

__all__ = ["ToyPrefixCache"]


class ToyPrefixCache:
    """Prefix cache of whole blocks keyed by content; implements ``engine_ext.Reclaimer``.

    Owns the cache entries and the reference counts of the blocks it handed
    out; the blocks themselves belong to ``blocks`` (freed there on eviction).
    Invariants: a block in ``refs`` has a count >= 1; a block is evictable iff
    it is cached and not in ``refs``; ``evict`` never frees a referenced block
    (it raises instead: the coordinator asked for something it must not).
    Thread: the engine thread only (mutations check the allocator's guard).
    """

    def __init__(self, blocks: BlockAllocator, *, name: str = "toy-prefix-cache") -> None:
        self.name = name
        self.blocks = blocks
        self.guard = blocks.guard
        self.refs: dict[int, int] = {}  # block -> running requests referencing it
        self.by_key: dict[Hashable, int] = {}  # content key -> cached block
        self.key_of: dict[int, Hashable] = {}  # cached block -> content key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.num_evicted = 0

    # -- the engine's side ------------------------------------------------------------
    def lookup(self, key: Hashable) -> int | None:
        """The cached block holding ``key``, or None (takes no reference)."""
        return self.by_key.get(key)

    def allocate(self, num_blocks: int, *, make_room: bool = False) -> list[int] | None:
        """``num_blocks`` fresh blocks, each referenced once; None if they do not fit.

        ``make_room`` evicts evictable blocks oldest first until they fit (the
        engine's own eviction, no page awareness).
        """
        self.guard.check()
        got = self.blocks.alloc(num_blocks)
        while got is None and make_room and self.evict_oldest():
            got = self.blocks.alloc(num_blocks)
        if got is not None:
            for block in got:
                self.refs[block] = 1
        return got

    def acquire(self, block: int) -> None:
        """A request takes a reference on ``block`` (e.g. a prefix hit)."""
        self.guard.check()
        self.refs[block] = self.refs.get(block, 0) + 1
        self._evictable.pop(block, None)

    def insert(self, block: int, key: Hashable) -> bool:
        """Cache ``block`` under ``key``; False (nothing changes) if either is cached already."""
        self.guard.check()
        if key in self.by_key or block in self.key_of:
            return False
        self.by_key[key] = block
        self.key_of[block] = key
        if block not in self.refs:
            self._evictable[block] = None
        return True

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block: cached ones become evictable, others are freed."""
        self.guard.check()
        to_free = []
        for block in blocks:
            count = self.refs[block] - 1
            if count:
                self.refs[block] = count
                continue
            del self.refs[block]
            if block in self.key_of:
                self._evictable[block] = None
            else:
                to_free.append(block)
        if to_free:
            self.blocks.free(to_free)

    def evict_oldest(self) -> int:
        """Evict the block that has been evictable longest (LRU); 0 if none is."""
        if not self._evictable:
            return 0
        return self.evict([next(iter(self._evictable))])

    # -- Reclaimer ---------------------------------------------------------------------
    def evictable_blocks(self) -> Iterable[int]:
        return list(self._evictable)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def evict(self, blocks: Sequence[int]) -> int:
        self.guard.check()
        for block in blocks:
            if block not in self._evictable:
                raise AssertionError(
                    f"{self.name}: asked to evict block {block}, which is "
                    f"{'referenced' if block in self.refs else 'not cached'}"
                )
        for block in blocks:
            del self._evictable[block]
            del self.by_key[self.key_of.pop(block)]
        self.blocks.free(blocks)
        self.num_evicted += len(blocks)
        return len(blocks)
