"""Issue 16/17: one pass reaches the limit, evicts about what the limit needs, and the
evictable/pinned figures are exact after one idle pass.

The cache is filled the way the real server fills it (``tests/e2e/test_sglang_serve.py``):
one 601-token document and eight 151-token prompts, each run to completion; SGLang
0.5.23 checkpoints each prompt after its prefill, so every request leaves a prompt node
with a small generated leaf under it. Idle iterations run SGLang's order: the
``get_next_batch_to_run`` pass, then ``on_idle``. Mapped bytes come from the memfd.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine_ext import EngineSettings, count_reclaimable_pages
from engine_ext.cpu_harness import CpuHarness, HarnessConfig
from engine_ext.protocol import Status

pytestmark = pytest.mark.sglang

Make = Callable[..., CpuHarness]


@pytest.fixture
def make_big(tmp_path: Path) -> Callable[[str], CpuHarness]:
    made: list[CpuHarness] = []

    def make(cache: str) -> CpuHarness:
        harness = CpuHarness(
            EngineSettings(enable=True, runtime_dir=tmp_path / "run", instance_id=f"e{len(made)}"),
            HarnessConfig(cache=cache, max_tokens=4092, max_context=2048),
        )
        made.append(harness)
        return harness

    yield make  # type: ignore[misc]
    for harness in made:
        harness.close()


def _fill(h: CpuHarness, seed: int) -> None:
    rng = random.Random(seed)
    for length in [601] + [151] * 8:
        h.submit([rng.randrange(1, 2000) for _ in range(length)], max_new_tokens=4)
        h.run_until_idle()


def _idle_iteration(h: CpuHarness) -> None:
    """An idle iteration of SGLang's loop: ``get_next_batch_to_run`` (a pass), ``on_idle``."""
    h.pool.before_schedule()
    h.on_idle()


def _unlocked_slots(h: CpuHarness) -> set[int]:
    """Every token slot of an unlocked tree node, read from SGLang's tree directly."""
    if h.config.cache == "unified":
        walk = h.tree_cache.tree_core.walk_for_kv_canary(True, False)
        return {int(s) for s in walk.slot_indices.tolist()}
    out: set[int] = set()
    stack = list(h.tree_cache.root_node.children.values())
    while stack:
        node = stack.pop()
        if node.lock_ref == 0 and node.value is not None:
            out.update(int(s) for s in node.value.tolist())
        stack.extend(node.children.values())
    return out


@pytest.mark.parametrize("seed", [3, 11])
@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.2])
def test_an_idle_limit_is_applied_by_one_pass(
    make_big: Callable[[str], CpuHarness], cache_kind: str, fraction: float, seed: int
) -> None:
    h = make_big(cache_kind)
    _fill(h, seed)
    full = h.pool.state()
    bundle = h.bundle_bytes
    limit = int(full.mapped_bytes * fraction) // bundle * bundle
    h.pool.set_limit(limit)
    _idle_iteration(h)
    state = h.pool.state()
    assert state.status is Status.APPLIED, state
    assert state.passes - full.passes == 1
    assert state.mapped_bytes == h.mapped_bytes() <= limit
    if fraction >= 0.5:  # only what the limit needed went (0.2 may take the document)
        assert h.tree_cache.evictable_size() > 0


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_a_one_bundle_cut_evicts_about_one_bundle(
    make_big: Callable[[str], CpuHarness], cache_kind: str, seed: int
) -> None:
    """Page-aware: the 601-token document is one node of ~37 bundles; evicting it whole
    (what the reclaimer did before) freed 36 bundles for a cut of one."""
    h = make_big(cache_kind)
    _fill(h, seed)
    bpp = h.blocks.blocks_per_page
    ps = h.config.page_size
    full = h.mapped_bytes()
    kept_before = h.tree_cache.evictable_size()
    h.pool.set_limit(full - h.bundle_bytes)
    _idle_iteration(h)
    assert h.pool.state().status is Status.APPLIED
    freed_bundles = (full - h.mapped_bytes()) // h.bundle_bytes
    evicted_blocks = (kept_before - h.tree_cache.evictable_size()) // ps
    assert evicted_blocks == h.pool.reclaimer.num_evicted_blocks
    if cache_kind == "radix":  # leaves split at the page boundary: a page's worth
        assert freed_bundles == 1 and evicted_blocks <= 2 * bpp
    else:  # the Rust core cannot split: whole leaves, the smallest that free a page
        assert freed_bundles <= 12 and evicted_blocks <= 12 * bpp  # the document is 37
    assert h.tree_cache.evictable_size() >= kept_before - 12 * bpp * ps


def test_a_half_cut_evicts_close_to_the_minimum(
    make_big: Callable[[str], CpuHarness], cache_kind: str
) -> None:
    h = make_big(cache_kind)
    _fill(h, 5)
    bpp = h.blocks.blocks_per_page
    full = h.mapped_bytes()
    limit = full // 2 // h.bundle_bytes * h.bundle_bytes
    h.pool.set_limit(limit)
    _idle_iteration(h)
    needed_blocks = (full - limit) // h.bundle_bytes * bpp
    evicted = h.pool.reclaimer.num_evicted_blocks
    slack = 1.1 if cache_kind == "radix" else 1.5  # whole leaves: one leaf's overshoot
    assert h.mapped_bytes() <= limit and evicted <= slack * needed_blocks


def test_figures_are_exact_after_one_idle_iteration_following_traffic(
    make_harness: Make, cache_kind: str
) -> None:
    """Evictable/pinned (issue 17, item 3): exact after traffic and one idle iteration,
    under a limit and without, checked against SGLang's tree read directly."""
    h = make_harness(cache_kind)
    rng = random.Random(7)
    bundle = h.bundle_bytes

    def check() -> None:
        slots = _unlocked_slots(h)
        unlocked = {s // h.config.page_size for s in slots}
        reclaimable = count_reclaimable_pages(unlocked, h.blocks)
        state = h.pool.state()
        assert state.evictable_bytes == reclaimable * bundle
        assert state.pinned_bytes == (h.pages.num_in_use - reclaimable) * bundle
        assert state.mapped_bytes == h.mapped_bytes()

    for round_ in range(6):
        for _ in range(rng.randrange(1, 8)):
            length = rng.randrange(8, 120)
            h.submit([rng.randrange(1, 2000) for _ in range(length)], rng.randrange(1, 9))
        while h.waiting or h.running:
            h.iterate()
        _idle_iteration(h)
        check()
        if round_ == 2:
            h.pool.set_limit(h.mapped_bytes() // 2 // bundle * bundle)
            _idle_iteration(h)
            check()
        if round_ == 4:
            h.pool.set_limit(None)
            _idle_iteration(h)
            check()


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_one_pass_applies_whenever_the_cache_can_cover_the_cut(
    make_big: Callable[[str], CpuHarness], cache_kind: str, seed: int
) -> None:
    """Random trees (shared prefixes of random depth, random lengths), some requests
    still running (locked), random limits: after one pass either the limit is met or no
    page is left whose every block is unlocked (nothing more eviction could free). The
    running requests' KV stays intact (their tokens are computed from it), and SGLang's
    strict idle leak check runs at every idle iteration."""
    h = make_big(cache_kind)
    rng = random.Random(seed)
    bundle = h.bundle_bytes
    prefixes = [[rng.randrange(1, 2000) for _ in range(rng.randrange(4, 90))] for _ in range(4)]

    def request() -> list[int]:
        head = rng.choice(prefixes)[: rng.randrange(0, 90)] if rng.random() < 0.7 else []
        return head + [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 120))]

    for _round in range(5):
        h.pool.set_limit(None)
        for _ in range(rng.randrange(3, 12)):
            h.submit(request(), rng.randrange(1, 6))
        h.run_until_idle()
        runners = [h.submit(request(), 40) for _ in range(rng.randrange(0, 3))]
        for _ in range(2):
            h.iterate()  # admitted and prefilled: they hold (lock) their KV
        before = h.pool.state()
        limit = rng.randrange(0, max(1, before.mapped_bytes // bundle)) * bundle
        h.pool.set_limit(limit)
        h.pool.before_schedule()  # one pass
        state = h.pool.state()
        assert state.passes - before.passes == 1
        if state.status is not Status.APPLIED:
            slots = _unlocked_slots(h)
            unlocked = {s // h.config.page_size for s in slots}
            assert count_reclaimable_pages(unlocked, h.blocks) == 0, state
            assert state.reason == "running_requests"
        assert state.mapped_bytes == h.mapped_bytes()
        for req in runners:
            if not req.done:
                h.abort(req)  # a client gone: SGLang finishes it as aborted
        h.run_until_idle()
