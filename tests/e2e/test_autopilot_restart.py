"""The autopilot across sidecar restarts, on one real SQLite file: what it keeps of an
instance whose engine is dead (its floor) until the engine returns or is forgotten.

Engines are :class:`SimEngine` stand-ins reporting over the real API; each sidecar is the
real app under uvicorn (:class:`ThreadedSidecar`), started again on the same database.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
from autopilot_sim import PAGE, GiB, SimEngine
from support import ThreadedSidecar, wait_until

from sidecar import SidecarSettings

DEV = "gpu-0"
BUDGET = 8 * GiB


def _settings(db: Path) -> SidecarSettings:
    return SidecarSettings(
        db_path=db,
        autopilot_interval_s=0.05,
        autopilot_busy_hold_s=0.5,
        autopilot_hysteresis=0,  # a page moves (the floor is one page)
        heartbeat_timeout_s=0.5,  # a dead engine is declared unreachable soon
    )


def _members(c: httpx.Client) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in c.get(f"/devices/{DEV}").json()["instances"]}


def _limit(c: httpx.Client, iid: str) -> int:
    limit = c.get(f"/instances/{iid}").json()["desired"]["limit_bytes"]
    return 1 << 62 if limit is None else int(limit)


def _start_two(c: httpx.Client) -> tuple[SimEngine, SimEngine]:
    """a (a floor of one page, as vLLM's null block) and b on an 8G budget, settled."""
    a, b = SimEngine(c, "a", DEV, floor=PAGE), SimEngine(c, "b", DEV)
    assert a.register().status_code == 200 and b.register().status_code == 200
    assert c.put(f"/devices/{DEV}/budget", json={"budget": "8G"}).status_code == 200

    def settled() -> bool:
        a.sync(), b.sync()
        return all(
            m["limit_bytes"] == m["target_bytes"] and m["status"] == "applied"
            for m in _members(c).values()
        )

    wait_until(settled, what="the idle split")
    return a, b


def _b_takes_what_a_left(c: httpx.Client, b: SimEngine) -> dict[str, dict[str, Any]]:
    """a's engine is silent: wait until it is unreachable and b (wanting the whole device)
    sits at its target."""
    b.waiting = BUDGET

    def done() -> dict[str, dict[str, Any]] | None:
        b.sync()
        m = _members(c)
        ready = (
            m["a"]["status"] == "unreachable"
            and m["b"]["limit_bytes"] == m["b"]["target_bytes"]
            and m["b"]["limit_bytes"] >= 7 * GiB
        )
        return m if ready else None

    return wait_until(done, what="a unreachable, b at its target")


def test_a_dead_instances_floor_stays_free_across_a_sidecar_restart(tmp_path: Path) -> None:
    """The floor was known from live reports only: after a restart, a dead instance (its
    engine died while the sidecar was down) counted no floor, b took the whole budget, and
    the engine, mapping its floor the moment it started again, went one page over it."""
    db = tmp_path / "floor.db"
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        a, b = _start_two(c)
    # a's engine dies while the sidecar is down; a new sidecar starts on the same database
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        b.client = c
        m = _b_takes_what_a_left(c, b)
        assert m["a"]["committed_bytes"] == PAGE, m["a"]
        assert _limit(c, "b") <= BUDGET - PAGE, "a's floor was not kept free"
        # a's engine starts again: it maps its floor before it is told any limit
        a = SimEngine(c, "a", DEV, floor=PAGE)
        assert a.register().status_code == 200
        for _ in range(20):
            a.sync(), b.sync()
            held = max(_limit(c, "a"), a.floor, a.mapped) + max(_limit(c, "b"), b.mapped)
            assert held <= BUDGET, _members(c)
        assert c.get("/instances/a").json()["status"] == "applied"


def test_forgetting_a_dead_instance_frees_its_stored_floor(tmp_path: Path) -> None:
    """``DELETE /instances/a`` drops a's stored floor: b may take the whole budget, also
    after the next restart."""
    db = tmp_path / "forget.db"
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        _, b = _start_two(c)
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        b.client = c
        _b_takes_what_a_left(c, b)
        assert _limit(c, "b") <= BUDGET - PAGE
        assert c.delete("/instances/a").status_code == 204
        wait_until(lambda: (b.sync(), _limit(c, "b") == BUDGET)[1], what="b takes a's floor")
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT * FROM policies WHERE id = 'a'").fetchall() == []
    with ThreadedSidecar(_settings(db)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        b.client = c
        wait_until(lambda: (b.sync(), _limit(c, "b") == BUDGET)[1], what="b keeps it all")
        assert list(_members(c)) == ["b"]
