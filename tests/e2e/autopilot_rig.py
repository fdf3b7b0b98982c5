"""The autopilot's e2e rig on real engines (no tests here; test_autopilot_vllm_serve.py).

* :class:`Rig` -- ``kvsidecar serve`` as a child process (restartable on its
  port, ``kill -9``-able) and CPU-harness ``vllm serve`` engines on one
  budgeted host device, each with the output reservation on;
* :class:`Watch` -- a thread sampling, as fast as it can, the sidecar's device
  view (one atomic snapshot of every member), the engines' own state over
  their control sockets and their KV memory from ``/proc``;
* :class:`Load` -- requests to one engine from a few threads until stopped.

The engines are started once per module (about 30 s of CPU each); every
scenario begins from the idle split (:meth:`Rig.settle`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import psutil  # type: ignore[import-untyped]
from support import wait_until
from support.control import ControlSocket
from test_sidecar_support import SidecarProcess

from engine_ext.cpu_harness import VllmServer, free_port, launch_vllm_server, make_document
from sidecar.demo._autopilot import _memfd_paths as memfd_paths  # the demo's /proc sampler

MiB = 1 << 20
DEVICE = "ap-host"
BUDGET = 8 * MiB
HEARTBEAT_TIMEOUT_S = 15  # a frozen engine is thawed well before; a killed one waits this long
BUSY_HOLD_S = 0.5
STUB_KV_MEMFD = VllmServer.kv_memfd_name

SIDECAR_ENV = {
    "KVSIDECAR_AUTOPILOT_INTERVAL_S": "0.1",
    "KVSIDECAR_AUTOPILOT_BUSY_HOLD_S": str(BUSY_HOLD_S),
    "KVSIDECAR_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
    "KVSIDECAR_PUSH_BACKOFF_MAX_S": "0.5",  # a thawed engine gets its limit soon
    "KVSIDECAR_LOG_FORMAT": "json",
    "KVSIDECAR_TOKEN": "",
}


@dataclass
class Engine(ControlSocket):
    """One ``vllm serve`` (API server + EngineCore, one process group)."""

    name: str
    server: VllmServer
    socket_path: Path
    model: str

    def complete(self, client: httpx.Client, prompt: str, max_tokens: int) -> None:
        reply = client.post(
            self.server.base_url + "/v1/completions",
            json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens},
        )
        if reply.status_code != 200:
            raise RuntimeError(f"{self.name}: {reply.status_code} {reply.text[:300]}")

    _inodes: set[tuple[int, int]] | None = field(default=None, init=False, repr=False)

    def memfd_inodes(self) -> set[tuple[int, int]]:
        """(st_dev, st_ino) of its KV memfd(s), found once from its process tree."""
        if not self._inodes:
            try:
                paths = memfd_paths(self.server.proc.pid, self.server.kv_memfd_name)
                self._inodes = {(st.st_dev, st.st_ino) for st in map(os.stat, paths)}
            except (psutil.NoSuchProcess, OSError):
                return set()
        return self._inodes

    def signal_group(self, sig: signal.Signals) -> None:
        """``sig`` to every process of the server (SIGSTOP freezes the whole engine)."""
        os.killpg(self.server.proc.pid, sig)

    def kill9(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.server.proc.wait(30)
        wait_until(lambda: not self.server.pids(), what=f"{self.name}'s processes gone")


class Rig:
    """The sidecar and the engines; test thread only (the watch only reads)."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.tmp = tmp
        self.model_dir = model_dir
        self.db = tmp / "sidecar.db"
        self.log_path = tmp / "sidecar.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sidecar: SidecarProcess | None = None
        self.engines: dict[str, Engine] = {}
        self.http = httpx.Client(base_url=self.url, timeout=30)

    # -- processes --------------------------------------------------------------------
    def start_sidecar(self) -> None:
        self.sidecar = SidecarProcess(
            self.db, SIDECAR_ENV, port=self.port, log_path=self.log_path
        ).start()

    def kill9_sidecar(self) -> None:
        assert self.sidecar is not None
        self.sidecar.kill9()
        self.sidecar = None

    def start_engine(self, name: str) -> Engine:
        old = self.engines.pop(name, None)
        if old is not None:  # a restart under the same name: the old server's leftovers go
            old.server.stop()
        runtime_dir = self.tmp / "run"
        server = launch_vllm_server(
            self.model_dir,
            env={
                "KVSIDECAR_ENABLE": "1",
                "KVSIDECAR_THREAD_GUARD": "1",
                "KVSIDECAR_INSTANCE_ID": name,
                "KVSIDECAR_RUNTIME_DIR": str(runtime_dir),
                "KVSIDECAR_SIDECAR_URL": self.url,
                "KVSIDECAR_HEARTBEAT_S": "0.5",
                "KVSIDECAR_DEVICE_ID": DEVICE,
                "KVSIDECAR_RESERVE_OUTPUT": "1",  # docs/autopilot.md: budgeted engines run so
            },
            extra_args=["--max-num-seqs", "8"],
            log_path=self.tmp / f"{name}.log",
            timeout_s=300,
        )
        engine = Engine(name, server, runtime_dir / name / "control.sock", str(self.model_dir))
        self.engines[name] = engine
        wait_until(
            lambda: self.http.get(f"/instances/{name}").json().get("observed"),
            timeout_s=60,
            what=f"{name} registered",
        )
        return engine

    def close(self) -> None:
        logs = {}
        for engine in self.engines.values():
            logs[engine.name] = engine.server.log_tail(200_000)
            engine.server.stop()
        if self.sidecar is not None:
            self.sidecar.stop()
        self.http.close()
        for name, log in logs.items():
            assert "ForeignThreadError" not in log, f"{name}: the pool was mutated off its thread"
        # an engine's report the sidecar refused leaves it (and the policy) a stale state
        sidecar_log = self.log_path.read_text(errors="replace")
        refused = [
            line
            for line in sidecar_log.splitlines()
            if "rejected an inconsistent report" in line or "ignored an inconsistent push" in line
        ]
        assert not refused, f"the sidecar refused engine reports: {refused[:3]}"

    # -- reads ------------------------------------------------------------------------
    def device(self) -> dict[str, Any]:
        reply = self.http.get(f"/devices/{DEVICE}")
        assert reply.status_code == 200, reply.text
        body: dict[str, Any] = reply.json()
        return body

    def instance(self, iid: str) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get(f"/instances/{iid}").json()
        return body

    def running(self, iid: str) -> int:
        """Running requests in the engine's last report to the sidecar."""
        return int((self.instance(iid)["observed"] or {}).get("num_running_requests", 0))

    def log_events(self, event: str) -> list[dict[str, Any]]:
        """The sidecar's JSON log lines with ``event`` (every run of the module)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if f'"event": "{event}"' in line:
                out.append(json.loads(line))
        return out

    def settle(self) -> dict[str, Any]:
        """Wait for the idle split: no requests, every limit at its target and applied, and
        still so (same limits) after twice the busy hold, so no engine counts busy."""

        def idle() -> dict[str, Any] | None:
            dev = self.device()
            for m in dev["instances"]:
                obs = self.instance(m["id"])["observed"] or {}
                if obs.get("num_running_requests") or obs.get("num_waiting_requests"):
                    return None
                if m["limit_bytes"] != m["target_bytes"] or m["status"] != "applied":
                    return None
            return dev

        def stable() -> dict[str, Any] | None:
            first = wait_until(idle, timeout_s=60, period_s=0.1, what="the idle split")
            time.sleep(2 * BUSY_HOLD_S)
            again = idle()
            if again is None:
                return None
            limits = [{m["id"]: m["limit_bytes"] for m in d["instances"]} for d in (first, again)]
            return again if limits[0] == limits[1] else None

        return wait_until(stable, timeout_s=120, what="a stable idle split")


def members(dev: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in dev["instances"]}


_STATE_KEYS = (
    "status",
    "revision",
    "limit_bytes",
    "mapped_bytes",
    "num_running_requests",
    "num_waiting_requests",
    "waiting_reason",
    "reserved_bytes",
)


@dataclass
class Sample:
    """One round of reads. ``proc`` is a lower bound of each engine's memory at one instant
    of the round (see :meth:`Watch._proc`); ``phase`` the test's mark when the round began
    and still when it ended (None when it changed in between)."""

    t: float
    device: dict[str, Any] | None  # None: the sidecar did not answer (e.g. it is down)
    held: dict[str, int | None]  # the limit each engine holds, from its control socket
    states: dict[str, dict[str, Any]]
    proc: dict[str, int]
    proc_sum: int
    phase: str | None
    dt: float  # seconds the round took


@dataclass
class Watch:
    """Samples in its own thread until :meth:`stop`; the test sets :attr:`phase` and
    :attr:`silent` (engines not to ask over their socket: frozen or dead)."""

    rig: Rig
    samples: list[Sample] = field(default_factory=list)
    phase: str | None = None
    silent: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, name="autopilot-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sampling; the samples go to ``watch-N.json`` in the rig's directory (to read
        when a check fails)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
            n = len(list(self.rig.tmp.glob("watch-*.json")))
            rows = [
                {k: v for k, v in vars(s).items() if k != "states"}
                | {"states": {e: {k: st.get(k) for k in _STATE_KEYS} for e, st in s.states.items()}}
                for s in self.samples
            ]
            (self.rig.tmp / f"watch-{n}.json").write_text(json.dumps(rows, indent=0))

    def count(self) -> int:
        return len(self.samples)

    def wait_samples(self, n: int, *, device: bool = True) -> None:
        """Wait until ``n`` more rounds (with a device view, by default) are in."""
        base = self._rounds(device)
        wait_until(lambda: self._rounds(device) >= base + n, timeout_s=60, what=f"{n} samples")

    def wait_total(self, n: int) -> None:
        """Wait until at least ``n`` rounds in all are in (however slow this machine is)."""
        wait_until(lambda: len(self.samples) >= n, timeout_s=120, what=f"{n} samples in all")

    def _rounds(self, device: bool) -> int:
        return sum(1 for s in list(self.samples) if s.device is not None or not device)

    def _run(self) -> None:
        sockets: dict[int, httpx.Client] = {}  # id(engine) -> a client on its control socket
        try:
            self._loop(sockets)
        finally:
            for client in sockets.values():
                client.close()

    def _state(self, sockets: dict[int, httpx.Client], engine: Engine) -> dict[str, Any] | None:
        """The engine's ``GET /state`` over a kept connection (a new one after an error)."""
        client = sockets.get(id(engine))
        if client is None:
            transport = httpx.HTTPTransport(uds=str(engine.socket_path))
            client = httpx.Client(transport=transport, base_url="http://engine", timeout=2)
            sockets[id(engine)] = client
        try:
            reply = client.get("/state")
        except httpx.HTTPError:
            sockets.pop(id(engine)).close()
            return None
        return reply.json() if reply.status_code == 200 else None  # type: ignore[no-any-return]

    def _loop(self, sockets: dict[int, httpx.Client]) -> None:
        with httpx.Client(base_url=self.rig.url, timeout=2) as http:
            while not self._stop.is_set():
                phase = self.phase
                t = time.monotonic()
                try:
                    reply = http.get(f"/devices/{DEVICE}")
                    device = reply.json() if reply.status_code == 200 else None
                except httpx.HTTPError:
                    device = None
                engines = dict(self.rig.engines)
                silent = set(self.silent)
                states = {}
                for name, engine in engines.items():
                    if name not in silent and (state := self._state(sockets, engine)):
                        states[name] = state
                proc = self._proc(engines)
                self.samples.append(
                    Sample(
                        t=t,
                        device=device,
                        held={n: s["limit_bytes"] for n, s in states.items()},
                        states=states,
                        proc=proc,
                        proc_sum=sum(proc.values()),
                        phase=phase if self.phase == phase else None,
                        dt=time.monotonic() - t,
                    )
                )
                self._stop.wait(0.01)

    @staticmethod
    def _proc(engines: dict[str, Engine]) -> dict[str, int]:
        """KV memory of every engine on the device, from /proc: every KV memfd open in this
        process's children (an engine still starting up included), each read twice, in
        opposite orders, keeping the smaller read. Memory moving from one engine to another
        between reads is then never counted twice: the sum is at most the true sum at one
        instant of the round. Keyed by engine name; ``other``: memfds of no known engine."""
        paths: dict[tuple[int, int], str] = {}
        try:
            tree = psutil.Process().children(recursive=True)
        except psutil.Error:
            tree = []
        for proc in tree:
            try:
                entries = os.scandir(f"/proc/{proc.pid}/fd")
            except OSError:
                continue
            with entries:
                for entry in entries:
                    try:
                        if not os.readlink(entry.path).startswith(f"/memfd:{STUB_KV_MEMFD}"):
                            continue
                        st = os.stat(entry.path)
                    except OSError:
                        continue
                    paths.setdefault((st.st_dev, st.st_ino), entry.path)
        order = list(paths.items())
        first = {key: _blocks(path) for key, path in order}
        again = {key: _blocks(path) for key, path in reversed(order)}
        owner = {key: name for name, e in engines.items() for key in e.memfd_inodes()}
        out = dict.fromkeys(engines, 0) | {"other": 0}
        for key in paths:
            out[owner.get(key, "other")] += min(first[key], again[key])
        return out

    def over_budget(self) -> list[Sample]:
        return [s for s in self.samples if s.proc_sum > BUDGET]


class Load:
    """``workers`` threads sending distinct prompts to one engine until :meth:`stop`
    (or until ``count`` requests were sent); every answer is counted, a failure with
    its message."""

    def __init__(
        self,
        engine: Engine,
        *,
        words: int,
        max_tokens: int,
        workers: int,
        seed: int,
        count: int | None = None,
    ) -> None:
        self.engine = engine
        self.words = words
        self.max_tokens = max_tokens
        self.count = count
        self.ok = 0
        self.failures: list[str] = []
        self._sent = 0
        self._seed = seed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name=f"load-{engine.name}-{i}", daemon=True)
            for i in range(workers)
        ]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _take(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or (self.count is not None and self._sent >= self.count):
                return None
            self._sent += 1
            return self._seed + self._sent

    def _run(self) -> None:
        # one per thread; a pooled connection is dropped after 2 s idle, before the engine's
        # 5 s keep-alive closes it (reusing one it is closing: "Server disconnected")
        limits = httpx.Limits(keepalive_expiry=2.0)
        with httpx.Client(timeout=120, limits=limits) as client:
            while (seed := self._take()) is not None:
                prompt = f"{self.engine.name} {make_document(self.words, seed=seed)}"
                try:
                    self.engine.complete(client, prompt, self.max_tokens)
                    failure = None
                except (httpx.HTTPError, RuntimeError) as exc:
                    failure = str(exc)[:200]
                with self._lock:
                    if failure is None:
                        self.ok += 1
                    else:
                        self.failures.append(failure)

    def stop(self) -> None:
        """No new request; wait for those in flight."""
        self._stop.set()
        self.wait_done()

    def wait_done(self) -> None:
        for thread in self._threads:
            thread.join(150)


def during(samples: list[Sample], phase: str) -> list[Sample]:
    return [s for s in samples if s.phase == phase]


def first_index(samples: list[Sample], pred: Callable[[Sample], bool]) -> int | None:
    return next((i for i, s in enumerate(samples) if pred(s)), None)


def iter_devices(samples: list[Sample]) -> Iterator[tuple[Sample, dict[str, dict[str, Any]]]]:
    for s in samples:
        if s.device is not None:
            yield s, members(s.device)


def _blocks(path: str) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except OSError:  # closed since (its process ended): nothing held
        return 0
