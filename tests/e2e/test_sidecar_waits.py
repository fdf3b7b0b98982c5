"""Waiting clients cannot lock engines and writes out (``KVSIDECAR_MAX_WAITS``), over real
HTTP: long-polls and event streams beyond the cap get 503 before they change anything,
the connections they leave serve reports and writes, and every slot comes back however
its wait ends (answered, timed out, abandoned, cut)."""

from __future__ import annotations

import json
import logging
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.soak import soak_seeds
from test_sidecar_support import ThreadedSidecar, db_rows

from engine_ext.protocol import REGISTRATION_HEADER
from sidecar import SidecarSettings

TOKEN = "T" * 32


def _serve(db: Path, **kw: Any) -> ThreadedSidecar:
    return ThreadedSidecar(
        SidecarSettings(db_path=db, push_backoff_initial_s=0.05, push_backoff_max_s=0.2, **kw)
    )


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _server_sockets(url: str) -> dict[str, int]:
    """The server side's TCP sockets on the port, by state, read from /proc/net/tcp (what
    the kernel holds, not what the server counts). CLOSE_WAIT: the client closed, the
    server never did (a leaked connection)."""
    port = int(url.rsplit(":", 1)[1])
    names = {"01": "ESTABLISHED", "08": "CLOSE_WAIT", "06": "TIME_WAIT", "04": "FIN_WAIT1"}
    states: dict[str, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        if local_port == port:
            state = names.get(fields[3], fields[3])
            states[state] = states.get(state, 0) + 1
    return states


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``check`` until true (no assertion on time: the deadline only ends a hang)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def _register(c: httpx.Client, iid: str, status: str = "applied", **state: Any) -> None:
    body = {
        "engine": "vllm",
        "engine_version": "0.33.0",
        "socket_path": "/nonexistent/kvsidecar-test.sock",
        "registration_token": TOKEN,
        "state": {"status": status, **state},
    }
    r = c.post(f"/instances/{iid}/register", json=body)
    assert r.status_code == 200, r.text


def _report(c: httpx.Client, iid: str, **state: Any) -> httpx.Response:
    return c.post(
        f"/instances/{iid}/report",
        json={"status": "applied", **state},
        headers={REGISTRATION_HEADER: TOKEN},
    )


def _refused(r: httpx.Response, limit: int) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["retry-after"] == "1"
    body = r.json()
    assert body["max_waits"] == limit and "KVSIDECAR_MAX_WAITS" in body["detail"]


def test_waits_beyond_the_cap_are_refused_and_reports_and_writes_still_get_through(
    tmp_path: Path,
) -> None:
    db = tmp_path / "sidecar.db"
    with (
        _serve(db, max_connections=8, max_wait_s=30) as server,  # max_waits: 4 (half)
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        assert c.put("/instances/a/limit", json={"limit": "1G"}).status_code == 200  # pending
        _register(c, "b", limit_bytes=None, revision=0)
        waiting = [_raw(server.url) for _ in range(4)]
        for sock in waiting:  # long-polls on an instance no engine will apply
            sock.sendall(b"GET /instances/a?wait=30 HTTP/1.1\r\nHost: x\r\n\r\n")
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 4, "4 waiting")
        before = c.get("/instances/a").json()
        rows = db_rows(db)

        _refused(c.get("/instances/a", params={"wait": 5}), 4)
        _refused(c.put("/instances/a/limit", params={"wait": 5}, json={"limit": "2G"}), 4)
        _refused(c.delete("/instances/a/limit", params={"wait": 5}), 4)
        _refused(c.get("/instances", params={"watch": 1}), 4)
        # nothing changed: the refused PUT/DELETE stored nothing, no revision was taken
        assert c.get("/instances/a").json()["desired"] == before["desired"]
        assert db_rows(db) == rows
        assert _metric(server.url, "kvsidecar_waits_refused_total") == 4

        # what does not wait is served: engine reports, registrations, writes, reads,
        # with more clients at once than the waits leave idle
        results: list[int] = []

        def engine(n: int) -> None:
            with httpx.Client(base_url=server.url, timeout=30) as own:
                for _ in range(5):
                    results.append(_report(own, "b", limit_bytes=None, revision=0).status_code)
                    results.append(
                        own.put(f"/instances/w{n}/limit", json={"limit": "1M"}).status_code
                    )

        threads = [threading.Thread(target=engine, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 30
        assert (
            c.put("/instances/a/limit", params={"wait": 0}, json={"limit": "3G"}).status_code == 202
        )

        # a slot comes back when its client goes
        for sock in waiting[:2]:
            sock.close()
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 2, "2 left")
        with c.stream("GET", "/instances", params={"watch": 1}) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()  # one iterator: dropping it would close the stream
            assert next(lines) == "retry: 1000"
            assert _metric(server.url, "kvsidecar_waiting_clients") == 3
            r = c.get("/instances/a", params={"wait": 0.2})  # the fourth
            assert r.status_code == 200 and r.json()["status"] == "pending"
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 2, "stream gone")
        for sock in waiting[2:]:
            sock.close()
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 0, "all gone")
        assert _metric(server.url, "kvsidecar_max_waits") == 4


@pytest.mark.parametrize("reset", [False, True])
def test_a_long_poll_whose_client_goes_ends_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, reset: bool
) -> None:
    """A long-poll abandoned by its client ends without an error: it used to read the
    cancelled waiter's result before the cancel landed (InvalidStateError, a 500 and two
    tracebacks in the log for every ``kvctl --wait`` interrupted with Ctrl-C)."""
    with (
        _serve(tmp_path / "sidecar.db", max_connections=8) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        assert c.put("/instances/a/limit", json={"limit": "1G"}).status_code == 200
        for path in ("/instances/a?wait=30", "/instances/a/limit?wait=30"):
            sock = _raw(server.url)
            if path.endswith("limit?wait=30"):
                body = b'{"limit": "2G"}'
                sock.sendall(
                    b"PUT " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 15\r\n\r\n" + body
                )
            else:
                sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 1, "waiting")
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            sock.close()
            _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 0, "ended")
        assert c.get("/instances/a").json()["desired"]["limit_bytes"] == 2 << 30  # PUT stored
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# --- every way a wait ends gives its slot back ----------------------------------------------


def _raw_wait(url: str, request: bytes, rng: random.Random) -> str:
    """Send ``request`` on a raw socket, then either read the answer or hang up at a random
    moment. Returns the status line's code, or "gone" when the client left first."""
    with _raw(url) as sock:
        sock.sendall(request)
        if rng.random() < 0.4:
            time.sleep(rng.uniform(0, 0.3))
            if rng.random() < 0.5:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            return "gone"  # closed (or reset) mid-wait
        sock.settimeout(30)
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
        return head[9:12].decode() or "closed"


@pytest.mark.parametrize("seed", soak_seeds() or range(2))
def test_every_way_a_wait_ends_gives_its_slot_back(
    tmp_path: Path, seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Threads start long-polls (GET, PUT, DELETE with ?wait=), event streams and plain
    requests at random; waits time out, get answered (an engine reports), or are abandoned
    (closed or reset mid-wait); streams end at KVSIDECAR_MAX_WAIT_S. A sampler reads
    /metrics all along. The waiting count never exceeds the cap, every answer is one the
    API documents, every 503 is a counted refusal, and once all have ended no slot is held:
    the cap's worth of new waits is accepted again."""
    rng = random.Random(seed)
    limit = 3
    db = tmp_path / "sidecar.db"
    with (
        _serve(db, max_connections=8, max_waits=limit, max_wait_s=1.0) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        _register(c, "e", status="applied", limit_bytes=None, revision=0)
        seen: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                seen.append(_metric(server.url, "kvsidecar_waiting_clients"))
                time.sleep(0.01)

        codes: list[str] = []
        lock = threading.Lock()

        def client(n: int) -> None:
            own = random.Random(seed * 100 + n)
            for _ in range(12):
                wait = own.choice(["0.3", "2", "0.05"])
                kind = own.randrange(5)
                if kind == 0:
                    req = f"GET /instances/e?wait={wait} HTTP/1.1\r\nHost: x\r\n\r\n"
                elif kind == 1:
                    body = json.dumps({"limit": f"{own.randrange(1, 64)}M"})
                    req = (
                        f"PUT /instances/e/limit?wait={wait} HTTP/1.1\r\nHost: x\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                        f"\r\n{body}"
                    )
                elif kind == 2:
                    req = f"DELETE /instances/e/limit?wait={wait} HTTP/1.1\r\nHost: x\r\n\r\n"
                elif kind == 3:
                    req = "GET /instances?watch=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                else:
                    req = "GET /instances/e HTTP/1.1\r\nHost: x\r\n\r\n"
                code = _raw_wait(server.url, req.encode(), own)
                with lock:
                    codes.append(code)

        def engine() -> None:  # answers some waits: the engine applies what is desired
            with httpx.Client(base_url=server.url, timeout=30) as own:
                while not stop.is_set():
                    view = own.get("/instances/e").json()
                    desired = view["desired"]
                    _report(
                        own, "e", limit_bytes=desired["limit_bytes"], revision=desired["revision"]
                    )
                    time.sleep(rng.uniform(0.05, 0.4))

        sampler = threading.Thread(target=sample)
        applier = threading.Thread(target=engine)
        clients = [threading.Thread(target=client, args=(n,)) for n in range(6)]
        for t in (sampler, applier, *clients):
            t.start()
        for t in clients:
            t.join()
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 0, "slots back")
        stop.set()
        sampler.join()
        applier.join()

        _until(lambda: "CLOSE_WAIT" not in _server_sockets(server.url), "no leaked sockets")
        assert max(seen) <= limit, f"{max(seen)} waiting clients against a cap of {limit}"
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]  # no 500s, even to clients gone
        assert set(codes) <= {"200", "202", "503", "gone"}, codes
        answered_503 = codes.count("503")
        refused = _metric(server.url, "kvsidecar_waits_refused_total")
        assert refused >= answered_503  # abandoned ones may have been refused too
        # no slot leaked: the cap's worth of waits is taken again, one more is refused
        held = [_raw(server.url) for _ in range(limit)]
        for sock in held:
            sock.sendall(b"GET /instances?watch=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == limit, "cap taken again")
        _refused(c.get("/instances/e", params={"wait": 1}), limit)
        for sock in held:
            sock.close()
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == 0, "given back")


def test_event_streams_share_one_list_per_poll(tmp_path: Path) -> None:
    """Each event stream used to build and compare the whole instance list itself every
    0.25 s: N dashboards cost N lists per poll (ten on a thousand instances took more
    than the event loop's whole time). Now the streams share one list per poll: with
    eight streams open, the lists built stay near one per poll plus one per stream (its
    first event), and every stream still gets every change."""
    from sidecar._routes.watch import _POLL_S, SharedListing

    streams = 8
    with (
        _serve(tmp_path / "sidecar.db", max_wait_s=30) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        for n in range(20):
            assert c.put(f"/instances/i{n}/limit", json={"limit": "1G"}).status_code == 200
        socks = [_raw(server.url) for _ in range(streams)]
        for sock in socks:
            sock.sendall(b"GET /instances?watch=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        _until(lambda: _metric(server.url, "kvsidecar_waiting_clients") == streams, "open")
        listing: SharedListing = server.app.state.watch_listing
        builds, start = listing.builds, time.monotonic()
        time.sleep(2.0)  # the point is time passing: how many lists does it bring
        assert c.put("/instances/i0/limit", json={"limit": "2G"}).status_code == 200
        time.sleep(0.5)
        elapsed = time.monotonic() - start
        built = listing.builds - builds
        # one per poll (plus a spare for a late tick); eight streams built ~8 per poll before
        assert built <= elapsed / _POLL_S + 2, f"{built} lists in {elapsed:.2f} s"
        for sock in socks:  # every stream got the first list and the change
            sock.settimeout(10)
            data = b""
            while data.count(b"event: instances") < 2 or b"\n" not in data.rsplit(b"data: ", 1)[1]:
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
            assert data.count(b"event: instances") == 2, data
            last = data.rsplit(b"data: ", 1)[1].split(b"\n", 1)[0]
            views = json.loads(last.decode())["instances"]
            assert views[0]["id"] == "i0" and views[0]["desired"]["limit_bytes"] == 2 << 30
            sock.close()
