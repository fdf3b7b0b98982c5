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
   points"): :meth:`safe_point` at the top and the end of every
   ``Scheduler.schedule()`` (patched), :meth:`after_change` when blocks are
   freed outside ``schedule()``, and the idle hook: a publish from any thread
   calls :meth:`wake`, which registers a one-shot callback on
   ``EngineCore._idle_state_callbacks`` and puts a ``WAKEUP`` on the input
   queue, so an idle engine applies the limit within one busy-loop pass
   (docs/engine-hooks.md 1.7). Allocation never runs a pass;
   :meth:`allocating` (the patched ``KVCacheManager.allocate_slots``) lets a
   RUNNING request's blocks go above the target and records admissions the
   limit keeps out (the demand probe).

Threads: :meth:`wake` from any thread; everything else on the busy-loop thread.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from engine_ext._coordinator import Demand
from engine_ext._errors import EngineExtConfigError
from engine_ext._hit_window import PrefixHitWindow
from engine_ext.protocol import DeferReason, EngineState, Status
from engine_ext.vllm._kv_memory import claim_kv_memory
from engine_ext.vllm._pool_backing import DeviceFullError, PoolBacking
from engine_ext.vllm._reserve import OutputReservation

if TYPE_CHECKING:
    from engine_ext import ElasticInstance, EngineSettings
    from engine_ext.vllm._block_pool import ElasticBlockPool
    from engine_ext.vllm._settings import VllmSettings

__all__ = ["VllmRuntime", "backing_for_pool", "configure", "current_runtime"]

_log = logging.getLogger("engine_ext.vllm.runtime")


class VllmRuntime:
    """Owns the ``ElasticInstance`` of this EngineCore process and the idle hook."""

    def __init__(self, engine: EngineSettings, vllm: VllmSettings) -> None:
        self.engine_settings = engine
        self.vllm_settings = vllm
        self.instance: ElasticInstance | None = None
        self.pool: ElasticBlockPool | None = None
        self._engine_core: Any = None  # EngineCoreProc, set by attach_engine
        self._armed = False
        self._arm_lock = threading.Lock()
        self._last_mapped = -1
        self._last_reclaimable = -1  # allocator's reclaimable pages at the last safe point
        self._blocks: Any = None  # the pool's BlockAllocator, set by build_backing
        self._scheduler: Any = None  # vLLM's Scheduler, seen at the first schedule()
        self._refused_blocks = 0  # blocks the waiting requests need (set when one is refused)
        self._device_refused = False  # ... refused because the device (not the limit) is full
        self._num_preemptions = 0  # Scheduler._preempt_request calls (exact, patched)
        self._hits = PrefixHitWindow()  # prefix_hit_rate over the last admissions
        self._demand_key: tuple[int, ...] | None = None  # last Demand's inputs
        self._last_demand = Demand()
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
        self._blocks = blocks
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
        _log.info(
            "kvsidecar: instance %s, control socket %s",
            self.instance.instance_id,
            self.instance.socket_path,
        )
        self._pass()

    def close(self) -> None:
        """Busy loop ended: stop the socket and the sidecar client (idempotent)."""
        if self.instance is not None:
            self.instance.close()

    # -- safe points (busy-loop thread) -------------------------------------------------
    def safe_point(self, scheduler: Any = None) -> EngineState | None:
        """No prefix lookup of this step is pending: take a target, evict, refresh the state.

        Called at the top and at the end of ``Scheduler.schedule()``. Between
        ``get_computed_blocks`` and the ``touch`` in ``allocate_slots`` the hit
        blocks have ``ref_cnt`` 0 and look evictable; evicting them there kills
        the EngineCore (docs/engine-hooks.md 1.6), so no pass runs inside ``schedule()``.
        When nothing waits this costs a few attribute reads plus the O(1) probe.
        """
        instance, pool = self.instance, self.pool
        if instance is None or pool is None:
            return None
        if scheduler is not None:
            self._scheduler = scheduler
        pool.cleanup()
        if instance.coordinator.pending:
            return self._pass()
        state = instance.step()  # O(1) unless pages moved: demand + mapped stay fresh
        blocks = self._blocks
        self._last_mapped = blocks.pages.num_mapped
        self._last_reclaimable = blocks.num_reclaimable_pages
        return state

    def begin_schedule(self, scheduler: Any) -> None:
        """Top of ``schedule()``: a safe point, then the pool defers its own evictions."""
        self.safe_point(scheduler)
        self._refused_blocks = 0
        self._device_refused = False
        if self._reservation is not None:
            self._reservation.begin_step()
        if self.pool is not None:
            self.pool.in_schedule = True

    def end_schedule(self) -> None:
        """End of ``schedule()`` (also on error): lookups are done, a safe point again."""
        if self.pool is not None:
            self.pool.in_schedule = False
        self.safe_point()

    def allocating(
        self,
        original: Any,
        manager: Any,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``KVCacheManager.allocate_slots``: running requests may go above the target.

        A RUNNING request is extending: vLLM would preempt it if we said no, so its
        blocks may be mapped above the target (the overage is reported as
        ``running_requests`` and shed when it finishes). Anything else is an
        admission (waiting or preempted): it gets only what fits under the target,
        and a refusal under a limit is recorded for the demand probe. O(1).
        """
        pool = self.pool
        if pool is None or manager.block_pool is not pool:
            return original(manager, request, *args, **kwargs)
        running = request.status == (_RUNNING or _running_status())
        reservation = self._reservation
        if reservation is not None:
            if self._manager is not manager:  # the probe reads the requests' blocks from it
                self._manager = manager
                reservation.max_model_len = int(manager.max_model_len)
            if (
                not running
                and pool.blocks_target() is not None
                and self._reserve_refuses(manager, request, args, kwargs)
            ):
                return None  # its whole output would not fit under the limit: it waits
        # a RUNNING request holds its blocks; only an admission may hold none yet (then a
        # failed map must give back the prefix hits it touched)
        held = running or _holds_blocks(manager, request.request_id)
        was_in_schedule = pool.in_schedule
        pool.overdraft = running
        pool.in_schedule = True  # frees inside allocate_slots (sliding window) evict later
        device = False
        try:
            result = original(manager, request, *args, **kwargs)
        except DeviceFullError:
            # The device filled between the free count and the map (another engine took
            # the memory, nothing cached to reuse): a refusal, which vLLM handles (the
            # admission waits; a running request is preempted as on a full cache).
            if not held:
                manager.free(request)  # the prefix hits it touched: as before the call
            result, device = None, True
        finally:
            pool.overdraft = False
            pool.in_schedule = was_in_schedule
        if result is None:
            device = device or pool.device_full()
            if not running and (device or pool.blocks_target() is not None):
                self._device_refused = device
                self._refused_blocks = self._waiting_blocks(
                    request, args, kwargs, pool.hash_block_size
                )
        elif not running:  # an admission: its prefix lookup feeds prefix_hit_rate
            self._hits.record(_hit_tokens(args, kwargs), int(request.num_tokens))
            if self._reservation is not None:
                held_now = manager.coordinator.single_type_managers[0].req_to_blocks
                self._reservation.admitted(request, len(held_now.get(request.request_id, ())))
        return result

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
            + int(kwargs.get("num_external_computed_tokens", 0))
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

    def after_forward(self) -> None:
        """``Scheduler.update_from_output`` (patched), before it frees anything: the
        forward pass whose output it holds was launched, so later unmaps wait on an
        event recorded now instead of a device-wide sync (allocator.UnmapFence)."""
        fence = self._fence
        if fence is not None:
            fence.record()

    def preempted(self) -> None:
        """``Scheduler._preempt_request`` (patched): one running request went back to waiting."""
        self._num_preemptions += 1

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
            hit = _hit_tokens(args, kwargs) + int(kwargs.get("num_external_computed_tokens", 0))
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
        nothing it reads moved, so the coordinator's comparison is an identity check."""
        sched = self._scheduler
        hits = self._hits
        if sched is None:
            running = waiting = refused = 0
        else:
            running = len(sched.running)
            waiting = len(sched.waiting) + len(getattr(sched, "kv_holding_waiting", ()))
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
        instance, pool = self.instance, self.pool
        if instance is None or pool is None or pool.in_schedule:
            return  # inside schedule(): the end-of-schedule safe point refreshes
        # Frees outside schedule() (finished requests, aborts, resets) happen with no
        # prefix lookup pending: a safe point, so the state follows /proc at once.
        blocks = self._blocks
        if (
            blocks.pages.num_mapped != self._last_mapped
            or blocks.num_reclaimable_pages != self._last_reclaimable
        ):
            self.safe_point()  # pages or evictable/pinned figures moved: report them now
        if self._armed or self._engine_core is None:
            return  # an idle pass is already due, or not serving yet
        if instance.coordinator.pending:
            self._arm(wakeup=False)

    # -- idle application ------------------------------------------------------------
    def wake(self) -> None:
        """Any thread: make an idle engine run one pass now."""
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
        instance = self.instance
        assert instance is not None and self.pool is not None
        self.pool.cleanup()
        state = instance.step()
        self.pool.invalidate_capacity()
        if self.pool.evict_on_retired_pages():
            state = instance.step()
            self.pool.invalidate_capacity()
        blocks = self._blocks
        self._last_mapped = blocks.pages.num_mapped
        self._last_reclaimable = blocks.num_reclaimable_pages
        return state


_RUNNING: Any = None


def _running_status() -> Any:
    """vLLM's ``RequestStatus.RUNNING`` (imported once, on first use)."""
    global _RUNNING
    if _RUNNING is None:
        from vllm.v1.request import RequestStatus

        _RUNNING = RequestStatus.RUNNING
    return _RUNNING


def _holds_blocks(manager: Any, request_id: str) -> bool:
    """Whether ``request_id`` holds blocks in any of the manager's KV cache groups."""
    return any(
        single.req_to_blocks.get(request_id) for single in manager.coordinator.single_type_managers
    )


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
    num_hit = int(args[1]) if len(args) > 1 else int(kwargs.get("num_new_computed_tokens", 0))
    num_ext = int(kwargs.get("num_external_computed_tokens", 0))
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
