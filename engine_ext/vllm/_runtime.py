"""The adapter's per-process runtime: builds the pool's backing, wires the core, idles.

One :class:`VllmRuntime` per EngineCore process. ``plugin.register()`` only
*configures* it (settings); nothing starts there, because threads do not
survive a fork. The rest happens in the EngineCore process:

1. vLLM builds the scheduler -> ``ElasticBlockPool.__init__`` ->
   :func:`backing_for_pool`: claims the worker's KV reservation, builds the
   ``PageAllocator``/``BlockAllocator`` with a ``ThreadGuard`` bound to this
   (the busy-loop) thread, and the core's ``ElasticInstance`` with the pool
   as its reclaimer;
2. ``EngineCoreProc.run_busy_loop`` (patched) -> :meth:`VllmRuntime.attach_engine`:
   starts the control socket, registers with the sidecar, and runs a first
   pass so a retained limit applies before the first request;
3. from then on, passes run only at *safe points* (docs/vllm.md, "Safe
   points"): the top of every ``Scheduler.schedule()`` (patched; a pass only
   when one is due), its end and the end of ``update_from_output`` when it
   freed blocks (the state is refreshed: O(1) when nothing moved),
   :meth:`after_change` when blocks are freed outside both, and the idle
   hook: a publish from any thread calls :meth:`wake`, which registers a
   one-shot callback on ``EngineCore._idle_state_callbacks`` and puts a
   ``WAKEUP`` on the input queue, so an idle engine applies the limit within
   one busy-loop pass (docs/engine-hooks.md 1.7). Allocation never runs a
   pass; the patched ``KVCacheManager.allocate_slots`` lets a RUNNING
   request's blocks go above the target and records admissions the limit
   keeps out (:meth:`allocating`, the demand probe).

Threads: :meth:`wake` from any thread; everything else on the busy-loop thread.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_ext._coordinator import Demand
from engine_ext._errors import EngineExtConfigError
from engine_ext._hit_window import HIT_WINDOW_ADMISSIONS, PrefixHitWindow
from engine_ext._inline import guarded_copy
from engine_ext._parent import ParentWatch
from engine_ext.protocol import DeferReason, EngineState, Status
from engine_ext.vllm._kv_memory import claim_kv_memory
from engine_ext.vllm._pool_backing import DeviceFullError, PoolBacking
from engine_ext.vllm._reserve import OutputReservation

try:  # the per-step paths in C (engine_ext/vllm/_block_speedups.c; optional)
    from engine_ext.vllm._block_speedups import HitWindow, RunningAllocate, StepHook, StepState
except ImportError:  # no compiler at install: the Python replacements do it all
    HitWindow = None  # type: ignore[assignment,misc]
    RunningAllocate = None  # type: ignore[assignment,misc]
    StepHook = None  # type: ignore[assignment,misc]

    class StepState:  # type: ignore[no-redef]
        """Without the C module, the gate's fields are plain attributes."""


if TYPE_CHECKING:
    from engine_ext import ElasticInstance, EngineSettings
    from engine_ext.vllm._block_pool import ElasticBlockPool
    from engine_ext.vllm._settings import VllmSettings

__all__ = [
    "DEMAND_MAX_AGE_S",
    "VllmRuntime",
    "allocate_slots_patch",
    "backing_for_pool",
    "configure",
    "current_runtime",
    "schedule_patch",
    "update_from_output_patch",
]

_log = logging.getLogger("engine_ext.vllm.runtime")
_monotonic = time.monotonic
_DEFERRED = Status.DEFERRED  # read at every safe point (a module global: no enum lookup)

#: The longest a demand figure vLLM moves without a hook of ours stays unread (s).
DEMAND_MAX_AGE_S = 0.1
_running_status: Any = None  # vLLM's RequestStatus.RUNNING, read at the first admission


class VllmRuntime(StepState):
    """Owns the ``ElasticInstance`` of this EngineCore process and the idle hook.

    The fields the step's brackets read at every step (the pool and its allocators,
    the safe points' gate, the update flags) are slots of ``StepState``, so the C
    brackets (``StepHook``) read them without an attribute lookup.
    """

    def __init__(self, engine: EngineSettings, vllm: VllmSettings) -> None:
        self.engine_settings = engine
        self.vllm_settings = vllm
        self.instance: ElasticInstance | None = None
        self.pool: ElasticBlockPool | None = None
        self._engine_core: Any = None  # EngineCoreProc, set by attach_engine
        self._parent_watch: ParentWatch | None = None  # EngineCoreProc: its API server
        self._armed = False
        self._arm_lock = threading.Lock()
        self._in_update = False  # inside Scheduler.update_from_output
        # The safe points' gate (see end_schedule): what the last safe point saw.
        self._woken = False  # wake() since the last safe point read the mailbox
        self._steady = False  # status settled, one rank: nothing to do unless figures move
        # a rank barrier (its liveness is checked at every pass) or the output reservation
        # (its figures move with every token): every safe point refreshes, none is skipped
        self._always_refresh = False
        self._seen_mapped = -1  # PageAllocator.num_mapped
        self._seen_device_full = False  # PageAllocator.device_full
        self._seen_refused = False  # an admission was refused (_refused_blocks > 0)
        self._seen_device_refused = False  # _device_refused
        self._refresh_due = float("-inf")  # monotonic time of the next forced refresh
        self._freed_in_update = False  # ... and the pool freed blocks there
        self._blocks: Any = None  # the pool's BlockAllocator, set by build_backing
        self._pages: Any = None  # ... and its PageAllocator
        self._scheduler: Any = None  # vLLM's Scheduler, seen at the first schedule()
        self._refused_blocks = 0  # blocks the waiting requests need (set when one is refused)
        self._device_refused = False  # ... refused because the device (not the limit) is full
        self._num_preemptions = 0  # Scheduler._preempt_request calls (exact, patched)
        # prefix_hit_rate over the last admissions; in C where built (the plain admission
        # in C records into it without a Python frame), else the Python reference
        window = PrefixHitWindow if HitWindow is None else HitWindow
        self._hits: PrefixHitWindow | HitWindow = window(HIT_WINDOW_ADMISSIONS)
        self._demand_key: tuple[int, ...] | None = None  # last Demand's inputs
        self._last_demand = Demand()
        # The demand gate (see _demand): bumped by every hooked event that moves a figure
        self._demand_events = 0
        self._demand_seen_events = -1  # ... at the last full read
        self._demand_seen_requests = -1  # len(Scheduler.requests) at the last full read
        self._demand_read_at = float("-inf")  # monotonic time of the last full read
        self._fence: Any = None  # allocator.UnmapFence of a GPU reservation (None on CPU)
        self._reservation: OutputReservation | None = None  # KVSIDECAR_RESERVE_OUTPUT
        self._manager: Any = None  # vLLM's KVCacheManager, seen at the first allocate_slots

    # -- construction (EngineCore main thread) -------------------------------------
    def build_backing(self, pool: ElasticBlockPool, num_gpu_blocks: int) -> PoolBacking:
        import vllm
        import vllm.envs

        from allocator import BlockAllocator, PageAllocator
        from engine_ext import ElasticInstance, EngineBinding

        if not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise EngineExtConfigError(
                "kvsidecar: the in-process EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0) has no "
                "busy loop, so the control socket never starts and no limit could ever apply; "
                "unset VLLM_ENABLE_V1_MULTIPROCESSING (or set it to 1), or unset KVSIDECAR_ENABLE"
            )
        memory = claim_kv_memory()
        if memory is None:
            raise EngineExtConfigError(
                "kvsidecar: the KV cache is not on a kvsidecar reservation. On CPU run vLLM with "
                "--distributed-executor-backend engine_ext.cpu_harness.vllm.executor.StubExecutor; "
                "on a GPU the worker must run in the EngineCore process (world size 1, "
                "--distributed-executor-backend uni) so the CudaBackend hook can publish it. "
                "Or unset KVSIDECAR_ENABLE."
            )
        if memory.num_blocks != num_gpu_blocks or num_gpu_blocks % memory.blocks_per_page:
            raise EngineExtConfigError(
                f"kvsidecar: vLLM plans {num_gpu_blocks} KV blocks but the reservation holds "
                f"{memory.num_blocks} in pages of {memory.blocks_per_page}; the block count must "
                "be a whole number of pages (size the KV memory in whole pages)"
            )
        guard = self.engine_settings.new_thread_guard("vllm-block-pool")
        guard.bind_current()
        pages = PageAllocator(
            memory.backend, reserve_pages=self.engine_settings.reserve_pages, guard=guard
        )
        blocks = BlockAllocator(pages, memory.blocks_per_page, guard=guard)
        self.pool = pool
        self._fence = memory.fence
        if self.engine_settings.reserve_output:
            # max_model_len is read from the KVCacheManager at its first allocate_slots
            self._reservation = OutputReservation(pool.hash_block_size, max_model_len=1 << 62)
            self._always_refresh = True
        self._blocks = blocks
        self._pages = pages
        binding = EngineBinding(
            engine="vllm",
            engine_version=vllm.__version__,
            blocks=blocks,
            reclaimers=(pool,),
            wake=self.wake,
            floor_pages=1,  # vLLM's null block 0 keeps page 0 mapped for the engine's life
        )
        self.instance = ElasticInstance(self.engine_settings, binding)
        self.instance.coordinator.set_demand_probe(self._demand)
        if memory.rank_barrier is not None:  # rank processes (the CPU harness's TP/PP ranks)
            self._always_refresh = True
            memory.rank_barrier.set_wake(self.wake)
            self.instance.coordinator.set_rank_barrier(memory.rank_barrier)
        return PoolBacking(
            blocks=blocks,
            guard=guard,
            hooks=self,
            mailbox=self.instance.mailbox,
            reclaim=self.engine_settings.reclaim,
            max_cached_tokens=self.vllm_settings.max_cached_tokens,
        )

    def attach_engine(self, engine_core: Any) -> None:
        """Busy-loop thread, before the loop starts: socket, registration, first pass."""
        if self.instance is None or self._engine_core is engine_core:
            return
        self._engine_core = engine_core
        self.instance.start()
        if threading.current_thread() is threading.main_thread():
            self.instance.install_signal_cleanup()  # removes the socket first (RuntimeDir)
            # vLLM's EngineCore outlives a killed API server for good, memory and all
            self._parent_watch = ParentWatch(_end_orphaned_engine_core)
            self._parent_watch.start()
        _log.info(
            "kvsidecar: instance %s, control socket %s",
            self.instance.instance_id,
            self.instance.socket_path,
        )
        self._pass()

    def close(self) -> None:
        """Busy loop ended: stop the socket and the sidecar client (idempotent)."""
        if self._parent_watch is not None:
            self._parent_watch.stop()
        if self.instance is not None:
            self.instance.close()

    # -- safe points (busy-loop thread) -------------------------------------------------
    def safe_point(self, scheduler: Any = None) -> EngineState | None:
        """No prefix lookup of this step is pending: take a target, evict, refresh the state.

        Between ``get_computed_blocks`` and the ``touch`` in ``allocate_slots`` the hit
        blocks have ``ref_cnt`` 0 and look evictable; evicting them there kills the
        EngineCore (docs/engine-hooks.md 1.6), so no pass runs inside ``schedule()``.
        When nothing waits and nothing moved this is a few int compares (the
        coordinator's fast path and the demand gate of :meth:`_demand`).
        """
        instance, pool = self.instance, self.pool
        if instance is None or pool is None:
            return None
        if scheduler is not None:
            self._scheduler = scheduler
        pool.cleanup()
        coordinator = instance.coordinator
        passes = coordinator.passes
        self._woken = False  # before the mailbox is read: a later publish wakes us again
        state = instance.step()
        if coordinator.passes != passes:  # a pass ran: the allocator moved under the pool
            state = self._after_pass(state)
        # what the next safe point compares to skip all of the above when nothing moved
        self._steady = state.status is not _DEFERRED and not self._always_refresh
        pages = self._blocks.pages
        self._seen_mapped = pages.num_mapped
        self._seen_device_full = pages.device_full
        self._seen_refused = self._refused_blocks > 0
        self._seen_device_refused = self._device_refused
        self._refresh_due = _monotonic() + DEMAND_MAX_AGE_S
        return state

    def begin_schedule(self, scheduler: Any) -> None:
        """Top of ``schedule()``: the pass point of a busy engine (a waiting target is
        taken, evictions run), then the pool defers its own evictions.

        The state is not refreshed here: nothing it shows moves between the end of
        the last step and this point without a hook of its own (frees call
        :meth:`after_change`); the end of ``schedule()`` refreshes it.
        """
        pool = self.pool
        if pool is None:
            return
        self._scheduler = scheduler
        if self._woken or not self._steady:
            self.safe_point()  # a target waits or the status is deferred: a pass may run
        elif pool.cleanup_due:
            pool.cleanup()  # evictions the pool deferred since the last safe point
        if self._refused_blocks or self._device_refused:  # measured again by this step
            self._refused_blocks = 0
            self._device_refused = False
            self._demand_events += 1
        if self._reservation is not None:
            self._reservation.begin_step()
        pool.in_schedule = True
        pool.overdraft = True  # running requests allocate first; admissions clear it

    def end_schedule(self) -> None:
        """End of ``schedule()`` (also on error): lookups are done, a safe point again.

        Skipped after a few compares when nothing that must be exact at every step
        moved since the last safe point: no publish (:meth:`wake`), status settled,
        no eviction the pool deferred, the same mapped pages and device-full flag
        (mapped bytes follow ``/proc`` at every step), no refusal begun or ended
        (``waiting_reason``), and the last full refresh less than
        :data:`DEMAND_MAX_AGE_S` ago. The counts (running, waiting, preemptions, hit
        rate) and the evictable/pinned figures move with nearly every admission and
        finish; they are refreshed by that periodic refresh (at most 100 ms old while
        busy) and by the idle hook, not at every step (docs/limits.md).
        """
        pool = self.pool
        if pool is None:
            return
        pool.in_schedule = False
        pool.overdraft = False
        pages = self._blocks.pages
        if (  # (one frame: this runs at every step)
            self._steady
            and not self._woken
            and self._device_refused == self._seen_device_refused
            and (self._refused_blocks > 0) == self._seen_refused
            and not pool.cleanup_due
            and pages.num_mapped == self._seen_mapped
            and pages.device_full == self._seen_device_full
            and not (pages.reserve_pages and pages.reserve_wanted())  # the pass refills it
            and _monotonic() < self._refresh_due
        ):
            return
        self.safe_point()

    def begin_update(self) -> None:
        """``Scheduler.update_from_output`` (patched), before it frees anything: the
        forward pass whose output it holds was launched, so later unmaps wait on an
        event recorded now instead of a device-wide sync (allocator.UnmapFence)."""
        fence = self._fence
        if fence is not None:
            fence.record()
        self._in_update = True

    def end_update(self) -> None:
        """End of ``update_from_output`` (also on error): if requests finished (their
        blocks were freed), :meth:`_after_free`: a safe point if mapped memory moved,
        else the idle hook armed, so an engine that goes idle now reports the memory
        and the demand as they are."""
        self._in_update = False
        if self._freed_in_update:
            self._freed_in_update = False
            self._after_free()

    def allocating(
        self,
        original: Any,
        manager: Any,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``KVCacheManager.allocate_slots`` (the general path of :func:`allocate_slots_patch`).

        A RUNNING request is extending: vLLM would preempt it if we said no, so its
        blocks may be mapped above the target (the overage is reported as
        ``running_requests`` and shed when it finishes). Anything else is an
        admission (waiting or preempted): it gets only what fits under the target,
        and a refusal under a limit is recorded for the demand probe. O(1).
        """
        pool = self.pool
        if pool is None or manager.block_pool is not pool:
            return original(manager, request, *args, **kwargs)
        global _running_status
        if _running_status is None:  # imported once, not at every admission
            from vllm.v1.request import RequestStatus

            _running_status = RequestStatus.RUNNING
        running = request.status is _running_status
        was_in_schedule, was_overdraft = pool.in_schedule, pool.overdraft
        pool.overdraft = running  # an admission sees only the headroom under the target
        reservation = self._reservation
        try:
            if reservation is not None:
                if self._manager is not manager:  # the probe reads the requests' blocks here
                    self._manager = manager
                    reservation.max_model_len = int(manager.max_model_len)
                if (
                    not running
                    and pool.blocks_target() is not None
                    and self._reserve_refuses(manager, request, args, kwargs)
                ):
                    return None  # its whole output would not fit under the limit: it waits
            # a RUNNING request holds its blocks; only an admission may hold none yet (then
            # a failed map must give back the prefix hits it touched)
            held = running or _holds_blocks(manager, request.request_id)
            pool.in_schedule = True  # frees inside allocate_slots (sliding window) evict later
            device = False
            try:
                result = original(manager, request, *args, **kwargs)
            except DeviceFullError:
                # The device filled between the free count and the map (another engine
                # took the memory, nothing cached to reuse): a refusal, which vLLM handles
                # (the admission waits; a running request is preempted as on a full cache).
                if not held:
                    manager.free(request)  # the prefix hits it touched: as before the call
                result, device = None, True
            if running:
                return result
            if result is None:
                self._refused_admission(request, args, kwargs, device)
                return result
            self._demand_events += 1  # an admission: the demand moved
            self._hits.record(_hit_tokens(args, kwargs), request.num_tokens)  # prefix_hit_rate
            if reservation is not None:
                held_now = manager.coordinator.single_type_managers[0].req_to_blocks
                reservation.admitted(request, len(held_now.get(request.request_id, ())))
            return result
        finally:
            pool.overdraft = was_overdraft
            pool.in_schedule = was_in_schedule

    def _refused_admission(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: bool
    ) -> None:
        """``allocate_slots`` refused an admission (returned None; ``device``: a map
        found the device full): the demand moved, and a refusal by the limit or the
        device is recorded for the demand fields (``waiting_reason``, ``waiting_bytes``).
        Also called by the C admission path (``RunningAllocate``) on a refusal."""
        pool = self.pool
        assert pool is not None
        self._demand_events += 1
        device = device or pool.device_full()
        if device or pool.blocks_target() is not None:
            self._device_refused = device
            self._refused_blocks = self._waiting_blocks(request, args, kwargs, pool.hash_block_size)

    def _reserve_refuses(
        self, manager: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        """Output reservation: whether an admission's whole life does not fit under the
        target beside the running requests' remaining output (then it is refused)."""
        reservation = self._reservation
        pool = self.pool
        assert reservation is not None and pool is not None
        computed = (
            int(request.num_computed_tokens)
            + _hit_tokens(args, kwargs)
            + _external_tokens(args, kwargs)
        )
        need = reservation.admission_blocks(request, computed)
        held = manager.coordinator.single_type_managers[0].req_to_blocks
        sched = self._scheduler
        running = sched.running if sched is not None else ()
        spare = (
            pool.get_num_free_blocks()
            - _evictable_hits(args, kwargs)
            - reservation.outstanding(running, held)
        )
        if need <= spare:
            return False
        self._device_refused = False
        self._refused_blocks = self._waiting_blocks(request, args, kwargs, pool.hash_block_size)
        return True

    def preempted(self) -> None:
        """``Scheduler._preempt_request`` (patched): one running request went back to waiting."""
        self._num_preemptions += 1
        self._demand_events += 1

    def _waiting_blocks(
        self, refused: Any, args: tuple[Any, ...], kwargs: dict[str, Any], block_tokens: int
    ) -> int:
        """Blocks every waiting request needs to start, at a refused admission.

        The refused request: its whole sequence less its prefix hits (known from
        the lookup just made). Every other waiting request: its whole sequence
        (its hits are not looked up until it reaches the head: an upper bound).
        O(waiting), once per scheduler step at most (vLLM stops admitting at the
        first refusal).
        """
        reservation = self._reservation
        if reservation is None:
            total = _blocks_needed(refused, args, kwargs, block_tokens)
        else:  # with the output reserved, a request needs its whole life to start
            hit = _hit_tokens(args, kwargs) + _external_tokens(args, kwargs)
            computed = int(refused.num_computed_tokens) + hit
            total = max(1, reservation.admission_blocks(refused, computed))
        sched = self._scheduler
        for request in getattr(sched, "waiting", ()) if sched is not None else ():
            if request is not refused:
                total += (
                    -(-int(request.num_tokens) // block_tokens)
                    if reservation is None
                    else reservation.final_blocks(request)
                )
        return total

    def _demand(self) -> Demand:
        """The demand probe (every safe point): the same :class:`Demand` object while
        nothing it reads can have moved, so the coordinator's check is one identity test.

        The gate: the scheduler's request count (arrivals, finishes, aborts) and
        ``_demand_events`` (admissions, refusals, preemptions, frees, which this
        runtime sees through its hooks) unchanged, and the last full read less
        than :data:`DEMAND_MAX_AGE_S` old (anything vLLM moves without a hook of
        ours shows within that).
        """
        sched = self._scheduler
        events = self._demand_events
        if sched is not None and events == self._demand_seen_events and not self._always_refresh:
            num_requests = len(getattr(sched, "requests", ()))
            if (
                num_requests == self._demand_seen_requests
                and _monotonic() - self._demand_read_at < DEMAND_MAX_AGE_S
            ):
                return self._last_demand
        return self._read_demand(sched, events)

    def _read_demand(self, sched: Any, events: int) -> Demand:
        """Read the scheduler's queues and this runtime's counters (O(1))."""
        hits = self._hits
        if sched is None:
            running = waiting = num_requests = 0
        else:
            running = len(sched.running)
            waiting = len(sched.waiting) + len(getattr(sched, "kv_holding_waiting", ()))
            num_requests = len(getattr(sched, "requests", ()))
        self._demand_seen_events = events
        self._demand_seen_requests = num_requests
        self._demand_read_at = _monotonic()
        refused = self._refused_blocks if waiting else 0
        device = self._device_refused
        reserved = shortfall = 0
        if self._reservation is not None and sched is not None:
            reserved, shortfall = self._reserved_growth(sched)
        key = (
            running,
            waiting,
            refused,
            device,
            self._num_preemptions,
            hits.changes,
            reserved,
            shortfall,
        )
        if key == self._demand_key:
            return self._last_demand
        self._demand_key = key
        demand = Demand(
            reserved_blocks=reserved,
            reserve_shortfall_blocks=shortfall,
            num_running_requests=running,
            num_waiting_requests=waiting,
            waiting_blocks=refused,
            waiting_for_memory=refused > 0 and not device,
            device_out_of_memory=refused > 0 and device,
            num_preemptions=self._num_preemptions,
            prefix_hit_rate=hits.rate,
        )
        self._last_demand = demand
        return demand

    def _reserved_growth(self, sched: Any) -> tuple[int, int]:
        """Output reservation: (blocks the running requests may still add, how many of
        them the headroom under the target cannot hold). O(running)."""
        reservation, pool, manager = self._reservation, self.pool, self._manager
        if reservation is None or pool is None or manager is None:
            return 0, 0
        held = manager.coordinator.single_type_managers[0].req_to_blocks
        reserved = reservation.remaining(sched.running, held)
        if pool.blocks_target() is None:
            return reserved, 0
        return reserved, max(0, reserved - pool.get_num_free_blocks())

    # -- PoolHooks (busy-loop thread) ------------------------------------------------
    def after_change(self) -> None:
        """The pool freed blocks (a request finished or was preempted, an abort, a reset)."""
        self._demand_events += 1
        pool = self.pool
        if pool is None or pool.in_schedule:
            return  # inside schedule(): the end-of-schedule safe point refreshes
        if self._in_update:
            self._freed_in_update = True  # the end of update_from_output decides
            return
        self._after_free()

    def _after_free(self) -> None:
        """Blocks were freed outside ``schedule()`` (finished requests at the end of
        ``update_from_output``, aborts, resets): no prefix lookup is pending.

        When mapped memory moved (a page unmapped, the device-full flag) or a pass may
        be due (a publish, a deferred status): a safe point now, so the state follows
        /proc at once. Otherwise only counts and figures moved (demand counts, pages
        becoming or ceasing to be all evictable): they are read by the periodic refresh
        at the end of a later ``schedule()`` (at most :data:`DEMAND_MAX_AGE_S` old) or by
        the idle hook armed here, which runs as soon as the busy loop has no work: an
        engine that goes idle reports them as they are. Without a busy loop (an
        in-process ``EngineCore`` stepped by its caller: tests, bench_vllm.py) there is
        no idle hook: the free that leaves the scheduler without requests refreshes,
        where the hook would run. Not a safe point per free: one per finishing step
        cost ~1.7 % of the scheduler step on bench_vllm's default trace and ~5 % on its
        ``--churn`` trace (bench/README.md, issue 17), and an abort of many requests
        one per request.
        """
        pages = self._blocks.pages
        if (  # mapped memory unmoved (end_schedule's check less the refusals and the clock)
            self._steady
            and not self._woken
            and pages.num_mapped == self._seen_mapped
            and pages.device_full == self._seen_device_full
        ):
            if self._engine_core is not None:
                if not self._armed:
                    self._arm(wakeup=False)  # an idle engine refreshes the demand once
                return
            sched = self._scheduler
            if sched is None or getattr(sched, "requests", None):
                return  # requests left: a later schedule() or the last free refreshes
        self._settle()

    def _settle(self) -> None:
        """A safe point outside ``schedule()``; if a pass is still due, the idle hook runs it."""
        self.safe_point()
        if self._armed or self._engine_core is None:
            return  # an idle pass is already due, or not serving yet
        instance = self.instance
        if instance is not None and instance.coordinator.pending:
            self._arm(wakeup=False)

    # -- idle application ------------------------------------------------------------
    def wake(self) -> None:
        """Any thread: a target was published (or a rank needs a pass): the next safe
        point runs a pass, and an idle engine runs one now."""
        self._woken = True  # a plain store: the busy loop reads it at its next safe point
        self._arm(wakeup=True)

    def _arm(self, *, wakeup: bool) -> None:
        engine = self._engine_core
        if engine is None:
            return  # not serving yet: attach_engine runs the first pass
        with self._arm_lock:
            if not self._armed:
                self._armed = True
                engine._idle_state_callbacks.append(self._on_idle)
        if wakeup:
            from vllm.v1.engine import EngineCoreRequestType

            engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _on_idle(self, engine_core: Any) -> None:
        with self._arm_lock:
            self._armed = False
        state = self._pass()
        if state.status is Status.DEFERRED and state.reason == DeferReason.EVICTING:
            self._arm(wakeup=True)  # capped pass: continue on the next loop iteration

    def _pass(self) -> EngineState:
        state = self.safe_point()
        assert state is not None
        return state

    def _after_pass(self, state: EngineState) -> EngineState:
        """A coordinator pass ran (a target, evictions): the pool's cached free count is
        stale, and cached blocks left on pages it retired are evicted now."""
        instance, pool = self.instance, self.pool
        assert instance is not None and pool is not None
        pool.invalidate_capacity()
        if pool.evict_on_retired_pages():
            state = instance.step()
            pool.invalidate_capacity()
        return state


# -- the replacements of the patched vLLM methods (docs/vllm.md, "Patches") -------------
#
# Each is called at every scheduler step (allocate_slots once per scheduled request), so
# each has a fast form with vLLM 0.33's exact signature: forwarding ``*args, **kwargs``
# costs about four times as much as the call itself (bench/README.md). The factory checks
# the original's signature and falls back to a generic ``*args, **kwargs`` form when it
# differs (a patch release that added a parameter keeps working, a little slower).


def _end_orphaned_engine_core(parent: int) -> None:
    """Watch thread: the API server that started this EngineCore is gone, so nobody can
    reach it again. End it the way vLLM's own shutdown does (SIGTERM: our handler removes
    the runtime dir, vLLM's ends the busy loop), so its KV memory goes back."""
    _log.error(
        "kvsidecar: the process that started this EngineCore (pid %d) is gone; ending this "
        "EngineCore (pid %d) so its KV memory goes back",
        parent,
        os.getpid(),
    )
    os.kill(os.getpid(), signal.SIGTERM)


def _signature(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _schedule_033(self: Any, throttle_prefills: bool = False) -> Any: ...


def _update_from_output_033(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any: ...


def _allocate_slots_033(
    self: Any,
    request: Any,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Any = None,
    num_lookahead_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
    full_sequence_must_fit: bool = False,
    reserved_blocks: int = 0,
    has_scheduled_reqs: bool = True,
    skip_zeroing_group_ids: tuple[int, ...] = (),
) -> Any: ...


def schedule_patch(original: Callable[..., Any], *, in_c: bool = True) -> Callable[..., Any]:
    """The replacement of ``Scheduler.schedule``: a safe point before and after it.

    With the C module (and ``in_c``), a ``StepHook``: the same brackets, their no-op
    case (the gate of :meth:`VllmRuntime.begin_schedule` and
    :meth:`VllmRuntime.end_schedule` holds) in C, the arguments passed as given.
    """
    if in_c and StepHook is not None:
        return StepHook(original, globals(), "schedule")

    def schedule(self: Any, throttle_prefills: bool = False) -> Any:
        runtime = _runtime
        if runtime is None:
            return original(self, throttle_prefills)
        runtime.begin_schedule(self)
        try:
            return original(self, throttle_prefills)
        finally:
            runtime.end_schedule()

    def schedule_any(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime
        if runtime is None:
            return original(self, *args, **kwargs)
        runtime.begin_schedule(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            runtime.end_schedule()

    fast = _signature(original) == _signature(_schedule_033)
    replacement: Callable[..., Any] = schedule if fast else schedule_any
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    return replacement


def update_from_output_patch(
    original: Callable[..., Any], *, in_c: bool = True
) -> Callable[..., Any]:
    """The replacement of ``Scheduler.update_from_output``: the unmap fence before it
    (the original frees blocks, unmaps may follow); after it, when it freed,
    :meth:`VllmRuntime.end_update`.

    With the C module (and ``in_c``), a ``StepHook``: without a fence, and when
    nothing was freed, the two flags are set in C (as :func:`schedule_patch`).
    """
    if in_c and StepHook is not None:
        return StepHook(original, globals(), "update_from_output")

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        runtime = _runtime
        if runtime is None:
            return original(self, scheduler_output, model_runner_output)
        runtime.begin_update()
        try:
            return original(self, scheduler_output, model_runner_output)
        finally:
            runtime.end_update()

    def update_from_output_any(self: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime
        if runtime is None:
            return original(self, *args, **kwargs)
        runtime.begin_update()
        try:
            return original(self, *args, **kwargs)
        finally:
            runtime.end_update()

    fast = _signature(original) == _signature(_update_from_output_033)
    replacement: Callable[..., Any] = update_from_output if fast else update_from_output_any
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    return replacement


def allocate_slots_patch(
    original: Callable[..., Any], pool_class: type[Any], *, inline: bool = True
) -> Callable[..., Any]:
    """The replacement of ``KVCacheManager.allocate_slots`` for pools of ``pool_class``.

    The common call, a RUNNING request extending inside ``schedule()``, takes the
    fast path here: the original, under the pool's ``overdraft`` flag, which
    :meth:`VllmRuntime.begin_schedule` holds for the whole of ``schedule()`` (its
    blocks may go above the target: a limit never preempts it), and a device
    found full after the free count is a refusal, as on a full cache. The fast
    path is taken only while the flag is up, so it never runs without it.
    With vLLM 0.33's signature and its source at hand (``inline``), the fast path
    is compiled into a copy of vLLM's method (:func:`engine_ext._inline.guarded_copy`),
    which hands every other call to the wrapper (in C where it is built).
    Admissions and calls outside ``schedule()`` go to
    :meth:`VllmRuntime.allocating`, which sets the flag for the call (up for a
    RUNNING request, down for an admission) and puts it back after.
    """
    from vllm.v1.request import RequestStatus

    running = RequestStatus.RUNNING

    def _in_c(replacement: Callable[..., Any]) -> Callable[..., Any]:
        # The fast path in C (_block_speedups.RunningAllocate): the same check, then the
        # original with the caller's arguments as they are, no frame of ours; every other
        # call goes to ``replacement``. Without the C module, ``replacement`` itself.
        if RunningAllocate is None:
            return replacement
        return RunningAllocate(
            original,
            pool_class,
            running,
            replacement,
            DeviceFullError,
            globals(),
            num_tokens_list(),
        )

    def general(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = _runtime
        if runtime is None or runtime.pool is not self.block_pool:
            return original(self, request, *args, **kwargs)
        return runtime.allocating(original, self, request, args, kwargs)

    if _signature(original) != _signature(_allocate_slots_033):

        def allocate_slots_any(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            pool: Any = self.block_pool
            if request.status is running and type(pool) is pool_class and pool.overdraft:
                try:  # overdraft: held for the whole of schedule() by begin_schedule
                    return original(self, request, *args, **kwargs)
                except DeviceFullError:
                    return None
            return general(self, request, *args, **kwargs)

        allocate_slots_any.__wrapped__ = original  # type: ignore[attr-defined]
        return _in_c(allocate_slots_any)

    def allocate_slots(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        pool: Any = self.block_pool
        if request.status is running and type(pool) is pool_class and pool.overdraft:
            try:  # overdraft: held for the whole of schedule() by begin_schedule
                return original(
                    self,
                    request,
                    num_new_tokens,
                    num_new_computed_tokens,
                    new_computed_blocks,
                    num_lookahead_tokens,
                    num_external_computed_tokens,
                    delay_cache_blocks,
                    num_encoder_tokens,
                    full_sequence_must_fit,
                    reserved_blocks,
                    has_scheduled_reqs,
                    skip_zeroing_group_ids,
                )
            except DeviceFullError:
                return None
        # The same list as above, as one tuple for the admission path's helpers (the
        # running path above spells it out: no tuple, no *args call at every extension).
        args = (  # all positional, in 0.33's order: no keyword dict per admission
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )
        runtime = _runtime
        if runtime is None:
            return original(self, request, *args)
        return runtime.allocating(original, self, request, args, _ALL_POSITIONAL_033)

    allocate_slots.__wrapped__ = original  # type: ignore[attr-defined]
    other = _in_c(allocate_slots)
    if not inline:
        return other
    # The running path compiled into a copy of vLLM's own method (engine_ext._inline):
    # the same check, then vLLM's body in the same frame, no call in between; every
    # other call goes to ``other``. Without the source of the running code, ``other``.
    copy = guarded_copy(
        original,
        _RUNNING_GUARD_033,
        {
            "_kvs_running": running,
            "_kvs_pool_class": pool_class,
            "_kvs_other": other,
            "_kvs_device_full": DeviceFullError,
        },
        catch=("_kvs_device_full", "return None"),
    )
    return other if copy is None else copy


# The guard of the inlined running path (vLLM 0.33's parameters, read off the signature
# the copy is made for): anything but a RUNNING request of an ElasticBlockPool's manager
# under the overdraft flag goes to the wrapper, with every argument as it was bound
# (all positional, in 0.33's order: what the wrapper's admission path takes).
_RUNNING_GUARD_033 = f"""
_kvs_pool = self.block_pool
if (
    request.status is not _kvs_running
    or type(_kvs_pool) is not _kvs_pool_class
    or not _kvs_pool.overdraft
):
    return _kvs_other({", ".join(inspect.signature(_allocate_slots_033).parameters)})
"""


def _len_of_a_list(self: Any) -> int:  # the shape num_tokens_list() looks for
    return len(self.tokens)


def num_tokens_list() -> tuple[type, str] | None:
    """(vLLM's ``Request``, ``name``) when its ``num_tokens`` property is exactly
    ``return len(self.<name>)`` with the builtin ``len`` (the same bytecode as
    :func:`_len_of_a_list`), else None. The C admission then reads the length of that
    list (when it is a list) instead of calling the property, a Python frame entered
    from C that cost about half the admission's own bookkeeping (bench/README.md)."""
    import builtins

    from vllm.v1.request import Request

    prop = Request.__dict__.get("num_tokens")
    fget = prop.fget if isinstance(prop, property) else None
    code, shape = getattr(fget, "__code__", None), _len_of_a_list.__code__
    if (
        code is None
        or code.co_code != shape.co_code
        or code.co_consts != shape.co_consts
        or code.co_argcount != 1
        or len(code.co_names) != 2
        or code.co_names[0] != "len"
        or getattr(fget, "__globals__", {}).get("len", builtins.len) is not builtins.len
    ):
        return None
    return Request, code.co_names[1]


def _holds_blocks(manager: Any, request_id: str) -> bool:
    """Whether ``request_id`` holds blocks in any of the manager's KV cache groups."""
    for single in manager.coordinator.single_type_managers:  # (a loop: no generator per call)
        if single.req_to_blocks.get(request_id):
            return True
    return False


# ``kwargs`` of a call whose ``args`` are all of vLLM 0.33's parameters after ``request``,
# in signature order (the 0.33 wrapper passes them so: no keyword dict per admission).
# Shared, never mutated; the readers below take a value positionally when it is there.
_ALL_POSITIONAL_033: dict[str, Any] = {}


def _external_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """``allocate_slots``' ``num_external_computed_tokens`` (KV connector hits), passed
    positionally (the fifth after ``request``) or by keyword."""
    if len(args) > 4:
        return int(args[4])
    return int(kwargs.get("num_external_computed_tokens", 0))


def _hit_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """``allocate_slots``' ``num_new_computed_tokens``: the local prefix-cache hit."""
    return int(args[1]) if len(args) > 1 else int(kwargs.get("num_new_computed_tokens", 0))


def _evictable_hits(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Prefix-hit blocks an admission will take out of the evictable ones (``ref_cnt`` 0)."""
    hits = args[2] if len(args) > 2 else kwargs.get("new_computed_blocks")
    if hits is None:
        return 0
    return sum(1 for block in hits.blocks[0] if block.ref_cnt == 0 and not block.is_null)


def _blocks_needed(
    request: Any, args: tuple[Any, ...], kwargs: dict[str, Any], block_tokens: int
) -> int:
    """Blocks a refused admission needs for its whole prompt (its hit blocks excluded).

    Not only the chunk ``allocate_slots`` was asked for: once started, a request
    runs to the end (it is never preempted by a limit), so this is what it maps.
    """
    num_new = int(args[0]) if args else int(kwargs.get("num_new_tokens", 0))
    num_hit = _hit_tokens(args, kwargs)
    num_ext = _external_tokens(args, kwargs)
    num_tokens, num_computed = int(request.num_tokens), int(request.num_computed_tokens)
    total = max(num_tokens, num_computed + num_hit + num_ext + num_new)
    return max(1, -(-total // block_tokens) - num_hit // block_tokens)


_configured: tuple[EngineSettings, VllmSettings] | None = None
_runtime: VllmRuntime | None = None


def configure(engine: EngineSettings, vllm: VllmSettings) -> None:
    """``plugin.register()``: remember the settings for this process (no threads, no I/O)."""
    global _configured
    _configured = (engine, vllm)


def current_runtime() -> VllmRuntime | None:
    """The runtime of this process, once a pool was built."""
    return _runtime


def backing_for_pool(pool: ElasticBlockPool, num_gpu_blocks: int) -> PoolBacking:
    """Called by ``ElasticBlockPool.__init__`` (EngineCore main thread)."""
    global _runtime
    if _configured is None:
        from engine_ext import load_engine_settings
        from engine_ext.vllm._settings import load_vllm_settings

        configure(load_engine_settings(), load_vllm_settings())
    assert _configured is not None
    _runtime = VllmRuntime(*_configured)
    return _runtime.build_backing(pool, num_gpu_blocks)
