"""The core against the real sidecar app (uvicorn on loopback) and the real control socket.

Full loop, no engine: sidecar REST -> retained limit or push over the engine's
unix socket -> mailbox -> engine pass on this (the engine) thread -> report ->
the sidecar's view.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
from engine_pool import BLOCKS_PER_PAGE, BUNDLE, Pool

from engine_ext import ElasticInstance, EngineBinding, load_engine_settings
from engine_ext.protocol import Status


def start_instance(pool: Pool, tmp_path: Path, url: str, woken: threading.Event) -> ElasticInstance:
    settings = load_engine_settings(
        instance_id="eng-r", sidecar_url=url, runtime_dir=tmp_path / "rt", heartbeat_s=0.2
    )
    inst = ElasticInstance(
        settings, EngineBinding("vllm", "0.33.0", pool.blocks, (pool.cache,), wake=woken.set)
    )
    inst.start()
    return inst


def test_retained_limit_then_pushed_limit(pool: Pool, tmp_path: Path, sidecar_url: str) -> None:
    api = httpx.Client(base_url=sidecar_url, timeout=30)
    woken = threading.Event()
    # 1. The operator sets a limit before the engine exists: retained.
    r = api.put("/instances/eng-r/limit", json={"limit": 2 * BUNDLE})
    assert r.status_code in (200, 202), r.text
    assert r.json()["status"] == "pending"
    inst = start_instance(pool, tmp_path, sidecar_url, woken)
    try:
        # 2. Start-up: the retained limit is in place before the first allocation.
        state = inst.step()
        assert state.limit_bytes == 2 * BUNDLE and state.status is Status.APPLIED
        got = [pool.cache.start([i]) for i in range(3 * BLOCKS_PER_PAGE)]
        assert sum(g is not None for g in got) == 2 * BLOCKS_PER_PAGE
        for req in got:
            if req is not None:
                pool.cache.finish(req)
        inst.step()  # reports the new mapped figure (the client thread sends it)
        deadline = time.monotonic() + 10
        while (view := api.get("/instances/eng-r").json())["mapped_bytes"] != 2 * BUNDLE:
            assert time.monotonic() < deadline, view
            time.sleep(0.01)  # the sidecar offers no event for a mapped figure
        assert view["status"] == "applied"
        # 3. A lower limit: the sidecar pushes it over the unix socket; the engine
        #    thread (this one) applies it on the pass after the wake.
        woken.clear()
        result: dict[str, Any] = {}
        put = threading.Thread(
            target=lambda: result.update(
                api.put(
                    "/instances/eng-r/limit", params={"wait": 20}, json={"limit": BUNDLE}
                ).json()
            )
        )
        put.start()
        assert woken.wait(20), "the push never reached the engine"
        assert pool.backend.mapped_bytes() == 2 * BUNDLE  # nothing happened off-thread
        state = inst.step()
        assert state.status is Status.APPLIED and pool.backend.mapped_bytes() == BUNDLE
        # The sidecar may see the push's reply (deferred) after the report (applied) for
        # the same revision; the next heartbeat (0.2 s here) carries the applied state.
        put.join(30)
        assert result["status"] == "applied" and result["mapped_bytes"] == BUNDLE
    finally:
        inst.close()
        api.close()
