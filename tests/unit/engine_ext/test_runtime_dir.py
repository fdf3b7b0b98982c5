"""RuntimeDir: one owner of a runtime dir (modes, owner record, sweep, removal), with real
processes as owners: a live one, one killed with SIGKILL, one ended by SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from engine_ext import EngineExtConfigError
from engine_ext._runtime_dir import (
    OWNER_FILE,
    RANK_SOCKET_FILE,
    SOCKET_FILE,
    RuntimeDir,
    owner_alive,
)

ROOT = Path(__file__).resolve().parents[3]

#: A child that owns ``root/<name>`` with a bound control socket, then waits on stdin.
_OWNER = textwrap.dedent(
    """
    import signal, socket, sys
    from pathlib import Path
    from engine_ext._runtime_dir import SOCKET_FILE, RuntimeDir
    rd = RuntimeDir(Path(sys.argv[1]) / sys.argv[2]).create()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(rd.file(SOCKET_FILE)))
    if sys.argv[3] == "signals":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        rd.remove_on_signals()
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def _owner(root: Path, name: str, mode: str = "plain") -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(root), name, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def _stop(child: subprocess.Popen[str]) -> None:
    child.kill()  # no-op if it already ended
    child.wait(timeout=30)
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            pipe.close()


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_create_makes_a_private_dir_with_a_private_owner_record(tmp_path: Path) -> None:
    rd = RuntimeDir(tmp_path / "root" / "inst").create()
    assert _mode(rd.path) == 0o700 and _mode(tmp_path / "root") == 0o700
    assert _mode(rd.file(OWNER_FILE)) == 0o600
    assert owner_alive(rd.path) is True
    assert [p.name for p in rd.path.iterdir()] == [OWNER_FILE]  # no temporary left
    rd.remove()
    assert not rd.path.exists() and (tmp_path / "root").exists()


def test_an_existing_dir_is_made_private_again(tmp_path: Path) -> None:
    (tmp_path / "inst").mkdir(mode=0o755)
    os.chmod(tmp_path / "inst", 0o755)
    rd = RuntimeDir(tmp_path / "inst").create()
    assert _mode(rd.path) == 0o700


def test_create_unique_dirs_are_private_owned_and_distinct(tmp_path: Path) -> None:
    root = tmp_path / "rt"
    a = RuntimeDir.create_unique(root, ".ranks-x-")
    b = RuntimeDir.create_unique(root, ".ranks-x-")
    assert a.path != b.path and a.path.parent == b.path.parent == root
    assert a.path.name.startswith(".ranks-x-")
    assert _mode(a.path) == 0o700 and _mode(a.file(OWNER_FILE)) == 0o600
    a.remove()
    b.remove()
    assert list(root.iterdir()) == []


def test_sweep_removes_a_killed_owners_dir_and_keeps_a_live_ones(tmp_path: Path) -> None:
    live = _owner(tmp_path, "live")
    killed = _owner(tmp_path, "killed")
    try:
        killed.kill()  # SIGKILL: no handler runs, the dir and its socket stay
        killed.wait(timeout=30)
        assert (tmp_path / "killed" / SOCKET_FILE).is_socket()
        me = RuntimeDir(tmp_path / "me").create()
        assert me.sweep_siblings() == [tmp_path / "killed"]
        assert not (tmp_path / "killed").exists()
        assert (tmp_path / "live" / SOCKET_FILE).is_socket()  # a live owner's: untouched
        assert owner_alive(tmp_path / "live") is True
        assert me.path.exists()
    finally:
        _stop(live)
        _stop(killed)


def test_sigterm_with_the_default_handler_removes_the_dir_and_still_ends_the_process(
    tmp_path: Path,
) -> None:
    child = _owner(tmp_path, "sig", "signals")
    try:
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=30)
    finally:
        _stop(child)
    assert child.returncode == -signal.SIGTERM  # died of the signal, as without us
    assert not (tmp_path / "sig").exists()


def test_remove_now_takes_the_sockets_too(tmp_path: Path) -> None:
    rd = RuntimeDir(tmp_path / "inst").create()
    for name in (SOCKET_FILE, RANK_SOCKET_FILE):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(rd.file(name)))
    rd.remove_now()
    assert not rd.path.exists()
    rd.remove_now()  # again: nothing left, no error
    rd.remove()


def test_remove_keeps_a_dir_holding_anything_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rd = RuntimeDir(tmp_path / "inst").create()
    (rd.path / "notes.txt").write_text("someone else's")
    with caplog.at_level("WARNING", logger="engine_ext.runtime_dir"):
        rd.remove()
    assert sorted(p.name for p in rd.path.iterdir()) == ["notes.txt"]  # owner record gone
    assert "left" in caplog.text


def test_remove_leaves_another_processes_owner_record(tmp_path: Path) -> None:
    live = _owner(tmp_path, "shared")
    try:
        RuntimeDir(tmp_path / "shared").remove()  # not ours: the record and dir stay
        assert (tmp_path / "shared" / OWNER_FILE).exists()
    finally:
        _stop(live)


def test_a_runtime_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "root").write_text("a file")
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_RUNTIME_DIR"):
        RuntimeDir.create_unique(tmp_path / "root", ".ranks-")
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_RUNTIME_DIR"):
        RuntimeDir(tmp_path / "root" / "inst").create()


def test_a_live_owners_dir_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """A second engine with the same id must fail without touching the first's files:
    taking over ``.owner`` let its cleanup remove the live engine's record, after which a
    crash of the live engine left a dir no sweep would ever remove."""
    from engine_ext import EngineExtConfigError

    live = _owner(tmp_path, "dup")
    try:
        record = (tmp_path / "dup" / OWNER_FILE).read_text()
        second = RuntimeDir(tmp_path / "dup")
        with pytest.raises(EngineExtConfigError, match=rf"pid {live.pid}.*KVSIDECAR_INSTANCE_ID"):
            second.create()
        second.remove()  # what a failed start's close does
        assert (tmp_path / "dup" / OWNER_FILE).read_text() == record
        assert (tmp_path / "dup" / SOCKET_FILE).is_socket()
        live.kill()  # the live engine crashes: its dir is a leftover the next start sweeps
        live.wait(timeout=30)
        assert RuntimeDir(tmp_path / "next").create().sweep_siblings() == [tmp_path / "dup"]
    finally:
        _stop(live)


def test_two_owners_in_one_process_are_told_apart(tmp_path: Path) -> None:
    from engine_ext import EngineExtConfigError

    first = RuntimeDir(tmp_path / "inst").create()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(first.file(SOCKET_FILE)))
    second = RuntimeDir(tmp_path / "inst")
    with pytest.raises(EngineExtConfigError, match="already owns"):
        second.create()
    second.remove()
    second.remove_now()  # a signal in the failed one: the first one's socket stays
    assert owner_alive(first.path) is True  # the first one's record is still there
    assert first.file(SOCKET_FILE).is_socket()
    sock.close()
    first.remove_now()
    assert not first.path.exists()
    first.remove()
    assert not first.path.exists()
    assert second.create().path.exists()  # free again: the second may take it
    second.remove()


def test_a_sweep_never_removes_what_a_start_creates_while_it_judges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of two crashed engines restarted together: A's sweep has judged dir ``x``
    stale (its owner is dead) when B, restarting as ``x``, creates it and binds its socket.
    B starts inside the sweep, right before the removal, on another thread; B's start must
    never lose its record or its socket to that sweep (it removed both by name)."""
    from engine_ext import _runtime_dir

    root = tmp_path / "run"
    crashed = _owner(root, "x")  # x's owner dies with SIGKILL: a stale dir with a socket
    _stop(crashed)
    assert owner_alive(root / "x") is False
    started = threading.Event()
    result: dict[str, object] = {}

    def start_b() -> None:
        try:
            rd = RuntimeDir(root / "x").create()
            (root / "x" / SOCKET_FILE).unlink(missing_ok=True)  # what ControlServer does
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(str(rd.file(SOCKET_FILE)))
            result["dir"], result["sock"] = rd, sock
        except Exception as exc:  # noqa: BLE001  (reported below)
            result["error"] = exc
        finally:
            started.set()

    real_remove = _runtime_dir._remove_instance_dir
    b = threading.Thread(target=start_b)

    def remove_after_b_starts(path: Path) -> bool:
        b.start()
        started.wait(timeout=1.0)  # B either starts now (nothing holds it back) or waits
        return real_remove(path)

    monkeypatch.setattr(_runtime_dir, "_remove_instance_dir", remove_after_b_starts)
    RuntimeDir(root / "a").create().sweep_siblings()
    b.join(timeout=30)
    assert "error" not in result, result
    rd = result["dir"]
    assert isinstance(rd, RuntimeDir)
    try:
        assert (root / "x" / SOCKET_FILE).exists() and owner_alive(root / "x") is True
        assert stat.S_ISSOCK(os.lstat(root / "x" / SOCKET_FILE).st_mode)
        assert RuntimeDir(root / "y").create().sweep_siblings() == []  # x is live: kept
    finally:
        sock = result["sock"]
        assert isinstance(sock, socket.socket)
        sock.close()
        rd.remove_now()
    assert not (root / "x").exists()


def test_a_live_owner_holding_the_lock_is_refused_at_once_with_its_pid(tmp_path: Path) -> None:
    """While a live engine holds ``x``, a second start is refused at once with the owner's
    pid, even though the lock alone cannot say who holds it."""
    root = tmp_path / "run"
    live = _owner(root, "x")
    try:
        with pytest.raises(EngineExtConfigError, match=rf"pid {live.pid}"):
            RuntimeDir(root / "x").create()
        assert (root / "x" / SOCKET_FILE).exists() and owner_alive(root / "x") is True
    finally:
        _stop(live)
    again = RuntimeDir(root / "x").create()  # its owner is gone: taken over
    again.remove_now()  # with the dead owner's socket
    assert not (root / "x").exists()
