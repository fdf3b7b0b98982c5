"""Keep SGLang's idle leak check truthful while a limit takes capacity away.

When fully idle, SGLang checks ``available + evictable + protected +
session_held == total`` and, with ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``
(on by default), raises on a mismatch. ``total`` is a copy of
``max_total_num_tokens`` taken when the scheduler was built, in the
invariant checker and in the (frozen) pool-stats observer, which the (frozen)
load inquirer also holds. Under a limit the
allocator's ``available`` is smaller by what the limit took away, so
:func:`sync_capacity` replaces ``total`` with the allocator's
:meth:`~ElasticTokenAllocator.capacity_tokens` right before every check: the
check stays on and still catches a real leak (a block nobody accounts for).

Thread: the scheduler thread (it rebinds scheduler attributes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["sync_capacity"]


def sync_capacity(scheduler: Any, capacity_tokens: int, page_size: int) -> None:
    """Make the leak check and the usage metrics use ``capacity_tokens`` as the total.

    The observer divides by its total (usage ratio), so at capacity 0 (limit
    0, padding page given back) it gets one page: usage reads 100%.
    """
    checker = getattr(scheduler, "invariant_checker", None)
    if checker is not None:
        checker.max_total_num_tokens = capacity_tokens
    observer = getattr(scheduler, "pool_stats_observer", None)
    observed = max(capacity_tokens, page_size)
    if observer is None or observer.max_total_num_tokens == observed:
        return
    fresh = dataclasses.replace(observer, max_total_num_tokens=observed)
    scheduler.pool_stats_observer = fresh
    for attr in ("invariant_checker", "load_inquirer"):  # they hold the observer too
        holder = getattr(scheduler, attr, None)
        if holder is None or getattr(holder, "pool_stats_observer", None) is not observer:
            continue
        if getattr(getattr(holder, "__dataclass_params__", None), "frozen", False):
            setattr(scheduler, attr, dataclasses.replace(holder, pool_stats_observer=fresh))
        else:
            holder.pool_stats_observer = fresh
