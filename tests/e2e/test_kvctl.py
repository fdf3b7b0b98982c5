"""kvctl against a real sidecar (uvicorn on loopback) and a real engine control socket."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import preload
from support.endless import EndlessServer
from test_sidecar_support import ROOT, SocketEngine, ThreadedSidecar
from typer.testing import CliRunner

from sidecar import SidecarSettings
from sidecar.kvctl import app

GiB = 1 << 30
runner = CliRunner()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[ThreadedSidecar]:
    with ThreadedSidecar(
        SidecarSettings(db_path=tmp_path / "s.db", token="tok", max_wait_s=30)
    ) as server:
        yield server


@pytest.fixture
def engine(tmp_path: Path, sidecar: ThreadedSidecar) -> Iterator[SocketEngine]:
    with SocketEngine(
        tmp_path / "e.sock", mapped_bytes=6 * GiB, device_total_bytes=80 * GiB
    ) as eng:
        r = httpx.post(
            f"{sidecar.url}/instances/llama-a/register",
            json=eng.register_body(),
            headers={"Authorization": "Bearer tok"},
        )
        assert r.status_code == 200
        yield eng


def kvctl(sidecar: ThreadedSidecar, *args: str, token: str = "tok") -> tuple[int, str]:
    result = runner.invoke(app, ["--url", sidecar.url, "--token", token, *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def report(sidecar: ThreadedSidecar, engine: SocketEngine, mapped_bytes: int) -> None:
    state = engine.engine_pass(mapped_bytes=mapped_bytes)
    httpx.post(
        f"{sidecar.url}/instances/llama-a/report",
        content=state.model_dump_json(),
        headers={"Authorization": "Bearer tok", "content-type": "application/json"},
    )


def test_limit_status_list_delete(sidecar: ThreadedSidecar, engine: SocketEngine) -> None:
    code, out = kvctl(sidecar, "limit", "llama-a", "4G")
    assert code == 0 and "limit 4GiB rev 1" in out
    code, out = kvctl(sidecar, "status", "llama-a", "--json")
    assert code == 0 and json.loads(out)["desired"]["limit_bytes"] == 4 * GiB
    code, out = kvctl(sidecar, "list", "--json")
    assert [v["id"] for v in json.loads(out)] == ["llama-a"]
    code, out = kvctl(sidecar, "list")
    assert code == 0 and "llama-a" in out and "4GiB" in out
    code, out = kvctl(sidecar, "delete", "llama-a", "--json")
    assert code == 0 and json.loads(out)["desired"] == {
        **json.loads(out)["desired"],
        "limit_bytes": None,
        "revision": 2,
    }


def test_limit_percent_uses_the_registered_device_memory(
    sidecar: ThreadedSidecar, engine: SocketEngine
) -> None:
    code, out = kvctl(sidecar, "limit-percent", "llama-a", "12.5", "--json")
    assert code == 0 and json.loads(out)["desired"]["limit_bytes"] == 10 * GiB
    code, out = kvctl(sidecar, "limit-percent", "llama-a", "150")
    assert code == 2 and "percent must be a number from 0 to 100; got 150.0" in out
    httpx.put(
        f"{sidecar.url}/instances/other/limit",
        json={"limit": 1},
        headers={"Authorization": "Bearer tok"},
    )
    code, out = kvctl(sidecar, "limit-percent", "other", "10")
    assert code == 2 and "has not registered its device memory" in out


@pytest.mark.parametrize("percent", ["nan", "NaN", "inf", "-inf", "infinity", "-0.5"])
def test_limit_percent_rejects_non_finite_values(
    sidecar: ThreadedSidecar, engine: SocketEngine, percent: str
) -> None:
    before = httpx.get(f"{sidecar.url}/instances/llama-a").json()["desired"]
    code, out = kvctl(sidecar, "limit-percent", "llama-a", "--", percent)
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
    assert "percent must be a number from 0 to 100" in out, out
    assert httpx.get(f"{sidecar.url}/instances/llama-a").json()["desired"] == before


def test_wait_exit_codes(sidecar: ThreadedSidecar, engine: SocketEngine) -> None:
    code, out = kvctl(sidecar, "limit", "llama-a", "4G", "--wait", "0.3")
    assert code == 3 and ("deferred" in out or "pending" in out)  # 6 GiB still mapped
    done: dict[str, tuple[int, str]] = {}
    waiter = threading.Thread(
        target=lambda: done.update(r=kvctl(sidecar, "status", "llama-a", "--wait", "30"))
    )
    waiter.start()
    report(sidecar, engine, mapped_bytes=3 * GiB)
    waiter.join(30)
    assert done["r"][0] == 0 and "applied" in done["r"][1]


def test_errors_are_one_line_with_exit_codes(sidecar: ThreadedSidecar) -> None:
    code, out = kvctl(sidecar, "limit", "llama-a", "12X")
    assert code == 2 and "cannot read size" in out
    code, out = kvctl(sidecar, "limit", "bad id!", "1G")
    assert code == 2 and "instance_id" in out
    code, out = kvctl(sidecar, "status", "nobody")
    assert code == 1 and "'nobody' is not known" in out
    code, out = kvctl(sidecar, "limit", "llama-a", "1G", token="wrong")
    assert code == 1 and "token is wrong" in out
    result = runner.invoke(app, ["--url", "http://127.0.0.1:9", "list"])
    assert result.exit_code == 4 and "cannot reach the sidecar" in result.output
    assert "Traceback" not in out


def test_watch_once_draws_bars(sidecar: ThreadedSidecar, engine: SocketEngine) -> None:
    kvctl(sidecar, "limit", "llama-a", "4G")
    report(sidecar, engine, mapped_bytes=6 * GiB)
    code, out = kvctl(sidecar, "watch", "--once")
    assert code == 0
    row = next(line for line in out.splitlines() if "llama-a" in line)
    assert "deferred" in row and "6GiB" in row and "4GiB" in row and "█" in row


def test_socket_mode_talks_to_the_engine_directly(tmp_path: Path) -> None:
    with SocketEngine(
        tmp_path / "direct.sock", mapped_bytes=2 * GiB, device_total_bytes=8 * GiB
    ) as engine:
        sock = str(engine.socket_path)
        result = runner.invoke(app, ["--socket", sock, "limit", "any", "1G", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["status"] == "deferred"
        assert engine.mailbox.desired.limit_bytes == GiB
        engine.engine_pass(mapped_bytes=GiB)
        result = runner.invoke(app, ["--socket", sock, "status", "any", "--wait", "5"])
        assert result.exit_code == 0 and "engine: applied" in result.output
        result = runner.invoke(app, ["--socket", sock, "list"])
        assert result.exit_code == 2 and "needs the sidecar" in result.output
    result = runner.invoke(app, ["--socket", sock, "status", "any"])
    assert result.exit_code == 4 and "cannot reach the engine control socket" in result.output


def test_socket_mode_ignores_the_sidecar_url_setting(tmp_path: Path) -> None:
    """A KVSIDECAR_URL kvctl could not use (meant for another tool) refused every
    ``--socket`` command, which asks no sidecar."""
    with SocketEngine(tmp_path / "d.sock", mapped_bytes=GiB, device_total_bytes=8 * GiB) as eng:
        args = ["--socket", str(eng.socket_path), "status", "any"]
        result = runner.invoke(app, args, env={"KVSIDECAR_URL": "ftp://elsewhere"})
        assert result.exit_code == 0 and "engine: " in result.output, result.output
        result = runner.invoke(app, ["--url", "ftp://x", *args])
        assert result.exit_code == 2 and "cannot be used" in result.output


def test_real_process_exit_codes_and_no_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSIDECAR_URL": "http://127.0.0.1:9"}
    for args, code in ((["limit", "a", "-1G"], 2), (["list"], 4), (["limit"], 2)):
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar.kvctl", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == code, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_a_sidecar_host_that_hangs_in_the_resolver_is_given_up_in_time(tmp_path: Path) -> None:
    """A DNS server that does not answer: resolving --url's host comes before httpx's
    timeouts and has none of its own, so kvctl waited for the resolver's retries (30 s
    here, a cron job's whole slot in general). It gives up within its documented bound
    (twice the 5 s connect timeout) with one line and exit 4. The slowdns shim hangs
    getaddrinfo() for one name in the kvctl process only."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LD_PRELOAD": str(preload.build("slowdns", tmp_path)),
        "KVS_SLOW_DNS_HOST": "kvs-hangs.invalid",
        "KVS_SLOW_DNS_S": "30",
    }
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.kvctl", "--url", "kvs-hangs.invalid:8570", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 4, proc.stderr
    assert took < 20, took
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does the host name resolve" in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("module", "args", "says", "see"),
    [
        ("sidecar.kvctl", ["set", "a", "1G"], "No such command 'set'", "kvctl --help"),
        ("sidecar.kvctl", ["limit"], "Missing argument", "kvctl limit --help"),
        ("sidecar.kvctl", ["limit", "a", "1G", "--wait", "x"], "'--wait'", "kvctl limit --help"),
        ("sidecar.kvctl", ["list", "--nope"], "No such option: --nope", "kvctl list --help"),
        ("sidecar.cli", ["serve", "--port", "x"], "'--port'", "kvsidecar serve --help"),
        ("sidecar.cli", ["serve", "--nope"], "No such option: --nope", "kvsidecar serve --help"),
    ],
)
def test_a_command_line_the_parser_refuses_is_one_line(
    module: str, args: list[str], says: str, see: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSIDECAR_URL": "http://127.0.0.1:9"}
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    prog = "kvctl" if module.endswith("kvctl") else "kvsidecar"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr  # not Typer's usage line and box
    assert lines[0].startswith(f"{prog}: ") and says in lines[0] and see in lines[0], lines
    assert proc.stdout == ""


def test_no_arguments_still_shows_the_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.kvctl"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "limit" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "bad",
    [
        "zzz/../llama-a",
        "llama-a?x",
        "llama-a#x",
        "../llama-a",
        "-llama",
        "x" * 64,
        "llama a",
        "llama-a/limit",
        "ll%61ma-a",
    ],
)
def test_ids_are_checked_before_any_request(
    sidecar: ThreadedSidecar, engine: SocketEngine, bad: str
) -> None:
    """Issue 14.3: ``kvctl limit zzz/../llama-a 1G`` used to set llama-a's limit."""
    assert kvctl(sidecar, "limit", "llama-a", "4G")[0] == 0
    before = kvctl(sidecar, "status", "llama-a", "--json")[1]
    for args in (
        ["limit", "--", bad, "1G"],
        ["status", "--", bad],
        ["delete", "--", bad],
        ["forget", "--", bad],
        ["limit-percent", "--", bad, "10"],
    ):
        code, out = kvctl(sidecar, *args)
        assert code == 2, (args, out)
        assert f"instance_id {bad!r} is not valid" in out and "Traceback" not in out
    after = kvctl(sidecar, "status", "llama-a", "--json")[1]
    assert json.loads(after)["desired"] == json.loads(before)["desired"]


def test_path_segments_are_encoded() -> None:
    from sidecar._kvctl_client import _path

    assert _path("llama-a.v2_1") == "/instances/llama-a.v2_1"
    assert _path("a/../b?x#y") == "/instances/a%2F..%2Fb%3Fx%23y"


def test_forget_drops_an_instance(sidecar: ThreadedSidecar) -> None:
    assert kvctl(sidecar, "limit", "lama-a", "4G")[0] == 0  # a typo
    code, out = kvctl(sidecar, "forget", "lama-a")
    assert code == 0 and "lama-a: forgotten" in out
    code, out = kvctl(sidecar, "status", "lama-a")
    assert code == 1 and "'lama-a' is not known" in out
    code, out = kvctl(sidecar, "forget", "lama-a")
    assert code == 1 and "'lama-a' is not known" in out
    code, out = kvctl(sidecar, "forget", "lama-a", token="wrong")
    assert code == 1 and "token is wrong" in out


def test_a_token_with_whitespace_from_the_environment_works(
    sidecar: ThreadedSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIDECAR_TOKEN", "tok\n")  # e.g. read from a file with a newline
    result = runner.invoke(app, ["--url", sidecar.url, "limit", "llama-b", "1G"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("bad", ["s3cr\u00e9t", "a b", "a\nb", "a\x01b"])
def test_a_token_that_cannot_be_sent_is_a_usage_error(
    sidecar: ThreadedSidecar, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """'é' in --token or KVSIDECAR_TOKEN ended in a UnicodeEncodeError traceback, a newline
    in 'cannot reach the sidecar' (exit 4): one line, exit 2, nothing sent."""
    assert kvctl(sidecar, "limit", "llama-a", "4G")[0] == 0
    before = httpx.get(f"{sidecar.url}/instances/llama-a").json()["desired"]
    code, out = kvctl(sidecar, "limit", "llama-a", "1G", token=bad)
    assert code == 2 and "must be printable ASCII" in out, out
    assert len(out.strip().splitlines()) == 1
    monkeypatch.setenv("KVSIDECAR_TOKEN", bad)
    result = runner.invoke(app, ["--url", sidecar.url, "limit", "llama-a", "1G"])
    assert result.exit_code == 2 and "must be printable ASCII" in result.output, result.output
    assert httpx.get(f"{sidecar.url}/instances/llama-a").json()["desired"] == before


@pytest.mark.parametrize(
    "url",
    [
        "127.0.0.1:abc",
        "localhost:8570x",
        "http://[::1",
        "http://:8570",
        "ftp://x",
        # these were taken and built into every request path or address
        "127.0.0.1:99999",  # a port out of range
        "127.0.0.1:0",
        "http://127.0.0.1:8570/kvs?x=1",  # GET /kvs?x=1/instances
        "http://127.0.0.1:8570#top",
        "http://side car:8570",
    ],
)
def test_a_malformed_url_is_a_usage_error(url: str) -> None:
    for how in ("flag", "env"):
        args = ["--url", url, "list"] if how == "flag" else ["list"]
        result = runner.invoke(app, args, env={"KVSIDECAR_URL": url})
        assert result.exit_code == 2, (how, result.output, result.exception)
        assert "KVSIDECAR_URL" in result.output and "cannot be used" in result.output


def test_a_server_that_is_not_kvsidecar_is_a_clear_error(tmp_path: Path) -> None:
    """A wrong port or a proxy's login page answers 200 with HTML: one line, exit 1."""

    class Html(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = b"<html><body>please log in</body></html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Html)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for args in (["list"], ["status", "a"], ["limit", "a", "1G"]):
            result = runner.invoke(app, ["--url", url, *args])
            assert result.exit_code == 1, (args, result.output, result.exception)
            assert "not JSON (text/html)" in result.output and "--url" in result.output
    finally:
        server.shutdown()
        server.server_close()


class _Answers(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``status`` and the class's ``body`` (not kvsidecar's)."""

    body = b"{}"
    status = 200
    kind = "application/json"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(self.status)
        self.send_header("content-type", self.kind)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_PUT = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _answering(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded HTTP server with ``handler`` on loopback; yields its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


_EVERY_COMMAND = (
    ["list"],
    ["list", "--json"],
    ["status", "a"],
    ["status", "a", "--wait", "1"],
    ["limit", "a", "1G"],
    ["limit", "a", "1G", "--json"],
    ["limit-percent", "a", "10"],
    ["delete", "a"],
    ["forget", "a"],
    ["watch", "--once"],
    ["watch", "--count", "1"],
    ["devices"],
    ["devices", "d"],
    ["budget", "d", "1G"],
    ["budget", "d", "none"],
    ["policy", "a", "--min", "1G"],
    ["device-limits", "d", "a=1G"],
)


@pytest.mark.parametrize(
    ("status", "kind", "body"),
    [
        (404, "text/html", b"<!DOCTYPE HTML>\n<html>\n<body>\n<h1>404</h1>\n</body>\n</html>\n"),
        (502, "text/html", b"<html><head><title>502 Bad Gateway</title></head></html>"),
        (501, "text/plain", b"Unsupported method\n('PUT')\n"),
        (500, "application/json", b'{"error": "upstream"}'),
        (503, "application/json", b"[1, 2]"),
        (400, "application/octet-stream", b""),
    ],
)
def test_an_error_answer_that_is_not_kvsidecars_is_one_line(
    status: int, kind: str, body: bytes
) -> None:
    """A wrong port or a proxy answering an error page: every command printed the page's raw
    lines (an HTML document across the terminal); now one line saying what answered and
    that it may not be kvsidecar, exit 1."""
    handler = type("Answers", (_Answers,), {"body": body, "status": status, "kind": kind})
    with _answering(handler) as url:
        for args in _EVERY_COMMAND:
            result = runner.invoke(app, ["--url", url, *args])
            assert result.exit_code == 1, (args, result.output, result.exception)
            assert len(result.output.strip().splitlines()) == 1, (args, result.output)
            assert f"HTTP {status}" in result.output, (args, result.output)
            assert "is that kvsidecar? Check --url/KVSIDECAR_URL" in result.output, (
                args,
                result.output,
            )
            assert "<h1>" not in result.output


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b"[1, 2]",
        b"null",
        b'"ok"',
        json.dumps({"instances": [{"id": "a"}], "devices": [{"id": "d"}]}).encode(),
        json.dumps({"instances": 5, "devices": 5}).encode(),
        json.dumps(
            {"id": "a", "status": "applied", "desired": {"limit_bytes": "x", "revision": 1}}
        ).encode(),
    ],
)
def test_json_that_is_not_a_kvsidecar_answer_is_one_line(body: bytes) -> None:
    """Another service's JSON (a proxy's error object, ``{}``) on the sidecar's port made
    every command but forget end in a KeyError/TypeError traceback (forget said
    'forgotten'): now one line naming the first field that does not fit, exit 1."""
    handler = type("Answers", (_Answers,), {"body": body})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for args in _EVERY_COMMAND:
            result = runner.invoke(app, ["--url", url, *args])
            assert result.exit_code == 1, (args, result.output, result.exception)
            assert isinstance(result.exception, SystemExit), (args, result.exception)
            assert len(result.output.strip().splitlines()) == 1, (args, result.output)
            assert "is that kvsidecar? Check --url/KVSIDECAR_URL" in result.output, args
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar.kvctl", "--url", url, "list"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("kvctl: ") and len(proc.stderr.splitlines()) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_an_engine_socket_answering_other_json_is_one_line(tmp_path: Path) -> None:
    """``--socket`` at a unix socket whose server answers JSON of another shape."""

    class UnixHttp(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    handler = type("Answers", (_Answers,), {"body": b'{"revision": "x"}'})
    path = tmp_path / "other.sock"
    server = UnixHttp(str(path), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        for args in (["status", "a"], ["status", "a", "--wait", "1"], ["limit", "a", "1G"]):
            result = runner.invoke(app, ["--socket", str(path), *args])
            assert result.exit_code == 1, (args, result.output, result.exception)
            assert isinstance(result.exception, SystemExit), (args, result.exception)
            assert "is not a kvsidecar EngineState" in result.output, result.output
            assert "Check --socket" in result.output
    finally:
        server.shutdown()
        server.server_close()


def test_sizes_are_read_exactly(sidecar: ThreadedSidecar) -> None:
    """'0.3' is not 0 bytes (which would drain the cache): a fraction of a byte is refused,
    as are other scripts' digits; a unit's fraction is exact."""
    for size in ("0.3", "1.5", "\u0661\u0662G", "9" * 400):
        code, out = kvctl(sidecar, "limit", "llama-a", size)
        assert code == 2, (size, out)
    assert kvctl(sidecar, "status", "llama-a")[0] == 1  # nothing was stored
    code, out = kvctl(sidecar, "limit", "llama-a", "1.5G", "--json")
    assert code == 0 and json.loads(out)["desired"]["limit_bytes"] == 3 * GiB // 2


@pytest.mark.parametrize("mode", ["flood", "drip"])
def test_an_answer_without_end_is_one_line_not_a_hang(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server sending an answer without end used to hold kvctl for ever (a byte now and
    then: httpx's timeout is per read) or fill its memory (a stream): now kvctl reads an
    answer within its time and size bounds and says so in one line, exit 4."""
    from sidecar import _kvctl_client

    monkeypatch.setattr(_kvctl_client, "_CONNECT_TIMEOUT_S", 0.5)  # total: 1 s
    monkeypatch.setattr(_kvctl_client, "MAX_ANSWER_BYTES", 4 << 20)
    server = EndlessServer(mode)
    try:
        url = server.url
        for args in (["list"], ["status", "a"], ["limit", "a", "1G"]):
            result = runner.invoke(app, ["--url", url, *args])
            assert result.exit_code == 4, (args, result.output, result.exception)
            assert len(result.output.strip().splitlines()) == 1, result.output
            reason = "AnswerTooLarge" if mode == "flood" else "ReadTimeout"
            assert f"cannot reach the sidecar at {url} ({reason}" in result.output, result.output
    finally:
        server.close()
