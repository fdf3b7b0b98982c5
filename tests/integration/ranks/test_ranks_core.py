"""TP/PP ranks over the real engine core and real rank processes (issue 7).

Every rank is a separate process (``python -m engine_ext.ranks``) with its own
view of the scheduler's memfd; what each rank maps is read from its
``/proc/<pid>/maps``. The limit goes through the in-process API
(``ElasticInstance.set_limit``); the test thread is the engine thread.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from allocator import BackendError
from engine_ext.protocol import EngineState, Status

from ._toy import BLOCK_SIZE, BLOCKS_PER_PAGE, LAYOUT, Request, ToyEngine

BUNDLE = LAYOUT.bundle_bytes
TOPOLOGIES = [pytest.param(2, 1, id="tp2"), pytest.param(1, 2, id="pp2")]


def _doc(seed: int, length: int = 4 * BLOCK_SIZE) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 20000 for i in range(length)]


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[object]:
    engines: list[ToyEngine] = []

    def make(tp: int, pp: int, delays: dict[int, float] | None = None) -> ToyEngine:
        engine = ToyEngine(tmp_path / f"e{len(engines)}", tp, pp, delays=delays)
        engines.append(engine)
        return engine

    for i in range(4):
        (tmp_path / f"e{i}").mkdir()
    yield make
    for engine in engines:
        engine.close()


def _check_applied(engine: ToyEngine, state: EngineState, limit: int, *, transition: bool) -> None:
    """Any ``applied`` poll: every rank's /proc view and the memfd are within the limit.

    The transition deferred -> applied additionally comes from a barrier pass:
    nothing is in flight and each rank's view is exactly the scheduler's.
    """
    for pid in engine.group.pids:
        assert len(engine.rank_pages(pid)) * BUNDLE <= limit, f"rank pid {pid} over the limit"
    assert engine.backend.mapped_bytes() <= limit  # the memfd, measured
    if not transition:
        return
    assert engine.backend.unmaps_in_flight == 0, "applied while an unmap is not acked"
    want = engine.scheduler_pages()
    for pid in engine.group.pids:
        pages = engine.rank_pages(pid)
        assert pages == want, f"rank pid {pid} maps {sorted(pages)}, scheduler {sorted(want)}"
    assert engine.backend.mapped_bytes() == len(want) * BUNDLE
    assert [(r.rank, r.alive) for r in state.ranks] == [
        (r, True) for r in range(engine.tp * engine.pp)
    ]


def _poll(engine: ToyEngine, limit: int, seen: list[EngineState]) -> EngineState:
    state = engine.instance.step()
    if state.status is Status.APPLIED:
        transition = bool(seen) and seen[-1].status is Status.DEFERRED
        _check_applied(engine, state, limit, transition=transition)
    seen.append(state)
    return state


def _idle_until_applied(engine: ToyEngine, limit: int, timeout_s: float) -> list[EngineState]:
    """Run idle passes (on wake-ups, like the adapters) until applied; check every poll."""
    seen: list[EngineState] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine.woken.clear()
        if _poll(engine, limit, seen).status is Status.APPLIED:
            return seen
        engine.woken.wait(0.1)
    raise AssertionError(f"not applied within {timeout_s}s: {seen[-1]}")


def _reference(
    engine: ToyEngine, limit: int | None
) -> tuple[dict[int, list[int]], list[EngineState]]:
    """Fill the prefix cache, lower the limit with shared-prefix requests queued, abort half."""
    for seed in range(3):
        req = engine.admit(_doc(seed) + [7, 8, 9])
        assert req is not None
        engine.decode(req, 4)
        engine.finish(req)
    states: list[EngineState] = []
    queued: dict[int, Request] = {}
    for i in range(4):
        req = engine.admit(_doc(0) + [50 + i] * 5)
        assert req is not None
        queued[i] = req
    if limit is not None:
        result = engine.instance.set_limit(limit)
        assert result.accepted
        states.append(engine.instance.step())
        assert states[-1].status is Status.DEFERRED, states[-1]
    for i in (1, 3):
        engine.abort(queued.pop(i))
    outputs: dict[int, list[int]] = {}
    for i, req in queued.items():
        engine.decode(req, 6)
        outputs[i] = req.tokens[req.prompt_len :]
        engine.finish(req)
        if limit is not None:
            _poll(engine, limit, states)
    if limit is None:  # nothing deferred: the coordinator has no reason to consult the barrier
        assert engine.barrier.sync().outcome.value == "confirmed"
    elif states[-1].status is not Status.APPLIED:
        states += _idle_until_applied(engine, limit, 10.0)
    return outputs, states


@pytest.mark.parametrize(("tp", "pp"), TOPOLOGIES)
def test_reference_scenario_every_rank_under_limit_same_tokens(
    make_engine, tp: int, pp: int
) -> None:
    baseline, _ = _reference(make_engine(tp, pp), None)
    engine = make_engine(tp, pp)
    limit = BUNDLE + BUNDLE // 2  # below what the queued requests pin
    outputs, states = _reference(engine, limit)
    assert outputs == baseline and len(outputs) == 2
    assert states[0].status is Status.DEFERRED and states[-1].status is Status.APPLIED
    final = states[-1]
    assert final.mapped_bytes <= limit and final.num_ranks == tp * pp
    assert [r.rank for r in final.ranks] == list(range(tp * pp))
    # the ranks really wrote the KV: the scheduler's view reads their words
    engine.instance.set_limit(None)
    req = engine.admit(_doc(9) + [1])
    assert req is not None
    for region in range(LAYOUT.num_regions):
        for word in range(tp):
            assert engine.read_slot(region, req.table[0], 0, word) == req.tokens[0]


def _fill(engine: ToyEngine) -> None:
    for seed in range(3):
        req = engine.admit(_doc(seed))
        assert req is not None
        engine.finish(req)


def test_slow_rank_defers_until_it_catches_up(make_engine) -> None:
    engine = make_engine(2, 1, {1: 5.0})
    _fill(engine)
    limit = BUNDLE
    started = time.monotonic()
    engine.instance.set_limit(limit)
    states = _idle_until_applied(engine, limit, 15.0)
    elapsed = time.monotonic() - started
    early = [s for s in states[:-1] if s.status is Status.APPLIED]
    assert not early
    assert elapsed >= 4.9, f"applied after {elapsed:.2f}s although rank 1 acks after 5s"
    reasons = {s.reason for s in states[:-1]}
    assert "rank_timeout" in reasons, reasons
    assert len(states) < 200, "the engine thread polled instead of waiting for the rank's ack"


def test_dead_rank_never_applied_rank_failed_rank0_consistent(make_engine) -> None:
    engine = make_engine(2, 1, {1: 30.0})
    _fill(engine)
    limit = BUNDLE
    engine.instance.set_limit(limit)
    state = engine.instance.step()
    assert state.status is Status.DEFERRED and state.reason == "rank_timeout"
    os.kill(engine.group.pids[1], signal.SIGKILL)  # rank 1 dies with the release in flight
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        engine.woken.wait(0.1)
        engine.woken.clear()
        state = engine.instance.step()
        assert state.status is not Status.APPLIED
        if state.reason == "rank_failed":
            break
    assert state.reason == "rank_failed", state
    assert [(r.rank, r.alive) for r in state.ranks] == [(0, True), (1, False)]
    for _ in range(3):  # and it stays so
        assert engine.instance.step().status is Status.DEFERRED
    assert engine.instance.state().reason == "rank_failed"
    want = engine.scheduler_pages()
    assert engine.rank_pages(engine.group.pids[0]) == want  # rank 0 agrees with the scheduler
    assert engine.backend.mapped_bytes() == len(want) * BUNDLE  # rank 0 acked: memory returned
    assert len(want) * BUNDLE <= limit
    # the figures follow what is mapped, not the dead rank's last report: it maps nothing
    state = engine.instance.step()
    assert [(r.rank, r.mapped_bytes) for r in state.ranks] == [(0, len(want) * BUNDLE), (1, 0)]
    assert state.mapped_bytes == engine.backend.mapped_bytes() and state.overage_bytes == 0
    engine.instance.set_limit(None)
    engine.instance.step()
    with pytest.raises(BackendError, match="rank 1"):  # no step can run without rank 1
        engine.blocks.alloc(2 * BLOCKS_PER_PAGE)
    engine.backend.settle(1.0)
    assert engine.rank_pages(engine.group.pids[0]) == engine.scheduler_pages() == want
    assert engine.backend.mapped_bytes() == len(want) * BUNDLE


def test_a_rank_killed_mid_release_the_owner_waits_for_every_live_rank(make_engine) -> None:
    """TP=2 x PP=2, two slow ranks (1: 3 s, 3: 1.5 s per unmap ack); rank 1 is killed with
    the release in flight. The owner gives a page back only once every *live* rank unmapped
    it (checked at every pass: each live rank's /proc view within the owner's own), never
    ``applied``, and in the end the live ranks, the owner and the scheduler agree."""
    engine = make_engine(2, 2, {1: 3.0, 3: 1.5})
    _fill(engine)
    limit = BUNDLE
    engine.instance.set_limit(limit)
    assert engine.instance.step().reason == "rank_timeout"
    os.kill(engine.group.pids[1], signal.SIGKILL)
    live = [pid for rank, pid in enumerate(engine.group.pids) if rank != 1]
    deadline = time.monotonic() + 10.0
    state = engine.instance.step()
    while time.monotonic() < deadline:
        assert state.status is not Status.APPLIED
        owner = engine.rank_pages(os.getpid())  # what the memfd still holds, from /proc
        for pid in live:
            assert engine.rank_pages(pid) <= owner, f"pid {pid} maps a page given back"
        if state.reason == "rank_failed" and not engine.backend.unmaps_in_flight:
            break
        engine.woken.wait(0.1)
        engine.woken.clear()
        state = engine.instance.step()
    assert state.reason == "rank_failed" and not engine.backend.unmaps_in_flight, state
    want = engine.scheduler_pages()
    assert len(want) * BUNDLE <= limit
    assert all(engine.rank_pages(pid) == want for pid in live)
    assert engine.rank_pages(os.getpid()) == want
    assert [(r.rank, r.alive) for r in state.ranks] == [(0, True), (1, False), (2, True), (3, True)]
