"""The real ``vllm serve`` (OpenAI server + EngineCore process) with kvsidecar on CPU.

Two servers for the whole module, started side by side: ``elastic`` (the
plugin with reclamation, registered with a real sidecar) and ``main`` (the
plugin with ``KVSIDECAR_RECLAIM=0``: limits are recorded, nothing is evicted
-- the "main" column of the reference table). Both run the CPU harness's stub
executor (KV tensors on a memfd ``HostBackend``: what the engine reports is
checked against ``/proc``) with the thread guard on. The first test steers
``elastic`` through the sidecar's REST API; the others use the engine's unix
control socket directly.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import wait_until
from support.control import ControlSocket, unchanged_by_a_storm

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")


from engine_ext.cpu_harness import (
    VllmServer,
    launch_vllm_server,
    make_document,
    make_tiny_model_dir,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
RETAINED_LIMIT = 4 << 20  # PUT before the engine exists: applied before its first request

DOC = make_document(1300, seed=1)
QUESTIONS = ["first question", "second question", "third question", "fourth question"]


@dataclass
class Engine(ControlSocket):
    server: VllmServer
    socket_path: Path
    model: str

    def complete(self, prompt: str, max_tokens: int = 16, timeout_s: float = 120) -> Any:
        response = httpx.post(
            self.server.base_url + "/v1/completions",
            json={"model": self.model, "prompt": prompt, "max_tokens": max_tokens},
            timeout=timeout_s,
        )
        assert response.status_code == 200, response.text
        return response.json()

    def requests_in_flight(self) -> int:
        """Requests the API server holds right now (``--enable-server-load-tracking``)."""
        response = httpx.get(self.server.base_url + "/load", timeout=10)
        assert response.status_code == 200, response.text
        return int(response.json()["server_load"])

    def reset(self) -> None:
        """Unlimited again and an empty prefix cache (between tests)."""
        revision = self.set_limit(None)
        response = httpx.post(self.server.base_url + "/reset_prefix_cache", timeout=30)
        assert response.status_code == 200, response.text
        self.wait_state(revision, status="applied")


def _start(
    tmp: Path, model_dir: Path, name: str, env: dict[str, str], *, async_scheduling: bool = False
) -> Engine:
    """``vllm serve`` with the plugin on as ``name`` (also used by test_vllm_serve_async.py)."""
    runtime_dir = tmp / name
    server = launch_vllm_server(
        model_dir,
        env={
            "KVSIDECAR_ENABLE": "1",
            "KVSIDECAR_THREAD_GUARD": "1",
            "KVSIDECAR_INSTANCE_ID": name,
            "KVSIDECAR_RUNTIME_DIR": str(runtime_dir),
            "VLLM_SERVER_DEV_MODE": "1",
            **env,
        },
        extra_args=["--max-num-seqs", "8", "--enable-server-load-tracking"],
        log_path=tmp / f"{name}.log",
        async_scheduling=async_scheduling,
    )
    return Engine(server, runtime_dir / name / "control.sock", str(model_dir))


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, module_sidecar_url: str
) -> Iterator[tuple[Engine, Engine]]:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    model_dir = make_tiny_model_dir(tmp / "model")
    retained = httpx.put(
        f"{module_sidecar_url}/instances/elastic/limit", json={"limit": RETAINED_LIMIT}
    )
    assert retained.status_code in (200, 202) and retained.json()["status"] == "pending"
    to_sidecar = {"KVSIDECAR_SIDECAR_URL": module_sidecar_url, "KVSIDECAR_HEARTBEAT_S": "0.5"}
    with ThreadPoolExecutor(2) as pool:
        elastic_f = pool.submit(_start, tmp, model_dir, "elastic", to_sidecar)
        main_f = pool.submit(_start, tmp, model_dir, "main", {"KVSIDECAR_RECLAIM": "0"})
        elastic, main = elastic_f.result(), main_f.result()
    try:
        yield elastic, main
    finally:
        for engine in (elastic, main):
            log = engine.server.log_tail(200_000)
            engine.server.stop()
            assert "ForeignThreadError" not in log, "the block pool was mutated off its thread"
            assert not engine.socket_path.exists(), "control socket left behind after SIGTERM"


def test_sidecar_retained_limit_then_push_applies(
    engines: tuple[Engine, Engine], module_sidecar_url: str
) -> None:
    elastic, _ = engines
    api = httpx.Client(base_url=module_sidecar_url, timeout=30)
    state = elastic.state()  # retained limit taken before the first request
    assert (state["revision"], state["limit_bytes"], state["status"]) == (
        1,
        RETAINED_LIMIT,
        "applied",
    )
    _fill_prefix_cache(elastic)
    full = elastic.state()["mapped_bytes"]
    reply = api.put("/instances/elastic/limit", params={"wait": "20"}, json={"limit": full // 2})
    assert reply.status_code == 200 and reply.json()["status"] == "applied", reply.text
    assert elastic.server.kv_memfd_bytes() <= full // 2
    body = api.get("/instances/elastic").json()
    assert body["observed"]["mapped_bytes"] <= full // 2
    assert body["engine"]["engine"] == "vllm"
    assert api.delete("/instances/elastic/limit").status_code in (200, 202)
    elastic.wait_state(3, status="applied")


def _fill_prefix_cache(engine: Engine) -> None:
    for question in QUESTIONS:
        engine.complete(f"{DOC} {question}")
    for seed in range(4):
        engine.complete(make_document(200, seed=10 + seed))


def _traffic(engine: Engine, num_requests: int) -> None:
    prompts = [make_document(100, seed=1000 + i) for i in range(num_requests)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: engine.complete(p, max_tokens=8), prompts))


def _reference_table(engine: Engine, status: str) -> dict[str, int]:
    engine.reset()
    _fill_prefix_cache(engine)
    full = engine.state()
    assert full["mapped_bytes"] == engine.server.kv_memfd_bytes()  # the report is measured
    limit = full["mapped_bytes"] // 2
    revision = engine.set_limit(limit)
    idle = engine.wait_state(revision, status=status)
    _traffic(engine, 100)
    after = engine.wait_state(revision, status=status)
    return {
        "limit": limit,
        "full": full["mapped_bytes"],
        "idle": idle["mapped_bytes"],
        "idle_passes": idle["passes"] - full["passes"],
        "after": engine.server.kv_memfd_bytes(),
        "after_reported": after["mapped_bytes"],
    }


def test_reference_table_limit_applies_idle_and_after_traffic(
    engines: tuple[Engine, Engine],
) -> None:
    elastic, main = engines
    with ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(_reference_table, (elastic, main), ("applied", "deferred")))
    kvs, base = rows
    print(f"\nreference table (MiB): {[{k: v / 2**20 for k, v in r.items()} for r in rows]}")
    assert kvs["idle"] <= kvs["limit"] and kvs["after"] <= kvs["limit"]
    assert kvs["idle_passes"] == 1  # converged within one idle pass
    assert kvs["after_reported"] == kvs["after"]
    assert base["idle"] > base["limit"] and base["after"] > base["limit"]
    assert main.state()["reason"] == "reclaim_disabled"


def test_under_traffic_deferred_then_applied_with_identical_tokens(
    engines: tuple[Engine, Engine],
) -> None:
    elastic, _ = engines
    elastic.reset()
    kept = [f"{DOC} {q} {i}" for i, q in enumerate(QUESTIONS * 3)]
    reference = [elastic.complete(p, max_tokens=96)["choices"][0]["text"] for p in kept]
    warm = elastic.state()
    bundle = warm["page_bundle_bytes"]

    def aborted(i: int) -> str:
        try:
            elastic.complete(f"{DOC} abandoned {i}", max_tokens=2000, timeout_s=1.0)
        except httpx.TimeoutException:
            return "aborted"
        return "finished"

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(elastic.complete, p, 96) for p in kept]
        abandoned = [pool.submit(aborted, i) for i in range(12)]
        # a full batch (--max-num-seqs 8) runs in the engine when the limit lands (the API
        # server's load counts requests the engine may not have admitted yet); not "all 24
        # in flight": on a loaded machine the first ones may finish before the last arrive
        busy = wait_until(
            lambda: (s := elastic.state())["num_running_requests"] >= 8 and s,
            what="a full batch running in the engine (--max-num-seqs 8)",
        )
        # below what the running batch pins right now (its pages only grow until a request
        # ends), so the limit must wait for requests to finish: deferred, then applied
        limit = min(warm["mapped_bytes"] - 2 * bundle, busy["pinned_bytes"] - bundle)
        revision = elastic.set_limit(limit)
        first = elastic.wait_state(revision, status="deferred")
        results = [f.result() for f in futures]
        outcomes = [f.result() for f in abandoned]
    assert first["reason"] in ("running_requests", "evicting")
    applied = elastic.wait_state(revision, status="applied")
    assert applied["mapped_bytes"] <= limit
    assert applied["mapped_bytes"] == elastic.server.kv_memfd_bytes()
    assert outcomes.count("aborted") == 12
    assert [r["choices"][0]["text"] for r in results] == reference
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in results)


def _sampled(engine: Engine, prompt: str, n: int) -> list[str]:
    """One completion of ``n`` choices (vLLM fans it out to ``n`` requests sharing the
    prompt's blocks; ``best_of`` asks for more and returns ``n``)."""
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 12, "n": n}
    if n % 3 == 0:
        body["best_of"] = n + 1
    response = httpx.post(engine.server.base_url + "/v1/completions", json=body, timeout=240)
    assert response.status_code == 200, response.text
    return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def test_parallel_sampling_under_limits_from_a_foreign_thread(
    engines: tuple[Engine, Engine],
) -> None:
    """``n`` > 1 (and ``best_of``): sibling requests share their prompt's blocks. Under
    limits published every few ms (0 included) each completion still answers with the
    tokens of a run without limits, and a one-page limit applies to the memfd afterwards."""
    elastic, _ = engines
    elastic.reset()
    asks = [(f"{DOC[: 300 + 211 * i]} sampled {i}", n) for i, n in enumerate((2, 3, 4, 8, 6, 5))]

    def run() -> list[list[str]]:
        with ThreadPoolExecutor(len(asks)) as pool:
            return list(pool.map(lambda a: _sampled(elastic, *a), asks))

    bundle = elastic.state()["page_bundle_bytes"]
    unchanged_by_a_storm(elastic, run, [0, bundle, 2 * bundle, 4 * bundle, None], seed=23)
    revision = elastic.set_limit(bundle)
    applied = elastic.wait_state(revision, status="applied")
    assert applied["mapped_bytes"] == elastic.server.kv_memfd_bytes() <= bundle


def test_reset_prefix_cache_releases_memory(engines: tuple[Engine, Engine]) -> None:
    elastic, _ = engines
    elastic.reset()
    _fill_prefix_cache(elastic)
    full = elastic.state()["mapped_bytes"]
    response = httpx.post(elastic.server.base_url + "/reset_prefix_cache", timeout=30)
    assert response.status_code == 200
    deadline = time.monotonic() + 10
    while elastic.server.kv_memfd_bytes() >= full and time.monotonic() < deadline:
        time.sleep(0.05)
    bundle = elastic.state()["page_bundle_bytes"]
    assert elastic.server.kv_memfd_bytes() <= bundle  # only the null block's page is left


def test_limit_zero_drains_and_serves_after_raise(engines: tuple[Engine, Engine]) -> None:
    elastic, _ = engines
    elastic.reset()
    _fill_prefix_cache(elastic)
    revision = elastic.set_limit(0)
    drained = elastic.wait_state(revision, status="applied")  # applied against the floor
    assert drained["evictable_bytes"] == 0
    assert drained["floor_bytes"] == drained["page_bundle_bytes"]  # the null block's page
    assert drained["effective_limit_bytes"] == drained["floor_bytes"]
    assert elastic.server.kv_memfd_bytes() == drained["page_bundle_bytes"]  # the null page
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(elastic.complete, f"{DOC} after the drain", 8)
        wait_until(elastic.requests_in_flight, what="the request reached the server")
        assert not waiting.done()  # waits like any request under memory pressure
        assert httpx.get(elastic.server.base_url + "/health", timeout=5).status_code == 200
        raised = elastic.set_limit(None)
        assert waiting.result()["usage"]["completion_tokens"] == 8
    elastic.wait_state(raised, status="applied")


def test_one_page_limit_right_after_a_cache_hit_never_kills_the_engine(
    engines: tuple[Engine, Engine],
) -> None:
    """Issue 11: a limit published while a request's prefix hit is looked up (100 tries)."""
    import random

    elastic, _ = engines
    elastic.reset()
    rng = random.Random(11)
    bundle = elastic.state()["page_bundle_bytes"]
    elastic.complete(f"{DOC} warm the cache")
    with ThreadPoolExecutor(1) as pool:
        for i in range(100):
            posted = pool.submit(elastic.complete, f"{DOC} question {i}", 4)
            time.sleep(rng.uniform(0.0, 0.02))
            elastic.set_limit(bundle)  # one page: the document's cached pages must go
            time.sleep(rng.uniform(0.0, 0.02))
            revision = elastic.set_limit(None)  # the request may wait for memory until here
            assert posted.result()["usage"]["completion_tokens"] == 4  # 200, engine alive
            state = elastic.wait_state(revision, status="applied")
            assert abs(state["mapped_bytes"] - elastic.server.kv_memfd_bytes()) <= bundle
            if i % 10 == 0:
                elastic.complete(f"{DOC} warm the cache")  # hits again in the next rounds
    assert httpx.get(elastic.server.base_url + "/health", timeout=5).status_code == 200


@dataclass
class Sample:
    """One 100 ms sample: ``/proc`` read before and after the engine's state."""

    proc_before: int
    state: dict[str, Any]
    proc_after: int


def _sample_every_100ms(engine: Engine, samples: list[Sample], stop: threading.Event) -> None:
    while not stop.is_set():
        started = time.monotonic()
        before = engine.server.kv_memfd_bytes()
        state = engine.state()
        samples.append(Sample(before, state, engine.server.kv_memfd_bytes()))
        stop.wait(max(0.0, 0.1 - (time.monotonic() - started)))


def _check_sample(sample: Sample, bundle: int) -> None:
    """The state agrees with /proc within one step, and its fields agree with each other.

    Tolerance: the engine refreshes its state at every scheduler step, and it keeps
    stepping while we read, so the state may be any value /proc held between the two
    reads, give or take the pages one step maps after its refresh (one page bundle:
    the step's decode; a prefill's pages are counted by the bracket).
    """
    state = sample.state
    low = min(sample.proc_before, sample.proc_after) - bundle
    high = max(sample.proc_before, sample.proc_after) + bundle
    assert low <= state["mapped_bytes"] <= high, sample
    effective = state["effective_limit_bytes"]
    if state["status"] == "applied" and effective is not None:
        assert state["mapped_bytes"] <= effective, sample
    if effective is not None and state["mapped_bytes"] > effective:
        assert state["status"] == "deferred" and state["overage_bytes"] > 0, sample
    if state["waiting_reason"] == "waiting_for_memory":
        assert state["num_waiting_requests"] >= 1 and state["waiting_bytes"] > 0, sample
    else:
        assert state["waiting_bytes"] == 0, sample


def test_small_limit_while_a_runs_and_b_waits_nothing_hangs_100ms_samples(
    engines: tuple[Engine, Engine],
) -> None:
    """Issue 11's hang on real ``vllm serve``: a 2-page limit, A (700 + 3000 tokens)
    running, B (1500 tokens) waiting. A finishes above the limit (reported), B waits
    with the state naming why and what it needs, then completes once the limit is
    raised; at every 100 ms sample the state agrees with /proc (see _check_sample)."""
    import random

    elastic, _ = engines
    elastic.reset()
    bundle = elastic.state()["page_bundle_bytes"]
    rng = random.Random(12)
    prompt_a = [rng.randrange(100, 1000) for _ in range(700)]
    prompt_b = [rng.randrange(100, 1000) for _ in range(1500)]

    def complete(prompt: list[int], max_tokens: int) -> Any:
        response = httpx.post(
            elastic.server.base_url + "/v1/completions",
            json={
                "model": elastic.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
            timeout=600,
        )
        assert response.status_code == 200, response.text
        return response.json()

    samples: list[Sample] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_every_100ms, args=(elastic, samples, stop))
    sampler.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(complete, prompt_a, 3000)
            wait_until(lambda: elastic.state()["num_running_requests"] >= 1, what="A is running")
            limited = elastic.set_limit(2 * bundle)
            b = pool.submit(complete, prompt_b, 16)
            wait_until(
                lambda: elastic.state()["waiting_reason"] == "waiting_for_memory",
                what="B waits for memory",
                timeout_s=120,
            )
            assert a.result()["usage"]["completion_tokens"] == 3000  # never preempted: done
            state = elastic.wait_state(limited, status="applied", timeout_s=60)
            assert not b.done()  # B still waits, and the state says so
            assert state["num_waiting_requests"] == 1 and state["num_running_requests"] == 0
            assert state["waiting_reason"] == "waiting_for_memory"
            # B does not fit under the limit (that is why it waits): it needs more than
            # the page the limit leaves beside the null block's page
            assert state["waiting_bytes"] > bundle
            time.sleep(0.5)  # a few more samples while B waits, and at least 21 in all
            wait_until(lambda: len(samples) > 20, what="21 samples", timeout_s=30)
            raised = elastic.set_limit(None)
            assert b.result()["usage"]["completion_tokens"] == 16
            elastic.wait_state(raised, status="applied")
    finally:
        stop.set()
        sampler.join()
    assert len(samples) > 20, len(samples)
    for sample in samples:
        _check_sample(sample, bundle)
    statuses = {(s.state["status"], s.state["reason"]) for s in samples}
    assert ("deferred", "running_requests") in statuses  # A ran above the 2-page limit
    assert any(s.state["waiting_reason"] == "waiting_for_memory" for s in samples)


def test_stop_removes_the_ipc_sockets_vllm_leaves(engines: tuple[Engine, Engine]) -> None:
    """Last in the module (it stops ``main``): vLLM leaves its ZMQ ipc sockets behind even
    on a clean exit; the harness gives it a private TMPDIR and removes it after the stop."""
    _, main = engines
    tmp_dir = main.server.tmp_dir
    assert tmp_dir is not None and tmp_dir.parent == Path(tempfile.gettempdir())
    sockets = [p for p in tmp_dir.iterdir() if p.is_socket()]
    assert sockets, f"vLLM's ipc sockets are not in its TMPDIR: {sorted(tmp_dir.iterdir())}"
    main.server.stop()
    assert not tmp_dir.exists()
    assert [p for p in sockets if os.path.lexists(p)] == []
