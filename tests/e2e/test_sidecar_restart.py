"""Durability: ``kill -9`` of ``kvsidecar serve`` right after a 200 loses nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
from test_sidecar_support import SidecarProcess, SocketEngine, db_rows

from engine_ext import EngineSettings, SidecarClient
from engine_ext.protocol import RegisterBody

GiB = 1 << 30


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
