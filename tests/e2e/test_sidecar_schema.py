"""Schemathesis over the live /openapi.json: no generated request may cause a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from test_sidecar_support import ThreadedSidecar

from sidecar import SidecarSettings, create_app


@pytest.fixture(scope="module")
def live_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedSidecar]:
    db: Path = tmp_path_factory.mktemp("schema") / "sidecar.db"
    # Short waits and retries: generated ?wait= values and socket paths must not stall the run.
    config = SidecarSettings(
        db_path=db,
        max_wait_s=0.2,
        push_timeout_s=0.5,
        push_backoff_initial_s=0.05,
        push_backoff_max_s=0.5,
    )
    with ThreadedSidecar(config) as server:
        yield server


# The same document the live server serves at /openapi.json (built without starting the app).
schema = schemathesis.openapi.from_dict(
    create_app(SidecarSettings(db_path=Path("/nonexistent/unused.db"))).openapi()
)


def test_the_served_schema_is_the_one_under_test(live_sidecar: ThreadedSidecar) -> None:
    served = httpx.get(f"{live_sidecar.url}/openapi.json").json()
    assert served == create_app(SidecarSettings(db_path=Path("/nonexistent/x.db"))).openapi()


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: Any, live_sidecar: ThreadedSidecar) -> None:
    response = case.call(base_url=live_sidecar.url, timeout=10)
    assert response.status_code < 500, (case.method, case.formatted_path, response.text)
    if response.status_code >= 400:
        content_type = response.headers["content-type"]  # schemathesis gives a list
        assert "application/problem+json" in content_type, (case.formatted_path, content_type)
        assert response.json()["detail"]
