"""Reclaimers over SGLang's tree caches: evict exactly the nodes that sit on victim pages.

SGLang evicts leaves in LRU order to make room; a shrink needs the opposite
question answered: *which nodes hold blocks on this page?* Both reclaimers
list the blocks of unlocked nodes (a node is unlocked only if its whole
subtree is, since a lock walks up to the root), and evict through the cache's
own primitives so its counters (``evictable_size``/``protected_size``), leaf
sets and KV events stay right. A locked node is never touched, whatever the
coordinator asks.

* :class:`RadixTreeReclaimer` -- ``RadixCache`` (Python nodes): splits a node
  at the first victim page, so the prefix before it stays cached, then
  removes the tail's subtree leaf by leaf.
* :class:`UnifiedTreeReclaimer` -- ``UnifiedRadixCache`` (default; Rust tree
  core, which exposes no node listing): lists unlocked slots with the
  core's ``walk_for_kv_canary``, and evicts by walking the core's eviction
  order, evicting only leaves whose root path holds a victim page (parents
  become leaves and come up in the same walk).

Thread: the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .. import count_reclaimable_pages
from .._errors import EngineExtConfigError

if TYPE_CHECKING:
    from allocator import BlockAllocator

    from ._allocator import ElasticTokenAllocator

__all__ = ["RadixTreeReclaimer", "UnifiedTreeReclaimer", "make_reclaimer"]


class _TreeReclaimer:
    """Common part: snapshot of evictable blocks, keyed by what can change it."""

    name = "sglang-tree"

    def __init__(self, cache: Any, allocator: ElasticTokenAllocator) -> None:
        self.cache = cache
        self.allocator = allocator
        self.page_size: int = allocator.page_size
        self.blocks: BlockAllocator = allocator.blocks
        self.num_evicted_blocks = 0  # blocks freed by evict(), collateral included
        self._key: tuple[int, ...] | None = None
        self._evictable: frozenset[int] = frozenset()
        self._unlocked_key: tuple[int, ...] | None = None
        self._unlocked_set: frozenset[int] = frozenset()

    # Reclaimer protocol ----------------------------------------------------------
    def evictable_blocks(self) -> Iterable[int]:
        return self._snapshot()

    def is_evictable(self, block: int) -> bool:
        return block in self._snapshot()

    def evict(self, blocks: Sequence[int]) -> int:
        wanted = {b for b in blocks if b in self._snapshot()}
        pages = self.blocks.pages
        if not wanted or (
            pages.target_pages is not None and pages.num_mapped <= pages.target_pages
        ):
            return 0  # earlier victims' collateral already brought the pool under its target
        before = self.blocks.num_allocated_blocks
        self._evict_pages(wanted)
        self._key = None
        self.num_evicted_blocks += before - self.blocks.num_allocated_blocks
        return sum(1 for b in wanted if not self.blocks.is_allocated(b))

    # admission truth ---------------------------------------------------------------
    def unlocked_blocks(self) -> frozenset[int]:
        """Every block of an unlocked node (what SGLang's eviction could free), read-only:
        it runs inside admission and inside SGLang's own eviction walk, where a second
        walk must not start. The same object while the allocator and tree did not change."""
        key = self._state_key()
        if key != self._unlocked_key:
            self._unlocked_set = frozenset(self._scan())
            self._unlocked_key = key
        return self._unlocked_set

    # internals -----------------------------------------------------------------------
    def _state_key(self) -> tuple[int, ...]:
        cache = self.cache
        return (
            self.allocator.num_allocs,
            self.allocator.num_frees,
            int(cache.evictable_size()),
            int(cache.protected_size()),
        )

    def _snapshot(self) -> frozenset[int]:
        """Blocks of unlocked *leaves* if they fill a page, else of every unlocked node.

        Leaves first: evicting an inner node takes its whole subtree with it, so a
        page of a shared prefix is offered only once its descendants are gone (or
        when no page can be freed from leaves alone).
        """
        key = self._state_key()
        if key != self._key:
            leaves = frozenset(self._scan_leaves())
            if count_reclaimable_pages(leaves, self.blocks) > 0:
                self._evictable = leaves
            else:
                self._evictable = frozenset(self._scan())
            self._key = key
        return self._evictable

    def _scan(self) -> Iterable[int]:
        raise NotImplementedError

    def _scan_leaves(self) -> Iterable[int]:
        raise NotImplementedError

    def _evict_pages(self, pages: set[int]) -> None:
        raise NotImplementedError


class RadixTreeReclaimer(_TreeReclaimer):
    """Reclaimer over ``RadixCache`` (Python ``TreeNode`` s)."""

    name = "sglang-radix"

    def _unlocked(self) -> Iterator[Any]:
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref == 0 and node.value is not None:
                yield node
            stack.extend(node.children.values())

    def _scan(self) -> Iterable[int]:
        ps = self.page_size
        for node in self._unlocked():
            yield from (int(s) // ps for s in node.value[::ps].tolist())

    def _scan_leaves(self) -> Iterable[int]:
        ps = self.page_size
        for node in self._unlocked():
            if not node.children:
                yield from (int(s) // ps for s in node.value[::ps].tolist())

    def _evict_pages(self, pages: set[int]) -> None:
        ps = self.page_size
        for node in list(self._unlocked()):
            if node.parent is None or node.value is None:
                continue  # removed with an ancestor earlier in this loop
            firsts = [int(s) // ps for s in node.value[::ps].tolist()]
            hits = [i for i, page in enumerate(firsts) if page in pages]
            if not hits:
                continue
            tail = node
            if hits[0] > 0:  # keep the cached prefix in front of the first victim page
                self.cache._split_node(node.key, node, hits[0] * ps)
            self._remove_subtree(tail)

    def _remove_subtree(self, top: Any) -> None:
        cache = self.cache
        order: list[Any] = []
        stack = [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents: each is a leaf when deleted
            cache.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
            cache._delete_leaf(node)
            cache.kv_events.record_remove(node)
            node.value = None
            node.parent = None


class UnifiedTreeReclaimer(_TreeReclaimer):
    """Reclaimer over ``UnifiedRadixCache`` with its tree core (Rust by default)."""

    name = "sglang-unified-radix"

    def __init__(self, cache: Any, allocator: ElasticTokenAllocator) -> None:
        super().__init__(cache, allocator)
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        self._full = ComponentType.FULL

    def _scan(self) -> Iterable[int]:
        walk = self.cache.tree_core.walk_for_kv_canary(True, False)
        ps = self.page_size
        return {int(s) // ps for s in walk.slot_indices.tolist()}

    def _scan_leaves(self) -> Iterable[int]:
        """Walk the core's eviction order without evicting: its unlocked device leaves."""
        cache = self.cache
        core = cache.tree_core
        tracker = {ct: 0 for ct in cache.tree_components}
        ps = self.page_size
        out: set[int] = set()
        core.evict_device_start(self._full, max(1, int(core.full_evictable_size())))
        try:
            while True:
                node_id, progressed = cache._evict_device_next_node(self._full, tracker)
                if node_id is None:
                    if not progressed:
                        break
                    continue
                value = core.get_component_device_value(node_id, self._full)
                if value is not None:
                    out.update(int(s) // ps for s in value[::ps].tolist())
        finally:
            core.evict_device_end(self._full)
        return out

    def _holds_victim(self, leaf: int, pages: set[int]) -> bool:
        core = self.cache.tree_core
        ps = self.page_size
        (path,) = core.collect_path_info([leaf])
        for info in path:
            value = core.get_component_device_value(info.node_id, self._full)
            if value is not None and any(int(s) // ps in pages for s in value[::ps].tolist()):
                return True
        return False

    def _evict_pages(self, pages: set[int]) -> None:
        cache = self.cache
        core = cache.tree_core
        full = self._full
        tracker = {ct: 0 for ct in cache.tree_components}
        core.evict_device_start(full, max(1, int(core.full_evictable_size())))
        try:
            while any(self.blocks.is_allocated(p) for p in pages):
                node_id, progressed = cache._evict_device_next_node(full, tracker)
                if node_id is None:
                    if not progressed:
                        break
                    continue
                if self._holds_victim(node_id, pages):
                    backup = cache._evict_device_leaf(node_id, tracker)
                    if backup is not None:  # write-back HiCache: refused at install
                        raise RuntimeError(
                            "kvsidecar does not support SGLang's hierarchical "
                            "cache (write-back); start without --enable-"
                            "hierarchical-cache"
                        )
        finally:
            core.evict_device_end(full)


def make_reclaimer(cache: Any, allocator: ElasticTokenAllocator) -> _TreeReclaimer:
    """The reclaimer for ``cache``'s type; refuses caches it does not understand."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if isinstance(cache, UnifiedRadixCache):
        return UnifiedTreeReclaimer(cache, allocator)
    if isinstance(cache, RadixCache):
        return RadixTreeReclaimer(cache, allocator)
    raise EngineExtConfigError(
        f"kvsidecar has no reclaimer for SGLang's {type(cache).__name__}; supported: "
        "UnifiedRadixCache (default) and RadixCache: drop the option that selects another "
        "cache, or start without kvsidecar (KVSIDECAR_ENABLE=0)"
    )
