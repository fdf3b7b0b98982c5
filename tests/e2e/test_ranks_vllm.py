"""The real ``vllm serve`` with rank processes: TP=2 (via the sidecar) and PP=2 (control socket).

The CPU harness's stub executor starts ``KVSIDECAR_STUB_TP x KVSIDECAR_STUB_PP``
rank processes (vLLM's own world size stays 1, docs/ranks.md); each attaches
the KV memfd into its own reservation and writes its share of every step's
KV, and the sampler reads it back. What each rank maps is read from its
``/proc/<pid>/maps``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support import wait_until
from support.control import ControlSocket

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

import psutil

from engine_ext.cpu_harness import (
    VllmServer,
    launch_vllm_server,
    make_document,
    make_tiny_model_dir,
)
from engine_ext.ranks import memfd_view

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DOC = make_document(600, seed=7)
KEPT = [f"{DOC} question {i}" for i in range(4)]


class Engine(ControlSocket):
    def __init__(self, server: VllmServer, socket_path: Path, model: str, world: int) -> None:
        self.server, self.socket_path, self.model, self.world = server, socket_path, model, world

    def complete(self, prompt: str, max_tokens: int = 24, timeout_s: float = 120) -> str:
        response = httpx.post(
            self.server.base_url + "/v1/completions",
            timeout=timeout_s,
            json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens},
        )
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])

    def requests_in_flight(self) -> int:
        """Requests the API server holds right now (``--enable-server-load-tracking``)."""
        response = httpx.get(self.server.base_url + "/load", timeout=10)
        assert response.status_code == 200, response.text
        return int(response.json()["server_load"])

    def rank_pids(self) -> list[int]:
        tree = psutil.Process(self.server.proc.pid).children(recursive=True)
        return [p.pid for p in tree if "engine_ext.ranks" in " ".join(p.cmdline())]

    def memfd_bytes(self) -> int:
        """Memory committed in the KV memfd (counted once, though every rank holds it open)."""
        seen: dict[tuple[int, int], int] = {}
        tree = [
            psutil.Process(self.server.proc.pid),
            *psutil.Process(self.server.proc.pid).children(True),
        ]
        for proc in tree:
            try:
                entries = list(Path(f"/proc/{proc.pid}/fd").iterdir())
            except OSError:
                continue
            for entry in entries:
                try:
                    if os.readlink(entry).startswith("/memfd:kvsidecar-stub-kv"):
                        info = os.stat(entry)
                        seen[(info.st_dev, info.st_ino)] = info.st_blocks * 512
                except OSError:
                    continue
        assert len(seen) == 1, seen
        return next(iter(seen.values()))

    def rank_views(self) -> list[int]:
        """Bytes each rank process maps of the KV memfd, from its /proc/<pid>/maps."""
        return [sum(n for _, n in memfd_view(pid, "kvsidecar-stub-kv")) for pid in self.rank_pids()]


def _start(tmp: Path, model_dir: Path, name: str, env: dict[str, str]) -> Engine:
    runtime = tmp / name
    server = launch_vllm_server(
        model_dir,
        env={
            "KVSIDECAR_ENABLE": "1",
            "KVSIDECAR_THREAD_GUARD": "1",
            "KVSIDECAR_INSTANCE_ID": name,
            "KVSIDECAR_RUNTIME_DIR": str(runtime),
            **env,
        },
        extra_args=["--max-num-seqs", "8", "--enable-server-load-tracking"],
        log_path=tmp / f"{name}.log",
    )
    world = int(env.get("KVSIDECAR_STUB_TP", "1")) * int(env.get("KVSIDECAR_STUB_PP", "1"))
    return Engine(server, runtime / name / "control.sock", str(model_dir), world)


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, module_sidecar_url: str
) -> Iterator[dict[str, Engine]]:
    tmp = tmp_path_factory.mktemp("vllm-ranks")
    model_dir = make_tiny_model_dir(tmp / "model")
    with ThreadPoolExecutor(2) as pool:
        tp2 = pool.submit(
            _start,
            tmp,
            model_dir,
            "tp2",
            {
                "KVSIDECAR_STUB_TP": "2",
                "KVSIDECAR_SIDECAR_URL": module_sidecar_url,
                "KVSIDECAR_HEARTBEAT_S": "0.5",
            },
        )
        pp2 = pool.submit(_start, tmp, model_dir, "pp2", {"KVSIDECAR_STUB_PP": "2"})
        started = {"tp2": tp2.result(), "pp2": pp2.result()}
    try:
        yield started
    finally:
        left: dict[str, tuple[list[int], str]] = {}
        for name, engine in started.items():  # stop every server before asserting anything
            pids = engine.rank_pids()
            log = engine.server.log_tail(200_000)
            engine.server.stop()
            left[name] = (pids, log)
        for name, (pids, log) in left.items():
            assert "ForeignThreadError" not in log
            assert not any(
                psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids
            ), f"{name}: a rank process outlived SIGTERM"
            assert not (tmp / name / name).exists(), f"{name}: runtime dir left after SIGTERM"


def _scenario(engine: Engine, lower: Callable[[int], int]) -> None:
    """Reference scenario: prefix cache full, limit lowered with shared-prefix requests
    in flight and half of the requests aborted, then idle."""
    reference = [engine.complete(p) for p in KEPT]  # also fills the prefix cache
    for seed in range(6):  # more cached documents: half of the cache still fits a request
        engine.complete(make_document(300, seed=100 + seed), max_tokens=4)
    full = engine.state()
    assert full["num_ranks"] in (1, engine.world)
    limit = full["mapped_bytes"] // 2

    def abandoned(i: int) -> None:
        try:
            engine.complete(f"{DOC} abandoned {i}", max_tokens=2000, timeout_s=1.0)
        except httpx.TimeoutException:
            return
        raise AssertionError("an abandoned request finished: raise its max_tokens")

    with ThreadPoolExecutor(8) as pool:
        kept = [pool.submit(engine.complete, p) for p in KEPT]
        aborted = [pool.submit(abandoned, i) for i in range(4)]
        wait_until(lambda: engine.requests_in_flight() >= len(KEPT), what="requests in flight")
        revision = lower(limit)
        texts = [f.result() for f in kept]
        for f in aborted:
            f.result()
    assert texts == reference  # same tokens as without the limit change
    deadline = time.monotonic() + 30
    seen: list[str] = []
    while time.monotonic() < deadline:
        state = engine.state()
        if state["revision"] >= revision:
            seen.append(state["status"])
            if state["status"] == "applied":
                views = engine.rank_views()  # measured right at the first applied poll
                assert len(views) == engine.world and max(views) <= limit, (views, limit)
                break
        time.sleep(0.02)
    assert seen and seen[-1] == "applied", (seen, engine.state())
    assert all(s == "deferred" for s in seen[:-1]), seen  # never pending/applied-then-back
    final = engine.state()
    assert final["mapped_bytes"] <= limit and engine.memfd_bytes() <= limit
    assert [(r["rank"], r["alive"]) for r in final["ranks"]][: engine.world] in (
        [(i, True) for i in range(engine.world)],
        [(0, True)],
    )
    assert [engine.complete(p, timeout_s=60) for p in KEPT] == reference  # serving, same tokens


def test_tp2_reference_scenario_via_sidecar(
    engines: dict[str, Engine], module_sidecar_url: str
) -> None:
    engine = engines["tp2"]
    api = httpx.Client(base_url=module_sidecar_url, timeout=30)

    def lower(limit: int) -> int:
        reply = api.put("/instances/tp2/limit", json={"limit": limit})
        assert reply.status_code in (200, 202), reply.text
        return int(reply.json()["desired"]["revision"])

    _scenario(engine, lower)
    view = api.get("/instances/tp2").json()
    assert view["status"] in ("applied", "deferred")
    deadline = time.monotonic() + 10
    while view["status"] != "applied" and time.monotonic() < deadline:
        time.sleep(0.1)
        view = api.get("/instances/tp2").json()
    assert view["status"] == "applied", view
    ranks = view["observed"]["ranks"]
    assert view["observed"]["num_ranks"] == engine.world == 2  # a TP=2 engine: both ranks
    assert len(ranks) == 2 and all(r["alive"] for r in ranks)


def test_pp2_reference_scenario_in_process_control_socket(engines: dict[str, Engine]) -> None:
    _scenario(engines["pp2"], engines["pp2"].set_limit)
