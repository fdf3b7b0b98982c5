"""The sidecar API over real HTTP (uvicorn on loopback, SQLite on disk)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_sidecar_support import ThreadedSidecar, db_rows

from sidecar import SidecarSettings

GiB = 1 << 30
MAX_BODY = 1024


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "sidecar.db"


@pytest.fixture
def sidecar(db: Path) -> Iterator[ThreadedSidecar]:
    settings = SidecarSettings(db_path=db, max_body_bytes=MAX_BODY, max_wait_s=5)
    with ThreadedSidecar(settings) as server:
        yield server


@pytest.fixture
def client(sidecar: ThreadedSidecar) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sidecar.url, timeout=30) as c:
        yield c


def test_put_get_delete_round_trip(client: httpx.Client, db: Path) -> None:
    r = client.put("/instances/llama-a/limit", json={"limit": "1.5GiB"})
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["desired"] == {**view["desired"], "limit_bytes": 3 * GiB // 2, "revision": 1}
    assert (view["status"], view["reason"]) == ("pending", "not_registered")
    assert db_rows(db)[0][:3] == ("llama-a", 3 * GiB // 2, 1)
    assert client.get("/instances/llama-a").json()["desired"] == view["desired"]
    assert [v["id"] for v in client.get("/instances").json()["instances"]] == ["llama-a"]
    r = client.delete("/instances/llama-a/limit")
    assert r.status_code == 200
    assert (r.json()["desired"]["limit_bytes"], r.json()["desired"]["revision"]) == (None, 2)
    assert db_rows(db)[0][:3] == ("llama-a", None, 2)


def test_unknown_instance_is_404_problem(client: httpx.Client) -> None:
    for r in (client.get("/instances/nobody"), client.delete("/instances/nobody/limit")):
        assert r.status_code == 404
        assert r.headers["content-type"] == "application/problem+json"
        assert "'nobody' is not known" in r.json()["detail"]


def test_same_revision_same_limit_is_an_idempotent_repeat(client: httpx.Client, db: Path) -> None:
    assert client.put("/instances/a/limit", json={"limit": "2G", "revision": 5}).status_code == 200
    before = db_rows(db)
    r = client.put("/instances/a/limit", json={"limit": 2 * GiB, "revision": 5})
    assert r.status_code == 200 and r.json()["desired"]["revision"] == 5
    assert db_rows(db) == before  # nothing rewritten, not even the timestamp


def test_wait_on_an_unregistered_instance_answers_202_at_the_deadline(client: httpx.Client) -> None:
    r = client.put("/instances/a/limit", params={"wait": 0.2}, json={"limit": "1G"})
    assert r.status_code == 202
    assert r.json()["status"] == "pending"


_BAD_ID = "x" * 64
# (case, method, path, raw body or json, headers, status, words in the detail)
BAD_INPUTS: list[tuple[str, str, str, Any, dict[str, str], int, str]] = [
    ("unit", "PUT", "/instances/a/limit", {"limit": "12X"}, {}, 422, "limit: cannot read size"),
    ("neg-str", "PUT", "/instances/a/limit", {"limit": "-5G"}, {}, 422, "cannot read size"),
    ("neg-int", "PUT", "/instances/a/limit", {"limit": -5}, {}, 422, "cannot be negative"),
    ("nan", "PUT", "/instances/a/limit", b'{"limit": NaN}', {}, 422, "finite"),
    ("inf", "PUT", "/instances/a/limit", b'{"limit": 1e999}', {}, 422, "finite"),
    ("huge", "PUT", "/instances/a/limit", {"limit": "99999999T"}, {}, 422, "larger than 1 EiB"),
    ("huge-int", "PUT", "/instances/a/limit", {"limit": 10**30}, {}, 422, "larger than 1 EiB"),
    ("fraction", "PUT", "/instances/a/limit", {"limit": 1.5}, {}, 422, "whole"),
    ("fraction-str", "PUT", "/instances/a/limit", {"limit": "0.5"}, {}, 422, "whole"),
    ("sub-byte", "PUT", "/instances/a/limit", {"limit": "0.0001K"}, {}, 422, "less than one"),
    ("past-float", "PUT", "/instances/a/limit", {"limit": "9" * 400}, {}, 422, "too many digits"),
    ("past-float-T", "PUT", "/instances/a/limit", {"limit": "9" * 300 + "T"}, {}, 422, "digits"),
    ("just-over", "PUT", "/instances/a/limit", {"limit": str((1 << 60) + 1)}, {}, 422, "1 EiB"),
    ("arabic-digits", "PUT", "/instances/a/limit", {"limit": "\u0661\u0662G"}, {}, 422, "read"),
    ("wide-digits", "PUT", "/instances/a/limit", {"limit": "\uff19G"}, {}, 422, "cannot read"),
    ("bool", "PUT", "/instances/a/limit", {"limit": True}, {}, 422, "boolean"),
    ("list", "PUT", "/instances/a/limit", {"limit": [1]}, {}, 422, "got list"),
    (
        "rev-str",
        "PUT",
        "/instances/a/limit",
        {"limit": 1, "revision": "9"},
        {},
        422,
        "revision: Input should be a valid integer",
    ),
    ("rev-bool", "PUT", "/instances/a/limit", {"limit": 1, "revision": True}, {}, 422, "revision"),
    (
        "rev-zero",
        "PUT",
        "/instances/a/limit",
        {"limit": 1, "revision": 0},
        {},
        422,
        "greater than or equal to 1",
    ),
    (
        "unknown-field",
        "PUT",
        "/instances/a/limit",
        {"limit": 1, "lmit": 2},
        {},
        422,
        "lmit: Extra inputs are not permitted",
    ),
    ("missing", "PUT", "/instances/a/limit", {}, {}, 422, "limit: Field required"),
    ("not-json", "PUT", "/instances/a/limit", b'{"limit": ', {}, 422, "body: not valid JSON ("),
    ("not-object", "PUT", "/instances/a/limit", b'"4G"', {}, 422, "valid dictionary"),
    (
        "text-plain",
        "PUT",
        "/instances/a/limit",
        b'{"limit": "1G"}',
        {"content-type": "text/plain"},
        422,
        "sent as text/plain: send JSON with 'content-type: application/json'",
    ),
    (
        "dup-key",
        "PUT",
        "/instances/a/limit",
        b'{"limit": "1G", "limit": "2G"}',
        {},
        422,
        "body: the key 'limit' appears twice",
    ),
    (
        "dup-revision",
        "PUT",
        "/instances/a/limit",
        b'{"limit": "3G", "revision": 9, "revision": 6}',
        {},
        422,
        "'revision' appears twice",
    ),
    (
        "dup-nested",
        "POST",
        "/instances/a/report",
        b'{"status": "applied", "ranks": [{"rank": 0, "rank": 1, "mapped_bytes": 0}]}',
        {},
        422,
        "'rank' appears twice",
    ),
    (
        "oversized",
        "PUT",
        "/instances/a/limit",
        b'{"limit": "1G", "pad": "' + b"x" * MAX_BODY + b'"}',
        {},
        413,
        "larger than 1024 bytes",
    ),
    ("bad-id", "PUT", "/instances/bad%20id!/limit", {"limit": 1}, {}, 422, "instance_id"),
    ("long-id", "PUT", f"/instances/{_BAD_ID}/limit", {"limit": 1}, {}, 422, "instance_id"),
    ("dash-id", "PUT", "/instances/-a/limit", {"limit": 1}, {}, 422, "instance_id"),
    (
        "stale",
        "PUT",
        "/instances/a/limit",
        {"limit": "1G", "revision": 4},
        {},
        409,
        "older than the current revision 5",
    ),
    (
        "conflict",
        "PUT",
        "/instances/a/limit",
        {"limit": "3G", "revision": 5},
        {},
        409,
        "revision 5 already set limit",
    ),
    ("wait-neg", "PUT", "/instances/a/limit?wait=-1", {"limit": 1}, {}, 422, "query.wait"),
    ("wait-huge", "PUT", "/instances/a/limit?wait=301", {"limit": 1}, {}, 422, "query.wait"),
    ("wait-nan", "GET", "/instances/a?wait=nan", None, {}, 422, "query.wait"),
    (
        "report-unknown",
        "POST",
        "/instances/b/report",
        {"status": "applied"},
        {},
        404,
        "'b' is not known",
    ),
    (
        "report-stale",
        "POST",
        "/instances/a/report",
        {"status": "stale"},
        {},
        422,
        "stale/conflict are replies only",
    ),
    (
        "register-relative",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "socket_path": "run/x.sock",
            "state": {"status": "applied"},
        },
        {},
        422,
        "socket_path: must be an absolute path",
    ),
    (
        "register-types",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "device_total_bytes": "lots",
            "state": {"status": "applied"},
        },
        {},
        422,
        "device_total_bytes",
    ),
    (
        "register-device-huge",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "device_total_bytes": 2**64,
            "state": {"status": "applied"},
        },
        {},
        422,
        "device_total_bytes: Input should be less",
    ),
    (
        "register-device-neg",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "device_total_bytes": -1,
            "state": {"status": "applied"},
        },
        {},
        422,
        "device_total_bytes: Input should be greater",
    ),
    (
        "register-rev-huge",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "state": {"status": "applied", "revision": 2**64, "limit_bytes": 1},
        },
        {},
        422,
        "state.revision: Input should be less than or equal to 4611686018427387904",
    ),
    (
        "register-rev-neg",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "state": {"status": "applied", "revision": -1},
        },
        {},
        422,
        "state.revision: Input should be greater than or equal to 0",
    ),
    (
        "register-limit-neg",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "state": {"status": "applied", "revision": 6, "limit_bytes": -5},
        },
        {},
        422,
        "state.limit_bytes: a size cannot be negative",
    ),
    (
        "register-limit-huge",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "state": {"status": "applied", "revision": 6, "limit_bytes": 2**61},
        },
        {},
        422,
        "state.limit_bytes: size 2305843009213693952 is larger than 1 EiB",
    ),
    (
        "register-effective-neg",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "state": {"status": "applied", "effective_limit_bytes": -1},
        },
        {},
        422,
        "state.effective_limit_bytes: a size cannot be negative",
    ),
    (
        "register-rank-neg",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "state": {"status": "applied", "ranks": [{"rank": 0, "mapped_bytes": -1}]},
        },
        {},
        422,
        "state.ranks.0.mapped_bytes: Input should be greater than or equal to 0",
    ),
    (
        "report-rev-huge",
        "POST",
        "/instances/a/report",
        {"status": "applied", "revision": 2**64},
        {},
        422,
        "revision: Input should be less",
    ),
    (
        "report-limit-neg",
        "POST",
        "/instances/a/report",
        {"status": "applied", "revision": 6, "limit_bytes": -5},
        {},
        422,
        "limit_bytes: a size cannot be negative",
    ),
    (
        "report-limit-bool",
        "POST",
        "/instances/a/report",
        {"status": "applied", "revision": 6, "limit_bytes": True},
        {},
        422,
        "limit_bytes: a size must be a byte count",
    ),
    *[
        (
            f"report-{name}-neg",
            "POST",
            "/instances/a/report",
            {"status": "deferred", name: -1},
            {},
            422,
            f"{name}: Input should be greater than or equal",
        )
        for name in (
            "floor_bytes",
            "mapped_bytes",
            "overage_bytes",
            "capacity_bytes",
            "page_bundle_bytes",
            "evictable_bytes",
            "pinned_bytes",
            "passes",
        )
    ],
    *[
        (
            f"report-{name}-huge",
            "POST",
            "/instances/a/report",
            {"status": "deferred", name: 10**400},
            {},
            422,
            f"{name}: Input should be less than or equal to 4611686018427387904",
        )
        for name in (
            "mapped_bytes",
            "capacity_bytes",
            "waiting_bytes",
            "reserved_bytes",
            "pinned_bytes",
            "passes",
            "num_running_requests",
            "num_waiting_requests",
            "num_preemptions",
        )
    ],
    *[
        (
            f"report-mapped-{name}",
            "POST",
            "/instances/a/report",
            {"status": "applied", "mapped_bytes": value},
            {},
            422,
            "mapped_bytes: must be a whole number",
        )
        for name, value in (("true", True), ("string", "5"))
    ],
    (
        "report-rank-huge",
        "POST",
        "/instances/a/report",
        {"status": "applied", "ranks": [{"rank": 10**30, "mapped_bytes": 0}]},
        {},
        422,
        "ranks.0.rank: Input should be less than 1024",
    ),
    ("no-route", "POST", "/instances/a/limit", {"limit": 1}, {}, 405, "Method Not Allowed"),
    # issue 14: revision bound, forget/deregister, field caps, report consistency
    (
        "rev-above-client-max",
        "PUT",
        "/instances/a/limit",
        {"limit": 1, "revision": 2**53 + 1},
        {},
        422,
        "revision: Input should be less than or equal to 9007199254740992",
    ),
    (
        "rev-max",
        "PUT",
        "/instances/a/limit",
        {"limit": 1, "revision": 2**62},
        {},
        422,
        "revision: Input should be less than or equal to 9007199254740992",
    ),
    ("forget-unknown", "DELETE", "/instances/b", None, {}, 404, "'b' is not known"),
    ("forget-bad-id", "DELETE", "/instances/-a", None, {}, 422, "instance_id"),
    ("forget-dotdot", "DELETE", "/instances/..", None, {}, 404, "no such endpoint"),
    ("deregister-unknown", "POST", "/instances/b/deregister", None, {}, 404, "'b' is not known"),
    (
        "deregister-unregistered",
        "POST",
        "/instances/a/deregister",
        None,
        {},
        404,
        "'a' is not known",
    ),
    (
        "register-engine-long",
        "POST",
        "/instances/a/register",
        {"engine": "x" * 65, "engine_version": "1", "state": {"status": "applied"}},
        {},
        422,
        "engine: String should have at most 64 characters",
    ),
    (
        "register-engine-empty",
        "POST",
        "/instances/a/register",
        {"engine": "", "engine_version": "1", "state": {"status": "applied"}},
        {},
        422,
        "engine: String should have at least 1 character",
    ),
    (
        "register-version-long",
        "POST",
        "/instances/a/register",
        {"engine": "vllm", "engine_version": "v" * 129, "state": {"status": "applied"}},
        {},
        422,
        "engine_version: String should have at most 128 characters",
    ),
    (
        "register-socket-long",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "1",
            "socket_path": "/" + "s" * 120,
            "state": {"status": "applied"},
        },
        {},
        422,
        "socket_path: String should have at most 107",
    ),
    (
        "register-token-bad",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "1",
            "registration_token": "short!",
            "state": {"status": "applied"},
        },
        {},
        422,
        "registration_token: String should match",
    ),
    (
        "register-inconsistent",
        "POST",
        "/instances/a/register",
        {
            "engine": "vllm",
            "engine_version": "1",
            "state": {
                "status": "applied",
                "revision": 5,
                "limit_bytes": 2 * GiB,
                "mapped_bytes": 10 * GiB,
            },
        },
        {},
        422,
        "inconsistent report: status applied with mapped_bytes 10737418240 above",
    ),
    (
        "report-reason-long",
        "POST",
        "/instances/a/report",
        {"status": "deferred", "reason": "r" * 65},
        {},
        422,
        "reason: String should have at most 64 characters",
    ),
    (
        "report-num-ranks-huge",
        "POST",
        "/instances/a/report",
        {"status": "deferred", "num_ranks": 1025},
        {},
        422,
        "num_ranks: Input should be less",
    ),
    (
        "report-token-header-bad",
        "POST",
        "/instances/a/report",
        {"status": "applied"},
        {"X-KVSidecar-Registration": "not a token"},
        422,
        "String should match pattern",
    ),
    (
        "report-stopped",
        "POST",
        "/instances/a/report",
        {"status": "stopped"},
        {},
        422,
        "stopped is sent as POST .../deregister",
    ),
    (
        "report-applied-10g-under-1m",
        "POST",
        "/instances/a/report",
        {
            "status": "applied",
            "revision": 5,
            "limit_bytes": 1 << 20,
            "effective_limit_bytes": 1 << 20,
            "mapped_bytes": 10 * GiB,
        },
        {},
        422,
        "status applied with mapped_bytes 10737418240 above the effective limit 1048576",
    ),
    (
        "report-applied-over-desired",
        "POST",
        "/instances/a/report",
        {"status": "applied", "revision": 5, "limit_bytes": 2 * GiB, "mapped_bytes": 3 * GiB},
        {},
        422,
        "above the effective limit 2147483648",
    ),
    (
        "report-applied-dead-rank",
        "POST",
        "/instances/a/report",
        {
            "status": "applied",
            "revision": 5,
            "limit_bytes": 2 * GiB,
            "mapped_bytes": GiB,
            "num_ranks": 2,
            "ranks": [
                {"rank": 0, "mapped_bytes": GiB},
                {"rank": 1, "mapped_bytes": GiB, "alive": False},
            ],
        },
        {},
        422,
        "rank(s) [1] are dead",
    ),
    (
        "report-applied-overage",
        "POST",
        "/instances/a/report",
        {
            "status": "applied",
            "revision": 5,
            "limit_bytes": 2 * GiB,
            "mapped_bytes": GiB,
            "overage_bytes": 1,
        },
        {},
        422,
        "status applied with overage_bytes 1",
    ),
    (
        "report-applied-effective-low",
        "POST",
        "/instances/a/report",
        {"status": "applied", "revision": 5, "limit_bytes": 2 * GiB, "effective_limit_bytes": GiB},
        {},
        422,
        "effective_limit_bytes 1073741824 below",
    ),
    (
        "report-rank-twice",
        "POST",
        "/instances/a/report",
        {
            "status": "deferred",
            "num_ranks": 2,
            "ranks": [{"rank": 0, "mapped_bytes": 0}, {"rank": 0, "mapped_bytes": 0}],
        },
        {},
        422,
        "lists a rank number twice",
    ),
    (
        "report-ranks-over-num",
        "POST",
        "/instances/a/report",
        {
            "status": "deferred",
            "num_ranks": 1,
            "ranks": [{"rank": 0, "mapped_bytes": 0}, {"rank": 1, "mapped_bytes": 0}],
        },
        {},
        422,
        "lists 2 ranks but num_ranks is 1",
    ),
    (
        "report-mapped-below-rank",
        "POST",
        "/instances/a/report",
        {"status": "deferred", "mapped_bytes": 1, "ranks": [{"rank": 0, "mapped_bytes": 5}]},
        {},
        422,
        "mapped_bytes 1 is below a rank's mapped bytes 5",
    ),
    (
        "report-overage-above-mapped",
        "POST",
        "/instances/a/report",
        {"status": "deferred", "mapped_bytes": 1, "overage_bytes": 5},
        {},
        422,
        "overage_bytes 5 exceeds mapped_bytes 1",
    ),
    (
        "report-overage-above-mapped-and-reserved",
        "POST",
        "/instances/a/report",
        {
            "status": "deferred",
            "mapped_bytes": 1,
            "overage_bytes": 20,
            "reserved_bytes": 4,
            "page_bundle_bytes": 2,
        },
        {},
        422,
        "overage_bytes 20 exceeds mapped_bytes + reserved_bytes + one page bundle (7)",
    ),
]


def _send(
    client: httpx.Client, method: str, path: str, body: Any, headers: dict[str, str]
) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json", **headers}
        return client.request(method, path, content=body, headers=headers)
    return client.request(method, path, json=body, headers=headers)


def _instances_now(client: httpx.Client) -> list[dict[str, Any]]:
    """Every instance view, less the one field that moves with the clock."""
    views: list[dict[str, Any]] = client.get("/instances").json()["instances"]
    return [{k: v for k, v in view.items() if k != "last_seen_s_ago"} for view in views]


@pytest.mark.parametrize(
    ("case", "method", "path", "body", "headers", "status", "words"),
    BAD_INPUTS,
    ids=[c[0] for c in BAD_INPUTS],
)
def test_bad_input_is_a_clear_4xx_and_changes_nothing(
    client: httpx.Client,
    db: Path,
    case: str,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    words: str,
) -> None:
    assert client.put("/instances/a/limit", json={"limit": "2G", "revision": 5}).status_code == 200
    if "/report" in path:  # reports are only taken from a registered engine
        engine = {"status": "applied", "revision": 5, "limit_bytes": 2 * GiB}
        assert (
            client.post(
                "/instances/a/register",
                json={"engine": "vllm", "engine_version": "0.33.0", "state": engine},
            ).status_code
            == 200
        )
    before_api, before_db = _instances_now(client), db_rows(db)
    r = _send(client, method, path, body, headers)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert words in r.json()["detail"], r.json()
    assert _instances_now(client) == before_api
    assert db_rows(db) == before_db


def test_a_rejected_revision_says_what_holds(client: httpx.Client) -> None:
    client.put("/instances/a/limit", json={"limit": "2G", "revision": 5})
    problem = client.put("/instances/a/limit", json={"limit": "1G", "revision": 5}).json()
    assert (
        problem["revision_status"],
        problem["current_revision"],
        problem["current_limit_bytes"],
    ) == ("conflict", 5, 2 * GiB)


def test_token_guards_every_mutating_endpoint(db: Path) -> None:
    settings = SidecarSettings(db_path=db, token="s3cret")
    register = {"engine": "vllm", "engine_version": "0.33.0", "state": {"status": "applied"}}
    calls = [
        ("PUT", "/instances/a/limit", {"limit": "1G"}),
        ("DELETE", "/instances/a/limit", None),
        ("POST", "/instances/a/register", register),
        ("POST", "/instances/a/report", {"status": "applied"}),
        ("DELETE", "/instances/a", None),
        ("POST", "/instances/a/deregister", None),
    ]
    with ThreadedSidecar(settings) as server, httpx.Client(base_url=server.url) as c:
        ok = c.put(
            "/instances/a/limit", json={"limit": "2G"}, headers={"Authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200
        before_api, before_db = c.get("/instances").content, db_rows(db)
        for method, path, body in calls:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Basic czNjcmV0"},
            ):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert "token" in r.json()["detail"]
        assert c.get("/instances").content == before_api  # reads need no token
        assert db_rows(db) == before_db


def test_100_concurrent_puts_lose_nothing(sidecar: ThreadedSidecar, db: Path) -> None:
    async def put_all(bodies: list[dict[str, Any]]) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=sidecar.url, limits=limits, timeout=60) as c:
            return await asyncio.gather(*(c.put("/instances/a/limit", json=b) for b in bodies))

    # Sidecar-assigned revisions: every PUT gets its own, none is lost.
    replies = asyncio.run(put_all([{"limit": i << 20} for i in range(1, 101)]))
    assert {r.status_code for r in replies} == {200}
    revisions = {
        r.json()["desired"]["revision"]: r.json()["desired"]["limit_bytes"] for r in replies
    }
    assert sorted(revisions) == list(range(1, 101))
    final = httpx.get(f"{sidecar.url}/instances/a").json()["desired"]
    assert (final["revision"], final["limit_bytes"]) == (100, revisions[100])
    assert db_rows(db)[0][1:3] == (revisions[100], 100)

    # Client revisions in random order: the highest wins; older ones arriving later are stale.
    order = list(range(101, 201))
    random.Random(5).shuffle(order)
    replies = asyncio.run(put_all([{"limit": r << 20, "revision": r} for r in order]))
    codes = {r.status_code for r in replies}
    assert codes <= {200, 409} and 200 in codes
    accepted = [rev for rev, r in zip(order, replies, strict=True) if r.status_code == 200]
    assert 200 in accepted
    for rev, r in zip(order, replies, strict=True):
        if r.status_code == 409:
            assert r.json()["revision_status"] == "stale"
            assert r.json()["current_revision"] > rev
    final = httpx.get(f"{sidecar.url}/instances/a").json()["desired"]
    assert (final["revision"], final["limit_bytes"]) == (200, 200 << 20)
    assert db_rows(db)[0][1:3] == (200 << 20, 200)


def test_health_readiness_and_metrics(client: httpx.Client) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").json() == {"status": "ready"}
    client.put("/instances/llama-a/limit", json={"limit": "4G"})
    text = client.get("/metrics").text
    assert 'kvsidecar_desired_limit_bytes{kv_instance="llama-a"} 4.294967296e+09' in text
    assert 'kvsidecar_instance_status{kv_instance="llama-a",status="pending"} 1.0' in text
    assert 'kvsidecar_instance_status{kv_instance="llama-a",status="applied"} 0.0' in text
    assert "kvsidecar_push_seconds_bucket" in text


def test_a_client_that_hangs_up_ends_its_long_poll(sidecar: ThreadedSidecar) -> None:
    tasks = sidecar.server.server_state.tasks  # uvicorn's in-flight request tasks
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=sidecar.url) as c:
        c.put("/instances/a/limit", params={"wait": 5}, json={"limit": "1G"}, timeout=0.3)
    deadline = time.monotonic() + 3  # well before the 5 s deadline of the wait
    while tasks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not tasks, "the long-poll outlived its client"


def test_a_late_reply_never_overwrites_a_newer_report(client: httpx.Client) -> None:
    """Observed state is ordered by (revision, engine passes), not by arrival."""

    def state(status: str, passes: int, mapped: int) -> dict[str, Any]:
        return {
            "status": status,
            "revision": 1,
            "limit_bytes": GiB,
            "mapped_bytes": mapped,
            "passes": passes,
            "overage_bytes": max(0, mapped - GiB),
        }

    body = {"engine": "vllm", "engine_version": "0.33.0", "state": state("deferred", 1, 2 * GiB)}
    assert client.post("/instances/late/register", json=body).status_code == 200
    assert client.post("/instances/late/report", json=state("applied", 5, GiB)).status_code == 200
    # the answer to an earlier push (same revision, fewer passes) arrives last
    assert (
        client.post("/instances/late/report", json=state("deferred", 3, 2 * GiB)).status_code == 200
    )
    view = client.get("/instances/late").json()
    assert (view["observed"]["status"], view["observed"]["passes"]) == ("applied", 5)
    assert view["mapped_bytes"] == GiB
