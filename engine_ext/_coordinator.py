"""The engine-thread side of a limit: take the target, shrink, report the status."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from allocator import BackendError, DeviceOutOfMemory

from ._barrier import BarrierOutcome, BarrierResult, RankBarrier
from ._mailbox import LimitMailbox, Target
from ._reclaim import Reclaimer, count_reclaimable_pages, select_victim_pages
from .protocol import DeferReason, EngineState, RankState, Status, WaitReason

if TYPE_CHECKING:
    from allocator import Backend, BlockAllocator, PageAllocator, ThreadGuard

__all__ = ["CoordinatorConfig", "Demand", "DemandProbe", "ShrinkCoordinator"]

_log = logging.getLogger("engine_ext.coordinator")
# The members read at every refresh, as module globals: an enum member read through its
# class costs ~190 ns in 3.11 (and several microseconds with cold caches after a page map)
_APPLIED, _DEFERRED = Status.APPLIED, Status.DEFERRED
Reporter = Callable[[EngineState], None]


@dataclass(frozen=True, slots=True)
class Demand:
    """What the engine's requests need now, as the adapter reads it from the scheduler.

    Built by the adapter's probe at every scheduler step: it must cost O(1)
    (counters the adapter keeps, lengths of the scheduler's queues), never a
    scan of requests or blocks.
    """

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    waiting_blocks: int = 0  # blocks the waiting requests still need to start
    # the limit keeps at least one waiting request out (not the engine's own batch caps)
    waiting_for_memory: bool = False
    num_preemptions: int = 0  # since start
    # the device (not the limit) refused the pages an admission needed
    device_out_of_memory: bool = False
    prefix_hit_rate: float | None = None  # recent window, None = no lookups yet
    # output reservation (KVSIDECAR_RESERVE_OUTPUT): blocks the running requests may still
    # add, and how many of those the headroom under the target cannot hold (while > 0 the
    # limit is not applied: the running requests would end above it)
    reserved_blocks: int = 0
    reserve_shortfall_blocks: int = 0


#: The adapter's demand reader (engine thread, O(1)).
DemandProbe = Callable[[], Demand]


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """How the coordinator shrinks."""

    reclaim: bool = True  # False: record targets, never evict (the "without reclaim" baseline)
    max_evict_pages_per_step: int | None = None  # cap per pass; None = the whole overage
    # how often a pass may rescan evictable/pinned figures when the allocator does not
    # track evictable blocks itself (an O(evictable) scan; the design asks for figures at
    # most 100 ms old while busy). With tracking the figures are O(1) and always current.
    stats_interval_s: float = 0.1
    # While deferred for a reason eviction cannot fix now (running requests, reclaim off, a
    # rank), retry at most this often (counted from the end of the last pass) unless the
    # mapped page count moved; with change keys a retry waits for a block event instead.
    deferred_retry_s: float = 0.005
    # Pages the engine itself keeps mapped whatever the limit (vLLM's null block 0 lives on
    # page 0): the status compares mapped bytes with max(limit, floor), so a limit of 0 can
    # be applied. The allocator's target stays limit // bundle: a floor page takes no new
    # blocks under a limit that excludes it.
    floor_pages: int = 0


@dataclass(frozen=True, slots=True)
class _Pass:
    """What one shrink pass did."""

    requested_pages: int = 0  # overage in pages when the pass started
    freed_pages: int = 0  # pages emptied by eviction


class ShrinkCoordinator:
    """Applies the mailbox's targets to one pool, on the engine thread.

    Owns the current :class:`Target`, the last computed :class:`EngineState`
    (also published to the mailbox as the read-only snapshot) and the
    registered reclaimers. ``step()`` is called at the adapter's safe points
    (around each scheduler step) and from the engine's idle hook; when nothing
    waits and no page moved it costs a few int compares plus the demand probe.

    Threads: constructor and ``add_reclaimer``/``set_reporter``/
    ``set_rank_barrier`` before the engine starts; ``step()`` from the engine
    thread only (guarded); ``state()`` and ``pending`` from any thread.
    """

    def __init__(
        self,
        mailbox: LimitMailbox,
        blocks: BlockAllocator,
        config: CoordinatorConfig | None = None,
        *,
        guard: ThreadGuard | None = None,
    ) -> None:
        self._mailbox = mailbox
        self._blocks = blocks
        self._pages: PageAllocator = blocks.pages
        self._backend: Backend = self._pages.backend
        self._bundle_bytes = self._backend.layout.bundle_bytes
        self._config = config or CoordinatorConfig()
        self._guard = guard if guard is not None else blocks.guard  # one owner for pool + us
        self._reclaimers: list[Reclaimer] = []
        self._reporter: Reporter | None = None
        self._demand_probe: DemandProbe | None = None
        self._demand = Demand()
        self._block_bytes = self._bundle_bytes // blocks.blocks_per_page
        self._barrier: RankBarrier | None = None
        self._barrier_epoch = 0  # the barrier's liveness epoch at the last pass
        self._backend_failed = False  # the last pass hit a map/unmap error
        self._device_oom = False  # ... for lack of device memory
        self._target = Target(None, 0)
        self.passes = 0  # shrink passes run so far (read-only outside: adapters compare it)
        self._seen_num_mapped = -1  # allocator's mapped-page count at the last state
        self._seen_device_full = False  # the allocator's device_full at the last state
        self._seen_unmap_failed = 0  # ... and its pages out of service (failed unmaps)
        self._seen_shortfall = 0  # the demand's reserve_shortfall_blocks at the last state
        self._reclaimable_pages = 0  # from the last scan
        self._scanned_at = float("-inf")
        self._reported: tuple[Status, int, int, str | None] | None = None
        self._settled = True  # status is not deferred: an idle pass has nothing to do
        self._tried_at = float("-inf")  # when the last shrink pass ended
        self._tried_key: object = None  # _change_key() at the end of the last pass
        self._figures_key: object = None  # _change_key() when the figures were computed
        self._floor_bytes = self._config.floor_pages * self._bundle_bytes
        self._rank0 = RankState(rank=0, mapped_bytes=0)  # _compute's one-rank state
        # _compute's template, with the fields that never change for this coordinator
        self._blank = EngineState.model_construct().model_copy(
            update={
                "capacity_bytes": self._backend.layout.num_pages * self._bundle_bytes,
                "page_bundle_bytes": self._bundle_bytes,
                "floor_bytes": self._floor_bytes,
            }
        )
        self._state = self._compute(_Pass(), None)
        self._settled = self._state.status is not Status.DEFERRED
        mailbox.set_state(self._state)

    # -- set-up (before the engine runs) ---------------------------------------------

    def add_reclaimer(self, reclaimer: Reclaimer) -> None:
        """Register a prefix cache the coordinator may ask to evict."""
        self._reclaimers.append(reclaimer)

    def set_reporter(self, reporter: Reporter | None) -> None:
        """Called (engine thread) with the new state when status, revision or mapped change."""
        self._reporter = reporter

    def set_demand_probe(self, probe: DemandProbe | None) -> None:
        """Read the engine's demand at every ``step()`` (see :class:`Demand`)."""
        self._demand_probe = probe

    def set_rank_barrier(self, barrier: RankBarrier | None) -> None:
        """TP/PP: confirm every rank's unmaps before ``applied`` (see :class:`RankBarrier`)."""
        self._barrier = barrier

    # -- read from any thread ---------------------------------------------------------

    def state(self) -> EngineState:
        """The last computed state (read-only snapshot)."""
        return self._state

    @property
    def pending(self) -> bool:
        """A target waits or the status is deferred: the adapter should call ``step()``."""
        return not self._settled or self._mailbox.has_untaken

    # -- engine thread ----------------------------------------------------------------

    def step(self) -> EngineState:
        """One pass: take the newest target once, shrink toward it, update the status.

        Call it only at a safe point (top of a scheduler step, idle hook): it may
        evict and unmap. When nothing waits it only refreshes the demand figures
        (O(1)), so calling it at every scheduler step keeps the state fresh; with a
        page reserve (``reserve_pages``) it also maps back what allocations took.
        """
        self._guard.check()
        pages = self._pages
        if (  # allocations took pages out of the reserve: map them back (mapped moves,
            # so the pass below publishes it); not while a target waits or a pass is due
            pages.reserve_pages
            and self._settled
            and not self._mailbox.has_untaken
            and pages.reserve_wanted()
        ):
            pages.refill_reserve()
        if self._settled and self._barrier is None and not self._mailbox.has_untaken:
            # The common case (nothing waits, one rank): a few int compares, no syscall,
            # no allocation unless the demand or a figure moved.
            blocks = self._blocks
            if (
                pages.num_mapped == self._seen_num_mapped
                and pages.device_full == self._seen_device_full
                and (
                    blocks.num_reclaimable_pages == self._figures_key
                    if blocks.tracks_evictable
                    else not self._figures_stale()
                )
            ):
                probe = self._demand_probe
                if probe is None:
                    return self._state
                demand = probe()
                if demand is self._demand or demand == self._demand:
                    return self._state
                self._demand = demand
                if demand.reserve_shortfall_blocks != self._seen_shortfall:
                    return self._step()  # the output reservation moved: the status may change
                return self._refresh_demand()
        return self._step()

    def _step(self) -> EngineState:
        """``step()`` when something may have moved (see :meth:`step`)."""
        target = self._mailbox.take()
        demand_moved = self._probe_demand()
        if target is None:
            moved = (
                self._pages.num_mapped != self._seen_num_mapped
                or self._pages.device_full != self._seen_device_full
                or self._demand.reserve_shortfall_blocks != self._seen_shortfall
                or self._pages.num_unmap_failed != self._seen_unmap_failed
            )
            barrier_due = self._barrier is not None and (
                self._barrier.epoch != self._barrier_epoch  # a rank died
                or self._barrier.in_flight  # a free unmapped pages the ranks still map
            )
            if self._settled and not barrier_due:
                # nothing waits; the common case returns here without a syscall
                if not moved:
                    blocks = self._blocks
                    if (
                        blocks.num_reclaimable_pages != self._figures_key
                        if blocks.tracks_evictable
                        else self._figures_stale()
                    ):
                        return self._refresh_figures()
                    return self._refresh_demand() if demand_moved else self._state
                # pages moved (traffic): with ranks, settle acked unmaps and keep the
                # per-rank figures (sync waits only while unmaps are in flight)
                barrier = self._barrier.sync() if self._barrier is not None else None
                return self._update(_Pass(), barrier)
            if not (moved or barrier_due) and self._retry_can_wait():
                if self._figures_stale():
                    return self._refresh_figures()
                return self._refresh_demand() if demand_moved else self._state
        self.passes += 1
        try:
            if target is not None:
                self._apply_target(target)
                if self._demand.reserved_blocks:
                    self._probe_demand()  # the reservation's shortfall is against the new target
            if self._pages.num_unmap_failed:
                # pages emptied whose unmap failed (out of service, counted as mapped):
                # nothing else retries them while no page moves
                self._pages.retry_unmaps()
            done = self._shrink()
            self._backend_failed = False
        except BackendError as exc:
            # The target is held; the status says why it is not met and the next pass
            # retries. Raising here would end the engine (idle callbacks, allocation path).
            _log.exception("kvsidecar: a map/unmap failed during a limit pass; retrying")
            self._backend_failed = True
            self._device_oom = isinstance(exc, DeviceOutOfMemory)
            done = _Pass(self._overage_pages(), 0)
        barrier = None
        if self._barrier is not None:
            self._barrier_epoch = self._barrier.epoch
            barrier = self._barrier.sync()
        state = self._update(done, barrier)
        self._tried_at = time.monotonic()  # the end: a long pass does not retry at once
        self._tried_key = self._change_key()
        return state

    def refresh(self) -> EngineState:
        """Engine thread, at any point (not only a safe point): the state again if a page
        was mapped or unmapped since it was computed; no target is taken, nothing is
        evicted or unmapped.

        For adapters whose safe points come before the engine's allocations (SGLang's
        ``get_next_batch_to_run``): a running request that maps a page above the limit
        there, or a free that empties a retired page, moves what ``/proc`` shows, and
        the state must say so before the forward pass, not at the next iteration.
        O(1) when nothing moved (int compares). The demand fields stay as the last
        safe point read them (mid-iteration the queues are half updated); with ranks,
        the next pass does it.
        """
        self._guard.check()
        pages = self._pages
        if self._barrier is not None or (
            pages.num_mapped == self._seen_num_mapped
            and pages.device_full == self._seen_device_full
        ):
            return self._state
        return self._update(_Pass(), None)

    def refresh_figures(self) -> EngineState:
        """Engine thread: recompute evictable/pinned now (same status, revision, mapped).

        For adapters whose allocator does not track evictable blocks: the figures
        are otherwise rescanned at most every ``stats_interval_s`` while busy. Costs
        one O(evictable) scan; call it where that is cheap (an idle iteration after
        the cache changed), not at every step.
        """
        self._guard.check()
        return self._refresh_figures()

    def _change_key(self) -> object:
        """What a pass looks at, as cheap counters: equal keys mean nothing moved.

        With evictable tracking: the allocator's reclaimable-page count (exact).
        Else the allocator's block events plus each reclaimer's ``change_key()``;
        ``None`` (unknown) if a reclaimer has none.
        """
        blocks = self._blocks
        if blocks.tracks_evictable:
            return blocks.num_reclaimable_pages
        keys: list[object] = [blocks.changes]
        for reclaimer in self._reclaimers:
            key = getattr(reclaimer, "change_key", None)
            if key is None:
                return None
            keys.append(key())
        return tuple(keys)

    def _retry_can_wait(self) -> bool:
        """Deferred, no page moved, no new target: whether a new pass can wait (O(1))."""
        if self._pages.num_unmap_failed:  # retried by a pass, at most every deferred_retry_s
            return time.monotonic() - self._tried_at < self._config.deferred_retry_s
        reason = self._state.reason
        if reason == DeferReason.EVICTING.value:
            return False  # a capped pass: continue at once
        if reason == DeferReason.RECLAIM_DISABLED.value:
            return True  # a pass evicts nothing: only pages moving changes the status
        if reason == DeferReason.RUNNING_REQUESTS.value:
            key = self._change_key()
            if self._blocks.tracks_evictable:
                return key == 0  # no page is all evictable: a pass would free nothing
            if key is not None:
                return key == self._tried_key  # no block event since the last pass
        return time.monotonic() - self._tried_at < self._config.deferred_retry_s

    def _figures_stale(self) -> bool:
        """Whether evictable/pinned moved since the state was computed (O(1))."""
        key = self._change_key()
        if key is None or key == self._figures_key:
            return False
        if self._blocks.tracks_evictable:
            return True
        return time.monotonic() - self._scanned_at >= self._config.stats_interval_s

    def _refresh_figures(self) -> EngineState:
        """Only evictable/pinned moved (no page): the same state with fresh figures."""
        reclaimable = self._scan_reclaimable(force=True)
        bundle = self._bundle_bytes
        update = self._demand_fields()
        update["evictable_bytes"] = reclaimable * bundle
        update["pinned_bytes"] = max(0, self._pages.num_in_use - reclaimable) * bundle
        return self._publish(derive_model(self._state, update))

    def _probe_demand(self) -> bool:
        """Read the adapter's demand; whether it changed since the last state."""
        probe = self._demand_probe
        if probe is None:
            return False
        demand = probe()
        if demand is self._demand or demand == self._demand:
            return False
        self._demand = demand
        return True

    def _refresh_demand(self) -> EngineState:
        """Only the demand moved: the same state with fresh demand fields (no syscall)."""
        return self._publish(derive_model(self._state, self._demand_fields()))

    def _demand_fields(self) -> dict[str, object]:
        demand = self._demand
        return {
            "num_running_requests": demand.num_running_requests,
            "num_waiting_requests": demand.num_waiting_requests,
            "waiting_bytes": demand.waiting_blocks * self._block_bytes,
            "waiting_reason": (
                WaitReason.WAITING_FOR_MEMORY.value
                if demand.waiting_for_memory
                else WaitReason.DEVICE_OUT_OF_MEMORY.value
                if demand.device_out_of_memory
                else None
            ),
            "num_preemptions": demand.num_preemptions,
            "prefix_hit_rate": demand.prefix_hit_rate,
            "reserved_bytes": demand.reserved_blocks * self._block_bytes,
        }

    def _apply_target(self, target: Target) -> None:
        self._target = target
        limit = target.limit_bytes
        self._pages.set_target(None if limit is None else limit // self._bundle_bytes)

    def _overage_pages(self) -> int:
        target_pages = self._pages.target_pages
        if target_pages is None:
            return 0
        return max(0, self._pages.num_mapped - target_pages)

    def _shrink(self) -> _Pass:
        over = self._overage_pages()
        if over == 0 or not self._config.reclaim or not self._reclaimers:
            return _Pass(over, 0)
        if self._blocks.tracks_evictable and not self._blocks.num_reclaimable_pages:
            return _Pass(over, 0)  # no page is all evictable: listing the cache frees nothing
        cap = self._config.max_evict_pages_per_step
        max_pages = over if cap is None else min(over, cap)
        page_reclaims = [getattr(r, "reclaim_pages", None) for r in self._reclaimers]
        if all(callable(reclaim) for reclaim in page_reclaims):
            # tree caches (SGLang): each frees whole pages its own way, until the target
            freed = 0
            for reclaim in page_reclaims:
                if freed >= max_pages or not self._overage_pages():
                    break
                freed += int(reclaim(max_pages - freed))  # type: ignore[misc]
            return _Pass(over, freed)
        owners: dict[int, Reclaimer] = {}
        for reclaimer in self._reclaimers:
            for block in reclaimer.evictable_blocks():
                owners[block] = reclaimer
        victims = select_victim_pages(
            owners, self._blocks, max_pages, lambda b: b in owners and owners[b].is_evictable(b)
        )
        freed = 0
        for _page, page_blocks in victims:
            for reclaimer, group in _group_by_owner(page_blocks, owners):
                reclaimer.evict(group)
            freed += 1
        return _Pass(over, freed)

    def _update(self, done: _Pass, barrier: BarrierResult | None) -> EngineState:
        return self._publish(self._compute(done, barrier))

    def _publish(self, state: EngineState) -> EngineState:
        """Make ``state`` the snapshot; report it if what the sidecar shows changed.

        Demand counts alone do not trigger a report (they move with every request);
        they travel with the next report or heartbeat. Whether requests wait for
        memory does.
        """
        self._state = state
        self._settled = state.status is not _DEFERRED
        self._mailbox.set_state(state)
        key = (state.status, state.revision, state.mapped_bytes, state.waiting_reason)
        if key != self._reported:
            self._reported = key
            self._report(state)
        return state

    def _report(self, state: EngineState) -> None:
        reporter = self._reporter
        if reporter is None:
            return
        try:
            reporter(state)
        except Exception:  # noqa: BLE001 -- last resort: reporting must never break the engine loop
            _log.exception("reporting the limit state failed; the next change is reported again")

    def _scan_reclaimable(self, force: bool) -> int:
        if self._blocks.tracks_evictable:
            self._figures_key = self._reclaimable_pages = self._blocks.num_reclaimable_pages
            return self._reclaimable_pages
        now = time.monotonic()
        if force or now - self._scanned_at >= self._config.stats_interval_s:
            self._figures_key = self._change_key()
            evictable: list[int] = []
            for reclaimer in self._reclaimers:
                evictable.extend(reclaimer.evictable_blocks())
            self._reclaimable_pages = count_reclaimable_pages(evictable, self._blocks)
            self._scanned_at = now
        return self._reclaimable_pages

    def _compute(self, done: _Pass, barrier: BarrierResult | None) -> EngineState:
        pages = self._pages
        self._seen_num_mapped = pages.num_mapped
        self._seen_device_full = pages.device_full
        self._seen_unmap_failed = pages.num_unmap_failed
        if barrier is not None and barrier.ranks:
            ranks = list(barrier.ranks)
            mapped = max(r.mapped_bytes for r in ranks)
        else:
            # one rank: its state is kept while its mapped bytes (the kernel's figure,
            # one fstat) do not move, and derived from a validated one when they do (a
            # validation costs 1.2 us hot, about 30 after a page map: cold caches)
            mapped = self._backend.mapped_bytes()
            rank0 = self._rank0
            if rank0.mapped_bytes != mapped:
                rank0 = self._rank0 = derive_model(rank0, {"mapped_bytes": mapped})
            ranks = [rank0]
        limit = self._target.limit_bytes
        floor = self._floor_bytes
        effective = None if limit is None else max(limit, floor)
        over = 0 if effective is None else max(0, mapped - effective)
        reclaimable = self._scan_reclaimable(force=done.requested_pages > 0)
        # a slow or dead rank keeps the status deferred even with no limit: never "applied"
        # while a rank has not confirmed (docs/design.md, "Statuses")
        reason = self._reason(over, reclaimable, barrier, limited=limit is not None)
        bundle = self._bundle_bytes
        shortfall = self._seen_shortfall = self._demand.reserve_shortfall_blocks
        if shortfall and limit is not None:
            # output reservation: the running requests' remaining output does not fit under
            # the limit; they would end above it, so the limit is not applied yet (the
            # overage is what they would add beyond it, in whole pages)
            per_page = self._blocks.blocks_per_page
            over = max(over, -(-shortfall // per_page) * bundle)
            if reason is None:
                reason = DeferReason.RUNNING_REQUESTS
        # A copy of a blank state with every field set: every value is computed here
        # from the allocator and the backend (no outside input to validate). A
        # validated model costs tens of microseconds and model_construct (a Python
        # loop over the fields) 2.6x a model_copy, paid at every step that maps or
        # unmaps; derive_model is half a model_copy. The fields that never change
        # (capacity, bundle, floor) are set in the blank.
        update = self._demand_fields()
        update["status"] = _APPLIED if reason is None else _DEFERRED
        update["revision"] = self._target.revision
        update["limit_bytes"] = limit
        update["effective_limit_bytes"] = effective
        update["mapped_bytes"] = mapped
        update["overage_bytes"] = over
        update["reason"] = None if reason is None else reason.value
        update["evictable_bytes"] = reclaimable * bundle
        update["pinned_bytes"] = max(0, pages.num_in_use - reclaimable) * bundle
        update["num_ranks"] = len(ranks)
        update["ranks"] = ranks
        update["passes"] = self.passes
        return derive_model(self._blank, update)

    def _reason(
        self, over: int, reclaimable: int, barrier: BarrierResult | None, *, limited: bool
    ) -> DeferReason | None:
        if barrier is not None:
            if barrier.outcome is BarrierOutcome.FAILED:
                return DeferReason.RANK_FAILED  # a dead rank: never applied, limit or not
            if barrier.outcome is BarrierOutcome.TIMEOUT and limited:
                return DeferReason.RANK_TIMEOUT  # unmaps not confirmed by every rank yet
        if over == 0:
            if limited and self._seen_device_full:
                return DeferReason.DEVICE_OUT_OF_MEMORY  # the limit allows more than is there
            return None
        if self._backend_failed:
            return (
                DeferReason.DEVICE_OUT_OF_MEMORY if self._device_oom else DeferReason.BACKEND_ERROR
            )
        if self._pages.num_unmap_failed:
            return DeferReason.BACKEND_ERROR  # emptied pages the backend failed to unmap
        if not self._config.reclaim:
            return DeferReason.RECLAIM_DISABLED
        if reclaimable > 0:
            return DeferReason.EVICTING
        return DeferReason.RUNNING_REQUESTS


_new_object = object.__new__
_set_slot = object.__setattr__
_M = TypeVar("_M", bound=BaseModel)
_FIELDS: dict[type[BaseModel], frozenset[str]] = {}  # each model class's field names


def derive_model(model: _M, update: dict[str, object]) -> _M:
    """``model.model_copy(update=update)`` in one frame: the values are the coordinator's
    own figures (nothing to validate), and this runs at every safe point where a figure
    moved, where pydantic's copy (several Python frames) is most of the cost; a safe
    point that follows a page map runs with cold caches, where each frame and each
    call into pydantic's validator costs several microseconds (bench/README.md).

    The same object pydantic builds: its values, every field marked set (each value
    is computed), no extra or private values (the wire models have none).
    ``tests/unit/engine_ext/test_engine_coordinator.py`` compares the two.
    """
    cls = type(model)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(cls.model_fields)
    values = model.__dict__.copy()
    values.update(update)
    new = _new_object(cls)
    _set_slot(new, "__dict__", values)
    _set_slot(new, "__pydantic_fields_set__", set(names))
    _set_slot(new, "__pydantic_extra__", None)
    _set_slot(new, "__pydantic_private__", None)
    return new


def _group_by_owner(
    blocks: Sequence[int], owners: dict[int, Reclaimer]
) -> Iterator[tuple[Reclaimer, list[int]]]:
    groups: dict[int, tuple[Reclaimer, list[int]]] = {}
    for block in blocks:
        owner = owners[block]
        groups.setdefault(id(owner), (owner, []))[1].append(block)
    yield from groups.values()
