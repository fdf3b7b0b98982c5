"""Evictable/pinned counts kept per tree event, not rescanned (issue 17, item 3).

The coordinator's ``evictable_bytes``/``pinned_bytes`` come from the block
allocator's evictable tracking (:meth:`allocator.BlockAllocator.track_evictable`):
the cache above marks each block SGLang alone holds, and the allocator keeps
per page how many of its blocks are marked, so the figures cost O(1) per
block event and the coordinator never lists the tree for them. This module
marks SGLang's tree blocks: a block is *evictable* when it belongs to a tree
node whose ``lock_ref`` is 0 (what SGLang counts in ``evictable_size()`` and
what the reclaimers' full scan lists).

Hooks, installed on the cache instance (``instance.method = wrapper``, so the
CPU harness and the real server get the same ones) by :func:`track_tree_cache`:

* ``RadixCache`` (Python nodes): ``inc_lock_ref``/``dec_lock_ref`` walk the
  node's path first, only while nodes change state (a parent is locked at
  least as often as a child, so the walk stops at the first node that does
  not): O(nodes that change + 1). ``_insert_helper``: a new leaf is marked.
  ``_split_node``: the node's host block list is split with it.
  ``_delete_leaf``: blocks still marked (a free deferred by a free group) are
  unmarked; freed blocks were unmarked by the allocator's ``free``.
* ``UnifiedRadixCache`` (Rust tree core, no node listing): the core reports
  no per-node lock state, so the hooks read ``evictable_size()`` before and
  after ``inc_lock_ref``/``dec_lock_ref``/``insert``: the tokens that changed
  state are the last ones of the node's root path (locks nest: the nodes that
  change form the path's tail), found with ``collect_path_info`` (O(path
  depth), as the core's own lock walk). ``_evict_device_leaf``: the node's
  host entry goes; inside a free group its blocks are unmarked.
  ``reset`` (``flush_cache``): every host entry goes.

Block ids are kept on the host per node (read from the node's slot tensor
once, when an insert adds it; a split hands the prefix to the new parent),
so a lock or unlock copies nothing from the device (``num_device_reads``).

A drift check (:meth:`TreeCounts.verify`, O(1): marked blocks x page size
against SGLang's own ``evictable_size()``) runs at every scheduler
iteration; a mismatch (an SGLang path these hooks do not see, e.g. a
``reset`` without ``clear``) is logged once and repaired by one full
rescan (:meth:`TreeCounts.resync`), counted in ``num_resyncs``.

Thread: the scheduler thread only (the allocator's guard checks it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from allocator import BlockAllocator

__all__ = ["TreeCounts", "track_tree_cache"]

_log = logging.getLogger("engine_ext.sglang")


class TreeCounts:
    """Keeps the block allocator's evictable marks equal to SGLang's unlocked tree blocks.

    Owns the hooks on one tree cache instance (installed by
    :func:`track_tree_cache`, removed by :meth:`close`) and operation counters
    the tests read (``num_hook_calls``, ``num_path_nodes``, ``num_blocks_marked``,
    ``num_blocks_unmarked``, ``num_resyncs``). Borrows the allocator.

    Invariant (between two hook calls): the marked blocks are exactly the
    blocks of the tree's unlocked nodes; ``num_evictable_blocks * page_size ==
    cache.evictable_size()``. Scheduler thread only.
    """

    def __init__(
        self,
        cache: Any,
        blocks: BlockAllocator,
        page_size: int,
        scan: Callable[[], Iterable[int]],
    ) -> None:
        self.cache = cache
        self.blocks = blocks
        self.page_size = page_size
        self._scan = scan  # the reclaimer's full listing of unlocked blocks (resync only)
        self._hooked: list[str] = []
        self.num_hook_calls = 0  # tree events seen
        self.num_path_nodes = 0  # tree nodes visited by the hooks (not the tree size)
        self.num_blocks_marked = 0
        self.num_blocks_unmarked = 0
        self.num_resyncs = 0  # full rescans (drift repaired); 0 when every event was seen
        # node slot tensors read (a device-to-host copy on GPU): at insert and on a mirror
        # miss only, never for a lock or unlock of a node the mirror knows
        self.num_device_reads = 0
        self._warned = False

    # -- marks ---------------------------------------------------------------------------

    def blocks_of(self, value: Any) -> list[int]:
        """SGLang page ids (= block ids) of a page-aligned slot tensor."""
        if value is None or len(value) == 0:
            return []
        ps = self.page_size
        return [int(s) // ps for s in value[::ps].tolist()]

    def read(self, value: Any) -> list[int]:
        """:meth:`blocks_of`, counted as a device read (the hooks' host mirror missed)."""
        self.num_device_reads += 1
        return self.blocks_of(value)

    def mark(self, blocks: list[int]) -> None:
        """These blocks are held by an unlocked node now (already marked ones are skipped)."""
        b = self.blocks
        todo = [x for x in blocks if b.is_allocated(x) and not b.is_marked_evictable(x)]
        if todo:
            b.mark_evictable(todo)
            self.num_blocks_marked += len(todo)

    def unmark(self, blocks: list[int]) -> None:
        """These blocks are locked, or leave the tree (unmarked ones are skipped)."""
        b = self.blocks
        todo = [x for x in blocks if b.is_marked_evictable(x)]
        if todo:
            b.unmark_evictable(todo)
            self.num_blocks_unmarked += len(todo)

    # -- drift check -----------------------------------------------------------------------

    def verify(self) -> bool:
        """O(1): whether the marks agree with SGLang's ``evictable_size()``; if not, resync
        (one full rescan, logged once). Returns whether they agreed."""
        if self.blocks.num_evictable_blocks * self.page_size == int(self.cache.evictable_size()):
            return True
        if not self._warned:
            self._warned = True
            _log.warning(
                "kvsidecar: SGLang's evictable size (%d tokens) moved without a tracked tree "
                "event (%d blocks marked); rescanning the tree (counted in num_resyncs)",
                int(self.cache.evictable_size()),
                self.blocks.num_evictable_blocks,
            )
        self.resync()
        return False

    def resync(self) -> None:
        """Make the marks equal to a full scan of the tree (O(tree + blocks))."""
        b = self.blocks
        unlocked = set(self._scan())
        stale = [x for x in range(b.num_blocks) if b.is_marked_evictable(x) and x not in unlocked]
        self.unmark(stale)
        self.mark(sorted(unlocked))
        self.num_resyncs += 1

    # -- installing ------------------------------------------------------------------------

    def hook(self, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``cache.name`` on the instance by ``make(original_bound_method)``."""
        original = getattr(self.cache, name)
        setattr(self.cache, name, functools.wraps(original)(make(original)))
        self._hooked.append(name)

    def close(self) -> None:
        """Remove the hooks (the class's methods show through again)."""
        for name in self._hooked:
            self.cache.__dict__.pop(name, None)
        self._hooked.clear()


# -- RadixCache (Python TreeNode) -------------------------------------------------------------


def _hook_radix(counts: TreeCounts) -> None:
    cache = counts.cache
    ps = counts.page_size
    mirror = "_kvsidecar_blocks"  # a node's block ids on the host (no device copy per lock)

    def node_blocks(node: Any) -> list[int]:
        value = node.value
        if value is None:
            return []
        blocks: list[int] | None = node.__dict__.get(mirror)
        if blocks is None or len(blocks) * ps != len(value):
            blocks = counts.read(value)
            setattr(node, mirror, blocks)
        return blocks

    def changing(node: Any, lock_ref: int) -> list[Any]:
        """The node and its ancestors whose ``lock_ref`` is ``lock_ref``: the nodes a lock
        walk changes state on (a parent is locked at least as often as its child)."""
        root = cache.root_node
        out = []
        while node is not None and node is not root and node.lock_ref == lock_ref:
            out.append(node)
            node = node.parent
        counts.num_path_nodes += len(out) + 1
        return out

    def lock_walk(original: Any, lock_ref: int, after: Callable[[list[Any]], None]) -> Any:
        """A lock walk's wrapper: the nodes it changes state on (``lock_ref`` before the
        walk), the walk itself, then ``after`` with those nodes."""

        def walk(node: Any, *args: Any, **kwargs: Any) -> Any:
            nodes = changing(node, lock_ref)
            result = original(node, *args, **kwargs)
            counts.num_hook_calls += 1
            after(nodes)
            return result

        return walk

    def now_locked(nodes: list[Any]) -> None:  # 0 -> 1: their blocks are pinned now
        for n in nodes:
            counts.unmark(node_blocks(n))

    def now_unlocked(nodes: list[Any]) -> None:  # 1 -> 0: their blocks are evictable now
        for n in nodes:
            if n.lock_ref == 0 and n.value is not None:
                counts.mark(node_blocks(n))

    def inc_lock_ref(original: Any) -> Any:
        return lock_walk(original, 0, now_locked)

    def dec_lock_ref(original: Any) -> Any:
        return lock_walk(original, 1, now_unlocked)

    def insert_helper(original: Any) -> Any:
        def insert(*args: Any, **kwargs: Any) -> Any:
            before = cache.evictable_size_
            result = original(*args, **kwargs)
            counts.num_hook_calls += 1
            if cache.evictable_size_ > before:  # a new leaf (lock_ref 0) ends the path
                counts.num_path_nodes += 1
                counts.mark(node_blocks(result[1]))
            return result

        return insert

    def split_node(original: Any) -> Any:
        def split(key: Any, child: Any, split_len: int, *args: Any, **kwargs: Any) -> Any:
            blocks: list[int] | None = child.__dict__.get(mirror)
            new = original(key, child, split_len, *args, **kwargs)
            if blocks is not None and split_len % ps == 0:  # the prefix went to ``new``
                cut = split_len // ps
                setattr(new, mirror, blocks[:cut])
                setattr(child, mirror, blocks[cut:])
            return new

        return split

    def delete_leaf(original: Any) -> Any:
        def delete(node: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = node_blocks(node)
            result = original(node, *args, **kwargs)
            counts.num_hook_calls += 1
            counts.num_path_nodes += 1
            counts.unmark(blocks)  # still marked: a free the group defers
            return result

        return delete

    counts.hook("inc_lock_ref", inc_lock_ref)
    counts.hook("dec_lock_ref", dec_lock_ref)
    counts.hook("_insert_helper", insert_helper)
    counts.hook("_split_node", split_node)
    counts.hook("_delete_leaf", delete_leaf)


# -- UnifiedRadixCache (Rust tree core) ------------------------------------------------------


def _hook_unified(counts: TreeCounts) -> None:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    cache = counts.cache
    full = ComponentType.FULL
    ps = counts.page_size

    # node id -> (path offset of blocks[0], blocks up to the node's end): a node id keeps
    # its end for life and only loses a prefix (a split gives it to a new parent id), and
    # ids are never reused, so an entry starting at or before the node is sliced to it
    mirror: dict[Any, tuple[int, list[int]]] = {}

    def node_blocks(info: Any) -> list[int]:
        """Blocks of one path node, from the mirror when it covers them, else read once."""
        start, size = info.path_start, info.full_value_len or 0
        entry = mirror.get(info.node_id)
        if entry is not None and info.path_end - start == size:
            first, known = entry
            cut, extra = divmod(start - first, ps)
            if cut >= 0 and not extra and (len(known) - cut) * ps == size:
                if cut:  # split since: the prefix is the new parent's
                    mirror[info.node_id] = (start, known[cut:])
                    mirror.setdefault(info.parent_id, (first, known[:cut]))
                return known[cut:]
        blocks = counts.read(cache.tree_core.get_component_device_value(info.node_id, full))
        mirror[info.node_id] = (start, blocks)
        return blocks

    def tail_blocks(node_id: Any, tokens: int) -> list[int] | None:
        """Blocks of the last ``tokens`` tokens of ``node_id``'s root path, whole nodes
        only; None when no run of whole nodes adds up to it (drift: resync)."""
        (path,) = cache.tree_core.collect_path_info([node_id])
        counts.num_path_nodes += len(path)
        out: list[int] = []
        left = tokens
        for info in reversed(path):
            if left <= 0:
                break
            size = info.full_value_len or 0
            if size > left:
                return None
            out.extend(node_blocks(info))
            left -= size
        return out if left == 0 else None

    def apply(node_id: Any, before: int, *, lock: bool) -> None:
        """``evictable_size()`` moved from ``before``: (un)mark the path tail it covers."""
        counts.num_hook_calls += 1
        delta = int(cache.evictable_size()) - before
        if delta == 0 or node_id is None:
            return
        if (delta < 0) != lock:
            counts.verify()  # an insert that shrank the evictable size, or the reverse
            return
        blocks = tail_blocks(node_id, abs(delta))
        if blocks is None:
            counts.verify()
        elif delta < 0:
            counts.unmark(blocks)
        else:
            counts.mark(blocks)

    def lock_ref(*, lock: bool) -> Callable[[Any], Any]:
        """``inc_lock_ref`` (``lock``) / ``dec_lock_ref``: (un)mark what the call moved."""

        def wrap(original: Any) -> Any:
            def call(node_id: Any, *args: Any, **kwargs: Any) -> Any:
                before = int(cache.evictable_size())
                result = original(node_id, *args, **kwargs)
                apply(node_id, before, lock=lock)
                return result

            return call

        return wrap

    def insert(original: Any) -> Any:
        def ins(*args: Any, **kwargs: Any) -> Any:
            before = int(cache.evictable_size())
            result = original(*args, **kwargs)
            apply(getattr(result, "last_device_node", None), before, lock=False)
            return result

        return ins

    def evict_device_leaf(original: Any) -> Any:
        def evict(node_id: Any, *args: Any, **kwargs: Any) -> Any:
            mirror.pop(node_id, None)
            # frees held by a free group leave the blocks marked: read them to unmark
            deferred = getattr(cache.token_to_kv_pool_allocator, "free_group", None) is not None
            value = cache.tree_core.get_component_device_value(node_id, full) if deferred else None
            result = original(node_id, *args, **kwargs)
            counts.num_hook_calls += 1
            counts.num_path_nodes += 1
            if deferred:
                counts.unmark(counts.read(value))
            return result

        return evict

    def reset(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            # flush_cache: every node goes (ids are never reused): drop their host entries,
            # or the mirror keeps every node of every flushed tree for the process's life
            mirror.clear()
            counts.num_hook_calls += 1
            return original(*args, **kwargs)

        return call

    counts.hook("inc_lock_ref", lock_ref(lock=True))
    counts.hook("dec_lock_ref", lock_ref(lock=False))
    counts.hook("insert", insert)
    counts.hook("_evict_device_leaf", evict_device_leaf)
    counts.hook("reset", reset)


def track_tree_cache(
    cache: Any, blocks: BlockAllocator, page_size: int, scan: Callable[[], Iterable[int]]
) -> TreeCounts:
    """Turn on the allocator's evictable tracking and keep it fed from ``cache``'s events.

    ``scan`` lists the blocks of every unlocked node (the reclaimer's full scan),
    used once here (the tree may hold entries already) and on drift only.
    """
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from .._errors import EngineExtConfigError

    counts = TreeCounts(cache, blocks, page_size, scan)
    blocks.track_evictable()
    if isinstance(cache, UnifiedRadixCache):
        _hook_unified(counts)
    elif isinstance(cache, RadixCache):
        _hook_radix(counts)
    else:
        raise EngineExtConfigError(
            f"kvsidecar cannot count evictable blocks of SGLang's {type(cache).__name__}; "
            "supported: UnifiedRadixCache (default) and RadixCache"
        )
    counts.resync()
    counts.num_resyncs = 0  # the initial listing is not drift
    return counts
