"""The autopilot's loop skips a device whose inputs did not move since a pass that had
nothing to write, and only then: real HTTP on loopback, the real SQLite file, stand-in
engines reporting over the API. What is counted is the policy's own function
(``compute_targets``) as the loop calls it; what is checked is the limits each engine
gets, whatever the loop skipped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from autopilot_sim import GiB, SimEngine
from support import ThreadedSidecar, wait_until

from sidecar import SidecarSettings, _autopilot
from sidecar._errors import StoreError

DEV = "gpu-0"
INTERVAL_S = 0.05
BUSY_HOLD_S = 0.5


def _settings(db: Path) -> SidecarSettings:
    return SidecarSettings(
        db_path=db, autopilot_interval_s=INTERVAL_S, autopilot_busy_hold_s=BUSY_HOLD_S
    )


def _limits(c: httpx.Client) -> dict[str, int]:
    dev = c.get(f"/devices/{DEV}").json()
    return {m["id"]: m["limit_bytes"] for m in dev["instances"]}


def _settled(c: httpx.Client, *engines: SimEngine) -> bool:
    for e in engines:
        e.sync()
    dev = c.get(f"/devices/{DEV}").json()
    return all(
        m["limit_bytes"] == m["target_bytes"] and m["status"] == "applied" for m in dev["instances"]
    )


@contextmanager
def _settled_device(
    tmp_path: Path, count: int, budget: str
) -> Iterator[tuple[ThreadedSidecar, httpx.Client, list[SimEngine]]]:
    """A sidecar with ``count`` stand-in engines on one budgeted device, split settled."""
    with (
        ThreadedSidecar(_settings(tmp_path / "s.db")) as s,
        httpx.Client(base_url=s.url, timeout=30) as c,
    ):
        engines = [SimEngine(c, chr(ord("a") + i), DEV) for i in range(count)]
        for e in engines:
            assert e.register().status_code == 200
        assert c.put(f"/devices/{DEV}/budget", json={"budget": budget}).status_code == 200
        wait_until(lambda: _settled(c, *engines), what="the idle split")
        yield s, c, engines


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each device the loop (or a request) computed targets for, in order."""
    seen: list[str] = []
    real = _autopilot.compute_targets

    def counted(budget: int, members: Any) -> Any:
        seen.append(DEV)
        return real(budget, members)

    monkeypatch.setattr(_autopilot, "compute_targets", counted)
    return seen


def test_an_idle_device_is_planned_again_only_when_an_input_moves(
    tmp_path: Path, plans: list[str]
) -> None:
    """Settled and idle: no pass plans again, tick after tick. A report with a demand
    plans at once, and the end of the busy hold (time alone, no report) does too: the
    split goes back to equal without any engine reporting."""
    with _settled_device(tmp_path, 2, "8G") as (_, c, (a, b)):
        assert _limits(c) == {"a": 4 * GiB, "b": 4 * GiB}
        time.sleep(BUSY_HOLD_S + 4 * INTERVAL_S)  # nothing busy, nothing in flight
        before = len(plans)
        time.sleep(20 * INTERVAL_S)  # twenty ticks with every input unchanged
        assert len(plans) == before, f"{len(plans) - before} passes planned unchanged inputs"

        b.pinned, b.waiting = GiB, 5 * GiB  # b is busy and wants 6 GiB
        b.sync(apply=False, grow=False)
        wait_until(lambda: len(plans) > before, timeout_s=5, what="a pass after b's report")
        wait_until(
            lambda: _settled(c, a, b) and _limits(c)["b"] >= 6 * GiB, what="b's demand granted"
        )
        grown = _limits(c)  # (busy: b takes what a does not need, on top of its demand)
        b.pinned = b.waiting = 0  # b's requests end: its share holds for the busy hold only
        b.sync()
        busy_ended = time.monotonic()
        assert _limits(c) == grown
        # no engine reports from here on: only the clock moves the inputs
        wait_until(
            lambda: _limits(c)["b"] < grown["b"],
            timeout_s=BUSY_HOLD_S + 5,
            what="b's share released when its busy hold ends",
        )
        assert time.monotonic() - busy_ended >= BUSY_HOLD_S * 0.9
        wait_until(lambda: _settled(c, a, b), what="the idle split again")
        assert _limits(c) == {"a": 4 * GiB, "b": 4 * GiB}


def test_a_pass_whose_write_failed_is_planned_again_though_nothing_moved(tmp_path: Path) -> None:
    """The database refuses the pass's writes for a while; no engine reports meanwhile. The
    plan is the same at every tick, and it must be tried again at every tick (a skip here
    would leave b without its memory until some engine happened to report)."""
    with _settled_device(tmp_path, 2, "8G") as (s, c, (a, b)):
        service = s.app.state.service
        real = service.set_limits
        refused: list[list[str]] = []

        async def refusing(writes: list[tuple[Any, ...]]) -> Any:
            if len(refused) < 5:
                refused.append([w[0] for w in writes])
                raise StoreError("database is locked (the test holds it)")
            return await real(writes)

        service.set_limits = refusing
        try:
            b.pinned, b.waiting = GiB, 5 * GiB
            b.sync(apply=False, grow=False)  # the one report: a's shrink is planned
            wait_until(lambda: len(refused) == 5, timeout_s=5, what="five refused writes")
            wait_until(
                lambda: _limits(c)["a"] < 4 * GiB, timeout_s=5, what="a's shrink written at last"
            )
        finally:
            service.set_limits = real
        assert refused == [["a"]] * 5  # shrink before grow: a's alone, tried again each tick
        wait_until(lambda: _settled(c, a, b) and _limits(c)["b"] >= 6 * GiB, what="b grown")


def test_a_pin_that_shrinks_every_other_instance_is_one_write_of_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pin on a device of six: the PUT's pass shrinks the five others, written durably
    before the answer in one commit for the limits and one for their sources (plus the
    pin's own row), not two per instance: at 128 instances a device that was 254
    commits (~0.35 ms each on the dev machine) inside one PUT."""
    with _settled_device(tmp_path, 6, "12G") as (s, c, engines):
        assert set(_limits(c).values()) == {2 * GiB}
        store = s.app.state.service._store
        commits: list[int] = []
        transaction = store._transaction
        monkeypatch.setattr(
            store, "_transaction", lambda body: commits.append(1) or transaction(body)
        )
        r = c.put("/instances/a/limit", json={"limit": "7G"})
        assert r.status_code == 200, r.text
        shrunk = {iid for iid, limit in _limits(c).items() if limit < 2 * GiB}
        assert shrunk == {"b", "c", "d", "e", "f"}  # written before the answer
        assert len(commits) <= 3, f"{len(commits)} commits for one pin"  # (was 1 + 2 * 5)
        wait_until(lambda: _settled(c, *engines) and _limits(c)["a"] == 7 * GiB, what="pinned")
