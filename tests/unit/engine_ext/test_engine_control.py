"""The control socket over a real unix socket, with a real pool behind the mailbox."""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_pool import BUNDLE, Pool
from support.rawhttp import framed_replies, mutated_request
from support.soak import soak_seeds

from engine_ext import (
    ControlServer,
    CoordinatorConfig,
    EngineExtConfigError,
    LimitMailbox,
    ShrinkCoordinator,
)
from engine_ext._control import MAX_CONNECTIONS
from engine_ext.protocol import Status


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.unix_path)


def call(
    path: str,
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], str]:
    conn = UnixHTTPConnection(path)
    try:
        conn.request(method, url, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data), resp.getheader("Content-Type", "")
    finally:
        conn.close()


@pytest.fixture
def served(pool: Pool, tmp_path: Path) -> Iterator[tuple[str, LimitMailbox, ShrinkCoordinator]]:
    pool.fill(6)
    mailbox = LimitMailbox()
    coord = ShrinkCoordinator(mailbox, pool.blocks, CoordinatorConfig())
    coord.add_reclaimer(pool.cache)
    coord.step()  # the test thread is the engine thread
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    server = ControlServer(str(rundir / "control.sock"), mailbox)
    server.start()
    try:
        yield server.socket_path, mailbox, coord
    finally:
        server.stop()
    assert not os.path.exists(server.socket_path)


def test_socket_is_private(served: tuple[str, LimitMailbox, ShrinkCoordinator]) -> None:
    path, _, _ = served
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert call(path, "GET", "/healthz")[:2] == (200, {"status": "ok"})


def test_put_limit_defers_then_engine_applies(
    served: tuple[str, LimitMailbox, ShrinkCoordinator], pool: Pool
) -> None:
    path, _mailbox, coord = served
    code, body, _ = call(path, "PUT", "/limit", json.dumps({"limit": "256KiB"}).encode())
    # The handler thread only published: the guard would have raised (500) on any
    # allocator call, and nothing was evicted or unmapped.
    assert code == 200 and body["status"] == "deferred" and body["revision"] == 1
    assert body["reason"] == "engine_pass" and body["overage_bytes"] == 4 * BUNDLE
    assert pool.cache.num_evicted == 0 and pool.backend.mapped_bytes() == 6 * BUNDLE
    state = coord.step()
    assert state.status is Status.APPLIED and pool.backend.mapped_bytes() == 2 * BUNDLE
    code, body, _ = call(path, "GET", "/state")
    assert code == 200 and body["status"] == "applied" and body["mapped_bytes"] == 2 * BUNDLE
    code, body, _ = call(path, "PUT", "/limit", b'{"limit": 262144, "revision": 1}')
    assert code == 200 and body["status"] == "applied"  # idempotent retry


def test_stale_and_conflict_are_409(served: tuple[str, LimitMailbox, ShrinkCoordinator]) -> None:
    path, mailbox, _ = served
    assert call(path, "PUT", "/limit", b'{"limit": "1G", "revision": 10}')[0] == 200
    code, body, _ = call(path, "PUT", "/limit", b'{"limit": "1G", "revision": 9}')
    assert code == 409 and body["status"] == "stale" and "10" in body["message"]
    code, body, _ = call(path, "PUT", "/limit", b'{"limit": "2G", "revision": 10}')
    assert code == 409 and body["status"] == "conflict"
    assert mailbox.desired.limit_bytes == 1 << 30 and mailbox.desired.revision == 10


@pytest.mark.parametrize(
    ("method", "url", "body", "code", "needle"),
    [
        ("PUT", "/limit", b'{"limit": "12 parsecs"}', 422, "limit"),
        ("PUT", "/limit", b'{"limit": -5}', 422, "limit"),
        ("PUT", "/limit", b'{"limit": 5, "revision": 0}', 422, "revision"),
        ("PUT", "/limit", b'{"limit": 5, "colour": 1}', 422, "colour"),
        ("PUT", "/limit", b'{"revision": 3}', 422, "limit"),
        ("PUT", "/limit", b"not json", 422, "body"),
        ("PUT", "/limit", b'{"limit": 5, "limit": 0}', 422, "'limit' appears twice"),
        ("PUT", "/limit", b'{"limit": "0.5"}', 422, "whole"),
        ("PUT", "/nope", b"{}", 404, "/nope"),
        ("GET", "/metrics", None, 404, "/metrics"),
        ("GET", "/limit", None, 405, "PUT /limit"),
        ("POST", "/limit", b"{}", 405, "PUT /limit"),
    ],
)
def test_bad_requests_are_4xx_and_change_nothing(
    served: tuple[str, LimitMailbox, ShrinkCoordinator],
    method: str,
    url: str,
    body: bytes | None,
    code: int,
    needle: str,
) -> None:
    path, mailbox, _ = served
    before = (mailbox.desired, mailbox.latest_state)
    got, problem, ctype = call(path, method, url, body)
    assert got == code and ctype == "application/problem+json"
    assert problem["status"] == code and needle in problem["detail"]
    assert (mailbox.desired, mailbox.latest_state) == before and not mailbox.has_untaken


def raw(path: str, request: bytes) -> bytes:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    with sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(4096):  # the server closes after these replies
            reply += chunk
        return reply


def test_oversized_body_is_413_unread(served: tuple[str, LimitMailbox, ShrinkCoordinator]) -> None:
    path, mailbox, _ = served
    # Only the headers are sent: the server must answer without waiting for 64 KiB.
    reply = raw(path, b"PUT /limit HTTP/1.1\r\nHost: x\r\nContent-Length: 65537\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and b"Connection: close" in reply
    assert b"65536" in reply and mailbox.revision == 0
    assert call(path, "PUT", "/limit", b" " * 65000 + b'{"limit": 1}')[0] == 200  # 64 KiB is fine


def test_missing_content_length_is_411(served: tuple[str, LimitMailbox, ShrinkCoordinator]) -> None:
    path, mailbox, _ = served
    reply = raw(path, b"PUT /limit HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 411") and mailbox.revision == 0


def test_second_server_on_live_socket_is_refused(
    served: tuple[str, LimitMailbox, ShrinkCoordinator],
) -> None:
    path, mailbox, _ = served
    with pytest.raises(EngineExtConfigError, match="INSTANCE_ID"):
        ControlServer(path, mailbox).start()


def test_leftover_socket_from_a_crash_is_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "control.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens
    server = ControlServer(path, LimitMailbox())
    server.start()
    try:
        assert call(path, "GET", "/healthz")[0] == 200
    finally:
        server.stop()


def test_too_long_socket_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_RUNTIME_DIR"):
        ControlServer(str(tmp_path / ("x" * 120)), LimitMailbox())


def test_one_connection_serves_several_requests(
    served: tuple[str, LimitMailbox, ShrinkCoordinator],
) -> None:
    path, mailbox, _ = served
    conn = UnixHTTPConnection(path)
    try:
        for method, url, body, code in (
            ("PUT", "/nope", b'{"limit": 1}', 404),
            ("PUT", "/limit", b'{"limit": "1M"}', 200),
            ("GET", "/state", None, 200),
        ):
            conn.request(method, url, body=body)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == code and not resp.will_close
    finally:
        conn.close()
    assert mailbox.desired.limit_bytes == 1 << 20


def test_handlers_never_call_the_pool(
    served: tuple[str, LimitMailbox, ShrinkCoordinator], pool: Pool
) -> None:
    """Every request kind, with each pool object's methods recording their caller."""
    path, _, _ = served
    callers: list[tuple[str, str]] = []
    for obj in (pool.backend, pool.pages, pool.blocks, pool.cache):
        for name in dir(obj):
            attr = getattr(obj, name)
            if name.startswith("__") or not callable(attr) or isinstance(attr, type):
                continue

            def spy(*a: Any, _f: Any = attr, _n: str = name, **k: Any) -> Any:
                callers.append((threading.current_thread().name, _n))
                return _f(*a, **k)

            setattr(obj, name, spy)
    callers.clear()  # reading properties above already went through some spies
    call(path, "PUT", "/limit", b'{"limit": "128K"}')
    call(path, "PUT", "/limit", b'{"limit": "1G", "revision": 1}')
    call(path, "PUT", "/limit", b'{"limit": "bad"}')
    call(path, "GET", "/state")
    call(path, "GET", "/healthz")
    assert callers == []
    served[2].step()  # the engine pass does call in, on this thread
    assert callers and {t for t, _ in callers} == {threading.current_thread().name}


def _switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status", encoding="ascii") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


def test_an_idle_control_server_never_wakes_up(tmp_path: Path) -> None:
    """No polling: the server thread sleeps in select until a client or stop() arrives."""
    server = ControlServer(str(tmp_path / "c.sock"), LimitMailbox())
    server.start()
    try:
        assert call(server.socket_path, "GET", "/healthz")[0] == 200
        thread = server._thread
        assert thread is not None and thread.native_id is not None
        # the thread finishes the answer (close, back to select) after the client has it:
        # on a loaded machine that can be later than this line; wait until it sleeps
        before = _switches(thread.native_id)
        for _ in range(50):
            time.sleep(0.02)
            now = _switches(thread.native_id)
            if now == before:
                break
            before = now
        time.sleep(0.5)  # a 100 ms poll would wake it ~5 times
        assert _switches(thread.native_id) == before
        assert call(server.socket_path, "GET", "/healthz")[0] == 200  # still serving
    finally:
        server.stop()
    assert not thread.is_alive() and not os.path.exists(server.socket_path)
    server.stop()  # idempotent


def test_a_client_that_leaks_connections_gets_503_not_a_thread_each(
    served: tuple[str, LimitMailbox, ShrinkCoordinator], pool: Pool
) -> None:
    """200 connections opened and left silent: the engine process starts at most
    MAX_CONNECTIONS handler threads; the next client gets a 503 that says what to do, and
    once the leaked connections close the socket serves limits again."""
    path, mailbox, coord = served
    before = _threads_named("control-handler")
    leaked = []
    try:
        for _ in range(200):
            leaked.append(_connect_when_accepted(path))
        status, body, ctype = _call_when_accepted(path, "GET", "/healthz")
        assert status == 503 and ctype == "application/problem+json"
        assert str(MAX_CONNECTIONS) in body["detail"] and "close idle" in body["detail"]
        assert _threads_named("control-handler") - before <= MAX_CONNECTIONS
        # /proc agrees: the process has no thread per leaked connection
        assert len(os.listdir("/proc/self/task")) < threading.active_count() + 8 < 100
    finally:
        for sock in leaked:
            sock.close()
    deadline = time.monotonic() + 10
    while _call_when_accepted(path, "GET", "/healthz")[0] != 200:
        assert time.monotonic() < deadline, "the slots were not given back"
        time.sleep(0.05)
    status, _state, _ = call(
        path,
        "PUT",
        "/limit",
        json.dumps({"limit": 2 * BUNDLE}).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 200 and mailbox.desired.limit_bytes == 2 * BUNDLE
    assert coord.step().status is Status.APPLIED
    assert pool.backend.mapped_bytes() == 2 * BUNDLE  # what the OS maps, not a counter


@pytest.mark.parametrize("where", ["request line", "headers", "body"])
def test_a_request_that_trickles_in_is_cut_at_the_deadline(
    served: tuple[str, LimitMailbox, ShrinkCoordinator],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """A client sending a byte every 0.2 s never hit the per-read timeout, so it held a
    handler thread (one of MAX_CONNECTIONS) for as long as it kept sending. Now the whole
    request must arrive within the client timeout (1 s here): the connection is closed
    then, nothing is published, and the socket serves the next client."""
    from engine_ext import _control

    monkeypatch.setattr(_control, "_CLIENT_TIMEOUT_S", 1.0)
    path, mailbox, _coord = served
    body = json.dumps({"limit": 2 * BUNDLE}).encode() + b" " * 200  # trickled spaces fit
    head = b"PUT /limit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    whole = head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    at = {"request line": 4, "headers": len(head) - 4, "body": len(whole) - 150}[where]
    before = mailbox.revision
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(whole[:at])
        start = time.monotonic()
        closed = False
        for byte in whole[at : at + 3]:  # 3 bytes more, 0.2 s apart...
            time.sleep(0.2)
            sock.sendall(bytes([byte]))
        sock.settimeout(0.2)
        while time.monotonic() - start < 20:  # ...then a byte every 0.2 s until it is cut
            try:
                if sock.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                try:
                    sock.sendall(b" ")
                except OSError:
                    closed = True
                    break
            except OSError:
                closed = True
                break
        assert closed, "a trickling request held the handler thread for 20 s"
    assert mailbox.revision == before  # nothing was published
    status, _body, _ = call(path, "GET", "/healthz")
    assert status == 200


def _connect_when_accepted(path: str) -> socket.socket:
    """A connection to ``path``, waiting while the listen backlog is full."""
    deadline = time.monotonic() + 10
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            assert time.monotonic() < deadline, "the server stopped accepting"
            time.sleep(0.01)


def _call_when_accepted(path: str, method: str, url: str) -> tuple[int, dict[str, Any], str]:
    deadline = time.monotonic() + 10
    while True:
        try:
            return call(path, method, url)
        except BlockingIOError:  # the listen backlog is full for a moment
            assert time.monotonic() < deadline, "the server stopped accepting"
            time.sleep(0.01)


def _threads_named(name: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name == name)


def _send_raw(path: str, request: bytes) -> bytes:
    """Send ``request`` and half-close (the server sees the end of what was sent); read
    until the server closes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(path)
    with sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


PUT_7 = b'PUT /limit HTTP/1.1\r\nContent-Length: 12\r\n\r\n{"limit": 7}'


@pytest.mark.parametrize(
    ("request_bytes", "code", "needle"),
    [
        (b"PATCH /limit HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405, "PUT /limit"),
        (b"HEAD /state HTTP/1.1\r\n\r\n", 405, "GET /state"),
        (b"OPTIONS /limit HTTP/1.1\r\n\r\n", 405, "PUT /limit"),
        (b"BREW /limit HTTP/1.1\r\n\r\n", 501, "unsupported method 'BREW'"),
        (b"GARBAGE\r\n\r\n", 400, "request line 'GARBAGE'"),
        (b"GET /state\r\n", 400, "send HTTP/1.1"),  # HTTP/0.9: answered, not left waiting
        (b"GET /state HTTP/9.9\r\n\r\n", 400, "send HTTP/1.1"),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414, "URI"),
        (b"GET /state HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", 431, "header"),
        # Content-Length read strictly: one value of ASCII digits (a second, different one,
        # a sign or Python's "1_2" is how one request hides another)
        (
            b'PUT /limit HTTP/1.1\r\nContent-Length: 12\r\nContent-Length: 0\r\n\r\n{"limit": 5}',
            400,
            "sent once",
        ),
        (b'PUT /limit HTTP/1.1\r\nContent-Length: +12\r\n\r\n{"limit": 5}', 400, "ASCII digits"),
        (b'PUT /limit HTTP/1.1\r\nContent-Length: 1_2\r\n\r\n{"limit": 5}', 400, "ASCII digits"),
        (
            b'PUT /limit HTTP/1.1\r\nContent-Length: \xd9\xa1\xd9\xa2\r\n\r\n{"limit": 5}',
            400,
            "ASCII",
        ),
    ],
)
def test_what_the_http_layer_refuses_is_problem_json_and_changes_nothing(
    served: tuple[str, LimitMailbox, ShrinkCoordinator],
    request_bytes: bytes,
    code: int,
    needle: str,
) -> None:
    """Refusals of the standard library's HTTP layer (unknown methods, unreadable request
    lines, oversized lines and headers) read like every other answer of the socket: a
    status line, problem+json, a detail that says what to send; the connection closes."""
    path, mailbox, _ = served
    before = (mailbox.desired, mailbox.latest_state)
    [(got, headers, body)] = framed_replies(_send_raw(path, request_bytes))
    problem = json.loads(body)
    assert (got, problem["status"]) == (code, code), problem
    assert headers["content-type"] == "application/problem+json"
    # the connection closes unless the request was read whole (PATCH/OPTIONS: as DELETE)
    read_whole = request_bytes.startswith((b"PATCH", b"OPTIONS"))
    assert headers.get("connection") == (None if read_whole else "close")
    assert needle in problem["detail"], problem
    assert (mailbox.desired, mailbox.latest_state) == before and not mailbox.has_untaken
    assert call(path, "GET", "/healthz")[0] == 200


def test_a_get_body_is_never_taken_for_the_next_request(
    served: tuple[str, LimitMailbox, ShrinkCoordinator],
) -> None:
    """A GET with a body carrying a whole PUT: the GET is answered, the connection closed,
    and the PUT inside it never runs."""
    path, mailbox, _ = served
    request = b"GET /state HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(PUT_7), PUT_7)
    [(got, headers, body)] = framed_replies(_send_raw(path, request))
    assert got == 200 and headers["connection"] == "close" and json.loads(body)["revision"] == 0
    time.sleep(0.2)  # a handler thread that went on to the hidden request would have published
    assert mailbox.revision == 0 and not mailbox.has_untaken
    # without a body the connection stays open for the next request, as before
    replies = framed_replies(_send_raw(path, b"GET /state HTTP/1.1\r\n\r\n" + PUT_7))
    assert [r[0] for r in replies] == [200, 200] and mailbox.desired.limit_bytes == 7


@pytest.mark.parametrize("seed", soak_seeds() or range(3))
def test_mutated_requests_get_framed_answers_and_only_a_200_put_publishes(
    served: tuple[str, LimitMailbox, ShrinkCoordinator], seed: int
) -> None:
    """Valid requests cut, spliced, byte-flipped and repeated, each on its own connection:
    every byte the server sends back is a framed HTTP/1.1 reply (JSON, problem+json on
    errors; no 5xx but 501 for a method it does not know), the socket keeps serving, and
    the mailbox's revision moves only where a request was answered 200."""
    path, mailbox, _ = served
    rng = random.Random(seed)
    seeds = [
        PUT_7,
        b'PUT /limit HTTP/1.1\r\nContent-Length: 29\r\n\r\n{"limit": "1G", "revision": 9}',
        b"GET /state HTTP/1.1\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n",
        b"DELETE /limit HTTP/1.1\r\n\r\n",
    ]
    for _ in range(150):
        request = mutated_request(rng, seeds)
        revision = mailbox.revision
        replies = framed_replies(_send_raw(path, request))
        for got, headers, body in replies:
            assert got < 500 or got == 501, (request, got, body)  # 501: a method
            assert headers["content-type"] == (
                "application/problem+json" if got >= 400 else "application/json"
            )
            json.loads(body)
        # the revision moves only where some request on the connection was answered 200
        # (a refused, cut or unanswered request publishes nothing)
        assert mailbox.revision == revision or 200 in [r[0] for r in replies], request
    assert call(path, "GET", "/healthz")[0] == 200


_FD_EXHAUSTED_CHILD = """
import os, resource, sys
from engine_ext import ControlServer, LimitMailbox
server = ControlServer(sys.argv[1], LimitMailbox())
server.start()
print(server._thread.native_id, flush=True)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print("full", flush=True)
sys.stdin.readline()
for fd in held:
    os.close(fd)
print("freed", flush=True)
sys.stdin.readline()
server.stop()
"""


def _thread_cpu_s(pid: int, tid: int) -> float:
    with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as stat_file:
        fields = stat_file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_engine_out_of_descriptors_does_not_spin_and_serves_once_they_free(
    tmp_path: Path,
) -> None:
    """The engine's process has no descriptor left (its limit reached: many connections of
    its own, a leak elsewhere) and a client connects: accept() fails with EMFILE while the
    connection stays in the backlog, so the socket stays readable. The server thread
    retried at once, for as long as the shortage lasted: a core at 100 % and the GIL
    taken from the engine's busy loop. It waits instead, and serves the client once
    descriptors are free again. From /proc: the thread's CPU time over that second."""
    path = str(tmp_path / "c.sock")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    with subprocess.Popen(
        [sys.executable, "-c", _FD_EXHAUSTED_CHILD, path],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            tid = int(child.stdout.readline())
            assert child.stdout.readline() == b"full\n"
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(15)
            with client:
                client.connect(path)  # into the backlog: the server cannot accept it now
                client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                time.sleep(0.2)
                cpu0 = _thread_cpu_s(child.pid, tid)
                time.sleep(1.0)
                spent = _thread_cpu_s(child.pid, tid) - cpu0
                assert spent < 0.2, f"the server thread spent {spent:.2f} s of CPU in 1 s"
                child.stdin.write(b"free\n")
                child.stdin.flush()
                assert child.stdout.readline() == b"freed\n"
                answer = client.recv(65536)  # served once descriptors are back
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            child.stdin.write(b"stop\n")
            child.stdin.flush()
            assert child.wait(15) == 0
        finally:
            if child.poll() is None:
                child.kill()
