"""Issue 17, item 3: SGLang's evictable/pinned counts are kept per tree event, not rescanned.

The block allocator's evictable marks (``engine_ext/sglang/_counts.py``) must equal a full
scan of SGLang's tree (the blocks of every unlocked node) after every event, on both tree
caches, with shared prefixes, aborts, retractions and limit changes; a state refresh must
not list the tree (counted, not timed); and after traffic the figures the engine reports
are exact after one idle pass.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from sglang_support import check_counts as _check_counts

from engine_ext import count_reclaimable_pages
from engine_ext.cpu_harness import CpuHarness

pytestmark = pytest.mark.sglang

Make = Callable[..., CpuHarness]


def _check_figures(h: CpuHarness) -> None:
    reclaimer: Any = h.pool.reclaimer
    reclaimable = count_reclaimable_pages(reclaimer.scan_unlocked(), h.blocks)
    state = h.pool.state()
    bundle = h.bundle_bytes
    assert state.evictable_bytes == reclaimable * bundle
    assert state.pinned_bytes == (h.pages.num_in_use - reclaimable) * bundle
    assert state.mapped_bytes == h.mapped_bytes()


@pytest.mark.parametrize("variant", ["plain", "chunked-capped"])
@pytest.mark.parametrize("seed", range(3))
def test_counts_equal_a_full_rescan_after_every_event(
    make_harness: Make, cache_kind: str, seed: int, variant: str
) -> None:
    """Random traffic over a few shared prefixes, aborts (waiting and running), limit
    changes (retractions and evictions follow): checked after every iteration and at the
    points inside one (after admission locked its prefixes, before the decode check).
    ``chunked-capped``: prompts prefilled in 16-token chunks, passes capped at one page
    (a shrink spreads over iterations while traffic runs)."""
    if variant == "plain":
        h = make_harness(cache_kind)
    else:
        h = make_harness(cache_kind, chunked_prefill_size=16, max_evict_pages_per_step=1)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 2000) for _ in range(rng.randrange(4, 60))] for _ in range(4)]
    capacity = h.pages.num_pages * h.bundle_bytes
    h.at_point = lambda point: _check_counts(h, point)
    live: list[Any] = []
    for step in range(160):
        roll = rng.random()
        if roll < 0.35:
            base = rng.choice(prefixes) if rng.random() < 0.7 else []
            tail = [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 50))]
            live.append(h.submit(base + tail, rng.randrange(1, 10)))
        elif roll < 0.45 and live:
            h.abort(live.pop(rng.randrange(len(live))))
        elif roll < 0.52:
            limit = None if rng.random() < 0.3 else rng.randrange(0, capacity)
            h.pool.set_limit(limit)
        h.iterate()
        _check_counts(h, f"step {step}")
    h.pool.set_limit(None)
    h.run_until_idle()
    _check_counts(h, "idle")


def test_a_state_refresh_does_not_scan_the_tree(make_harness: Make, cache_kind: str) -> None:
    """Operation counts, not time: with 6 or 30 prompts cached, one request over a cached
    prefix costs the same tree work (nodes visited, blocks marked and unmarked, node slot
    tensors read), and neither the request's iterations nor the idle passes after it list
    the tree."""
    work: list[tuple[int, int, int, int]] = []
    for cached in (6, 30):
        h = make_harness(cache_kind)
        for i in range(cached):
            h.submit([(i * 53 + j * 7) % 1999 + 1 for j in range(24)], 2)
        h.run_until_idle()
        reclaimer: Any = h.pool.reclaimer
        scans = 0
        original = reclaimer._scan

        def counting_scan(original: Any = original) -> Any:
            nonlocal scans
            scans += 1
            return original()

        reclaimer._scan = counting_scan
        counts = h.pool.counts
        assert counts is not None
        before = (
            counts.num_path_nodes,
            counts.num_blocks_marked,
            counts.num_blocks_unmarked,
            counts.num_device_reads,
        )
        hits = h.num_prefix_hits
        last = cached - 1  # the most recent prompt: still cached
        h.submit([(last * 53 + j * 7) % 1999 + 1 for j in range(24)] + [5, 6, 7, 8, 9], 2)
        h.run_until_idle()
        assert h.num_prefix_hits == hits + 1
        for _ in range(5):
            h.iterate()  # idle passes: the figures stay exact without a scan
        assert scans == 0, "a state refresh listed the tree"
        _check_figures(h)  # (its reference scan comes after the count)
        after = (
            counts.num_path_nodes,
            counts.num_blocks_marked,
            counts.num_blocks_unmarked,
            counts.num_device_reads,
        )
        work.append(tuple(a - b for a, b in zip(after, before)))  # type: ignore[arg-type]
        assert counts.num_resyncs == 0
    small, large = work
    assert small == large, f"tree work grew with the tree: {small} -> {large}"
    assert small[1] > 0 and small[2] > 0  # the request's lock and unlock were seen
    # node slots read (device-to-host on GPU): only the leaves its two inserts added
    # (prompt checkpoint, finish); locks and unlocks use the host mirror
    assert small[3] <= 2, small


def test_figures_exact_one_idle_pass_after_traffic(make_harness: Make, cache_kind: str) -> None:
    """After traffic (shared prefixes, an abort, a limit that evicts): the first idle
    iteration reports exact evictable/pinned figures, with no limit and under one."""
    h = make_harness(cache_kind)
    rng = random.Random(11)
    shared = [rng.randrange(1, 2000) for _ in range(32)]
    for round_ in range(4):
        reqs = [
            h.submit(shared + [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 40))], 6)
            for _ in range(rng.randrange(2, 7))
        ]
        for _ in range(3):
            h.iterate()
        h.abort(reqs[-1])
        while h.waiting or h.running:
            h.iterate()
        h.iterate()  # one idle pass
        _check_figures(h)
        if round_ == 1:
            h.pool.set_limit(h.mapped_bytes() // 2 // h.bundle_bytes * h.bundle_bytes)
            h.iterate()
            _check_figures(h)
    _check_counts(h, "end")


def _obtainable_from_scan(h: CpuHarness) -> int:
    """``obtainable_blocks`` computed from a full scan of the tree (the reference)."""
    reclaimer: Any = h.pool.reclaimer
    blocks, pages = h.blocks, h.pages
    bpp = blocks.blocks_per_page
    unlocked: dict[int, int] = {}
    for b in reclaimer.scan_unlocked():
        unlocked[b // bpp] = unlocked.get(b // bpp, 0) + 1
    locked = [
        n
        for n in (blocks.occupancy(p) - unlocked.get(p, 0) for p in range(pages.num_pages))
        if n > 0
    ]
    cap = pages.cap_pages()
    if len(locked) <= cap:
        return max(0, cap * bpp - sum(locked))
    return max(0, sum(bpp - n for n in sorted(locked, reverse=True)[:cap]))


def test_admission_under_retired_pages_reads_the_marks_not_the_tree(
    make_harness: Make, cache_kind: str
) -> None:
    """While pages are retired (a limit below what running requests hold), admission asks
    ``obtainable_blocks`` every round: it must not list the tree (counted), and must equal
    the figure a full scan gives."""
    h = make_harness(cache_kind)
    rng = random.Random(3)
    for i in range(6):
        h.submit([(i * 41 + j * 13) % 1999 + 1 for j in range(40)], 2)
    h.run_until_idle()  # a cache to count
    reclaimer: Any = h.pool.reclaimer
    allocator = h.token_to_kv_pool_allocator
    scans = 0
    original_scan = reclaimer._scan

    def counting_scan() -> Any:
        nonlocal scans
        scans += 1
        return original_scan()

    reclaimer._scan = counting_scan
    original = allocator.obtainable_blocks
    calls: list[tuple[int, int]] = []

    def checked() -> int:
        nonlocal scans
        before = scans
        got = original()
        assert scans == before, "obtainable_blocks listed the tree"
        calls.append((got, _obtainable_from_scan(h)))
        scans = before  # the reference's own scan is not the code under test
        return got

    allocator.obtainable_blocks = checked  # type: ignore[method-assign]
    for _ in range(4):
        h.submit([rng.randrange(1, 2000) for _ in range(60)], 40)
    for _ in range(6):
        h.iterate()
    h.pool.set_limit(h.bundle_bytes * 2)  # below what the running requests hold: retired
    for _ in range(4):
        h.submit([rng.randrange(1, 2000) for _ in range(rng.randrange(8, 40))], 3)
    for _ in range(60):
        h.iterate()
    assert calls, "admission never asked while pages were retired"
    assert all(got == want for got, want in calls), calls
    h.pool.set_limit(None)
    h.run_until_idle()
    _check_counts(h, "end")
