"""The sidecar API under generated input, over real HTTP (uvicorn on loopback, SQLite on disk).

A seeded generator sends a few hundred requests per seed to every endpoint:
sizes and revisions valid, invalid and at their bounds, odd instance ids,
engine states that contradict themselves, garbage and oversized bodies,
wrong methods, missing or wrong tokens. What must hold for every request:

* never a 5xx;
* every 4xx is ``application/problem+json`` whose ``status`` is the HTTP
  status and whose ``detail`` is a non-empty text, and it changed nothing:
  every instance view and every stored row (instances, devices, policies)
  read the same before and after;
* a ``dry_run`` budget moves no instance's desired limit (it is stored as a
  budget, in dry run: the autopilot only shows its plan);
* ``PUT /instances/{id}/limit`` follows the revision rule of docs/api.md
  exactly: an oracle built from the views before the request says whether it
  is refused (which status) or stored (which limit, which revision), and the
  view after it must say the same.

A second test fuzzes from several threads at once and then restarts the
sidecar on the same file: no 5xx, and every desired limit and revision the
API showed before the restart it shows after.
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.soak import soak_seeds
from test_sidecar_support import ThreadedSidecar

from sidecar import SidecarSettings

GiB = 1 << 30
EiB = 1 << 60
TOKEN = "fuzz-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MAX_BODY = 2048
MAX_INSTANCES = 6
MAX_CLIENT_REVISION = 1 << 53
DEVICE = "gpu-0"

# Sizes whose reading docs/api.md states: value sent -> bytes stored (None: unlimited).
GOOD_SIZES: list[tuple[Any, int | None]] = [
    (0, 0),
    ("0", 0),
    (4096, 4096),
    ("512M", 512 << 20),
    ("2G", 2 * GiB),
    ("1.5GiB", 3 * GiB // 2),
    ("4gb", 4 * GiB),
    ("1.3G", 1395864371),
    ("1024k", 1 << 20),
    ("1T", 1 << 40),
    ("9007199254740993", 9007199254740993),
    (EiB, EiB),
    (None, None),
    ("none", None),
    ("unlimited", None),
]
# Sizes docs/api.md says are refused with 422.
BAD_SIZES: list[Any] = [
    -1,
    "-1G",
    "1e3",
    1.5,
    "0.5",
    "0.0001K",
    True,
    False,
    "12X",
    "nan",
    "inf",
    EiB + 1,
    "2E",
    [],
    {},
    "",
    "\uff11G",  # a full-width digit
    "1_000",
    "0x10",
    1 << 64,
    1e30,
]
GOOD_IDS = ["a", "b", "c-1", "d.2", "e_3"]
BAD_IDS = ["-a", ".a", "a" * 64, "a%20b", "%C3%A9", "a%2Fb", "..", "%00", "a*"]
# Two engine processes' registration tokens, a malformed one, none.
REGISTRATION_TOKENS = ["proc-one-0123456789", "proc-two-0123456789"] * 2 + ["short", None]
BAD_REVISIONS: list[Any] = [0, -1, MAX_CLIENT_REVISION + 1, 1 << 63, "3", 3.5, True, []]


def _instance_ids(client: httpx.Client) -> set[str]:
    return {view["id"] for view in client.get("/instances").json()["instances"]}


def _views(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """Every instance view by id, less what moves without a request: the clock's
    ``last_seen_s_ago`` and ``policy.target_bytes`` (a dry-run budget's plan, which the
    autopilot's own passes recompute; it is never stored)."""
    out = {}
    for view in client.get("/instances").json()["instances"]:
        view.pop("last_seen_s_ago")
        if view.get("policy") is not None:
            view["policy"].pop("target_bytes")
        out[view["id"]] = view
    return out


def _rows(db: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the stored tables (the readiness probe's scratch row aside)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("instances", "devices", "policies")
        }
    finally:
        conn.close()


def _engine_state(rng: random.Random, revision: int, limit: int | None) -> dict[str, Any]:
    """An engine state: mostly consistent, sometimes one that contradicts itself."""
    mapped = rng.choice([0, GiB, 3 * GiB])
    state: dict[str, Any] = {"status": "deferred", "revision": revision, "limit_bytes": limit}
    state["mapped_bytes"] = mapped
    roll = rng.random()
    if roll < 0.5:  # consistent: applied when it is at or under its limit
        if limit is None or mapped <= limit:
            state["status"] = "applied"
        return state
    if roll < 0.6:  # applied above its own limit: a lie the sidecar refuses
        state.update(status="applied", limit_bytes=GiB, mapped_bytes=2 * GiB)
    elif roll < 0.7:
        state["overage_bytes"] = mapped + 1  # more overage than mapped
    elif roll < 0.75:
        state["ranks"] = [{"rank": 0, "mapped_bytes": 1}, {"rank": 0, "mapped_bytes": 1}]
    elif roll < 0.8:
        state["mapped_bytes"] = rng.choice([-1, "5", True, 1 << 63, 1.5])
    elif roll < 0.85:
        state["status"] = rng.choice(["done", "", None, 3, "stale", "stopped"])
    elif roll < 0.9:
        state["revision"] = rng.choice([-1, (1 << 62) + 1, "2"])
    elif roll < 0.95:
        state["revision"] = revision + rng.choice([1, 7])  # newer than the sidecar's: adopted
    return state


class Fuzzer:
    """Builds one request at a time from a seeded generator (test thread only)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def instance_id(self) -> str:
        rng = self.rng
        return rng.choice(GOOD_IDS) if rng.random() < 0.85 else rng.choice(BAD_IDS)

    def size(self) -> Any:
        rng = self.rng
        return rng.choice(GOOD_SIZES)[0] if rng.random() < 0.7 else rng.choice(BAD_SIZES)

    def revision(self, current: int) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.3:
            return None  # leave the field out
        if roll < 0.8:  # around the current one: stale, equal, next, a gap
            return max(1, current + rng.choice([-2, -1, 0, 0, 1, 1, 5]))
        if roll < 0.9:
            return rng.choice([MAX_CLIENT_REVISION, MAX_CLIENT_REVISION - 1])
        return rng.choice(BAD_REVISIONS)

    def headers(self) -> dict[str, str]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.9:
            return dict(AUTH)
        if roll < 0.95:
            return {}
        return {"authorization": rng.choice(["Bearer wrong", "Basic abc", "Bearer", TOKEN])}

    def garbage(self) -> bytes:
        rng = self.rng
        return rng.choice(
            [
                b"",
                b"{",
                b"null",
                b"[]",
                b'"2G"',
                b'{"limit": NaN}',
                b'{"limit": Infinity}',
                b'{"limit": 1, "limit": "2G"}',
                b'{"limit": "2G", "extra": 1}',
                b"\xff\xfe\x00",
                b"[" * 5000 + b"]" * 5000,
                b'{"limit": "' + b"9" * (MAX_BODY + 10) + b'"}',
                json.dumps({"limit": "1G", "pad": "x" * MAX_BODY}).encode(),
            ]
        )


def _changes(before: dict[str, Any], after: dict[str, Any], at: str = "") -> list[str]:
    """What differs between two snapshots, as paths (for the assertion messages)."""
    out = []
    for key in sorted(set(before) | set(after), key=str):
        a, b = before.get(key), after.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{at}{key}.")
        elif a != b:
            out.append(f"{at}{key}: {a!r} -> {b!r}")
    return out


def _with_registration(headers: dict[str, str], token: str | None) -> dict[str, str]:
    return headers if token is None else {**headers, "x-kvsidecar-registration": token}


def _check_problem(r: httpx.Response) -> None:
    assert r.headers["content-type"] == "application/problem+json", (r.status_code, r.text)
    body = r.json()
    assert body["status"] == r.status_code, body
    assert isinstance(body["detail"], str) and body["detail"].strip(), body


def _send(
    client: httpx.Client, method: str, path: str, body: Any, headers: dict[str, str]
) -> httpx.Response:
    if isinstance(body, bytes):
        return client.request(
            method, path, content=body, headers={"content-type": "application/json", **headers}
        )
    if body is _ABSENT:
        return client.request(method, path, headers=headers)
    return client.request(method, path, json=body, headers=headers)


_ABSENT = object()


def _limit_oracle(
    views: dict[str, dict[str, Any]],
    iid: str,
    body: Any,
    authorized: bool,
) -> tuple[set[int], int | None, int | None]:
    """What docs/api.md says a PUT of ``body`` on ``iid`` must do, from the views before it:
    (acceptable statuses, expected limit bytes, expected revision; the last two only for 200).
    An empty set: the outcome is not modelled (any non-5xx is fine)."""
    if not authorized:
        return {401}, None, None
    if iid in BAD_IDS:
        return {404, 422}, None, None
    if not isinstance(body, dict) or set(body) - {"limit", "revision"} or "limit" not in body:
        return {422}, None, None
    good = {json.dumps(v): b for v, b in GOOD_SIZES}
    key = json.dumps(body["limit"])
    revision = body.get("revision")
    if key not in good:
        return {422}, None, None
    if revision is not None and (
        type(revision) is not int or not 1 <= revision <= MAX_CLIENT_REVISION
    ):
        return {422}, None, None
    limit = good[key]
    view = views.get(iid)
    if view is None:
        if len(views) >= MAX_INSTANCES:
            return {409}, None, None
        return {200}, limit, revision if revision is not None else 1
    current = view["desired"]["revision"]
    if revision is None:
        return {200}, limit, current + 1
    if revision > current:
        return {200}, limit, revision
    if revision == current and view["desired"]["limit_bytes"] == limit:
        return {200}, limit, current
    return {409}, None, None


def _fuzz(
    client: httpx.Client,
    db: Path,
    rng: random.Random,
    requests: int,
    check: bool,
    log: list[str],
) -> None:
    """Send ``requests`` generated requests; with ``check``, hold every promise above after
    each (single sender only: the before/after reads assume nobody else writes)."""
    gen = Fuzzer(rng)
    for n in range(requests):
        views = _views(client) if check else {}
        rows = _rows(db) if check else {}
        iid = gen.instance_id()
        headers = gen.headers()
        roll = rng.random()
        oracle: tuple[set[int], int | None, int | None] | None = None
        dry_run = False
        if roll < 0.45:
            body: Any = {"limit": gen.size()}
            revision = gen.revision(views.get(iid, {}).get("desired", {}).get("revision", 0))
            if revision is not None:
                body["revision"] = revision
            if rng.random() < 0.05:
                body["extra"] = 1
            method, path = "PUT", f"/instances/{iid}/limit"
            if rng.random() < 0.1:
                path += "?wait=" + rng.choice(["-1", "abc", "nan", "301", "1e9", "0"])
            elif check:
                oracle = _limit_oracle(views, iid, body, headers == AUTH)
        elif roll < 0.52:
            method, path, body = "DELETE", f"/instances/{iid}/limit", _ABSENT
        elif roll < 0.56:
            method, path, body = "DELETE", f"/instances/{iid}", _ABSENT
        elif roll < 0.66:
            desired = views.get(iid, {}).get("desired", {})
            state = _engine_state(rng, desired.get("revision", 0), desired.get("limit_bytes"))
            body = {
                "engine": rng.choice(["vllm"] * 6 + ["sglang", "", "x" * 65]),
                "engine_version": "0.33.0",
                "device_total_bytes": rng.choice([80 * GiB] * 6 + [-1, EiB + 1, None]),
                "device_id": rng.choice([DEVICE] * 4 + [None, "bad dev", "gpu-1"]),
                "state": state,
            }
            token = rng.choice(REGISTRATION_TOKENS)
            if token is not None:
                body["registration_token"] = token
            method, path = "POST", f"/instances/{iid}/register"
        elif roll < 0.74:
            desired = views.get(iid, {}).get("desired", {})
            body = _engine_state(rng, desired.get("revision", 0), desired.get("limit_bytes"))
            method, path = "POST", f"/instances/{iid}/report"
            headers = _with_registration(headers, rng.choice(REGISTRATION_TOKENS))
        elif roll < 0.77:
            method, path, body = "POST", f"/instances/{iid}/deregister", _ABSENT
            headers = _with_registration(headers, rng.choice(REGISTRATION_TOKENS))
        elif roll < 0.83:
            body = {k: gen.size() for k in rng.sample(["min", "max"], rng.randint(0, 2))}
            if rng.random() < 0.4:
                body["weight"] = rng.choice([1, 0.5, 0, -1, "2", True, 1e308])
            method, path = "PUT", f"/instances/{iid}/policy"
        elif roll < 0.88:
            dry_run = rng.random() < 0.7
            body = {"budget": gen.size(), "dry_run": dry_run}
            if not dry_run:  # a live budget only with a bad size: a live one starts the autopilot
                body["budget"] = rng.choice(BAD_SIZES)
            dev = rng.choice([DEVICE, "gpu-9", "bad dev"])
            method, path = "PUT", f"/devices/{dev}/budget"
        elif roll < 0.91:
            limits = {rng.choice(GOOD_IDS + BAD_IDS): gen.size() for _ in range(rng.randint(0, 3))}
            method, path, body = "PUT", f"/devices/{DEVICE}/limits", {"limits": limits}
        elif roll < 0.93:
            wait = rng.choice(["-1", "abc", "nan", "inf", "301", "0", "0.01", ""])
            method, path, body = "GET", f"/instances/{iid}?wait={wait}", _ABSENT
        elif roll < 0.96:
            method = "PUT" if rng.random() < 0.5 else "POST"
            path = rng.choice([f"/instances/{iid}/limit", f"/instances/{iid}/report"])
            body = gen.garbage()
        else:
            method = rng.choice(["PATCH", "POST", "PUT", "DELETE"])
            path = rng.choice(["/instances", "/healthz", "/metrics", "/devices", "/nowhere"])
            body = _ABSENT
        r = _send(client, method, path, body, headers)
        what = f"#{n} {method} {path} {body if not isinstance(body, bytes) else body[:60]!r}"
        log.append(f"{what} -> {r.status_code}")
        assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            _check_problem(r)
        if not check:
            continue
        if dry_run and r.status_code < 400:  # stored as a budget in dry run: no limit moves
            after = _views(client)
            desired = {i: v["desired"] for i, v in views.items()}
            assert {i: v["desired"] for i, v in after.items()} == desired, what
        elif r.status_code >= 400:
            after = _views(client)
            assert after == views, f"{what} -> {r.status_code}: {_changes(views, after)}"
            assert _rows(db) == rows, f"{what} -> {r.status_code}: {_changes(rows, _rows(db))}"
        if oracle is not None:
            statuses, limit, revision = oracle
            assert r.status_code in statuses, f"{what}: {r.status_code} {r.text[:300]}"
            if r.status_code == 200:
                desired = _views(client)[iid]["desired"]
                assert (desired["limit_bytes"], desired["revision"]) == (limit, revision), what


def _settings(db: Path) -> SidecarSettings:
    return SidecarSettings(
        db_path=db,
        token=TOKEN,
        max_body_bytes=MAX_BODY,
        max_wait_s=1,
        max_instances=MAX_INSTANCES,
        heartbeat_timeout_s=3600,  # no instance turns unreachable while the test reads
    )


@pytest.mark.parametrize("seed", soak_seeds() or range(4))
def test_generated_requests_never_5xx_and_refusals_change_nothing(
    tmp_path: Path, seed: int
) -> None:
    db = tmp_path / "sidecar.db"
    log: list[str] = []
    with (
        ThreadedSidecar(_settings(db)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        _fuzz(client, db, random.Random(seed), 350, True, log)
        assert client.get("/healthz").status_code == 200
    # the generator reached the paths that matter: stored limits, refusals of each kind
    statuses = {line.rsplit(" ", 1)[1] for line in log}
    assert {"200", "401", "404", "409", "422"} <= statuses, statuses


def test_concurrent_generated_requests_and_a_restart_keep_what_was_stored(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sidecar.db"
    errors: list[BaseException] = []
    logs: list[list[str]] = [[] for _ in range(4)]
    with ThreadedSidecar(_settings(db)) as server:

        def sender(k: int) -> Callable[[], None]:
            def run() -> None:
                try:
                    with httpx.Client(base_url=server.url, timeout=30) as client:
                        _fuzz(client, db, random.Random(100 + k), 200, False, logs[k])
                except BaseException as exc:  # noqa: BLE001 -- reported below
                    errors.append(exc)

            return run

        threads = [threading.Thread(target=sender(k)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        with httpx.Client(base_url=server.url, timeout=30) as client:
            before = {i: v["desired"] for i, v in _views(client).items()}
    assert before, "no limit was stored: the generator sent nothing the sidecar kept"
    with (
        ThreadedSidecar(_settings(db)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        after = {i: v["desired"] for i, v in _views(client).items()}
    assert after == before
