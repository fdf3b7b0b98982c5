"""SGLang's paged token-to-KV allocator, backed by a kvsidecar :class:`BlockAllocator`.

SGLang page *p* (``page_size`` token slots) is block *p* of the block
allocator; an allocator *page* (the unit that is mapped and unmapped) is a
run of ``blocks_per_page`` SGLang pages. The class keeps SGLang's interface
and kernels: each allocation takes exactly the blocks it needs from the
block allocator, hands them to the parent's code as its free list, and
leaves the free list empty again. Frees go back to the block allocator, so
a page whose last block is freed is unmapped (retired pages) or kept as
reserve at once.

Admission = allocation (what SGLang's ``PrefillBudget`` counts is what an
allocation under the current limit can get):

* :meth:`available_size` is exactly what an allocation could get *now*
  without evicting: free blocks on mapped, non-retired pages plus pages
  mappable under the target. Never negative.
* While no page is retired, evicting a cached block frees exactly one block,
  so SGLang's ``available + evictable`` is exact. While pages are retired
  (a shrink is deferred, e.g. with ``max_evict_pages_per_step``), evicting a
  block on a retired page frees nothing, and emptying a page un-retires
  another one that brings its own blocks back into service (so evicting can
  even *lower* what is available). The budget
  (:class:`._budget.ElasticPrefillBudget`) then counts ``min(available +
  evictable, obtainable)``, *obtainable* being a lower bound of what is
  free once every unlocked cache block is evicted (:meth:`obtainable_blocks`),
  and :meth:`evict_to_free_tokens` keeps evicting until the allocation fits
  or nothing is left, so the promise is always kept.
* Running requests are never retracted *because of* a limit: a decode (and,
  as a last resort, a prefill SGLang forces through, such as a chunked
  continuation) that cannot be served under the target is served above it,
  while physical capacity lasts (:meth:`_take_over_target`); the pages above
  the target are retired and the coordinator reports ``running_requests``.
* :meth:`capacity_tokens` is the total the idle leak check must use in place
  of the configured ``max_total_num_tokens``: configured capacity minus what
  a limit took away (see :mod:`._accounting`).

Thread: the scheduler thread only (the block allocator's guard enforces it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.utils.common import get_num_new_pages

from allocator import BackendError

from .._hit_window import PrefixHitWindow

if TYPE_CHECKING:
    from allocator import BlockAllocator

    from ._budget import ElasticPrefillBudget

__all__ = ["ElasticTokenAllocator"]

_log = logging.getLogger("engine_ext.sglang")

_NONE: frozenset[int] = frozenset()  # obtainable_blocks' source when the marks count
PADDING_BLOCK = 0  # SGLang page 0 absorbs padded writes; never handed out


class ElasticTokenAllocator(PagedTokenToKVPoolAllocator):  # type: ignore[misc]
    """A ``PagedTokenToKVPoolAllocator`` whose pages are blocks of a :class:`BlockAllocator`.

    Owns the padding block (held while work may run; given back when the
    scheduler is fully idle under a limit that needs its page) and the
    mapping between SGLang page ids and block ids (the identity). Does not
    own the block allocator's life cycle. Scheduler thread only.
    """

    def __init__(
        self,
        blocks: BlockAllocator,
        *,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
    ) -> None:
        self.blocks = blocks
        self._padding_held = False
        self._initialized = False  # clear() ran once (the constructor calls it)
        self._before_alloc: Callable[[], None] | None = None
        self._unlocked_blocks: Callable[[], frozenset[int]] | None = None
        self._obtainable_key: tuple[int, ...] | None = None
        self._obtainable_source: frozenset[int] = frozenset()
        self._obtainable = 0
        self.num_failed_allocs = 0  # allocations that returned None (SGLang then waits/evicts)
        self.num_allocs = 0  # successful block allocations (change detection for reclaimers)
        self.num_frees = 0  # block frees (change detection for reclaimers)
        self.num_overdraft_blocks = 0  # blocks served above the target (running requests)
        self.num_prefill_overdrafts = 0  # prefill allocations served above it (last resort)
        self.num_decode_shortages = 0  # decode capacity checks that failed (SGLang retracts)
        # demand, refreshed by each admission round (see ElasticPrefillBudget.check_prefill)
        self.refused_tokens = 0  # tokens of the request admission just refused (0: none)
        self.refused_input_tokens = 0  # ... its sequence length (to find it in the queue)
        self.refused_by_device = False  # ... because the device, not the limit, was full
        # tokens of the chunked-prefill continuation this round could not schedule because
        # the device refused its pages (0: none); it waits for the next round
        self.parked_chunk_tokens = 0
        self.num_device_refusals = 0  # admissions/decodes/continuations refused for device memory
        # Blocks taken (pages mapped) when admission or the decode check said yes, so the
        # allocation that follows cannot find the device full (another engine may take the
        # memory in between); the allocations use them first, the next pass frees the rest.
        self._promised: list[int] = []
        self.hits = PrefixHitWindow()  # prefix_hit_rate: accepted admissions' cache hits
        size = (blocks.num_blocks - 1) * page_size
        # need_sort (PD staging) is not used: freed pages go back to the block allocator at once.
        super().__init__(size, page_size, dtype, device, kvcache, need_sort=False)

    # -- wiring (before the scheduler runs) ------------------------------------------

    def set_before_alloc(self, hook: Callable[[], None] | None) -> None:
        """Called at the top of every allocation; it must never take a new target
        (see :mod:`._runtime`): the pool only makes sure its first pass ran."""
        self._before_alloc = hook

    def set_unlocked_blocks(self, scan: Callable[[], frozenset[int]] | None) -> None:
        """Every cache block SGLang could evict (unlocked tree nodes); the same object
        while nothing changed (the reclaimer caches it)."""
        self._unlocked_blocks = scan

    # -- accounting --------------------------------------------------------------------

    def available_size(self) -> int:
        """Token slots an allocation could get now, under the current limit, without evicting.

        0 while the padding page is given back (idle under a limit): nothing
        is admitted until :meth:`claim_padding` succeeded.
        """
        if not self._padding_held:
            return 0
        return int(self.blocks.num_free_blocks * self.page_size)

    def admission_tokens(self, evictable_tokens: int) -> int:
        """What admission may count as available (``PrefillBudget``'s available + evictable).

        ``available + evictable`` while no page is retired (exact then); else
        at most what allocation is sure to get: now, or after evicting every
        unlocked block (evicting may lower what is available now, see the
        module doc). Never more than ``available + evictable``.
        """
        if not self._padding_held:
            return 0
        available = self.available_size()
        stock = available + evictable_tokens
        if not self.blocks.num_retired_blocks or self._unlocked_blocks is None:
            return stock
        # Not max(available, obtainable): SGLang evicts for its conservative estimate (one
        # page per request more than it may need), and a partial eviction can *lower*
        # available here; only "after evicting everything" is sure.
        return int(min(stock, self.obtainable_blocks() * self.page_size))

    def obtainable_blocks(self) -> int:
        """A lower bound of the free blocks once every unlocked cache block is evicted.

        Pages still holding locked blocks stay in use. If they fit under the
        cap, the free blocks are the cap's blocks minus the locked ones; else
        ``in use - cap`` of them stay retired and only the others take blocks:
        counted as the cap's *fullest* pages, the least room any choice leaves.
        Cached by the allocator's and the tree's change counters; when they moved,
        :meth:`BlockAllocator.free_after_eviction`: O(pages) in C from the
        evictable marks (:mod:`._counts`), or O(tree) from the reclaimer's scan
        without them. Asked only while a page is retired.
        """
        blocks = self.blocks
        pages = blocks.pages
        tracked = blocks.tracks_evictable  # the tree's unlocked blocks are marked (._counts)
        scan = self._unlocked_blocks
        source = scan() if scan is not None and not tracked else _NONE
        key = (
            self.num_allocs,
            self.num_frees,
            pages.num_retired,
            pages.num_mapped,
            pages.cap_pages(),
            blocks.changes if tracked else 0,  # every mark/unmark counts as a change
        )
        if key == self._obtainable_key and source is self._obtainable_source:
            return self._obtainable
        # O(pages) in C, not a Python loop over pages (bench/bench_scale.py)
        self._obtainable = blocks.free_after_eviction(
            pages.cap_pages(), None if tracked else source
        )
        self._obtainable_key, self._obtainable_source = key, source
        return self._obtainable

    def capacity_tokens(self) -> int:
        """Token capacity under the current limit (what the leak check's total must be)."""
        if not self._padding_held:
            return 0  # released only with nothing else allocated: nothing to account for
        usable = self.blocks.num_free_blocks + self.blocks.num_allocated_blocks - 1
        return int(usable * self.page_size)

    # -- SGLang's admission and eviction entry points ------------------------------------

    def create_prefill_budget(
        self, tree_cache: Any, *, num_mixed_decode_tokens: int = 0
    ) -> ElasticPrefillBudget:
        """SGLang's ``PrefillBudget`` counting :meth:`admission_tokens` (a new admission round)."""
        from ._budget import ElasticPrefillBudget

        self.refused_tokens = 0
        self.refused_input_tokens = 0
        self.refused_by_device = False
        self.parked_chunk_tokens = 0
        return ElasticPrefillBudget(
            self, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens
        )

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        """Evict unlocked cache until ``num_tokens`` can be allocated, or nothing is left.

        Unlike the stock single pass, this loops: with retired pages an
        evicted token does not always free a token (see the module doc).
        """
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        shortfall = num_tokens - self.available_size()
        if shortfall <= 0:
            return
        tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall))
        while (shortfall := num_tokens - self.available_size()) > 0:
            result = tree_cache.evict(EvictParams(num_tokens=max(shortfall, self.page_size)))
            if not result.num_tokens_evicted:
                return

    def check_decode_capacity(
        self, *, num_tokens: int, tree_cache: Any, requests: Any = None, spec_algorithm: Any = None
    ) -> bool:
        """Room for the next decode step: under the limit after evicting, else above it
        (running requests finish above a limit rather than being retracted for it)."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        pages = -(-num_tokens // self.page_size)
        if self.available_size() >= num_tokens:
            if self.promise(pages):
                return True
            # promise() counted a device refusal already
        elif self._padding_held and self._physical_free_blocks() * self.page_size >= num_tokens:
            over = self._take_over_target(pages)
            if over is not None:
                self._promised.extend(int(b) for b in over.tolist())
                return True
            if self.blocks.refused_by_device:
                self.num_device_refusals += 1
        self.num_decode_shortages += 1  # SGLang retracts: the device is full, not the limit
        return False

    def promise(self, num_pages: int) -> bool:
        """Take ``num_pages`` blocks now for an allocation admission or the decode check
        just allowed (mapping their pages): False if the device cannot back them.

        The allocation that follows takes promised blocks first, so a device that fills
        in between (another engine) cannot fail it; :meth:`release_promises` (the next
        pass) frees what it did not use.
        """
        if num_pages <= 0:
            return True
        got = self.blocks.alloc(num_pages)
        if got is None:
            if self.blocks.refused_by_device:
                self.num_device_refusals += 1
            return False
        self._promised.extend(got)
        return True

    def promise_chunk(self, tree_cache: Any, num_tokens: int) -> bool:
        """Take the pages of a chunked-prefill continuation when SGLang schedules it.

        SGLang gives a continuation no admission check (it forces it through so
        the request progresses), so without this its allocation is the first to
        meet a device another engine filled, and fails ("Prefill out of memory").
        Here it takes its pages first: under the limit after evicting, else above
        it (a running request, as :meth:`alloc_extend` would serve it). False only
        when the device refused the pages: the continuation waits a round.
        """
        tokens = int(num_tokens)
        if tokens <= 0:
            return True
        self.evict_to_free_tokens(tree_cache, tokens)
        pages = -(-tokens // self.page_size)
        if self.available_size() >= pages * self.page_size:
            if self.promise(pages):
                return True
            if self.blocks.refused_by_device:
                return False  # promise() counted it
        if self._padding_held and self._physical_free_blocks() >= pages:
            over = self._take_over_target(pages)
            if over is not None:
                self._promised.extend(int(b) for b in over.tolist())
                self._note_prefill_overdraft("a chunked-prefill continuation", pages)
                return True
            if self.blocks.refused_by_device:
                self.num_device_refusals += 1
                return False
        return True  # no room even without a limit: SGLang's own allocation decides, as before

    @property
    def promised_tokens(self) -> int:
        """Token slots taken by :meth:`promise` and not allocated yet."""
        return len(self._promised) * int(self.page_size)

    def release_promises(self) -> None:
        """Top of a scheduler iteration / idle: free the promised blocks nothing used."""
        if self._promised:
            promised, self._promised = self._promised, []
            self._free_blocks(promised)

    def get_all_free_pages(self) -> torch.Tensor:
        """Not enumerable (free pages are virtual until mapped); an empty census."""
        return self.free_pages

    # -- the padding page --------------------------------------------------------------

    @property
    def padding_held(self) -> bool:
        """Whether block 0 (SGLang's padding page) is held, i.e. forward passes may run."""
        return self._padding_held

    def release_padding(self) -> bool:
        """Give the padding page back when nothing else is allocated (fully idle, limit 0)."""
        if not self._padding_held or self.blocks.num_allocated_blocks != 1:
            return False
        self._free_blocks([PADDING_BLOCK])
        self._padding_held = False
        return True

    def claim_padding(self) -> bool:
        """Hold the padding page again before work is admitted; False if the limit forbids it."""
        if self._padding_held:
            return True
        try:
            claim_block(self.blocks, PADDING_BLOCK)
        except RuntimeError:
            return False
        self.num_allocs += 1
        self._padding_held = True
        return True

    # -- allocation --------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        self._step()
        pages = self._take(need_size // self.page_size)
        if pages is None:
            return None
        return self._run_with(pages, lambda: super(ElasticTokenAllocator, self).alloc(need_size))

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        self._step()
        needed = int(
            get_num_new_pages(
                seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
            )
        )
        pages = self._take(needed)
        if pages is None:
            pages = self._take_over_target(needed)
            if pages is None:
                return None
            self._note_prefill_overdraft(
                "a prefill SGLang admitted without budget (e.g. a chunked continuation)", needed
            )
        parent = super().alloc_extend
        return self._run_with(
            pages,
            lambda: parent(
                prefix_lens,
                prefix_lens_cpu,
                seq_lens,
                seq_lens_cpu,
                last_loc,
                extend_num_tokens,
                num_new_pages=needed,
            ),
        )

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        self._step()
        needed = int(
            get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
        )
        pages = self._take(needed)
        if pages is None:
            pages = self._take_over_target(needed)  # a running request: above the limit
            if pages is None:
                return None
        parent = super().alloc_decode
        return self._run_with(pages, lambda: parent(seq_lens, seq_lens_cpu, last_loc))

    # -- freeing -----------------------------------------------------------------------

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        ids: list[int] = []
        for chunk in page_ids:
            ids.extend(int(p) for p in chunk.tolist())
        if PADDING_BLOCK in ids:
            raise ValueError("SGLang freed the padding page 0; it is never allocated")
        self._free_blocks(ids)

    def clear(self) -> None:
        """First call (construction): hold the padding page. Later (``flush_cache``):
        free every block but the padding page, the promised ones included."""
        if not self._initialized:
            if not self.blocks.is_allocated(PADDING_BLOCK):  # placed pools claim it earlier
                claim_block(self.blocks, PADDING_BLOCK)
            self._padding_held = self._initialized = True
        else:
            # promised blocks are among those freed here: forget them, or the next pass's
            # release_promises frees them a second time (a flush lands between a round that
            # left promises and that pass: pause_generation(retract) + flush_cache in one ingest)
            self._promised = []
            held = [b for b in range(1, self.blocks.num_blocks) if self.blocks.is_allocated(b)]
            if held:
                self._free_blocks(held)
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_group = None
        self.free_page_ids_group: list[torch.Tensor] = []
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0

    # -- internals ---------------------------------------------------------------------

    def _step(self) -> None:
        if self._before_alloc is not None:
            self._before_alloc()
        self.claim_padding()

    def _free_blocks(self, ids: list[int]) -> None:
        if ids:
            try:
                self.blocks.free(ids)
            except BackendError as exc:
                # the blocks are free; a page that failed to unmap is out of service,
                # counted as mapped and retried by the limit pass (raising here would end
                # SGLang's scheduler)
                _log.warning("kvsidecar: %s", exc)
            self.num_frees += 1

    def _take(self, num_pages: int) -> torch.Tensor | None:
        promised = self._promised
        if promised:  # what admission / the decode check took for this allocation
            have = min(num_pages, len(promised))
            taken = promised[:have]
            del promised[:have]
            if have < num_pages:
                more = self.blocks.alloc(num_pages - have)
                if more is None:
                    promised[:0] = taken
                    self.num_failed_allocs += 1
                    return None
                taken += more
            self.num_allocs += 1
            return torch.tensor(taken, dtype=torch.int64, device=self.device)
        got = self.blocks.alloc(num_pages)
        if got is None:
            self.num_failed_allocs += 1
            return None
        self.num_allocs += 1
        return torch.tensor(got, dtype=torch.int64, device=self.device)

    def _physical_free_blocks(self) -> int:
        """Blocks an allocation could get with no target (the device's capacity)."""
        return int(self.blocks.num_blocks - self.blocks.num_allocated_blocks)

    def _take_over_target(self, num_pages: int) -> torch.Tensor | None:
        """``num_pages`` blocks above the target, for requests already running.

        The target is lifted for this call only and put back at once: the pages
        now above it are retired (no new blocks; unmapped when they empty) and the
        coordinator reports the overage. Runs while a limit is short, or with no
        limit while the allocator holds at what is mapped after a device refusal
        (``DEVICE_RETRY_S``): lifting the target also lifts that hold, so the device
        is asked again, and nothing is above a limit (not counted as an overdraft).
        """
        if not self._padding_held or self._physical_free_blocks() < num_pages:
            self.num_failed_allocs += 1
            return None
        limited = self.blocks.pages.target_pages is not None
        got = self.blocks.alloc_above_target(num_pages)
        if got is None:
            self.num_failed_allocs += 1
            return None
        self.num_allocs += 1
        if limited:
            self.num_overdraft_blocks += num_pages
        return torch.tensor(got, dtype=torch.int64, device=self.device)

    def _note_prefill_overdraft(self, what: str, num_pages: int) -> None:
        """A prefill got its pages from :meth:`_take_over_target`: above the KV limit
        (counted, a warning), or with no limit set only past the device hold (debug)."""
        if self.blocks.pages.target_pages is None:
            _log.debug(
                "kvsidecar: %s took %d page(s) past the device hold (no KV limit set; the "
                "device was asked again before the hold ended)",
                what,
                num_pages,
            )
            return
        self.num_prefill_overdrafts += 1
        _log.warning(
            "kvsidecar: %s took %d page(s) above the KV limit (a running request is "
            "served, not retracted)",
            what,
            num_pages,
        )

    def _run_with(
        self, pages: torch.Tensor, call: Callable[[], torch.Tensor | None]
    ) -> torch.Tensor | None:
        """Run the parent's allocation with exactly ``pages`` as its free list."""
        self.free_pages = pages
        try:
            out = call()
        except BaseException:
            self.free_pages = self.free_pages[:0]
            self._free_blocks(pages.tolist())
            raise
        left = self.free_pages
        self.free_pages = pages[:0]
        if out is None or len(left):
            # Cannot happen (we computed the parent's exact page count); never leak a block.
            self._free_blocks(left.tolist() if out is not None else pages.tolist())
            if out is None:
                self.num_failed_allocs += 1
        return out


def claim_block(blocks: BlockAllocator, wanted: int) -> None:
    """Allocate exactly block ``wanted`` (at start-up; gives back what it took on the way)."""
    taken: list[int] = []
    try:
        while True:
            got = blocks.alloc(1)
            if got is None:
                raise RuntimeError(f"block {wanted} could not be allocated: the pool is full")
            if got[0] == wanted:
                return
            taken.append(got[0])
    finally:
        if taken:
            blocks.free(taken)
