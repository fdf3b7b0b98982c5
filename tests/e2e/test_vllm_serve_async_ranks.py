"""The real ``vllm serve`` on vLLM's async-scheduling loop with TP=2 rank processes.

A GPU server with TP > 1 runs async scheduling by default; here the CPU harness keeps
it on (``launch_vllm_server(async_scheduling=True)``) and ``KVSIDECAR_STUB_TP=2`` gives
the stub executor two rank processes that write every step's KV (docs/ranks.md). Two
servers for the module, started side by side: ``tp2`` (that loop with the ranks,
registered with a real sidecar) and ``ref`` (the synchronous single-rank loop: the
reference outputs, since the stub's tokens are computed from the KV read back). What
each rank maps is read from its ``/proc/<pid>/maps``. The module ends with SIGTERM to
``tp2``'s API server while idle; fresh ``tp2`` servers get SIGTERM (the API server
alone), SIGINT (Ctrl-C, to the whole group),
``kill -9`` of the API server alone and ``kill -9`` of one rank, mid-generation: every
rank process must end and no socket or shared-memory file may stay.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support import wait_until
from test_vllm_serve import DOC, QUESTIONS, Engine, _fill_prefix_cache, _start
from test_vllm_serve_async import (
    ASYNC_LOOP,
    _assert_nothing_left,
    _complete_texts,
    _ipc_paths,
    _remove_vllm_ipc_dirs,
    _stream,
    _vllm_ipc_dir,
    stream_through_limits,
)

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

import psutil

from engine_ext.cpu_harness import make_tiny_model_dir
from engine_ext.ranks import memfd_view

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

__all__ = ["_remove_vllm_ipc_dirs"]  # the module's autouse fixture
TP2 = {"KVSIDECAR_STUB_TP": "2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("vllm-async-ranks-model") / "model")


def rank_pids(engine: Engine) -> list[int]:
    """The rank processes of ``engine`` (``python -m engine_ext.ranks``)."""
    found: list[int] = []
    for pid in engine.server.pids():
        try:
            if "engine_ext.ranks" in " ".join(psutil.Process(pid).cmdline()):
                found.append(pid)
        except psutil.NoSuchProcess:
            continue
    return found


def rank_views(engine: Engine) -> list[int]:
    """Bytes each rank maps of the KV memfd, from its ``/proc/<pid>/maps``."""
    name = engine.server.kv_memfd_name
    return [sum(n for _, n in memfd_view(pid, name)) for pid in rank_pids(engine)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, module_sidecar_url: str, model_dir: Path
) -> Iterator[tuple[Engine, Engine]]:
    """(``tp2``, ``ref``); ``tp2`` ends with SIGTERM to its API server, checked."""
    tmp = tmp_path_factory.mktemp("vllm-async-ranks")
    to_sidecar = {
        "KVSIDECAR_SIDECAR_URL": module_sidecar_url,
        "KVSIDECAR_HEARTBEAT_S": "0.5",
        **TP2,
        **_vllm_ipc_dir(),
    }
    with ThreadPoolExecutor(2) as pool:
        tp2_f = pool.submit(_start, tmp, model_dir, "tp2", to_sidecar, async_scheduling=True)
        ref_f = pool.submit(_start, tmp, model_dir, "ref", _vllm_ipc_dir())
        tp2, ref = tp2_f.result(), ref_f.result()
    try:
        yield tp2, ref
    finally:
        ref.server.stop()
        ranks = rank_pids(tp2)
        left = _ipc_paths(tp2.server)
        tp2.server.signal(signal.SIGTERM)  # what an orchestrator sends the server
        tp2.server.proc.wait(timeout=60)
        log = tp2.server.log_tail(400_000)
        tp2.server.stop()  # stragglers, if any
        _assert_nothing_left(tp2, left, log)
        assert len(ranks) == 2 and not any(_alive(p) for p in ranks), ranks


def test_limits_while_streaming_with_disconnects_hold_on_every_rank(
    engines: tuple[Engine, Engine], module_sidecar_url: str
) -> None:
    tp2, ref = engines
    tp2.reset()
    api = httpx.Client(base_url=module_sidecar_url, timeout=30)
    kept = [f"{DOC} {q} streamed {i}" for i, q in enumerate(QUESTIONS * 2)]
    reference = _complete_texts(ref, kept, 200)
    _fill_prefix_cache(tp2)
    assert ASYNC_LOOP in tp2.server.log_text() and len(rank_pids(tp2)) == 2
    full = tp2.state()["mapped_bytes"]
    bundle = tp2.state()["page_bundle_bytes"]

    def check_ranks() -> None:
        # while requests run, a view may move between two reads (a step maps a page):
        # both ranks alive here (five reads after each limit), their views against the
        # limit once idle (below)
        for _ in range(5):
            state = tp2.state()
            assert len(rank_views(tp2)) == 2 and len(state["ranks"]) == 2, state
            assert all(r["alive"] for r in state["ranks"]), state

    texts, outcomes = stream_through_limits(
        tp2,
        api,
        "tp2",
        kept,
        max_tokens=200,
        dropped=6,
        full=full,
        bundle=bundle,
        after_each=check_ranks,
    )
    assert outcomes == ["disconnected"] * 6
    assert texts == reference  # the single-rank synchronous server's tokens
    wait_until(lambda: tp2.requests_in_flight() == 0, what="the API server holds no request")
    reply = api.put("/instances/tp2/limit", params={"wait": "20"}, json={"limit": full // 4})
    assert reply.status_code == 200 and reply.json()["status"] == "applied", reply.text
    observed = api.get("/instances/tp2").json()["observed"]
    assert observed["num_ranks"] == 2 and all(r["alive"] for r in observed["ranks"])
    views = rank_views(tp2)
    assert max(views) <= full // 4 and tp2.server.kv_memfd_bytes() <= full // 4, views
    assert api.delete("/instances/tp2/limit").status_code in (200, 202)


def test_limit_zero_while_idle_unmaps_every_rank(engines: tuple[Engine, Engine]) -> None:
    tp2, _ = engines
    tp2.reset()
    _fill_prefix_cache(tp2)
    bundle = tp2.state()["page_bundle_bytes"]
    assert min(rank_views(tp2)) > 4 * bundle
    wait_until(lambda: tp2.requests_in_flight() == 0, what="idle")
    revision = tp2.set_limit(0)  # no request comes: only the idle callback can apply it
    drained = tp2.wait_state(revision, status="applied")
    assert drained["effective_limit_bytes"] == drained["floor_bytes"] == bundle
    assert rank_views(tp2) == [bundle, bundle]  # the null block's page, on each rank
    assert tp2.server.kv_memfd_bytes() == bundle
    tp2.wait_state(tp2.set_limit(None), status="applied")
    assert tp2.complete(f"{DOC} after the drain", max_tokens=4)["usage"]["completion_tokens"] == 4


def _stop_mid_generation(tmp_path: Path, model_dir: Path, name: str, how: str) -> None:
    """A fresh ``tp2`` server, one streamed request running, then ``how``: ``sigint`` to
    the whole group (Ctrl-C), ``sigterm`` or ``kill9`` of the API server alone, or
    ``kill9-rank`` of one rank process. Every process, rank and socket must go."""
    engine = _start(tmp_path, model_dir, name, {**TP2, **_vllm_ipc_dir()}, async_scheduling=True)
    try:
        tree = engine.server.pids()
        ranks = rank_pids(engine)
        assert len(ranks) == 2, tree
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream, engine, f"{DOC} interrupted", 2000)
            wait_until(lambda: engine.state()["num_running_requests"] >= 1, what="a request runs")
            held = _ipc_paths(engine.server)
            if how == "sigint":
                os.killpg(engine.server.proc.pid, signal.SIGINT)
            elif how == "sigterm":
                engine.server.signal(signal.SIGTERM)  # the API server only, as an orchestrator
            elif how == "kill9":
                os.kill(engine.server.proc.pid, signal.SIGKILL)  # the API server only
            else:  # a rank dies: the next step fails, the EngineCore ends, vLLM's server too
                os.kill(ranks[1], signal.SIGKILL)
            engine.server.proc.wait(timeout=60)
            wait_until(
                lambda: not any(_alive(p) for p in tree),
                timeout_s=60,
                what="the EngineCore and its ranks to end",
            )
            # the stream ends, cut short, with vLLM's error event, or (SIGINT: the server
            # drains) with [DONE]: how it ends is vLLM's, not what this test checks
            stream.exception(timeout=30)
    finally:
        log = engine.server.log_tail(400_000)
        engine.server.stop()
    assert ASYNC_LOOP in engine.server.log_text()
    _assert_nothing_left(engine, held, log)
    if how == "kill9-rank":  # the EngineCore's last words name the rank and what to do
        # (the exit, or the reset of its socket, whichever the engine saw first)
        assert f"dead: rank 1 (pid {ranks[1]}): " in log, log[-4000:]
        assert "restart the instance" in log
    else:
        # an orderly end, not a dead-rank crash: Ctrl-C reaches the ranks too, while the
        # EngineCore may be in a step (its busy loop runs one before its shutdown starts);
        # the ranks serve it and exit when the EngineCore closes their stream
        assert "EngineCore encountered a fatal error" not in log, log[-6000:]
        assert "failed: send failed" not in log and "RankChannelError" not in log


def test_sigint_to_the_process_group_ends_every_rank(tmp_path: Path, model_dir: Path) -> None:
    _stop_mid_generation(tmp_path, model_dir, "tp2-int", "sigint")


def test_sigterm_to_the_api_server_mid_generation_ends_every_rank(
    tmp_path: Path, model_dir: Path
) -> None:
    _stop_mid_generation(tmp_path, model_dir, "tp2-term", "sigterm")


def test_kill_9_of_the_api_server_ends_every_rank(tmp_path: Path, model_dir: Path) -> None:
    _stop_mid_generation(tmp_path, model_dir, "tp2-kill", "kill9")


def test_kill_9_of_a_rank_ends_the_server_and_every_process(
    tmp_path: Path, model_dir: Path
) -> None:
    _stop_mid_generation(tmp_path, model_dir, "tp2-rank", "kill9-rank")
