"""SGLang's prefill budget over the elastic allocator's admission figure.

Imported lazily (by :meth:`ElasticTokenAllocator.create_prefill_budget`):
SGLang's budget module pulls in its memory pools, which need
:func:`._cpu_imports.prepare_cpu_imports` first on a CPU-only machine.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.prefill_budget import PrefillBudget

__all__ = ["ElasticPrefillBudget"]


class ElasticPrefillBudget(PrefillBudget):  # type: ignore[misc]
    """SGLang's ``PrefillBudget`` over :meth:`ElasticTokenAllocator.admission_tokens`.

    Records the request admission refused (the demand probe reports it as
    waiting for memory) and, for an accepted one, its prefix-cache hit
    (``prefix_hit_rate``: ``input_tokens - extend_input_len`` of its
    ``input_tokens`` came from the tree cache). What admission accepts, and
    the chunked-prefill continuation SGLang schedules first (:meth:`fit_chunk`),
    is taken from the allocator at once (pages mapped), so the allocation that
    follows cannot meet a device another engine filled meanwhile. A
    continuation the device refuses waits for the next round, and so does
    every new request of this round behind it. Scheduler thread; one
    admission round.
    """

    _chunk_parked = False  # this round's continuation waits: the device refused its pages

    def _available_and_evictable(self) -> int:
        # promised blocks (taken for admissions of this round) are reserved by SGLang's own
        # offsets already: count them as available so they are not subtracted twice
        allocator = self.allocator
        admission = allocator.admission_tokens(int(self.tree_cache.evictable_size()))
        return int(admission + allocator.promised_tokens)

    def fit_chunk(
        self, *, extend_input_len: int, max_new_tokens: int, chunk_limit: int
    ) -> int | None:
        """SGLang's continuation (``PrefillAdder.add_chunked_req``): its chunk's pages are
        taken now, or it waits this round (``None``) if the device cannot back them."""
        size: int | None = super().fit_chunk(
            extend_input_len=extend_input_len,
            max_new_tokens=max_new_tokens,
            chunk_limit=chunk_limit,
        )
        if size is None:
            return None
        tokens = min(int(extend_input_len), int(size))
        allocator = self.allocator
        if allocator.promise_chunk(self.tree_cache, tokens):
            return size
        self._chunk_parked = True
        allocator.parked_chunk_tokens = tokens
        return None

    def can_allocate_prefill(
        self,
        *,
        paged_input: int,
        extend_input_len: int,
        max_new_tokens: int,
        chunk_limit: int | None,
    ) -> bool:
        """SGLang's admission for ``ignore_eos`` requests without a radix cache
        (``PrefillAdder.add_one_req_ignore_eos``, which skips :meth:`check_prefill`):
        its pages (this round's chunk) are taken the same way, or it waits."""
        allocator = self.allocator
        if self._chunk_parked:
            fits = False
            allocator.refused_by_device = True
        else:
            fits = bool(
                super().can_allocate_prefill(
                    paged_input=paged_input,
                    extend_input_len=extend_input_len,
                    max_new_tokens=max_new_tokens,
                    chunk_limit=chunk_limit,
                )
            )
        if fits:
            extend = int(extend_input_len)
            if chunk_limit is not None:
                extend = min(extend, int(chunk_limit))
            allocator.evict_to_free_tokens(self.tree_cache, extend)
            if not allocator.promise(-(-extend // allocator.page_size)):
                allocator.refused_by_device = True
                fits = False
        if not fits:
            allocator.refused_tokens = int(paged_input)
            allocator.refused_input_tokens = int(extend_input_len)
        return fits

    def check_prefill(self, **kwargs: Any) -> tuple[bool, int | None]:
        allocator = self.allocator
        input_tokens = int(kwargs["input_tokens"])
        if self._chunk_parked:  # the continuation goes first once the device has room
            verdict: tuple[bool, int | None] = (False, None)
            allocator.refused_by_device = True
        else:
            verdict = super().check_prefill(**kwargs)
        if verdict[0]:
            # Map the pages its prefill takes now (this round's chunk only, when chunked):
            # a device that fills before the allocation (another engine) refuses the
            # admission here instead of failing the allocation ("Prefill out of memory"
            # ends SGLang's scheduler).
            extend = int(kwargs["extend_input_len"])
            if verdict[1] is not None:
                extend = min(extend, int(verdict[1]))
            allocator.evict_to_free_tokens(self.tree_cache, extend)
            if not allocator.promise(-(-extend // allocator.page_size)):
                allocator.refused_by_device = True
                verdict = (False, None)
        if not verdict[0]:
            allocator.refused_tokens = int(kwargs["total_tokens"])
            allocator.refused_input_tokens = input_tokens
        else:
            allocator.hits.record(input_tokens - int(kwargs["extend_input_len"]), input_tokens)
        return verdict
