"""ShrinkCoordinator over a real host-memory pool and a real (small) prefix cache."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from engine_pool import BLOCKS_PER_PAGE, BUNDLE, Pool

from allocator import ForeignThreadError
from engine_ext import (
    BarrierOutcome,
    BarrierResult,
    CoordinatorConfig,
    LimitMailbox,
    ShrinkCoordinator,
)
from engine_ext.protocol import EngineState, RankState, Status


def on_thread(name: str, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on a new thread called ``name``; return its value or error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed back to the test
            out["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return out


def make(pool: Pool, **config: Any) -> tuple[LimitMailbox, ShrinkCoordinator]:
    config.setdefault("deferred_retry_s", 0.0)  # retry every pass: results do not hang on time
    wakes: list[str] = []
    mailbox = LimitMailbox(lambda: wakes.append(threading.current_thread().name))
    coordinator = ShrinkCoordinator(mailbox, pool.blocks, CoordinatorConfig(**config))
    coordinator.add_reclaimer(pool.cache)
    mailbox.wakes = wakes  # type: ignore[attr-defined]
    return mailbox, coordinator


def record_evict_threads(pool: Pool) -> list[str]:
    threads: list[str] = []
    real = pool.cache.evict

    def evict(blocks: Any) -> int:
        threads.append(threading.current_thread().name)
        return real(blocks)

    pool.cache.evict = evict  # type: ignore[method-assign]
    return threads


def test_publish_from_control_thread_defers_and_engine_pass_applies(pool: Pool) -> None:
    pool.fill(8)
    mailbox, coord = make(pool)
    coord.step()
    evict_threads = record_evict_threads(pool)
    before = pool.backend.mapped_bytes()
    assert before == 8 * BUNDLE

    out = on_thread("control-handler", lambda: mailbox.publish(3 * BUNDLE, 1))

    result = out["value"]
    assert result.accepted and result.status is Status.DEFERRED
    assert result.state.overage_bytes == 5 * BUNDLE
    assert mailbox.wakes == ["control-handler"]  # type: ignore[attr-defined]
    assert pool.backend.mapped_bytes() == before and pool.cache.num_evicted == 0
    assert evict_threads == []

    state = coord.step()
    assert state.status is Status.APPLIED
    assert state.mapped_bytes == pool.backend.mapped_bytes() <= 3 * BUNDLE
    assert set(evict_threads) == {threading.current_thread().name}
    assert pool.cache.num_evicted == 5 * BLOCKS_PER_PAGE  # whole pages, nothing more
    assert mailbox.latest_state == state


def test_limit_zero_drains_everything_evictable(pool: Pool) -> None:
    pool.fill(6)
    running = pool.run(2)
    mailbox, coord = make(pool)
    mailbox.publish(0, 1)
    state = coord.step()
    assert state.status is Status.DEFERRED and state.reason == "running_requests"
    assert state.limit_bytes == 0
    assert state.overage_bytes == BUNDLE == pool.backend.mapped_bytes()
    assert all(pool.blocks.is_allocated(b) for b in running.blocks)

    pool.cache.finish(running)
    state = coord.step()
    assert state.status is Status.APPLIED
    assert pool.backend.mapped_bytes() == 0 == state.mapped_bytes


def test_limit_published_before_start_applies_before_first_allocation(pool: Pool) -> None:
    mailbox, coord = make(pool)
    mailbox.publish(2 * BUNDLE + 1, 7)  # floors to 2 pages
    assert pool.backend.mapped_bytes() == 0
    # The engine starts: the first allocation is preceded by a pass.
    state = coord.step()
    assert state.revision == 7 and state.status is Status.APPLIED
    assert pool.pages.target_pages == 2
    reqs = [pool.cache.start([1000 + i]) for i in range(3 * BLOCKS_PER_PAGE)]
    assert sum(r is not None for r in reqs) == 2 * BLOCKS_PER_PAGE
    assert pool.backend.mapped_bytes() == 2 * BUNDLE


def test_newest_revision_wins_over_any_number_of_idle_passes(pool: Pool) -> None:
    pool.fill(9)
    mailbox, coord = make(pool)
    assert mailbox.publish(12 * BUNDLE, 1).accepted  # source A (e.g. kvctl)
    state = coord.step()
    assert state.status is Status.APPLIED and state.limit_bytes == 12 * BUNDLE
    assert mailbox.publish(4 * BUNDLE, 2).accepted  # source B (e.g. the API)
    for _ in range(20):
        state = coord.step()
        assert state.revision == 2 and state.limit_bytes == 4 * BUNDLE
        mapped = pool.backend.mapped_bytes()
        assert (state.status is Status.APPLIED) == (mapped <= 4 * BUNDLE)
        assert pool.pages.target_pages == 4
    assert state.status is Status.APPLIED
    stale = mailbox.publish(12 * BUNDLE, 1)  # A retries its old revision
    assert stale.status is Status.STALE and not stale.accepted
    assert coord.step().limit_bytes == 4 * BUNDLE


def test_older_target_never_reapplied_while_running_requests_pin(pool: Pool) -> None:
    running = [pool.run(BLOCKS_PER_PAGE) for _ in range(6)]
    pool.fill(3)
    mailbox, coord = make(pool)
    mailbox.publish(12 * BUNDLE, 1)
    mailbox.publish(4 * BUNDLE, 2)  # both before one pass: only B is taken
    for _ in range(10):
        state = coord.step()
        assert state.revision == 2 and state.status is Status.DEFERRED
        assert state.reason == "running_requests"
        assert state.overage_bytes == 2 * BUNDLE == pool.backend.mapped_bytes() - 4 * BUNDLE
    for req in running:
        pool.cache.finish(req)
    state = coord.step()
    assert state.status is Status.APPLIED and pool.backend.mapped_bytes() <= 4 * BUNDLE


def test_under_traffic_deferred_until_requests_finish(pool: Pool) -> None:
    running = [pool.run(BLOCKS_PER_PAGE) for _ in range(5)]
    pool.fill(4)
    mailbox, coord = make(pool)
    mailbox.publish_next(2 * BUNDLE)
    state = coord.step()
    assert state.status is Status.DEFERRED and state.reason == "running_requests"
    assert state.overage_bytes == 3 * BUNDLE
    assert state.pinned_bytes == 5 * BUNDLE and state.evictable_bytes == 0
    while running:
        held = {b for r in running for b in r.blocks}
        assert all(pool.blocks.is_allocated(b) for b in held)  # nothing freed early
        measured = pool.backend.mapped_bytes()
        assert state.mapped_bytes == measured
        assert state.overage_bytes == max(0, measured - 2 * BUNDLE)
        assert (state.status is Status.APPLIED) == (measured <= 2 * BUNDLE)
        pool.cache.finish(running.pop())
        state = coord.step()
    assert state.status is Status.APPLIED and state.overage_bytes == 0


def test_growth_applies_next_pass_without_eviction(pool: Pool) -> None:
    pool.fill(6)
    mailbox, coord = make(pool)
    mailbox.publish_next(2 * BUNDLE)
    coord.step()
    evicted = pool.cache.num_evicted
    mailbox.publish_next(10 * BUNDLE)
    state = coord.step()
    assert state.status is Status.APPLIED and state.limit_bytes == 10 * BUNDLE
    assert pool.cache.num_evicted == evicted and pool.pages.target_pages == 10
    pool.fill(7)
    assert pool.backend.mapped_bytes() == 9 * BUNDLE


def test_reclaim_disabled_records_target_evicts_nothing(pool: Pool) -> None:
    pool.fill(6)
    mailbox, coord = make(pool, reclaim=False)
    mailbox.publish_next(2 * BUNDLE)
    state = coord.step()
    assert state.status is Status.DEFERRED and state.reason == "reclaim_disabled"
    assert pool.cache.num_evicted == 0 and pool.pages.target_pages == 2
    assert state.overage_bytes == 4 * BUNDLE and state.evictable_bytes == 6 * BUNDLE


def test_max_pages_per_step_bounds_each_pass(pool: Pool) -> None:
    pool.fill(8)
    mailbox, coord = make(pool, max_evict_pages_per_step=2)
    mailbox.publish_next(1 * BUNDLE)
    mapped = [pool.backend.mapped_bytes()]
    reasons = []
    for _ in range(6):
        state = coord.step()
        mapped.append(pool.backend.mapped_bytes())
        reasons.append(state.reason)
    assert [m // BUNDLE for m in mapped] == [8, 6, 4, 2, 1, 1, 1]
    assert reasons[:3] == ["evicting"] * 3 and reasons[3:] == [None] * 3


def test_reports_only_on_change(pool: Pool) -> None:
    pool.fill(4)
    mailbox, coord = make(pool)
    reports: list[EngineState] = []
    coord.set_reporter(reports.append)
    for _ in range(5):
        coord.step()
    assert reports == []  # nothing changed since construction
    mailbox.publish_next(6 * BUNDLE)
    for _ in range(5):
        coord.step()
    assert [(r.status, r.revision) for r in reports] == [(Status.APPLIED, 1)]
    pool.run(1)  # mapped grows by one page: reported
    coord.step()
    coord.step()
    assert len(reports) == 2 and reports[-1].mapped_bytes == 5 * BUNDLE


class _Barrier:
    """A rank barrier (the TP/PP layer's role) with a scripted outcome."""

    def __init__(self, outcome: BarrierOutcome, rank1_bytes: int) -> None:
        self.outcome = outcome
        self.rank1_bytes = rank1_bytes
        self.calls = 0
        self.epoch = 0  # bumped when a rank dies
        self.in_flight = False  # unmaps the ranks have not acknowledged

    def sync(self) -> BarrierResult:
        self.calls += 1
        return BarrierResult(
            self.outcome,
            (RankState(rank=0, mapped_bytes=0), RankState(rank=1, mapped_bytes=self.rank1_bytes)),
        )


def test_rank_barrier_forces_deferred(pool: Pool) -> None:
    pool.fill(4)
    mailbox, coord = make(pool)
    barrier = _Barrier(BarrierOutcome.TIMEOUT, 2 * BUNDLE)
    coord.set_rank_barrier(barrier)
    mailbox.publish_next(2 * BUNDLE)
    state = coord.step()
    assert state.status is Status.DEFERRED and state.reason == "rank_timeout"
    assert state.num_ranks == 2 and barrier.calls == 1
    barrier.outcome = BarrierOutcome.FAILED
    assert coord.step().reason == "rank_failed"
    barrier.outcome = BarrierOutcome.CONFIRMED
    barrier.rank1_bytes = 3 * BUNDLE  # a rank still maps more than the limit
    state = coord.step()
    assert state.status is Status.DEFERRED and state.mapped_bytes == 3 * BUNDLE
    barrier.rank1_bytes = 2 * BUNDLE
    assert coord.step().status is Status.APPLIED


def test_unmaps_in_flight_to_the_ranks_are_never_applied(pool: Pool) -> None:
    """A free outside a pass unmaps a page in the scheduler's view at once; the ranks still
    map it until they ack. With the page count back where it was (a page mapped and freed
    between two steps), the idle fast path must still sync the ranks, not repeat the state.
    (Found by tests/integration/ranks/test_ranks_random.py over 40 seeds: applied at one
    page while every rank's /proc showed two.)"""
    pool.fill(1)
    mailbox, coord = make(pool)
    barrier = _Barrier(BarrierOutcome.CONFIRMED, BUNDLE)
    coord.set_rank_barrier(barrier)
    mailbox.publish(BUNDLE, 1)
    assert coord.step().status is Status.APPLIED
    calls = barrier.calls
    assert coord.step().status is Status.APPLIED and barrier.calls == calls  # idle: no sync
    barrier.in_flight = True  # the unmap of a page mapped and freed since the last step
    barrier.outcome, barrier.rank1_bytes = BarrierOutcome.TIMEOUT, 2 * BUNDLE  # not acked
    state = coord.step()
    assert barrier.calls == calls + 1
    assert state.status is Status.DEFERRED and state.mapped_bytes == 2 * BUNDLE
    barrier.in_flight = False
    barrier.outcome, barrier.rank1_bytes = BarrierOutcome.CONFIRMED, BUNDLE  # acked
    assert coord.step().status is Status.APPLIED


def test_a_rank_dying_while_idle_is_reported_on_the_next_idle_pass(pool: Pool) -> None:
    pool.fill(2)
    mailbox, coord = make(pool)
    reports: list[EngineState] = []
    coord.set_reporter(reports.append)
    barrier = _Barrier(BarrierOutcome.CONFIRMED, 0)
    coord.set_rank_barrier(barrier)
    mailbox.publish_next(None)
    assert coord.step().status is Status.APPLIED
    calls = barrier.calls
    assert coord.step().status is Status.APPLIED and barrier.calls == calls  # idle: no sync
    barrier.outcome, barrier.epoch = BarrierOutcome.FAILED, 1  # rank 1 died, nothing pending
    state = coord.step()
    assert (state.status, state.reason) == (Status.DEFERRED, "rank_failed")
    assert reports[-1].reason == "rank_failed"


def test_foreign_thread_mutation_fails(pool: Pool) -> None:
    pool.fill(2)
    _mailbox, coord = make(pool)
    coord.step()
    for name, fn in {
        "alloc": lambda: pool.blocks.alloc(1),
        "set_target": lambda: pool.pages.set_target(1),
        "evict": lambda: pool.cache.evict(list(pool.cache.evictable_blocks())[:1]),
        "step": coord.step,
        "refresh": coord.refresh,
    }.items():
        out = on_thread("intruder", fn)
        assert isinstance(out.get("error"), ForeignThreadError), name
    assert pool.backend.mapped_bytes() == 2 * BUNDLE and pool.cache.num_evicted == 0


def test_idle_pass_is_cheap_and_changes_nothing(pool: Pool) -> None:
    pool.fill(3)
    mailbox, coord = make(pool)
    first = coord.step()
    assert all(coord.step() is first for _ in range(100))
    assert not coord.pending
    mailbox.publish_next(None)
    assert coord.pending
    assert coord.step().passes == first.passes + 1 and not coord.pending


@pytest.mark.parametrize("limit", [None, 0, 5 * BUNDLE])
def test_state_figures_match_the_backend(pool: Pool, limit: int | None) -> None:
    pool.fill(3)
    pool.run(2)
    mailbox, coord = make(pool)
    mailbox.publish_next(limit)
    state = coord.step()
    assert state.mapped_bytes == pool.backend.mapped_bytes()
    assert state.capacity_bytes == 16 * BUNDLE and state.page_bundle_bytes == BUNDLE
    assert state.ranks == [RankState(rank=0, mapped_bytes=state.mapped_bytes)]


def test_deferred_retries_are_throttled_until_something_moves(pool: Pool) -> None:
    running = [pool.run(BLOCKS_PER_PAGE) for _ in range(3)]
    mailbox, coord = make(pool, deferred_retry_s=3600.0)
    mailbox.publish_next(BUNDLE)
    state = coord.step()
    assert state.reason == "running_requests"
    pool.cache.finish(running[0])  # now evictable, but no page moved: the retry waits
    pool.cache.finish(running[1])
    assert coord.step() is state and pool.cache.num_evicted == 0
    pool.cache.evict(running[0].blocks)  # the engine's own eviction empties a page
    state = coord.step()  # the page count moved: the pass runs at once
    assert pool.cache.num_evicted == 2 * BLOCKS_PER_PAGE and state.status is Status.APPLIED
    assert state.mapped_bytes == pool.backend.mapped_bytes() == BUNDLE
    mailbox.publish_next(0)  # a new target is never throttled
    state = coord.step()
    assert state.reason == "running_requests" and state.revision == 2


def test_limit_zero_is_applied_against_the_engine_floor(pool: Pool) -> None:
    """An engine page that can never go (vLLM's null block) sets the effective limit."""
    pinned = pool.run(1)  # the engine's own block, never finished
    pool.fill(3)
    mailbox, coord = make(pool, floor_pages=1)
    mailbox.publish_next(0)
    state = coord.step()
    assert pool.backend.mapped_bytes() == BUNDLE  # only the floor page is left
    assert (state.status, state.limit_bytes) == (Status.APPLIED, 0)
    assert (state.floor_bytes, state.effective_limit_bytes, state.overage_bytes) == (
        BUNDLE,
        BUNDLE,
        0,
    )
    assert pool.blocks.alloc(1) is None  # a limit of 0 still admits nothing new
    assert pinned is not None


def test_without_a_floor_a_pinned_page_keeps_limit_zero_deferred(pool: Pool) -> None:
    pool.run(1)
    mailbox, coord = make(pool)
    mailbox.publish_next(0)
    state = coord.step()
    assert (state.status, state.reason, state.overage_bytes) == (
        Status.DEFERRED,
        "running_requests",
        BUNDLE,
    )


class _Demand:
    """A demand probe the test moves by hand; counts how often the coordinator reads it."""

    def __init__(self) -> None:
        from engine_ext import Demand

        self.value = Demand()
        self.reads = 0

    def __call__(self) -> Any:
        self.reads += 1
        return self.value


def test_demand_is_fresh_at_every_step_while_settled(pool: Pool) -> None:
    from engine_ext import Demand

    pool.fill(4)
    mailbox, coord = make(pool)
    probe = _Demand()
    coord.set_demand_probe(probe)
    reports: list[EngineState] = []
    coord.set_reporter(reports.append)
    mailbox.publish(8 * BUNDLE, 1)
    coord.step()
    reports.clear()
    reads = probe.reads

    probe.value = Demand(
        num_running_requests=2,
        num_waiting_requests=1,
        waiting_blocks=3,
        num_preemptions=1,
        prefix_hit_rate=0.5,
    )
    state = coord.step()
    assert probe.reads == reads + 1  # read at every step, not only when a target waits
    assert (state.num_running_requests, state.num_waiting_requests) == (2, 1)
    assert state.waiting_bytes == 3 * (BUNDLE // BLOCKS_PER_PAGE)
    assert state.num_preemptions == 1 and state.prefix_hit_rate == 0.5
    assert state.waiting_reason is None and state.status is Status.APPLIED
    assert mailbox.latest_state == state  # what the control socket serves is fresh too
    assert reports == []  # demand counts alone travel with the next report/heartbeat


def test_waiting_for_memory_is_shown_and_reported_under_an_applied_limit(pool: Pool) -> None:
    from engine_ext import Demand

    pool.fill(4)
    mailbox, coord = make(pool)
    probe = _Demand()
    coord.set_demand_probe(probe)
    reports: list[EngineState] = []
    coord.set_reporter(reports.append)
    mailbox.publish(8 * BUNDLE, 1)
    assert coord.step().status is Status.APPLIED
    reports.clear()

    probe.value = Demand(num_waiting_requests=1, waiting_blocks=40, waiting_for_memory=True)
    state = coord.step()
    assert state.status is Status.APPLIED  # the limit holds; requests wait under it
    assert state.waiting_reason == "waiting_for_memory"
    assert state.waiting_bytes == 40 * (BUNDLE // BLOCKS_PER_PAGE)
    assert [r.waiting_reason for r in reports] == ["waiting_for_memory"]

    probe.value = Demand()
    state = coord.step()
    assert state.waiting_reason is None and state.num_waiting_requests == 0
    assert [r.waiting_reason for r in reports] == ["waiting_for_memory", None]


def test_derive_model_builds_an_engine_state_as_pydantics_copy() -> None:
    """The coordinator's one-frame copy against ``model_copy``: equal, the same JSON,
    independent of its source, and a model pydantic still handles (validate, copy)."""
    import copy
    import random

    from engine_ext._coordinator import derive_model

    rng = random.Random(7)
    source = EngineState(
        status=Status.DEFERRED,
        revision=3,
        limit_bytes=4 * BUNDLE,
        mapped_bytes=6 * BUNDLE,
        reason="running_requests",
        ranks=[RankState(rank=0, mapped_bytes=6 * BUNDLE)],
        prefix_hit_rate=0.25,
    )
    before = source.model_dump_json()
    choices: dict[str, Callable[[], object]] = {
        "status": lambda: rng.choice(list(Status)),
        "revision": lambda: rng.randrange(100),
        "limit_bytes": lambda: rng.choice([None, rng.randrange(1 << 30)]),
        "mapped_bytes": lambda: rng.randrange(1 << 30),
        "overage_bytes": lambda: rng.randrange(1 << 20),
        "reason": lambda: rng.choice([None, "evicting", "running_requests"]),
        "evictable_bytes": lambda: rng.randrange(1 << 20),
        "pinned_bytes": lambda: rng.randrange(1 << 20),
        "ranks": lambda: [RankState(rank=0, mapped_bytes=rng.randrange(1 << 20))],
        "num_running_requests": lambda: rng.randrange(50),
        "waiting_reason": lambda: rng.choice([None, "waiting_for_memory"]),
        "prefix_hit_rate": lambda: rng.choice([None, rng.random()]),
    }
    for _ in range(200):
        keys = rng.sample(sorted(choices), rng.randrange(len(choices) + 1))
        update = {key: choices[key]() for key in keys}
        derived = derive_model(source, update)
        expected = source.model_copy(update=update)
        assert derived == expected
        assert derived.model_dump_json() == expected.model_dump_json()
        assert derived.model_fields_set >= expected.model_fields_set
        assert EngineState.model_validate_json(derived.model_dump_json()) == derived
        assert copy.copy(derived) == derived and derived.model_copy() == derived
    assert source.model_dump_json() == before  # the source is never changed
    derived = derive_model(source, {"mapped_bytes": 1})
    derived.revision = 99  # its own values and fields-set, not the source's
    derived.model_fields_set.discard("status")
    assert source.revision == 3 and "status" in source.model_fields_set


def test_derive_model_builds_a_rank_state_as_pydantics_copy() -> None:
    """The one-rank state after a page map is derived, not validated again: the same
    model pydantic's copy builds, and a source left as it was."""
    from engine_ext._coordinator import derive_model

    source = RankState(rank=0, mapped_bytes=0)
    for mapped in (0, BUNDLE, 7 * BUNDLE, 1 << 40):
        derived = derive_model(source, {"mapped_bytes": mapped})
        expected = source.model_copy(update={"mapped_bytes": mapped})
        assert type(derived) is RankState and derived == expected
        assert derived.model_dump_json() == expected.model_dump_json()
        assert RankState.model_validate_json(derived.model_dump_json()) == derived
        assert derived.model_fields_set == set(RankState.model_fields)
    assert source.mapped_bytes == 0 and source.model_fields_set == {"rank", "mapped_bytes"}


def test_one_rank_state_follows_the_kernels_figure(pool: Pool) -> None:
    """The rank figure is the backend's (fstat) after every map and unmap: a state
    derived when the figure moves, never the one kept while it held."""
    mailbox, coord = make(pool)
    held = []
    figures = []
    for pages in (2, 5):
        while pool.pages.num_mapped < pages:
            held.append(pool.run(BLOCKS_PER_PAGE))
        state = coord.step()
        assert state.ranks[0].mapped_bytes == state.mapped_bytes == pool.backend.mapped_bytes()
        figures.append(state.ranks[0].mapped_bytes)
    for req in held:
        pool.cache.finish(req)
    assert mailbox.publish(BUNDLE, 1).accepted
    state = coord.step()  # evicts and unmaps down to the limit
    assert state.ranks[0].mapped_bytes == state.mapped_bytes == pool.backend.mapped_bytes()
    figures.append(state.ranks[0].mapped_bytes)
    assert figures == [2 * BUNDLE, 5 * BUNDLE, BUNDLE]


def test_refresh_follows_pages_mapped_and_unmapped_but_takes_no_target(pool: Pool) -> None:
    """SGLang's hooks after the batch: the state follows /proc between passes, and a
    refresh never does a pass's work (no target taken, nothing evicted or unmapped)."""
    pool.fill(4)
    mailbox, coord = make(pool)
    coord.step()
    mailbox.publish(4 * BUNDLE, 1)
    assert coord.step().status is Status.APPLIED  # the limit is taken at a pass
    same = coord.state()
    assert coord.refresh() is same  # nothing moved: the same snapshot, no recompute

    pool.pages.set_target(None)  # a running request's page above the target, mapped as
    running = pool.run(BLOCKS_PER_PAGE)  # the pools' overdraft does: target lifted, then
    pool.pages.set_target(4)  # put back (the page above it is retired)
    assert pool.backend.mapped_bytes() == 5 * BUNDLE
    state = coord.refresh()
    assert state.mapped_bytes == pool.backend.mapped_bytes() == 5 * BUNDLE
    assert state.status is Status.DEFERRED and state.overage_bytes == BUNDLE
    assert state.revision == 1 and pool.cache.num_evicted == 0  # no pass ran

    mailbox.publish(None, 2)  # waits for the next pass: a refresh does not take it
    evicted = pool.cache.num_evicted
    state = coord.refresh()
    assert state.revision == 1 and mailbox.has_untaken and pool.cache.num_evicted == evicted

    pool.cache.finish(running)  # its blocks stay cached: nothing unmapped, nothing moved
    assert coord.refresh().mapped_bytes == pool.backend.mapped_bytes()
    state = coord.step()  # the pass takes revision 2 (unlimited)
    assert (state.revision, state.status) == (2, Status.APPLIED)
