"""The SGLang adapter against the real sidecar (uvicorn on loopback) and its control socket."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sglang_support import fill, prompt

from engine_ext import EngineSettings
from engine_ext.cpu_harness import CpuHarness, HarnessConfig
from engine_ext.protocol import Status

pytestmark = pytest.mark.sglang

BUNDLE = 16384  # the harness pool's page bundle (HarnessConfig defaults)


def wait_for(api: httpx.Client, path: str, done: Any, harness: CpuHarness) -> dict[str, Any]:
    """Spin the scheduler loop (as SGLang does) until the sidecar's view satisfies ``done``."""
    deadline = time.monotonic() + 15
    while True:
        body = api.get(path).json()
        if done(body):
            return body
        assert time.monotonic() < deadline, body
        harness.iterate()


def test_retained_limit_applies_before_the_first_request_then_a_push(
    tmp_path: Path, sidecar_url: str
) -> None:
    api = httpx.Client(base_url=sidecar_url, timeout=30)
    r = api.put("/instances/sgl-r/limit", json={"limit": 6 * BUNDLE})
    assert r.status_code in (200, 202) and r.json()["status"] == "pending", r.text
    settings = EngineSettings(
        enable=True,
        instance_id="sgl-r",
        sidecar_url=sidecar_url,
        runtime_dir=tmp_path / "rt",
        heartbeat_s=0.2,
    )
    h = CpuHarness(settings, HarnessConfig())
    try:
        assert h.pages.target_pages == 6  # applied in attach, before any request
        reqs = [h.submit(prompt(i, length=24), max_new_tokens=2) for i in range(12)]
        h.run_until_idle()
        assert all(r.done for r in reqs) and h.mapped_bytes() <= 6 * BUNDLE
        wait_for(api, "/instances/sgl-r", lambda b: b["status"] == "applied", h)

        # A push from the operator: over the control socket into the mailbox; the
        # scheduler applies it on its own thread in the idle hook.
        fill(h, 10, start=20)
        r = api.put("/instances/sgl-r/limit", json={"limit": 2 * BUNDLE})
        assert r.status_code in (200, 202), r.text
        body = wait_for(
            api,
            "/instances/sgl-r",
            lambda b: b["observed"]["revision"] == 2 and b["status"] == "applied",
            h,
        )
        assert h.mapped_bytes() <= 2 * BUNDLE
        assert body["observed"]["mapped_bytes"] <= 2 * BUNDLE
        assert body["engine"]["engine"] == "sglang"
        assert h.pool.state().status is Status.APPLIED
    finally:
        h.close()
