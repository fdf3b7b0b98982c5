"""Several stuck ranks, one deadline; ``close()`` with a frame half sent (real processes).

A rank frozen by SIGSTOP stops reading its socket. Small send buffers
(``SO_SNDBUF``) make a buffer fill within one step, as a long stop does with
the default 208 KiB. Whatever the number of stuck ranks and wherever each one
stopped (its buffer full or not), one call waits on one deadline, and a rank
that made no progress for ``send_timeout_s`` -- took no byte, acked nothing --
counts as dead and is killed. Checked by behaviour: the call returns, the
stuck ranks are dead and killed, each named once in the log, and the live
ranks' ``/proc/<pid>/maps`` agree with the owner's memfd.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from allocator import HostBackend, PageLayout
from engine_ext.ranks import (
    RankChannelBarrier,
    RankChannelError,
    RankedBackend,
    RankGroup,
    memfd_view,
)

LAYOUT = PageLayout(page_bytes=4096, num_pages=8, num_regions=2)
BLOCK_BYTES, SLOT_BYTES = 1024, 64  # block 4 is the first of page 1
WRITES = 2000  # one step: 24 KB of KV writes, more than a 4 KiB send buffer holds


def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _view_pages(pid: int, name: str) -> int:
    """Pages ``pid`` maps of memfd ``name``, from its /proc/<pid>/maps (every region)."""
    return sum(length for _, length in memfd_view(pid, name)) // LAYOUT.bundle_bytes


def _small_send_buffer(group: RankGroup, rank: int) -> None:
    group._ranks[rank].sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def _step(first: int) -> dict[str, list[int]]:
    """``WRITES`` writes into slot 0 of block 4; the last one (``first + WRITES - 1``) stays."""
    return {
        "blocks": [4] * WRITES,
        "offsets": [0] * WRITES,
        "values": list(range(first, first + WRITES)),
    }


def _word(owner: HostBackend, region: int, word: int) -> int:
    """What rank word ``word`` holds in slot 0 of block 4 of ``region``, read by the owner."""
    address = owner.base_address + region * LAYOUT.region_bytes + 4 * BLOCK_BYTES + word * 4
    return int(ctypes.c_int32.from_address(address).value)


def _in_thread(call: object, bound_s: float, unblock: list[int]) -> list[BaseException]:
    """Run ``call`` on an "engine" thread; ``bound_s`` bounds a failing test only (then the
    ``unblock`` pids are killed so the thread ends). Returns what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 -- handed to the test
            raised.append(exc)

    engine = threading.Thread(target=run, name="engine")
    engine.start()
    engine.join(bound_s)
    hung = engine.is_alive()
    if hung:
        for pid in unblock:
            os.kill(pid, signal.SIGKILL)
        engine.join()
    assert not hung, f"the call did not return within {bound_s} s"
    return raised


def test_two_stuck_ranks_are_declared_dead_within_one_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1's buffer fills during the step (the send stalls); rank 2's takes the whole step
    (it stopped later, its buffer had room) but it never acks. One call, one deadline: both
    are dead and killed after ``send_timeout_s`` without progress, not one after the other
    (it was the send's timeout for rank 1, then ``rank_timeout_s`` waiting on rank 2, which
    stayed alive and mapped)."""
    name = "kvs-two-stuck"
    fds = _fds()
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 4, timeout_s=30, send_timeout_s=1.0)
    owner = HostBackend.reserve(LAYOUT, name=name)
    procs = list(group._procs)
    pids = group.pids
    try:
        backend = RankedBackend.start(
            owner, group, tp=2, pp=2, block_bytes=BLOCK_BYTES, slot_bytes=SLOT_BYTES
        )
        backend.map_many([1, 2])
        _small_send_buffer(group, 1)
        os.kill(pids[1], signal.SIGSTOP)
        os.kill(pids[2], signal.SIGSTOP)
        caplog.set_level(logging.ERROR, logger="engine_ext.ranks")
        (error,) = _in_thread(
            lambda: group.run_step(_step(0), timeout_s=60.0), 40.0, [pids[1], pids[2]]
        )
        assert isinstance(error, RankChannelError)
        for rank in (1, 2):
            assert f"rank {rank} (pid {pids[rank]})" in str(error)
            lines = [m for m in caplog.messages if f"rank {rank} (pid {pids[rank]}) failed" in m]
            assert len(lines) == 1, caplog.messages
            assert "killed" in lines[0] and "restart the instance" in lines[0]
            assert "KVSIDECAR_RANK_SEND_TIMEOUT_S" in lines[0]
        assert "restart the instance" in str(error)
        assert [procs[r].wait(30) for r in (1, 2)] == [-signal.SIGKILL] * 2
        assert [(s.alive, s.mapped_bytes) for s in group.states()] == [
            (True, 2 * LAYOUT.bundle_bytes),
            (False, 0),
            (False, 0),
            (True, 2 * LAYOUT.bundle_bytes),
        ]
        # the live ranks and the owner agree, measured by the kernel
        assert _view_pages(pids[0], name) == _view_pages(pids[3], name) == 2
        assert len(owner.mapped_pages()) == 2
        backend.unmap_many([1, 2])
        assert backend.settle(10.0).outcome.value == "rank_failed"
        assert _view_pages(pids[0], name) == _view_pages(pids[3], name) == 0
        assert owner.mapped_bytes() == 0
    finally:
        group.close()
        owner.release()
    assert [proc.returncode for proc in procs] == [0, -signal.SIGKILL, -signal.SIGKILL, 0]
    assert _fds() == fds


def test_a_call_ends_at_its_own_deadline_and_a_stopped_rank_catches_up(tmp_path: Path) -> None:
    """A rank stopped for less than ``send_timeout_s`` is slow, even with its buffer full:
    the call fails at its own timeout (the send used to block until ``send_timeout_s``),
    what the socket did not take is sent once it reads again, in order, and the rank ends
    with both steps' writes."""
    name = "kvs-catch-up"
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30, send_timeout_s=30.0)
    owner = HostBackend.reserve(LAYOUT, name=name)
    pids = group.pids
    try:
        backend = RankedBackend.start(
            owner, group, tp=2, pp=1, block_bytes=BLOCK_BYTES, slot_bytes=SLOT_BYTES
        )
        backend.map_many([1, 2])
        _small_send_buffer(group, 1)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            (error,) = _in_thread(lambda: group.run_step(_step(0), timeout_s=0.5), 20.0, [pids[1]])
        finally:
            os.kill(pids[1], signal.SIGCONT)
        assert "ranks 1 did not answer in time" in str(error)
        assert not group.any_dead()
        group.run_step(_step(WRITES), timeout_s=30.0)
        backend.probe(30.0)  # every rank re-measures its view from its /proc/self/maps
        assert [(s.alive, s.mapped_bytes) for s in group.states()] == [
            (True, 2 * LAYOUT.bundle_bytes)
        ] * 2
        last = 2 * WRITES - 1
        assert [_word(owner, region, word) for region in (0, 1) for word in (0, 1)] == [last] * 4
        assert _view_pages(pids[0], name) == _view_pages(pids[1], name) == 2
    finally:
        group.close()
        owner.release()
    assert [proc.returncode for proc in group._procs] == [0, 0]


def test_close_with_a_frame_half_sent_lets_the_rank_exit_cleanly(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``close()`` while a stopped rank's socket holds part of a step: the rank, continued,
    reads the part, then the end of the stream, and exits cleanly (status 0, its view
    released): nothing is appended after the part (a ``stop`` there would be read as the
    step's payload) and the cut frame is not an error of the rank's."""
    name = "kvs-half-frame"
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30, send_timeout_s=30.0)
    owner = HostBackend.reserve(LAYOUT, name=name)
    procs: list[subprocess.Popen[bytes]] = list(group._procs)
    pids = group.pids
    try:
        backend = RankedBackend.start(
            owner, group, tp=2, pp=1, block_bytes=BLOCK_BYTES, slot_bytes=SLOT_BYTES
        )
        backend.map_many([1, 2])
        _small_send_buffer(group, 1)
        os.kill(pids[1], signal.SIGSTOP)
        assert _view_pages(pids[1], name) == 2
        stepping = threading.Thread(
            target=lambda: pytest.raises(RankChannelError, group.run_step, _step(0), 30.0),
            name="engine",
        )
        stepping.start()  # blocks: rank 1 neither takes the step nor acks it
        stepping.join(0.5)
        closer = threading.Thread(target=group.close, name="close")
        closer.start()  # waits up to 5 s for the ranks to exit, then kills them
        closer.join(0.3)
        os.kill(pids[1], signal.SIGCONT)
        closer.join(30)
        stepping.join(30)
        assert not closer.is_alive() and not stepping.is_alive()
    finally:
        group.close()
        owner.release()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0]
    assert "channel closed" not in capfd.readouterr().out


def test_start_stop_cycles_with_dead_and_stuck_ranks_leave_nothing(tmp_path: Path) -> None:
    """Cycles of start, traffic and close -- clean, a rank killed, a rank stuck with a backlog
    and declared dead -- leave no descriptor (``/proc/self/fd``), thread, file or mapping."""
    fds, threads = _fds(), threading.active_count()
    for cycle in range(9):
        name = f"kvs-cycle-{cycle}"
        group = RankGroup.spawn_private(tmp_path, "cyc", 2, send_timeout_s=0.3)
        owner = HostBackend.reserve(LAYOUT, name=name)
        procs = list(group._procs)
        try:
            backend = RankedBackend.start(
                owner, group, tp=2, pp=1, block_bytes=BLOCK_BYTES, slot_bytes=SLOT_BYTES
            )
            backend.map_many([1, 2])
            if cycle % 3 == 1:
                os.kill(group.pids[1], signal.SIGKILL)
            elif cycle % 3 == 2:
                _small_send_buffer(group, 1)
                os.kill(group.pids[1], signal.SIGSTOP)
                with pytest.raises(RankChannelError):
                    group.run_step(_step(0), timeout_s=0.1)  # leaves a backlog
                with pytest.raises(RankChannelError, match="rank 1 .* took no data"):
                    group.run_step(_step(0), timeout_s=30.0)
            backend.unmap_many([1, 2])
            backend.settle(5.0)
        finally:
            group.close()
            owner.release()
        assert all(proc.returncode is not None for proc in procs)
        assert (cycle % 3 == 0) == (procs[1].returncode == 0)
        assert f"/memfd:{name}" not in Path("/proc/self/maps").read_text()
    assert os.listdir(tmp_path) == []
    assert _fds() == fds
    assert threading.active_count() == threads


def test_the_barrier_never_waits_on_a_stopped_ranks_full_buffer(tmp_path: Path) -> None:
    """A pass's barrier (``sync``) waits at most ``wait_s``, also when a stopped rank's buffer
    fills with its unmaps (the send used to wait up to ``send_timeout_s`` inside the pass).
    The rank is slow, not dead; continued, it catches up and the release is confirmed."""
    name = "kvs-barrier-backlog"
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30, send_timeout_s=60.0)
    layout = PageLayout(page_bytes=4096, num_pages=256, num_regions=2)
    owner = HostBackend.reserve(layout, name=name)
    pids = group.pids
    try:
        backend = RankedBackend.start(
            owner, group, tp=2, pp=1, block_bytes=BLOCK_BYTES, slot_bytes=SLOT_BYTES
        )
        barrier = RankChannelBarrier(backend, wait_s=0.01)
        backend.map_many(list(range(layout.num_pages)))
        _small_send_buffer(group, 1)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            outcomes = []

            def passes() -> None:
                for page in range(layout.num_pages):  # one unmap frame per pass
                    backend.unmap_many([page])
                    outcomes.append(barrier.sync().outcome.value)

            assert _in_thread(passes, 30.0, [pids[1]]) == []
            assert group._ranks[1].unsent, "the rank's buffer never filled: the test is moot"
        finally:
            os.kill(pids[1], signal.SIGCONT)
        assert set(outcomes) == {"rank_timeout"} and not group.any_dead()
        result = RankChannelBarrier(backend, wait_s=30.0).sync()
        assert result.outcome.value == "confirmed", result
        assert _view_pages(pids[0], name) == _view_pages(pids[1], name) == 0
        assert owner.mapped_bytes() == 0
    finally:
        group.close()
        owner.release()
    assert [proc.returncode for proc in group._procs] == [0, 0]
