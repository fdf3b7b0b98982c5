"""A rank that stops reading its socket (SIGSTOP, a debugger, a hang), with real processes.

The engine must never block on it without bound: once the rank's socket buffer
is full, a send that makes no progress for ``send_timeout_s`` declares the rank
dead (and kills it, so it maps nothing); the other rank and the owner's memfd
stay in step, checked from each process's ``/proc``. A rank stopped only
briefly, whose socket still takes what is sent, is slow, not dead. Nothing is
left behind: descriptors, processes, the socket file, the memfd.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from allocator import BackendError, HostBackend, PageLayout
from engine_ext.ranks import RankChannelError, RankedBackend, RankGroup, memfd_view
from engine_ext.ranks._group import _Rank

from ._accepting import accept_ranks

LAYOUT = PageLayout(page_bytes=4096, num_pages=8, num_regions=2)
BLOCK_BYTES = 1024  # 4 blocks per page: block 4 is the first of page 1
WRITES = 25_000  # one step: 300 KB of KV writes, more than a socket buffer (208 KiB) holds


def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _view_pages(pid: int, name: str) -> int:
    """Pages ``pid`` maps of memfd ``name``, from its /proc/<pid>/maps (every region)."""
    return sum(length for _, length in memfd_view(pid, name)) // LAYOUT.bundle_bytes


def _own_maps_name(name: str) -> bool:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        return f"/memfd:{name}" in maps.read()


def test_a_stopped_rank_is_declared_dead_after_the_send_timeout_and_nothing_leaks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    name = "kvs-stopped"
    fds = _fds()
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30, send_timeout_s=1.0)
    owner = HostBackend.reserve(LAYOUT, name=name)
    ranks = list(group._procs)
    rank0, rank1 = group.pids
    try:
        backend = RankedBackend.start(
            owner, group, tp=2, pp=1, block_bytes=BLOCK_BYTES, slot_bytes=64
        )
        backend.map_many([1, 2])
        os.kill(rank1, signal.SIGSTOP)
        step = {"blocks": [4] * WRITES, "offsets": [0] * WRITES, "values": list(range(WRITES))}
        errors: list[Exception] = []

        def drive() -> None:  # steps until rank 1 counts as dead (its buffer fills at once)
            for _ in range(40):
                try:
                    group.run_step(step, timeout_s=1.0)
                except RankChannelError as exc:  # rank 1 did not ack: slow, or dead
                    if group.any_dead():
                        errors.append(exc)
                        return

        caplog.set_level(logging.ERROR, logger="engine_ext.ranks")
        engine = threading.Thread(target=drive, name="engine")
        engine.start()
        engine.join(120)  # bounds a failing test only: the engine blocked in a send
        hung = engine.is_alive()
        if hung:
            os.kill(rank1, signal.SIGKILL)  # ends the blocked send (EPIPE), so the test ends
            engine.join()
        assert not hung, "the engine blocked sending to a stopped rank"
        (error,) = errors
        assert f"rank 1 (pid {rank1})" in str(error) and "took no data for 1 s" in str(error)
        assert "restart the instance" in str(error)
        assert f"rank 1 (pid {rank1}) failed: its socket took no data" in caplog.text
        assert ranks[1].wait(30) == -signal.SIGKILL  # killed: a dead rank maps nothing
        assert [(s.alive, s.mapped_bytes) for s in group.states()] == [
            (True, 2 * LAYOUT.bundle_bytes),
            (False, 0),
        ]
        # rank 0 and the owner stay in step, measured by the kernel
        assert _view_pages(rank0, name) == len(owner.mapped_pages()) == 2
        with pytest.raises(BackendError, match="dead") as raised:
            backend.map_many([3])  # no new page without every rank
        assert raised.value.fatal
        backend.unmap_many([1, 2])
        assert backend.settle(10.0).outcome.value == "rank_failed"
        assert _view_pages(rank0, name) == len(owner.mapped_pages()) == 0
        assert owner.mapped_bytes() == 0
    finally:
        group.close()
        owner.release()
    assert [proc.returncode for proc in ranks] == [0, -signal.SIGKILL]
    assert os.listdir(tmp_path) == []  # the listening socket went at start-up
    assert not _own_maps_name(name)
    assert _fds() == fds  # every socket, pidfd, pipe and the memfd closed


def test_a_briefly_stopped_rank_is_slow_not_dead(tmp_path: Path) -> None:
    """Stopped, but its socket still takes what is sent: the call times out, the rank lives,
    and it catches up when continued."""
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30, send_timeout_s=1.0)
    try:
        os.kill(group.pids[1], signal.SIGSTOP)
        try:
            with pytest.raises(RankChannelError, match="ranks 1 did not answer in time"):
                group.call("probe", 0.5)
        finally:
            os.kill(group.pids[1], signal.SIGCONT)
        group.call("probe", 30)
        assert not group.any_dead() and group.deaths == 0
    finally:
        group.close()
    assert [proc.returncode for proc in group._procs] == [0, 0]


def test_close_does_not_wait_on_a_rank_whose_buffer_is_full() -> None:
    """The last send filled a rank's buffer exactly (nothing stalled yet); the rank is
    stopped. ``close()`` sends ``stop`` only if the socket takes it at once."""
    ours, theirs = socket.socketpair()
    group = RankGroup([_Rank(rank=0, pid=os.getpid(), sock=ours)], send_timeout_s=600)
    with theirs:
        ours.setblocking(False)
        try:
            while True:
                ours.send(b"\0" * 4096)
        except BlockingIOError:
            pass  # full: a stopped peer would never read it
        ours.setblocking(True)
        closer = threading.Thread(target=group.close, name="close")
        closer.start()
        closer.join(60)  # bounds a failing test only
        hung = closer.is_alive()
        if hung:
            theirs.close()  # ends the blocked send, so the test ends
            closer.join()
        assert not hung, "close() blocked sending stop to a rank with a full buffer"


_GARBLING_RANK = """
import json, os, socket, struct, sys, time
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
hello = json.dumps({"hello": 0, "pid": os.getpid()}).encode()
sock.sendall(struct.pack(">I", len(hello)) + hello)
sock.recv(1 << 16)  # the probe
sock.sendall(struct.pack(">I", 5) + b"hello")  # not an ack
time.sleep(600)  # and goes on running, its view (if it had one) still mapped
"""


def test_a_rank_that_breaks_the_channel_is_ended(tmp_path: Path) -> None:
    """A rank declared dead for garbage on its socket still runs; it counts as mapping
    nothing (the owner gives back what the live ranks released), so the group ends it."""
    path = str(tmp_path / "r.sock")
    group, (proc,) = accept_ranks(
        path, lambda: [subprocess.Popen([sys.executable, "-c", _GARBLING_RANK, path])]
    )
    try:
        assert group.wait(group.broadcast("probe"), 30.0).value == "rank_failed"
        assert "channel error" in group.describe(group.wait(0, 0))
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        group.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
