"""The autopilot against requests that land while one of its passes (or another request) is
half-way: real HTTP on loopback, the real SQLite file, stand-in engines reporting over the
API.

A pass (and every write of the autopilot) awaits the store between its decision and its
write. To hold a request at that point the test holds the database's write lock from a
second connection, as another process would (``BEGIN IMMEDIATE``): the sidecar's writes
wait for it (its busy timeout is 5 s) and run in order once it is released. The sleeps
below only give the requests time to reach that point; what is checked is the state after
everything finished, whatever order the requests ended up in.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from autopilot_sim import GiB, SimEngine
from support import ThreadedSidecar, wait_until

from sidecar import SidecarSettings

DEV = "gpu-0"
REACH_S = 0.4  # time for a request to reach the locked store (not an assertion)


def _settings(db: Path) -> SidecarSettings:
    return SidecarSettings(db_path=db, autopilot_interval_s=0.05, autopilot_busy_hold_s=0.5)


@contextmanager
def _db_locked(db: Path) -> Iterator[None]:
    """Hold the database's write lock (another process's transaction) until the block ends."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
        conn.execute("COMMIT")
    finally:
        conn.close()


class _InFlight:
    """One request sent from its own thread (and client): it may wait on the locked store."""

    def __init__(self, url: str, send: Callable[[httpx.Client], httpx.Response]) -> None:
        self.response: httpx.Response | None = None

        def run() -> None:
            with httpx.Client(base_url=url, timeout=30) as client:
                self.response = send(client)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self) -> httpx.Response:
        self._thread.join(30)
        assert self.response is not None, "the request did not finish"
        return self.response


def _settle(c: httpx.Client, *engines: SimEngine) -> dict[str, Any]:
    def settled() -> dict[str, Any] | None:
        for e in engines:
            e.sync()
        dev: dict[str, Any] = c.get(f"/devices/{DEV}").json()
        done = all(
            m["limit_bytes"] == m["target_bytes"] and m["status"] == "applied"
            for m in dev["instances"]
        )
        return dev if done else None

    return wait_until(settled, what="the limits settled")


def test_an_instance_forgotten_while_a_pass_writes_stays_forgotten(tmp_path: Path) -> None:
    """A pass plans a shrink for ``a`` and ``x`` and is writing ``a``'s when the operator
    forgets ``x``. The pass then wrote ``x``'s limit after the forget: ``x`` was back, a
    pending instance holding the policy's limit (0 here), which its engine, if it still
    ran, would have taken as its retained limit on registering again."""
    db = tmp_path / "s.db"
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b, x = (SimEngine(c, name, DEV) for name in ("a", "b", "x"))
        for e in (a, b, x):
            assert e.register().status_code == 200
        assert c.put(f"/devices/{DEV}/budget", json={"budget": "9G"}).status_code == 200
        _settle(c, a, b, x)
        assert {m["limit_bytes"] for m in c.get(f"/devices/{DEV}").json()["instances"]} == {3 * GiB}
        with _db_locked(db):
            b.pinned, b.waiting = GiB, 6 * GiB
            b.sync(apply=False, grow=False)  # b's demand: the pass shrinks a and x
            time.sleep(REACH_S)  # the pass waits to write a's limit
            forget = _InFlight(s.url, lambda client: client.delete("/instances/x"))
            time.sleep(REACH_S)
        assert forget.result().status_code == 204
        wait_until(lambda: c.get("/instances/a").json()["desired"]["limit_bytes"] < 3 * GiB)
        time.sleep(REACH_S)  # anything the pass had left to write is written by now
        r = c.get("/instances/x")
        assert r.status_code == 404, f"x came back after it was forgotten: {r.text}"
        assert [i["id"] for i in c.get("/instances").json()["instances"]] == ["a", "b"]
        assert [m["id"] for m in c.get(f"/devices/{DEV}").json()["instances"]] == ["a", "b"]
        metrics = c.get("/metrics").text
        assert 'kv_instance="x"' not in metrics


def test_a_limit_and_a_budget_put_at_once_never_leave_a_pin_above_the_budget(
    tmp_path: Path,
) -> None:
    """``PUT a/limit 100G`` on a device without a budget, and while its write waits,
    ``PUT budget 8G``. The budget's check did not see the pin (not recorded yet) and both
    got 200; the pass then moved ``a`` to the policy's 4G and the pin took that: the
    operator was told 100G and got a pin at 4G. One of the two must be refused (the
    budget cannot hold the pin), and what was answered must be what holds."""
    db = tmp_path / "s.db"
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
        assert a.register().status_code == 200 and b.register().status_code == 200
        with _db_locked(db):
            limit = _InFlight(
                s.url, lambda cl: cl.put("/instances/a/limit", json={"limit": "100G"})
            )
            time.sleep(REACH_S)  # its write waits on the lock
            budget = _InFlight(
                s.url, lambda cl: cl.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
            )
            time.sleep(REACH_S)
        codes = (limit.result().status_code, budget.result().status_code)
        assert sorted(codes) == [200, 409], (limit.response.text, budget.response.text)
        time.sleep(REACH_S)  # passes run (the loop ticks every 0.05 s)
        for e in (a, b):
            e.sync()
        view = c.get("/instances/a").json()
        dev = c.get(f"/devices/{DEV}").json()
        if codes[0] == 200:  # the pin holds as answered; the budget was refused
            assert view["desired"]["limit_bytes"] == 100 * GiB, view
            assert view["policy"]["pinned"] is True and dev["budget_bytes"] is None, dev
        else:  # the budget holds; the pin was refused
            assert dev["budget_bytes"] == 8 * GiB and view["policy"]["pinned"] is False, view
            assert dev["sum_limits_bytes"] is not None and dev["sum_limits_bytes"] <= 8 * GiB


def test_device_limits_are_checked_against_the_budget_set_meanwhile(tmp_path: Path) -> None:
    """``PUT budget 4G`` (its write waiting) and ``PUT /devices/{id}/limits a=6G`` at once.
    The limits were checked against the budget read before the lock, 8G: both were 200 and
    a pin of 6G sat on a 4G budget (the policy then gave ``b`` less than its min)."""
    db = tmp_path / "s.db"
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
        assert a.register().status_code == 200 and b.register().status_code == 200
        assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
        _settle(c, a, b)
        with _db_locked(db):
            budget = _InFlight(
                s.url, lambda cl: cl.put(f"/devices/{DEV}/budget", json={"budget": "4G"})
            )
            time.sleep(REACH_S)  # holds the autopilot's lock while its write waits
            limits = _InFlight(
                s.url, lambda cl: cl.put(f"/devices/{DEV}/limits", json={"limits": {"a": "6G"}})
            )
            time.sleep(REACH_S)
        assert budget.result().status_code == 200, budget.response
        r = limits.result()
        assert r.status_code == 409, f"a 6G pin accepted on a 4G budget: {r.text}"
        assert c.get("/instances/a").json()["policy"]["pinned"] is False
        _settle(c, a, b)
        dev = c.get(f"/devices/{DEV}").json()
        assert dev["budget_bytes"] == 4 * GiB and dev["sum_limits_bytes"] <= 4 * GiB, dev


class _DeviceReader:
    """Polls ``GET /devices`` from its own thread and client until stopped, keeping every
    view in which the device's live limits add up to more than its live budget."""

    def __init__(self, url: str) -> None:
        self.polls = 0
        self.over: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not self._stop.is_set():
                for dev in client.get("/devices").json()["devices"]:
                    if _over_budget(dev):
                        self.over.append(dev)
                self.polls += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _over_budget(dev: dict[str, Any]) -> bool:
    """The device has a live budget (not in dry run) and its live instances' limits add up to
    more (docs/autopilot.md, "Shrink before grow": no pins or mins are involved here)."""
    total, budget = dev["sum_limits_bytes"], dev["budget_bytes"]
    return budget is not None and not dev["dry_run"] and total is not None and total > budget


def test_no_reader_sees_the_limits_above_a_budget_while_it_is_lowered_and_raised(
    tmp_path: Path,
) -> None:
    """Budgets lowered and raised at random while a reader polls ``/devices``. A lowered
    budget was shown (and answered) at once, beside the limits of the budget before it,
    until the next pass wrote the shrinks: the sum of limits read above the budget."""
    db = tmp_path / "s.db"
    rng = random.Random(7)
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        engines = [SimEngine(c, name, DEV) for name in ("a", "b", "c")]
        for e in engines:
            assert e.register().status_code == 200
        assert c.put(f"/devices/{DEV}/budget", json={"budget": "12G"}).status_code == 200
        _settle(c, *engines)
        engines[0].pinned, engines[1].waiting = GiB, 3 * GiB  # some demand, some idle
        reader = _DeviceReader(s.url)
        answers = []
        try:
            for _ in range(30):
                size = rng.choice([2, 3, 5, 8, 12, 16]) * GiB
                r = c.put(f"/devices/{DEV}/budget", json={"budget": size})
                assert r.status_code == 200, r.text
                answers.append(r.json())
                for e in rng.sample(engines, rng.randint(0, 3)):
                    e.sync(apply=rng.random() < 0.7)
        finally:
            reader.stop()
        over = [a for a in answers if _over_budget(a)]
        assert not over, f"{len(over)} budget answers over the budget, first: {over[0]}"
        assert reader.polls >= 30, reader.polls
        assert not reader.over, f"{len(reader.over)} views over the budget: {reader.over[0]}"


def test_a_pass_during_a_returning_engines_registration_does_not_grow_into_its_room(
    tmp_path: Path,
) -> None:
    """``a`` is dead and comes back; its kept 4G fits beside ``b`` (max 4G) and is answered.
    A pass that ran while a's registration waited on the store still counted ``a`` dead
    (its floor only) and grew ``b``, whose max had just been lifted, into a's 4G: both
    engines were told limits adding up to 12G on an 8G budget."""
    db = tmp_path / "s.db"
    settings = SidecarSettings(
        db_path=db,
        autopilot_interval_s=60,  # passes run on wakes only: the order below is the test's
        autopilot_busy_hold_s=0.5,
        heartbeat_timeout_s=2,  # a is declared dead; b, silent below, is not
    )
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
        assert a.register().status_code == 200 and b.register().status_code == 200
        assert c.put("/instances/b/policy", json={"max": "4G"}).status_code == 200
        assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
        _settle(c, a, b)
        assert {m["limit_bytes"] for m in c.get(f"/devices/{DEV}").json()["instances"]} == {4 * GiB}
        wait_until(  # a's engine is gone: b, at its max, does not take a's memory
            lambda: (b.sync(), c.get("/instances/a").json()["status"] == "unreachable")[1]
        )
        b_revision = c.get("/instances/b").json()["desired"]["revision"]
        back = SimEngine(c, "a", DEV)  # a new engine process under a's id
        with _db_locked(db):
            lift = _InFlight(s.url, lambda cl: cl.put("/instances/b/policy", json={"max": None}))
            time.sleep(REACH_S)  # holds the autopilot's lock while its write waits
            register = _InFlight(s.url, lambda cl: _register_with(back, cl))
            time.sleep(REACH_S)  # waits for the lock, then fits a and registers it
        assert lift.result().status_code == 200
        assert register.result().status_code == 200
        time.sleep(REACH_S)  # the passes the lift and a's registration woke have run
        assert back.limit == 4 * GiB  # its kept limit fitted
        b_view = c.get("/instances/b").json()["desired"]
        # b was not told a grow into a's 4G (shrunk again by the pass that saw a live)
        assert b_view == {**b_view, "limit_bytes": 4 * GiB, "revision": b_revision}, b_view
        dev = c.get(f"/devices/{DEV}").json()
        assert dev["sum_limits_bytes"] <= dev["budget_bytes"], dev


def _register_with(engine: SimEngine, client: httpx.Client) -> httpx.Response:
    """``engine`` registers over ``client`` (one of its own thread's)."""
    engine.client = client
    return engine.register()
