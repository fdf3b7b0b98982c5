"""SGLang's ``flush_cache`` (``/flush_cache``, a weight update) against the adapter's allocator.

``Scheduler.flush_cache`` runs in the ingest step at the top of an iteration,
before ``get_next_batch_to_run``: ``tree_cache.reset()``,
``req_to_token_pool.clear()``, ``token_to_kv_pool_allocator.clear()``. The
pages admission promised in the previous round and did not use are released at
the next pass; a flush in between frees them first. It is reached when
``/pause_generation`` (``retract``) and ``/flush_cache`` arrive in one ingest,
as a trainer sends them back to back around a weight update (SGLang answers
the pause before the scheduler has read it).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
from sglang_support import fill, prompt

from engine_ext.cpu_harness import CpuHarness

pytestmark = pytest.mark.sglang

Make = Callable[..., CpuHarness]


def _retract_chunked(h: CpuHarness) -> None:
    """``pause_generation(mode="retract")`` on the chunked request (SGLang's ``retract_all``
    -> ``release_req``): its own KV back to the allocator, its lock and row released, the
    request queued again."""
    req = h.chunked
    assert req is not None and req.row is not None
    kv = h.req_to_token_pool.req_to_token[req.row, : req.kv_len].to("cpu").long()
    h.token_to_kv_pool_allocator.free(kv[req.owned_len :])
    h.tree_cache.unlock(req.lock)
    h.req_to_token_pool.free_rows([req.row])
    req.row, req.lock, req.kv_len, req.prefix_len, req.owned_len = None, None, 0, 0, 0
    h.chunked = None
    h.waiting.insert(0, req)


def test_flush_right_after_a_round_that_left_promised_pages(
    make_harness: Make, any_cache_kind: str
) -> None:
    h = make_harness(any_cache_kind, chunked_prefill_size=30)
    allocator = h.token_to_kv_pool_allocator
    reference = make_harness(any_cache_kind, chunked_prefill_size=30)
    expected = reference.submit(prompt(1, 100), max_new_tokens=4)
    reference.run_until_idle()

    req = h.submit(prompt(1, 100), max_new_tokens=4)
    h.iterate()  # a 28-token chunk (page-aligned end) of a 30-token budget: 8 pages promised
    assert h.chunked is req and allocator.promised_tokens > 0  # the 8th page, unused

    _retract_chunked(h)
    # Scheduler.flush_cache's memory steps, in its order
    h.tree_cache.reset()
    h.req_to_token_pool.clear()
    allocator.clear()

    h.pool.on_idle()  # the paused loop's pass (or the next iteration's): no double free
    assert h.blocks.num_allocated_blocks == 1  # the padding block only
    assert h.mapped_bytes() == h.bundle_bytes == h.pool.state().mapped_bytes  # memfd

    h.run_until_idle()  # continue_generation: the request is prefilled again and completes
    assert req.done and req.generated == expected.generated
    assert h.pool.state().mapped_bytes == h.mapped_bytes()


def _counts_bytes() -> int:
    """Bytes allocated by ``engine_ext/sglang/_counts.py`` and still alive (tracemalloc)."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*engine_ext/sglang/_counts.py")]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_repeated_flushes_do_not_grow_the_evictable_counts_memory(make_harness: Make) -> None:
    """The unified cache's hooks keep node block ids on the host; a flush drops every node
    (the Rust core never reuses an id), so what they hold must not grow flush after flush."""
    h = make_harness("unified")
    allocator = h.token_to_kv_pool_allocator

    def cycle(i: int) -> None:
        fill(h, 20, start=20 * i)
        h.tree_cache.reset()  # Scheduler.flush_cache's memory steps, in its order
        h.req_to_token_pool.clear()
        allocator.clear()
        h.iterate()

    tracemalloc.start()
    try:
        for i in range(15):  # Python's free lists fill up (freed objects stay traced there)
            cycle(i)
        early = _counts_bytes()
        for i in range(15, 45):
            cycle(i)
        late = _counts_bytes()
    finally:
        tracemalloc.stop()
    assert h.pool.counts is not None and h.pool.counts.num_resyncs == 0
    assert h.blocks.num_evictable_blocks == 0 == h.tree_cache.evictable_size()
    # 30 more flushed trees of 20 requests each: before, every node's entry stayed
    # (~10 KiB per flush)
    assert late - early < 32 << 10, (early, late)
