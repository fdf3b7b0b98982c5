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
    waiting for memory). Scheduler thread; one admission round.
    """

    def _available_and_evictable(self) -> int:
        return int(self.allocator.admission_tokens(int(self.tree_cache.evictable_size())))

    def check_prefill(self, **kwargs: Any) -> tuple[bool, int | None]:
        verdict: tuple[bool, int | None] = super().check_prefill(**kwargs)
        if not verdict[0]:
            self.allocator.refused_tokens = int(kwargs["total_tokens"])
        return verdict
