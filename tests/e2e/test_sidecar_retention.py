"""``KVSIDECAR_FORGET_AFTER_S``: instances whose engine is gone that long are forgotten.

Over real HTTP (uvicorn on loopback) against the real store. The ids of engines
that end for good (Kubernetes pod names) otherwise pile up: the instance cap
then refuses new engines, and the autopilot keeps each dead one's floor free.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
from support import wait_until
from support.clockshift import ClockShift
from support.soak import soak_seeds
from test_sidecar_support import SidecarProcess, ThreadedSidecar, db_rows

from engine_ext.protocol import REGISTRATION_HEADER
from sidecar import SidecarSettings

MiB = 1 << 20
TOKEN = "t" * 32


def _serve(db: Path, **kw: Any) -> ThreadedSidecar:
    return ThreadedSidecar(SidecarSettings(db_path=db, **kw))


def _register(c: httpx.Client, iid: str, **state: Any) -> httpx.Response:
    body = {
        "engine": "vllm",
        "engine_version": "0.33.0",
        "socket_path": f"/nonexistent/kvsidecar-{iid}.sock",
        "registration_token": TOKEN,
        "state": {"status": "applied", **state},
    }
    return c.post(f"/instances/{iid}/register", json=body)


def _report(c: httpx.Client, iid: str) -> httpx.Response:
    return c.post(
        f"/instances/{iid}/report", json={"status": "applied"}, headers={REGISTRATION_HEADER: TOKEN}
    )


def _deregister(c: httpx.Client, iid: str) -> None:
    r = c.post(f"/instances/{iid}/deregister", headers={REGISTRATION_HEADER: TOKEN})
    assert r.status_code == 200 and r.json()["status"] == "stopped", r.text


def _ids(c: httpx.Client) -> set[str]:
    return {view["id"] for view in c.get("/instances").json()["instances"]}


def _db_ids(db: Path) -> set[str]:
    return {row[0] for row in db_rows(db)}


def _forgotten_total(c: httpx.Client) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("kvsidecar_retention_forgotten_total "):
            return float(line.split()[1])
    raise AssertionError("no kvsidecar_retention_forgotten_total in /metrics")


class _Heartbeat:
    """An engine that keeps reporting (a live one) from a thread of its own."""

    def __init__(self, url: str, iid: str) -> None:
        self.url, self.iid = url, iid
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while not self.stop.wait(0.1):
                r = _report(c, self.iid)
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text}")

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_gone_engines_are_forgotten_and_the_rest_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvsidecar.audit")
    db = tmp_path / "sidecar.db"
    with (
        _serve(db, forget_after_s=1, heartbeat_timeout_s=0.5) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        for iid in ("stopped", "silent", "live"):
            assert _register(c, iid).status_code == 200
        # a limit set ahead of its engine (never registered): kept however long it waits
        assert c.put("/instances/ahead/limit", json={"limit": "8M"}).status_code == 200
        with _Heartbeat(server.url, "live") as live:
            _deregister(c, "stopped")
            # "silent" never reports again: unreachable after 0.5 s, gone 1 s after that
            t0 = time.monotonic()
            wait_until(lambda: "stopped" not in _ids(c), timeout_s=10, what="stopped forgotten")
            assert "silent" in _ids(c)  # not yet: 1 s after its timeout, not after its stop
            wait_until(lambda: "silent" not in _ids(c), timeout_s=10, what="silent forgotten")
            took = time.monotonic() - t0
            time.sleep(1.5)  # several more sweeps
            assert _ids(c) == {"live", "ahead"}
            assert live.failures == []
        assert took >= 1.4, took  # the silent one: heartbeat timeout + forget_after
        assert _db_ids(db) == {"live", "ahead"}  # gone from the store too, not only the view
        assert c.get("/instances/stopped").status_code == 404
        assert _forgotten_total(c) == 2
        assert 'kv_instance="stopped"' not in c.get("/metrics").text
        # a forgotten engine that comes back registers afresh, as after kvctl forget
        assert _register(c, "silent").status_code == 200
        assert c.get("/instances/silent").json()["status"] == "applied"
    audit = [r.getMessage() for r in caplog.records if r.getMessage().startswith("forget ")]
    assert any("forget stopped" in m and "by retention" in m for m in audit), audit


def test_a_full_instance_table_takes_new_engines_again_once_the_dead_are_forgotten(
    tmp_path: Path,
) -> None:
    """The production failure: pod names as ids, a cap of 3, three pods replaced. Without
    retention the fourth pod is refused for good; with it, once the dead are forgotten."""
    for forget_after_s in (0, 1):
        db = tmp_path / f"cap-{forget_after_s}.db"
        with (
            _serve(
                db, forget_after_s=forget_after_s, max_instances=3, heartbeat_timeout_s=0.5
            ) as server,
            httpx.Client(base_url=server.url, timeout=30) as c,
        ):
            for n in range(3):
                assert _register(c, f"pod-{n}").status_code == 200
                _deregister(c, f"pod-{n}")
            refused = _register(c, "pod-new")
            assert refused.status_code == 409 and "KVSIDECAR_MAX_INSTANCES" in refused.text
            time.sleep(2.5)
            again = _register(c, "pod-new")
            if forget_after_s:
                assert again.status_code == 200, again.text
                assert _ids(c) == {"pod-new"}
            else:  # the default: kept for their return, as before
                assert again.status_code == 409
                assert _ids(c) == {"pod-0", "pod-1", "pod-2"}


def test_a_stop_before_a_restart_of_the_sidecar_counts(tmp_path: Path) -> None:
    """``stopped_at`` is durable: time spent while the sidecar was down counts. An engine
    that was unreachable at the restart gets the full time again (its last report is not
    stored: the clock starts at start-up)."""
    db = tmp_path / "sidecar.db"
    with _serve(db) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        for iid in ("stopped", "silent"):
            assert _register(c, iid).status_code == 200
        _deregister(c, "stopped")
    time.sleep(1.2)
    with (
        _serve(db, forget_after_s=1, heartbeat_timeout_s=1) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        t0 = time.monotonic()
        wait_until(lambda: "stopped" not in _ids(c), timeout_s=10, what="stopped forgotten")
        assert time.monotonic() - t0 < 1.0  # at the first sweep (0.25 s), not 1 s later
        assert "silent" in _ids(c)
        wait_until(lambda: "silent" not in _ids(c), timeout_s=10, what="silent forgotten")
        assert time.monotonic() - t0 >= 1.9


def test_the_shim_steps_the_wall_clock_of_its_process_only(tmp_path: Path) -> None:
    """What the next test relies on: the shim moves ``time.time()`` in the process it is
    loaded in, at once, both ways, and leaves the monotonic clock alone."""
    shift = ClockShift(tmp_path)
    probe = (
        "import time, sys\n"
        "print(time.time(), time.monotonic(), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(time.time(), time.monotonic(), flush=True)\n"
    )
    env = {**os.environ, **shift.env}
    with subprocess.Popen(
        [sys.executable, "-c", probe], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        wall0, mono0 = map(float, proc.stdout.readline().split())
        assert abs(wall0 - time.time()) < 5
        shift.set(-_DAY_S)
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        wall1, mono1 = map(float, proc.stdout.readline().split())
    assert abs(wall1 - (time.time() - _DAY_S)) < 5
    assert 0 <= mono1 - mono0 < 5


_DAY_S = 86_400.0


@pytest.mark.parametrize("step_s", [_DAY_S, -_DAY_S])
def test_a_step_of_the_wall_clock_neither_forgets_early_nor_holds_back(
    tmp_path: Path, step_s: float
) -> None:
    """NTP stepping the clock, or a VM resumed, while engines are stopped: with the wall
    clock a day ahead every stopped instance was forgotten at the next sweep (its stop
    looked a day old); a day behind, none for a day. The stop is counted on the
    monotonic clock while the sidecar runs. A real ``kvsidecar serve`` whose wall clock
    (only its own) the shim steps."""
    shift = ClockShift(tmp_path)
    env = {**shift.env, "KVSIDECAR_FORGET_AFTER_S": "4", "KVSIDECAR_LOG_LEVEL": "warning"}
    server = SidecarProcess(tmp_path / "sidecar.db", env).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert _register(c, "stopped").status_code == 200
            _deregister(c, "stopped")
            t0 = time.monotonic()
            stopped_at = c.get("/instances/stopped").json()["engine"]["stopped_at"]
            assert abs(stopped_at - time.time()) < 5  # no shift yet
            shift.set(step_s)
            # the sidecar's own clock moved (the views it writes now say so)
            assert _register(c, "witness").status_code == 200
            seen = c.get("/instances/witness").json()["engine"]["registered_at"]
            assert abs(seen - (time.time() + step_s)) < 5
            time.sleep(2.5)  # two or three sweeps (every 1 s) after the step
            assert "stopped" in _ids(c)  # a day ahead: was forgotten here
            wait_until(lambda: "stopped" not in _ids(c), timeout_s=10, what="stopped forgotten")
            took = time.monotonic() - t0  # a day behind: was not forgotten here
            assert 3.9 <= took < 8.0, took
            assert _ids(c) == {"witness"}
    finally:
        server.stop()


@pytest.mark.parametrize("value", ["0.5", "-1", "inf", "nan", "1e12", "soon"])
def test_bad_forget_after_values_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVSIDECAR_FORGET_AFTER_S", value)
    with pytest.raises(ValueError, match="forget_after_s"):
        SidecarSettings()


_FORGET_AFTER_S = 1.0
_HEARTBEAT_TIMEOUT_S = 0.5
_SLACK_S = 0.05  # the client's clock is read around its requests, not inside the sidecar


class _Engine:
    """One id driven at random by one thread: register, report, deregister, fall silent.

    Records, from the client's side, when the sidecar last heard from it and whether it
    deregistered, so a forget can be checked against the earliest time it was allowed."""

    def __init__(self, iid: str) -> None:
        self.iid = iid
        self.registered = False
        self.heard_at = 0.0  # monotonic: the start of the last request the sidecar took
        self.stopped_at: float | None = None  # monotonic: when its deregistration was answered
        self.early: list[str] = []  # forgets before they were allowed

    def act(self, c: httpx.Client, rng: random.Random) -> None:
        if not self.registered:
            sent = time.monotonic()
            r = _register(c, self.iid)
            assert r.status_code == 200, r.text
            self.registered, self.heard_at, self.stopped_at = True, sent, None
            return
        roll = rng.random()
        if roll < 0.15:
            sent = time.monotonic()
            _deregister(c, self.iid)
            self.registered, self.heard_at, self.stopped_at = False, sent, time.monotonic()
            self._after_stop(c, rng)
        elif roll < 0.35:  # fall silent: often past the heartbeat timeout, sometimes past both
            self._check_report(c, pause=rng.choice((0.2, 0.7, 1.2, 1.8, 2.5)))
        else:
            self._check_report(c, pause=rng.uniform(0.0, 0.2))

    def _after_stop(self, c: httpx.Client, rng: random.Random) -> None:
        """Stay stopped a while, then see whether the id is still known."""
        time.sleep(rng.choice((0.3, 0.9, 1.4, 2.2)))
        asked = time.monotonic()
        known = c.get(f"/instances/{self.iid}").status_code == 200
        assert self.stopped_at is not None
        if not known and asked - self.stopped_at < _FORGET_AFTER_S - _SLACK_S:
            self.early.append(f"stopped {asked - self.stopped_at:.2f}s ago and forgotten")

    def _check_report(self, c: httpx.Client, pause: float) -> None:
        time.sleep(pause)
        sent = time.monotonic()
        r = _report(c, self.iid)
        if r.status_code == 200:
            self.heard_at = sent
            return
        assert r.status_code == 404, r.text  # forgotten: allowed only after both times ran out
        silent = sent - self.heard_at
        if silent < _HEARTBEAT_TIMEOUT_S + _FORGET_AFTER_S - _SLACK_S:
            self.early.append(f"silent {silent:.2f}s and forgotten")
        self.registered = False  # an engine registers again after a 404


@pytest.mark.parametrize("seed", soak_seeds() or range(2))
def test_live_engines_are_never_forgotten_under_random_timing(tmp_path: Path, seed: int) -> None:
    """Threads register, report, deregister and fall silent at random against a sidecar
    that forgets after 1 s; one id per thread. No id is forgotten before its engine was
    gone the full time (checked from each client's own clock), every report of a live
    engine is taken, and once all stop, every id goes within the time plus two sweeps."""
    db = tmp_path / "sidecar.db"
    rng = random.Random(seed)
    engines = [_Engine(f"e{n}") for n in range(4)]
    deadline = time.monotonic() + 8.0
    errors: list[BaseException] = []

    def drive(engine: _Engine, thread_seed: int) -> None:
        local = random.Random(thread_seed)
        try:
            with httpx.Client(base_url=server.url, timeout=10) as c:
                while time.monotonic() < deadline:
                    engine.act(c, local)
        except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
            errors.append(exc)

    with (
        _serve(
            db, forget_after_s=_FORGET_AFTER_S, heartbeat_timeout_s=_HEARTBEAT_TIMEOUT_S
        ) as server,
        httpx.Client(base_url=server.url, timeout=30) as c,
    ):
        assert c.put("/instances/ahead/limit", json={"limit": "8M"}).status_code == 200
        threads = [
            threading.Thread(target=drive, args=(e, rng.randrange(1 << 30)), daemon=True)
            for e in engines
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [], errors
        early = [f"{e.iid}: {m}" for e in engines for m in e.early]
        assert early == [], early
        forgotten = _forgotten_total(c)
        assert forgotten >= 1, "the run forgot nothing: it tested nothing"
        # all quiet now: each id goes within its time plus two sweeps (0.25 s each)
        bound = _HEARTBEAT_TIMEOUT_S + _FORGET_AFTER_S + 2 * 0.25 + 0.5
        time.sleep(bound)
        assert _ids(c) == {"ahead"}
        assert _db_ids(db) == {"ahead"}
