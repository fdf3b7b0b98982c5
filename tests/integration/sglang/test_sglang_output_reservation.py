"""Output reservation (``KVSIDECAR_RESERVE_OUTPUT=1``) on SGLang's memory classes (CPU harness).

SGLang admits against an estimate of each request's output; with the
reservation the adapter holds SGLang's ``new_token_ratio`` at 1.0 (its
admission then counts every running request's whole remaining output, as
the harness's admission does), reports what the running requests may still
add (``reserved_bytes``), and a lowered limit is ``applied`` only once that
fits under it. Memory is the reservation's measured mapping (memfd), at
every iteration.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
    NewTokenRatioTracker,
)
from sglang_support import prompt

from engine_ext.cpu_harness import CpuHarness
from engine_ext.protocol import Status
from sidecar._reports import report_problem

Make = Callable[..., CpuHarness]


def test_sglangs_output_estimate_is_held_at_the_whole_output(make_harness: Make) -> None:
    h = make_harness(reserve_output=True)
    tracker = NewTokenRatioTracker(init=0.7, min=0.098, decay=0.001, current=0.7)
    h.new_token_ratio_tracker = tracker  # type: ignore[attr-defined]  # as SGLang's Scheduler
    h.submit(prompt(1, length=40), max_new_tokens=4)
    h.iterate()
    assert (tracker.current, tracker.min, tracker.decay) == (1.0, 1.0, 0.0)
    tracker.current = 0.3  # SGLang lowers it after a retraction
    tracker.decay_step()
    h.iterate()
    assert tracker.current == 1.0
    h.run_until_idle()


def test_without_the_reservation_sglangs_estimate_is_left_alone(make_harness: Make) -> None:
    h = make_harness()
    tracker = NewTokenRatioTracker(init=0.7, min=0.098, decay=0.001, current=0.7)
    h.new_token_ratio_tracker = tracker  # type: ignore[attr-defined]
    h.submit(prompt(1, length=40), max_new_tokens=4)
    h.iterate()
    assert tracker.current == 0.7 and tracker.min == 0.098


def test_applied_means_the_running_requests_growth_fits(
    make_harness: Make, any_cache_kind: str
) -> None:
    h = make_harness(any_cache_kind, reserve_output=True)
    bundle, page = h.bundle_bytes, h.config.page_size
    reqs = [h.submit(prompt(60 + i, length=2 * page), max_new_tokens=12 * page) for i in range(3)]
    h.iterate()
    assert all(r in h.running for r in reqs)
    h.pool.before_schedule()
    state = h.pool.state()
    assert state.reserved_bytes > 0  # their outputs are still to come
    limit = h.mapped_bytes() + bundle  # above what is mapped, below where they will end
    revision = h.pool.set_limit(limit).revision
    h.pool.before_schedule()
    state = h.pool.state()
    assert state.revision == revision and h.mapped_bytes() <= limit
    assert state.status is Status.DEFERRED and state.reason == "running_requests"
    assert state.overage_bytes > 0
    applied = False
    for _ in range(5000):
        h.iterate()
        state = h.pool.state()
        if state.revision == revision and state.status is Status.APPLIED:
            applied = True
        if applied:  # from the first applied on, never above the limit
            assert h.mapped_bytes() <= limit, state
        if all(r.done for r in reqs):
            break
    assert all(r.done for r in reqs)
    h.idle_until(lambda: h.pool.state().status is Status.APPLIED)
    assert h.mapped_bytes() <= limit and h.pool.state().reserved_bytes == 0


def test_every_state_under_a_zero_limit_passes_the_sidecars_report_checks(
    make_harness: Make,
) -> None:
    """A limit of 0 while requests with long outputs run: the overage counts their output
    still to come, beyond what is mapped; the sidecar must take every such report."""
    h = make_harness(reserve_output=True)
    page = h.config.page_size
    reqs = [h.submit(prompt(80 + i, length=page), max_new_tokens=12 * page) for i in range(2)]
    h.iterate()
    assert all(r in h.running for r in reqs)
    revision = h.pool.set_limit(0).revision
    beyond = 0
    for _ in range(5000):
        h.iterate()
        state = h.pool.state()
        assert report_problem(state, 0, revision) is None, state
        beyond += state.overage_bytes > state.mapped_bytes
        if all(r.done for r in reqs):
            break
    assert all(r.done for r in reqs) and beyond > 0
