"""ElasticInstance: runtime dir, socket life cycle, in-process API, signal cleanup."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_pool import BUNDLE, Pool
from support.hangup import with_default_hangup

from engine_ext import ElasticInstance, EngineBinding, EngineExtConfigError, load_engine_settings
from engine_ext.protocol import Status

ROOT = Path(__file__).resolve().parents[3]


def make(pool: Pool, tmp_path: Path, **kw: object) -> ElasticInstance:
    settings = load_engine_settings(instance_id="inst-1", runtime_dir=tmp_path / "rt", **kw)
    return ElasticInstance(settings, EngineBinding("vllm", "0.33.0", pool.blocks, (pool.cache,)))


def test_start_makes_private_dir_and_close_removes_it(pool: Pool, tmp_path: Path) -> None:
    inst = make(pool, tmp_path)
    inst.start()
    try:
        assert stat.S_IMODE(os.stat(inst.runtime_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(inst.socket_path).st_mode) == 0o600
        assert inst.runtime_dir == tmp_path / "rt" / "inst-1"
    finally:
        inst.close()
    assert not inst.runtime_dir.exists()
    inst.close()  # idempotent


def test_set_limit_from_any_thread_only_publishes(pool: Pool, tmp_path: Path) -> None:
    pool.fill(5)
    inst = make(pool, tmp_path)
    inst.start()
    try:
        inst.step()
        results = []
        t = threading.Thread(target=lambda: results.append(inst.set_limit(BUNDLE)), name="api")
        t.start()
        t.join()
        assert results[0].status is Status.DEFERRED and pool.cache.num_evicted == 0
        assert inst.step().status is Status.APPLIED
        assert pool.backend.mapped_bytes() == BUNDLE
    finally:
        inst.close()


def test_runtime_dir_that_is_a_file_is_a_config_error(pool: Pool, tmp_path: Path) -> None:
    (tmp_path / "rt").write_text("not a dir")
    inst = make(pool, tmp_path)
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_RUNTIME_DIR"):
        inst.start()


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout
    from engine_ext import ElasticInstance, EngineBinding, load_engine_settings
    backend = HostBackend.reserve(PageLayout(page_bytes=65536, num_pages=4))
    blocks = BlockAllocator(PageAllocator(backend), 4)
    settings = load_engine_settings(instance_id="sig", runtime_dir=sys.argv[1])
    inst = ElasticInstance(settings, EngineBinding("vllm", "0.33.0", blocks))
    inst.start()
    inst.install_signal_cleanup()
    print(inst.socket_path, flush=True)
    sys.stdin.readline()
    """
)


def _engine_child(code: str, runtime_dir: Path) -> subprocess.Popen[str]:
    """``code`` (an engine with its instance started) in a child interpreter: it prints
    the socket path, then waits on stdin. SIGHUP at its default, as from a terminal, even
    when this test run ignores it (nohup)."""
    return subprocess.Popen(
        with_default_hangup([sys.executable, "-c", code, str(runtime_dir)]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_removes_socket_and_dir(tmp_path: Path, signum: int) -> None:
    """Also SIGHUP: a terminal that closes under the engine ends it by default; that left
    the socket and the dir behind."""
    with _engine_child(_CHILD, tmp_path) as child:
        try:
            assert child.stdout is not None
            socket_path = Path(child.stdout.readline().strip())
            assert socket_path.is_socket()
            child.send_signal(signum)
            child.wait(timeout=30)
        finally:
            child.kill()
    assert child.returncode in (-signum, 1)  # SIGINT: KeyboardInterrupt exits 1
    assert not socket_path.exists() and not socket_path.parent.exists()


def test_an_ignored_hangup_stays_ignored(tmp_path: Path) -> None:
    """Under ``nohup`` (SIGHUP ignored) a hangup must neither end the engine nor take its
    socket: the cleanup is chained to SIGHUP only where the hangup would end it."""
    child_code = _CHILD.replace(
        "inst.start()", "signal.signal(signal.SIGHUP, signal.SIG_IGN)\ninst.start()"
    )
    assert child_code != _CHILD
    with _engine_child(child_code, tmp_path) as child:
        try:
            assert child.stdout is not None
            socket_path = Path(child.stdout.readline().strip())
            child.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert child.poll() is None and socket_path.is_socket()
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=30)
        finally:
            child.kill()
    assert not socket_path.exists()


def test_failed_start_leaves_nothing_behind(pool: Pool, tmp_path: Path) -> None:
    first = make(pool, tmp_path)
    first.start()
    try:
        second = make(pool, tmp_path)  # same instance id: the socket is taken
        with pytest.raises(EngineExtConfigError, match="INSTANCE_ID"):
            second.start()
        assert Path(first.socket_path).is_socket()  # the live one is untouched
    finally:
        first.close()
    assert not first.runtime_dir.exists()


def test_a_failed_unmap_during_a_pass_is_logged_not_fatal(
    pool: Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass runs in the engine's idle callbacks: an OS/driver error must not end it."""
    from allocator import BackendError

    pool.fill(4)
    inst = make(pool, tmp_path)
    real_unmap_many = pool.backend.unmap_many

    def failing(pages: object) -> None:
        raise BackendError("punch hole failed (injected)")

    monkeypatch.setattr(pool.backend, "unmap_many", failing)
    monkeypatch.setattr(pool.backend, "unmap", failing)
    revision = inst.set_limit(BUNDLE).revision
    state = inst.step()  # no exception
    assert (state.status, state.reason, state.revision) == (
        Status.DEFERRED,
        "backend_error",
        revision,
    )  # the target is held, truthfully
    monkeypatch.undo()
    assert pool.backend.unmap_many == real_unmap_many
    deadline = time.monotonic() + 5
    while inst.step().status is not Status.APPLIED and time.monotonic() < deadline:
        time.sleep(0.01)  # the next passes retry on their own (no new revision)
    assert inst.state().status is Status.APPLIED
    assert pool.backend.mapped_bytes() <= BUNDLE


_FORKING_CHILD = textwrap.dedent(
    """
    import json, os, signal, socket, sys, time
    from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout
    from engine_ext import ElasticInstance, EngineBinding, load_engine_settings
    backend = HostBackend.reserve(PageLayout(page_bytes=65536, num_pages=4))
    blocks = BlockAllocator(PageAllocator(backend), 4)
    settings = load_engine_settings(
        instance_id="forks", runtime_dir=sys.argv[1], sidecar_url=sys.argv[2] or None
    )
    inst = ElasticInstance(settings, EngineBinding("vllm", "0.33.0", blocks))
    inst.start()
    inst.install_signal_cleanup()
    pid = os.fork()
    if pid == 0:  # a helper the engine forked, ending as Python programs do
        if sys.argv[3] == "signal":
            os.kill(os.getpid(), signal.SIGTERM)  # as a kill of the process group does
            time.sleep(5)
        sys.exit(0)  # atexit handlers run here
    _, status = os.waitpid(pid, 0)
    answer = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(inst.socket_path)
            s.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
            answer = s.recv(100)
    except OSError as exc:
        answer = repr(exc).encode()
    print(json.dumps({
        "socket": os.path.exists(inst.socket_path),
        "dir": inst.runtime_dir.exists(),
        "answer": answer.decode(errors="replace").split("\\r\\n")[0],
    }), flush=True)
    sys.stdin.readline()
    inst.close()
    """
)


@pytest.mark.parametrize("how", ["exit", "signal"])
def test_a_forked_helper_that_ends_leaves_the_engine_its_socket_dir_and_registration(
    tmp_path: Path, how: str
) -> None:
    """A process the engine forks after start-up (a helper, a library's worker) inherits
    the atexit hook and the SIGTERM/SIGINT handler. Ending normally, or on SIGTERM, ran
    them in the helper: it unlinked the engine's control socket, removed its runtime dir
    and deregistered the instance (``stopped``) while the engine ran on, deaf to pushes.
    Only the process that started the instance closes it now."""
    from support import ThreadedSidecar

    from sidecar import SidecarSettings

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [sys.executable, "-c", _FORKING_CHILD, str(tmp_path / "rt")]
    with (
        ThreadedSidecar(SidecarSettings(db_path=tmp_path / "s.db")) as sidecar,
        subprocess.Popen(
            [*args, sidecar.url, how],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        ) as child,
    ):
        try:
            assert child.stdout is not None and child.stdin is not None
            seen = json.loads(child.stdout.readline())
            status = httpx.get(f"{sidecar.url}/instances/forks").json()["status"]
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.wait(timeout=30) == 0
        finally:
            child.kill()
    assert seen == {"socket": True, "dir": True, "answer": "HTTP/1.1 200 OK"}, seen
    assert status != "stopped", status
