"""The autopilot over real HTTP: budgets, shrink before grow, pins, bounds, bad input.

Engines are :class:`SimEngine` stand-ins reporting over the real API; the
host-memory engines measured from /proc are in test_autopilot_engines.py.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from autopilot_sim import GiB, SimEngine, post_register, post_report
from prometheus_client.parser import text_string_to_metric_families
from support import ThreadedSidecar, wait_until

from engine_ext.protocol import Status
from sidecar import SidecarSettings

DEV = "gpu-0"


def _settings(db: Path, **kw: Any) -> SidecarSettings:
    kw = {"autopilot_interval_s": 0.05, "autopilot_busy_hold_s": 0.5, **kw}
    return SidecarSettings(db_path=db, **kw)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadedSidecar]:
    with ThreadedSidecar(_settings(tmp_path / "s.db")) as s:
        yield s


@pytest.fixture
def c(server: ThreadedSidecar) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _desired(c: httpx.Client, iid: str) -> int | None:
    limit: int | None = c.get(f"/instances/{iid}").json()["desired"]["limit_bytes"]
    return limit


def _lim(c: httpx.Client, iid: str) -> int:
    """The desired limit; unlimited reads as more than any budget."""
    limit = _desired(c, iid)
    return 1 << 62 if limit is None else limit


def _settle(c: httpx.Client, *engines: SimEngine, rounds: int = 100) -> None:
    """Let the engines follow their limits (apply) until each sits at its target."""
    for _ in range(rounds):
        for e in engines:
            e.sync()
        dev = c.get(f"/devices/{DEV}").json()
        if all(
            m["limit_bytes"] == m["target_bytes"] and m["status"] == "applied"
            for m in dev["instances"]
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"the limits did not settle: {dev}")


def test_budget_shares_the_device_and_grows_only_after_the_shrink_is_applied(
    c: httpx.Client,
) -> None:
    a = SimEngine(c, "a", DEV)
    b = SimEngine(c, "b", DEV, mapped=3 * GiB)  # B's prefix cache holds 3G
    assert a.register().status_code == 200 and b.register().status_code == 200
    r = c.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
    assert r.status_code == 200, r.text
    assert r.json()["budget_bytes"] == 8 * GiB
    _settle(c, a, b)
    assert _desired(c, "a") == _desired(c, "b") == 4 * GiB  # idle: an equal split
    # Load moves to A: B is asked to shrink; A may not grow while B holds its memory.
    a.pinned, a.waiting = 4 * GiB, 3 * GiB
    a.sync()
    wait_until(lambda: _lim(c, "b") < 3 * GiB)
    for _ in range(10):
        a.sync()
        b.sync(apply=False)  # B's pages are still in use: deferred at 3G
        time.sleep(0.05)
        assert _lim(c, "a") + b.mapped <= 8 * GiB, "A grew before B applied"
    b.sync(apply=True)  # B gives its memory back: now A grows
    wait_until(lambda: (a.sync(), b.sync(), _lim(c, "a") >= 7 * GiB)[2])
    _settle(c, a, b)
    dev = c.get(f"/devices/{DEV}").json()
    assert dev["sum_limits_bytes"] <= 8 * GiB and dev["free_bytes"] >= 0
    assert {m["id"] for m in dev["instances"]} == {"a", "b"}
    view = c.get("/instances/a").json()
    assert view["policy"]["source"] == "policy" and view["policy"]["reason"]
    assert view["policy"]["device_id"] == DEV and view["policy"]["managed"] is True
    metrics = c.get("/metrics").text
    assert 'kvsidecar_limit_changes_total{source="policy"}' in metrics
    assert "kvsidecar_autopilot_apply_seconds_count" in metrics


def test_reports_run_the_pass_the_timer_is_only_a_fallback(tmp_path: Path) -> None:
    """With a 60 s timer (longer than the test waits), the reports alone move memory: A's new
    demand makes B shrink, and B's ``applied`` report makes A grow, with no report from A
    in between."""
    with (
        ThreadedSidecar(_settings(tmp_path / "s.db", autopilot_interval_s=60)) as s,
        httpx.Client(base_url=s.url, timeout=30) as c,
    ):
        a = SimEngine(c, "a", DEV)
        b = SimEngine(c, "b", DEV, mapped=3 * GiB)
        assert a.register().status_code == 200 and b.register().status_code == 200
        assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
        _settle(c, a, b)  # each report (taking the split) runs a pass: no tick needed
        assert _desired(c, "a") == _desired(c, "b") == 4 * GiB
        a.pinned, a.waiting = 1 * GiB, 6 * GiB
        a.sync()  # A's demand changes: B is asked to shrink at once
        wait_until(lambda: _lim(c, "b") <= 1 * GiB, what="B asked to shrink")
        for _ in range(5):
            b.sync(apply=False)  # B still holds its pages (deferred): A may not grow
            assert _lim(c, "a") + b.mapped <= 8 * GiB, "A grew before B applied"
        b.sync(apply=True)  # B's applied report: A grows now, without a report of A's
        wait_until(lambda: _lim(c, "a") >= 7 * GiB, what="A grown after B's applied")
        assert _lim(c, "a") + _lim(c, "b") <= 8 * GiB


def test_a_deferred_shrink_frees_nothing_while_its_requests_may_still_grow(
    c: httpx.Client,
) -> None:
    """With the output reservation an engine takes a lower limit, maps less than it, and is
    still ``deferred``: its running requests, admitted under the old limit, add their output
    up to it. The engine reports the new limit from the moment it takes it; the sidecar
    must not hand the old one's memory to another engine until ``applied``."""
    a = SimEngine(c, "a", DEV)
    b = SimEngine(c, "b", DEV)
    assert a.register().status_code == 200 and b.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    _settle(c, a, b)
    assert _desired(c, "b") == 4 * GiB
    # B runs a request admitted under 4G: 1G mapped, 3G of its output still to come
    b.pinned, b.mapped, b.reserved = GiB, GiB, 3 * GiB
    b.sync(apply=False)
    # an operator caps B at 1G while A wants everything: B is asked to shrink
    assert c.put("/instances/b/policy", json={"max": "1G"}).status_code == 200
    a.pinned, a.waiting = GiB, 7 * GiB
    a.sync()
    wait_until(lambda: _lim(c, "b") <= GiB, what="B asked to shrink")
    deferred = 0
    for _ in range(10):
        a.sync()
        b.sync(apply=False)  # takes 1G, maps 1G, and its output is still to come
        deferred += c.get("/instances/b").json()["status"] == "deferred"
        time.sleep(0.05)
        assert _lim(c, "a") + b.mapped + b.reserved <= 8 * GiB, "A grew into B's outputs"
    assert deferred == 10
    b.mapped, b.reserved, b.pinned = b.mapped + b.reserved, 0, 0  # the outputs came
    b.sync(apply=False)
    assert _lim(c, "a") + b.mapped <= 8 * GiB, "A grew into B's outputs"
    b.mapped = 0  # the request finished and its pages were freed: applied, A grows
    wait_until(lambda: (a.sync(), b.sync(), _lim(c, "a") >= 7 * GiB)[2], what="A grown")
    assert _lim(c, "a") + _lim(c, "b") <= 8 * GiB


def test_operator_pin_wins_until_delete(c: httpx.Client) -> None:
    a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
    a.register(), b.register()
    a.pinned = b.pinned = 0
    c.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
    _settle(c, a, b)
    assert _desired(c, "a") == _desired(c, "b") == 4 * GiB  # idle: an equal split
    r = c.put("/instances/a/limit", json={"limit": "6G"})
    assert r.status_code == 200, r.text
    assert r.json()["policy"]["pinned"] is True
    _settle(c, a, b)
    assert _desired(c, "a") == 6 * GiB and _desired(c, "b") == 2 * GiB
    assert c.get("/instances/a").json()["policy"]["source"] == "operator"
    b.waiting = 6 * GiB  # B's demand does not move A's pinned limit
    _settle(c, a, b)
    assert _desired(c, "a") == 6 * GiB and _desired(c, "b") == 2 * GiB
    assert c.delete("/instances/a/limit").status_code == 200
    _settle(c, a, b)
    assert c.get("/instances/a").json()["policy"]["pinned"] is False
    assert _lim(c, "b") > 2 * GiB and _lim(c, "a") < 6 * GiB
    assert _lim(c, "a") + _lim(c, "b") <= 8 * GiB
    # an unlimited pin on a budgeted device is refused, nothing changed
    r = c.put("/instances/a/limit", json={"limit": None})
    assert r.status_code == 409 and "cannot be unlimited" in r.json()["detail"]
    assert c.get("/instances/a").json()["policy"]["pinned"] is False


def test_revisions_of_a_pin_on_a_budgeted_device_are_kept(tmp_path: Path) -> None:
    """A client's revision on a budgeted device is recorded with the pin: an older one is
    stale, the same one with another limit a conflict, a repeat idempotent, also while the
    pin waits for room (a grow, shrink before grow) and after a restart."""
    db = tmp_path / "rev.db"
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV, mapped=4 * GiB)
        a.register(), b.register()
        assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
        _settle(c, a, b)
        r = c.put("/instances/a/limit", json={"limit": "2G", "revision": 100})
        assert r.status_code == 200, r.text
        assert r.json()["desired"] == {
            **r.json()["desired"],
            "limit_bytes": 2 * GiB,
            "revision": 100,
        }
        for body, verdict in (
            ({"limit": "1G", "revision": 50}, "stale"),
            ({"limit": "3G", "revision": 100}, "conflict"),
        ):
            r = c.put("/instances/a/limit", json=body)
            assert r.status_code == 409 and r.json()["revision_status"] == verdict, r.text
        r = c.put("/instances/a/limit", json={"limit": "2G", "revision": 100})
        assert r.status_code == 200 and r.json()["desired"]["revision"] == 100  # a repeat
        assert (
            _desired(c, "a") == 2 * GiB
            and c.get("/instances/a").json()["policy"]["pin_bytes"] == 2 * GiB
        )
        # a grow into memory B still maps waits (B does not apply): the pin holds its revision
        for e in (a, b):
            e.sync(apply=False)
        r = c.put("/instances/a/limit", json={"limit": "6G", "revision": 200})
        assert r.status_code == 200, r.text
        assert _desired(c, "a") < 6 * GiB, "A grew before B gave its memory back"
        for body, verdict in (
            ({"limit": "5G", "revision": 150}, "stale"),
            ({"limit": "5G", "revision": 200}, "conflict"),
        ):
            r = c.put("/instances/a/limit", json=body)
            assert r.status_code == 409 and r.json()["revision_status"] == verdict, r.text
        assert c.put("/instances/a/limit", json={"limit": "6G", "revision": 200}).status_code == 200
        assert c.get("/instances/a").json()["policy"]["pin_bytes"] == 6 * GiB
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a.client = b.client = c
        r = c.put("/instances/a/limit", json={"limit": "5G", "revision": 200})
        assert r.status_code == 409 and r.json()["revision_status"] == "conflict", r.text
        b.sync()  # B applies its shrink: A's pin is written, under the client's revision
        wait_until(lambda: (a.sync(), b.sync(), _desired(c, "a") == 6 * GiB)[2], what="A grown")
        assert c.get("/instances/a").json()["desired"]["revision"] == 200
        assert c.put("/instances/a/limit", json={"limit": "6G", "revision": 200}).status_code == 200
        r = c.put("/instances/a/limit", json={"limit": "4G"})  # no revision: the next one
        assert r.status_code == 200 and r.json()["desired"]["revision"] == 201, r.text


def test_a_device_whose_pass_fails_does_not_hold_the_others_back(
    server: ThreadedSidecar, c: httpx.Client
) -> None:
    """A pass that raises on one device (a bug, a bad figure) is logged and retried; the
    loop still runs every other device's pass, also those sorted after it."""
    autopilot = server.server.config.app.state.autopilot
    real_pass = autopilot._pass
    failed: list[str] = []

    async def failing_pass(device_id: str, dev: object = None) -> None:
        if device_id == "a-broken-dev":
            failed.append(device_id)
            raise RuntimeError("a bug in one device's pass")
        await real_pass(device_id, dev)

    broken = SimEngine(c, "z", "a-broken-dev")
    assert broken.register().status_code == 200
    # budgeted before its pass breaks: a first budget's PUT runs the pass itself
    assert c.put("/devices/a-broken-dev/budget", json={"budget": "4G"}).status_code == 200
    autopilot._pass = failing_pass
    a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
    for e in (a, b):
        assert e.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    _settle(c, a, b)
    assert _desired(c, "a") == _desired(c, "b") == 4 * GiB
    assert failed, "the broken device's pass never ran"


def test_min_max_and_weight_bound_the_shares(c: httpx.Client) -> None:
    a, b, d = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV), SimEngine(c, "d", DEV)
    for e in (a, b, d):
        e.register()
    assert c.put("/instances/a/policy", json={"min": "3G"}).status_code == 200
    assert c.put("/instances/b/policy", json={"max": "1G"}).status_code == 200
    r = c.put("/instances/d/policy", json={"weight": 3})
    assert r.status_code == 200 and r.json()["policy"]["weight"] == 3
    c.put(f"/devices/{DEV}/budget", json={"budget": "9G"})
    _settle(c, a, b, d)
    la, lb, ld = (_lim(c, i) for i in ("a", "b", "d"))
    assert la >= 3 * GiB and lb <= GiB and ld > la - 3 * GiB
    assert la + lb + ld <= 9 * GiB
    # null resets a field to its default
    assert c.put("/instances/b/policy", json={"max": None}).json()["policy"]["max_bytes"] is None


def test_bad_input_is_a_clear_4xx_and_changes_nothing(c: httpx.Client) -> None:
    a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
    a.register(), b.register()
    c.put("/instances/a/policy", json={"min": "3G"})
    c.put("/instances/b/policy", json={"min": "3G"})
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    before = c.get(f"/devices/{DEV}").json()

    r = c.put(f"/devices/{DEV}/budget", json={"budget": "5G"})  # below the sum of mins
    assert r.status_code == 409 and "below what its instances are promised" in r.json()["detail"]
    r = c.put("/instances/a/policy", json={"min": "6G"})  # the mins would not fit
    assert r.status_code == 409
    r = c.put("/instances/a/policy", json={"min": "2G", "max": "1G"})  # min > max
    assert r.status_code == 422 and "above max" in r.json()["detail"]
    r = c.put("/instances/a/policy", json={"weight": -1})
    assert r.status_code == 422 and "weight" in r.text
    r = c.put("/instances/a/policy", json={"weight": 0})
    assert r.status_code == 422
    assert c.put("/instances/zz/policy", json={"weight": 2}).status_code == 404
    for method, path, body in (
        ("GET", "/devices/nope", None),
        ("PUT", "/devices/nope/budget", {"budget": "1G"}),
        ("PUT", "/devices/nope/limits", {"limits": {"a": "1G"}}),
    ):
        r = c.request(method, path, json=body)
        assert r.status_code == 404 and "KVSIDECAR_DEVICE_ID" in r.json()["detail"], r.text
    r = c.put(f"/devices/{DEV}/limits", json={"limits": {"a": "1G", "ghost": "1G"}})
    assert r.status_code == 422 and "ghost" in r.json()["detail"]
    r = c.put(f"/devices/{DEV}/limits", json={"limits": {"a": "6G", "b": "6G"}})
    assert r.status_code == 409
    r = c.put(f"/devices/{DEV}/budget", json={"budget": "-1G"})
    assert r.status_code == 422
    r = c.put("/devices/bad id/budget", json={"budget": "1G"})
    assert r.status_code in (404, 422)
    # an instance moving devices
    r = a.register(device="gpu-1")
    assert r.status_code == 409 and "cannot move devices" in r.json()["detail"]
    assert c.get("/instances/a").json()["policy"]["device_id"] == DEV
    after = c.get(f"/devices/{DEV}").json()
    assert (after["budget_bytes"], after["revision"]) == (
        before["budget_bytes"],
        before["revision"],
    )
    assert [(m["id"], m["pinned"], m["min_bytes"]) for m in after["instances"]] == [
        (m["id"], m["pinned"], m["min_bytes"]) for m in before["instances"]
    ]
    assert "gpu-1" not in [d["id"] for d in c.get("/devices").json()["devices"]]


def test_device_limits_are_atomic_and_shrink_first(c: httpx.Client) -> None:
    a, b = SimEngine(c, "a", DEV, mapped=6 * GiB), SimEngine(c, "b", DEV)
    a.pinned = 6 * GiB
    a.register(), b.register()
    c.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
    _settle(c, a, b)  # A (busy) holds 6G under its policy limit
    assert a.mapped == 6 * GiB
    r = c.put(f"/devices/{DEV}/limits", json={"limits": {"a": "2G", "b": "6G"}})
    assert r.status_code == 200, r.text
    assert _desired(c, "a") == 2 * GiB
    for _ in range(8):  # A holds 6G (its requests run): B stays where it fits
        a.sync(apply=False)
        b.sync()
        time.sleep(0.05)
        assert _lim(c, "b") <= 2 * GiB
    a.pinned = 0
    a.sync(apply=True)
    wait_until(lambda: (b.sync(), _desired(c, "b") == 6 * GiB)[1])
    view = c.get(f"/devices/{DEV}").json()
    assert all(m["pinned"] and m["source"] == "operator" for m in view["instances"])


def test_no_device_view_shows_a_written_limit_beside_the_source_before_it(
    server: ThreadedSidecar, c: httpx.Client
) -> None:
    """The autopilot writes a limit and its source (operator or policy) in one change:
    with the service's write slowed after it returns (GETs are served meanwhile), every
    device view that shows an operator's pinned size also says ``operator``. (The source
    used to follow the limit after two awaits; CI caught one view in between.)"""
    import asyncio

    autopilot = server.server.config.app.state.autopilot
    service = autopilot._service
    real = service.set_limit

    async def slow_tail(*args: Any, **kwargs: Any) -> Any:
        view = await real(*args, **kwargs)
        await asyncio.sleep(0.3)  # the limit is written; the rest of the change waits
        return view

    a, b = SimEngine(c, "a", DEV, mapped=6 * GiB), SimEngine(c, "b", DEV)
    a.pinned = 6 * GiB
    a.register(), b.register()
    c.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
    _settle(c, a, b)
    service.set_limit = slow_tail
    try:
        pins = {"a": 2 * GiB, "b": 6 * GiB}
        r = c.put(f"/devices/{DEV}/limits", json={"limits": {"a": "2G", "b": "6G"}})
        assert r.status_code == 200, r.text
        a.pinned = 0
        views: list[dict[str, Any]] = []

        def b_grown() -> bool:
            a.sync(apply=True)
            b.sync()
            views.append(c.get(f"/devices/{DEV}").json())
            return _desired(c, "b") == 6 * GiB

        wait_until(b_grown)
        for _ in range(5):  # the grow's slow tail
            views.append(c.get(f"/devices/{DEV}").json())
            time.sleep(0.05)
    finally:
        service.set_limit = real
    seen = 0
    for view in views:
        for m in view["instances"]:
            if m["limit_bytes"] == pins[m["id"]]:
                assert m["source"] == "operator" and m["pinned"], m
                seen += 1
    assert seen > 0


def test_dry_run_shows_the_plan_and_writes_nothing(c: httpx.Client) -> None:
    a, b = SimEngine(c, "a", DEV, mapped=6 * GiB), SimEngine(c, "b", DEV)
    a.register(), b.register()
    r = c.put(f"/devices/{DEV}/budget", json={"budget": "8G", "dry_run": True})
    assert r.status_code == 200 and r.json()["dry_run"] is True
    wait_until(lambda: c.get(f"/devices/{DEV}").json()["would"] != [])
    would = {w["instance"]: w for w in c.get(f"/devices/{DEV}").json()["would"]}
    assert would["a"]["old_bytes"] is None and would["a"]["new_bytes"] <= 8 * GiB
    assert _desired(c, "a") is None and _desired(c, "b") is None
    assert c.get("/instances/a").json()["policy"]["managed"] is False
    r = c.put(f"/devices/{DEV}/budget", json={"budget": "8G", "dry_run": False})
    assert r.json()["dry_run"] is False
    wait_until(lambda: _desired(c, "a") is not None)


def _two_busy_at_4g(c: httpx.Client) -> tuple[SimEngine, SimEngine]:
    """a (4G pinned) and b (8G waiting) on an 8G budget, settled at 4G each."""
    a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
    a.register(), b.register()
    c.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
    # the budget's first limits before the load: an unlimited sim would map B's whole
    # waiting need at once (its request then runs, and its demand follows its limit)
    _settle(c, a, b)
    a.pinned, b.waiting = 4 * GiB, 8 * GiB  # both busy: 4G each
    _settle(c, a, b)
    return a, b


def test_a_dead_engine_is_reassigned_and_fits_on_return(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "d.db", heartbeat_timeout_s=0.5)
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = _two_busy_at_4g(c)
        kept = _desired(c, "a")
        assert kept == 4 * GiB
        deadline = time.monotonic() + 10
        while _lim(c, "b") < 7 * GiB:  # A is silent: unreachable, then reassigned
            assert time.monotonic() < deadline, c.get(f"/devices/{DEV}").json()
            b.sync()
            time.sleep(0.05)
        assert c.get("/instances/a").json()["status"] == "unreachable"
        assert _desired(c, "a") == kept  # kept for its return
        a.mapped = 0
        assert a.register().status_code == 200  # back: its kept limit no longer fits
        room = 8 * GiB - max(b.mapped, _lim(c, "b"))
        assert _lim(c, "a") <= room
        assert c.get("/instances/a").json()["policy"]["reason"] == "returned_fit"


def test_a_refused_registration_leaves_no_device_policy_or_fitted_limit(
    tmp_path: Path,
) -> None:
    """The service's refusals (instance cap, an inconsistent state) come before anything
    the autopilot stores for a registration: its device (a policy row, a device in
    GET /devices) and the fit of a returning engine's kept limit."""
    db = tmp_path / "r.db"
    settings = _settings(db, heartbeat_timeout_s=0.5, max_instances=2)
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = _two_busy_at_4g(c)
        # a third id on another device, at the cap: 409, and no trace of it or its device
        r = SimEngine(c, "third", "gpu-7").register()
        assert r.status_code == 409 and "KVSIDECAR_MAX_INSTANCES" in r.json()["detail"]
        assert "gpu-7" not in [d["id"] for d in c.get("/devices").json()["devices"]]
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            ids = {row[0] for row in conn.execute("SELECT id FROM policies")}
        assert ids == {"a", "b"}
        # a dies; b is given its memory; a's kept limit no longer fits
        deadline = time.monotonic() + 10
        while _lim(c, "b") < 7 * GiB:
            assert time.monotonic() < deadline, c.get(f"/devices/{DEV}").json()
            b.sync()
            time.sleep(0.05)
        before = c.get("/instances/a").json()
        # its return with a state that contradicts itself (applied above its own limit)
        lie = a.state(apply=False).model_copy(
            update={"status": Status.APPLIED, "mapped_bytes": 6 * GiB}
        )
        r = post_register(c, "a", lie, a.capacity, DEV)
        assert r.status_code == 422 and "inconsistent report" in r.json()["detail"], r.text
        after = c.get("/instances/a").json()
        assert after["desired"] == before["desired"]  # not fitted: no new limit, revision
        assert after["policy"]["reason"] != "returned_fit"
        assert after["status"] == "unreachable"
        # the same return, consistent: fitted at once
        a.mapped = 0
        assert a.register().status_code == 200
        assert c.get("/instances/a").json()["policy"]["reason"] == "returned_fit"


def test_a_silent_engine_that_reports_again_is_fitted_at_once(tmp_path: Path) -> None:
    """A frozen (not dead) engine: silent past the heartbeat timeout, so B grows into its
    room, then it reports again, the same report as before it went silent (it never
    registered again). Its return alone must run a pass (the 60 s timer is the fallback
    only; B says nothing more): the limits fit the budget again at once."""
    settings = _settings(tmp_path / "f.db", heartbeat_timeout_s=0.5, autopilot_interval_s=60)
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = _two_busy_at_4g(c)
        wait_until(  # A is silent
            lambda: c.get("/instances/a").json()["status"] == "unreachable", what="unreachable"
        )
        b.waiting += GiB  # B's demand moves: a pass, which grows B into A's room
        wait_until(lambda: (b.sync(), _lim(c, "b") >= 7 * GiB)[1], what="B grown")
        assert _lim(c, "a") + _lim(c, "b") > 8 * GiB  # A's limit was kept for its return
        a.sync(grow=False)  # it wakes up: the same state it reported before
        wait_until(
            lambda: _lim(c, "a") + _lim(c, "b") <= 8 * GiB,
            what="the limits fitted to the budget after A's return",
        )
        assert c.get("/instances/a").json()["status"] != "unreachable"


def test_a_limit_set_on_an_engines_socket_is_fitted_at_once_on_a_budgeted_device(
    tmp_path: Path,
) -> None:
    """``kvctl --socket`` bypasses the sidecar: the engine takes a newer revision with 8G on
    a device whose budget gives it 4G. The sidecar adopts the revision (the newest wins);
    the adoption alone must run a pass (the timer is 60 s), which writes the policy's
    limit over it, so the limits fit the budget again at once."""
    settings = _settings(tmp_path / "k.db", autopilot_interval_s=60)
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
        a.register(), b.register()
        c.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
        _settle(c, a, b)
        assert _lim(c, "a") == _lim(c, "b") == 4 * GiB
        a.revision, a.limit = a.revision + 1, 8 * GiB  # set on its socket directly
        a.sync(grow=False)  # its report carries the newer revision: adopted
        wait_until(
            lambda: _lim(c, "a") + _lim(c, "b") <= 8 * GiB,
            what="the adopted limit replaced by one that fits the budget",
        )


def test_sidecar_restart_mid_change_keeps_the_budget(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV, mapped=3 * GiB)
        a.register(), b.register()
        c.put(f"/devices/{DEV}/budget", json={"budget": "8G"})
        _settle(c, a, b)
        a.pinned, a.waiting = 4 * GiB, 3 * GiB
        wait_until(lambda: (a.sync(), b.sync(apply=False), _lim(c, "b") < 3 * GiB)[2])
    # the sidecar is gone mid-change: B was asked to shrink and still holds 3G
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a.client = b.client = c
        assert c.get(f"/devices/{DEV}").json()["budget_bytes"] == 8 * GiB
        for _ in range(10):
            a.sync()
            b.sync(apply=False)
            time.sleep(0.05)
            assert _lim(c, "a") + b.mapped <= 8 * GiB
        b.sync(apply=True)
        wait_until(lambda: (a.sync(), b.sync(), _lim(c, "a") >= 7 * GiB)[2])
        assert _lim(c, "a") + _lim(c, "b") <= 8 * GiB


@pytest.mark.parametrize("retained", ["6G", None])
def test_a_retained_limit_the_budget_cannot_hold_is_not_pinned_when_its_engine_joins(
    c: httpx.Client, retained: str | None
) -> None:
    """``PUT b/limit`` before b's engine ever ran pins b, unchecked (no device known yet).
    When b joined a device whose budget cannot hold it beside a's min, the pin was kept:
    with 6G, a (min 6G) was cut to 2G, ``budget_short``; unlimited became a pin at the 0
    b was fitted to, for good. Such a pin is dropped: b follows the policy, a keeps its
    min, and the sum of limits stays within the budget."""
    a = SimEngine(c, "a", DEV)
    assert a.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    assert c.put("/instances/a/policy", json={"min": "6G"}).status_code == 200
    _settle(c, a)
    assert _desired(c, "a") == 8 * GiB
    r = c.put("/instances/b/limit", json={"limit": retained})
    assert r.status_code == 200 and r.json()["status"] == "pending", r.text
    assert r.json()["policy"]["pinned"] is True
    b = SimEngine(c, "b", DEV)
    assert b.register().status_code == 200
    _settle(c, a, b)
    view = c.get("/instances/b").json()
    assert view["policy"]["pinned"] is False and view["policy"]["source"] == "policy", view
    assert view["policy"]["managed"] is True
    dev = c.get(f"/devices/{DEV}").json()
    # a's min holds; the 2G it leaves are split evenly (both idle)
    assert (_desired(c, "a"), _desired(c, "b")) == (7 * GiB, 1 * GiB), dev
    assert dev["sum_limits_bytes"] <= 8 * GiB


def test_a_retained_limit_the_budget_holds_stays_pinned_when_its_engine_joins(
    c: httpx.Client,
) -> None:
    """The same with a retained limit that fits beside a's min: it is the operator's pin."""
    a = SimEngine(c, "a", DEV)
    assert a.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    assert c.put("/instances/a/policy", json={"min": "6G"}).status_code == 200
    assert c.put("/instances/b/limit", json={"limit": "2G"}).status_code == 200
    b = SimEngine(c, "b", DEV)
    assert b.register().status_code == 200
    _settle(c, a, b)
    view = c.get("/instances/b").json()
    assert view["policy"]["pinned"] is True and view["policy"]["pin_bytes"] == 2 * GiB, view
    assert _desired(c, "b") == 2 * GiB and _desired(c, "a") == 6 * GiB


def _policy_changes(c: httpx.Client) -> float:
    """``kvsidecar_limit_changes_total{source="policy"}``, read with Prometheus' own parser."""
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "kvsidecar_limit_changes_total" and sample.labels == {
                "source": "policy"
            }:
                return sample.value
    return 0.0


def _two_busy_on_8g(c: httpx.Client) -> tuple[SimEngine, SimEngine]:
    """a (4G of demand) and b (1G) busy on an 8G budget, settled: each its demand, then
    half of the 3G left."""
    a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
    assert a.register().status_code == 200 and b.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    a.pinned, b.pinned = 4 * GiB, 1 * GiB
    _settle(c, a, b)
    assert (_desired(c, "a"), _desired(c, "b")) == (5.5 * GiB, 2.5 * GiB)
    return a, b


def test_a_gap_between_a_busy_instances_requests_moves_no_memory(tmp_path: Path) -> None:
    """Two busy instances share the spare after their demands. A gap between a's requests
    (its demand 0 for a moment, well within the busy hold) moved 2G to b and back: 4 limit
    writes per gap, 40 for 10 gaps. The demand seen within the hold holds, so the gaps
    move nothing; once the hold is over a's lower demand does move memory."""
    settings = _settings(tmp_path / "s.db", autopilot_busy_hold_s=3600)
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = _two_busy_on_8g(c)
        before = _policy_changes(c)
        revisions = {i: c.get(f"/instances/{i}").json()["desired"]["revision"] for i in "ab"}
        for _ in range(10):
            for demand in (0, 4 * GiB):  # a's request ends, the next one starts
                a.pinned = demand
                for _ in range(4):
                    a.sync(), b.sync()
                    time.sleep(0.05)  # passes run (the loop ticks every 0.05 s)
        assert _policy_changes(c) - before == 0
        assert {
            i: c.get(f"/instances/{i}").json()["desired"]["revision"] for i in "ab"
        } == revisions
        assert (_desired(c, "a"), _desired(c, "b")) == (5.5 * GiB, 2.5 * GiB)


def test_a_busy_instances_demand_holds_only_for_the_busy_hold(tmp_path: Path) -> None:
    """Past the busy hold, a demand that fell moves memory: a drops from 4G to 1G and b,
    busy with 1G, gets a larger share."""
    settings = _settings(tmp_path / "s.db", autopilot_busy_hold_s=0.3)
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = _two_busy_on_8g(c)
        a.pinned = a.mapped = 1 * GiB  # a's load falls and stays low (both still busy)
        wait_until(
            lambda: (a.sync(), b.sync(), _desired(c, "b") == 4 * GiB)[2],
            what="b's share grown once a's higher demand is past the hold",
        )
        _settle(c, a, b)
        assert (_desired(c, "a"), _desired(c, "b")) == (4 * GiB, 4 * GiB)


def test_a_report_with_a_floor_above_its_pool_takes_nothing_from_the_others(
    c: httpx.Client,
) -> None:
    """The floor is pages of the engine's own pool, kept whatever its limit, and the policy
    gives every instance its floor first. One report with a floor of 1 PiB (capacity
    16G) on a 9G budget made the policy scale every other instance down, ``budget_short``:
    a, with a min of 2G, got 18 KiB and b 0. Such a report is refused (422) like any
    inconsistent one; the instance and the device keep what they had."""
    engines = [SimEngine(c, name, DEV) for name in ("a", "b", "x")]
    for e in engines:
        assert e.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "9G"}).status_code == 200
    assert c.put("/instances/a/policy", json={"min": "2G"}).status_code == 200
    _settle(c, *engines)
    before = {m["id"]: m["limit_bytes"] for m in c.get(f"/devices/{DEV}").json()["instances"]}
    x = engines[2]
    bogus = x.state(apply=True).model_copy(update={"floor_bytes": 1 << 50})
    r = post_report(c, "x", bogus)
    assert r.status_code == 422 and "floor_bytes" in r.text, r.text
    r = post_register(c, "x", bogus, x.capacity, DEV)
    assert r.status_code == 422 and "floor_bytes" in r.text, r.text
    _settle(c, *engines)
    after = {m["id"]: m["limit_bytes"] for m in c.get(f"/devices/{DEV}").json()["instances"]}
    assert after == before and after["a"] >= 2 * GiB
    assert c.get("/instances/x").json()["observed"]["floor_bytes"] == 0


def test_a_min_set_before_its_engine_joined_is_dropped_if_the_budget_cannot_hold_it(
    c: httpx.Client,
) -> None:
    """``PUT b/policy {"min": "6G"}`` before b's engine ever ran is not checked (no device
    known yet). When b joined the 8G device beside a's min of 6G, the policy scaled both
    down, ``budget_short``: a got 4G, below its min. b's min is dropped (to 0, logged)."""
    a = SimEngine(c, "a", DEV)
    assert a.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    assert c.put("/instances/a/policy", json={"min": "6G"}).status_code == 200
    assert c.put("/instances/b/limit", json={"limit": "1G"}).status_code == 200  # b is known
    assert c.delete("/instances/b/limit").status_code == 200
    r = c.put("/instances/b/policy", json={"min": "6G"})
    assert r.status_code == 200 and r.json()["policy"]["device_id"] is None, r.text
    b = SimEngine(c, "b", DEV)
    assert b.register().status_code == 200
    _settle(c, a, b)
    assert c.get("/instances/b").json()["policy"]["min_bytes"] == 0
    assert (_desired(c, "a"), _desired(c, "b")) == (7 * GiB, 1 * GiB)


def test_a_pinned_instances_min_must_fit_too(c: httpx.Client) -> None:
    """b pinned at 1G: ``PUT b/policy {"min": "6G"}`` was checked with b's pin (1G) and
    accepted beside a's min of 6G on 8G; ``DELETE b/limit`` then put b's 6G min in force
    and the policy cut a to 4G, below its min. A pinned instance's min counts as well."""
    a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
    assert a.register().status_code == 200 and b.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
    assert c.put("/instances/a/policy", json={"min": "6G"}).status_code == 200
    assert c.put("/instances/b/limit", json={"limit": "1G"}).status_code == 200
    r = c.put("/instances/b/policy", json={"min": "6G"})
    assert r.status_code == 409 and "b pinned 1GiB (min 6GiB)" in r.json()["detail"], r.text
    assert c.delete("/instances/b/limit").status_code == 200
    _settle(c, a, b)
    assert _desired(c, "a") >= 6 * GiB and _desired(c, "a") + _desired(c, "b") <= 8 * GiB


def test_a_demand_now_goes_before_a_demand_held_through_the_busy_hold(tmp_path: Path) -> None:
    """b's load ends (b still busy: the hold) while a's requests wait for 6G: a's demand now
    is served first; b keeps only what is left of its held demand."""
    settings = _settings(tmp_path / "s.db", autopilot_busy_hold_s=3600)
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = SimEngine(c, "a", DEV), SimEngine(c, "b", DEV)
        assert a.register().status_code == 200 and b.register().status_code == 200
        b.pinned = 6 * GiB
        b.sync()  # b's load is reported before the budget's first split (written by its PUT)
        assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200
        _settle(c, a, b)
        assert (_desired(c, "a"), _desired(c, "b")) == (0, 8 * GiB)  # a idle: its min only
        b.pinned = b.mapped = 0  # b's requests finished
        a.waiting = 6 * GiB  # a's wait for memory
        _settle(c, a, b)
        assert (_desired(c, "a"), _desired(c, "b")) == (6 * GiB, 2 * GiB)
