"""Operations hardening (issue 14, "Must fix"), over real HTTP: uvicorn on loopback,
SQLite on disk, raw sockets where a well-behaved client would hide the problem."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.rawhttp import framed_replies, mutated_request
from support.soak import soak_seeds
from test_sidecar_support import ThreadedSidecar, db_rows

from engine_ext.protocol import MAX_CLIENT_REVISION, MAX_REVISION, REGISTRATION_HEADER
from sidecar import SidecarSettings
from sidecar._errors import SidecarConfigError
from sidecar._store import Store

MiB, GiB = 1 << 20, 1 << 30
TOKEN_A = "A" * 32
TOKEN_B = "B" * 32


def _register(
    c: httpx.Client, iid: str = "a", token: str | None = TOKEN_A, **state: Any
) -> httpx.Response:
    body: dict[str, Any] = {
        "engine": "vllm",
        "engine_version": "0.33.0",
        "socket_path": "/nonexistent/kvsidecar-test.sock",
        "state": {"status": "applied", **state},
    }
    if token is not None:
        body["registration_token"] = token
    return c.post(f"/instances/{iid}/register", json=body)


def _report(
    c: httpx.Client, iid: str = "a", token: str | None = TOKEN_A, **state: Any
) -> httpx.Response:
    headers = {} if token is None else {REGISTRATION_HEADER: token}
    return c.post(f"/instances/{iid}/report", json={"status": "applied", **state}, headers=headers)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "sidecar.db"


def _serve(db: Path, **kw: Any) -> ThreadedSidecar:
    return ThreadedSidecar(
        SidecarSettings(db_path=db, push_backoff_initial_s=0.05, push_backoff_max_s=0.2, **kw)
    )


@pytest.fixture
def client(db: Path) -> Iterator[httpx.Client]:
    with _serve(db) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


# --- 1. revisions ------------------------------------------------------------------------


def test_a_client_revision_near_the_top_never_wedges_the_instance(
    client: httpx.Client, db: Path
) -> None:
    r = client.put("/instances/a/limit", json={"limit": "1M", "revision": MAX_REVISION})
    assert r.status_code == 422 and "less than or equal to" in r.json()["detail"]
    assert client.get("/instances/a").status_code == 404  # nothing stored
    r = client.put("/instances/a/limit", json={"limit": "1M", "revision": MAX_CLIENT_REVISION})
    assert r.status_code == 200, r.text
    r = client.put("/instances/a/limit", json={"limit": "2M"})  # the next one is taken
    assert r.status_code == 200 and r.json()["desired"]["revision"] == MAX_CLIENT_REVISION + 1
    assert client.delete("/instances/a/limit").status_code == 200
    # every engine path still answers (it was 500 for ever)
    assert _register(client).status_code == 200
    rev = MAX_CLIENT_REVISION + 2
    reply = _report(client, revision=rev, limit_bytes=None)
    assert reply.status_code == 200 and reply.json()["revision"] == rev


def test_the_largest_revision_is_refused_clearly_and_changes_nothing(
    client: httpx.Client, db: Path
) -> None:
    # an engine may hold the largest revision (it adopts what it is sent): the sidecar adopts it
    assert (
        _register(
            client, revision=MAX_REVISION, limit_bytes=MiB, effective_limit_bytes=MiB
        ).status_code
        == 200
    )
    assert client.get("/instances/a").json()["desired"]["revision"] == MAX_REVISION
    before = db_rows(db)
    for r in (
        client.put("/instances/a/limit", json={"limit": "4M"}),
        client.delete("/instances/a/limit"),
    ):
        assert r.status_code == 409, r.text
        assert "largest revision" in r.json()["detail"] and "forget" in r.json()["detail"]
    assert db_rows(db) == before
    # register, report and the push path keep working; forget recovers the id
    assert (
        _register(
            client, revision=MAX_REVISION, limit_bytes=MiB, effective_limit_bytes=MiB
        ).status_code
        == 200
    )
    assert (
        _report(
            client, revision=MAX_REVISION, limit_bytes=MiB, effective_limit_bytes=MiB
        ).status_code
        == 200
    )
    assert client.delete("/instances/a").status_code == 204
    r = client.put("/instances/a/limit", json={"limit": "4M"})
    assert r.status_code == 200 and r.json()["desired"]["revision"] == 1


# --- 2. connections ----------------------------------------------------------------------


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (30 s socket timeout)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def _closed_answer(sock: socket.socket) -> bytes:
    """The status line the server sent before closing, or ``(reset)``."""
    try:
        return _read_until_closed(sock)[:12]
    except ConnectionResetError:
        return b"(reset)"


def test_half_sent_requests_are_closed_and_health_still_answers(db: Path) -> None:
    with _serve(db, header_timeout_s=1, body_timeout_s=1, max_connections=300) as server:
        headers_only = [_raw(server.url) for _ in range(100)]
        for sock in headers_only:
            sock.sendall(b"PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\n")  # never ends
        bodies = [_raw(server.url) for _ in range(50)]
        for sock in bodies:  # the headers, then a body that stops short (valid JSON so far!)
            sock.sendall(
                b"PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                b'{"limit": 1}'
            )
        silent = [_raw(server.url) for _ in range(20)]  # connect, send nothing
        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
        for sock in headers_only + bodies + silent:
            answer = _read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            [(_code, headers, body)] = framed_replies(answer)
            assert headers["content-type"] == "application/problem+json"
            assert "KVSIDECAR_HEADER_TIMEOUT_S" in json.loads(body)["detail"]
            sock.close()
        # the partial body was never used, the server still answers
        assert httpx.get(f"{server.url}/instances").json() == {"instances": []}
        assert db_rows(db) == []


def test_half_sent_requests_beyond_the_cap_are_evicted_and_health_answers(db: Path) -> None:
    """A client holding max_connections half-sent requests cannot lock others out."""
    with _serve(db, max_connections=8, header_timeout_s=60) as server:
        held = [_raw(server.url) for _ in range(30)]
        for sock in held:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never ends
        for _ in range(5):  # each new request evicts the longest-waiting half-sent one
            assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
        # 30 - 8 evictions among them (+1 for the first health check; the later ones find
        # room), the oldest first: the oldest 20 are closed, none was served. Evictions
        # begin as the connections arrive: one closed (408 sent) before this test sent its
        # half request is reset by the server's kernel when that request reaches it, and a
        # reset drops the 408 unread. Closed either way, never answered.
        answers = [_closed_answer(sock) for sock in held[:20]]
        assert set(answers) <= {b"HTTP/1.1 408", b"(reset)"}, answers
        for sock in held:
            sock.close()


def test_half_sent_bodies_beyond_the_cap_are_evicted_and_health_answers(db: Path) -> None:
    """Bodies that never finish (headers complete, the app waits on the body) count as
    waiting on their client, not as busy: they are evicted like half-sent headers (GET
    needs no token, so a token does not keep them out)."""
    with _serve(db, max_connections=8, body_timeout_s=60) as server:
        held = [_raw(server.url) for _ in range(30)]
        for sock in held:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n{}")
        for _ in range(5):
            assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
        for sock in held:
            sock.close()


def test_clients_that_do_not_read_their_answers_are_evicted_beyond_the_cap(db: Path) -> None:
    """A client that pipelines requests for a large answer and never reads it holds its
    connection while uvicorn's writes are paused: under the cap it is evicted."""
    with _serve(db, max_connections=8) as server:
        held = [_raw(server.url) for _ in range(8)]
        for sock in held:
            sock.sendall(b"GET /docs-assets/swagger-ui-bundle.js HTTP/1.1\r\nHost: x\r\n\r\n" * 16)
        time.sleep(0.5)  # the server fills their socket buffers and pauses its writes
        for _ in range(5):
            assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
        for sock in held:
            sock.close()


def test_connections_beyond_the_cap_are_refused_when_all_are_busy(db: Path) -> None:
    # every connection may wait here (KVSIDECAR_MAX_WAITS at the connection cap, not the
    # default half), so long-polls can make them all busy in the app
    with (
        _serve(db, max_connections=8, max_waits=8, max_wait_s=30) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        assert c.put("/instances/a/limit", json={"limit": "1G"}).status_code == 200
        busy = [_raw(server.url) for _ in range(8)]
        for sock in busy:  # long-polls on an instance that will never apply: busy in the app
            sock.sendall(b"GET /instances/a?wait=30 HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 30
        while True:  # until the server has them all (no assertion on time)
            extra = _raw(server.url)
            extra.settimeout(2)  # sends nothing: a refused one is answered at once
            try:
                answer = _read_until_closed(extra)
            except TimeoutError:
                answer = b"(accepted)"
            extra.close()
            if answer.startswith(b"HTTP/1.1 503"):
                [(_code, headers, body)] = framed_replies(answer)
                assert headers["content-type"] == "application/problem+json"
                assert headers["retry-after"] == "1"
                assert "KVSIDECAR_MAX_CONNECTIONS" in json.loads(body)["detail"]
                break
            assert time.monotonic() < deadline, answer
            time.sleep(0.05)
        for sock in busy:
            sock.close()
        deadline = time.monotonic() + 30
        while True:  # once they are gone, new connections are served again
            try:
                if httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the sidecar never served again"
            time.sleep(0.05)


def _send_whole(url: str, request: bytes) -> bytes:
    """Send ``request``, half-close, and read until the server closes."""
    with _raw(url) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        return _read_until_closed(sock)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /healthz\r\n\r\n",  # HTTP/0.9
        b"GET /healthz HTTP/1.1\r\n\r\n",  # no Host
        (
            b"PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n"
            b'Content-Length: 0\r\n\r\n{"limit": "1G"}'
        ),
        b'PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\nContent-Length: +15\r\n\r\n{"limit": "1G"}',
        b"PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
    ],
)
def test_what_the_http_parser_refuses_is_problem_json_and_changes_nothing(
    db: Path, request_bytes: bytes
) -> None:
    """Requests h11 cannot read get problem+json like every other error (uvicorn's own
    answer is a line of text), and the connection is closed."""
    with _serve(db) as server:
        [(code, headers, body)] = framed_replies(_send_whole(server.url, request_bytes))
        problem = json.loads(body)
        assert (code, problem["status"]) == (400, 400)
        assert headers["content-type"] == "application/problem+json"
        assert headers["connection"] == "close"
        assert "Host header" in problem["detail"] and "Content-Length" in problem["detail"]
        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
        assert db_rows(db) == []


@pytest.mark.parametrize("seed", soak_seeds() or range(2))
def test_mutated_requests_get_framed_problem_json_answers(db: Path, seed: int) -> None:
    """Valid requests cut, spliced, byte-flipped and repeated, each on its own connection
    (half-closed after sending): every byte the server sends back is a framed HTTP/1.1
    reply with a JSON body (problem+json for errors), never a 5xx, and the server keeps
    serving. (What the stored state does under bad input is checked with whole requests
    in test_sidecar_fuzz_http.py: here a request carried out may lose its answer, as
    uvicorn drops the answers of a connection whose client half-closed.)"""
    rng = random.Random(seed)
    seeds = [
        (
            b"PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'Content-Length: 15\r\n\r\n{"limit": "1G"}'
        ),
        (
            b"PUT /instances/b/limit HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b'Content-Length: 30\r\n\r\n{"limit": "2G", "revision": 9}'
        ),
        b"GET /instances HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /instances/a?wait=0 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"DELETE /instances/a/limit HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ]
    with _serve(db, header_timeout_s=2, body_timeout_s=2, max_body_bytes=1024) as server:
        for _ in range(120):
            request = mutated_request(rng, seeds)
            replies = framed_replies(_send_whole(server.url, request))
            for code, headers, body in replies:
                assert code < 500, (request, code, body)
                assert headers["content-type"] == (
                    "application/problem+json" if code >= 400 else "application/json"
                ), (request, code)
                json.loads(body)
        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200


def test_no_token_is_refused_before_the_body_is_read(db: Path) -> None:
    with _serve(db, token="s3cret", body_timeout_s=60) as server:
        sock = _raw(server.url)
        sock.settimeout(20)  # well below the body timeout: the answer must not wait for it
        sock.sendall(
            b"PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 60000\r\n\r\n"
        )
        answer = _read_until_closed(sock)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 401"), answer
        assert b"requires a bearer token" in answer
        assert b'www-authenticate: bearer realm="kvsidecar"' in answer.lower()
        for wrong in ("Bearer nope", "Basic czNjcmV0"):
            sock = _raw(server.url)
            sock.settimeout(20)
            sock.sendall(
                b"POST /instances/a/register HTTP/1.1\r\nHost: x\r\nAuthorization: "
                + wrong.encode()
                + b"\r\nContent-Length: 5000\r\n\r\n"
            )
            assert _read_until_closed(sock).startswith(b"HTTP/1.1 401")
            sock.close()
        assert db_rows(db) == []


# --- 4. forget and stopped ---------------------------------------------------------------


def test_forget_removes_an_instance_everywhere(client: httpx.Client, db: Path) -> None:
    assert client.put("/instances/typo/limit", json={"limit": "1G"}).status_code == 200
    assert client.put("/instances/kept/limit", json={"limit": "2G"}).status_code == 200
    r = client.delete("/instances/typo")
    assert r.status_code == 204 and r.content == b""
    assert client.get("/instances/typo").status_code == 404
    assert [v["id"] for v in client.get("/instances").json()["instances"]] == ["kept"]
    assert 'instance="typo"' not in client.get("/metrics").text
    assert [row[0] for row in db_rows(db)] == ["kept"]
    r = client.delete("/instances/typo")
    assert r.status_code == 404 and "'typo' is not known" in r.json()["detail"]


def test_a_forgotten_live_engine_registers_again(client: httpx.Client) -> None:
    assert (
        _register(
            client, revision=3, limit_bytes=GiB, effective_limit_bytes=GiB, mapped_bytes=GiB
        ).status_code
        == 200
    )
    assert client.delete("/instances/a").status_code == 204
    assert _report(client, revision=3, limit_bytes=GiB).status_code == 404  # -> re-register
    assert (
        _register(
            client, revision=3, limit_bytes=GiB, effective_limit_bytes=GiB, mapped_bytes=GiB
        ).status_code
        == 200
    )
    assert client.get("/instances/a").json()["desired"]["revision"] == 3  # adopted again


def test_a_clean_shutdown_is_stopped_not_unreachable_and_keeps_the_limit(db: Path) -> None:
    with (
        _serve(db, heartbeat_timeout_s=0.3) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        assert c.put("/instances/a/limit", json={"limit": "1G"}).status_code == 200
        assert (
            _register(c, revision=1, limit_bytes=GiB, effective_limit_bytes=GiB).status_code == 200
        )
        r = c.post("/instances/a/deregister", headers={REGISTRATION_HEADER: TOKEN_A})
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["reason"]) == ("stopped", "deregistered")
        time.sleep(0.6)  # past the heartbeat timeout: still stopped, never unreachable
        view = c.get("/instances/a").json()
        assert view["status"] == "stopped" and view["desired"]["limit_bytes"] == GiB
        assert (
            'kvsidecar_instance_status{kv_instance="a",status="stopped"} 1.0'
            in c.get("/metrics").text
        )
        assert _report(c).status_code == 404  # a stopped engine must register again
    with (
        _serve(db, heartbeat_timeout_s=0.3) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        assert c.get("/instances/a").json()["status"] == "stopped"  # durable
        assert (
            _register(
                c, token=TOKEN_B, revision=1, limit_bytes=GiB, effective_limit_bytes=GiB
            ).status_code
            == 200
        )
        assert c.get("/instances/a").json()["status"] == "applied"


# --- 5. one id, two processes ------------------------------------------------------------


def test_a_second_live_process_on_one_id_is_refused(client: httpx.Client, db: Path) -> None:
    assert _register(client, revision=0).status_code == 200
    before_api, before_db = client.get("/instances/a").json(), db_rows(db)
    r = _register(client, token=TOKEN_B, mapped_bytes=GiB)
    assert r.status_code == 409, r.text
    assert "held by another live engine process" in r.json()["detail"]
    assert "KVSIDECAR_INSTANCE_ID" in r.json()["detail"]
    r = _report(client, token=TOKEN_B, mapped_bytes=GiB)
    assert r.status_code == 409
    r = client.post("/instances/a/deregister", headers={REGISTRATION_HEADER: TOKEN_B})
    assert r.status_code == 409
    after = client.get("/instances/a").json()
    assert {**after, "last_seen_s_ago": None} == {**before_api, "last_seen_s_ago": None}
    assert db_rows(db) == before_db
    assert _report(client, token=TOKEN_A).status_code == 200  # the holder carries on
    # once the holder stops cleanly, the other process takes the id
    assert (
        client.post("/instances/a/deregister", headers={REGISTRATION_HEADER: TOKEN_A}).status_code
        == 200
    )
    assert _register(client, token=TOKEN_B).status_code == 200
    assert _report(client, token=TOKEN_A).status_code == 409


def test_a_silent_holder_is_released_after_the_heartbeat_timeout(db: Path) -> None:
    with (
        _serve(db, heartbeat_timeout_s=0.3) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        assert _register(c).status_code == 200
        assert _register(c, token=TOKEN_B).status_code == 409
        time.sleep(0.6)  # the holder was kill -9'ed: no report since
        assert _register(c, token=TOKEN_B).status_code == 200


def test_a_restart_that_serves_the_holders_socket_takes_the_id_over_at_once(
    client: httpx.Client, tmp_path: Path
) -> None:
    """kill -9 and a restart before the heartbeat times out: the new process serves the same
    control socket (an engine binds it only when nobody answers), and its /healthz shows the
    mark of its own registration token, so the sidecar hands it the id, and the retained
    limit, at once. A live holder's socket answers with the holder's mark: still refused."""
    from engine_ext import ControlServer, LimitMailbox
    from engine_ext.protocol import registration_mark

    path = str(tmp_path / "control.sock")

    def register(token: str, socket_path: str = path) -> httpx.Response:
        body = {
            "engine": "vllm",
            "engine_version": "0.33.0",
            "socket_path": socket_path,
            "registration_token": token,
            "state": {"status": "applied"},
        }
        return client.post("/instances/a/register", json=body)

    holder = ControlServer(path, LimitMailbox(), registration_mark(TOKEN_A))
    holder.start()
    assert register(TOKEN_A).status_code == 200
    assert client.put("/instances/a/limit", json={"limit": "1M"}).status_code == 200
    # a second engine while the holder lives: on its own socket, or claiming the holder's
    assert register(TOKEN_B, str(tmp_path / "other.sock")).status_code == 409
    assert register(TOKEN_B).status_code == 409
    holder.stop()  # the holder dies (its socket file stays after a kill -9: recreate one)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()
    assert register(TOKEN_B).status_code == 409  # nobody answers: nothing is proven
    restarted = ControlServer(path, LimitMailbox(), registration_mark(TOKEN_B))
    restarted.start()  # the restarted engine clears the dead socket and serves it
    try:
        r = register(TOKEN_B)
        assert r.status_code == 200, r.text
        assert r.json() == {"limit": MiB, "revision": 1}  # the retained limit, at once
        assert _report(client, token=TOKEN_A).status_code == 409  # the old holder is out
    finally:
        restarted.stop()


# --- 6. reports are checked --------------------------------------------------------------


def test_an_inconsistent_report_is_rejected_logged_and_changes_nothing(
    client: httpx.Client, db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert client.put("/instances/a/limit", json={"limit": "1M"}).status_code == 200
    assert (
        _register(
            client, revision=1, limit_bytes=MiB, effective_limit_bytes=MiB, mapped_bytes=MiB
        ).status_code
        == 200
    )
    before_api, before_db = client.get("/instances/a").json(), db_rows(db)
    with caplog.at_level(logging.WARNING, logger="kvsidecar.service"):
        r = _report(
            client, revision=1, limit_bytes=MiB, effective_limit_bytes=MiB, mapped_bytes=10 * GiB
        )
    assert r.status_code == 422 and "inconsistent report" in r.json()["detail"]
    assert "rejected an inconsistent report" in caplog.text
    after = client.get("/instances/a").json()
    assert after["status"] == "applied" and after["mapped_bytes"] == MiB
    assert {**after, "last_seen_s_ago": None} == {**before_api, "last_seen_s_ago": None}
    assert db_rows(db) == before_db


# --- 8. token, caps, readiness -----------------------------------------------------------


def test_a_token_with_surrounding_whitespace_is_stripped(db: Path) -> None:
    with _serve(db, token="  s3cret\n") as server, httpx.Client(base_url=server.url) as c:
        r = c.put(
            "/instances/a/limit", json={"limit": "1G"}, headers={"Authorization": "Bearer s3cret"}
        )
        assert r.status_code == 200, r.text
        assert c.put("/instances/a/limit", json={"limit": "1G"}).status_code == 401


def test_a_token_with_inner_whitespace_is_refused_at_start(db: Path) -> None:
    with pytest.raises(ValueError, match="KVSIDECAR_TOKEN must be printable ASCII without"):
        SidecarSettings(db_path=db, token="s3 cret")


def test_a_token_no_client_can_send_is_refused_at_start(db: Path) -> None:
    """'é' started the sidecar, and no HTTP client can put it in a header: every PUT was
    locked out (kvctl ended in a UnicodeEncodeError traceback)."""
    line = _refused_at_start(db, env={"KVSIDECAR_TOKEN": "s3cr\u00e9t"})
    assert "KVSIDECAR_TOKEN must be printable ASCII" in line, line


def test_a_port_in_use_or_an_unknown_host_is_one_line(db: Path) -> None:
    """uvicorn logged its start-up, an ERROR line and its shutdown, and exited 3."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        line = _refused_at_start(db, "--port", port)
        assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in line, line
    line = _refused_at_start(db, "--host", "no-such-host.invalid")
    assert "cannot listen on no-such-host.invalid" in line and "KVSIDECAR_HOST" in line, line


def test_serve_names_a_misspelt_setting(db: Path) -> None:
    """``KVSIDECAR_HEARTBEAT_TIMEOUT=3`` (no ``_S``) was dropped without a word: the
    sidecar ran with 15 s."""
    from test_sidecar_support import SidecarProcess

    proc = SidecarProcess(db, {"KVSIDECAR_HEARTBEAT_TIMEOUT": "3"}).start()
    proc.stop()
    assert (
        "KVSIDECAR_HEARTBEAT_TIMEOUT is not a kvsidecar setting, so it is ignored; "
        "did you mean KVSIDECAR_HEARTBEAT_TIMEOUT_S?" in proc.stderr
    ), proc.stderr


@pytest.mark.parametrize(
    ("args", "env"),
    [((), {"KVSIDECAR_HOST": ""}), ((), {"KVSIDECAR_HOST": "  "}), (("--host", ""), {})],
)
def test_an_empty_host_is_refused_not_bound_on_every_interface(
    db: Path, args: tuple[str, ...], env: dict[str, str]
) -> None:
    """uvicorn binds an empty host on 0.0.0.0 and [::] (ss showed both): an empty
    KVSIDECAR_HOST, e.g. a compose ``${SIDECAR_HOST}`` left unset, exposed the sidecar."""
    line = _refused_at_start(db, *args, env=env)
    assert "bad setting KVSIDECAR_HOST" in line and "every interface" in line, line


def test_the_instance_count_is_capped(db: Path) -> None:
    with _serve(db, max_instances=3) as server, httpx.Client(base_url=server.url) as c:
        for i in range(3):
            assert c.put(f"/instances/i{i}/limit", json={"limit": "1G"}).status_code == 200
        before_api, before_db = c.get("/instances").json(), db_rows(db)
        for r in (c.put("/instances/i3/limit", json={"limit": "1G"}), _register(c, "i3")):
            assert r.status_code == 409, r.text
            assert "KVSIDECAR_MAX_INSTANCES" in r.json()["detail"]
        assert c.get("/instances").json() == before_api and db_rows(db) == before_db
        assert c.put("/instances/i0/limit", json={"limit": "2G"}).status_code == 200  # known
        assert _register(c, "i1").status_code == 200
        assert c.delete("/instances/i2").status_code == 204  # forget makes room
        assert c.put("/instances/i3/limit", json={"limit": "1G"}).status_code == 200


def test_readyz_fails_once_the_database_file_is_deleted(db: Path) -> None:
    with _serve(db) as server, httpx.Client(base_url=server.url) as c:
        assert c.get("/readyz").status_code == 200
        assert c.put("/instances/kept/limit", json={"limit": "1G"}).status_code == 200
        db.unlink()
        r = c.get("/readyz")
        assert r.status_code == 503 and "deleted or replaced" in r.json()["detail"]
        # a write would go to a file no one reads: refused, never a 200 that is lost
        r = c.put("/instances/lost/limit", json={"limit": "2G"})
        assert r.status_code == 503 and "deleted or replaced" in r.json()["detail"], r.text
        assert c.get("/instances/lost").status_code == 404
        assert c.get("/healthz").status_code == 200  # alive, not ready


def _refused_at_start(db: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``kvsidecar serve --db DB [ARGS]`` in a child (with ``env`` added to the environment),
    which must refuse to start: exit 2 and one line on stderr (no traceback). Returns that
    line."""
    import os
    import subprocess
    import sys

    from test_sidecar_support import ROOT

    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "serve", "--port", "0", "--db", str(db), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    return proc.stderr


def test_a_second_sidecar_on_one_database_is_refused(db: Path) -> None:
    """Two sidecars on one file would serve the rows each loaded at start and hand out
    revisions the other already used: the second is refused, in one line, exit 2."""
    with _serve(db) as server, httpx.Client(base_url=server.url) as c:
        assert c.put("/instances/a/limit", json={"limit": "1G"}).status_code == 200
        assert "another kvsidecar serves the database" in _refused_at_start(db)
        assert c.put("/instances/a/limit", json={"limit": "2G"}).status_code == 200
    with _serve(db) as server, httpx.Client(base_url=server.url) as c:  # released at close
        assert c.get("/instances/a").json()["desired"]["limit_bytes"] == 2 * GiB


def test_a_database_with_foreign_columns_is_one_line(tmp_path: Path) -> None:
    for version in (1, 2):
        path = tmp_path / f"v{version}.db"
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE instances (id TEXT PRIMARY KEY, lim INTEGER)")
        conn.execute(f"PRAGMA user_version={version}")
        conn.commit()
        conn.close()
        line = _refused_at_start(path)
        assert "has the columns (id, lim)" in line and "--db" in line


# the schema a version-1 sidecar created, with a row
_V1_DATABASE = """
    CREATE TABLE instances (id TEXT PRIMARY KEY, limit_bytes INTEGER,
        revision INTEGER NOT NULL, updated_at REAL NOT NULL, engine TEXT,
        engine_version TEXT, socket_path TEXT, device_total_bytes INTEGER,
        registered_at REAL) STRICT;
    INSERT INTO instances VALUES ('old', 1073741824, 7, 1.0, NULL, NULL, NULL, NULL, NULL);
    PRAGMA user_version=1;"""


def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    conn.executescript(_V1_DATABASE)
    conn.close()
    with _serve(path) as server, httpx.Client(base_url=server.url) as c:
        view = c.get("/instances/old").json()
        assert view["desired"] == {**view["desired"], "limit_bytes": GiB, "revision": 7}
        assert c.get("/readyz").status_code == 200


# the schema a version-3 sidecar created, with its rows
_V3_DATABASE = """
        CREATE TABLE instances (id TEXT PRIMARY KEY, limit_bytes INTEGER,
            revision INTEGER NOT NULL, updated_at REAL NOT NULL, engine TEXT,
            engine_version TEXT, socket_path TEXT, device_total_bytes INTEGER,
            registered_at REAL, stopped_at REAL) STRICT;
        CREATE TABLE devices (id TEXT PRIMARY KEY, budget_bytes INTEGER,
            revision INTEGER NOT NULL, updated_at REAL NOT NULL,
            dry_run INTEGER NOT NULL DEFAULT 0) STRICT;
        CREATE TABLE policies (id TEXT PRIMARY KEY, device_id TEXT,
            min_bytes INTEGER NOT NULL DEFAULT 0, max_bytes INTEGER,
            weight REAL NOT NULL DEFAULT 1.0, pinned INTEGER NOT NULL DEFAULT 0,
            pin_bytes INTEGER, source TEXT, reason TEXT, changed_at REAL) STRICT;
        INSERT INTO instances VALUES ('old', 1073741824, 7, 1.0, 'vllm', '0.33', NULL,
            NULL, 1.0, NULL);
        INSERT INTO devices VALUES ('gpu-9', 8589934592, 2, 1.0, 0);
        INSERT INTO policies VALUES ('old', 'gpu-9', 0, NULL, 1.0, 1, 1073741824,
            'operator', 'operator', 1.0);
        PRAGMA user_version=3;"""


def test_a_version_3_database_gains_the_pins_revision(tmp_path: Path) -> None:
    """Version 3 (the autopilot's tables, no ``pin_revision``) is migrated on open: its
    budget and pin are kept, and a pin with a revision is then recorded."""
    path = tmp_path / "v3.db"
    conn = sqlite3.connect(path)
    conn.executescript(_V3_DATABASE)
    conn.close()
    with _serve(path) as server, httpx.Client(base_url=server.url) as c:
        view = c.get("/instances/old").json()
        assert view["desired"] == {**view["desired"], "limit_bytes": GiB, "revision": 7}
        assert view["policy"]["pinned"] is True and view["policy"]["pin_bytes"] == GiB
        assert c.get("/devices/gpu-9").json()["budget_bytes"] == 8 * GiB
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    assert conn.execute("SELECT pin_revision, floor_bytes FROM policies").fetchall() == [(None, 0)]
    conn.close()


# the schema a version-4 sidecar created (sidecar/_store.py at schema 4), with its rows
_V4_DATABASE = """
    CREATE TABLE instances (id TEXT PRIMARY KEY, limit_bytes INTEGER,
        revision INTEGER NOT NULL, updated_at REAL NOT NULL, engine TEXT,
        engine_version TEXT, socket_path TEXT, device_total_bytes INTEGER,
        registered_at REAL, stopped_at REAL) STRICT;
    CREATE TABLE ready_probe (k INTEGER PRIMARY KEY, at REAL NOT NULL) STRICT;
    CREATE TABLE devices (id TEXT PRIMARY KEY, budget_bytes INTEGER,
        revision INTEGER NOT NULL, updated_at REAL NOT NULL,
        dry_run INTEGER NOT NULL DEFAULT 0) STRICT;
    CREATE TABLE policies (id TEXT PRIMARY KEY, device_id TEXT,
        min_bytes INTEGER NOT NULL DEFAULT 0, max_bytes INTEGER,
        weight REAL NOT NULL DEFAULT 1.0, pinned INTEGER NOT NULL DEFAULT 0,
        pin_bytes INTEGER, source TEXT, reason TEXT, changed_at REAL,
        pin_revision INTEGER) STRICT;
    INSERT INTO instances VALUES ('pinned', 1073741824, 7, 1.0, 'vllm', '0.33', NULL,
        NULL, 1.0, NULL);
    INSERT INTO instances VALUES ('free', 2147483648, 3, 1.0, 'sglang', '0.5', NULL,
        NULL, 1.0, 2.0);
    INSERT INTO devices VALUES ('gpu-9', 8589934592, 2, 1.0, 1);
    INSERT INTO policies VALUES ('pinned', 'gpu-9', 0, NULL, 1.0, 1, 1073741824,
        'operator', 'operator', 1.0, 7);
    INSERT INTO policies VALUES ('free', 'gpu-9', 536870912, 4294967296, 2.5, 0, NULL,
        'policy', 'fair_share', 1.0, NULL);
    PRAGMA user_version=4;"""


def test_a_version_4_database_gains_the_floor_and_keeps_every_row(tmp_path: Path) -> None:
    """Version 4 (no stored floor) is migrated on open: every row is kept as it was, each
    instance's floor reads 0 (unknown) until its engine reports one."""
    path = tmp_path / "v4.db"
    conn = sqlite3.connect(path)
    conn.executescript(_V4_DATABASE)
    before = {
        table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
        for table in ("instances", "devices", "policies")
    }
    conn.close()
    with _serve(path) as server, httpx.Client(base_url=server.url) as c:
        pinned = c.get("/instances/pinned").json()
        assert (pinned["desired"]["limit_bytes"], pinned["desired"]["revision"]) == (GiB, 7)
        assert pinned["policy"]["pinned"] is True and pinned["policy"]["pin_bytes"] == GiB
        free = c.get("/instances/free").json()
        assert free["status"] == "stopped" and free["policy"]["weight"] == 2.5
        device = c.get("/devices/gpu-9").json()
        assert (device["budget_bytes"], device["revision"], device["dry_run"]) == (8 * GiB, 2, True)
        assert c.get("/readyz").status_code == 200
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    after = {
        table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
        for table in ("instances", "devices", "policies")
    }
    conn.close()
    assert after["instances"] == before["instances"]
    assert after["devices"] == before["devices"]
    assert after["policies"] == [(*row, 0) for row in before["policies"]]


@pytest.mark.parametrize(
    ("database", "added", "instance", "pin_bytes"),
    [
        (_V4_DATABASE, "policies ADD COLUMN floor_bytes INTEGER NOT NULL DEFAULT 0", "pinned", GiB),
        (_V1_DATABASE, "instances ADD COLUMN stopped_at REAL", "old", None),
    ],
    ids=["v4", "v1"],
)
def test_a_migration_cut_short_is_finished_on_the_next_start(
    tmp_path: Path, database: str, added: str, instance: str, pin_bytes: int | None
) -> None:
    """An older sidecar added a column, then set the version in another transaction: one
    killed in between (power loss) left a file that already has the column under the old
    version. Adding it again failed ("duplicate column"), and the file was refused for good."""
    path = tmp_path / "cut.db"
    conn = sqlite3.connect(path)
    conn.executescript(database)
    conn.execute(f"ALTER TABLE {added}")
    conn.commit()
    conn.close()
    with _serve(path) as server, httpx.Client(base_url=server.url) as c:
        view = c.get(f"/instances/{instance}").json()
        assert view["desired"]["limit_bytes"] == GiB
        assert (view.get("policy") or {}).get("pin_bytes") == pin_bytes
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    conn.close()


def _schema_of(path: Path) -> tuple[int, list[tuple[Any, ...]]]:
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        return version, conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
    finally:
        conn.close()


def test_a_migration_that_fails_part_way_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The migration is one transaction: when its second step is refused (here by SQLite's
    authorizer, as a full disk or a kill would cut it), the first is undone too, and the
    next start migrates the file whole. (Before, the first column stayed under the old
    version number.)"""
    path = tmp_path / "v3.db"
    conn = sqlite3.connect(path)
    conn.executescript(_V3_DATABASE)
    conn.close()
    before = _schema_of(path)
    real_connect = sqlite3.connect
    alters: list[str] = []

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        opened = real_connect(*args, **kwargs)

        def authorize(action: int, arg1: Any, arg2: Any, *_: Any) -> int:
            if action == sqlite3.SQLITE_ALTER_TABLE:
                alters.append(str(arg2))
                if len(alters) == 2:  # pin_revision went in; floor_bytes is refused
                    return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK

        opened.set_authorizer(authorize)
        return opened

    monkeypatch.setattr("sidecar._store.sqlite3.connect", connect)
    store = Store(path)
    try:
        with pytest.raises(SidecarConfigError, match="cannot be read as a kvsidecar database"):
            asyncio.run(store.open())
    finally:
        asyncio.run(store.close())
    assert len(alters) == 2
    assert _schema_of(path) == before
    monkeypatch.undo()
    with _serve(path) as server, httpx.Client(base_url=server.url) as c:
        assert c.get("/instances/old").json()["policy"]["pin_bytes"] == GiB
    version, _ = _schema_of(path)
    assert version == 5
