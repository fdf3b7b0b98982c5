"""Prefix-cache reclaimers and the page-aware victim selection both adapters share.

Memory comes back a whole page at a time, and a page can only be unmapped
when every block on it is free. So evicting blocks in LRU order (what an
engine does to make room) is the wrong tool for shrinking: it throws away
cached prefixes on pages that stay mapped because one running request still
holds a block there. :func:`select_victim_pages` instead picks pages whose
*every* allocated block is evictable, fewest blocks first (most memory per
lost cache block), and re-checks each page right before choosing it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["BlockView", "Reclaimer", "VictimPage", "count_reclaimable_pages", "select_victim_pages"]

#: A chosen page and the blocks to evict from it (all its allocated blocks).
VictimPage = tuple[int, list[int]]


class BlockView(Protocol):
    """What victim selection reads from :class:`allocator.BlockAllocator`."""

    def page_of(self, block: int) -> int: ...

    def occupancy(self, page: int) -> int: ...

    def blocks_on_page(self, page: int) -> list[int]: ...


@runtime_checkable
class Reclaimer(Protocol):
    """A prefix cache that can give blocks back. Engine thread only.

    ``evictable_blocks`` lists blocks held by the cache alone (no running
    request references them); ``is_evictable`` answers the same for one block
    *now* and is called right before a page is chosen; ``evict`` drops the
    cache entries of exactly these blocks and frees them to the block
    allocator, returning how many it evicted. A reclaimer never evicts a block
    a request references, whatever it is asked.

    Optional: ``reclaim_pages(max_pages) -> int``. When every registered
    reclaimer has it, a shrink pass calls it instead of :func:`select_victim_pages`
    (tree caches, where evicting a block takes every block after it in its node
    and the node's subtree): it evicts until the pool is at its target or
    ``max_pages`` pages emptied, in one call, and returns the pages emptied.
    """

    name: str

    def evictable_blocks(self) -> Iterable[int]: ...

    def is_evictable(self, block: int) -> bool: ...

    def evict(self, blocks: Sequence[int]) -> int: ...


def _evictable_per_page(evictable: Iterable[int], blocks: BlockView) -> dict[int, int]:
    counts: dict[int, int] = {}
    page_of = blocks.page_of
    for block in evictable:
        page = page_of(block)
        counts[page] = counts.get(page, 0) + 1
    return counts


def count_reclaimable_pages(evictable: Iterable[int], blocks: BlockView) -> int:
    """Pages whose every allocated block is in ``evictable`` (no re-check)."""
    counts = _evictable_per_page(evictable, blocks)
    return sum(1 for page, n in counts.items() if n == blocks.occupancy(page))


def select_victim_pages(
    evictable: Iterable[int],
    blocks: BlockView,
    max_pages: int,
    recheck: Callable[[int], bool],
) -> list[VictimPage]:
    """Choose at most ``max_pages`` pages that can be emptied by eviction alone.

    ``evictable`` is a listing of evictable blocks (it may be stale by the time
    we get here); a page qualifies when its listed blocks are all of its
    allocated blocks. Candidates are tried fewest blocks first (ties: lower
    page first); right before a page is chosen, every block now on it must
    pass ``recheck``, else the page is skipped. Returns ``(page, blocks)``
    pairs, blocks being the page's allocated blocks at the re-check.
    """
    if max_pages <= 0:
        return []
    counts = _evictable_per_page(evictable, blocks)
    candidates = sorted((n, page) for page, n in counts.items() if n == blocks.occupancy(page))
    chosen: list[VictimPage] = []
    for _, page in candidates:
        on_page = blocks.blocks_on_page(page)
        if on_page and all(recheck(b) for b in on_page):
            chosen.append((page, on_page))
            if len(chosen) == max_pages:
                break
    return chosen
