"""Engine blocks inside pages."""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._errors import AllocatorConfigError, AllocatorContractError, AllocatorError, BackendError
from ._guard import ThreadGuard
from ._pages import PageAllocator

_log = logging.getLogger("allocator.blocks")

try:  # the C hot paths (allocator/_speedups.c), built by scripts/dev.sh or pip
    from . import _speedups
except ImportError:  # no compiler where this was installed: the pure-Python ones below
    _speedups = None  # type: ignore[assignment]
else:
    _speedups.configure(AllocatorContractError, AllocatorError)

#: Whether :class:`BlockAllocator` runs its hot paths in C (``allocator._speedups``).
SPEEDUPS = _speedups is not None

__all__ = ["SPEEDUPS", "BlockAllocator", "PyBlockAllocator"]


class _BlockBook:
    """Everything of :class:`BlockAllocator` but its four hot paths (state, queries,
    retirement, multi-block frees); see :class:`BlockAllocator`."""

    def __init__(
        self, pages: PageAllocator, blocks_per_page: int, *, guard: ThreadGuard | None = None
    ) -> None:
        if (
            isinstance(blocks_per_page, bool)
            or not isinstance(blocks_per_page, int)
            or blocks_per_page <= 0
        ):
            raise AllocatorConfigError(
                f"blocks_per_page must be an int >= 1; got {blocks_per_page!r} (use "
                "PageLayout.blocks_per_page(block_bytes) to compute it)"
            )
        pages.set_observer(self)
        bpp = blocks_per_page
        self.pages = pages
        self.guard = guard if guard is not None else pages.guard
        self.blocks_per_page = bpp
        self.num_blocks = pages.num_pages * bpp  # virtual capacity in blocks
        self.num_allocated_blocks = 0
        self.num_retired_blocks = 0  # allocated blocks on retired pages
        # per block: 0 free, 1 allocated, 2 allocated and marked evictable (when tracking)
        self._allocated = bytearray(self.num_blocks)
        self._ones = b"\x01" * bpp  # the flags of a run of fresh blocks (sliced)
        self._occupancy = [0] * pages.num_pages
        self._slots: list[list[int]] = [[] for _ in range(pages.num_pages)]  # free slots, in use
        self._retired = bytearray(pages.num_pages)  # mirror of PageAllocator retirement
        # _buckets[k]: partly used, non-retired pages holding k blocks (1 <= k < bpp);
        # _pos[page] is the page's index in its bucket (swap-remove keeps this O(1)).
        self._buckets: list[list[int]] = [[] for _ in range(bpp)]
        self._pos = [0] * pages.num_pages
        self._top = 0  # no bucket above this index is non-empty
        # _rbuckets[k]: retired pages holding k blocks (1 <= k <= bpp), same _pos scheme;
        # a page is in at most one bucket of either kind.
        self._rbuckets: list[list[int]] = [[] for _ in range(bpp + 1)]
        self._rtop = 0  # no retired bucket above this index is non-empty
        self._partial_free = 0
        self.changes = 0  # block events so far (see the class doc)
        # the last alloc() returned None because the device refused a map (read right after)
        self.refused_by_device = False
        #: Whether the cache above reports evictable blocks (:meth:`track_evictable`).
        self.tracks_evictable = False
        self._ev_on: list[int] = []  # marked blocks per page (when tracking)
        self.num_evictable_blocks = 0
        self.num_reclaimable_pages = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`alloc` could still hand out under the current target."""
        return self._partial_free + self.pages.headroom_pages() * self.blocks_per_page

    def page_of(self, block: int) -> int:
        """The page that holds ``block``."""
        self._check_block(block)
        return block // self.blocks_per_page

    def occupancy(self, page: int) -> int:
        """Allocated blocks on ``page``."""
        self._check_page(page)
        return self._occupancy[page]

    def blocks_on_page(self, page: int) -> list[int]:
        """Allocated block ids on ``page``, ascending."""
        self._check_page(page)
        first = page * self.blocks_per_page
        flags = self._allocated
        return [b for b in range(first, first + self.blocks_per_page) if flags[b]]

    def is_allocated(self, block: int) -> bool:
        """Whether ``block`` is allocated now."""
        self._check_block(block)
        return bool(self._allocated[block])

    def is_marked_evictable(self, block: int) -> bool:
        """Whether ``block`` is marked evictable now (False when not tracking)."""
        self._check_block(block)
        return self._allocated[block] == 2

    def held_per_page(self) -> list[int]:
        """Per page, allocated blocks not marked evictable (occupancy when not tracking).

        O(pages), in C (``map(operator.sub, ...)``), no Python loop over pages.
        """
        if not self.tracks_evictable:
            return list(self._occupancy)
        return list(map(operator.sub, self._occupancy, self._ev_on))

    def free_after_eviction(self, cap_pages: int, unlocked: Iterable[int] | None = None) -> int:
        """A lower bound of the blocks :meth:`alloc` could hand out once every
        evictable block is freed, with at most ``cap_pages`` pages in use.

        Evictable = marked (tracking), or the ``unlocked`` block ids given.
        Pages still holding other blocks stay in use: if they fit under the cap,
        the answer is the cap's blocks minus those held; else only ``cap_pages``
        of them can take blocks, counted as the *fullest* ones (the least room
        any choice leaves). O(pages) in C plus O(blocks_per_page) in Python
        (a count of pages per held level), O(unlocked) for ``unlocked``.
        """
        if type(cap_pages) is not int or not 0 <= cap_pages <= self.pages.num_pages:
            raise AllocatorContractError(
                f"free_after_eviction(): cap_pages must be an int in 0..{self.pages.num_pages}; "
                f"got {cap_pages!r}"
            )
        bpp = self.blocks_per_page
        held = self.held_per_page()
        if unlocked is not None:
            unlocked = list(unlocked)
            for block in unlocked:
                if type(block) is not int or not 0 <= block < self.num_blocks:
                    raise AllocatorContractError(
                        f"free_after_eviction(): {block!r} is not a block id in "
                        f"0..{self.num_blocks - 1}"
                    )
            for page, count in Counter(b // bpp for b in unlocked).items():
                left = held[page] - count
                held[page] = max(0, left)
        in_use = len(held) - held.count(0)
        if in_use <= cap_pages:
            return max(0, cap_pages * bpp - sum(held))
        per_level = Counter(held)  # pages per number of held blocks (C: _count_elements)
        room, free = cap_pages, 0
        for level in range(bpp, 0, -1):  # the fullest pages first
            take = per_level.get(level, 0)
            take = min(take, room)
            free += take * (bpp - level)
            room -= take
            if not room:
                break
        return free

    def evictable_on(self, page: int) -> int:
        """Blocks on ``page`` marked evictable now (O(1); 0 when not tracking)."""
        self._check_page(page)
        return self._ev_on[page] if self.tracks_evictable else 0

    # PageObserver ---------------------------------------------------------
    def live_blocks(self, page: int) -> int:
        """Same as :meth:`occupancy` (asked by the PageAllocator when retiring)."""
        return self._occupancy[page]

    def on_retired(self, page: int, retired: bool) -> None:
        """Move ``page`` out of (or back into) the pages that take new blocks."""
        occ = self._occupancy[page]
        if retired:
            self._retired[page] = 1
            if 0 < occ < self.blocks_per_page:
                self._bucket_remove(page, occ)
            if occ:
                self._rbucket_add(page, occ)
            self._partial_free -= self.blocks_per_page - occ
            self.num_retired_blocks += occ
        else:
            self._retired[page] = 0
            if occ:
                self._rbucket_remove(page, occ)
            if 0 < occ < self.blocks_per_page:
                self._bucket_add(page, occ)
            self._partial_free += self.blocks_per_page - occ
            self.num_retired_blocks -= occ

    def fullest_retired(self) -> int:
        """A retired page with the most allocated blocks (O(blocks_per_page) at worst)."""
        buckets, top = self._rbuckets, self._rtop
        while top and not buckets[top]:
            top -= 1
        self._rtop = top
        if not top:
            raise AllocatorContractError("fullest_retired(): no page is retired")
        return buckets[top][-1]

    # ------------------------------------------------------------------ mutations
    def alloc_above_target(self, n: int) -> list[int] | None:
        """``n`` blocks for requests already running, above the page target if need be.

        The target is lifted for this call only and put back at once: pages mapped
        now beyond it are retired (no new blocks; unmapped when they empty), and
        the coordinator reports the overage. None if even that fails (no free block
        at all, or the device refused the page). Engine thread; a limit never
        preempts a running request, so the engines' pools serve it this way.
        """
        pages = self.pages
        saved = pages.target_pages
        ids: list[int] | None = None
        try:
            try:
                pages.set_target(None)
            except BackendError as exc:  # the target is lifted; a stuck page still fails
                _log.warning("alloc_above_target: %s", exc)
            ids = self.alloc(n)  # type: ignore[attr-defined]  # C or Python
        finally:
            # Put the target back, whatever happened: a failed unmap while doing so (a page
            # that stays out of service, retried later) must neither lose the blocks just
            # handed out nor leave the limit lifted.
            try:
                pages.set_target(saved)
            except BackendError as exc:
                _log.warning("alloc_above_target: the target is back, but %s", exc)
        return ids

    def track_evictable(self) -> None:
        """From now on the cache above marks its evictable blocks (nothing marked yet).

        Every cache above this allocator must then mark through it: the counts
        are the whole truth for the coordinator (no rescan). Idempotent.
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        if not self.tracks_evictable:
            self._ev_on = [0] * self.pages.num_pages
            self.tracks_evictable = True

    def note_change(self) -> None:
        """Something a shrink pass looks at moved outside this allocator's calls."""
        self.changes += 1

    # ------------------------------------------------------------------ internals
    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.pages.num_pages:
            raise AllocatorContractError(f"page {page} is outside 0..{self.pages.num_pages - 1}")

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise AllocatorContractError(f"block {block} is outside 0..{self.num_blocks - 1}")

    def _untrack_freed(self, batch: list[int]) -> None:
        """Evictable accounting for ``batch`` (checked), before the occupancy drops."""
        flags, ev_on, bpp = self._allocated, self._ev_on, self.blocks_per_page
        occupancy = self._occupancy
        if len(batch) == 1:  # the common free of one block (a request's partial tail block)
            block = batch[0]
            page = block // bpp
            occ = occupancy[page]
            on = ev_on[page]
            was = on == occ
            if flags[block] == 2:
                on -= 1
                ev_on[page] = on
                self.num_evictable_blocks -= 1
            self.num_reclaimable_pages += (occ > 1 and on == occ - 1) - was
            return
        gone: dict[int, int] = {}  # page -> blocks of this batch already accounted
        delta = 0
        for block in batch:
            page = block // bpp
            done = gone.get(page, 0)
            gone[page] = done + 1
            occ = occupancy[page] - done  # occupancy as sequential frees would see it
            on = ev_on[page]
            was = on == occ
            if flags[block] == 2:  # marked: free() clears the flag right after
                on -= 1
                ev_on[page] = on
                self.num_evictable_blocks -= 1
            delta += (occ > 1 and on == occ - 1) - was
        self.num_reclaimable_pages += delta

    def _roll_back(self, out: list[int]) -> None:
        """Undo a partial ``alloc``: the blocks taken go back, and so does the evictable
        accounting ``_take`` changed (a page whose live blocks were all evictable before
        the take is reclaimable again). The C ``alloc`` calls this too."""
        if not out:
            return
        if self.tracks_evictable:
            self._untrack_freed(out)
        self._free_checked(out)

    def _free_checked(self, batch: list[int]) -> None:
        """Free blocks already known to be allocated and distinct.

        Bucket moves happen once per touched page, after its blocks are back.
        """
        bpp = self.blocks_per_page
        allocated, occupancy, slots = self._allocated, self._occupancy, self._slots
        before: dict[int, int] = {}  # touched page -> occupancy before this call
        for block in batch:
            page = block // bpp
            allocated[block] = 0
            slots[page].append(block - page * bpp)
            old = occupancy[page]
            if page not in before:
                before[page] = old
            occupancy[page] = old - 1
        # Account for every touched page before any page goes back: releasing a page can
        # take a retired page back into service (on_retired), which reads this state.
        retired = self._retired
        emptied_retired: list[int] = []
        emptied: list[int] = []
        for page, old in before.items():
            new = occupancy[page]
            if retired[page]:
                self.num_retired_blocks -= old - new
                self._rbucket_remove(page, old)
                if new:
                    self._rbucket_add(page, new)
                else:
                    slots[page] = []
                    retired[page] = 0
                    emptied_retired.append(page)
                continue
            if old < bpp:
                self._bucket_remove(page, old)
            self._partial_free += old - new
            if new:
                self._bucket_add(page, new)
            else:
                self._partial_free -= bpp
                slots[page] = []
                emptied.append(page)
        # Retired pages first, so no emptied page is taken back into service; one
        # release_many unmaps contiguous runs in one backend call.
        if emptied_retired or emptied:
            self.pages.release_many(emptied_retired + emptied)

    def _bucket_add(self, page: int, occ: int) -> None:
        bucket = self._buckets[occ]
        self._pos[page] = len(bucket)
        bucket.append(page)
        self._top = max(self._top, occ)

    def _bucket_remove(self, page: int, occ: int) -> None:
        bucket = self._buckets[occ]
        index = self._pos[page]
        last = bucket.pop()
        if last != page:
            bucket[index] = last
            self._pos[last] = index

    def _rbucket_add(self, page: int, occ: int) -> None:
        bucket = self._rbuckets[occ]
        self._pos[page] = len(bucket)
        bucket.append(page)
        self._rtop = max(self._rtop, occ)

    def _rbucket_remove(self, page: int, occ: int) -> None:
        bucket = self._rbuckets[occ]
        index = self._pos[page]
        last = bucket.pop()
        if last != page:
            bucket[index] = last
            self._pos[last] = index


class PyBlockAllocator(_BlockBook):
    """:class:`BlockAllocator` with its hot paths (``alloc``, ``free``, ``mark_evictable``,
    ``unmark_evictable``) in Python: the reference the C ones (``allocator/_speedups.c``)
    are tested against, and what runs where the C module was not built."""

    def alloc(self, n: int) -> list[int] | None:
        """``n`` blocks, all or nothing; ``None`` when they cannot all be had now.

        Fills partly used, non-retired pages first (fullest first), then
        acquires pages from the :class:`PageAllocator`.
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        self.refused_by_device = False
        if type(n) is not int or n < 0:
            raise AllocatorContractError(f"alloc(n) needs an int >= 0; got {n!r}")
        if n > self._partial_free and n > self.num_free_blocks:
            return None
        out: list[int] = []
        need = n
        try:
            buckets = self._buckets
            while need and self._partial_free:
                top = self._top  # the fullest partly used page sits in the highest bucket
                while not buckets[top]:
                    top -= 1
                self._top = top
                need -= self._take(buckets[top][-1], need, out)
            while need:
                fresh = self.pages.acquire()
                if fresh is None:
                    if self.pages.refused_by_device:  # no device memory: all or nothing
                        self.refused_by_device = True
                        self._roll_back(out)
                        return None
                    raise AllocatorContractError("PageAllocator refused a page within headroom")
                self._slots[fresh] = list(range(self.blocks_per_page - 1, -1, -1))
                self._partial_free += self.blocks_per_page
                need -= self._take(fresh, need, out)
        except AllocatorError:
            self._roll_back(out)
            raise
        self.num_allocated_blocks += n
        self.changes += 1
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Give ``blocks`` back; a page that empties goes back to the PageAllocator.

        Checks every id first (range, allocated, no repeats) and changes
        nothing if one is wrong.
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        batch = blocks if type(blocks) is list else list(blocks)
        allocated, limit = self._allocated, self.num_blocks
        for block in batch:
            if type(block) is not int or not 0 <= block < limit:
                raise AllocatorContractError(
                    f"free(): {block!r} is not a block id in 0..{limit - 1}"
                )
            if not allocated[block]:
                raise AllocatorContractError(
                    f"free(): block {block} is not allocated (double free?)"
                )
        if len(batch) > 1 and len(set(batch)) != len(batch):
            raise AllocatorContractError("free(): the same block appears twice in one call")
        self.num_allocated_blocks -= len(batch)
        self.changes += 1
        if self.tracks_evictable:
            self._untrack_freed(batch)
        if len(batch) == 1:
            self._free_one(batch[0])
        else:
            self._free_checked(batch)

    def mark_evictable(self, blocks: Iterable[int]) -> None:
        """These allocated blocks are now held by the cache alone (O(1) each).

        Each id is checked (allocated, not marked yet); on a bad one the blocks
        before it stay marked and :class:`AllocatorContractError` is raised.
        """
        self._change_marks(blocks, True)

    def unmark_evictable(self, blocks: Iterable[int]) -> None:
        """These blocks are referenced again (or about to be reused in place)."""
        self._change_marks(blocks, False)

    def _change_marks(self, blocks: Iterable[int], mark: bool) -> None:
        """Flag 1 -> 2 (``mark``) or 2 -> 1 for each block, keeping the per-page counts."""
        name = "mark_evictable" if mark else "unmark_evictable"
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        if not self.tracks_evictable:
            raise AllocatorContractError(f"{name}(): call track_evictable() first")
        flags, ev_on, occupancy = self._allocated, self._ev_on, self._occupancy
        bpp, limit = self.blocks_per_page, self.num_blocks
        before, after, step = (1, 2, 1) if mark else (2, 1, -1)
        pages_changed = 0  # pages that became (mark) or stopped being (unmark) all evictable
        count = 0
        try:
            for block in blocks:
                if type(block) is not int or not 0 <= block < limit:
                    raise AllocatorContractError(
                        f"{name}(): {block!r} is not a block id in 0..{limit - 1}"
                    )
                if flags[block] != before:
                    if not mark:
                        raise AllocatorContractError(f"{name}(): block {block} is not marked")
                    raise AllocatorContractError(
                        f"{name}(): block {block} is "
                        f"{'already marked' if flags[block] else 'not allocated'}"
                    )
                flags[block] = after
                count += 1
                page = block // bpp
                on = ev_on[page]
                if on + (step > 0) == occupancy[page]:  # all evictable after (mark) or before
                    pages_changed += 1
                ev_on[page] = on + step
        finally:  # the counts agree with the flags stored, even after a bad id
            self.num_reclaimable_pages += step * pages_changed
            self.num_evictable_blocks += step * count
            self.changes += 1

    def _take(self, page: int, need: int, out: list[int]) -> int:
        """Allocate up to ``need`` blocks from ``page`` (in use, not retired) into ``out``."""
        bpp = self.blocks_per_page
        old = self._occupancy[page]
        count = min(need, bpp - old)
        slots = self._slots[page]
        first = page * bpp
        allocated = self._allocated
        if not old:  # a fresh page: its slots are bpp-1..0, so the ids taken are one run
            allocated[first : first + count] = self._ones[:count]
            out.extend(range(first, first + count))
            del slots[-count:]
        elif count == 1:  # the common decode step: one block
            block = first + slots.pop()
            allocated[block] = 1
            out.append(block)
        else:
            for slot in slots[-count:]:
                allocated[first + slot] = 1
                out.append(first + slot)
            del slots[-count:]
        new = old + count
        self._occupancy[page] = new
        self._partial_free -= count
        if old and self.tracks_evictable and self._ev_on[page] == old:
            self.num_reclaimable_pages -= 1  # a fresh block on it is not evictable
        buckets, pos = self._buckets, self._pos
        if old:  # leave bucket[old] (swap-remove)
            bucket = buckets[old]
            last = bucket.pop()
            if last != page:
                bucket[pos[page]] = last
                pos[last] = pos[page]
        if new < bpp:  # join bucket[new]
            bucket = buckets[new]
            pos[page] = len(bucket)
            bucket.append(page)
            self._top = max(self._top, new)
        return count

    def _free_one(self, block: int) -> None:
        """Free one block known to be allocated (the common decode-step case)."""
        bpp = self.blocks_per_page
        page = block // bpp
        self._allocated[block] = 0
        self._slots[page].append(block - page * bpp)
        old = self._occupancy[page]
        new = old - 1
        self._occupancy[page] = new
        if self._retired[page]:
            self.num_retired_blocks -= 1
            self._rbucket_remove(page, old)
            if new:
                self._rbucket_add(page, new)
            else:
                self._slots[page] = []
                self._retired[page] = 0
                self.pages.release(page)
            return
        self._partial_free += 1
        buckets, pos = self._buckets, self._pos
        if old < bpp:
            bucket = buckets[old]
            last = bucket.pop()
            if last != page:
                bucket[pos[page]] = last
                pos[last] = pos[page]
        if new:
            bucket = buckets[new]
            pos[page] = len(bucket)
            bucket.append(page)
            self._top = max(self._top, new)
        else:
            self._partial_free -= bpp
            self._slots[page] = []
            self.pages.release(page)


_DOC = """Hands out engine blocks from pages; engine thread only (guarded).

Block ids are ``page * blocks_per_page + slot``: a block never straddles
a page, and :meth:`page_of` is a division.

Owns, per page, the free slots and the occupancy (allocated blocks), and
buckets of *partly used, non-retired* pages keyed by occupancy, so that
best fit (fullest partly used page first) is found in O(blocks_per_page)
per ``alloc`` call and each block costs O(1). Empty pages go back to the
:class:`PageAllocator` at once (one ``release_many`` per ``free`` call).
Retired pages sit in separate buckets by occupancy, never in the partly
used ones, so they never receive new blocks and the fullest one is found
in O(blocks_per_page) when the PageAllocator takes one back.

Evictable tracking (opt-in, :meth:`track_evictable`): the prefix cache
above marks the allocated blocks it alone holds (:meth:`mark_evictable`,
:meth:`unmark_evictable`; :meth:`free` unmarks). The allocator then keeps
per page how many of its blocks are evictable, and
``num_reclaimable_pages`` (pages whose every allocated block is evictable)
in O(1) per block event, so nobody rescans the cache for these figures.
``changes`` counts every block event (alloc, free, mark, unmark,
:meth:`note_change`): equal counts mean nothing a shrink pass looks at moved.

Invariants: ``num_allocated_blocks == sum(occupancy)``; every in-use page
has occupancy >= 1; ``_partial_free`` == free slots on in-use,
non-retired pages; every retired page is in ``_rbuckets[occupancy]``;
``_allocated[block]`` is 0 (free), 1 (allocated) or 2 (allocated and
marked evictable: one flag per block, so a mark is one test and one store);
when tracking, ``_ev_on[page]`` == marked blocks on ``page`` <= its
occupancy, and ``num_reclaimable_pages`` == pages with
``0 < occupancy == _ev_on``.

The four hot paths (``alloc``, ``free``, ``mark_evictable``,
``unmark_evictable``) run in C (``allocator/_speedups.c``, :data:`SPEEDUPS`)
when that module is built, else in Python (:class:`PyBlockAllocator`, their
reference: tests drive both with the same operations and compare every field).
"""


if TYPE_CHECKING or _speedups is None:

    class BlockAllocator(PyBlockAllocator):
        __doc__ = _DOC

else:

    class BlockAllocator(_speedups.BlockCore, _BlockBook):
        __doc__ = _DOC
