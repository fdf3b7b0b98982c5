"""One scheduler's kvsidecar runtime (:class:`SglangRuntime`): what the SGLang hooks call.

Where the coordinator runs, and why there:

* :meth:`SglangRuntime.before_schedule` -- top of every scheduler iteration,
  *before admission* (``get_next_batch_to_run``): takes the newest target,
  shrinks, and only then lets ``PrefillBudget`` look at
  ``available + evictable``. A pass between admission and allocation could
  take away capacity admission already promised, and SGLang turns a failed
  prefill allocation into a ``RuntimeError`` that ends the scheduler
  (docs/engine-hooks.md 2.6); so the allocation-time hook only makes sure the first
  pass (the retained limit) ran, and capacity never shrinks under a batch.
* :meth:`SglangRuntime.on_idle` -- wraps ``Scheduler.on_idle``: a pass when a
  limit is pending, then the leak check's total is synced
  (:func:`sync_capacity`) before SGLang's own check runs.
* :meth:`SglangRuntime.refresh_state`, when ``get_next_batch_to_run`` returns
  (the batch's pages are allocated) and when ``process_batch_result`` returns
  (finished requests freed theirs) -- no pass, only the state again if a page
  was mapped or unmapped (O(1) otherwise),
  so a running request mapped above the limit reads ``deferred`` before the
  forward pass, not one iteration later.

Thread: the scheduler thread, except :meth:`set_limit` and :meth:`state`.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from .. import (
    Demand,
    ElasticInstance,
    EngineBinding,
    EngineExtConfigError,
    EngineSettings,
    Reclaimer,
)
from ._accounting import sync_capacity
from ._allocator import ElasticTokenAllocator
from ._counts import TreeCounts, track_tree_cache
from ._reclaimers import make_reclaimer
from ._wake import PipeWaker

if TYPE_CHECKING:
    import httpx

    from .._mailbox import PublishResult
    from ..protocol import EngineState

__all__ = ["SglangRuntime", "runtime_of"]

_log = logging.getLogger("engine_ext.sglang")
ATTR = "_kvsidecar_runtime"  # where the runtime hangs on the scheduler


class SglangRuntime:
    """Owns the instance runtime (mailbox, coordinator, socket, sidecar client)
    and the tree-cache reclaimer of one scheduler; borrows its allocator."""

    def __init__(
        self,
        scheduler: Any,
        instance: ElasticInstance,
        allocator: ElasticTokenAllocator,
        reclaimer: Reclaimer,
        counts: TreeCounts | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.instance = instance
        self.allocator = allocator
        self.reclaimer = reclaimer
        self.waker: PipeWaker | None = None  # wakes --sleep-on-idle polls on publish
        self._stepped = False
        # evictable/pinned marks kept per tree event (._counts); its O(1) drift check runs
        # at every iteration, so the figures never need a rescan
        self.counts = counts
        # GPU: the fence the KV backend's unmaps wait on (allocator.FencedBackend, placed by
        # _kv_placement); recorded after each batch (after_batch). None: no ordering needed.
        self.fence: Any = getattr(allocator.blocks.pages.backend, "fence", None)

    @classmethod
    def attach(
        cls,
        scheduler: Any,
        settings: EngineSettings,
        *,
        engine_version: str,
        sidecar_transport: httpx.BaseTransport | None = None,
        signal_cleanup: bool = False,
    ) -> SglangRuntime:
        """Build the reclaimer for the scheduler's (already built) tree cache, register,
        apply the retained or configured limit, and hang the runtime on the scheduler.

        ``signal_cleanup`` (the scheduler process's main thread): SIGTERM and SIGINT
        remove the runtime dir before SGLang's own handling (SGLang's scheduler installs
        no handler, so SIGTERM would leave ``.owner`` and ``control.sock`` behind).
        """
        allocator = scheduler.token_to_kv_pool_allocator
        if not isinstance(allocator, ElasticTokenAllocator):
            raise EngineExtConfigError(
                f"the scheduler's allocator is {type(allocator).__name__}, not the "
                "kvsidecar allocator; call install() before building the scheduler"
            )
        reclaimer = make_reclaimer(scheduler.tree_cache, allocator)
        counts = track_tree_cache(
            scheduler.tree_cache, allocator.blocks, allocator.page_size, reclaimer.scan_unlocked
        )
        waker = PipeWaker()
        waker.attach(scheduler)
        binding = EngineBinding(
            "sglang",
            engine_version,
            allocator.blocks,
            (reclaimer,),
            wake=waker.wake,
            device_total_bytes=_device_total_bytes(allocator.device),
        )
        instance = ElasticInstance(settings, binding, sidecar_transport=sidecar_transport)
        runtime = cls(scheduler, instance, allocator, reclaimer, counts)
        runtime.waker = waker
        allocator.set_unlocked_blocks(reclaimer.unlocked_blocks)
        allocator.set_before_alloc(runtime._ensure_started)
        instance.coordinator.set_demand_probe(runtime.demand)
        instance.start()
        if signal_cleanup:
            _install_signal_cleanup(instance)
        runtime.before_schedule()  # the retained limit is applied before the first request
        setattr(scheduler, ATTR, runtime)
        return runtime

    # -- scheduler thread --------------------------------------------------------------

    def before_schedule(self) -> EngineState:
        """Top of a scheduler iteration: one coordinator pass, then truthful totals."""
        self._stepped = True
        if self.instance.settings.reserve_output:
            self._pin_output_ratio()
        self.allocator.release_promises()  # last iteration's unused promises, before the pass
        if not self.allocator.padding_held and not self.scheduler.is_fully_idle():
            self.allocator.claim_padding()  # work arrived: padded writes need page 0 again
        if self.counts is not None:
            self.counts.verify()  # O(1); a full rescan only if a tree event went unseen
        state = self._step()
        # a claim refused under the old target (limit 0 while idle): the pass may just have
        # taken a raised limit, so claim again now, or admission sees no room this iteration
        if (
            not self.allocator.padding_held
            and not self.scheduler.is_fully_idle()
            and self.allocator.claim_padding()
        ):
            self.refresh_state()
        sync_capacity(self.scheduler, self.allocator.capacity_tokens(), self.allocator.page_size)
        return state

    def on_idle(self) -> None:
        """Fully or partly idle iteration: a pass if a limit waits; totals synced."""
        if self.waker is not None and self.waker.attached:
            self.waker.drain()
        self.allocator.release_promises()  # before SGLang's idle leak check
        pending = self.instance.coordinator.pending
        if self.counts is not None:
            self.counts.verify()
        self._step()  # not pending: cheap, only refreshes the state if mapped memory moved
        if (
            pending
            and self._over_target()
            and self.scheduler.is_fully_idle()
            and self._drain_padding_page()
        ):
            self._step()  # page 0 unmapped: recompute the status
        self.refresh_state()  # the drain's evictions may have emptied retired pages
        sync_capacity(self.scheduler, self.allocator.capacity_tokens(), self.allocator.page_size)

    def refresh_state(self) -> None:
        """The state follows the pages mapped or unmapped since the last pass; no pass.

        Called when ``get_next_batch_to_run`` returns (the batch's pages are mapped;
        a running request may have gone above the limit, and the status then says
        so) and when ``process_batch_result`` returns (its frees may have emptied
        retired pages). O(1) when nothing moved."""
        self.instance.coordinator.refresh()

    def after_batch(self) -> None:
        """``Scheduler.process_batch_result`` (patched), before it frees anything: record
        the unmap fence, so later unmaps wait on the work launched so far rather than on a
        device-wide sync (allocator.UnmapFence).

        SGLang's overlap loop launches forwards on ``forward_stream`` (the batch after
        this one may be running there now): the event is recorded on that stream, here
        and when an unmap records it again before its wait (``UnmapFence.stream``).
        """
        fence = self.fence
        if fence is None:
            return
        if fence.stream is None:
            stream = getattr(self.scheduler, "forward_stream", None)
            if stream is not None:
                import torch

                fence.stream = lambda: torch.cuda.stream(stream)
        fence.record()

    def _pin_output_ratio(self) -> None:
        """Output reservation (``KVSIDECAR_RESERVE_OUTPUT``): SGLang admits against an
        estimate of each request's output, ``new_token_ratio`` x ``max_new_tokens``
        (from 0.7 decaying to about 0.1, lowered again after a retraction). Held at 1.0
        the estimate is the whole ``max_new_tokens``: SGLang's own admission then keeps
        every running request's remaining output inside the headroom under the limit.
        One attribute read per iteration once pinned."""
        tracker = getattr(self.scheduler, "new_token_ratio_tracker", None)
        if tracker is not None and (tracker.current != 1.0 or tracker.min != 1.0):
            tracker.init = tracker.min = tracker.current = 1.0
            tracker.decay = 0.0

    def _reserved_growth(self) -> tuple[int, int]:
        """Output reservation: (pages the running requests, and the one in the middle of a
        chunked prefill, may still add, how many of them the free pages under the target
        cannot hold). O(running)."""
        page = self.allocator.page_size
        reserved = 0
        for req in _running_requests(self.scheduler):
            prompt, out, max_new = _token_counts(req)
            more = -(-(prompt + max_new) // page) - -(-(prompt + out) // page)
            if more > 0:
                reserved += more
        chunked = _chunked_request(self.scheduler)
        if chunked is not None:  # the rest of its prompt's chunks, then its whole output
            prompt, _out, max_new = _token_counts(chunked)
            reserved += max(0, -(-(prompt + max_new) // page) - -(-_held_tokens(chunked) // page))
        pages = self.allocator.blocks.pages
        if pages.target_pages is None:
            return reserved, 0
        return reserved, max(0, reserved - self.allocator.blocks.num_free_blocks)

    def demand(self) -> Demand:
        """The demand probe (scheduler thread): queue lengths and the allocator's counters.

        ``waiting_for_memory``: the last admission round refused a request for
        memory while a limit is set. ``waiting_blocks`` then covers every waiting
        request: the refused one's budget (its prompt less its prefix hit, plus
        the decode headroom SGLang reserves) and every other one's whole sequence
        (their hits are looked up only when they reach the budget: an upper bound).
        ``device_out_of_memory`` also while a chunked-prefill continuation waits
        because the device refused its pages (its chunk counts in
        ``waiting_blocks``). O(1) unless a request was refused; then O(waiting).
        """
        scheduler, allocator = self.scheduler, self.allocator
        waiting = _num_waiting(scheduler)
        refused = allocator.refused_tokens if waiting else 0
        # set by the last admission round, which SGLang skips with nothing queued and no
        # chunked request: a parked chunk whose request was aborted or retracted is gone
        parked = allocator.parked_chunk_tokens if _chunked_request(scheduler) is not None else 0
        pages = allocator.blocks.pages
        limited = pages.target_pages is not None and pages.target_pages < pages.num_pages
        page = allocator.page_size
        blocks = -(-parked // page)
        if refused:
            blocks += (
                -(-refused // page)
                + _queued_pages(scheduler, page)
                - -(-allocator.refused_input_tokens // page)
            )
        reserved = shortfall = 0
        if self.instance.settings.reserve_output:
            reserved, shortfall = self._reserved_growth()
        return Demand(
            reserved_blocks=reserved,
            reserve_shortfall_blocks=shortfall,
            num_running_requests=_num_running(scheduler),
            num_waiting_requests=waiting,
            waiting_blocks=max(0, blocks),
            waiting_for_memory=bool(refused and limited and not allocator.refused_by_device),
            device_out_of_memory=bool((refused and allocator.refused_by_device) or parked),
            num_preemptions=allocator.num_decode_shortages,
            prefix_hit_rate=allocator.hits.rate,
        )

    def _step(self) -> EngineState:
        """A coordinator pass (a failed map/unmap is logged by the instance, never fatal)."""
        return self.instance.step()

    def _drain_padding_page(self) -> bool:
        """Fully idle and still over the target: only page 0 can be left (it holds the
        padding block, so victim selection never picks it). Evict the cache blocks that
        share it and give the padding back; the next admission claims it again."""
        if not self.instance.settings.reclaim:
            return False
        blocks = self.allocator.blocks
        others = [b for b in blocks.blocks_on_page(blocks.page_of(0)) if b != 0]
        if others and all(self.reclaimer.is_evictable(b) for b in others):
            self.reclaimer.evict(others)
        return self.allocator.release_padding()

    def _over_target(self) -> bool:
        pages = self.allocator.blocks.pages
        return pages.target_pages is not None and pages.num_mapped > pages.target_pages

    def _ensure_started(self) -> None:
        if not self._stepped:
            self.before_schedule()

    # -- any thread ------------------------------------------------------------------

    def set_limit(self, limit_bytes: int | None) -> PublishResult:
        """Publish a limit (next revision); the scheduler applies it on its next pass."""
        return self.instance.set_limit(limit_bytes)

    def state(self) -> EngineState:
        return self.instance.state()

    def close(self) -> None:
        self.instance.close()
        if self.counts is not None:
            self.counts.close()
        if self.waker is not None:
            self.waker.close()


def _num_waiting(scheduler: Any) -> int:
    queue: Any = getattr(scheduler, "waiting_queue", None)  # SGLang's Scheduler
    if queue is None:
        queue = getattr(scheduler, "waiting", ())  # the CPU harness
    return len(queue)


def _queued_pages(scheduler: Any, page_size: int) -> int:
    """Pages the whole sequences of every waiting request span (O(waiting))."""
    queue: Any = getattr(scheduler, "waiting_queue", None)
    if queue is None:
        queue = getattr(scheduler, "waiting", ())
    total = 0
    for req in queue:
        tokens = getattr(req, "tokens", None)  # the CPU harness
        n = (
            len(tokens) if tokens is not None else len(req.origin_input_ids) + len(req.output_ids)
        )  # SGLang's Req
        total += -(-n // page_size)
    return total


def _running_requests(scheduler: Any) -> Any:
    batch = getattr(scheduler, "running_batch", None)  # SGLang's Scheduler
    if batch is not None:
        return getattr(batch, "reqs", None) or ()
    return getattr(scheduler, "running", ())  # the CPU harness


def _token_counts(req: Any) -> tuple[int, int, int]:
    """(prompt tokens, output tokens so far, max new tokens) of a running request."""
    params = getattr(req, "sampling_params", None)
    if params is not None:  # SGLang's Req
        return len(req.origin_input_ids), len(req.output_ids), int(params.max_new_tokens)
    return len(req.tokens), len(req.generated), int(req.max_new_tokens)  # the CPU harness


def _num_running(scheduler: Any) -> int:
    """The running batch's requests, plus the request in the middle of a chunked prefill
    (see :func:`_chunked_request`)."""
    batch = getattr(scheduler, "running_batch", None)  # SGLang's Scheduler
    if batch is not None:
        running = len(getattr(batch, "reqs", None) or ())
    else:
        running = len(getattr(scheduler, "running", ()))  # the CPU harness
    return running + (_chunked_request(scheduler) is not None)


def _chunked_request(scheduler: Any) -> Any:
    """The request in the middle of a chunked prefill, or None: SGLang keeps it in
    ``chunked_req`` (neither queued nor in the running batch) while it holds its prompt's
    KV so far and takes a chunk each round."""
    if getattr(scheduler, "running_batch", None) is not None:  # SGLang's Scheduler
        return getattr(scheduler, "chunked_req", None)
    return getattr(scheduler, "chunked", None)  # the CPU harness


def _held_tokens(req: Any) -> int:
    """Token slots a request holds in its row (its prefix and the chunks so far)."""
    kv = getattr(req, "kv", None)
    if kv is not None:  # SGLang's Req: its row spans [0, kv_allocated_len)
        return int(kv.kv_allocated_len)
    return int(req.kv_len)  # the CPU harness


def _install_signal_cleanup(instance: ElasticInstance) -> None:
    """Chain the instance's cleanup in front of SIGTERM/SIGINT (main thread only);
    a signal the process ignores stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        _log.warning(
            "kvsidecar: not on the main thread; SIGTERM will leave %s behind", instance.runtime_dir
        )
        return
    ignored = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) == signal.SIG_IGN]
    instance.install_signal_cleanup()
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)


def _device_total_bytes(device: Any) -> int | None:
    """Memory of this rank's GPU (for ``kvctl limit-percent``); None on CPU."""
    if not str(device).startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def runtime_of(scheduler: Any) -> SglangRuntime | None:
    """The runtime attached to ``scheduler``, if any."""
    runtime = getattr(scheduler, ATTR, None)
    return runtime if isinstance(runtime, SglangRuntime) else None
