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
    ``input_tokens`` came from the tree cache). Scheduler thread; one
    admission round.
    """

    def _available_and_evictable(self) -> int:
        # promised blocks (taken for admissions of this round) are reserved by SGLang's own
        # offsets already: count them as available so they are not subtracted twice
        allocator = self.allocator
        admission = allocator.admission_tokens(int(self.tree_cache.evictable_size()))
        return int(admission + allocator.promised_tokens)

    def check_prefill(self, **kwargs: Any) -> tuple[bool, int | None]:
        verdict: tuple[bool, int | None] = super().check_prefill(**kwargs)
        allocator = self.allocator
        input_tokens = int(kwargs["input_tokens"])
        if verdict[0]:
            # Map the pages its prefill takes now: a device that fills before the
            # allocation (another engine) refuses the admission here instead of failing
            # the allocation ("Prefill out of memory" ends SGLang's scheduler).
            extend = int(kwargs["extend_input_len"])
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
