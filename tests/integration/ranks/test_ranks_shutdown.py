"""Clean shutdown of an instance with rank processes (issue 7).

Real processes: the instance host (``_host.py``: ``ElasticInstance``, control
socket, ``RankGroup`` with two rank processes sharing a memfd) in its own
process group. Nothing of it may survive SIGINT or SIGTERM to the group: no
file in its runtime dir, no memfd in any ``/proc/*/fd`` or ``/proc/*/maps``,
no ``/dev/shm`` segment. A ``kill -9`` leftover is swept at the next start,
and a live neighbour's files are never touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import wait_until

from engine_ext._runtime_dir import OWNER_FILE
from engine_ext.ranks.__main__ import SIGNAL_GRACE_S

from ._toy import BLOCK_SIZE, ToyEngine

REPO = Path(__file__).resolve().parents[3]


def _start(root: Path, instance_id: str, memfd: str) -> tuple[subprocess.Popen[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.ranks._host", str(root), instance_id, memfd],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY "), f"host did not start (exit {proc.poll()}): {line!r}"
    return proc, json.loads(line[6:])


def _memfd_holders(name: str) -> list[str]:
    """Every /proc/<pid>/fd or /proc/<pid>/maps entry that still refers to memfd ``name``."""
    found: list[str] = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{name} "):
                    found.append(f"{pid}/fd/{fd}")
            with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
                if f"/memfd:{name} " in maps.read():
                    found.append(f"{pid}/maps")
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_twenty_start_stop_cycles_leave_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    for cycle in range(20):
        memfd = f"kvs-cycle-{os.getpid()}-{cycle}"
        proc, info = _start(root, "cyc", memfd)
        try:
            _stop_cycle(root / "cyc", proc, info, memfd, cycle)
        finally:
            _kill_group(proc)
    assert list(root.iterdir()) == [], "the rank sockets' private dirs must be gone too"
    new_shm = set(os.listdir("/dev/shm")) - shm_before
    assert not [n for n in new_shm if "kvs" in n or "cyc" in n], new_shm


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """Test teardown: nothing of a failed cycle may outlive the test."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)
    _close_pipe(proc)


def _close_pipe(proc: subprocess.Popen[str]) -> None:
    """The host's stdout pipe is ours to close once it exited (not the collector's)."""
    if proc.stdout is not None:
        proc.stdout.close()


def _stop_cycle(
    run_dir: Path, proc: subprocess.Popen[str], info: dict, memfd: str, cycle: int
) -> None:
    """Check the running instance, signal its group, check nothing is left."""
    assert sorted(p.name for p in run_dir.iterdir()) == [OWNER_FILE, "control.sock"]
    assert _memfd_holders(memfd), "the memfd should be mapped while the instance runs"
    with httpx.Client(transport=httpx.HTTPTransport(uds=info["socket"])) as client:
        assert client.get("http://engine/state").json()["num_ranks"] == 2
    sig = signal.SIGINT if cycle % 2 == 0 else signal.SIGTERM
    os.killpg(proc.pid, sig)
    proc.wait(20)
    _close_pipe(proc)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in info["ranks"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(p) for p in info["ranks"]), f"cycle {cycle}: a rank outlived {sig!r}"
    assert not run_dir.exists() or not list(run_dir.iterdir()), (
        f"cycle {cycle} ({sig.name}) left {list(run_dir.iterdir())}"
    )
    assert not run_dir.exists(), f"cycle {cycle} ({sig.name}) left the empty runtime dir"
    assert _memfd_holders(memfd) == [], f"cycle {cycle} ({sig.name}): memfd still held"


def test_kill9_leftover_is_swept_at_next_start_live_neighbour_untouched(tmp_path: Path) -> None:
    root = tmp_path / "run"
    neighbour, _ = _start(root, "alive", f"kvs-alive-{os.getpid()}")
    crashed, info = _start(root, "crashed", f"kvs-crashed-{os.getpid()}")
    try:
        os.killpg(crashed.pid, signal.SIGKILL)
        crashed.wait(10)
        _close_pipe(crashed)
        assert sorted(p.name for p in (root / "crashed").iterdir()) == [OWNER_FILE, "control.sock"]
        deadline = time.monotonic() + 10  # ranks notice the end of the stream and exit
        while any(_alive(p) for p in info["ranks"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(_alive(p) for p in info["ranks"])
        (root / "foreign").mkdir()  # no owner record: not ours to judge, left alone
        nxt, _ = _start(root, "next", f"kvs-next-{os.getpid()}")
        try:
            assert not (root / "crashed").exists(), "the kill -9 leftover was not swept"
            assert sorted(p.name for p in (root / "alive").iterdir()) == [
                OWNER_FILE,
                "control.sock",
            ]
            assert (root / "foreign").is_dir()
        finally:
            os.killpg(nxt.pid, signal.SIGTERM)
            nxt.wait(20)
            _close_pipe(nxt)
    finally:
        os.killpg(neighbour.pid, signal.SIGTERM)
        neighbour.wait(20)
        _close_pipe(neighbour)
    assert sorted(p.name for p in root.iterdir()) == ["foreign"]


def test_kill9_of_the_engine_alone_ends_every_rank_even_a_stopped_one(tmp_path: Path) -> None:
    """``kill -9`` of the engine process only (not its group): a running rank reads the end
    of its socket and exits; a stopped one (SIGSTOP, a debugger) or one hung in a call never
    reads it, and held the KV memfd until someone continued it. The kernel ends it (the
    parent-death signal). Checked in the filesystem and /proc: no rank, no memfd holder,
    nothing in /dev/shm, only the engine's own runtime dir (swept at the next start)."""
    root = tmp_path / "run"
    memfd = f"kvs-k9-alone-{os.getpid()}"
    shm_before = set(os.listdir("/dev/shm"))
    proc, info = _start(root, "k9", memfd)
    try:
        os.kill(info["ranks"][1], signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _close_pipe(proc)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in info["ranks"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [_alive(p) for p in info["ranks"]] == [False, False]
        assert _memfd_holders(memfd) == []
        assert sorted(p.name for p in root.iterdir()) == ["k9"]  # no .ranks-* dir
        assert sorted(p.name for p in (root / "k9").iterdir()) == [OWNER_FILE, "control.sock"]
        assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if "kvs" in n]
    finally:
        for pid in info["ranks"]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        _kill_group(proc)


def test_a_rank_started_through_a_wrapper_process_serves(tmp_path: Path) -> None:
    """A launcher that forks the rank (not exec) is its parent, not the engine: the rank must
    not take that for "the engine is gone" and exit (the start-up then failed)."""
    from ._accepting import accept_ranks

    path = str(tmp_path / "r.sock")
    rank = [sys.executable, "-m", "engine_ext.ranks", "--socket", path, "--rank", "0"]
    wrapper = [
        sys.executable,
        "-c",
        "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))",
    ]
    group, (proc,) = accept_ranks(
        path,
        lambda: [
            subprocess.Popen(
                [*wrapper, *rank, "--parent-pid", str(os.getpid())],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        ],
    )
    try:
        group.call("probe", 30.0)
    finally:
        group.close()
    assert proc.returncode == 0


def test_ranks_spawned_from_a_short_lived_thread_outlive_it(tmp_path: Path) -> None:
    """The parent-death signal follows the *thread* that started a process: ranks tied to a
    thread that then ends were killed with it, while the engine lived on. Spawned from any
    thread but the main one, the ranks are not tied (they end with their socket)."""
    import threading

    from engine_ext.ranks import RankGroup

    made: list[RankGroup] = []
    starter = threading.Thread(
        target=lambda: made.append(RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30)),
        name="short-lived",
    )
    starter.start()
    starter.join(60)
    assert made, "the ranks did not start"
    group = made[0]
    try:
        time.sleep(0.5)  # a rank tied to the ended thread is SIGKILLed by now
        group.call("probe", 30.0)
        assert [state.alive for state in group.states()] == [True, True]
    finally:
        group.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_group_leaves_the_ranks_serving_until_the_engine_closes(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C (SIGINT) or a service manager's stop (SIGTERM) reaches every process of the
    group, the ranks with the engine, which may be in a step just then: the ranks must
    still serve it (a rank that exited at once failed that step, and vLLM's EngineCore
    ended with a fatal dead-rank error instead of its orderly shutdown), and exit when
    the engine closes the stream."""
    engine = ToyEngine(tmp_path, 2, 1)
    pids = engine.group.pids
    try:
        req = engine.admit([100 + i for i in range(3 * BLOCK_SIZE)])
        assert req is not None
        for pid in pids:  # delivered before a rank reads the next op: its handler runs first
            os.kill(pid, sig)
        engine.decode(req, 2 * BLOCK_SIZE)  # steps and a map of a new page, on every rank
        engine.finish(req)
        engine.backend.probe(timeout_s=30)  # every rank alive, its /proc view as acked
        assert not engine.group.any_dead()
    finally:
        engine.close()
    # the engine closed the stream: the ranks exit now, well before their grace ends
    wait_until(
        lambda: not any(_alive(p) for p in pids),
        timeout_s=SIGNAL_GRACE_S / 2,
        what="the ranks to exit when the engine closed",
    )
