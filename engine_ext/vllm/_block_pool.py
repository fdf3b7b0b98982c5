"""``ElasticBlockPool``: vLLM's ``BlockPool`` over the core's ``BlockAllocator``.

vLLM's pool keeps every block in one free queue (truly free + evictable) over
memory that is all mapped. Here block ids come from a ``BlockAllocator``
(block ``b`` lives on page ``b // blocks_per_page``; vLLM's null block 0 stays
allocated for good), so a page is mapped when its first block is handed out
and unmapped when its last block is given back. Each block id is in exactly
one of three states:

* **free**: not allocated in the ``BlockAllocator``; ``ref_cnt`` 0, no hash;
* **in use**: allocated, ``ref_cnt`` > 0 (held by requests);
* **evictable**: allocated, ``ref_cnt`` 0, hashed, in ``free_block_queue``
  (which therefore holds only evictable blocks, in vLLM's LRU order).

Prefix caching is vLLM's own code (hashes, ``get_cached_block``, ``touch``,
``cache_full_blocks``, KV events): this class only changes where blocks come
from and where they go. ``get_num_free_blocks`` = what the allocator can still
hand out under the target + evictable blocks (reused in place, LRU first, as
vLLM does). With reclamation on, a block freed onto a *retired* page (in use
above the target) is evicted at once, so the page can be unmapped when its
last block goes.

Threads: every method runs on the EngineCore busy-loop thread; the
``ThreadGuard`` (on with ``KVSIDECAR_THREAD_GUARD=1``) raises otherwise.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared
from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from allocator import BackendError
from engine_ext._errors import EngineExtConfigError
from engine_ext.vllm._pool_backing import DeviceFullError, PoolBacking

try:  # the per-block loops in C (engine_ext/vllm/_block_speedups.c; optional)
    from engine_ext.vllm._block_speedups import BlockFields
except ImportError:  # no C compiler where this was installed: the Python loops run
    BlockFields = None  # type: ignore[assignment,misc]

__all__ = ["SPEEDUPS", "DeviceFullError", "ElasticBlockPool"]

SPEEDUPS = BlockFields is not None  # whether the per-block loops run in C

_log = logging.getLogger("engine_ext.vllm.block_pool")
_block_id = operator.attrgetter("block_id")


class ElasticBlockPool(BlockPool):  # type: ignore[misc]  # vLLM is untyped here (pyproject)
    """A ``BlockPool`` whose blocks are backed by pages mapped on demand. Busy-loop thread only.

    It is also the core's :class:`engine_ext.Reclaimer` for its prefix cache
    (``name``, :meth:`evictable_blocks`, :meth:`is_evictable`, :meth:`evict`),
    and it marks its evictable blocks in the ``BlockAllocator`` as they come
    and go, so the coordinator's evictable/pinned figures never rescan it.
    """

    name = "vllm-prefix-cache"  # Reclaimer
    _use_c = SPEEDUPS  # class-wide switch (tests build pools with it off to compare)

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
    ) -> None:
        super().__init__(
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
            num_hash_lookahead_tokens,
            medium,
        )
        from engine_ext.vllm._runtime import backing_for_pool

        backing: PoolBacking = backing_for_pool(self, num_gpu_blocks)
        self._backing = backing
        self._blocks = backing.blocks
        self._num_blocks = backing.blocks.num_blocks  # the allocator's capacity (fixed)
        self._guard = backing.guard
        self._hooks = backing.hooks
        self._mailbox = backing.mailbox
        # Cache of self._blocks.num_free_blocks (-1: stale). Every path that changes the
        # allocator resets it: this pool's own methods and, via invalidate_capacity(),
        # the runtime after a coordinator pass.
        self._fresh_free = -1
        # True while a RUNNING request may allocate: its blocks may be mapped above the
        # target (liveness: a limit never preempts). The runtime holds it for the whole of
        # Scheduler.schedule() (whose running requests allocate first) and clears it around
        # each admission (_runtime.allocating), so the common call needs no store at all.
        self.overdraft = False
        # True while Scheduler.schedule() runs (between a prefix lookup and the touch
        # in allocate_slots hit blocks have ref_cnt 0): the pool evicts nothing on its
        # own then; the evictions it owes run at the next safe point (cleanup()).
        self.in_schedule = False
        # Evictions deferred to the next safe point are owed (set by the pool, cleared by
        # cleanup(); the runtime reads it to skip a safe point when nothing is owed).
        self.cleanup_due = False
        # The per-block loops of get_new_blocks and free_blocks in C for vLLM's own block
        # class (None: the Python loops below, the reference the tests compare them to).
        self._fields = _block_fields(type(self.null_block)) if self._use_c else None
        bound = backing.max_cached_tokens
        self._max_cached_blocks = None if bound < 0 else bound // hash_block_size
        # Evictable blocks only (none yet): unlink what BlockPool linked.
        for block in self.blocks:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([])
        self._blocks.track_evictable()  # evictable/pinned figures kept per block event
        null = self._blocks.alloc(1)
        if null != [0]:
            raise EngineExtConfigError(
                f"the block allocator handed out {null} first, not vLLM's null block 0: "
                "build the pool over a fresh allocator with KVSIDECAR_RESERVE_PAGES=0"
            )

    # -- counts ---------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        # Read-only: never takes a target, never evicts (docs/vllm.md, "Safe points").
        if self.overdraft:  # a running request: every unallocated block, above the target
            num_evictable: int = self.free_block_queue.num_free_blocks
            return self._num_blocks - self._blocks.num_allocated_blocks + num_evictable
        fresh = self._fresh_free  # _free_under_target(), inline (called at every allocation)
        if fresh < 0:
            fresh = self._fresh_free = self._blocks.num_free_blocks
        queued: int = self.free_block_queue.num_free_blocks
        return fresh + queued

    def _free_under_target(self) -> int:
        """Blocks the allocator can hand out under the target + evictable blocks."""
        fresh = self._fresh_free
        if fresh < 0:
            fresh = self._fresh_free = self._blocks.num_free_blocks
        queued: int = self.free_block_queue.num_free_blocks
        return fresh + queued

    def device_full(self) -> bool:
        """A map found the device out of memory a moment ago (allocator's ``device_full``)."""
        return bool(self._blocks.pages.device_full)

    def blocks_target(self) -> int | None:
        """The allocator's page target (None = unlimited)."""
        return self._blocks.pages.target_pages

    def get_usage(self) -> float:
        """Running requests' share of the blocks the limit allows (``vllm:kv_cache_usage_perc``).

        vLLM's own figure is ``1 - free / num_gpu_blocks``: under a limit the free
        blocks shrink to what the limit allows, so one tiny request reads as a full
        cache. Here: blocks held by requests / (those + the blocks still available
        under the target, evictable cached blocks included). Unlimited, this equals
        vLLM's figure; cached blocks count as available, as in vLLM.
        """
        available = self._free_under_target()  # also inside schedule(), under the overdraft
        in_use = self._blocks.num_allocated_blocks - self.free_block_queue.num_free_blocks - 1
        allowed = in_use + available  # the null block (allocated for good) is neither
        return in_use / allowed if allowed > 0 else 0.0

    def invalidate_capacity(self) -> None:
        """The allocator changed outside this pool's methods (a coordinator pass)."""
        self._fresh_free = -1

    @property
    def num_evictable_blocks(self) -> int:
        return int(self.free_block_queue.num_free_blocks)

    def is_evictable(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return (
            block.ref_cnt == 0
            and not block.is_null
            and block.block_hash is not None
            and self._blocks.is_allocated(block_id)
        )

    def evictable_block_ids(self) -> list[int]:
        return [block.block_id for block in self.free_block_queue.get_all_free_blocks()]

    def evictable_blocks(self) -> list[int]:
        """Reclaimer: the evictable blocks, least recently used first (O(evictable))."""
        return self.evictable_block_ids()

    # -- allocation -----------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if self._guard.enabled:  # a call only when the guard is on (hot path)
            self._guard.check()
        fresh_free = self._fresh_free
        if fresh_free < 0:
            fresh_free = self._blocks.num_free_blocks
        num_fresh = min(num_blocks, fresh_free)
        num_reused = num_blocks - num_fresh
        if num_reused:  # (no queue read nor min() on the common all-fresh path)
            num_reused = min(num_reused, self.free_block_queue.num_free_blocks)
        num_over = num_blocks - num_fresh - num_reused  # above the target: running requests only
        if num_over and not self.overdraft:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        fields = self._fields
        if num_fresh:
            self._fresh_free = -1  # stale if alloc raises (a failed map is rolled back)
            ids = self._blocks.alloc(num_fresh)
            if ids is None:  # the device had no memory for a new page (docs/overcommit.md)
                if (
                    num_blocks - self._blocks.num_free_blocks
                    > self.free_block_queue.num_free_blocks
                ):
                    raise DeviceFullError(
                        f"Cannot get {num_blocks} free blocks from the pool: "
                        "the device is out of memory (lower another engine's "
                        "limit)"
                    )
                return self.get_new_blocks(num_blocks)  # the headroom is what is mapped now
            if fields is not None and not self._reuse_watchers:  # (watchers see ref_cnt 0)
                ret = fields.take(self.blocks, ids)  # checked free, ref_cnt 1: the loop in C
                done = len(ret)
            else:
                all_blocks = self.blocks
                ret = [all_blocks[i] for i in ids]
                done = 0
        else:
            ret = []
            done = 0
        self._fresh_free = fresh_free - num_fresh  # alloc(k) lowers the free count by k
        if num_over:
            try:
                ret.extend(self._alloc_over_target(num_over))
            except DeviceFullError:  # give the fresh blocks back (no leak)
                if ret:
                    for block in ret[:done]:
                        block.ref_cnt = 0  # as they were before take()
                    self._fresh_free = -1
                    self._blocks.free([block.block_id for block in ret])
                raise
        if num_reused:  # evictable blocks, least recently used first (vLLM's order)
            # in C: checked free and given ref_cnt 1 as they leave the queue (the hash is
            # dropped below: it does not read ref_cnt), unless blocks before them still
            # wait for the Python loop or reuse watchers must see them free
            hold = done == len(ret) and fields is not None and not self._reuse_watchers
            if fields is not None:
                reused, reused_ids = fields.popleft_n(self.free_block_queue, num_reused, hold)
            else:
                reused = self.free_block_queue.popleft_n(num_reused)
                reused_ids = list(map(_block_id, reused))
            self._blocks.unmark_evictable(reused_ids)
            for block in reused:
                self._maybe_evict_cached_block(block)  # drops the hash, emits BlockRemoved
            ret.extend(reused)
            if hold:
                done = len(ret)
        if self._reuse_watchers:
            self._notify_reuse(ret)
        if done < len(ret):  # (done: the fresh blocks take() set up in C)
            for block in ret[done:] if done else ret:
                assert block.ref_cnt == 0 and block._block_hash is None  # (no property call)
                block.ref_cnt = 1
        collector = self.metrics_collector
        if collector:
            for block in ret:
                collector.on_block_allocated(block)
        return ret

    def _give_back(self, ids: list[int]) -> None:
        """Free ``ids`` in the allocator. A page that empties and then fails to unmap is
        out of service (counted as mapped; the limit pass retries it and reports
        ``backend_error``): the blocks are free either way, and raising here would end
        the engine (vLLM's ``KVCacheManager.free``)."""
        try:
            self._blocks.free(ids)
        except BackendError as exc:
            _log.warning("kvsidecar: %s", exc)
            self._hooks.after_change()

    def _alloc_over_target(self, count: int) -> list[KVCacheBlock]:
        """Map ``count`` blocks above the target for a running request (rare: over a limit).

        The allocator's target is lifted just enough for this call and put back at
        once: the pages now above it are retired (no new blocks, unmapped when they
        empty) and the coordinator reports the overage as ``running_requests``.
        Costs one ``set_target`` pair (O(in-use pages log k)), only while over a limit.
        """
        self._fresh_free = -1
        ids = self._blocks.alloc_above_target(count)
        if ids is None:
            raise DeviceFullError(f"Cannot get {count} blocks: the device is out of memory")
        self.cleanup_due = True  # pages were retired: evict cached blocks on them later
        all_blocks = self.blocks
        return [all_blocks[i] for i in ids]

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit takes a reference; an evictable block leaves the LRU queue."""
        queue = self.free_block_queue
        collector = self.metrics_collector
        fields = self._fields
        if fields is not None and not collector:
            hit_ids = fields.touch(queue, blocks)  # the loop in C (None: another class)
            if hit_ids is not None:
                if hit_ids:
                    self._blocks.unmark_evictable(hit_ids)
                return
        hit: list[int] = []
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:  # evictable: held by the cache alone until now
                queue.remove(block)
                hit.append(block.block_id)
            block.ref_cnt += 1
            if collector:
                collector.on_block_accessed(block)
        if hit:
            self._blocks.unmark_evictable(hit)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        if self._guard.enabled:  # a call only when the guard is on (hot path)
            self._guard.check()
        # Cached blocks are evicted at once with caching off, with a bound of 0, and
        # (reclaim on) on retired pages, which must empty to be unmapped.
        # Inside schedule() a freed block may be a hit of a pending lookup of another
        # request (shared prefix): keep it cached and evict at the next safe point.
        deferred = self.in_schedule
        evict_now = (not self.enable_caching or self._max_cached_blocks == 0) and not deferred
        retired = self._backing.reclaim and self._blocks.num_retired_blocks > 0 and not deferred
        fields = self._fields
        split: Any = ordered_blocks  # the C's 4-tuple, or blocks for the Python loop
        if fields is not None and not retired and not evict_now:
            # in C (no block needs an eviction decision of its own); a block of another
            # class comes back as a list, for the Python loop
            split = fields.split_freed(ordered_blocks, self)
        if type(split) is not tuple:
            split = self._split_freed(split, evict_now, retired)
        to_free, to_cache, cache_ids, foreign = split
        if to_cache:
            if fields is None or not fields.append_n(self.free_block_queue, to_cache):
                self.free_block_queue.append_n(to_cache)  # (C: False for another class)
            self._blocks.mark_evictable(cache_ids)
        if to_free:
            self._fresh_free = -1
            self._give_back(to_free)
        if foreign:  # blocks of other pools (deferred frees), each pool's in one call
            others: dict[BlockPool, list[KVCacheBlock]] = {}
            for block in foreign:
                others.setdefault(block.pool, []).append(block)
            for pool, group in others.items():
                pool.free_blocks(group)
        if deferred:
            self.cleanup_due = self.cleanup_due or bool(to_cache)
        elif self._max_cached_blocks is not None:
            self._enforce_cache_bound()
        self._hooks.after_change()

    def _split_freed(
        self, ordered_blocks: Iterable[KVCacheBlock], evict_now: bool, retired: bool
    ) -> tuple[list[int], list[KVCacheBlock], list[int], list[KVCacheBlock]]:
        """:meth:`free_blocks`' loop in Python (the reference of ``BlockFields.split_freed``,
        which it extends with the evictions): one reference off each block; returns the
        ids to free, the blocks to cache, their ids and other pools' blocks."""
        to_free: list[int] = []
        to_cache: list[KVCacheBlock] = []
        foreign: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.pool is not None and block.pool is not self:
                foreign.append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if block._block_hash is None:  # vLLM 0.33's slot behind the block_hash property
                to_free.append(block.block_id)
            elif evict_now or (retired and self._on_retired_page(block)):
                self._maybe_evict_cached_block(block)
                to_free.append(block.block_id)
            else:
                to_cache.append(block)
        return to_free, to_cache, list(map(_block_id, to_cache)), foreign

    def cleanup(self) -> None:
        """Safe point only: the evictions ``free_blocks`` deferred during ``schedule()``."""
        if not self.cleanup_due:
            return
        self.cleanup_due = False
        if not self.enable_caching or self._max_cached_blocks == 0:
            self.evict(self.evictable_block_ids())
        else:
            self.evict_on_retired_pages()
            if self._max_cached_blocks is not None:
                self._enforce_cache_bound()

    # -- eviction (the reclaimer and the cache bound) ---------------------------------
    def evict(self, block_ids: Sequence[int]) -> int:
        """Evict these evictable blocks: drop their hashes and free them to the allocator."""
        if self._guard.enabled:  # a call only when the guard is on (hot path)
            self._guard.check()
        freed: list[int] = []
        for block_id in block_ids:
            if not self.is_evictable(block_id):
                continue  # referenced again (or gone): never evict a block a request holds
            block = self.blocks[block_id]
            self.free_block_queue.remove(block)
            self._maybe_evict_cached_block(block)
            freed.append(block_id)
        if freed:
            self._fresh_free = -1
            self._give_back(freed)
        return len(freed)

    def evict_on_retired_pages(self) -> int:
        """Evict evictable blocks that sit on retired pages (after a lower target)."""
        if not self._backing.reclaim or not self._blocks.num_retired_blocks:
            return 0
        victims = [
            b.block_id
            for b in self.free_block_queue.get_all_free_blocks()
            if self._on_retired_page(b)
        ]
        return self.evict(victims)

    def reset_prefix_cache(self) -> bool:
        if self._guard.enabled:  # a call only when the guard is on (hot path)
            self._guard.check()
        num_in_use = self._blocks.num_allocated_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_in_use:
            _log.warning("Failed to reset prefix cache: %d blocks are still in use", num_in_use)
            return False
        evictable = self.evictable_block_ids()
        for block_id in evictable:
            self.blocks[block_id].prev_free_block = self.blocks[block_id].next_free_block = None
        self.free_block_queue = FreeKVCacheBlockQueue([])
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        if evictable:
            self._fresh_free = -1
            self._give_back(evictable)
        _log.info("Reset the prefix cache: %d cached blocks freed", len(evictable))
        self._hooks.after_change()
        return True

    def _enforce_cache_bound(self) -> None:
        cap = self._max_cached_blocks
        if cap is None or cap == 0:
            return
        excess = self.free_block_queue.num_free_blocks - cap
        if excess <= 0:
            return
        from engine_ext import select_victim_pages

        bpp = self._blocks.blocks_per_page
        victims = select_victim_pages(
            self.evictable_block_ids(), self._blocks, -(-excess // bpp), self.is_evictable
        )
        for _page, page_blocks in victims:
            excess -= self.evict(page_blocks)
            if excess <= 0:
                return
        if excess > 0:  # no whole page left: fall back to vLLM's LRU order
            self.evict(self._lru_ids(excess))

    def _lru_ids(self, count: int) -> list[int]:
        out: list[int] = []
        block = self.free_block_queue.fake_free_list_head.next_free_block
        tail = self.free_block_queue.fake_free_list_tail
        while block is not None and block is not tail and len(out) < count:
            out.append(block.block_id)
            block = block.next_free_block
        return out

    def _on_retired_page(self, block: KVCacheBlock) -> bool:
        return self._backing.reclaim and self._blocks.pages.is_retired(
            block.block_id // self._blocks.blocks_per_page
        )


def _block_fields(cls: type) -> BlockFields | None:
    """The C loops for blocks of ``cls``, or None where they cannot run (no module, or a
    vLLM whose KVCacheBlock fields are not plain slots: the Python loops then)."""
    if BlockFields is None:
        return None
    try:
        return BlockFields(cls)
    except TypeError as exc:
        _log.warning("kvsidecar: block pool loops in Python (%s)", exc)
        return None
