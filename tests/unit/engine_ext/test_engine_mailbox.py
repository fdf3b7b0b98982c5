"""LimitMailbox: revisions, take-once, wake, concurrency. No allocator involved."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext import EngineExtContractError, LimitMailbox, Target
from engine_ext.protocol import EngineState, Status


def test_stale_and_conflict_change_nothing() -> None:
    box = LimitMailbox()
    assert box.publish(100, 5).status is Status.DEFERRED
    assert box.take() == Target(100, 5)
    for limit, revision, status in (
        (50, 4, Status.STALE),
        (50, 5, Status.CONFLICT),
        (None, 5, Status.CONFLICT),
    ):
        result = box.publish(limit, revision)
        assert not result.accepted and result.status is status
        assert result.state.status is status and result.message
        assert "5" in result.message
        assert box.desired == Target(100, 5) and box.take() is None


def test_same_revision_same_limit_is_idempotent() -> None:
    box = LimitMailbox()
    first = box.publish(100, 3)
    again = box.publish(100, 3)
    assert again.accepted and again.status is Status.DEFERRED and again.revision == 3
    assert box.take() == Target(100, 3) and box.take() is None
    box.set_state(EngineState(status=Status.APPLIED, revision=3, limit_bytes=100))
    third = box.publish(100, 3)
    assert third.accepted and third.status is Status.APPLIED and box.take() is None
    assert first.state.reason == "engine_pass"


def test_take_returns_newest_once() -> None:
    box = LimitMailbox()
    box.publish(300, 1)
    box.publish(200, 2)
    box.publish(100, 3)
    assert box.take() == Target(100, 3)
    assert box.take() is None
    box.publish(400, 4)
    assert box.take() == Target(400, 4)


def test_publish_next_takes_revisions_atomically() -> None:
    box = LimitMailbox()
    box.publish(10, 41)
    revisions: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            result = box.publish_next(1)
            with lock:
                revisions.append(result.revision)

    threads = [threading.Thread(target=worker, name=f"api-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(revisions) == list(range(42, 842))
    assert box.revision == 841


def test_wake_called_outside_lock_and_errors_do_not_fail_publish() -> None:
    box = LimitMailbox()
    seen: list[int] = []
    box.set_wake(lambda: seen.append(box.revision))  # would deadlock if called under the lock
    box.publish_next(5)
    assert seen == [1]

    def broken() -> None:
        raise RuntimeError("engine gone")

    box.set_wake(broken)
    assert box.publish_next(6).accepted and box.desired == Target(6, 2)


def test_pending_state_overage_from_snapshot() -> None:
    box = LimitMailbox()
    box.set_state(EngineState(status=Status.APPLIED, mapped_bytes=1000))
    result = box.publish_next(400)
    assert result.state.overage_bytes == 600 and result.state.limit_bytes == 400
    assert box.publish_next(None).state.overage_bytes == 0


def test_pending_state_works_towards_the_floor() -> None:
    """A limit under the floor (memory the engine never gives back): the reply's effective
    limit is the floor, and its overage is measured against it, as after the pass."""
    box = LimitMailbox()
    box.set_state(
        EngineState(
            status=Status.APPLIED,
            limit_bytes=3000,
            effective_limit_bytes=3000,
            floor_bytes=100,
            mapped_bytes=1000,
        )
    )
    state = box.publish_next(0).state
    assert (state.limit_bytes, state.effective_limit_bytes, state.overage_bytes) == (0, 100, 900)
    state = box.publish_next(500).state
    assert (state.effective_limit_bytes, state.overage_bytes) == (500, 500)
    state = box.publish_next(None).state
    assert (state.effective_limit_bytes, state.overage_bytes) == (None, 0)


@pytest.mark.parametrize(
    ("limit", "revision"),
    [(-1, 1), (True, 1), (1.5, 1), (1 << 61, 1), (1, 0), (1, -3), (1, True), (1, "2")],
)
def test_bad_values_raise_and_change_nothing(limit: object, revision: object) -> None:
    box = LimitMailbox()
    box.publish(7, 1)
    with pytest.raises(EngineExtContractError):
        box.publish(limit, revision)  # type: ignore[arg-type]
    assert box.desired == Target(7, 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("publish"), st.one_of(st.none(), st.integers(0, 50)), st.integers(1, 12)
            ),
            st.tuples(st.just("next"), st.one_of(st.none(), st.integers(0, 50)), st.just(0)),
            st.tuples(st.just("take"), st.none(), st.just(0)),
        ),
        max_size=40,
    )
)
def test_revision_rules_hold_for_any_sequence(ops: list[tuple[str, int | None, int]]) -> None:
    box = LimitMailbox()
    accepted: dict[int, int | None] = {}  # revision -> limit, as accepted
    last_taken = 0
    for op, limit, revision in ops:
        before = box.desired
        if op == "take":
            got = box.take()
            if got is not None:
                assert got == box.desired and got.revision > last_taken
                last_taken = got.revision
            continue
        result = box.publish(limit, revision) if op == "publish" else box.publish_next(limit)
        if result.accepted:
            accepted.setdefault(result.revision, limit)
            assert accepted[result.revision] == limit and box.desired.revision >= before.revision
        else:
            assert box.desired == before  # rejected: nothing changed
            assert (result.status is Status.STALE) == (revision < before.revision)
    assert box.revision == max(accepted, default=0)
