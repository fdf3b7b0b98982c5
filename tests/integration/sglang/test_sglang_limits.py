"""Issue 6 acceptance: limits on SGLang's real tree caches, allocator path and leak check.

Mapped bytes are measured from the memfd behind the KV tensors (HostBackend),
never taken from a counter. Every idle pass runs SGLang's strict idle leak
check (``SchedulerInvariantChecker``), which raises on a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sglang_support import fill, prompt
from support.threads import in_foreign_thread

from engine_ext.cpu_harness import CpuHarness
from engine_ext.protocol import Status

pytestmark = pytest.mark.sglang

Make = Callable[..., CpuHarness]


def test_reference_scenario_idle_then_traffic(make_harness: Make, cache_kind: str) -> None:
    h = make_harness(cache_kind)
    bundle = h.bundle_bytes
    fill(h, 30)
    filled = h.mapped_bytes()
    assert filled >= 30 * bundle and h.tree_cache.evictable_size() > 0

    limit = 10 * bundle
    published = h.pool.set_limit(limit)
    assert published.status is Status.DEFERRED
    assert h.mapped_bytes() == filled  # publishing never evicts

    h.on_idle()  # one idle pass of the wrapped on_idle
    state = h.pool.state()
    assert state.status is Status.APPLIED and state.limit_bytes == limit
    assert state.mapped_bytes == h.mapped_bytes() <= limit
    assert h.tree_cache.evictable_size() > 0  # only what the limit needed went

    # Traffic: cache hits on what survived, misses, and new prompts.
    reqs = [h.submit(prompt(i), max_new_tokens=6) for i in range(30, 46)]
    h.run_until_idle()
    repeats = [h.submit(prompt(i), max_new_tokens=3) for i in range(44, 46)]
    h.run_until_idle()
    assert all(r.done for r in reqs + repeats)
    assert all(r.prefix_len > 0 for r in repeats)  # tree hits; their KV was read back
    state = h.pool.state()
    assert state.status is Status.APPLIED
    assert h.mapped_bytes() <= limit and state.mapped_bytes == h.mapped_bytes()


def test_without_reclaim_mapped_stays_above(make_harness: Make, cache_kind: str) -> None:
    h = make_harness(cache_kind, reclaim=False)
    fill(h, 30)
    before = h.mapped_bytes()
    h.pool.set_limit(10 * h.bundle_bytes)
    for _ in range(3):
        h.on_idle()
    state = h.pool.state()
    assert state.status is Status.DEFERRED and state.reason == "reclaim_disabled"
    assert h.mapped_bytes() == before > 10 * h.bundle_bytes
    assert state.overage_bytes == before - 10 * h.bundle_bytes


def test_locked_prefix_is_never_evicted_and_is_the_deferred_reason(
    make_harness: Make, cache_kind: str
) -> None:
    h = make_harness(cache_kind)
    fill(h, 12)
    shared = prompt(3)  # cached by fill
    # 41 tokens: the 40 cached ones are a hit, and 3 decode steps fit the last page,
    # so the runner needs no new page under the limit (a runner that does is retracted
    # by SGLang's decode path, as without kvsidecar).
    runner = h.submit(shared + [7], max_new_tokens=3)
    h.iterate()  # admitted: prefix matched and locked, prefill allocated
    assert runner in h.running and runner.prefix_len == 40
    held_slots = h.req_to_token_pool.req_to_token[runner.row, : runner.kv_len].tolist()
    held_pages = {s // h.config.page_size for s in held_slots}

    h.pool.set_limit(0)
    h.iterate()  # the pass at the top of the iteration evicts all it may
    state = h.pool.state()
    assert state.status is Status.DEFERRED and state.reason == "running_requests"
    assert state.overage_bytes == h.mapped_bytes() > 0
    assert state.pinned_bytes > 0 and state.evictable_bytes == 0
    assert all(h.blocks.is_allocated(p) for p in held_pages)  # nothing of the runner went
    assert h.tree_cache.protected_size() >= runner.prefix_len

    h.run_until_idle()  # the runner finishes; its prefix KV was checked when it was reused
    assert runner.done
    h.idle_until(lambda: h.pool.state().status is Status.APPLIED)
    state = h.pool.state()
    assert state.status is Status.APPLIED and h.mapped_bytes() == 0 == state.mapped_bytes


def test_leak_check_stays_on_through_shrinks_and_growths(
    make_harness: Make, cache_kind: str
) -> None:
    from sglang.srt.environ import envs

    assert envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.get()  # strict: a leak raises
    h = make_harness(cache_kind)
    configured = h.max_total_num_tokens
    bundle = h.bundle_bytes
    for round_, limit in enumerate([12, 30, 5, None, 8, 64, 4, 0]):
        if limit != 0:  # under limit 0 requests wait (tested below)
            fill(h, 6, start=round_ * 6)
        h.pool.set_limit(None if limit is None else limit * bundle)
        h.on_idle()  # runs SGLang's pool + req-pool checks after the pass
        checker_total = h.invariant_checker.max_total_num_tokens
        assert checker_total == h.token_to_kv_pool_allocator.capacity_tokens()
        stats = h.pool_stats_observer.get_pool_stats()
        assert (
            stats.full_available_size + stats.full_evictable_size + h.tree_cache.protected_size()
            == checker_total
        )
        if limit is None:
            assert checker_total == configured
        # every holder of SGLang's (frozen) pool-stats observer sees the same one
        assert h.load_inquirer.pool_stats_observer is h.pool_stats_observer
        assert h.invariant_checker.pool_stats_observer is h.pool_stats_observer
    # The check is live: against SGLang's configured total, a shrunk pool is a "leak".
    h.pool.set_limit(5 * bundle)
    h.on_idle()
    h.invariant_checker.max_total_num_tokens = configured
    leak, messages = h.invariant_checker._check_all_pools(h.pool_stats_observer.get_pool_stats())
    assert leak, messages
    with pytest.raises(ValueError, match="memory leak"):
        h.invariant_checker._report_leak("pool", "\n".join(messages))


def test_prefill_that_no_longer_fits_waits_then_completes(
    make_harness: Make, cache_kind: str
) -> None:
    h = make_harness(cache_kind)
    bundle = h.bundle_bytes
    fill(h, 10)
    h.pool.set_limit(2 * bundle)
    h.on_idle()
    assert h.pool.state().status is Status.APPLIED
    big = h.submit(prompt(40, length=200), max_new_tokens=8)  # needs > 2 pages
    small = h.submit(prompt(41, length=8), max_new_tokens=2)
    for _ in range(20):
        h.iterate()  # no RuntimeError from SGLang's allocation path: it waits
    assert big in h.waiting and not big.done
    assert h.mapped_bytes() <= 2 * bundle
    h.pool.set_limit(None)
    h.run_until_idle()
    assert big.done and small.done
    assert h.token_to_kv_pool_allocator.num_failed_allocs == 0


def test_prefill_under_a_partly_applied_shrink_never_crashes(
    make_harness: Make, cache_kind: str
) -> None:
    """Evictable blocks on retired pages make no room: admission must not count them."""
    h = make_harness(cache_kind, max_evict_pages_per_step=1)
    bundle = h.bundle_bytes
    fill(h, 30)
    h.pool.set_limit(12 * bundle)
    h.iterate()  # one pass: evicts one page, retires the rest above the target
    assert h.blocks.num_retired_blocks > 0
    reqs = [h.submit(prompt(i, length=60), max_new_tokens=4) for i in range(30, 45)]
    h.run_until_idle()  # SGLang's alloc_paged_token_slots_extend raises if we over-admit
    assert all(r.done for r in reqs)
    assert h.token_to_kv_pool_allocator.num_failed_allocs == 0
    assert h.pool.state().status is Status.APPLIED and h.mapped_bytes() <= 12 * bundle


def test_allocation_never_takes_a_new_target(make_harness: Make) -> None:
    """A limit published between admission and allocation waits for the next iteration."""
    import torch

    h = make_harness()
    fill(h, 4)
    target_before = h.pages.target_pages
    h.pool.set_limit(0)
    out = h.token_to_kv_pool_allocator.alloc_extend(
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([16]),
        torch.tensor([16]),
        torch.tensor([-1]),
        16,
    )
    assert out is not None and len(out) == 16
    assert h.pages.target_pages == target_before  # not taken at allocation time
    h.token_to_kv_pool_allocator.free(out)
    h.iterate()  # fully idle: the idle hook takes it
    assert h.pages.target_pages == 0


def test_limit_zero_drains_and_gives_back_the_padding_page(
    make_harness: Make, cache_kind: str
) -> None:
    h = make_harness(cache_kind)
    fill(h, 20)
    h.pool.set_limit(0)
    h.on_idle()
    state = h.pool.state()
    assert state.status is Status.APPLIED and state.limit_bytes == 0
    assert h.mapped_bytes() == 0 == state.mapped_bytes
    assert h.tree_cache.evictable_size() == 0 and h.blocks.num_allocated_blocks == 0
    waiting = h.submit(prompt(1), max_new_tokens=2)
    for _ in range(5):
        h.iterate()
    assert waiting in h.waiting and h.mapped_bytes() == 0  # nothing may be mapped: it waits
    h.pool.set_limit(4 * h.bundle_bytes)
    h.run_until_idle()
    assert waiting.done and 0 < h.mapped_bytes() <= 4 * h.bundle_bytes


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_request_waiting_under_limit_zero_starts_in_the_iteration_that_raises_it(
    make_harness: Make, cache_kind: str, overlap: bool
) -> None:
    """Idle under limit 0 the padding page is given back. The pass that takes a raised
    limit comes before admission in the same iteration, so the request waiting for it
    is admitted there, and no state reads ``waiting_for_memory`` once the limit fits."""
    h = make_harness(cache_kind, overlap=overlap)
    fill(h, 3)
    in_foreign_thread(lambda: h.pool.set_limit(0))
    h.idle_until(lambda: h.mapped_bytes() == 0)
    waiting = h.submit(prompt(1), max_new_tokens=2)
    for _ in range(3):
        h.iterate()
    assert waiting in h.waiting and h.pool.state().waiting_reason == "waiting_for_memory"
    in_foreign_thread(lambda: h.pool.set_limit(8 * h.bundle_bytes))
    h.iterate()
    assert waiting not in h.waiting, "admitted one iteration after the limit was taken"
    h.iterate()  # the next pass reads the demand of this iteration's admission round
    state = h.pool.state()
    assert state.status is Status.APPLIED and state.waiting_reason is None, state
    h.run_until_idle()
    assert waiting.done and 0 < h.mapped_bytes() <= 8 * h.bundle_bytes


def test_limit_retained_before_start_applies_before_first_request(make_harness: Make) -> None:
    h = make_harness(limit="3G")  # KVSIDECAR_LIMIT: published at start, applied in attach
    state = h.pool.state()
    assert state.revision == 1 and state.limit_bytes == 3 << 30
    small = make_harness(limit=5 * 16384)  # 5 bundles of the harness pool
    assert small.pages.target_pages == 5 and small.mapped_bytes() <= 5 * small.bundle_bytes
    reqs = [small.submit(prompt(i, length=20), max_new_tokens=2) for i in range(8)]
    small.run_until_idle()
    assert all(r.done for r in reqs)
    assert small.mapped_bytes() <= 5 * small.bundle_bytes
    assert small.pool.state().status is Status.APPLIED


def test_shrink_keeps_a_shared_prefix_and_evicts_whole_pages(
    make_harness: Make, cache_kind: str
) -> None:
    """Leaves go first: a system prompt shared by every request survives a moderate shrink."""
    h = make_harness(cache_kind)
    system = [5] * 32
    for i in range(30):
        h.submit(system + prompt(i, length=12), max_new_tokens=5)
    h.run_until_idle()
    before = h.pages.num_mapped
    h.pool.set_limit(10 * h.bundle_bytes)
    h.on_idle()
    assert h.pool.state().status is Status.APPLIED and h.pages.num_mapped == 10
    freed = before - h.pages.num_mapped
    evicted = h.pool.reclaimer.num_evicted_blocks
    assert evicted <= freed * h.blocks.blocks_per_page * 1.25  # near the minimum: whole pages
    again = h.submit(system + prompt(99, length=12), max_new_tokens=2)
    h.run_until_idle()
    assert again.prefix_len == 32  # the shared prompt was still cached (KV read back)


def test_publish_wakes_a_scheduler_sleeping_on_idle(make_harness: Make) -> None:
    """--sleep-on-idle: SGLang's IdleSleeper poll returns at once when a limit arrives."""
    import threading

    h = make_harness(sleep_on_idle=True)
    poller = h.idle_sleeper.poller  # SGLang's IdleSleeper; the adapter registered its pipe
    fill(h, 10)
    assert poller.poll(0) == []  # nothing to wake for
    publisher = threading.Thread(
        target=lambda: h.pool.set_limit(2 * h.bundle_bytes), name="control-handler"
    )
    publisher.start()
    publisher.join(10)
    assert [fd for fd, _ in poller.poll(0)] == [h.pool.waker.fileno]  # the poll returns now
    h.on_idle()  # the woken loop's idle hook: the pass runs, the wake-up is consumed
    assert poller.poll(0) == []
    assert h.pool.state().status is Status.APPLIED
    assert h.mapped_bytes() <= 2 * h.bundle_bytes


def test_only_the_scheduler_thread_may_touch_the_pool(make_harness: Make) -> None:
    """The one rule: a control thread publishes; allocation or a pass from it raises."""
    import threading

    from allocator import ForeignThreadError

    h = make_harness()
    fill(h, 4)
    errors: list[BaseException] = []

    def foreign() -> None:
        for call in (lambda: h.token_to_kv_pool_allocator.alloc(16), h.pool.before_schedule):
            try:
                call()
            except ForeignThreadError as exc:
                errors.append(exc)
        h.pool.set_limit(h.bundle_bytes * 3)  # publishing is allowed from any thread

    thread = threading.Thread(target=foreign, name="control-handler")
    thread.start()
    thread.join(10)
    assert len(errors) == 2
    assert h.pages.target_pages is None  # nothing applied off the scheduler thread
    h.on_idle()
    assert h.pages.target_pages == 3


def test_small_limit_running_request_finishes_and_waiting_one_is_named(
    make_harness: Make, cache_kind: str
) -> None:
    """Issue 11 hang scenario: 2-page limit, A running, B waiting. A is never retracted
    for the limit (it finishes above it, reported), B waits with the state saying so
    and what it needs, and completes once the limit is raised."""
    h = make_harness(cache_kind)
    bundle = h.bundle_bytes
    a = h.submit(prompt(50, length=120), max_new_tokens=120)  # grows well past 2 pages
    h.iterate()
    assert a in h.running
    h.pool.set_limit(2 * bundle)
    b = h.submit(prompt(51, length=300), max_new_tokens=8)
    samples = 0
    while not a.done:
        running = len(h.running)
        h.iterate()
        state = h.pool.state()
        assert state.num_running_requests == running  # read at the iteration's top
        # refreshed at every iteration's top: within the one page this iteration's decode
        # may have mapped since
        assert abs(state.mapped_bytes - h.mapped_bytes()) <= bundle
        if a in h.running and state.mapped_bytes > 2 * bundle:
            assert state.status is Status.DEFERRED and state.reason == "running_requests"
            assert state.overage_bytes == state.mapped_bytes - 2 * bundle
        samples += 1
    assert h.num_retracted == 0 and a.done  # never retracted because of the limit
    assert h.token_to_kv_pool_allocator.num_overdraft_blocks > 0  # it finished above it
    # A's KV is cached now: the next passes shrink to the limit (retries are throttled)
    h.idle_until(lambda: h.pool.state().status is Status.APPLIED)
    state = h.pool.state()
    assert b in h.waiting and state.num_waiting_requests == 1
    assert state.waiting_reason == "waiting_for_memory"
    page = h.config.page_size
    needed = -(-(-(-300 // page) * page + page + 8) // page)  # blocks B asked admission for
    assert state.waiting_bytes == needed * (bundle // h.blocks.blocks_per_page)
    assert state.status is Status.APPLIED and h.mapped_bytes() <= 2 * bundle
    h.pool.set_limit(None)
    h.run_until_idle()
    assert b.done
    assert h.pool.state().waiting_reason is None and h.pool.state().num_waiting_requests == 0
