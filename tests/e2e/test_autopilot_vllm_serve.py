"""The autopilot with real ``vllm serve`` engines, over real HTTP, memory measured in /proc.

Two CPU-harness ``vllm serve`` engines (``a``, ``b``; output reservation on, as
docs/autopilot.md asks of budgeted engines) register on one host device with
an 8 MiB budget, under ``kvsidecar serve`` as a child process. The engines
start once for the module; the scenarios run in order, each from the idle
split (``Rig.settle``):

1. shrink before grow: with ``a`` frozen (SIGSTOP) while it holds half the
   budget, ``b``'s load makes the sidecar lower ``a``'s limit; ``b`` grows only
   once ``a`` reported ``applied``;
2. an operator pin holds ``a``'s limit against ``b``'s demand until DELETE;
3. min and max bound the shares under load;
4. the sidecar is ``kill -9``-ed mid-change and restarted: no grow before the
   frozen engine reports to the new process;
5. an engine is ``kill -9``-ed mid-load: its memory goes to the survivor once it
   is ``unreachable``, its limit is kept; restarted, it is fitted into what is
   left (``returned_fit``).

Ordering is read from evidence, never from timing: the sidecar's device view
(one atomic snapshot of every member per read), each engine's own state over
its control socket, and /proc, sampled in a thread as fast as it goes
(:class:`autopilot_rig.Watch`). A freeze lasts until the evidence it waits for
is in, far below the heartbeat timeout.
"""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from autopilot_rig import (
    BUDGET,
    DEVICE,
    HEARTBEAT_TIMEOUT_S,
    Load,
    MiB,
    Rig,
    Sample,
    Watch,
    during,
    iter_devices,
    members,
)
from support import wait_until

from engine_ext.cpu_harness import make_tiny_model_dir

if importlib.util.find_spec("vllm") is None:  # found, not imported: the engines import it
    pytest.skip("vllm 0.33 is installed by scripts/dev.sh", allow_module_level=True)
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

# b's load: busy all along (16 in flight, each request's life ~0.6 MiB)
B_LOAD = {"words": 500, "max_tokens": 96, "workers": 16}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("autopilot-vllm")
    rig = Rig(tmp, make_tiny_model_dir(tmp / "model"))
    try:
        rig.start_sidecar()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(rig.start_engine, ("a", "b")))
        reply = rig.http.put(f"/devices/{DEVICE}/budget", json={"budget": BUDGET})
        assert reply.status_code == 200, reply.text
        rig.settle()
        yield rig
    finally:
        rig.close()


def _limit(dev: dict[str, Any], iid: str) -> int:
    limit = members(dev)[iid]["limit_bytes"]
    assert limit is not None, dev
    return int(limit)


def _committed_within_budget(samples: list[Sample]) -> None:
    """The sidecar's invariant, from its own view: what the members may hold fits (a dead
    one counts the floor it maps again when it restarts)."""
    for s, m in iter_devices(samples):
        held = [x["committed_bytes"] for x in m.values()]
        # a member not heard from since the sidecar started (None), or one that registered
        # unlimited and has not reported its limit yet (its capacity), blocks every grow:
        # the sidecar's own bound is then not the budget (the /proc check still holds)
        if None in held or max(held) > BUDGET:
            continue
        assert sum(held) <= BUDGET, (  # which phase, and each member's figures
            s.phase,
            s.t,
            {
                iid: {
                    k: x.get(k)
                    for k in ("status", "limit_bytes", "target_bytes", "mapped_bytes")
                    + ("committed_bytes", "reason")
                }
                for iid, x in m.items()
            },
            s.held,
            s.proc,
        )


MIN_SAMPLES = 21  # /proc rounds a test wants before it judges (Watch.wait_total)


def _proc_within_budget(watch: Watch) -> None:
    assert len(watch.samples) >= MIN_SAMPLES
    over = watch.over_budget()
    assert not over, [(s.t, s.proc) for s in over[:5]]


def _fill_a_then_idle(rig: Rig, seed: int) -> int:
    """``a`` fills its prefix cache under load, then idles back to half the budget, its
    cache kept up to that limit: the memory a premature grow of ``b`` would overlap. It
    starts from the idle split: a load the scenario before ended less than a busy hold ago
    still holds its demand (docs/autopilot.md), and ``a`` would cache less meanwhile."""
    rig.settle()
    a = rig.engines["a"]
    with Load(a, words=500, max_tokens=1, workers=4, seed=seed, count=16) as load:
        load.wait_done()
    assert not load.failures, load.failures
    dev = rig.settle()
    a_old = _limit(dev, "a")
    assert a.server.kv_memfd_bytes() >= BUDGET // 4, "a's cache should hold memory b would want"
    return a_old


def _freeze(watch: Watch, rig: Rig, name: str) -> None:
    watch.silent.add(name)  # its socket will not answer
    rig.engines[name].signal_group(signal.SIGSTOP)
    watch.phase = "frozen"  # after SIGSTOP: every round counted frozen saw it stopped


def _thaw(watch: Watch, rig: Rig, name: str) -> None:
    watch.phase = "thawed"  # before SIGCONT: no round counted frozen saw the engine run
    rig.engines[name].signal_group(signal.SIGCONT)
    watch.silent.discard(name)


def _held_back(rig: Rig, room: int) -> bool:
    """A device view where the policy wants ``b`` above ``room`` (its target) while its
    limit is still within it: a grow the sidecar holds back."""
    b = members(rig.device())["b"]
    return b["target_bytes"] is not None and b["target_bytes"] > room >= b["limit_bytes"]


def _check_shift(watch: Watch, a_old: int) -> None:
    """The evidence of one shift from a frozen ``a`` to a loaded ``b``."""
    room_b = BUDGET - a_old  # what b may hold while a holds a_old
    frozen = during(watch.samples, "frozen")
    frozen_views = [m for _, m in iter_devices(frozen)]
    # while a was frozen the sidecar lowered its limit and wanted b above room_b ...
    assert any(
        m["a"]["limit_bytes"] < a_old and (m["b"]["target_bytes"] or 0) > room_b
        for m in frozen_views
    ), "no shift decided while a was frozen"
    # ... and did not grow b: a could not report applied
    for m in frozen_views:
        assert m["b"]["limit_bytes"] <= room_b, m
    b_held = [s.held["b"] for s in frozen if s.held.get("b") is not None]
    assert b_held and max(b_held) <= room_b, b_held
    # b grew afterwards, and in every view where b is above room_b, a had reported applied
    # under its lower limit (one atomic snapshot: the order the sidecar saw)
    raised = [m for _, m in iter_devices(watch.samples) if m["b"]["limit_bytes"] > room_b]
    assert raised, "b never grew"
    for m in raised:
        assert m["a"]["status"] == "applied" and m["a"]["limit_bytes"] < a_old, m
        assert m["a"]["mapped_bytes"] + m["b"]["limit_bytes"] <= BUDGET, m
    # physically: the limit b's engine holds plus what idle a maps (read after it) fits
    for s in watch.samples:
        held = s.held.get("b")
        if held is not None:
            assert held + s.proc["a"] <= BUDGET, s
    _committed_within_budget(watch.samples)
    _proc_within_budget(watch)


def _shift_to_b_with_a_frozen(
    rig: Rig, watch: Watch, a_old: int, *, on_decided: Callable[[], None] | None = None
) -> Load:
    """Freeze a, load b, wait until the sidecar lowered a's limit and holds b's grow back;
    ``on_decided`` runs then (a still frozen); then ten more device views, and a thaws.
    Returns b's load (running)."""
    room_b = BUDGET - a_old
    _freeze(watch, rig, "a")
    load = Load(rig.engines["b"], seed=50_000 + len(watch.samples), **B_LOAD).__enter__()
    try:
        wait_until(lambda: _limit(rig.device(), "a") < a_old, timeout_s=30, what="a's shrink")
        wait_until(lambda: _held_back(rig, room_b), timeout_s=30, what="b's grow held back")
        if on_decided is not None:
            on_decided()
            wait_until(lambda: _held_back(rig, room_b), timeout_s=30, what="held back again")
        watch.wait_samples(10)  # the sidecar had its chances to (wrongly) grow b
    finally:
        _thaw(watch, rig, "a")
    return load


def test_b_grows_only_after_a_reports_its_shrink_applied(rig: Rig) -> None:
    a_old = _fill_a_then_idle(rig, seed=10_000)
    with Watch(rig) as watch:
        load = _shift_to_b_with_a_frozen(rig, watch, a_old)
        wait_until(lambda: _limit(rig.device(), "b") > BUDGET - a_old, timeout_s=30, what="b grown")
        watch.wait_samples(5)
        watch.wait_total(MIN_SAMPLES)
        load.stop()
    assert not load.failures and load.ok, load.failures
    _check_shift(watch, a_old)
    metrics = rig.http.get("/metrics").text
    assert "kvsidecar_autopilot_apply_seconds_count" in metrics


def test_an_operator_pin_holds_until_delete(rig: Rig) -> None:
    rig.settle()
    pin = 2 * MiB
    reply = rig.http.put("/instances/a/limit", json={"limit": pin})
    assert reply.status_code == 200, reply.text
    assert reply.json()["policy"]["pinned"] is True
    wait_until(
        lambda: (
            (v := rig.instance("a"))["status"] == "applied"
            and v["desired"]["limit_bytes"] == pin
            and v["policy"]["source"] == "operator"
        ),
        timeout_s=30,
        what="a at its pin",
    )
    with Watch(rig) as watch, Load(rig.engines["b"], seed=60_000, **B_LOAD) as load:
        # b wants the whole budget; the pin keeps a where it is (idle, the policy
        # alone would take a down to its floor)
        wait_until(
            lambda: _limit(rig.device(), "b") == BUDGET - pin,
            timeout_s=30,
            what="b at the budget less the pin",
        )
        watch.wait_samples(10)
        pinned = list(watch.samples)
        watch.phase = "unpinned"
        reply = rig.http.delete("/instances/a/limit")
        assert reply.status_code == 200, reply.text
        assert reply.json()["policy"]["pinned"] is False
        wait_until(lambda: _limit(rig.device(), "b") > BUDGET - pin, timeout_s=30, what="b grown")
        watch.wait_samples(5)
        watch.wait_total(MIN_SAMPLES)
    assert not load.failures and load.ok, load.failures
    for _, m in iter_devices(pinned):
        assert m["a"]["limit_bytes"] == pin and m["a"]["pinned"], m
        assert m["a"]["source"] == "operator", m
        assert m["b"]["limit_bytes"] <= BUDGET - pin, m
    view = rig.instance("a")
    assert view["policy"]["source"] == "policy" and view["policy"]["reason"], view["policy"]
    assert view["desired"]["limit_bytes"] < pin
    # after DELETE: b above BUDGET - pin only once a reported its lower limit applied
    for _, m in iter_devices(watch.samples):
        if m["b"]["limit_bytes"] > BUDGET - pin:
            assert m["a"]["status"] == "applied" and m["a"]["limit_bytes"] < pin, m
    _committed_within_budget(watch.samples)
    _proc_within_budget(watch)


def test_min_and_max_bound_the_shares_under_load(rig: Rig) -> None:
    rig.settle()
    a_min, b_max = 3 * MiB, 4 * MiB
    for iid, body in (("a", {"min": a_min}), ("b", {"max": b_max})):
        reply = rig.http.put(f"/instances/{iid}/policy", json=body)
        assert reply.status_code == 200, reply.text
    try:
        with Watch(rig) as watch, Load(rig.engines["b"], seed=70_000, **B_LOAD) as load:
            wait_until(
                lambda: (
                    rig.running("b") > 0
                    and (m := members(rig.device()))["b"]["limit_bytes"] == b_max
                    and m["a"]["limit_bytes"] >= a_min
                ),
                timeout_s=30,
                what="b busy at its max",
            )
            watch.wait_samples(10)
            # b busy: without the max it would take what a's min leaves
            bounded = [
                s for s in watch.samples if s.states.get("b", {}).get("num_running_requests")
            ]
            # back to the defaults: b (still loaded) grows past its old max
            for iid, body in (("a", {"min": None}), ("b", {"max": None})):
                reply = rig.http.put(f"/instances/{iid}/policy", json=body)
                assert reply.status_code == 200, reply.text
            wait_until(
                lambda: _limit(rig.device(), "b") > b_max, timeout_s=30, what="b past the max"
            )
            watch.wait_samples(5)
            watch.wait_total(MIN_SAMPLES)
    finally:
        for iid, body in (("a", {"min": None}), ("b", {"max": None})):
            rig.http.put(f"/instances/{iid}/policy", json=body)
    assert not load.failures and load.ok, load.failures
    assert bounded
    for s in bounded:  # b busy, yet within its max; a (idle) keeps its min
        if s.device is not None:
            m = members(s.device)
            assert m["b"]["limit_bytes"] <= b_max and m["a"]["limit_bytes"] >= a_min, m
        assert s.held.get("b") is None or s.held["b"] <= b_max, s
        assert s.proc["b"] <= b_max, s
    # memory left free rather than given to b above its max (idle a is at its min)
    assert any(s.device["free_bytes"] > 0 for s in bounded if s.device is not None)
    _committed_within_budget(watch.samples)
    _proc_within_budget(watch)


def test_sidecar_killed_mid_change_keeps_the_budget_after_restart(rig: Rig) -> None:
    a_old = _fill_a_then_idle(rig, seed=20_000)

    def restart() -> None:  # a's shrink is written, not applied: the sidecar dies now
        rig.kill9_sidecar()
        rig.start_sidecar()
        # the new process: a has not reported to it, b has (it waits for memory)
        wait_until(
            lambda: members(rig.device())["b"]["committed_bytes"] is not None,
            timeout_s=30,
            what="b reported to the new sidecar",
        )

    with Watch(rig) as watch:
        load = _shift_to_b_with_a_frozen(rig, watch, a_old, on_decided=restart)
        wait_until(lambda: _limit(rig.device(), "b") > BUDGET - a_old, timeout_s=30, what="b grown")
        watch.wait_samples(5)
        watch.wait_total(MIN_SAMPLES)
        load.stop()
    assert not load.failures and load.ok, load.failures
    assert any(s.device is None for s in watch.samples), "no round saw the sidecar down"
    frozen_after_restart = [
        m
        for s, m in iter_devices(during(watch.samples, "frozen"))
        if m["a"]["committed_bytes"] is None
    ]
    assert frozen_after_restart, "no view of the new sidecar before a reported"
    _check_shift(watch, a_old)


def test_engine_killed_mid_load_memory_reassigned_then_fitted_on_return(rig: Rig) -> None:
    """kill -9 of ``a`` (output reservation on) while both engines serve: ``b`` gets its
    memory once ``a`` is ``unreachable`` (and maps it), ``a``'s limit is kept; ``a`` comes
    back under the same id and is fitted into what ``b`` left. The budget holds at every
    /proc sample, the returning engine's start-up included."""
    rig.settle()
    a, b = rig.engines["a"], rig.engines["b"]
    both = {"words": 400, "max_tokens": 64, "workers": 6}
    with Watch(rig) as watch:
        with Load(b, seed=80_000, **both) as load_b:
            with Load(a, seed=90_000, **both) as load_a:
                watch.wait_samples(5)
                # killed while its last report shows requests running under a share of
                # its own: the limit it keeps for its return is more than its floor; and
                # after it answered at least one (a CI run killed it before any had)
                wait_until(
                    lambda: (
                        load_a.ok > 0
                        and rig.running("a") > 0
                        and rig.running("b") > 0
                        and _limit(rig.device(), "a") >= BUDGET // 4
                    ),
                    timeout_s=30,
                    period_s=0.005,
                    what="both engines running requests",
                )
                watch.silent.add("a")
                watch.phase = "dead"
                a.kill9()
            assert load_a.ok, load_a.failures
            wait_until(
                lambda: rig.instance("a")["status"] == "unreachable",
                timeout_s=HEARTBEAT_TIMEOUT_S * 3,
                what="a unreachable",
            )
            page = rig.instance("a")["observed"]["page_bundle_bytes"]
            wait_until(  # b busy: all of it but a's floor (kept for a's return)
                lambda: _limit(rig.device(), "b") >= BUDGET - 2 * page,
                timeout_s=30,
                what="b given a's memory",
            )
            watch.wait_samples(5)  # views of the reassignment, still in the "dead" phase
            kept = _limit(rig.device(), "a")
            a_held = [
                m["a"]["committed_bytes"]
                for _, m in iter_devices(during(watch.samples, "dead"))
                if m["a"]["status"] != "unreachable"
            ][-1]  # what a could hold the last time it counted
            wait_until(
                lambda: watch.samples[-1].proc["b"] > BUDGET - a_held,
                timeout_s=60,
                what="b maps memory that was a's",
            )
        assert not load_b.failures and load_b.ok, load_b.failures
        # b, idle now, keeps what it maps (its prefix cache) while a starts again
        assert rig.instance("a")["desired"]["limit_bytes"] == kept  # kept for its return
        watch.phase = "returning"
        returned = rig.start_engine("a")
        watch.silent.discard("a")
        with Load(returned, seed=95_000, **both) as load_a2, Load(b, seed=85_000, **both):
            wait_until(lambda: rig.running("a") > 0, timeout_s=30, what="a serves again")
            watch.wait_samples(10)
            watch.wait_total(MIN_SAMPLES)
    assert not load_a2.failures and load_a2.ok, load_a2.failures
    dead = [m for _, m in iter_devices(during(watch.samples, "dead"))]
    before = [m for m in dead if m["a"]["status"] != "unreachable"]
    assert before and any(m["a"]["status"] == "unreachable" for m in dead)
    for m in before:  # silent, not yet unreachable: what a may hold is not b's
        assert m["b"]["limit_bytes"] + m["a"]["committed_bytes"] <= BUDGET, m
    given = [i for i, m in enumerate(dead) if m["b"]["limit_bytes"] >= BUDGET - 2 * page]
    assert given and all(m["a"]["status"] == "unreachable" for m in dead[given[0] :])
    for m in dead[given[0] :]:  # reassigned: a's own limit is kept for its return
        assert m["a"]["limit_bytes"] == kept, m
    # back: its kept limit, fitted into what b left when it no longer fits (the usual case:
    # b holds all but a's floor), as the first thing the sidecar says of it
    fits = [
        e
        for e in rig.log_events("autopilot_change")
        if e["instance"] == "a" and e["reason"] == "returned_fit"
    ]
    back = [m["a"] for _, m in iter_devices(during(watch.samples, "returning"))]
    back = [x for x in back if x["status"] != "unreachable"]
    assert back, "no view of a after its return"
    if kept > page:
        assert fits and fits[-1]["old_limit_bytes"] == kept, fits
        assert fits[-1]["new_limit_bytes"] < kept
    else:  # it died idle (its floor): that fits as it is
        assert not fits and back[0]["limit_bytes"] == kept, (fits, back[0])
    _committed_within_budget(watch.samples)
    _proc_within_budget(watch)
