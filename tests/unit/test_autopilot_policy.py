"""The autopilot's pure policy (sidecar/_policy.py): targets, bounds, shrink before grow.

The fuzz plays engines that apply their limits late or never, defer a lower
one while their running requests still grow, map under what they hold, die
and return, against random demand, and checks at every step that what they
map, and what they may hold, never exceeds the budget.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar._policy import (
    Member,
    Target,
    committed,
    compute_targets,
    held_after_report,
    held_after_write,
    plan,
    room_for,
)

G = 1 << 30
PAGE = 1 << 20


def _m(iid: str, **kw: object) -> Member:
    base: dict[str, object] = {
        "live": True,
        "desired": 0,
        "held": 0,
        "page": PAGE,
        "capacity": 64 * G,
    }
    base.update(kw)
    return Member(iid, **base)  # type: ignore[arg-type]


def test_idle_instances_split_the_budget_by_weight() -> None:
    t = compute_targets(12 * G, [_m("a"), _m("b", weight=2.0)])
    assert (t["a"].limit, t["b"].limit) == (4 * G, 8 * G)
    assert t["a"].reason == "idle_share"


def test_demand_first_then_the_spare_to_the_busy_ones() -> None:
    t = compute_targets(
        10 * G,
        [_m("a", pinned=2 * G, waiting=3 * G, busy=True), _m("b"), _m("c", pinned=G, busy=True)],
    )
    assert t["b"].limit == 0  # idle while others are busy: its min
    assert t["a"].limit >= 5 * G and t["c"].limit >= G
    assert t["a"].limit + t["c"].limit == 10 * G


def test_contention_is_weighted_and_bounded() -> None:
    members = [
        _m("a", waiting=10 * G, busy=True, min=G),
        _m("b", waiting=10 * G, busy=True, weight=3.0, max=5 * G),
    ]
    t = compute_targets(8 * G, members)
    assert t["b"].limit <= 5 * G and t["a"].limit >= G
    assert t["a"].limit + t["b"].limit <= 8 * G
    assert t["a"].reason == "demand_capped"


def test_pins_and_dead_instances() -> None:
    members = [_m("a", pin=6 * G), _m("b"), _m("dead", live=False, desired=4 * G)]
    t = compute_targets(8 * G, members)
    assert set(t) == {"b"} and t["b"].limit == 2 * G
    assert committed(members[2]) == 0  # its memory is reassigned


def test_a_dead_instance_keeps_its_floor_free_for_its_return() -> None:
    """An engine maps its floor the moment it restarts, before it can be told a limit
    (seen on real ``vllm serve``: the null block's page): the others never get it."""
    dead = _m("dead", live=False, desired=4 * G, held=4 * G, floor=PAGE)
    b = _m("b", desired=4 * G, held=4 * G, mapped=4 * G, busy=True, waiting=8 * G)
    t = compute_targets(8 * G, [dead, b])
    assert set(t) == {"b"} and t["b"].limit == 8 * G - PAGE
    assert committed(dead) == PAGE
    assert room_for("dead", 8 * G, [dead, replace(b, desired=t["b"].limit)]) == PAGE
    grows = plan(8 * G, [dead, b], t, hysteresis=PAGE)
    assert [(c.id, c.new) for c in grows] == [("b", 8 * G - PAGE)]


def test_a_grow_waits_for_the_shrink_to_be_applied() -> None:
    a = _m("a", desired=6 * G, held=6 * G, mapped=6 * G)
    b = _m("b", desired=2 * G, held=2 * G, mapped=2 * G, waiting=4 * G, busy=True)
    targets = {"a": Target("a", 2 * G, "min"), "b": Target("b", 6 * G, "demand")}
    changes = plan(8 * G, [a, b], targets, hysteresis=PAGE)
    assert [(c.id, c.new) for c in changes] == [("a", 2 * G)]  # shrink only
    # A took the new limit (its report says 2G) but its requests, admitted under 6G, still
    # hold 5G and may grow back to 6G: deferred, it frees nothing, whatever it maps
    a = replace(a, desired=2 * G, held=held_after_write(a.held, 2 * G))
    for mapped in (5 * G, G):
        held = held_after_report(a.held, applied=False, effective=2 * G, mapped=mapped)
        a = replace(a, held=held, mapped=mapped)
        assert a.held == 6 * G and plan(8 * G, [a, b], targets, hysteresis=PAGE) == []
    a = replace(a, held=held_after_report(a.held, applied=True, effective=2 * G, mapped=G))
    assert [(c.id, c.new) for c in plan(8 * G, [a, b], targets, PAGE)] == [("b", 6 * G)]


def test_what_an_engine_may_hold_falls_only_with_an_applied_report() -> None:
    assert held_after_write(4 * G, 2 * G) == 4 * G and held_after_write(4 * G, None) is None
    assert held_after_write(2 * G, 4 * G) == 4 * G
    # deferred (or applied for an older revision): the larger of before, the limit, mapped
    assert held_after_report(4 * G, applied=False, effective=2 * G, mapped=3 * G) == 4 * G
    assert held_after_report(4 * G, applied=False, effective=2 * G, mapped=5 * G) == 5 * G
    assert held_after_report(4 * G, applied=False, effective=None, mapped=0) is None
    assert held_after_report(None, applied=False, effective=2 * G, mapped=0) is None
    # applied at the desired revision: what it holds now
    assert held_after_report(None, applied=True, effective=2 * G, mapped=G) == 2 * G
    assert held_after_report(0, applied=False, effective=G, mapped=0) == G  # a new process


def test_a_silent_instance_blocks_every_grow_until_it_reports() -> None:
    a = _m("a", reported=False, desired=2 * G)
    b = _m("b", desired=G, held=G)
    assert plan(8 * G, [a, b], {"b": Target("b", 4 * G, "demand")}, PAGE) == []


def test_hysteresis_skips_small_moves_unless_over_budget() -> None:
    a = _m("a", desired=4 * G, held=4 * G)
    assert plan(8 * G, [a], {"a": Target("a", 4 * G + PAGE, "fair_share")}, G) == []
    over = _m("a", desired=9 * G, held=9 * G, mapped=9 * G)
    assert [c.new for c in plan(8 * G, [over], {"a": Target("a", 8 * G, "max")}, 2 * G)] == [8 * G]


@dataclass
class _Engine:
    """The fuzz's engine, as the sidecar cannot see it: the limit it holds, whether the
    sidecar's latest limit reached it, and ``bound``, the most its admitted requests may
    map (the higher limit they were admitted under while a lower one is deferred)."""

    limit: int
    taken: bool = True
    applied: bool = True
    bound: int = 0


def _report(m: Member, e: _Engine) -> Member:
    """The sidecar takes the engine's report (as InstanceRecord.take_report does)."""
    held = held_after_report(
        m.held, applied=e.applied and e.taken, effective=e.limit, mapped=m.mapped
    )
    return replace(m, held=held)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), budget_g=st.integers(1, 32))
def test_fuzz_the_budget_holds_at_every_step(seed: int, n: int, budget_g: int) -> None:
    """Engines take their limits late, defer a lower one while requests admitted under the
    higher one still map up to it (also after mapping less than the new one, as the output
    reservation allows), grow under what they hold, die and return; the sidecar knows only
    their reports. What they map never exceeds the budget, nor do the granted limits."""
    rng = random.Random(seed)
    budget = budget_g * G
    mins = [rng.choice([0, 0, PAGE * rng.randint(0, 64)]) for _ in range(n)]
    while sum(mins) > budget:
        mins[rng.randrange(n)] = 0
    members = []
    engines: dict[str, _Engine] = {}
    for i in range(n):
        lo = mins[i]
        hi = rng.choice([None, lo + PAGE * rng.randint(0, 20000)])
        floor = rng.choice([0, PAGE])
        m = _m(
            f"e{i}",
            min=lo,
            max=hi,
            weight=rng.choice([0.5, 1.0, 3.0]),
            floor=floor,
            desired=0,
            held=0,
        )
        engines[m.id] = _Engine(limit=floor, bound=floor)
        members.append(_report(m, engines[m.id]))
    hysteresis = rng.choice([0, PAGE, budget // 20])
    for _step in range(60):
        # the world moves: demand changes, engines take limits late, defer them, map,
        # die and come back; every live engine reports
        moved = []
        for m in members:
            e = engines[m.id]
            if rng.random() < 0.2:
                m = replace(
                    m,
                    pinned=rng.randint(0, 2 * budget) // PAGE * PAGE,
                    waiting=rng.choice([0, rng.randint(0, budget)]),
                    busy=rng.random() < 0.6,
                )
            if not m.live:
                moved.append(m)
                continue
            if not e.taken and rng.random() < 0.5:  # takes the desired limit
                new = max(m.desired or 0, m.floor)
                e.limit, e.taken = new, True
                if new < e.bound and rng.random() < 0.5:
                    e.applied = False  # deferred: the running requests may still reach bound
                else:
                    e.applied, e.bound = True, new
                    m = replace(m, mapped=min(m.mapped, new))
            elif not e.applied and rng.random() < 0.3:  # those requests finished: applied
                e.applied, e.bound = True, e.limit
                m = replace(m, mapped=min(m.mapped, e.limit))
            if rng.random() < 0.5:  # maps: demand, and a deferred engine's outputs
                want = max(m.mapped, m.pinned, 0 if e.applied else rng.randint(0, e.bound))
                cap = e.bound if not e.applied else e.limit
                m = replace(m, mapped=min(want, cap) // PAGE * PAGE)
            moved.append(_report(m, e))
        members = moved
        for i, m in enumerate(members):
            if rng.random() < 0.03:  # dies (its memory is gone) or returns, fitted to the room
                if m.live:
                    members[i] = replace(m, live=False, mapped=0)
                else:
                    room = max(0, room_for(m.id, budget, members)) // PAGE * PAGE
                    kept = room if m.desired is None else min(m.desired, room)
                    # it maps its floor at start, before it registers (a new process)
                    e = engines[m.id] = _Engine(limit=max(kept, m.floor))
                    e.bound = e.limit
                    back = replace(m, live=True, mapped=m.floor, desired=kept, held=0)
                    members[i] = _report(back, e)
        # what the engines map (measured) never exceeds the budget
        assert sum(m.mapped for m in members if m.live) <= budget, members
        before = sum(committed(m) for m in members)  # the dead ones' floors included
        targets = compute_targets(budget, members)
        for t in targets.values():
            m = next(x for x in members if x.id == t.id)
            if t.reason != "budget_short":
                assert t.limit >= min(max(m.min, m.floor), budget) - PAGE or t.limit >= m.min
                if m.max is not None:
                    assert t.limit <= max(m.max, m.min, m.floor)
        assert sum(t.limit for t in targets.values()) <= budget
        changes = plan(budget, members, targets, hysteresis)
        grown = {m.id: m for m in members}
        for c in changes:  # each grow takes the room the others leave once the earlier are in
            if c.shrink:
                continue
            room, want = room_for(c.id, budget, grown.values()), targets[c.id].limit
            assert c.new == (want if want <= room else room // PAGE * PAGE), (c, room, want)
            grown[c.id] = replace(grown[c.id], desired=c.new)
        shrinks_done = False
        for c in changes:  # shrinks come first
            if c.shrink:
                assert not shrinks_done, "a shrink after a grow"
            else:
                shrinks_done = True
        by_id = {m.id: m for m in members}
        for c in changes:  # stored: the sidecar counts the new limit at once
            m = by_id[c.id]
            by_id[c.id] = replace(m, desired=c.new, held=held_after_write(m.held, c.new))
            engines[c.id].taken = False
        members = list(by_id.values())
        after = sum(committed(m) for m in members)
        if before <= budget:
            assert after <= budget, (changes, members)
        else:  # over (e.g. an instance came back): we never add to it
            assert after <= before


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0), (1.0, 2.0, 5.0)])
def test_targets_fill_the_budget_in_whole_pages(weights: tuple[float, ...]) -> None:
    members = [_m(f"e{i}", weight=w, busy=True, waiting=G) for i, w in enumerate(weights)]
    t = compute_targets(9 * G + 3 * PAGE // 2, members)
    assert all(x.limit % PAGE == 0 for x in t.values())
    assert 9 * G + 3 * PAGE // 2 - 3 * PAGE <= sum(x.limit for x in t.values()) <= 9 * G + PAGE
