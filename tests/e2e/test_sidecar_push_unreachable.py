"""No push to an ``unreachable`` instance: a restarted engine gets its limit by registering.

Found on real ``vllm serve`` (test_autopilot_vllm_serve.py): an engine was
``kill -9``-ed, the sidecar kept retrying the push of its last desired limit,
and the engine started again on the same control socket path got that push
before it registered. It took the dead engine's kept limit unfitted (on a
budgeted device the others held that memory by then), and the push's answer
made the dead registration look alive, so the new process's registration was
refused as a second engine for a heartbeat timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from support import ThreadedSidecar, wait_until
from test_sidecar_support import SocketEngine

from sidecar import SidecarSettings

GiB = 1 << 30


def test_a_restarted_engine_gets_no_push_before_it_registers(tmp_path: Path) -> None:
    settings = SidecarSettings(
        db_path=tmp_path / "s.db",
        heartbeat_timeout_s=0.3,
        push_backoff_initial_s=0.02,
        push_backoff_max_s=0.05,
    )
    sock = tmp_path / "e.sock"
    with ThreadedSidecar(settings) as server, httpx.Client(base_url=server.url) as c:
        with SocketEngine(sock, mapped_bytes=GiB, device_total_bytes=8 * GiB) as old:
            r = c.post("/instances/e/register", json=old.register_body())
            assert r.status_code == 200, r.text
        # the engine is gone (its socket closed) and silent: unreachable
        wait_until(lambda: c.get("/instances/e").json()["status"] == "unreachable")
        assert c.put("/instances/e/limit", json={"limit": "2G"}).status_code in (200, 202)
        with SocketEngine(sock, mapped_bytes=GiB, device_total_bytes=8 * GiB) as new:
            time.sleep(0.5)  # the point is time passing: many of the pusher's back-off rounds
            assert new.mailbox.pushes == [], "the dead engine's limit was pushed to a new one"
            r = c.post("/instances/e/register", json=new.register_body())
            assert r.status_code == 200, r.text  # not refused as a second live engine
            assert r.json() == {"limit": 2 * GiB, "revision": 1}
            assert c.get("/instances/e").json()["status"] != "unreachable"
