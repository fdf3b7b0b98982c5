"""The real ``vllm serve`` on vLLM's async-scheduling loop, with kvsidecar, on CPU.

A GPU server with the uni executor runs vLLM's ``AsyncScheduler`` and steps with
``EngineCore.step_with_batch_queue`` by default; the CPU platform turns that off, so
``launch_vllm_server(async_scheduling=True)`` keeps it on (``StubAsyncExecutor``, the
harness's plugin). Two servers for the module, started side by side: ``async`` (that
loop, registered with a real sidecar) and ``sync`` (the synchronous loop, the
reference outputs: the stub's tokens are computed from the KV memory read back, so
they must be the same). Memory is measured from ``/proc`` (the KV memfd); the module
ends with SIGTERM to ``async``'s API server and a fresh ``async`` server gets SIGINT
(Ctrl-C, to the whole group): neither may leave a socket or a shared-memory file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import wait_until
from test_vllm_serve import DOC, QUESTIONS, Engine, _fill_prefix_cache, _start

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from engine_ext.cpu_harness import VllmServer, make_document, make_tiny_model_dir
from engine_ext.cpu_harness.vllm._async_plugin import LOOP_LOG

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_IPC = "kvs-vllm-ipc-"  # prefix of the directories of vLLM's own ipc sockets
_IPC_DIRS: list[str] = []
ASYNC_LOOP = f"{LOOP_LOG}: scheduler=AsyncScheduler batch_queue=2 step_fn=step_with_batch_queue"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("vllm-async-model") / "model")


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, module_sidecar_url: str, model_dir: Path
) -> Iterator[tuple[Engine, Engine]]:
    """(``async``, ``sync``); ``async`` ends with SIGTERM to its API server, checked."""
    tmp = tmp_path_factory.mktemp("vllm-async")
    to_sidecar = {
        "KVSIDECAR_SIDECAR_URL": module_sidecar_url,
        "KVSIDECAR_HEARTBEAT_S": "0.5",
        **_vllm_ipc_dir(),
    }
    with ThreadPoolExecutor(2) as pool:
        async_f = pool.submit(_start, tmp, model_dir, "async", to_sidecar, async_scheduling=True)
        sync_f = pool.submit(_start, tmp, model_dir, "sync", _vllm_ipc_dir())
        fast, sync = async_f.result(), sync_f.result()
    try:
        yield fast, sync
    finally:
        sync.server.stop()
        left = _ipc_paths(fast.server)
        fast.server.signal(signal.SIGTERM)  # what an orchestrator sends the server
        fast.server.proc.wait(timeout=60)
        log = fast.server.log_tail(400_000)
        fast.server.stop()  # stragglers, if any
        _assert_nothing_left(fast, left, log)


def _vllm_ipc_dir() -> dict[str, str]:
    """Where vLLM puts its ZMQ ipc sockets (``VLLM_RPC_BASE_PATH``, default the temporary
    directory): vLLM 0.33 leaves them behind after SIGTERM/SIGINT with or without
    kvsidecar, so they go to a directory of their own (short: a socket path has at most
    107 bytes), told apart by its name and removed at the end of the module."""
    ipc = tempfile.mkdtemp(prefix=VLLM_IPC)
    _IPC_DIRS.append(ipc)
    return {"VLLM_RPC_BASE_PATH": ipc}


@pytest.fixture(scope="module", autouse=True)
def _remove_vllm_ipc_dirs() -> Iterator[None]:
    yield
    for ipc in _IPC_DIRS:
        shutil.rmtree(ipc, ignore_errors=True)


def _ipc_paths(server: VllmServer) -> set[str]:
    """The unix socket paths bound and the /dev/shm files held by the server's processes,
    read from /proc (the control socket, vLLM's ZMQ ipc sockets, shared memory)."""
    inodes: set[str] = set()
    paths: set[str] = set()
    for pid in server.pids():
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
            elif target.startswith("/dev/shm/"):
                paths.add(target.removesuffix(" (deleted)"))
        for line in maps.splitlines():
            mapped = line.split(maxsplit=5)[5:] or [""]
            if mapped[0].startswith("/dev/shm/"):
                paths.add(mapped[0].removesuffix(" (deleted)"))
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            paths.add(fields[7])
    return paths


def _assert_nothing_left(engine: Engine, held: set[str], log: str) -> None:
    """Every socket and shared-memory file the server held is gone, but vLLM's own ipc
    sockets (left by vLLM itself, see _vllm_ipc_dir); the instance's directory too."""
    assert engine.socket_path.as_posix() in held  # the control socket was among them
    wait_until(
        lambda: not engine.server.pids(), timeout_s=30, what="every process of the server exited"
    )
    ours = {p for p in held if not Path(p).parent.name.startswith(VLLM_IPC)}
    assert sorted(p for p in ours if os.path.exists(p)) == [], log[-4000:]
    assert not engine.socket_path.parent.exists(), sorted(engine.socket_path.parent.iterdir())
    assert "ForeignThreadError" not in log, "the block pool was mutated off its thread"


def _exits_or_says_why(engine: Engine, timeout_s: float) -> None:
    """Wait for the server process; if it outlives ``timeout_s``, fail with what is still
    running and the end of its log, so a rare hang says where it stood (a bare
    ``TimeoutExpired`` said nothing, once, in CI)."""
    try:
        engine.server.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        import psutil  # type: ignore[import-untyped]

        alive = []
        for pid in engine.server.pids():
            try:
                proc = psutil.Process(pid)
                alive.append(
                    f"{pid} {proc.name()} {proc.status()} {' '.join(proc.cmdline())[:120]}"
                )
            except psutil.Error:
                continue
        pytest.fail(
            f"the server did not exit within {timeout_s:g} s of the signal; still running:\n"
            + "\n".join(alive)
            + "\nlog tail:\n"
            + engine.server.log_tail(8000)
        )


def _complete_texts(engine: Engine, prompts: list[str], max_tokens: int) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: engine.complete(p, max_tokens=max_tokens), prompts))
    return [r["choices"][0]["text"] for r in replies]


def _stream(
    engine: Engine,
    prompt: str,
    max_tokens: int,
    stop_after: int | None = None,
    started: threading.Semaphore | None = None,
) -> str:
    """A streamed completion's text; ``stop_after`` chunks: the client goes away (an abort).
    ``started`` is released once, when the first chunk arrives (the request runs)."""
    text: list[str] = []
    body = {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream(
        "POST", engine.server.base_url + "/v1/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
            if started is not None and len(text) == 1:
                started.release()
            if stop_after is not None and len(text) >= stop_after:
                return "disconnected"
    return "".join(text)


def stream_through_limits(
    engine: Engine,
    api: httpx.Client,
    instance_id: str,
    prompts: list[str],
    *,
    max_tokens: int,
    dropped: int,
    full: int,
    bundle: int,
    after_each: Callable[[], None] = lambda: None,
) -> tuple[list[str], list[str]]:
    """Stream ``prompts``, and ``dropped`` clients that leave early, while the sidecar sets
    limits from half of ``full`` down to one page bundle and lifts them: each limit reaches
    the engine while it generates; the smallest leave requests waiting for memory (they do
    not fit under them) until the last raise. ``after_each`` runs after each limit is
    taken. Returns the streamed texts and the dropped clients' outcomes."""
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(_stream, engine, p, max_tokens, None, started) for p in prompts]
        leaving = [
            pool.submit(_stream, engine, f"{DOC} dropped {i}", 2000, stop_after=10 + 20 * i)
            for i in range(dropped)
        ]
        # Requests run when the limits land: four streams have their first token, and each
        # has up to max_tokens more to go. The clients tell, not GET /state: one CI run saw
        # no count >= 4 there within 10 s, and on a loaded machine one GET /state from this
        # test took up to 1.2 s.
        for n in range(4):
            assert started.acquire(timeout=120), f"only {n} streams got a first token in 120 s"
        for limit in (full // 2, 4 * bundle, full // 3, bundle, None):
            if limit is None:
                reply = api.delete(f"/instances/{instance_id}/limit")
            else:
                reply = api.put(f"/instances/{instance_id}/limit", json={"limit": limit})
            assert reply.status_code in (200, 202), reply.text
            wait_until(lambda v=limit: engine.state()["limit_bytes"] == v, what=f"limit {limit}")
            after_each()
        return [f.result() for f in streams], [f.result() for f in leaving]


def test_the_server_runs_the_async_scheduling_loop(engines: tuple[Engine, Engine]) -> None:
    fast, sync = engines
    fast.complete("warm up", max_tokens=2)
    sync.complete("warm up", max_tokens=2)
    assert ASYNC_LOOP in fast.server.log_text()
    assert LOOP_LOG not in sync.server.log_text()  # the harness plugin is off there


def test_outputs_match_the_synchronous_server(engines: tuple[Engine, Engine]) -> None:
    fast, sync = engines
    prompts = [f"{DOC} {q}" for q in QUESTIONS] + [
        make_document(150, seed=70 + i) for i in range(4)
    ]
    for engine in (fast, sync):
        engine.reset()
    reference = _complete_texts(sync, prompts, 48)
    assert _complete_texts(fast, prompts, 48) == reference
    assert _complete_texts(fast, prompts, 48) == reference  # now from the prefix cache


def test_sidecar_limits_while_streaming_with_disconnects(
    engines: tuple[Engine, Engine], module_sidecar_url: str
) -> None:
    fast, sync = engines
    fast.reset()
    api = httpx.Client(base_url=module_sidecar_url, timeout=30)
    kept = [f"{DOC} {q} streamed {i}" for i, q in enumerate(QUESTIONS * 2)]
    reference = _complete_texts(sync, kept, 256)
    _fill_prefix_cache(fast)
    full = fast.state()["mapped_bytes"]
    bundle = fast.state()["page_bundle_bytes"]
    texts, outcomes = stream_through_limits(
        fast, api, "async", kept, max_tokens=256, dropped=8, full=full, bundle=bundle
    )
    assert outcomes == ["disconnected"] * 8
    assert texts == reference
    # the dropped requests were aborted: nothing is left in the engine
    wait_until(lambda: fast.requests_in_flight() == 0, what="the API server holds no request")
    state = fast.state()
    assert state["num_running_requests"] == 0 and state["num_waiting_requests"] == 0
    reply = api.put("/instances/async/limit", params={"wait": "20"}, json={"limit": full // 4})
    assert reply.status_code == 200 and reply.json()["status"] == "applied", reply.text
    assert fast.server.kv_memfd_bytes() <= full // 4
    assert api.delete("/instances/async/limit").status_code in (200, 202)


def test_limit_zero_while_idle_is_applied_by_the_idle_callback(
    engines: tuple[Engine, Engine],
) -> None:
    fast, _ = engines
    fast.reset()
    _fill_prefix_cache(fast)
    assert fast.server.kv_memfd_bytes() > 4 * fast.state()["page_bundle_bytes"]
    wait_until(lambda: fast.requests_in_flight() == 0, what="idle")
    revision = fast.set_limit(0)  # no request comes: only the idle callback can apply it
    drained = fast.wait_state(revision, status="applied")
    assert drained["effective_limit_bytes"] == drained["floor_bytes"]
    assert fast.server.kv_memfd_bytes() == drained["page_bundle_bytes"]  # the null page
    raised = fast.set_limit(None)
    fast.wait_state(raised, status="applied")
    assert fast.complete(f"{DOC} after the drain", max_tokens=4)["usage"]["completion_tokens"] == 4


def test_limit_below_running_requests_deferred_then_applied(
    engines: tuple[Engine, Engine],
) -> None:
    fast, sync = engines
    fast.reset()
    prompts = [make_document(300, seed=200 + i) for i in range(8)]
    reference = _complete_texts(sync, prompts, 600)
    bundle = fast.state()["page_bundle_bytes"]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(fast.complete, p, 600) for p in prompts]
        busy: dict[str, Any] = wait_until(
            lambda: (s := fast.state())["num_running_requests"] >= 4 and s,
            what="requests running",
            timeout_s=60,
            period_s=0.005,
        )
        limit = busy["pinned_bytes"] - 2 * bundle  # below what the running batch pins
        revision = fast.set_limit(limit)
        first = fast.wait_state(revision, status="deferred")
        texts = [f.result()["choices"][0]["text"] for f in futures]
    assert first["reason"] == "running_requests", first
    applied = fast.wait_state(revision, status="applied")
    assert applied["mapped_bytes"] <= limit
    assert fast.server.kv_memfd_bytes() == applied["mapped_bytes"]
    assert texts == reference
    fast.wait_state(fast.set_limit(None), status="applied")


def test_sigint_to_the_process_group_leaves_nothing_behind(tmp_path: Path, model_dir: Path) -> None:
    """Ctrl-C in the terminal: SIGINT to every process of the group, mid-generation."""
    engine = _start(tmp_path, model_dir, "async-int", _vllm_ipc_dir(), async_scheduling=True)
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(_stream, engine, f"{DOC} interrupted", 2000, stop_after=None)
            wait_until(lambda: engine.state()["num_running_requests"] >= 1, what="a request runs")
            held = _ipc_paths(engine.server)
            os.killpg(engine.server.proc.pid, signal.SIGINT)
            _exits_or_says_why(engine, timeout_s=60)
    finally:
        log = engine.server.log_tail(400_000)
        engine.server.stop()
    assert ASYNC_LOOP in engine.server.log_text()
    _assert_nothing_left(engine, held, log)
