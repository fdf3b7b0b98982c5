"""Durability: ``kill -9`` of ``kvsidecar serve`` right after a 200 loses nothing."""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_sidecar_support import SidecarProcess, SocketEngine, db_rows

from engine_ext import EngineSettings, SidecarClient
from engine_ext.protocol import RegisterBody

GiB = 1 << 30
MiB = 1 << 20


def test_kill9_after_200_then_restart_keeps_limit_and_engine_gets_it(tmp_path: Path) -> None:
    db = tmp_path / "sidecar.db"
    first = SidecarProcess(db).start()
    try:
        for size in ("8G", "6G"):
            r = httpx.put(f"{first.url}/instances/llama-a/limit", json={"limit": size})
            assert r.status_code == 200
        first.kill9()  # no shutdown hook runs: only what was committed survives
    finally:
        first.stop()
    assert db_rows(db)[0][:3] == ("llama-a", 6 * GiB, 2)

    second = SidecarProcess(db, env={"KVSIDECAR_TOKEN": "t0k"}).start()
    try:
        desired = httpx.get(f"{second.url}/instances/llama-a").json()["desired"]
        assert (desired["limit_bytes"], desired["revision"]) == (6 * GiB, 2)

        # A (re)starting engine registers with the real engine_ext client and gets the limit.
        with SocketEngine(
            tmp_path / "e.sock", mapped_bytes=GiB, device_total_bytes=80 * GiB
        ) as engine:
            settings = EngineSettings(enable=True, sidecar_url=second.url, token="t0k")
            client = SidecarClient(
                settings,
                engine.mailbox,
                lambda: RegisterBody.model_validate(engine.register_body()),
                instance_id="llama-a",
            )
            assert client.register_blocking(timeout_s=10)
            assert (engine.mailbox.desired.limit_bytes, engine.mailbox.desired.revision) == (
                6 * GiB,
                2,
            )
            r = httpx.put(
                f"{second.url}/instances/llama-a/limit",
                json={"limit": "5G"},
                headers={"Authorization": "Bearer t0k"},
            )
            assert r.json()["desired"]["revision"] == 3
            client.stop()
    finally:
        second.stop()


def _storm(url: str, ids: list[str], stop: threading.Event, log: dict[str, list]) -> None:
    """PUT limits on ``ids`` (this thread's own) until the sidecar is gone.

    ``log[iid]`` gets ``("sent", limit)`` before each request and
    ``("acked", revision, limit)`` for each 200.
    """
    n = 0
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            iid = ids[n % len(ids)]
            n += 1
            mib = 1 + (n * 37) % 4000
            log[iid].append(("sent", mib * MiB))
            try:
                r = client.put(f"{url}/instances/{iid}/limit", json={"limit": f"{mib}M"})
            except httpx.TransportError:
                return  # killed
            assert r.status_code == 200, r.text
            desired = r.json()["desired"]
            log[iid].append(("acked", desired["revision"], desired["limit_bytes"]))


@pytest.mark.parametrize("seed", [1, 2])
def test_kill9_in_a_storm_of_puts_loses_no_acknowledged_limit(tmp_path: Path, seed: int) -> None:
    """Four clients PUT limits as fast as they can; ``kill -9`` at a random moment, three
    times on one database. Every limit that got a 200 survives (the stored revision
    is at least the last acknowledged one, and equal to it only with its limit); what
    is stored was sent; a restarted sidecar never hands out an acknowledged revision
    again; the file passes SQLite's integrity check."""
    rng = random.Random(seed)
    db = tmp_path / "sidecar.db"
    ids = [f"storm-{i}" for i in range(8)]
    high: dict[str, int] = {}  # the revision stored at the last kill
    for _cycle in range(3):
        log: dict[str, list] = {iid: [] for iid in ids}
        sidecar = SidecarProcess(db).start()
        stop = threading.Event()
        threads = [
            threading.Thread(target=_storm, args=(sidecar.url, ids[k::4], stop, log))
            for k in range(4)
        ]
        try:
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.3, 1.2))
            sidecar.kill9()
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
            sidecar.stop()
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        finally:
            conn.close()
        stored = {row[0]: (row[1], row[2]) for row in db_rows(db)}
        acked_any = False
        for iid in ids:
            acks = [(e[1], e[2]) for e in log[iid] if e[0] == "acked"]
            sent = {e[1] for e in log[iid] if e[0] == "sent"}
            if not acks:
                continue
            acked_any = True
            limit, revision = stored[iid]
            last_rev, last_limit = acks[-1]
            assert acks[0][0] > high.get(iid, 0), (iid, acks[0], high.get(iid))  # no reuse
            assert [r for r, _ in acks] == sorted({r for r, _ in acks}), iid
            assert revision >= last_rev, (iid, revision, acks[-1])
            assert revision <= last_rev + 1, (iid, revision, acks[-1])  # at most the one in flight
            assert limit in sent, (iid, limit)
            if revision == last_rev:
                assert limit == last_limit, (iid, limit, acks[-1])
            high[iid] = revision
        assert acked_any  # the storm ran
