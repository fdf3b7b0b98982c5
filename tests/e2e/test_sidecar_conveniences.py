"""Operator conveniences over real HTTP: version/build info, autoscaler metrics, audit and
JSON logs, a falling log rate for dead sockets, kvctl --version and --url host:port."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_sidecar_support import ROOT, SidecarProcess, SocketEngine, ThreadedSidecar
from typer.testing import CliRunner

from sidecar import SidecarSettings
from sidecar.kvctl import app as kvctl_app

GiB = 1 << 30
MiB = 1 << 20
runner = CliRunner()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[ThreadedSidecar]:
    with ThreadedSidecar(SidecarSettings(db_path=tmp_path / "s.db", max_wait_s=10)) as server:
        yield server


@pytest.fixture
def client(sidecar: ThreadedSidecar) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sidecar.url, timeout=30) as c:
        yield c


def _samples(text: str, name: str) -> dict[str, float]:
    """``{'label="v",...': value}`` of every sample of metric ``name``."""
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_healthz_and_metrics_carry_the_version(client: httpx.Client) -> None:
    body = client.get("/healthz").json()
    assert body["status"] == "ok"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", body["version"])
    assert body["build"]["version"] == body["version"] and body["build"]["python"]
    info = _samples(client.get("/metrics").text, "kvsidecar_build_info")
    assert len(info) == 1
    ((labels, value),) = info.items()
    assert value == 1.0 and f'version="{body["version"]}"' in labels
    assert client.get("/openapi.json").json()["info"]["version"] == body["version"]


def test_cli_version_flags() -> None:
    for module, name in (("sidecar.cli", "kvsidecar"), ("sidecar.kvctl", "kvctl")):
        proc = subprocess.run(
            [sys.executable, "-m", module, "--version"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert re.match(rf"{name} \d+\.\d+\.\d+", proc.stdout), proc.stdout


def test_kvctl_url_without_a_scheme(sidecar: ThreadedSidecar) -> None:
    hostport = sidecar.url.removeprefix("http://")
    result = runner.invoke(kvctl_app, ["--url", hostport, "limit", "a", "1G"])
    assert result.exit_code == 0, result.output
    assert "limit 1GiB rev 1" in result.output
    for bad in ("ftp://h:1", "http://", "://x"):
        result = runner.invoke(kvctl_app, ["--url", bad, "list"])
        assert result.exit_code == 2 and "--url" in result.output, (bad, result.output)


def test_metrics_for_autoscalers(client: httpx.Client, tmp_path: Path) -> None:
    client.put("/instances/typo/limit", json={"limit": "1G"})  # never registers
    with SocketEngine(
        tmp_path / "e.sock", mapped_bytes=6 * GiB, device_total_bytes=80 * GiB
    ) as engine:
        body = engine.register_body()
        body["state"].update(evictable_bytes=2 * GiB, pinned_bytes=GiB, capacity_bytes=40 * GiB)
        assert client.post("/instances/llama-a/register", json=body).status_code == 200
        # the limit below what is mapped: the engine answers deferred (evicting)
        r = client.put("/instances/llama-a/limit", json={"limit": "4G"})
        assert r.status_code == 200
        assert engine.mailbox.pushed.wait(10), "the sidecar never pushed the limit"
        # passes=1: ordered after the push's own answer (passes 0), whenever that lands
        state = engine.engine_pass().model_copy(update={"passes": 1})
        assert state.status.value == "deferred"
        assert (
            client.post(
                "/instances/llama-a/report",
                content=state.model_dump_json(),
                headers={"content-type": "application/json"},
            ).status_code
            == 200
        )
        text = client.get("/metrics").text
        assert not re.search(
            r'[{,]instance="', text
        )  # Prometheus' own target label is never exported
        mapped = _samples(text, "kvsidecar_mapped_bytes")
        assert mapped == {'kv_instance="llama-a"': 6 * GiB}  # no 0 for the typo'd id
        assert _samples(text, "kvsidecar_device_total_bytes") == {'kv_instance="llama-a"': 80 * GiB}
        assert _samples(text, "kvsidecar_capacity_bytes") == {'kv_instance="llama-a"': 80 * GiB}
        assert set(_samples(text, "kvsidecar_evictable_bytes")) == {'kv_instance="llama-a"'}
        assert set(_samples(text, "kvsidecar_pinned_bytes")) == {'kv_instance="llama-a"'}
        assert _samples(text, "kvsidecar_deferred") == {
            'kv_instance="llama-a",reason="evicting"': 1.0
        }
        stamps = _samples(text, "kvsidecar_last_report_timestamp_seconds")
        assert set(stamps) == {'kv_instance="llama-a"'}
        assert abs(stamps['kv_instance="llama-a"'] - time.time()) < 60
        assert _samples(text, "kvsidecar_desired_limit_bytes")['kv_instance="typo"'] == GiB
        applied_before = _samples(text, "kvsidecar_apply_seconds_count")
        assert applied_before == {}  # unlabelled histogram: no labelled samples
        assert "kvsidecar_apply_seconds_count 0.0" in text
        # the engine evicts down to the limit: PUT -> applied is timed once
        state = engine.engine_pass(mapped_bytes=3 * GiB).model_copy(update={"passes": 2})
        client.post(
            "/instances/llama-a/report",
            content=state.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        client.post(
            "/instances/llama-a/report",
            content=state.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        text = client.get("/metrics").text
        assert "kvsidecar_apply_seconds_count 1.0" in text
        assert _samples(text, "kvsidecar_deferred") == {}


def test_one_audit_line_per_limit_change(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvsidecar.audit")
    client.put("/instances/a/limit", json={"limit": "1M"})
    client.put("/instances/a/limit", json={"limit": "1M", "revision": 1})  # repeat: no change
    client.put("/instances/a/limit", json={"limit": "2M", "revision": 7})
    client.put("/instances/a/limit", json={"limit": "3M", "revision": 2})  # stale: refused
    client.delete("/instances/a/limit")
    audits = [r for r in caplog.records if r.name == "kvsidecar.audit"]
    got = [
        (f["old_limit_bytes"], f["new_limit_bytes"], f["old_revision"], f["revision"])
        for f in (r.fields for r in audits)
    ]  # type: ignore[attr-defined]
    assert got == [(None, MiB, 0, 1), (MiB, 2 * MiB, 1, 7), (2 * MiB, None, 7, 8)]
    assert [r.fields["source"].split()[0] for r in audits] == ["PUT", "PUT", "DELETE"]  # type: ignore[attr-defined]
    assert all("127.0.0.1" in r.fields["source"] for r in audits)  # type: ignore[attr-defined]


def test_forget_and_deregister_write_audit_lines(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvsidecar.audit")
    client.put("/instances/typo/limit", json={"limit": "1M"})
    assert client.delete("/instances/typo").status_code == 204
    body = {"engine": "vllm", "engine_version": "0", "state": {"status": "applied"}}
    assert client.post("/instances/b/register", json=body).status_code == 200
    client.put("/instances/b/limit", json={"limit": "2M", "revision": 4})
    assert client.post("/instances/b/deregister").json()["status"] == "stopped"
    fields = [
        r.fields
        for r in caplog.records  # type: ignore[attr-defined]
        if r.name == "kvsidecar.audit"
    ]
    assert [(f["event"], f["instance"]) for f in fields] == [
        ("limit_change", "typo"),
        ("forget", "typo"),
        ("limit_change", "b"),
        ("deregister", "b"),
    ]
    forget, deregister = fields[1], fields[3]
    assert (forget["old_limit_bytes"], forget["old_revision"]) == (MiB, 1)
    assert forget["source"].startswith("DELETE from 127.0.0.1")
    assert (deregister["limit_bytes"], deregister["revision"], deregister["source"]) == (
        2 * MiB,
        4,
        "engine",
    )


def test_forget_drops_every_series_of_the_instance(tmp_path: Path) -> None:
    """The new gauges, the deferred reason and the push-failure counter go with the id."""
    settings = SidecarSettings(
        db_path=tmp_path / "s.db", push_backoff_initial_s=0.001, push_backoff_max_s=0.004
    )
    with ThreadedSidecar(settings) as server, httpx.Client(base_url=server.url) as c:
        body = {
            "engine": "vllm",
            "engine_version": "0",
            "state": {
                "status": "deferred",
                "reason": "evicting",
                "mapped_bytes": 2 * GiB,
                "capacity_bytes": 4 * GiB,
                "evictable_bytes": GiB,
                "pinned_bytes": MiB,
                "overage_bytes": GiB,
                "revision": 1,
                "limit_bytes": GiB,
                "effective_limit_bytes": GiB,
            },
            "socket_path": str(tmp_path / "nobody-listens.sock"),
            "device_total_bytes": 80 * GiB,
        }
        r = c.post("/instances/gone/register", json=body)
        assert r.status_code == 200, r.text
        c.put("/instances/gone/limit", json={"limit": "1G", "revision": 2})
        c.put("/instances/kept/limit", json={"limit": "1G"})
        deadline = time.monotonic() + 30
        while not _samples(c.get("/metrics").text, "kvsidecar_push_failures_total"):
            assert time.monotonic() < deadline, "the push never failed"
            time.sleep(0.05)
        before = c.get("/metrics").text
        for name in (
            "kvsidecar_mapped_bytes",
            "kvsidecar_capacity_bytes",
            "kvsidecar_evictable_bytes",
            "kvsidecar_pinned_bytes",
            "kvsidecar_device_total_bytes",
            "kvsidecar_last_report_timestamp_seconds",
            "kvsidecar_desired_limit_bytes",
            "kvsidecar_instance_status",
        ):
            assert any('kv_instance="gone"' in k for k in _samples(before, name)), name
        assert c.delete("/instances/gone").status_code == 204
        time.sleep(0.2)  # a push attempt in flight when it was forgotten has ended
        after = c.get("/metrics").text
        assert 'kv_instance="gone"' not in after
        assert 'kv_instance="kept"' in after


def test_a_dead_socket_is_logged_at_a_falling_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = SidecarSettings(
        db_path=tmp_path / "s.db", push_backoff_initial_s=0.001, push_backoff_max_s=0.004
    )
    caplog.set_level(logging.WARNING, logger="kvsidecar.push")
    with ThreadedSidecar(settings) as server, httpx.Client(base_url=server.url) as c:
        body = {
            "engine": "vllm",
            "engine_version": "0",
            "state": {"status": "applied"},
            "socket_path": str(tmp_path / "nobody-listens.sock"),
        }
        assert c.post("/instances/gone/register", json=body).status_code == 200
        c.put("/instances/gone/limit", json={"limit": "1G"})
        failures = 0.0
        deadline = time.monotonic() + 30
        while failures < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
            failures = sum(
                _samples(c.get("/metrics").text, "kvsidecar_push_failures_total").values()
            )
    assert failures >= 40
    lines = [r for r in caplog.records if r.name == "kvsidecar.push"]
    # logged at failures 1, 2, 4, 8, ...: about log2(n) + 1 lines, not n
    assert 1 <= len(lines) <= int(failures).bit_length() + 2, (len(lines), failures)
    assert "nobody-listens.sock" in lines[0].getMessage()


def test_serve_json_logs_are_one_format_for_uvicorn_and_ours(tmp_path: Path) -> None:
    proc = SidecarProcess(tmp_path / "s.db", env={"KVSIDECAR_LOG_FORMAT": "json"}).start()
    try:
        httpx.put(f"{proc.url}/instances/a/limit", json={"limit": "1G"})
    finally:
        proc.stop()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert any(r["logger"].startswith("uvicorn") for r in records)
    audit = [r for r in records if r.get("event") == "limit_change"]
    assert len(audit) == 1
    assert (audit[0]["instance"], audit[0]["new_limit_bytes"], audit[0]["revision"]) == (
        "a",
        GiB,
        1,
    )


def test_serve_keeps_its_read_timeouts_under_json_logs(tmp_path: Path) -> None:
    """``kvsidecar serve`` runs the guarded server (timeouts, cap) AND logs in one format."""
    proc = SidecarProcess(
        tmp_path / "s.db", env={"KVSIDECAR_LOG_FORMAT": "json", "KVSIDECAR_HEADER_TIMEOUT_S": "0.5"}
    ).start()
    try:
        sock = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
        sock.sendall(b"PUT /instances/a/limit HTTP/1.1\r\nHost: x\r\n")  # never ends
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert httpx.get(f"{proc.url}/instances").json() == {"instances": []}
    finally:
        proc.stop()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert any(
        r["logger"] == "kvsidecar.http" and "did not arrive in time" in r["msg"] for r in records
    )


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--log-format", "xml"], {}, "KVSIDECAR_LOG_FORMAT"),
        ([], {"KVSIDECAR_LOG_LEVEL": "bogus"}, "KVSIDECAR_LOG_LEVEL"),
    ],
)
def test_serve_refuses_an_unknown_log_format_or_level(
    tmp_path: Path, args: list[str], env: dict[str, str], named: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "serve", "--db", str(tmp_path / "s.db"), *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_kvctl_watch_writes_flushed_lines_to_a_pipe(sidecar: ThreadedSidecar) -> None:
    httpx.put(f"{sidecar.url}/instances/llama-a/limit", json={"limit": "4G"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar.kvctl", "--url", sidecar.url, "watch", "--interval", "0.2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # arrives while kvctl still runs: it was flushed
        httpx.put(f"{sidecar.url}/instances/llama-a/limit", json={"limit": "2G"})
        later = [proc.stdout.readline() for _ in range(10)]
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.communicate(timeout=20)  # reads and closes both pipes
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ llama-a: pending .*limit 4GiB rev 1.*\n", first
    ), first
    assert any("limit 2GiB rev 2" in line for line in later), later
    assert not any("\x1b" in line or "│" in line for line in [first, *later])  # no screen


def test_kvctl_watch_count_stops(sidecar: ThreadedSidecar) -> None:
    result = runner.invoke(
        kvctl_app, ["--url", sidecar.url, "watch", "--interval", "0.1", "--count", "2"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("(no instances)") == 2


def _read_events(resp: httpx.Response, n: int) -> list[dict[str, str]]:
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in resp.iter_lines():
        if not line:
            if "data" in current:
                events.append(current)
                if len(events) == n:
                    return events
            current = {}
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        current[key] = value.removeprefix(" ")
    return events


def test_instances_watch_streams_server_sent_events(sidecar: ThreadedSidecar) -> None:
    with httpx.Client(base_url=sidecar.url, timeout=30) as c:
        c.put("/instances/a/limit", json={"limit": "1G"})
        with c.stream("GET", "/instances", params={"watch": 1}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            changes = threading.Thread(
                target=lambda: (
                    time.sleep(0.5),
                    httpx.put(f"{sidecar.url}/instances/b/limit", json={"limit": "2G"}),
                )
            )
            changes.start()
            events = _read_events(resp, 2)
            changes.join()
    assert [e["event"] for e in events] == ["instances", "instances"]
    assert [e["id"] for e in events] == ["1", "2"]
    first, second = (json.loads(e["data"])["instances"] for e in events)
    assert [v["id"] for v in first] == ["a"]
    assert [v["id"] for v in second] == ["a", "b"] and second[1]["desired"]["revision"] == 1


def test_instances_watch_ends_at_the_wait_cap(tmp_path: Path) -> None:
    settings = SidecarSettings(db_path=tmp_path / "s.db", max_wait_s=0.5)
    with ThreadedSidecar(settings) as server, httpx.Client(base_url=server.url) as c:
        r = c.get("/instances", params={"watch": "true"}, timeout=20)  # returns: stream ended
        assert r.status_code == 200 and r.text.startswith("retry: ")
        assert r.text.count("event: instances") == 1
        assert c.get("/instances", params={"watch": "sometimes"}).status_code == 422


def test_docs_work_offline(client: httpx.Client) -> None:
    """/docs and /redoc reference only this server (no CDN); every asset they name is served."""
    for page_path, marker, count in (("/docs", "SwaggerUIBundle", 3), ("/redoc", "<redoc", 2)):
        page = client.get(page_path)
        assert page.status_code == 200 and marker in page.text
        assert "http://" not in page.text and "https://" not in page.text, page_path
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert len(assets) == count, assets
        assert all(a.startswith("/docs-assets/") for a in assets), assets
        for asset in assets:
            r = client.get(asset)
            assert r.status_code == 200 and len(r.content) > 1000, asset
        assert "/openapi.json" in page.text
    js = client.get("/docs-assets/swagger-ui-bundle.js")
    assert "javascript" in js.headers["content-type"] and len(js.content) > 500_000
    # Swagger UI 5: 4.x cannot render the OpenAPI 3.1 document FastAPI serves
    assert client.get("/openapi.json").json()["openapi"].startswith("3.1")


def test_sigterm_cuts_open_event_streams_after_the_grace(tmp_path: Path) -> None:
    """A connected dashboard must not keep ``kvsidecar serve`` up for KVSIDECAR_MAX_WAIT_S."""
    proc = SidecarProcess(tmp_path / "s.db", env={"KVSIDECAR_SHUTDOWN_GRACE_S": "1"}).start()
    ended = threading.Event()

    def follow() -> None:
        try:
            with httpx.stream(
                "GET", f"{proc.url}/instances", params={"watch": 1}, timeout=400
            ) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass
        ended.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while not _samples(httpx.get(f"{proc.url}/metrics").text, "kvsidecar_build_info"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # the stream is open (its first event went out at once)
    assert proc.proc is not None
    proc.proc.terminate()
    try:
        code = proc.proc.wait(timeout=60)  # the stream alone would last 300 s
    finally:
        proc.stop()
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught on its way out
    assert ended.wait(10)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.slow
def test_docs_pages_render_in_a_browser(sidecar: ThreadedSidecar, tmp_path: Path) -> None:
    """Headless Chromium (where installed: apt-get install chromium) renders both pages
    from this server alone (the machine reaches no CDN)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium installed (apt-get install chromium)")
    for page, expected in (("/docs", "Every known instance"), ("/redoc", "Every known instance")):
        proc = subprocess.run(
            [
                browser,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-zygote",
                f"--user-data-dir={tmp_path / page.strip('/')}",
                "--virtual-time-budget=8000",
                "--dump-dom",
                sidecar.url + page,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert expected in proc.stdout, (page, proc.stdout[-2000:])
        assert "Unable to render this definition" not in proc.stdout
