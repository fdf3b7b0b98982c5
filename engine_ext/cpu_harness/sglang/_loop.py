"""A CPU stand-in for SGLang's scheduler loop, over SGLang's real memory classes.

SGLang's ``Scheduler.__init__`` needs a model worker, a tokenizer, ZMQ IPC
channels and a process group before it builds the KV cache, so on a machine
without a GPU model this harness runs *SGLang's own* memory path instead
(see docs/sglang.md): the real tree cache (``UnifiedRadixCache`` with its
Rust core by default, or ``RadixCache``), ``ReqToTokenPool``, the kvsidecar
:class:`ElasticTokenAllocator` (a ``PagedTokenToKVPoolAllocator``), SGLang's
``PrefillBudget`` for admission, SGLang's ``alloc_paged_token_slots_extend``
for prefill allocation (which raises ``RuntimeError`` on a failed
allocation, as in the server) and SGLang's ``SchedulerInvariantChecker`` +
``SchedulerPoolStatsObserver`` for the strict idle leak check. The request
loop calls them in the scheduler's order: before-schedule pass, admission
(match_prefix, lock), req row + ``alloc_extend``, a "forward" that writes
each token's id into every layer's K/V rows (a write to an unmapped page
would fault), the prompt checkpointed into the tree (as SGLang 0.5.23 does
after a prefill, and with a chunk of a chunked prompt at the top of the next
round), decode steps, and on finish insert / free duplicates / unlock.
KV tensors live on a :class:`allocator.HostBackend`, so mapped memory is
measured from the memfd.

Thread: one thread (the "scheduler thread") drives a harness.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from allocator import BlockAllocator, PageAllocator
from engine_ext import EngineSettings
from engine_ext.sglang import (
    ElasticTokenAllocator,
    KVGeometry,
    KVReservation,
    SglangRuntime,
    installed_sglang_version,
    prepare_cpu_imports,
    reserve_kv,
)

__all__ = [
    "BatchDevice",
    "CpuHarness",
    "HarnessConfig",
    "HarnessRequest",
    "LaunchedBatch",
    "single_rank_runtime",
]


class BatchDevice(Protocol):
    """Where the harness's batches "run" (test instrumentation: a simulated device queue).

    :meth:`launch` is called with the allocator pages a batch reads or writes when the
    loop launches it, and returns its id; :meth:`complete_through` when the loop waits
    for that batch's result (SGLang's ``copy_done.synchronize()``).
    """

    def launch(self, pages: set[int]) -> int: ...

    def complete_through(self, step: int) -> None: ...


@dataclass(slots=True, eq=False)
class LaunchedBatch:
    """A batch whose result the overlap loop processes one iteration later.

    ``entries``: per request, its epoch at launch and the token it produced (-1 for an
    extend, whose result is the prompt checkpoint)."""

    kind: str  # "extend" or "decode"
    entries: list[tuple[HarnessRequest, int, int]]
    pages: set[int]
    device_id: int = 0


@dataclass(frozen=True, slots=True)
class HarnessConfig:
    """Shape of the harness pool (defaults: 4 KiB pages of 4 SGLang pages, 16 KiB bundles)."""

    page_size: int = 4  # tokens per SGLang page
    head_num: int = 2
    head_dim: int = 64  # fp16: 256 bytes per token row, 1 KiB per SGLang page
    layer_num: int = 2  # 4 regions (K and V per layer)
    max_tokens: int = 1020  # SGLang-sized capacity: 255 pages + padding = 64 allocator pages
    # "unified" (SGLang's default), "radix", or "disabled" (--disable-radix-cache)
    cache: str = "unified"
    max_running: int = 16  # ReqToTokenPool rows
    max_context: int = 1024
    sleep_on_idle: bool = False  # build SGLang's IdleSleeper (the adapter registers its waker)
    signal_cleanup: bool = False  # as a scheduler process: SIGTERM/SIGINT remove the runtime dir
    # SGLang's --chunked-prefill-size: tokens prefilled per round; a longer prompt is
    # prefilled in chunks, one chunked request at a time (None: off)
    chunked_prefill_size: int | None = None
    # SGLang's event_loop_overlap (its default on GPU and CPU): batch N+1 is formed and
    # launched before the result of batch N is processed (see CpuHarness.iterate)
    overlap: bool = False


@dataclass(slots=True, eq=False)
class HarnessRequest:
    """One request: its prompt, what it generated and what it holds."""

    rid: int
    tokens: list[int]  # prompt
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    row: int | None = None  # ReqToTokenPool row
    prefix_len: int = 0  # matched (page-aligned) prefix at admission
    owned_len: int = 0  # tokens of its KV the tree owns (SGLang's cache_protected_len)
    lock: Any = None  # tree lock on the matched node
    kv_len: int = 0  # token slots written for this request
    extend_end: int = 0  # end of the tokens this round prefills (a chunk, or the prompt)
    done: bool = False
    aborted: bool = False  # aborted by :meth:`CpuHarness.abort` (not in ``finished``)
    # bumped when the request gives its KV back (finish, abort, retraction): a result of a
    # batch launched before that is stale (SGLang skips finished and retracted requests)
    epoch: int = 0

    @property
    def seq(self) -> list[int]:
        return self.tokens + self.generated


def single_rank_runtime() -> None:
    """State the parallel widths the memory classes read (a server publishes them)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        get_parallel().dcp_enabled  # noqa: B018 -- published already (e.g. a real scheduler)
    except RuntimeError:
        get_parallel().override_permanently(dcp_enabled=False)


class CpuHarness:
    """SGLang's memory classes driven like the scheduler drives them (see module doc).

    Owns the reservation, the allocators, the tree cache and the attached
    :class:`SglangRuntime`; :meth:`close` releases them.
    """

    def __init__(self, settings: EngineSettings, config: HarnessConfig | None = None) -> None:
        prepare_cpu_imports()
        import torch
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.config = cfg = config or HarnessConfig()
        if cfg.page_size < 2:
            raise ValueError("the adapter needs SGLang page size >= 2 (see docs/sglang.md)")
        single_rank_runtime()
        geometry = KVGeometry(
            cfg.page_size, cfg.head_num, cfg.head_dim, cfg.layer_num, 2, cfg.max_tokens
        )
        self.reservation: KVReservation = reserve_kv(geometry, device="cpu")
        self.pages = PageAllocator(self.reservation.backend, reserve_pages=settings.reserve_pages)
        self.blocks = BlockAllocator(self.pages, self.reservation.blocks_per_page)
        self.token_to_kv_pool_allocator = ElasticTokenAllocator(
            self.blocks, page_size=cfg.page_size, dtype=torch.float16, device="cpu", kvcache=None
        )
        self.k_buffer, self.v_buffer = self.reservation.buffers(torch.float16)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_running, cfg.max_context, "cpu", False)
        self.tree_cache = self._make_cache()
        self.max_total_num_tokens = self.token_to_kv_pool_allocator.size
        self.pool_stats_observer, self.invariant_checker = self._make_checks()
        self.load_inquirer = self._make_load_inquirer()
        self.idle_sleeper: Any = None
        if cfg.sleep_on_idle:
            from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper

            self.idle_sleeper = IdleSleeper(sockets=[])
        self.waiting: list[HarnessRequest] = []
        self.running: list[HarnessRequest] = []
        self.chunked: HarnessRequest | None = None  # SGLang's chunked_req: prompt in chunks
        # SGLang's _pending_chunked_abort_req: the chunked request an abort marked
        self.pending_chunked_abort: HarnessRequest | None = None
        self.num_parked_chunks = 0  # rounds whose continuation the budget held back
        self.finished: list[HarnessRequest] = []
        self._rids = itertools.count()
        self.num_retracted = 0  # decode shortages answered by retraction (as SGLang does)
        self.num_prefix_hits = 0  # admitted requests that matched a cached prefix
        self.num_overshoot_frees = 0  # overlap: released with a slot the next batch wrote
        # Test instrumentation: called with "admitted" after admission, before the prefill
        # allocation, and "decode" before the decode capacity check (the points where a
        # foreign thread's limit must not change what the scheduler was promised).
        self.at_point: Callable[[str], None] | None = None
        # Test instrumentation: the simulated device batches launch on (None: none).
        self.device: BatchDevice | None = None
        self.last_batch: LaunchedBatch | None = None  # overlap: launched, result unprocessed
        # /pause_generation mode="in_place": SGLang's loops then only call
        # _record_scheduler_state_for_paused_engine (patched: the idle pass), leaving the
        # queues, the batch in flight and its unprocessed result as they are
        self.paused = False
        self.pool = SglangRuntime.attach(
            self,
            settings,
            engine_version=installed_sglang_version(),
            signal_cleanup=cfg.signal_cleanup,
        )

    # -- building ----------------------------------------------------------------------

    def _make_cache(self) -> Any:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        if self.config.cache not in ("unified", "radix", "disabled"):
            raise ValueError(
                f"cache must be 'unified', 'radix' or 'disabled'; got {self.config.cache!r}"
            )
        params = CacheInitParams(
            disable=self.config.cache == "disabled",
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            page_size=self.config.page_size,
            tree_components=(ComponentType.FULL,),
        )
        if self.config.cache == "radix":
            return RadixCache(params)
        # SGLang 0.5.23 builds its --disable-radix-cache cache this way too: the unified
        # tree with ``disable`` set, which caches nothing and frees a request's KV at its end
        return UnifiedRadixCache(params)

    def _make_checks(self) -> tuple[Any, Any]:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.invariant_checker import (
            SchedulerInvariantChecker,
        )
        from sglang.srt.managers.scheduler_components.pool_stats_observer import (
            SchedulerPoolStatsObserver,
        )

        observer = SchedulerPoolStatsObserver(
            tree_cache=self.tree_cache,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            req_to_token_pool=self.req_to_token_pool,
            session_controller=None,
            hisparse_coordinator=None,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hisparse=False,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            max_total_num_tokens=self.max_total_num_tokens,
        )
        checker = SchedulerInvariantChecker(
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            disaggregation_mode=DisaggregationMode.NULL,
            page_size=self.config.page_size,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            max_total_num_tokens=self.max_total_num_tokens,
            tree_cache=self.tree_cache,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            req_to_token_pool=self.req_to_token_pool,
            pool_stats_observer=observer,
            get_last_batch=lambda: None,
            get_running_batch=lambda: None,
            scheduler_stage_metrics=None,
        )
        return observer, checker

    def _make_load_inquirer(self) -> Any:
        """SGLang's (frozen) load inquirer: it holds the observer the adapter replaces."""
        from dataclasses import fields

        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.scheduler_components.load_inquirer import (
            SchedulerLoadInquirer,
        )

        given = {
            "disaggregation_mode": DisaggregationMode.NULL,
            "server_args": None,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.config.max_running,
            "pool_stats_observer": self.pool_stats_observer,
            "tp_worker": None,
            "token_to_kv_pool_allocator": self.token_to_kv_pool_allocator,
            "spec_algorithm": None,
        }
        unused = {
            f.name: None
            for f in fields(SchedulerLoadInquirer)
            if f.name not in given and f.default is f.default_factory
        }  # callables
        return SchedulerLoadInquirer(**given, **unused)

    # -- requests ----------------------------------------------------------------------

    def submit(self, tokens: list[int], max_new_tokens: int = 4) -> HarnessRequest:
        req = HarnessRequest(next(self._rids), list(tokens), max_new_tokens)
        self.waiting.append(req)
        return req

    def abort(self, req: HarnessRequest) -> bool:
        """Abort a waiting, chunked or running request (SGLang finishes a running one as
        aborted: its KV goes through ``cache_finished_req``). The chunked request (in the
        middle of its prompt's chunks) is only marked, as SGLang's ``abort_request`` does:
        the next ``get_next_batch_to_run`` releases it before any chunk (see
        :meth:`_release_pending_chunked_abort`). False if it already ended (or is marked)."""
        if req.aborted:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        elif req is self.chunked:
            self.pending_chunked_abort = req
        elif req in self.running:
            self._finish(req)
            self.finished.remove(req)
            req.done = False
        else:
            return False
        req.aborted = True
        return True

    def pause_retract(self) -> None:
        """``/pause_generation`` mode="retract": (overlap) the result in flight processed
        first, then every running request and the chunked one released without a
        checkpoint (``retract_all``) and queued again (SGLang's ``_add_request_to_queue``:
        at the end), ``chunked_req`` cleared; generation stays paused (set ``paused``
        False to continue). A chunked request whose abort was only marked is retracted
        like the others and, as in SGLang, the mark is then dropped: it runs again."""
        last, self.last_batch = self.last_batch, None
        if last is not None:
            self.pool.after_batch()
            if self.device is not None:
                self.device.complete_through(last.device_id)
            self._process_result(last)
        retracted = list(self.running)
        if self.chunked is not None:
            retracted.append(self.chunked)
        for req in retracted:
            self._release(req)
            req.generated.clear()
            self.waiting.append(req)
        self.running.clear()
        self.chunked = None
        self.paused = True
        self.pool.refresh_state()

    def flush_cache(self) -> bool:
        """``Scheduler.flush_cache`` (``/flush_cache``): tree, rows and allocator cleared, only
        when fully idle (in the overlap loop also no result left to process); False else."""
        if not self.is_fully_idle():
            return False
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        return True

    def is_fully_idle(self) -> bool:
        """SGLang's ``is_fully_idle``: no request, and (overlap) no result left to process."""
        return (
            not self.waiting
            and not self.running
            and self.chunked is None
            and self.last_batch is None
        )

    def iterate(self) -> None:
        """One scheduler iteration: pass, admission + prefill, one decode step; idle hook.

        With ``HarnessConfig.overlap``, SGLang's ``event_loop_overlap`` instead: the pass
        and the next batch (formed, allocated and launched) come *before* the result of
        the batch launched in the previous iteration is processed (its finished requests
        released, its prompts checkpointed, its tokens appended). A request finishing in
        batch N is then already in batch N+1 (one token over, freed at its release), and
        a retraction or an abort frees KV that the batch in flight still reads.
        """
        if self.paused:
            self.pool.on_idle()  # _record_scheduler_state_for_paused_engine (patched)
            return
        if self.config.overlap:
            self._iterate_overlap()
            return
        if self.is_fully_idle():
            self.on_idle()
            return
        self.pool.before_schedule()
        self._chunked_between_rounds()
        admitted = self._admit()
        if admitted:
            if self.at_point is not None:
                self.at_point("admitted")
            batch: LaunchedBatch | None = self._prefill(admitted)
        elif self.running:
            batch = self._decode()
        else:
            self.on_idle()  # requests wait for memory: a batch-less iteration
            return
        self.pool.refresh_state()  # get_next_batch_to_run returns here: the batch is allocated
        if batch is not None:
            self._launch(batch)
        self.pool.after_batch()  # Scheduler.process_batch_result (patched)
        if batch is not None:
            if self.device is not None:
                self.device.complete_through(batch.device_id)  # result.copy_done.synchronize()
            self._process_result(batch)
        self.pool.refresh_state()

    def _iterate_overlap(self) -> None:
        """``event_loop_overlap``: get_next_batch_to_run (the pass, every iteration), launch
        it, then process the previous batch's result; ``on_idle`` when there is neither."""
        self.pool.before_schedule()
        self._chunked_between_rounds()
        admitted = self._admit()
        batch: LaunchedBatch | None = None
        if admitted:
            if self.at_point is not None:
                self.at_point("admitted")
            batch = self._prefill(admitted)
        elif self.running:
            batch = self._decode()
        self.pool.refresh_state()  # get_next_batch_to_run returns here: the batch is allocated
        if batch is not None:
            self._launch(batch)
        last, self.last_batch = self.last_batch, batch
        if self.at_point is not None:
            self.at_point("launched")  # the batch runs; the previous result is not processed
        if last is not None:
            self.pool.after_batch()  # Scheduler.process_batch_result (patched)
            if self.device is not None:
                self.device.complete_through(last.device_id)  # result.copy_done.synchronize()
            self._process_result(last)
            self.pool.refresh_state()
        elif batch is None:
            self.on_idle()

    def _chunked_between_rounds(self) -> None:
        """The top of SGLang's ``get_next_batch_to_run`` for the chunked request (after the
        adapter's pass, which wraps it): ``process_pending_chunked_abort`` releases a marked
        one (``release_kv_cache(checkpoint=False)``: its own KV freed, its lock and row
        released; a chunk still in flight reads pages the unmap fence holds), else its last
        chunk is stashed (``checkpoint_kv_cache``): inserted into the tree, the lock moved
        onto it, so its prefix is the tree's, locked, between chunks."""
        req = self.chunked
        if req is None:
            self.pending_chunked_abort = None
            return
        if self.pending_chunked_abort is req:
            self.pending_chunked_abort = None
            self._release(req)
            self.chunked = None
            return
        self._checkpoint(req)

    def _release(self, req: HarnessRequest) -> None:
        """``release_kv_cache(checkpoint=False)``: the KV past the tree-owned prefix goes
        back to the allocator, the lock and the row are released."""
        kv = self.req_to_token_pool.req_to_token[req.row, : req.kv_len].to("cpu").long()
        if req.kv_len > req.owned_len:
            self.token_to_kv_pool_allocator.free(kv[req.owned_len :])
        self.tree_cache.unlock(req.lock)
        self.req_to_token_pool.free_rows([req.row])
        req.row, req.lock, req.kv_len, req.prefix_len, req.owned_len = None, None, 0, 0, 0
        req.epoch += 1

    def _launch(self, batch: LaunchedBatch) -> None:
        """The forward was computed at allocation (CPU); the device, if any, runs it now."""
        if self.device is not None:
            batch.device_id = self.device.launch(batch.pages)

    def _process_result(self, batch: LaunchedBatch) -> None:
        """``process_batch_result``: checkpoint finished prompts, append tokens, release
        finished requests; results of requests that gave their KV back are skipped. Its
        frees are held in SGLang's free group until the batch is processed."""
        allocator = self.token_to_kv_pool_allocator
        allocator.free_group_begin()
        try:
            for req, epoch, token in batch.entries:
                if req.epoch != epoch or req.row is None:
                    continue  # finished, aborted or retracted since the launch
                if batch.kind == "extend":
                    self._checkpoint(req)
                    continue
                req.generated.append(token)
                if len(req.generated) >= req.max_new_tokens:
                    self._finish(req)
        finally:
            allocator.free_group_end()

    def _pages_of(self, reqs: list[HarnessRequest]) -> set[int]:
        """Allocator pages holding the KV rows of ``reqs`` (what their forward reads/writes)."""
        if self.device is None:
            return set()
        ps = self.config.page_size
        table = self.req_to_token_pool.req_to_token
        blocks: set[int] = set()
        for req in reqs:
            blocks.update((table[req.row, : req.kv_len] // ps).tolist())
        return {self.blocks.page_of(int(b)) for b in blocks}

    def run_until_idle(self, max_iterations: int = 10_000, min_seconds: float = 5.0) -> None:
        """Iterate until fully idle; give up after ``max_iterations`` *and* ``min_seconds``.

        Both bounds: after a device refusal the allocator holds at what is mapped for
        ``DEVICE_RETRY_S`` (1 s), and on a quiet machine 10k fast iterations end
        sooner than that.
        """
        deadline = time.monotonic() + min_seconds
        done = 0
        while not self.is_fully_idle():
            if done >= max_iterations and time.monotonic() > deadline:
                raise RuntimeError(f"not idle after {done} iterations: {self.describe()}")
            self.iterate()
            done += 1
        self.on_idle()

    def describe(self) -> str:
        """What a stuck loop looks like: the queues and the memory books (for errors)."""
        allocator = self.token_to_kv_pool_allocator
        blocks = allocator.blocks
        pages = blocks.pages
        chunked = self.chunked
        return (
            f"waiting={len(self.waiting)} (first rid "
            f"{self.waiting[0].rid if self.waiting else None}), "
            f"running={[(r.rid, r.kv_len, len(r.generated)) for r in self.running]}, "
            f"chunked={None if chunked is None else (chunked.rid, chunked.kv_len, len(chunked.tokens))}, "
            f"available={allocator.available_size()}, "
            f"evictable={int(self.tree_cache.evictable_size())}, "
            f"protected={int(self.tree_cache.protected_size())}, "
            f"promised={allocator.promised_tokens}, padding_held={allocator.padding_held}, "
            f"blocks allocated={blocks.num_allocated_blocks}/{blocks.num_blocks} "
            f"free={blocks.num_free_blocks}, pages mapped={pages.num_mapped} "
            f"cap={pages.cap_pages()} retired={pages.num_retired} target={pages.target_pages} "
            f"device_full={pages.device_full}, parked_chunks={self.num_parked_chunks}, "
            f"retracted={self.num_retracted}"
        )

    def idle_until(self, done: Callable[[], bool], timeout_s: float = 5.0) -> int:
        """Spin idle iterations (as SGLang's loop does without --sleep-on-idle) until ``done``.

        The coordinator throttles retries of a deferral eviction could not fix
        (a few ms), so a change it cannot see (a request finished) is picked up
        by a later spin. Returns the number of iterations; raises on timeout.
        """
        deadline = time.monotonic() + timeout_s
        spins = 0
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done after {spins} idle iterations ({timeout_s}s)")
            self.iterate()
            spins += 1
        return spins

    def on_idle(self) -> None:
        """``Scheduler.on_idle`` as wrapped by kvsidecar: pool hook, then SGLang's leak checks."""
        self.pool.on_idle()
        if not self.is_fully_idle():
            return
        has_leak, messages = self.invariant_checker._check_all_pools(
            self.pool_stats_observer.get_pool_stats()
        )
        if has_leak:
            self.invariant_checker._report_leak("pool", "\n".join(messages))
        self.invariant_checker._check_req_pool()

    # -- the scheduler's memory calls --------------------------------------------------

    def _key(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens))

    def _running_offset(self) -> int:
        """What ``PrefillAdder`` adds to the budget's offset for the running batch."""
        return sum(max(r.max_new_tokens - len(r.generated), 0) for r in self.running)

    def _admit(self) -> list[HarnessRequest]:
        """``PrefillAdder``'s memory part: the allocator's budget, the chunked request's
        continuation first (``add_chunked_req``: ``available_chunk_tokens``, ``fit_chunk``),
        then ``check_prefill`` and ``reserve`` per waiting request."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        ps = self.config.page_size
        admitted: list[HarnessRequest] = []
        full = len(self.running) >= self.config.max_running
        if self.chunked is None and (full or not self.waiting):
            return admitted  # get_new_batch_prefill returns before it builds a PrefillAdder
        budget = self.token_to_kv_pool_allocator.create_prefill_budget(self.tree_cache)
        budget.total_offset += self._running_offset()
        rem_chunk = self.config.chunked_prefill_size
        if self.chunked is not None and rem_chunk is not None:
            req = self.chunked
            left = len(req.tokens) - req.kv_len
            size = budget.available_chunk_tokens(rem_chunk)
            if size is not None:
                size = budget.fit_chunk(
                    extend_input_len=left, max_new_tokens=req.max_new_tokens, chunk_limit=size
                )
            if size is None:  # SGLang parks it: no chunk this round, the request keeps its KV
                self.num_parked_chunks += 1
            else:
                last = left <= size
                chunk = left if last else size
                req.extend_end = req.kv_len + chunk
                budget.reserve(chunk, req.max_new_tokens if last else 0)
                rem_chunk -= chunk
                admitted.append(req)
        for req in list(self.waiting):
            if len(admitted) + len(self.running) >= self.config.max_running:
                break
            if rem_chunk is not None and rem_chunk <= 0:
                break
            match = self.tree_cache.match_prefix(MatchPrefixParams(key=self._key(req.tokens)))
            prefix = min(match.device_prefix_len, (len(req.tokens) - 1) // ps * ps)
            extend = len(req.tokens) - prefix
            total = budget.ceil_paged_tokens(extend) + ps + req.max_new_tokens
            lock = self.tree_cache.lock(match.last_device_node)  # the pin before the check
            ok, limit = budget.check_prefill(
                extend_input_len=extend,
                total_tokens=total,
                max_new_tokens=req.max_new_tokens,
                input_tokens=len(req.tokens),
                swa_host_hit_length=0,
                chunk_limit=rem_chunk,
            )
            chunk = extend
            if ok and limit is not None and budget.ceil_paged_tokens(extend) > limit:
                # truncated to a page-aligned end; one chunked request at a time
                chunk = (prefix + limit // ps * ps) // ps * ps - prefix
                if self.chunked is not None or chunk <= 0:
                    ok = False
            if not ok:  # SGLang's NO_TOKEN: stay waiting
                self.tree_cache.unlock(lock)
                break
            req.prefix_len, req.owned_len, req.lock = prefix, prefix, lock
            req.extend_end = prefix + chunk
            budget.reserve(chunk, req.max_new_tokens if chunk == extend else 0)
            if chunk < extend:
                self.chunked = req
            if rem_chunk is not None:
                rem_chunk -= chunk
            self.num_prefix_hits += prefix > 0
            self.waiting.remove(req)
            admitted.append(req)
        return admitted

    def _prefill(self, batch: list[HarnessRequest]) -> LaunchedBatch:
        """One extend pass: each request's tokens from its KV end (or matched prefix) to its
        ``extend_end``; a request whose prompt is done joins the running batch (its prompt
        is checkpointed when the result is processed)."""
        import torch
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend

        fresh = [req for req in batch if req.row is None]
        rows = self.req_to_token_pool.alloc_rows(len(fresh)) if fresh else []
        if rows is None:
            raise RuntimeError("ReqToTokenPool exhausted (admission bounds running requests)")
        table = self.req_to_token_pool.req_to_token
        for req, row in zip(fresh, rows):
            req.row = row
            req.kv_len = req.prefix_len
            if req.prefix_len:
                path = self.tree_cache.path_device_indices(req.lock.node)[: req.prefix_len]
                table[row, : req.prefix_len] = path.to(table.dtype)
                self._check_kv(req, path.tolist())
        starts = [req.kv_len for req in batch]
        ends = [req.extend_end for req in batch]
        last_loc = [
            int(table[r.row, start - 1]) if start else -1 for r, start in zip(batch, starts)
        ]
        p, s = torch.tensor(starts), torch.tensor(ends)
        out = alloc_paged_token_slots_extend(
            tree_cache=self.tree_cache,
            prefix_lens=p,
            prefix_lens_cpu=p,
            seq_lens=s,
            seq_lens_cpu=s,
            last_loc=torch.tensor(last_loc),
            extend_num_tokens=int((s - p).sum()),
        )
        offset = 0
        done: list[tuple[HarnessRequest, int, int]] = []
        for req, start, end in zip(batch, starts, ends):
            slots = out[offset : offset + end - start]
            offset += end - start
            table[req.row, start:end] = slots.to(table.dtype)
            self._write(slots.tolist(), req.tokens[start:end])
            req.kv_len = end
            if end < len(req.tokens):
                continue  # the chunked request: its next chunk comes in a later round
            if self.chunked is req:
                self.chunked = None
            self.running.append(req)
            done.append((req, req.epoch, -1))
        return LaunchedBatch("extend", done, self._pages_of(batch))

    def _checkpoint(self, req: HarnessRequest) -> None:
        """``checkpoint_kv_cache`` after a prefill (SGLang 0.5.23 publishes the prompt of a
        request that keeps decoding): insert its page-aligned prompt, move the lock onto the
        node the insert ended on. The finish then inserts only the generated pages, as a
        child of the prompt's node (the tree shape the real server builds)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

        ps = self.config.page_size
        # the prompt only: in the overlap loop the next batch has written a token past it
        aligned = min(req.kv_len, len(req.tokens)) // ps * ps
        if aligned <= req.owned_len or self.config.cache == "disabled":
            return  # a disabled tree keeps nothing: the request owns all its KV to the end
        kv = self.req_to_token_pool.req_to_token[req.row, :aligned].to("cpu").long()
        key = self._key(req.tokens[:aligned])
        result = self.tree_cache.insert(
            InsertParams(key=key, value=kv.clone(), prev_prefix_len=req.owned_len)
        )
        if self.config.cache == "radix" and result.prefix_len > req.owned_len:
            self.token_to_kv_pool_allocator.free(kv[req.owned_len : result.prefix_len])
        node = self.tree_cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
        path = self.tree_cache.path_device_indices(node)
        table = self.req_to_token_pool.req_to_token
        table[req.row, req.owned_len : len(path)] = path[req.owned_len :].to(table.dtype)
        self.tree_cache.unlock(req.lock)
        req.lock = self.tree_cache.lock(node)
        req.owned_len = len(path)

    def _decode(self) -> LaunchedBatch | None:
        """One decode step; on shortage SGLang retracts requests to the queue, so do we.
        Each request's token is written into its new slot now; it joins the request's
        output when the result is processed."""
        import torch

        allocator = self.token_to_kv_pool_allocator
        table = self.req_to_token_pool.req_to_token
        if self.at_point is not None:
            self.at_point("decode")
        while self.running:
            need = self._decode_pages(self.running) * self.config.page_size
            if allocator.check_decode_capacity(num_tokens=need, tree_cache=self.tree_cache):
                break
            self._retract(self.running[-1])
        if not self.running:
            return None
        batch = list(self.running)
        seq = torch.tensor([r.kv_len + 1 for r in batch])
        last = torch.tensor([int(table[r.row, r.kv_len - 1]) for r in batch])
        out = allocator.alloc_decode(seq, seq, last)
        if out is None:
            raise RuntimeError("decode allocation failed after the capacity check passed")
        entries: list[tuple[HarnessRequest, int, int]] = []
        for req, slot in zip(batch, out.tolist()):
            token = self._next_token(req)
            table[req.row, req.kv_len] = slot
            self._write([slot], [token])
            req.kv_len += 1
            entries.append((req, req.epoch, token))
        return LaunchedBatch("decode", entries, self._pages_of(batch))

    def _decode_pages(self, batch: list[HarnessRequest]) -> int:
        return sum(1 for r in batch if r.kv_len % self.config.page_size == 0)

    def _retract(self, req: HarnessRequest) -> None:
        """``retract_decode``: give the request's own KV back and queue it again."""
        self._release(req)
        req.generated.clear()
        self.running.remove(req)
        self.waiting.insert(0, req)
        self.num_retracted += 1

    def _finish(self, req: HarnessRequest) -> None:
        """``cache_finished_req``: insert the page-aligned KV, free duplicates and the tail.

        In the overlap loop the request's KV may run one token past its output (the batch
        launched before this result was processed): that slot is freed with the tail, as
        SGLang's ``_release_overallocated_kv_indices`` does."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        ps = self.config.page_size
        kv = self.req_to_token_pool.req_to_token[req.row, : req.kv_len].to("cpu").long()
        # a disabled tree inserts nothing: SGLang's release frees the whole row
        aligned = 0 if self.config.cache == "disabled" else min(req.kv_len, len(req.seq)) // ps * ps
        result = self.tree_cache.insert(
            InsertParams(
                key=self._key(req.seq[:aligned]),
                value=kv[:aligned].clone(),
                prev_prefix_len=req.owned_len,
            )
        )
        allocator = self.token_to_kv_pool_allocator
        if self.config.cache == "radix" and result.prefix_len > req.owned_len:
            # RadixCache leaves duplicates to the caller; the unified tree frees them itself.
            allocator.free(kv[req.owned_len : result.prefix_len])
        if req.kv_len > aligned:
            allocator.free(kv[aligned:])
        self.num_overshoot_frees += req.kv_len > len(req.seq)
        self.tree_cache.unlock(req.lock)
        self.req_to_token_pool.free_rows([req.row])
        req.row, req.lock, req.done = None, None, True
        req.epoch += 1
        self.running.remove(req)
        self.finished.append(req)

    # -- the "forward": KV rows carry the token id -------------------------------------

    def _write(self, slots: list[int], tokens: list[int]) -> None:
        import torch

        index = torch.tensor(slots)
        values = torch.tensor(tokens, dtype=torch.float32).to(torch.float16)
        for layer in range(self.config.layer_num):
            self.k_buffer[layer][index, 0, 0] = values
            self.v_buffer[layer][index, 0, 0] = -values

    def _next_token(self, req: HarnessRequest) -> int:
        """The "model": a function of the request's KV as read from memory (last layer's
        K), so a page unmapped or reused under a running request changes the tokens."""
        import torch

        slots = self.req_to_token_pool.req_to_token[req.row, : req.kv_len].long()
        ids = self.k_buffer[-1][slots, 0, 0].to(torch.float64)
        weights = torch.arange(1, len(slots) + 1, dtype=torch.float64)
        return 1024 + int(torch.sum(ids * weights).item()) % 1021  # < 2048: exact in fp16

    def _check_kv(self, req: HarnessRequest, slots: list[int]) -> None:
        """A prefix hit must read back the KV its tokens wrote (fp16 holds ids < 2048 exactly)."""
        import torch

        got = self.k_buffer[-1][torch.tensor(slots), 0, 0].float().tolist()
        want = [float(torch.tensor(t, dtype=torch.float16)) for t in req.tokens[: len(slots)]]
        if got != want:
            raise AssertionError(f"request {req.rid}: cached prefix KV corrupted: {got} != {want}")

    # -- measurements ------------------------------------------------------------------

    def mapped_bytes(self) -> int:
        """Measured from the memfd (st_blocks), not from a counter."""
        return int(self.reservation.backend.mapped_bytes())

    @property
    def bundle_bytes(self) -> int:
        return int(self.reservation.backend.layout.bundle_bytes)

    def close(self) -> None:
        self.pool.close()
        self.k_buffer, self.v_buffer = [], []
        self.reservation.backend.release()
