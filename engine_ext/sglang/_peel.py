"""Page-aware eviction over a radix tree: free pages by peeling leaf tails.

In a radix tree a cached block can only go together with every block after
it in its node and the node's whole subtree. The blocks a shrink must give
back, though, come a page (``blocks_per_page`` blocks) at a time, and a page
is freed only when *every* block on it is gone. Evicting whole leaf nodes
(SGLang's own eviction) therefore overshoots by up to a whole node: a
600-token document is one node of ~37 pages, all of them evicted to free
one.

:func:`peel_pages` frees pages at the least cache cost it can find, in one
call, until the caller's ``done()`` or ``max_pages`` pages emptied:

* The candidates are the *tail pages* of the unlocked leaves (the page of
  a leaf's last block). Freeing one costs, for every leaf holding a block
  of it, the blocks from that block to the leaf's end (with
  :attr:`TreeView.can_split`; else the whole leaf). A tail page holding a
  block of a locked node, of an inner node or of no node (SGLang's padding
  block) cannot be freed by peeling now.
* The cheapest candidate goes first; after each cut the cut leaves offer
  their new tail page, and a leaf emptied entirely may turn its parent into
  a new leaf (a shared prefix is peeled only once its descendants are gone).
* A leaf none of whose pages can be freed (a page shares blocks with an
  inner node) may be evicted whole to expose its unlocked parent, when its
  size plus the parent's cut is cheaper than the cheapest cut on offer and
  a page whose every block is unlocked is still in use.

With sequentially allocated blocks a long leaf is peeled page by page at
``blocks_per_page`` blocks per page: the minimum.

Thread: the scheduler thread only (it calls into the tree cache).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from allocator import BlockAllocator

__all__ = ["TreeView", "peel_pages"]

#: A leaf as the tree presents it: an opaque handle and its blocks, root side first.
LeafEntry = tuple[Hashable, list[int]]


class TreeView(Protocol):
    """What :func:`peel_pages` needs from a tree cache (one call's worth)."""

    #: Whether :meth:`evict_tail` can keep a prefix of a leaf (else only ``keep == 0``).
    can_split: bool

    def leaves(self) -> Iterable[LeafEntry]:
        """Unlocked leaf nodes (no children), with their blocks in order."""
        ...

    def evict_tail(self, handle: Hashable, keep: int) -> tuple[Hashable | None, LeafEntry | None]:
        """Evict the leaf's blocks from index ``keep`` on (through the cache's own
        primitives). Returns the handle of the kept prefix (``None`` if ``keep == 0``)
        and, when the whole leaf went, its parent if that is now an unlocked leaf."""
        ...

    def parent_blocks(self, handle: Hashable) -> int:
        """Blocks of the leaf's parent if it is an unlocked node other than the root, else 0."""
        ...


class _Leaf:
    """One leaf during a call: its handle, remaining blocks, and a version that
    invalidates older heap entries."""

    __slots__ = ("blocks", "handle", "version")

    def __init__(self, handle: Hashable, blocks: list[int]) -> None:
        self.handle = handle
        self.blocks = blocks
        self.version = 0


def peel_pages(
    view: TreeView,
    blocks: BlockAllocator,
    unlocked: frozenset[int],
    max_pages: int,
    done: Callable[[], bool],
) -> int:
    """Evict leaf tails until ``done()`` or ``max_pages`` pages emptied; returns the
    pages emptied. ``unlocked``: every block of an unlocked node (inner ones too)."""
    if max_pages <= 0 or done():
        return 0
    bpp = blocks.blocks_per_page
    split = view.can_split
    loc: dict[int, tuple[_Leaf, int]] = {}  # block of a current leaf -> (leaf, index)
    heap: list[tuple[int, int, _Leaf, int]] = []  # (cost, order, leaf, version)
    waiting: dict[int, list[_Leaf]] = {}  # page -> leaves whose tail page waits on it
    stuck: dict[_Leaf, None] = {}  # leaves none of whose pages can be freed now
    # (estimated cost, order, leaf, version): a stuck leaf evicted whole to expose its parent
    exposers: list[tuple[int, int, _Leaf, int]] = []
    goal = {b // bpp for b in unlocked}  # pages whose every block is unlocked
    goal = {p for p in goal if all(b in unlocked for b in blocks.blocks_on_page(p))}
    goal_left = len(goal)
    order = itertools.count()

    def page_cuts(leaf: _Leaf, page: int) -> dict[_Leaf, int] | None:
        """The cut that frees ``page`` (a page of ``leaf``), or None if it cannot now."""
        cuts: dict[_Leaf, int] = {}
        for block in blocks.blocks_on_page(page):
            at = loc.get(block)
            if at is None:  # locked, an inner node, or SGLang's padding block
                return None
            owner, index = at
            if owner not in cuts or index < cuts[owner]:
                cuts[owner] = index if split else 0
        return cuts

    def cuts_for(leaf: _Leaf) -> tuple[dict[_Leaf, int] | None, int | None]:
        """The cheapest cut freeing one of ``leaf``'s pages, nearest its tail first (the
        blocks behind it go too), and the tail page if that one waits."""
        first_waiting: int | None = None
        seen: set[int] = set()
        for block in reversed(leaf.blocks):
            page = block // bpp
            if page in seen:
                continue
            seen.add(page)
            cuts = page_cuts(leaf, page)
            if cuts is not None:
                return cuts, first_waiting
            if first_waiting is None:
                first_waiting = page
        return None, first_waiting

    def offer(leaf: _Leaf) -> None:
        leaf.version += 1
        stuck.pop(leaf, None)
        if not leaf.blocks:
            return
        cuts, waits_on = cuts_for(leaf)
        if waits_on is not None:
            waiting.setdefault(waits_on, []).append(leaf)  # a cheaper cut may come
        if cuts is None:
            stuck[leaf] = None
            parent = view.parent_blocks(leaf.handle)
            if parent:  # the cost to free a page through its parent, about
                cost = len(leaf.blocks) + (min(parent, bpp) if split else parent)
                heapq.heappush(exposers, (cost, next(order), leaf, leaf.version))
        else:
            cost = sum(len(owner.blocks) - at for owner, at in cuts.items())
            heapq.heappush(heap, (cost, next(order), leaf, leaf.version))

    def add(entry: LeafEntry) -> _Leaf:
        leaf = _Leaf(entry[0], entry[1])
        for index, block in enumerate(leaf.blocks):
            loc[block] = (leaf, index)
        return leaf

    def wake(pages: Iterable[int]) -> None:
        for page in pages:
            for leaf in waiting.pop(page, ()):
                offer(leaf)

    def cut(leaf: _Leaf, at: int, touched: set[int]) -> None:
        gone = leaf.blocks[at:]
        del leaf.blocks[at:]
        for block in gone:
            del loc[block]
            touched.add(block // bpp)
        kept, parent = view.evict_tail(leaf.handle, at)
        if kept is not None:
            leaf.handle = kept
        if not leaf.blocks and parent is not None:
            grown = add(parent)
            offer(grown)
            wake({b // bpp for b in grown.blocks})

    for leaf in [add(entry) for entry in view.leaves()]:
        offer(leaf)
    emptied = 0
    while emptied < max_pages and not done():
        while heap and (heap[0][3] != heap[0][2].version or not heap[0][2].blocks):
            heapq.heappop(heap)
        while exposers and (
            exposers[0][3] != exposers[0][2].version or exposers[0][2] not in stuck
        ):
            heapq.heappop(exposers)
        # A page whose every block is unlocked may still be in use only because it holds
        # blocks of an inner node: evicting a stuck leaf whole exposes its parent (once its
        # siblings are gone too), when that is cheaper than the cheapest cut on offer.
        expose = bool(exposers) and goal_left > 0 and (not heap or exposers[0][0] < heap[0][0])
        if expose:
            leaf = heapq.heappop(exposers)[2]
            cuts: dict[_Leaf, int] = {leaf: 0}
        elif heap:
            leaf = heapq.heappop(heap)[2]
            found, _ = cuts_for(leaf)  # the tree moved since it was offered: cut it now
            if found is None:
                offer(leaf)
                continue
            cuts = found
        else:
            break
        touched: set[int] = set()
        for owner, at in cuts.items():
            cut(owner, at, touched)
        for owner in cuts:
            offer(owner)
        for page in touched:
            if not blocks.occupancy(page):
                emptied += 1
                goal_left -= page in goal
        wake(touched)
    return emptied
