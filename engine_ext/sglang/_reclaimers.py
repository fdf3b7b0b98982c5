"""Reclaimers over SGLang's tree caches: free whole pages at the least cache cost.

SGLang evicts leaves in LRU order to make room; a shrink needs another
question answered: *which cache entries must go so that these pages empty?*
Both reclaimers list the blocks of unlocked nodes (a node is unlocked only if
its whole subtree is, since a lock walks up to the root), and evict through
the cache's own primitives so its counters (``evictable_size``/
``protected_size``), leaf sets and KV events stay right. A locked node is
never touched, whatever the coordinator asks.

:meth:`_TreeReclaimer.reclaim_pages` (what the coordinator calls) runs
:func:`._peel.peel_pages` over a view of the tree: leaf tails are evicted
cheapest page first until the pool is at its target, in one call.

* :class:`RadixTreeReclaimer` -- ``RadixCache`` (Python nodes): a leaf is
  split at the page boundary (``RadixCache._split_node``) and only its tail
  is evicted, so freeing one page costs about one page of cache.
* :class:`UnifiedTreeReclaimer` -- ``UnifiedRadixCache`` (default; Rust tree
  core, which exposes neither a node listing nor a split): leaves come from
  a dry run of the core's eviction walk, parents from ``collect_path_info``,
  and a leaf is evicted whole (``_evict_device_leaf``); the cheapest leaves
  per page go first.

Thread: the scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .. import count_reclaimable_pages
from .._errors import EngineExtConfigError
from ._peel import LeafEntry, peel_pages

if TYPE_CHECKING:
    from allocator import BlockAllocator

    from ._allocator import ElasticTokenAllocator

__all__ = ["RadixTreeReclaimer", "UnifiedTreeReclaimer", "make_reclaimer"]


class _TreeReclaimer:
    """Common part: the unlocked blocks (cached by what can change them), the page
    reclaim and the block-list protocol (``evict``) for callers that name blocks."""

    name = "sglang-tree"

    def __init__(self, cache: Any, allocator: ElasticTokenAllocator) -> None:
        self.cache = cache
        self.allocator = allocator
        self.page_size: int = allocator.page_size
        self.blocks: BlockAllocator = allocator.blocks
        self.num_evicted_blocks = 0  # blocks freed by evict()/reclaim_pages(), collateral included
        self.num_freed_pages = 0  # pages emptied by reclaim_pages()
        self._unlocked_key: tuple[int, ...] | None = None
        self._unlocked_set: frozenset[int] = frozenset()

    # Reclaimer protocol ----------------------------------------------------------
    def evictable_blocks(self) -> Iterable[int]:
        return self.unlocked_blocks()

    def is_evictable(self, block: int) -> bool:
        blocks = self.blocks
        if blocks.tracks_evictable:  # marked per tree event (._counts): O(1)
            return blocks.is_marked_evictable(block)
        return block in self.unlocked_blocks()

    def reclaim_pages(self, max_pages: int) -> int:
        """Evict until the pool is at its target or ``max_pages`` pages emptied (one call:
        leaf tails cheapest page first, see :mod:`._peel`); returns the pages emptied."""
        blocks = self.blocks
        pages = blocks.pages

        def at_target() -> bool:
            target = pages.target_pages
            return target is not None and pages.num_mapped <= target

        if at_target() or (blocks.tracks_evictable and not blocks.num_reclaimable_pages):
            return 0  # at target, or no page is all evictable (the counts say so in O(1))
        unlocked = self.unlocked_blocks()
        if not blocks.tracks_evictable and not count_reclaimable_pages(unlocked, blocks):
            return 0
        before = blocks.num_allocated_blocks
        try:
            emptied = self._peel(unlocked, max_pages, at_target)
        finally:
            self.num_evicted_blocks += before - blocks.num_allocated_blocks
        self.num_freed_pages += emptied
        return emptied

    def evict(self, blocks: Sequence[int]) -> int:
        unlocked = self.unlocked_blocks()
        wanted = {b for b in blocks if b in unlocked}
        pages = self.blocks.pages
        if not wanted or (
            pages.target_pages is not None and pages.num_mapped <= pages.target_pages
        ):
            return 0  # earlier victims' collateral already brought the pool under its target
        before = self.blocks.num_allocated_blocks
        self._evict_pages(wanted)
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

    def scan_unlocked(self) -> frozenset[int]:
        """A fresh full scan of the unlocked blocks (O(tree)); not cached. For the
        evictable counts' start and drift repair (:mod:`._counts`), never per iteration."""
        return frozenset(self._scan())

    # internals -----------------------------------------------------------------------
    def _state_key(self) -> tuple[int, ...]:
        cache = self.cache
        return (
            self.allocator.num_allocs,
            self.allocator.num_frees,
            int(cache.evictable_size()),
            int(cache.protected_size()),
        )

    def _peel(self, unlocked: frozenset[int], max_pages: int, done: Any) -> int:
        raise NotImplementedError

    def _scan(self) -> Iterable[int]:
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

    def _blocks_of(self, node: Any) -> list[int]:
        ps = self.page_size
        return [int(s) // ps for s in node.value[::ps].tolist()]

    def _peel(self, unlocked: frozenset[int], max_pages: int, done: Any) -> int:
        return peel_pages(_RadixView(self), self.blocks, unlocked, max_pages, done)

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

    def _remove_leaf(self, node: Any) -> None:
        cache = self.cache
        cache.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        cache._delete_leaf(node)  # the parent becomes an evictable leaf if it may
        cache.kv_events.record_remove(node)
        node.value = None
        node.parent = None

    def _remove_subtree(self, top: Any) -> None:
        order: list[Any] = []
        stack = [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents: each is a leaf when deleted
            self._remove_leaf(node)


class _RadixView:
    """:class:`._peel.TreeView` over ``RadixCache``: leaves split at a page boundary."""

    can_split = True

    def __init__(self, reclaimer: RadixTreeReclaimer) -> None:
        self._r = reclaimer
        self._root = reclaimer.cache.root_node

    def leaves(self) -> Iterator[LeafEntry]:
        r = self._r
        for node in r._unlocked():
            if not node.children:
                yield node, r._blocks_of(node)

    def evict_tail(self, handle: Hashable, keep: int) -> tuple[Hashable | None, LeafEntry | None]:
        r = self._r
        node: Any = handle
        if keep:
            # the node object becomes the tail; its new parent holds the kept prefix
            r.cache._split_node(node.key, node, keep * r.page_size)
            kept = node.parent
            r._remove_leaf(node)
            return kept, None
        parent = node.parent
        r._remove_leaf(node)
        if (
            parent is self._root
            or parent.lock_ref
            or parent.value is None
            or any(not c.evicted for c in parent.children.values())
        ):
            return None, None
        return None, (parent, r._blocks_of(parent))

    def parent_blocks(self, handle: Hashable) -> int:
        parent = getattr(handle, "parent", None)
        if parent is None or parent is self._root or parent.lock_ref or parent.value is None:
            return 0
        return len(parent.value) // self._r.page_size


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

    def _leaves(self) -> list[LeafEntry]:
        """Walk the core's eviction order without evicting: its unlocked device leaves."""
        cache = self.cache
        core = cache.tree_core
        tracker = {ct: 0 for ct in cache.tree_components}
        out: list[LeafEntry] = []
        core.evict_device_start(self._full, max(1, int(core.full_evictable_size())))
        try:
            while True:
                node_id, progressed = cache._evict_device_next_node(self._full, tracker)
                if node_id is None:
                    if not progressed:
                        break
                    continue
                blocks = self._blocks_of(node_id)
                if blocks:
                    out.append((node_id, blocks))
        finally:
            core.evict_device_end(self._full)
        return out

    def _blocks_of(self, node_id: int) -> list[int]:
        value = self.cache.tree_core.get_component_device_value(node_id, self._full)
        if value is None:
            return []
        ps = self.page_size
        return [int(s) // ps for s in value[::ps].tolist()]

    def _peel(self, unlocked: frozenset[int], max_pages: int, done: Any) -> int:
        view = _UnifiedView(self, unlocked)
        leaves = self._leaves()
        cache = self.cache
        core = cache.tree_core
        core.evict_device_start(self._full, max(1, int(core.full_evictable_size())))
        try:
            view.start(leaves)
            return peel_pages(view, self.blocks, unlocked, max_pages, done)
        finally:
            core.evict_device_end(self._full)

    def _evict_leaf(self, node_id: int, tracker: dict[Any, int]) -> None:
        backup = self.cache._evict_device_leaf(node_id, tracker)
        if backup is not None:  # write-back HiCache: refused at install
            raise RuntimeError(
                "kvsidecar does not support SGLang's hierarchical "
                "cache (write-back); start without --enable-"
                "hierarchical-cache"
            )

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
                    self._evict_leaf(node_id, tracker)
        finally:
            core.evict_device_end(full)


class _UnifiedView:
    """:class:`._peel.TreeView` over ``UnifiedRadixCache``: whole leaves (the Rust core
    has no split). Call inside an ``evict_device_start``/``end`` bracket."""

    can_split = False

    def __init__(self, reclaimer: UnifiedTreeReclaimer, unlocked: frozenset[int]) -> None:
        self._r = reclaimer
        self._unlocked = unlocked
        self._leaves: list[LeafEntry] = []
        self._tracker = {ct: 0 for ct in reclaimer.cache.tree_components}

    def start(self, leaves: list[LeafEntry]) -> None:
        self._leaves = leaves

    def leaves(self) -> list[LeafEntry]:
        return self._leaves

    def evict_tail(self, handle: Hashable, keep: int) -> tuple[Hashable | None, LeafEntry | None]:
        if keep:
            raise AssertionError("the Rust tree core cannot split a leaf")
        r = self._r
        core = r.cache.tree_core
        node_id: Any = handle
        (path,) = core.collect_path_info([node_id])
        r._evict_leaf(node_id, self._tracker)
        if len(path) < 2:
            return None, None  # a child of the root
        (parent_path,) = core.collect_path_info([path[-2].node_id])
        info = parent_path[-1]
        if info.num_children:
            return None, None
        blocks = r._blocks_of(info.node_id)
        if not blocks or any(b not in self._unlocked for b in blocks):
            return None, None  # locked (a request matched up to it) or no device value
        return None, (info.node_id, blocks)

    def parent_blocks(self, handle: Hashable) -> int:
        (path,) = self._r.cache.tree_core.collect_path_info([handle])
        if len(path) < 2:
            return 0
        blocks = self._r._blocks_of(path[-2].node_id)
        return len(blocks) if blocks and all(b in self._unlocked for b in blocks) else 0


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
