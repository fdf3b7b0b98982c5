"""SidecarClient and ElasticInstance start-up against a small real HTTP server on loopback.

The stand-in speaks the engine-facing half of the sidecar API
(``/instances/{id}/register`` and ``/report``) with the wire models of
``engine_ext.protocol``; the real sidecar is exercised by the e2e tests.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from engine_pool import BLOCKS_PER_PAGE, BUNDLE, Pool
from support import preload
from support.endless import EndlessServer, rss_bytes
from support.soak import soak_seeds

from engine_ext import ElasticInstance, EngineBinding, LimitMailbox, Target, load_engine_settings
from engine_ext._sidecar_client import SidecarClient
from engine_ext.protocol import (
    MAX_REPLY_BYTES,
    EngineState,
    RegisterBody,
    RegisterReply,
    Status,
)


class StandIn:
    """Records what the engine sends; answers like the sidecar would."""

    def __init__(self, port: int = 0) -> None:
        self.retained = RegisterReply()
        self.registers: list[RegisterBody] = []
        self.reports: list[EngineState] = []
        self.refused_reports = 0  # reports answered 404
        self.deregisters = 0
        self.delay_s = 0.0  # each answer waits this long (a slow sidecar)
        self.auth: list[str | None] = []
        self.forget = False  # answer 404 to reports until the next register
        self.never_known = False  # answer 404 to every report (/report reaches another server)
        self.gate = threading.Event()
        self.gate.set()  # cleared: report handlers block until set
        self.changed = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["Content-Length"]))
                outer.auth.append(self.headers.get("Authorization"))
                if self.path == "/instances/eng-1/register":
                    body = RegisterBody.model_validate_json(data)
                    outer.forget = False
                    reply = outer.retained.model_dump_json().encode()
                    code = 200
                    with outer.changed:
                        outer.registers.append(body)
                        outer.changed.notify_all()
                elif self.path == "/instances/eng-1/report":
                    outer.gate.wait(10)
                    forgot = outer.forget or outer.never_known
                    code, reply = (
                        (404, b'{"detail": "unknown"}')
                        if forgot
                        else (200, outer.retained.model_dump_json().encode())
                    )
                    with outer.changed:
                        if not forgot:
                            outer.reports.append(EngineState.model_validate_json(data))
                        outer.refused_reports += forgot
                        outer.changed.notify_all()
                elif self.path == "/instances/eng-1/deregister":
                    code, reply = 200, b"{}"
                    with outer.changed:
                        outer.deregisters += 1
                        outer.changed.notify_all()
                else:
                    code, reply = 404, b"{}"
                time.sleep(outer.delay_s)
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def wait(self, what: str, count: int) -> list[Any]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(getattr(self, what)) >= count, timeout=10)
            return list(getattr(self, what))

    def wait_report(self, revision: int, mapped_bytes: int) -> None:
        """Wait until a report carries this revision and mapped figure."""
        with self.changed:
            assert self.changed.wait_for(
                lambda: any(
                    r.revision == revision and r.mapped_bytes == mapped_bytes for r in self.reports
                ),
                timeout=10,
            )

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def standin() -> Iterator[StandIn]:
    s = StandIn()
    yield s
    s.close()


def make_instance(
    pool: Pool, tmp_path: Path, url: str, wake: threading.Event | None = None, **settings: Any
) -> ElasticInstance:
    settings.setdefault("register_timeout_s", 5)
    config = load_engine_settings(
        instance_id="eng-1", sidecar_url=url, runtime_dir=tmp_path, **settings
    )
    binding = EngineBinding(
        "vllm", "0.33.0", pool.blocks, (pool.cache,), wake=None if wake is None else wake.set
    )
    return ElasticInstance(config, binding)


def test_retained_limit_applied_before_first_allocation(
    pool: Pool, tmp_path: Path, standin: StandIn
) -> None:
    standin.retained = RegisterReply(limit=2 * BUNDLE, revision=3)
    inst = make_instance(pool, tmp_path, standin.url, token="s3cret")
    try:
        inst.start()
        body = standin.registers[0]
        assert body.engine == "vllm" and body.socket_path == inst.socket_path
        assert standin.auth[0] == "Bearer s3cret"
        assert pool.backend.mapped_bytes() == 0
        # the engine's first allocation: a pass, then blocks
        state = inst.step()
        assert state.revision == 3 and state.status is Status.APPLIED
        got = [pool.cache.start([i]) for i in range(4 * BLOCKS_PER_PAGE)]
        assert sum(r is not None for r in got) == 2 * BLOCKS_PER_PAGE
        assert pool.backend.mapped_bytes() == 2 * BUNDLE
        inst.step()
        standin.wait_report(3, 2 * BUNDLE)
    finally:
        inst.close()
    assert not Path(inst.socket_path).exists() and not inst.runtime_dir.exists()


def test_reports_latest_state_and_never_blocks_the_engine(
    pool: Pool, tmp_path: Path, standin: StandIn
) -> None:
    inst = make_instance(pool, tmp_path, standin.url, heartbeat_s=30)
    try:
        inst.start()
        standin.gate.clear()  # the sidecar hangs on reports
        pool.fill(3)
        inst.set_limit(8 * BUNDLE)
        inst.step()  # reports (enqueue) while the sidecar is stuck: must return
        inst.set_limit(1 * BUNDLE)
        state = inst.step()
        assert state.status is Status.APPLIED and state.revision == 2
        standin.gate.set()
        standin.wait_report(2, BUNDLE)
        assert standin.reports[-1].revision == 2  # latest wins: nothing older after it
    finally:
        inst.close()


def test_heartbeats_and_reregisters_after_404(pool: Pool, tmp_path: Path, standin: StandIn) -> None:
    woken = threading.Event()
    inst = make_instance(pool, tmp_path, standin.url, woken, heartbeat_s=0.05)
    try:
        inst.start()
        standin.wait("reports", 3)  # heartbeats with nothing changed
        assert not woken.is_set() and inst.mailbox.revision == 0
        standin.retained = RegisterReply(limit=BUNDLE, revision=4)  # a push that got lost
        assert woken.wait(10) and inst.mailbox.desired.revision == 4  # adopted from a reply
        standin.forget = True  # the sidecar lost its state
        standin.wait("registers", 2)
        n = len(standin.reports)
        standin.wait("reports", n + 1)
    finally:
        inst.close()


def test_a_report_unknown_right_after_registering_backs_off(
    standin: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    """Two sidecars behind one address (or a proxy that routes /report elsewhere): every
    registration succeeds and the report after it is 404. Registering again at once, as
    after a sidecar that forgot the instance, made the two calls loop as fast as the
    network answered: 648 registrations in 2 s against this stand-in, each a durable
    write in a sidecar. They back off instead, with a warning that names the setting; a
    sidecar that forgets an instance it had taken reports from is re-joined at once."""
    standin.never_known = True
    client = SidecarClient(
        load_engine_settings(sidecar_url=standin.url, heartbeat_s=60),
        LimitMailbox(),
        lambda: RegisterBody(engine="vllm", engine_version="0.33.0", state=_state(0)),
        instance_id="eng-1",
    )
    try:
        with caplog.at_level(logging.WARNING, logger="engine_ext"):
            client.start()
            client.report(_state(1))  # an engine reports as it runs
            time.sleep(2.0)
            n = len(standin.registers)
        # backoff from 0.05 s, doubling: 0.05 + 0.1 + ... + 0.8 < 2 s, then 1.6 s waits
        assert 3 <= n <= 8, n
        assert standin.refused_reports in (n - 1, n)
        assert any("KVSIDECAR_SIDECAR_URL" in r.getMessage() for r in caplog.records)
        # the sidecar takes reports again: the client settles and reports
        standin.never_known = False
        standin.wait("reports", 1)
        registered = len(standin.registers)
        # then it forgets the instance (kvctl forget): registered again at once, no backoff
        standin.forget = True
        t0 = time.monotonic()
        client.report(_state(3))
        standin.wait("registers", registered + 1)
        assert time.monotonic() - t0 < 1.0
    finally:
        client.stop()


@pytest.mark.parametrize(
    "bad",
    [
        {"limit": -5, "revision": 4},
        {"limit": 1 << 61, "revision": 4},
        {"limit": BUNDLE, "revision": 1 << 64},
    ],
    ids=["negative", "over-1EiB", "huge-revision"],
)
def test_a_bad_reply_is_ignored_and_the_client_keeps_going(
    pool: Pool,
    tmp_path: Path,
    standin: StandIn,
    bad: dict[str, int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    standin.retained = RegisterReply.model_construct(**bad)  # what a buggy sidecar might send
    woken = threading.Event()
    inst = make_instance(pool, tmp_path, standin.url, woken, heartbeat_s=0.05)
    try:
        inst.start()  # the register reply is bad: the engine starts anyway, unlimited
        assert inst.sidecar is not None and inst.sidecar.registered
        standin.wait("reports", 3)  # the client thread survived the bad replies
        assert inst.mailbox.revision == 0 and not woken.is_set()
        assert "ignored" in caplog.text
        standin.retained = RegisterReply(limit=BUNDLE, revision=5)
        assert woken.wait(10) and inst.mailbox.desired == Target(BUNDLE, 5)
    finally:
        inst.close()


def test_sidecar_down_at_start_registers_in_background(pool: Pool, tmp_path: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    woken = threading.Event()
    inst = make_instance(
        pool, tmp_path, f"http://127.0.0.1:{port}", woken, register_timeout_s=0.2, limit="512K"
    )
    try:
        inst.start()  # gives up after 0.2 s; the engine starts with the configured limit
        assert inst.sidecar is not None and not inst.sidecar.registered
        assert inst.mailbox.desired.limit_bytes == 512 * 1024
        woken.clear()
        late = StandIn(port)
        try:
            late.retained = RegisterReply(limit=BUNDLE, revision=9)
            assert woken.wait(10)  # the client published the retained limit: engine woken
            assert inst.mailbox.revision == 9 and len(late.registers) == 1
            assert inst.step().limit_bytes == BUNDLE
        finally:
            late.close()
    finally:
        inst.close()


def make_client(standin: StandIn, **settings: Any) -> SidecarClient:
    """A registered, started client of the stand-in (no engine behind it), its first
    report (the mailbox's state, sent as the thread starts) taken off the record."""
    config = load_engine_settings(sidecar_url=standin.url, heartbeat_s=60, **settings)
    client = SidecarClient(
        config,
        LimitMailbox(),
        lambda: RegisterBody(engine="vllm", engine_version="0.33.0", state=_state(0)),
        instance_id="eng-1",
    )
    assert client.register_blocking(5)
    client.start()
    standin.wait("reports", 1)
    with standin.changed:
        standin.reports.clear()
    return client


def _state(mapped_pages: int, status: Status = Status.APPLIED, revision: int = 0) -> EngineState:
    return EngineState(status=status, revision=revision, mapped_bytes=mapped_pages * BUNDLE)


def test_figures_only_reports_are_paced_and_the_latest_arrives(standin: StandIn) -> None:
    """Mapped bytes move with nearly every page under traffic: a POST each would cost the
    engine process ~1-2 ms of CPU per page (bench/bench_reports.py). At most one report
    per interval goes out, and the last state always does."""
    interval = 0.3
    client = make_client(standin, report_interval_s=interval)
    try:
        client.report(_state(0))
        standin.wait("reports", 1)
        started = time.monotonic()
        for pages in range(1, 41):  # a burst of page maps, the status unchanged
            client.report(_state(pages))
            time.sleep(0.005)
        elapsed = time.monotonic() - started
        standin.wait_report(0, 40 * BUNDLE)  # the trailing report carries the latest figure
        reports = standin.wait("reports", 1)
        # one report per interval at most (plus the one that opened the burst's interval)
        assert len(reports) <= 2 + elapsed / interval, [r.mapped_bytes for r in reports]
        assert reports[-1].mapped_bytes == 40 * BUNDLE
    finally:
        client.stop()


def test_a_status_or_revision_change_is_not_held_by_the_interval(standin: StandIn) -> None:
    client = make_client(standin, report_interval_s=30)  # its first report just went
    try:
        client.report(_state(2))  # figures only: waits for the interval (30 s)
        time.sleep(0.3)
        assert standin.reports == []
        client.report(_state(3, Status.DEFERRED, revision=1))  # a new target: at once
        reports = standin.wait("reports", 1)
        # latest wins: the figures-only state never went on its own
        assert [(r.status, r.mapped_bytes) for r in reports] == [(Status.DEFERRED, 3 * BUNDLE)]
        client.report(_state(2, Status.APPLIED, revision=1))  # the status moved: at once
        assert standin.wait("reports", 2)[-1].status is Status.APPLIED
    finally:
        client.stop()


def test_random_reports_from_a_foreign_thread_keep_order_pace_and_the_last_state(
    standin: StandIn,
) -> None:
    """Reports at random moments (the engine thread's page maps, status flips, new
    revisions) while the client thread sends: what is sent is in the order reported,
    never older than what was sent before, ends with the last state reported, and two
    sends whose status, revision and reasons are the same are an interval apart."""
    import random

    interval = 0.2
    client = make_client(standin, report_interval_s=interval)
    sends: list[tuple[float, EngineState]] = []
    post = client._post

    def recorded(path: str, content: str) -> Any:
        if path == "/report":  # _sent_at is what the pacing compares with
            sends.append((client._sent_at, EngineState.model_validate_json(content)))
        return post(path, content)

    client._post = recorded  # type: ignore[method-assign]
    rng = random.Random(11)
    status, revision = Status.APPLIED, 0
    reported: list[EngineState] = []
    try:
        for i in range(1, 301):
            if rng.random() < 0.04:
                revision += 1
            if rng.random() < 0.06:
                status = Status.DEFERRED if status is Status.APPLIED else Status.APPLIED
            state = EngineState(status=status, revision=revision, mapped_bytes=i)  # i: its id
            reported.append(state)
            client.report(state)
            time.sleep(rng.choice([0, 0, 0.001, 0.003, 0.01]))
        standin.wait_report(revision, 300)
    finally:
        client.stop()
    ids = [state.mapped_bytes for _at, state in sends]
    assert ids == sorted(set(ids)) and ids[-1] == 300  # in order, no repeat, the last one
    keys = [(state.status, state.revision) for _at, state in sends]
    for k in range(1, len(sends)):
        if keys[k] == keys[k - 1]:
            assert sends[k][0] - sends[k - 1][0] >= interval, (k, keys[k])
    changes = sum(
        (a.status, a.revision) != (b.status, b.revision) for a, b in itertools.pairwise(reported)
    )
    assert changes >= 10  # the trace did flip statuses and revisions (not only figures)


def test_interval_zero_reports_every_change(standin: StandIn) -> None:
    client = make_client(standin, report_interval_s=0)
    try:
        for pages in range(1, 6):
            client.report(_state(pages))
            standin.wait_report(0, pages * BUNDLE)
        assert [r.mapped_bytes for r in standin.reports] == [p * BUNDLE for p in range(1, 6)]
    finally:
        client.stop()


def test_no_sidecar_uses_configured_limit(pool: Pool, tmp_path: Path) -> None:
    config = load_engine_settings(instance_id="solo", runtime_dir=tmp_path, limit="256KiB")
    inst = ElasticInstance(config, EngineBinding("sglang", "0.5.23", pool.blocks, (pool.cache,)))
    try:
        inst.start()
        assert inst.sidecar is None
        state = inst.step()
        assert state.limit_bytes == 256 * 1024 == 2 * BUNDLE and state.revision == 1
        pool.fill(2)
        assert pool.cache.start([10_000]) is None  # the third page is refused
        assert inst.step().status is Status.APPLIED
    finally:
        inst.close()


class HostileSidecar:
    """A raw TCP server that answers every request with the next of ``answers`` (bytes
    sent as they are, then the connection closed), or with ``good`` once it is set."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = itertools.cycle(answers)
        self.good: bytes | None = None
        self.served = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:  # the request's headers (the body is small)
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    answer = self.good if self.good is not None else next(self.answers)
                    self.served += 1
                    conn.sendall(answer)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _answer(status: str, body: bytes, *headers: bytes) -> bytes:
    head = [b"HTTP/1.1 " + status.encode(), b"Content-Length: %d" % len(body), *headers]
    return b"\r\n".join([*head, b"Connection: close", b"", body])


HOSTILE_ANSWERS = [
    _answer("409 Conflict", b"[]"),  # a refusal whose JSON is not an object
    _answer("409 Conflict", b'"held"'),
    _answer("409 Conflict", b"\xff\xfe not utf-8"),
    _answer("200 OK", b"[1, 2]"),
    _answer("200 OK", b'{"limit": "lots", "revision": 3}'),
    _answer("200 OK", b'{"limit": -5, "revision": 3}'),
    _answer("200 OK", b'{"limit": 1, "revision": -1}'),
    _answer("200 OK", b'{"limit": 1, "revision": 1e400}'),
    _answer("200 OK", b"[" * 100_000 + b"]" * 100_000),
    _answer("200 OK", b"not json at all"),
    _answer("200 OK", b"{}", b"Content-Encoding: gzip"),  # not gzip
    _answer("500 Internal Server Error", b"<html>oops</html>"),
    _answer("404 Not Found", b"[]"),
    b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{}",  # cut short
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a bad chunk
    b"garbage, not HTTP\r\n\r\n",
    b"",  # closed without a word
]


def test_a_hostile_sidecar_never_ends_the_client_thread_nor_sets_a_limit(
    pool: Pool, tmp_path: Path
) -> None:
    """Every answer a broken or hostile server could give to register and report (refusals
    whose body is not an object, replies that are not RegisterReplies, limits and
    revisions out of range, bodies cut short, bad encodings, not HTTP at all): the engine
    starts unlimited, the client thread keeps trying, no limit is taken; once a sane
    answer comes its limit is taken."""
    server = HostileSidecar(HOSTILE_ANSWERS)
    woken = threading.Event()
    inst = make_instance(pool, tmp_path, server.url, woken, register_timeout_s=1, heartbeat_s=0.05)
    try:
        inst.start()
        assert inst.sidecar is not None
        deadline = time.monotonic() + 30
        while server.served < 3 * len(HOSTILE_ANSWERS):  # every answer, several times
            assert time.monotonic() < deadline, server.served
            assert inst.sidecar._thread is not None and inst.sidecar._thread.is_alive()
            time.sleep(0.05)
        assert inst.sidecar._thread.is_alive()
        assert inst.mailbox.revision == 0 and not woken.is_set()
        server.good = _answer(
            "200 OK", RegisterReply(limit=BUNDLE, revision=5).model_dump_json().encode()
        )
        assert woken.wait(30) and inst.mailbox.desired == Target(BUNDLE, 5)
    finally:
        inst.close()
        server.close()


@pytest.mark.parametrize(
    "answer",
    [
        _answer(
            "404 Not Found",
            b"<!DOCTYPE HTML>\n<html>\n<body>\n<h1>Not Found</h1>\n</body>\n</html>\n",
            b"Content-Type: text/html",
        ),
        _answer(
            "502 Bad Gateway",
            b"upstream\nconnect error\nor disconnect",
            b"Content-Type: text/plain",
        ),
        _answer(
            "401 Unauthorized",
            b'{"detail": "wrong\\nbearer token"}',
            b"Content-Type: application/json",
        ),
    ],
)
def test_what_a_refusal_logs_is_one_line(
    pool: Pool, tmp_path: Path, answer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar URL that reaches a proxy or another server: the engine's warning was the
    page's raw lines (an HTML document across the engine's log); now one line that says
    what answered."""
    caplog.set_level(logging.WARNING, logger="kvsidecar")
    server = HostileSidecar([answer])
    inst = make_instance(pool, tmp_path, server.url, threading.Event(), register_timeout_s=1)
    try:
        inst.start()
        deadline = time.monotonic() + 30
        while server.served < 2:
            assert time.monotonic() < deadline, server.served
            time.sleep(0.05)
    finally:
        inst.close()
        server.close()
    failures = [r.getMessage() for r in caplog.records if "answered" in r.getMessage()]
    assert failures, [r.getMessage() for r in caplog.records]
    for message in failures:
        assert "\n" not in message, message
        assert "<h1>" not in message, message


@pytest.mark.parametrize("mode", ["flood", "drip"])
def test_an_answer_without_end_is_cut_and_the_client_goes_on(
    pool: Pool, tmp_path: Path, mode: str
) -> None:
    """The client reads at most MAX_REPLY_BYTES of an answer and gives it at most its
    request timeout in all. Before, a sidecar streaming without end filled the engine's
    memory (the whole answer was read), and one sending a byte now and then held the
    start-up's registration, then the client thread, for ever (httpx's timeout is per
    read). Checked by what the kernel says (RSS) and by the client coming back."""
    server = EndlessServer(mode)
    inst = make_instance(pool, tmp_path, server.url, register_timeout_s=1, heartbeat_s=0.05)
    rss_before = rss_bytes()
    try:
        inst.start()  # the registration gives up after register_timeout_s (each try is cut)
        assert inst.sidecar is not None
        deadline = time.monotonic() + 60
        while server.connections < 3:  # the client thread keeps trying: each answer was cut
            assert time.monotonic() < deadline, (server.connections, server.sent)
            time.sleep(0.05)
        assert inst.sidecar._thread is not None and inst.sidecar._thread.is_alive()
        if mode == "flood":
            assert server.sent > 2 * MAX_REPLY_BYTES  # more was offered than was read
            assert rss_bytes() - rss_before < 64 << 20, "the answers were read into memory"
        assert inst.mailbox.revision == 0
    finally:
        inst.close()
        server.close()


def test_a_bug_in_handling_an_answer_is_logged_and_retried(
    pool: Pool,
    tmp_path: Path,
    standin: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception no answer should cause (here: taking the reply raises, twice) neither
    stops the engine's start nor ends the client thread: it is logged with its traceback
    and the call retried, and the retained limit is taken once the bug stops."""
    real = SidecarClient._adopt
    failures = iter([RuntimeError("bug 1"), RuntimeError("bug 2")])

    def adopt(self: SidecarClient, response: Any) -> None:
        exc = next(failures, None)
        if exc is not None:
            raise exc
        real(self, response)

    monkeypatch.setattr(SidecarClient, "_adopt", adopt)
    standin.retained = RegisterReply(limit=2 * BUNDLE, revision=4)
    woken = threading.Event()
    inst = make_instance(pool, tmp_path, standin.url, woken, heartbeat_s=0.05)
    try:
        inst.start()  # the first register's reply raised: retried (in start or later)
        assert woken.wait(10) and inst.mailbox.desired == Target(2 * BUNDLE, 4)
        assert inst.sidecar is not None and inst.sidecar._thread is not None
        assert inst.sidecar._thread.is_alive()
        assert caplog.text.count("failed unexpectedly") == 2 and "bug 2" in caplog.text
    finally:
        inst.close()


_HANGING_RESOLVER_CHILD = """
import json, socket, time
from engine_ext import LimitMailbox, load_engine_settings
from engine_ext._sidecar_client import SidecarClient
from engine_ext.protocol import EngineState, RegisterBody, Status

t0 = time.monotonic()
try:
    socket.getaddrinfo("kvs-hangs.invalid", 8570)
except OSError:
    pass
resolve_s = time.monotonic() - t0
client = SidecarClient(
    load_engine_settings(sidecar_url="http://kvs-hangs.invalid:8570"),
    LimitMailbox(),
    lambda: RegisterBody(engine="vllm", engine_version="0.33.0",
                         state=EngineState(status=Status.APPLIED)),
    instance_id="eng-1",
)
t0 = time.monotonic()
registered = client.register_blocking(1.0)
register_s = time.monotonic() - t0
t0 = time.monotonic()
client.stop()
stop_s = time.monotonic() - t0
print(json.dumps({"resolve_s": resolve_s, "register_s": register_s,
                  "registered": registered, "stop_s": stop_s}))
"""


def test_a_sidecar_host_that_hangs_in_the_resolver_holds_neither_start_nor_stop(
    tmp_path: Path,
) -> None:
    """A DNS server that does not answer: resolving the sidecar's host name takes as long as
    the resolver's retries (seconds to tens of seconds), and name resolution has no
    timeout of its own. The engine's start waited for that past ``register_timeout_s``
    (6 s against 1 s here), and its shutdown past the deregistration's 2 s (11.5 s).
    Both waits are bounded now; the calls go on in the client thread. In a child process
    whose getaddrinfo() the slowdns shim makes hang 4 s for one name."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
        "LD_PRELOAD": str(preload.build("slowdns", tmp_path)),
        "KVS_SLOW_DNS_HOST": "kvs-hangs.invalid",
        "KVS_SLOW_DNS_S": "4",
    }
    done = subprocess.run(
        [sys.executable, "-c", _HANGING_RESOLVER_CHILD],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    times = json.loads(done.stdout.splitlines()[-1])
    assert times["resolve_s"] >= 3.5, times  # the shim hangs the resolver (else vacuous)
    assert not times["registered"]
    assert times["register_s"] < 2.0, times  # register_timeout_s 1 s, not the resolver's 4
    assert times["stop_s"] < 4.0, times  # the stop's own bound (2.5 s), not 4 + 4 s


@pytest.mark.parametrize("seed", soak_seeds() or range(2))
def test_start_report_and_stop_from_foreign_threads_at_random_moments(
    standin: StandIn, seed: int
) -> None:
    """The client's life cycle from three threads at once, at random moments: the engine
    thread's register_blocking, a thread reporting states, and stop() (a signal's
    cleanup, the atexit hook). Whatever the order: register_blocking returns within its
    bound, stop() within its own, the client thread has ended when stop() returns (the
    sidecar was quick), nothing raises, and every registration the sidecar took is
    followed by a deregistration."""
    rng = random.Random(seed)
    errors: list[BaseException] = []

    def guarded(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 -- collected for the test thread
                errors.append(exc)

        return run

    for _ in range(25):
        standin.delay_s = rng.choice([0.0, 0.0, 0.005, 0.02])
        with standin.changed:
            registers_before = len(standin.registers)
            deregisters_before = standin.deregisters
        client = SidecarClient(
            load_engine_settings(sidecar_url=standin.url, heartbeat_s=0.05),
            LimitMailbox(),
            lambda: RegisterBody(engine="vllm", engine_version="0.33.0", state=_state(0)),
            instance_id="eng-1",
        )
        waited: list[float] = []

        def register(client: SidecarClient = client, waited: list[float] = waited) -> None:
            time.sleep(rng.uniform(0, 0.02))
            t0 = time.monotonic()
            client.register_blocking(0.5)
            waited.append(time.monotonic() - t0)

        def reports(client: SidecarClient = client) -> None:
            for n in range(rng.randrange(1, 20)):
                client.report(_state(n))
                time.sleep(rng.uniform(0, 0.005))

        stopped: list[float] = []

        def stop(client: SidecarClient = client, stopped: list[float] = stopped) -> None:
            time.sleep(rng.uniform(0, 0.08))
            t0 = time.monotonic()
            client.stop()
            stopped.append(time.monotonic() - t0)

        threads = [
            threading.Thread(target=guarded(fn), name=name)
            for name, fn in (("engine", register), ("reporter", reports), ("stopper", stop))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert errors == []
        assert waited and waited[0] < 1.0, waited
        assert stopped and stopped[0] < 3.0, stopped
        client_thread = client._thread
        assert client_thread is None or not client_thread.is_alive()
        with standin.changed:
            registered = len(standin.registers) - registers_before
            deregistered = standin.deregisters - deregisters_before
        assert deregistered == (1 if registered else 0), (registered, deregistered)
