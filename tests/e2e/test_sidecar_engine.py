"""Sidecar ↔ engine over real HTTP and the real engine control socket (engine_ext.ControlServer)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import wait_until
from support.endless import rss_bytes, send_endless
from test_sidecar_support import SocketEngine, ThreadedSidecar

from sidecar import SidecarSettings

GiB = 1 << 30


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[ThreadedSidecar]:
    settings = SidecarSettings(
        db_path=tmp_path / "s.db",
        push_backoff_initial_s=0.02,
        push_backoff_max_s=0.2,
        max_wait_s=30,
    )
    with ThreadedSidecar(settings) as server:
        yield server


@pytest.fixture
def client(sidecar: ThreadedSidecar) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sidecar.url, timeout=60) as c:
        yield c


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SocketEngine]:
    with SocketEngine(
        tmp_path / "e.sock", mapped_bytes=6 * GiB, device_total_bytes=80 * GiB
    ) as eng:
        yield eng


def _report(client: httpx.Client, iid: str, engine: SocketEngine, **kw: Any) -> httpx.Response:
    state = engine.engine_pass(**kw)
    r = client.post(
        f"/instances/{iid}/report",
        content=state.model_dump_json(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    return r


def test_put_deferred_then_report_applied(client: httpx.Client, engine: SocketEngine) -> None:
    reply = client.post("/instances/llama-a/register", json=engine.register_body()).json()
    assert reply == {"limit": None, "revision": 0}
    assert client.get("/instances/llama-a").json()["status"] == "applied"

    r = client.put("/instances/llama-a/limit", json={"limit": "4G"})
    assert r.status_code == 200 and r.json()["desired"]["revision"] == 1
    assert engine.mailbox.pushed.wait(10), "the sidecar did not push to the control socket"
    assert engine.mailbox.pushes == [(4 * GiB, 1)]
    # The push reply is the engine's word: deferred until an engine pass ran.
    wait_until(lambda: client.get("/instances/llama-a").json()["status"] != "pending")
    view = client.get("/instances/llama-a").json()
    assert (view["status"], view["reason"]) == ("deferred", "engine_pass")

    _report(client, "llama-a", engine)  # still 6 GiB mapped: evicting
    view = client.get("/instances/llama-a").json()
    assert (view["status"], view["reason"], view["overage_bytes"]) == (
        "deferred",
        "evicting",
        2 * GiB,
    )

    _report(client, "llama-a", engine, mapped_bytes=3 * GiB)
    view = client.get("/instances/llama-a").json()
    assert (view["status"], view["mapped_bytes"], view["effective_limit_bytes"]) == (
        "applied",
        3 * GiB,
        4 * GiB,
    )


def test_wait_returns_as_soon_as_applied(client: httpx.Client, engine: SocketEngine) -> None:
    client.post("/instances/llama-a/register", json=engine.register_body())
    answer: dict[str, Any] = {}

    def put() -> None:
        start = time.monotonic()
        r = client.put("/instances/llama-a/limit", params={"wait": 30}, json={"limit": "4G"})
        answer.update(code=r.status_code, body=r.json(), elapsed=time.monotonic() - start)

    waiter = threading.Thread(target=put)
    waiter.start()
    assert engine.mailbox.pushed.wait(10)
    _report(client, "llama-a", engine)  # deferred: the PUT keeps waiting
    assert waiter.is_alive()
    applied_at = time.monotonic()
    _report(client, "llama-a", engine, mapped_bytes=4 * GiB)
    waiter.join(30)
    assert answer["code"] == 200 and answer["body"]["status"] == "applied"
    assert time.monotonic() - applied_at < 5  # woken by the report, not by the 30 s deadline
    # kvctl status --wait uses GET ?wait: already applied, so it answers at once.
    r = client.get("/instances/llama-a", params={"wait": 30})
    assert r.json()["status"] == "applied"


def test_wait_deadline_while_deferred_is_202(client: httpx.Client, engine: SocketEngine) -> None:
    client.post("/instances/llama-a/register", json=engine.register_body())
    r = client.put("/instances/llama-a/limit", params={"wait": 0.3}, json={"limit": "1G"})
    assert r.status_code == 202
    assert r.json()["status"] in ("pending", "deferred")


def test_registration_returns_the_retained_limit(
    client: httpx.Client, engine: SocketEngine
) -> None:
    client.put("/instances/llama-a/limit", json={"limit": "2G"})
    client.put("/instances/llama-a/limit", json={"limit": "3G"})
    reply = client.post("/instances/llama-a/register", json=engine.register_body()).json()
    assert reply == {"limit": 3 * GiB, "revision": 2}


def test_a_retained_limit_is_pushed_when_the_registration_reply_is_lost(
    client: httpx.Client, engine: SocketEngine
) -> None:
    """An engine that gave up waiting for a slow registration reply still gets the retained
    limit: the registration wakes the push worker, which delivers it over the socket."""
    client.put("/instances/llama-a/limit", json={"limit": "2G"})
    client.post("/instances/llama-a/register", json=engine.register_body())  # reply dropped
    assert engine.mailbox.pushed.wait(10), "the retained limit was never pushed"
    assert engine.mailbox.pushes[-1] == (2 * GiB, 1)
    _report(client, "llama-a", engine, mapped_bytes=GiB)
    view = client.get("/instances/llama-a").json()
    assert view["status"] == "applied" and view["observed"]["revision"] == 1


def test_a_put_while_a_push_is_on_the_wire_is_no_push_failure(
    client: httpx.Client, engine: SocketEngine
) -> None:
    """The engine answers the push of revision 1 after revision 2 was stored: that answer is
    not a failed push (no warning, no failure counted, no back-off); revision 2 follows."""
    client.post("/instances/llama-a/register", json=engine.register_body())
    release = engine.mailbox.hold = threading.Event()
    client.put("/instances/llama-a/limit", json={"limit": "4G"})
    assert engine.mailbox.holding.wait(10), "the sidecar did not push revision 1"
    client.put("/instances/llama-a/limit", json={"limit": "3G"})  # revision 2, push in flight
    engine.mailbox.hold = None
    release.set()
    wait_until(lambda: engine.mailbox.pushes[-1:] == [(3 * GiB, 2)])
    assert engine.mailbox.pushes == [(4 * GiB, 1), (3 * GiB, 2)]
    metrics = client.get("/metrics").text
    failures = [ln for ln in metrics.splitlines() if ln.startswith("kvsidecar_push_failures")]
    assert not any('instance="llama-a"' in ln and not ln.endswith(" 0.0") for ln in failures), (
        failures
    )


def test_a_newer_engine_revision_is_adopted(client: httpx.Client, engine: SocketEngine) -> None:
    engine.mailbox.publish(5 * GiB, 7)  # set on the socket directly (kvctl --socket)
    engine.engine_pass()
    client.put("/instances/llama-a/limit", json={"limit": "2G"})  # revision 1 here
    reply = client.post("/instances/llama-a/register", json=engine.register_body()).json()
    assert reply == {"limit": 5 * GiB, "revision": 7}
    r = client.put("/instances/llama-a/limit", json={"limit": "4G"})
    assert r.json()["desired"]["revision"] == 8  # the sidecar stays ahead
    wait_until(lambda: (4 * GiB, 8) in engine.mailbox.pushes)


def test_pushes_retry_and_never_reorder(
    client: httpx.Client, sidecar: ThreadedSidecar, tmp_path: Path
) -> None:
    engine = SocketEngine(tmp_path / "late.sock", mapped_bytes=GiB, device_total_bytes=8 * GiB)
    client.post("/instances/late/register", json=engine.register_body())  # socket not served yet
    for size in ("3G", "2G", "1G"):
        client.put("/instances/late/limit", json={"limit": size})
    wait_until(lambda: "kvsidecar_push_failures_total{" in client.get("/metrics").text)
    with engine:  # the engine comes up: the retry delivers the newest revision only
        assert engine.mailbox.pushed.wait(10)
        wait_until(lambda: client.get("/instances/late").json()["status"] == "deferred")
    revisions = [rev for _, rev in engine.mailbox.pushes]
    assert revisions == sorted(revisions) and revisions[-1] == 3
    assert engine.mailbox.pushes[-1] == (GiB, 3)


def test_missing_heartbeats_make_it_unreachable(tmp_path: Path, engine: SocketEngine) -> None:
    settings = SidecarSettings(db_path=tmp_path / "hb.db", heartbeat_timeout_s=0.3)
    with ThreadedSidecar(settings) as server, httpx.Client(base_url=server.url) as c:
        c.post("/instances/llama-a/register", json=engine.register_body())
        assert c.get("/instances/llama-a").json()["status"] == "applied"
        time.sleep(0.4)  # the point is time passing without a report
        view = c.get("/instances/llama-a").json()
        assert (view["status"], view["reason"]) == ("unreachable", "no_heartbeat")
        assert 'status="unreachable"} 1.0' in c.get("/metrics").text
        _report(c, "llama-a", engine)  # a report is a heartbeat
        assert c.get("/instances/llama-a").json()["status"] == "applied"


def test_a_conflicting_engine_revision_is_overtaken(
    client: httpx.Client, engine: SocketEngine
) -> None:
    client.post("/instances/llama-a/register", json=engine.register_body())  # revision 0
    engine.mailbox.publish(5 * GiB, 1)  # someone used the socket; the sidecar has not heard
    client.put("/instances/llama-a/limit", json={"limit": "2G"})  # revision 1 here too
    wait_until(lambda: engine.mailbox.desired.revision == 2)
    assert (engine.mailbox.desired.limit_bytes, engine.mailbox.pushes[-2:]) == (
        2 * GiB,
        [(2 * GiB, 1), (2 * GiB, 2)],
    )  # rejected as a conflict, then re-issued
    assert client.get("/instances/llama-a").json()["desired"]["revision"] == 2


def test_same_revision_other_limit_at_registration_is_overtaken(
    client: httpx.Client, engine: SocketEngine
) -> None:
    """The sidecar was down at engine start: the engine took KVSIDECAR_LIMIT as revision 1,
    an operator's PUT was stored as revision 1 too. The sidecar's intent wins."""
    engine.mailbox.publish(5 * GiB, 1)
    engine.engine_pass()
    client.put("/instances/llama-a/limit", json={"limit": "2G"})  # revision 1 here too
    reply = client.post("/instances/llama-a/register", json=engine.register_body()).json()
    assert reply == {"limit": 2 * GiB, "revision": 2}  # re-issued as the next revision
    wait_until(lambda: engine.mailbox.desired.revision == 2)
    assert engine.mailbox.desired.limit_bytes == 2 * GiB
    assert client.get("/instances/llama-a").json()["status"] != "applied"  # 6 GiB mapped
    _report(client, "llama-a", engine, mapped_bytes=GiB)
    view = client.get("/instances/llama-a").json()
    assert (view["status"], view["desired"]["revision"], view["observed"]["limit_bytes"]) == (
        "applied",
        2,
        2 * GiB,
    )


def test_same_revision_other_limit_in_a_report_is_overtaken(
    client: httpx.Client, engine: SocketEngine
) -> None:
    """No socket to push to: the report's reply carries the re-issued limit (pull)."""
    body = {**engine.register_body(), "socket_path": None}
    client.post("/instances/llama-a/register", json=body)  # revision 0
    client.put("/instances/llama-a/limit", json={"limit": "2G"})  # revision 1, not pushed
    engine.mailbox.publish(5 * GiB, 1)  # the engine took revision 1 elsewhere
    reply = _report(client, "llama-a", engine, mapped_bytes=GiB).json()
    assert reply == {"limit": 2 * GiB, "revision": 2}
    view = client.get("/instances/llama-a").json()
    assert (view["status"], view["reason"]) == ("pending", "push_in_flight")
    engine.mailbox.publish(reply["limit"], reply["revision"])  # what SidecarClient does
    _report(client, "llama-a", engine)
    view = client.get("/instances/llama-a").json()
    assert (view["status"], view["desired"]["revision"], view["observed"]["limit_bytes"]) == (
        "applied",
        2,
        2 * GiB,
    )


def test_forgetting_an_instance_closes_the_connection_to_its_engine(
    sidecar: ThreadedSidecar, client: httpx.Client, engine: SocketEngine
) -> None:
    """Engines come and go (a new pod, a new socket path): the sidecar keeps no transport,
    and no connection, to a forgotten engine's socket (each held an fd and, before, its own
    SSL context of ~0.8 MiB)."""
    router = sidecar.server.config.app.state.service._router
    client.post("/instances/llama-a/register", json=engine.register_body())
    client.put("/instances/llama-a/limit", json={"limit": "2G"})
    wait_until(lambda: (2 * GiB, 1) in engine.mailbox.pushes)
    path = str(engine.socket_path)
    assert path in router._transports  # the push went over a kept transport
    assert client.delete("/instances/llama-a").status_code == 204
    assert path not in router._transports


# --- an engine that never takes the limit cannot make the sidecar spin ----------------------


class _HostileEngine:
    """A raw control socket (keep-alive HTTP/1.1 over AF_UNIX) that answers every push
    without taking its limit, per ``mode``; counts the pushes it gets.

    * ``conflict``: 409, it holds the pushed revision with another limit (a tie, every time);
    * ``tie``: 200 applied, the pushed revision with another limit;
    * ``older``: 200 applied, one revision below the pushed one;
    * ``flood``: an answer without end, 1 MiB chunks as fast as they are read;
    * ``drip``: an answer without end, a byte every 0.2 s.
    """

    def __init__(self, path: Path, mode: str) -> None:
        import socket

        self.path, self.mode = path, mode
        self.pushes: list[int] = []  # the revisions pushed, in order
        self.sent = 0  # bytes of endless answers sent
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _count(self, n: int) -> None:
        self.sent += n

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        import json

        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    rest += conn.recv(65536)
                body, buf = json.loads(rest[:length] or b"{}"), rest[length:]
                revision = int(body.get("revision", 0))
                self.pushes.append(revision)
                if self.mode in ("flood", "drip"):
                    send_endless(conn, self.mode, self._count)
                    return
                code, state = 200, {"status": "applied", "limit_bytes": 7}
                if self.mode == "conflict":
                    code, state = (
                        409,
                        {"status": "conflict", "revision": revision, "limit_bytes": 7},
                    )
                elif self.mode == "tie":
                    state["revision"] = revision
                else:  # older
                    state = {
                        "status": "applied",
                        "revision": max(0, revision - 1),
                        "limit_bytes": None,
                    }
                out = json.dumps(state).encode()
                conn.sendall(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                    % (code, len(out))
                    + out
                )


def _hostile_sidecar(tmp_path: Path, hostile: _HostileEngine, **backoff: float) -> ThreadedSidecar:
    return ThreadedSidecar(SidecarSettings(db_path=tmp_path / "s.db", **backoff))


def _register_hostile(c: httpx.Client, hostile: _HostileEngine) -> None:
    body = {
        "engine": "vllm",
        "engine_version": "0.33.0",
        "socket_path": str(hostile.path),
        "state": {"status": "applied"},
    }
    assert c.post("/instances/x/register", json=body).status_code == 200


@pytest.mark.parametrize("mode", ["conflict", "tie", "older"])
def test_an_engine_that_never_takes_the_limit_is_pushed_at_the_backoffs_pace(
    tmp_path: Path, mode: str
) -> None:
    """Such an engine used to be pushed as fast as it answered: a tie re-issued the limit
    as a new revision (a database write and a warning) at every answer, ~700 a second;
    an answer that took nothing woke the push worker out of its own backoff. Now the
    first tie is re-issued and pushed at once, and after that the pushes (and re-issues)
    follow the backoff."""
    hostile = _HostileEngine(tmp_path / "e.sock", mode)
    try:
        with (
            _hostile_sidecar(
                tmp_path, hostile, push_backoff_initial_s=0.02, push_backoff_max_s=0.5
            ) as server,
            httpx.Client(base_url=server.url) as c,
        ):
            _register_hostile(c, hostile)
            assert c.put("/instances/x/limit", json={"limit": "1G"}).status_code == 200
            wait_until(lambda: len(hostile.pushes) >= 3)
            time.sleep(2.0)  # the point is time passing: how many pushes does it bring
            pushes = len(hostile.pushes)
            revision = c.get("/instances/x").json()["desired"]["revision"]
            # backoff 0.02 s doubling to 0.5 s: about 9 pushes in 2 s (thousands before)
            assert pushes <= 40, f"{pushes} pushes in ~2 s"
            assert revision <= 1 + pushes  # at most one re-issue per push
            if mode != "older":
                assert revision >= 3  # ties are still settled in the sidecar's favour
    finally:
        hostile.close()


@pytest.mark.parametrize("mode", ["conflict", "tie", "older"])
def test_a_new_desired_ends_the_backoff_the_answers_do_not(tmp_path: Path, mode: str) -> None:
    """With a 5 s first backoff: after the push (and the one re-issue a tie gets at once)
    nothing more is pushed while the engine answers; a PUT is pushed at once."""
    hostile = _HostileEngine(tmp_path / "e.sock", mode)
    try:
        with (
            _hostile_sidecar(
                tmp_path, hostile, push_backoff_initial_s=5.0, push_backoff_max_s=60.0
            ) as server,
            httpx.Client(base_url=server.url) as c,
        ):
            _register_hostile(c, hostile)
            assert c.put("/instances/x/limit", json={"limit": "1G"}).status_code == 200
            first = 1 if mode == "older" else 2  # a tie: the push and its re-issue
            wait_until(lambda: len(hostile.pushes) >= first)
            time.sleep(0.5)
            assert len(hostile.pushes) == first, hostile.pushes  # backing off (5 s)
            assert c.put("/instances/x/limit", json={"limit": "2G"}).status_code == 200
            wait_until(lambda: len(hostile.pushes) > first, timeout_s=3.0, what="PUT pushed")
    finally:
        hostile.close()


@pytest.mark.parametrize("mode", ["flood", "drip"])
def test_a_push_answer_without_end_is_cut_and_the_push_retried(tmp_path: Path, mode: str) -> None:
    """The sidecar reads at most MAX_REPLY_BYTES of a push answer and gives it at most
    KVSIDECAR_PUSH_TIMEOUT_S in all. Before, a socket streaming without end filled the
    sidecar's memory (2 GB in 8 s), and one sending a byte now and then held the
    instance's push worker for ever (httpx's timeout is per read)."""
    from engine_ext.protocol import MAX_REPLY_BYTES

    hostile = _HostileEngine(tmp_path / "e.sock", mode)
    rss_before = rss_bytes()
    try:
        with (
            _hostile_sidecar(
                tmp_path,
                hostile,
                push_timeout_s=1.0,
                push_backoff_initial_s=0.02,
                push_backoff_max_s=0.1,
            ) as server,
            httpx.Client(base_url=server.url) as c,
        ):
            _register_hostile(c, hostile)
            assert c.put("/instances/x/limit", json={"limit": "1G"}).status_code == 200
            wait_until(lambda: len(hostile.pushes) >= 3, timeout_s=60, what="pushes retried")
            reason = "reply_too_large" if mode == "flood" else "timeout"
            assert f'reason="{reason}"' in c.get("/metrics").text
            if mode == "flood":
                assert hostile.sent > 2 * MAX_REPLY_BYTES  # more was offered than was read
                assert rss_bytes() - rss_before < 64 << 20, "the answers were read into memory"
            assert c.get("/instances/x").json()["status"] == "pending"
    finally:
        hostile.close()


@pytest.mark.parametrize("mode", ["flood", "drip"])
def test_the_takeover_probe_reads_a_bounded_answer(tmp_path: Path, mode: str) -> None:
    """A second process registering an id whose live holder's socket path it names makes
    the sidecar ask that socket's /healthz who serves it. That answer was read whole with
    httpx's per-read timeout: a socket streaming without end filled the sidecar's memory
    during the registration, one dripping held it for ever. Now the probe's answer is
    bounded like a push's: the takeover is not proven, the second process gets its 409."""
    from engine_ext.protocol import MAX_REPLY_BYTES

    hostile = _HostileEngine(tmp_path / "e.sock", mode)
    rss_before = rss_bytes()
    try:
        with (
            _hostile_sidecar(tmp_path, hostile, push_timeout_s=1.0) as server,
            httpx.Client(base_url=server.url, timeout=60) as c,
        ):
            body = {
                "engine": "vllm",
                "engine_version": "0.33.0",
                "socket_path": str(hostile.path),
                "state": {"status": "applied"},
            }
            first = {**body, "registration_token": "A" * 32}
            assert c.post("/instances/x/register", json=first).status_code == 200
            second = {**body, "registration_token": "B" * 32}
            r = c.post("/instances/x/register", json=second)
            assert r.status_code == 409, r.text  # the live holder keeps the id
            assert "held by another live engine process" in r.json()["detail"]
            assert hostile.pushes, "the probe never reached the socket"
            if mode == "flood":
                assert hostile.sent >= MAX_REPLY_BYTES  # as much was offered as is read
                assert rss_bytes() - rss_before < 64 << 20, "the answer was read into memory"
    finally:
        hostile.close()
