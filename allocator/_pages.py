"""Which pages are mapped, and which may take new blocks."""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from enum import IntEnum
from typing import Protocol

from ._backend import Backend
from ._errors import (
    AllocatorConfigError,
    AllocatorContractError,
    BackendError,
    DeviceOutOfMemory,
)
from ._guard import ThreadGuard

__all__ = ["PageAllocator", "PageObserver", "PageState"]

_log = logging.getLogger(__name__)

#: After a map found the device full, acquire() maps nothing more for this long.
DEVICE_RETRY_S = 1.0


class PageState(IntEnum):
    """Life cycle of one page."""

    UNMAPPED = 0  # no physical memory behind it
    FREE = 1  # mapped, holds no blocks: the pre-mapped reserve
    IN_USE = 2  # handed out by acquire(); may take new blocks
    RETIRED = 3  # in use but above the target: no new blocks, unmapped when emptied
    UNMAP_FAILED = 4  # holds no blocks, its unmap failed: out of service, mapped, retried


class PageObserver(Protocol):
    """What a :class:`PageAllocator` asks of the block layer above it."""

    def live_blocks(self, page: int) -> int:
        """Blocks allocated on ``page`` now (retirement picks the emptiest pages)."""
        ...

    def on_retired(self, page: int, retired: bool) -> None:
        """``page`` was retired (``True``) or taken back into service (``False``)."""
        ...

    def fullest_retired(self) -> int:
        """A retired page with the most live blocks (asked when one is taken back).

        Called only while at least one page is retired; must cost O(1) amortised
        (the allocator asks once per page released while others are retired).
        """
        ...


class PageAllocator:
    """Decides which pages are mapped; engine thread only (guarded).

    Owns the page states and drives the backend's ``map``/``unmap``; it does
    not own the backend's life cycle (the caller releases the backend).

    Invariants (``cap`` = ``target_pages`` or ``num_pages`` when unlimited):

    * non-retired mapped pages (free + in use) <= ``cap``;
    * retired pages == max(0, in-use pages - ``cap``) after every call, and
      free pages == 0 while any page is retired;
    * free mapped pages <= ``reserve_pages``; they count as mapped.
    * a page whose unmap failed (the backend still maps it, maybe in some
      regions only) is ``UNMAP_FAILED``: it holds no blocks, is never handed
      out, counts as mapped, and is unmapped again by the next
      ``release_many`` or ``set_target`` (:meth:`retry_unmaps`). After any
      failed unmap, a page is ``UNMAPPED`` exactly when the backend says it
      is not mapped.

    Costs: ``acquire`` and ``release`` are O(1) (plus one map/unmap): taking
    back the fullest retired page asks the observer's
    :meth:`PageObserver.fullest_retired` (without an observer every page
    counts as empty and the lowest retired page returns, O(retired)).
    ``release_many`` unmaps in one ``unmap_many`` call (contiguous runs are
    one call per region). ``set_target`` is O(in-use pages log k).
    """

    def __init__(
        self, backend: Backend, *, reserve_pages: int = 0, guard: ThreadGuard | None = None
    ) -> None:
        num_pages = backend.layout.num_pages
        if isinstance(reserve_pages, bool) or not isinstance(reserve_pages, int):
            raise AllocatorConfigError(f"reserve_pages must be an int; got {reserve_pages!r}")
        if not 0 <= reserve_pages <= num_pages:
            raise AllocatorConfigError(
                f"reserve_pages={reserve_pages} must be between 0 and the capacity ({num_pages} "
                "pages); a few pages are enough to keep acquire() off the map path"
            )
        if any(backend.is_mapped(page) for page in range(num_pages)):
            raise AllocatorConfigError(
                "the backend already maps pages; give PageAllocator a fresh backend"
            )
        self.backend = backend
        self.guard = guard if guard is not None else ThreadGuard("PageAllocator")
        self.num_pages = num_pages
        self.reserve_pages = reserve_pages
        self.target_pages: int | None = None  # None = unlimited
        self._state = bytearray(num_pages)  # PageState per page
        self._unmapped = list(range(num_pages - 1, -1, -1))  # stack: low pages come out first
        # Pages with memory behind them (free reserve + in use + retired): num_pages -
        # len(_unmapped), kept as a plain int because every free and step reads it.
        self.num_mapped = 0
        self._free: list[int] = []  # stack of FREE pages
        self._in_use: set[int] = set()  # IN_USE (not retired)
        self._retired: set[int] = set()  # RETIRED
        self._unmap_failed: list[int] = []  # UNMAP_FAILED
        self._observer: PageObserver | None = None
        self._device_full_at: float | None = None  # monotonic time of the last device OOM
        # whether the last acquire() returned None because the device refused the map (not
        # time-based, unlike device_full: the caller of acquire reads it right after)
        self.refused_by_device = False
        self._device_cap = num_pages  # pages mapped when the device was found full
        self._refill_held_until = 0.0  # monotonic time before which refills wait (0: none)
        self._top_up()

    # ------------------------------------------------------------------ counts
    @property
    def num_free_mapped(self) -> int:
        """Mapped pages that hold no blocks (the reserve)."""
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        """Pages handed out by :meth:`acquire` and not yet released (retired included)."""
        return len(self._in_use) + len(self._retired)

    @property
    def num_unmap_failed(self) -> int:
        """Mapped pages out of service because their unmap failed (retried later)."""
        return len(self._unmap_failed)

    @property
    def num_retired(self) -> int:
        """In-use pages above the target, waiting for their last block to go."""
        return len(self._retired)

    @property
    def device_full(self) -> bool:
        """A map found no free device memory less than ``DEVICE_RETRY_S`` ago.

        Meanwhile :meth:`cap_pages` holds at the pages mapped when it was
        found full, so the headroom the engine sees is what is really there.
        """
        at = self._device_full_at
        if at is None:
            return False
        if time.monotonic() - at >= DEVICE_RETRY_S:
            self._device_full_at = None  # try the device again
            return False
        return True

    def cap_pages(self) -> int:
        """Most pages that may be mapped now: the target, or the capacity if unlimited.

        While :attr:`device_full`, no more than were mapped when the device was full.
        """
        target = self.target_pages
        cap = self.num_pages if target is None else min(target, self.num_pages)
        if self._device_full_at is not None and self.device_full:
            cap = min(cap, self._device_cap)
        return cap

    def headroom_pages(self) -> int:
        """Pages :meth:`acquire` could still hand out (free mapped + mappable under the cap)."""
        if self._retired:
            return 0
        return len(self._free) + max(0, self.cap_pages() - self.num_mapped)

    def page_state(self, page: int) -> PageState:
        """The state of ``page``."""
        self._check_page(page)
        return PageState(self._state[page])

    def is_retired(self, page: int) -> bool:
        """Whether ``page`` is retired (in use above the target)."""
        self._check_page(page)
        return self._state[page] == PageState.RETIRED

    def set_observer(self, observer: PageObserver) -> None:
        """Register the block layer (one per PageAllocator; BlockAllocator does this)."""
        if self._observer is not None:
            raise AllocatorContractError("this PageAllocator already serves a BlockAllocator")
        self._observer = observer

    # ------------------------------------------------------------------ mutations
    def set_target(self, pages: int | None) -> None:
        """Allow at most ``pages`` mapped pages (``None`` = unlimited, 0 is valid).

        Free mapped pages above the target are unmapped at once; in-use pages
        still above it are retired, fewest live blocks first. Raising the
        target takes retired pages back (fullest first) and refills the reserve.
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        if pages is not None and (
            isinstance(pages, bool) or not isinstance(pages, int) or pages < 0
        ):
            raise AllocatorContractError(f"target must be None or an int >= 0; got {pages!r}")
        self.target_pages = pages
        self._device_full_at = None  # limits moved: memory may be free again, try the device
        self._refill_held_until = 0.0
        error: BackendError | None = None
        if self._unmap_failed:
            try:
                self.retry_unmaps()
            except BackendError as exc:
                error = exc
        cap = self.cap_pages()
        drop = min(self.num_mapped - cap, len(self._free))
        if drop > 0:
            victims = self._free[-drop:]
            del self._free[-drop:]
            error = self._unmap_out_of_service(victims) or error
        self._trim_spares()
        want_retired = max(0, self.num_in_use - cap)
        if want_retired > len(self._retired):
            self._retire(want_retired - len(self._retired))
        elif want_retired < len(self._retired):
            self._unretire(len(self._retired) - want_retired)
        try:
            self._top_up()
        except BackendError as exc:
            _log.warning("could not refill the page reserve after set_target: %s", exc)
        if error is not None:
            raise error

    def acquire(self) -> int | None:
        """A mapped page for new blocks, mapping one if the target allows; else ``None``.

        After a ``None``, :attr:`refused_by_device` says whether the device refused the map
        (out of memory, or any other map failure: the engine's allocation path must not
        raise; the cap then holds at what is mapped for ``DEVICE_RETRY_S``).
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        self.refused_by_device = False
        if self._free:
            page = self._free.pop()
        elif not self._retired and self.num_mapped < self.cap_pages():
            page = self._unmapped[-1]
            try:
                self.backend.map(page)
            except BackendError as exc:
                # Out of memory, or another failure of the driver/OS (the backend rolled the
                # map back): no page now either way. Raising here would end the engine (its
                # allocation path); the cap holds at what is mapped and the device is tried
                # again after DEVICE_RETRY_S or at the next limit change. A fatal error (a
                # dead TP/PP rank) is raised: the engine cannot go on, and says so loudly.
                if exc.fatal:
                    raise
                self.refused_by_device = True
                self._hold_at_mapped(f"for page {page}", exc)
                return None
            self._unmapped.pop()
            self.num_mapped += 1
        else:
            return None
        self._state[page] = PageState.IN_USE
        self._in_use.add(page)
        return page

    def refill_reserve(self) -> int:
        """Map free pages until the reserve is full again; returns how many were mapped.

        Pages :meth:`acquire` takes out of the reserve come back only when a page
        empties or the target moves; call this at a safe point (the engine's own
        thread, no allocation under way) so the next burst finds its pages mapped.
        Within the cap, none while pages are retired. A device out of memory holds
        the cap at what is mapped, as in :meth:`acquire` (:attr:`device_full`); any
        other backend error is logged and refills wait ``DEVICE_RETRY_S`` (or the
        next :meth:`set_target`), so a failing backend is not retried at every step.
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        if self._refill_held_until and time.monotonic() < self._refill_held_until:
            return 0
        before = self.num_mapped
        try:
            self._top_up()
        except DeviceOutOfMemory as exc:
            self._hold_at_mapped("to refill the page reserve", exc)
        except BackendError as exc:
            self._refill_held_until = time.monotonic() + DEVICE_RETRY_S
            _log.warning(
                "could not refill the page reserve: %s; trying again in %.1f s",
                exc,
                DEVICE_RETRY_S,
            )
        return self.num_mapped - before

    def _hold_at_mapped(self, what: str, exc: BackendError) -> None:
        """The device had no memory for one more page: hold the cap at what is mapped
        for ``DEVICE_RETRY_S`` (:attr:`device_full`), and say so once."""
        self._device_full_at = time.monotonic()
        self._device_cap = self.num_mapped
        _log.warning(
            "no device memory %s (%d pages mapped): %s; holding at %d pages for %.1f s",
            what,
            self.num_mapped,
            exc,
            self.num_mapped,
            DEVICE_RETRY_S,
        )

    def release(self, page: int) -> None:
        """``page`` holds no blocks any more: unmap it, or keep it as free reserve.

        A retired page is always unmapped. While other pages are retired, the
        emptied page is unmapped and the fullest retired page is taken back.
        Otherwise it stays mapped as reserve if the reserve has room.
        """
        self.release_many((page,))

    def release_many(self, pages: Sequence[int]) -> None:
        """:meth:`release` each of ``pages`` (retired ones first), with one ``unmap_many``.

        Checks every page first (in range, in use or retired, no repeats) and
        changes nothing if one is wrong. A failed unmap still releases every
        page (they hold no blocks): those the backend unmapped are booked
        unmapped, those it still maps become ``UNMAP_FAILED`` (out of service,
        retried by the next release or :meth:`set_target`), then
        :class:`BackendError` is raised.
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        state, num_pages = self._state, self.num_pages
        for page in pages:
            if type(page) is not int or not 0 <= page < num_pages:
                raise AllocatorContractError(
                    f"release({page!r}): no such page (0..{num_pages - 1})"
                )
            if state[page] not in (PageState.IN_USE, PageState.RETIRED):
                raise AllocatorContractError(
                    f"release({page}): the page is {PageState(state[page]).name}, not in use; "
                    "release each acquired page exactly once"
                )
        if len(pages) > 1 and len(set(pages)) != len(pages):
            raise AllocatorContractError("release_many(): the same page appears twice")
        # Plan as sequential release() calls would go, then unmap once, then apply.
        retired_left = len(self._retired)
        free_room = self.reserve_pages - len(self._free)
        unmap: list[int] = []
        keep: list[int] = []
        take_back = 0
        for page in pages:  # retired pages first: none of them is taken back into service
            if state[page] == PageState.RETIRED:
                unmap.append(page)
                retired_left -= 1
        for page in pages:
            if state[page] == PageState.RETIRED:
                continue
            if retired_left:
                unmap.append(page)
                retired_left -= 1
                take_back += 1
            elif free_room > 0:
                keep.append(page)
                free_room -= 1
            else:
                unmap.append(page)
        error: BackendError | None = None
        try:
            if len(unmap) == 1:
                self.backend.unmap(unmap[0])
            elif unmap:
                self.backend.unmap_many(unmap)
        except BackendError as exc:  # not all or nothing: book what the backend did
            error = exc
        for page in unmap:
            if state[page] == PageState.RETIRED:
                self._retired.discard(page)
            else:
                self._in_use.discard(page)
        if error is None:
            self._mark_unmapped(unmap)
        else:
            error = self._book_failed_unmap(unmap, error)
        if take_back:
            self._unretire(take_back)
        for page in keep:
            self._in_use.discard(page)
            state[page] = PageState.FREE
            self._free.append(page)
        if unmap:
            self._trim_spares()
        if error is not None:
            raise error
        if self._unmap_failed:
            try:
                self.retry_unmaps()
            except BackendError as exc:  # raised when it first failed; still held, counted
                _log.debug("pages %s still cannot be unmapped: %s", self._unmap_failed, exc)

    def retry_unmaps(self) -> None:
        """Unmap the pages whose unmap failed earlier (``UNMAP_FAILED``).

        Raises :class:`BackendError` if some still fail; those stay out of service.
        """
        if self.guard.enabled:  # a call only when the guard is on (hot path)
            self.guard.check()
        pages, self._unmap_failed = self._unmap_failed, []
        if not pages:
            return
        error = self._unmap_out_of_service(pages)
        self._trim_spares()
        if error is not None:
            raise error

    # ------------------------------------------------------------------ internals
    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise AllocatorContractError(f"page {page} is outside 0..{self.num_pages - 1}")

    def _unmap_out_of_service(self, pages: list[int]) -> BackendError | None:
        """Unmap ``pages``, already out of every state list; book what the backend did."""
        try:
            self.backend.unmap_many(pages)
        except BackendError as exc:
            return self._book_failed_unmap(pages, exc)
        self._mark_unmapped(pages)
        return None

    def _book_failed_unmap(self, pages: list[int], exc: BackendError) -> BackendError:
        """After a failed unmap of ``pages`` (out of every state list): the ones the backend
        still maps become UNMAP_FAILED, the others UNMAPPED. Returns the error to raise."""
        mapped = self.backend.is_mapped
        stuck: list[int] = []
        gone: list[int] = []
        for page in pages:
            (stuck if mapped(page) else gone).append(page)
        self._mark_unmapped(gone)
        for page in stuck:
            self._state[page] = PageState.UNMAP_FAILED
        self._unmap_failed.extend(stuck)
        error = BackendError(
            f"could not unmap page(s) {sorted(stuck)} of {len(pages)} ({exc}); they hold no blocks "
            "and stay mapped out of service (counted as mapped) until the next release or "
            "limit change unmaps them; the others were unmapped",
            errno=exc.errno,
        )
        error.__cause__ = exc
        return error

    def _mark_unmapped(self, pages: list[int]) -> None:
        for page in pages:
            self._state[page] = PageState.UNMAPPED
        self._unmapped.extend(reversed(pages))
        self.num_mapped -= len(pages)

    def _trim_spares(self) -> None:
        """Backends that keep unmapped handles for reuse (CudaBackend) keep them under the cap."""
        trim = getattr(self.backend, "trim_spares", None)
        if trim is not None:
            try:
                trim(max(0, self.cap_pages() - self.num_mapped))
            except BackendError as exc:
                _log.warning("could not give back spare device memory: %s", exc)

    def reserve_wanted(self) -> int:
        """Pages :meth:`refill_reserve` would map now: what the reserve lacks, within the
        cap; 0 while any page is retired."""
        if self._retired or not self.reserve_pages:
            return 0
        return max(0, min(self.reserve_pages - len(self._free), self.cap_pages() - self.num_mapped))

    def _top_up(self) -> None:
        want = self.reserve_wanted()
        if want <= 0:
            return
        pages = self._unmapped[-want:]
        self.backend.map_many(pages)
        del self._unmapped[-want:]
        self.num_mapped += len(pages)
        for page in pages:
            self._state[page] = PageState.FREE
        self._free.extend(sorted(pages, reverse=True))  # the lowest page is popped first

    def _retire(self, count: int) -> None:
        # The emptiest pages, the highest page first among equals: grouped by live
        # count (no key tuples: one observer call per in-use page, then C sorts).
        observer = self._observer
        groups: dict[int, list[int]] = {}
        if observer is None:
            groups[0] = list(self._in_use)
        else:
            live = observer.live_blocks
            for page in self._in_use:
                group = groups.get(n := live(page))
                if group is None:
                    groups[n] = [page]
                else:
                    group.append(page)
        chosen: list[int] = []
        for n in sorted(groups):
            group = groups[n]
            group.sort(reverse=True)
            chosen += group[: count - len(chosen)]
            if len(chosen) == count:
                break
        for page in chosen:
            self._in_use.discard(page)
            self._retired.add(page)
            self._state[page] = PageState.RETIRED
            if observer is not None:
                observer.on_retired(page, True)

    def _unretire(self, count: int) -> None:
        observer = self._observer
        if observer is None:  # every page counts as empty: the lowest pages return
            for page in heapq.nsmallest(count, self._retired):
                self._back_in_service(page)
            return
        for _ in range(count):
            page = observer.fullest_retired()
            if self._state[page] != PageState.RETIRED:
                raise AllocatorContractError(
                    f"the observer named page {page} as retired but it is "
                    f"{PageState(self._state[page]).name}"
                )
            self._back_in_service(page)
            observer.on_retired(page, False)

    def _back_in_service(self, page: int) -> None:
        self._retired.discard(page)
        self._in_use.add(page)
        self._state[page] = PageState.IN_USE
