"""The rank channel's frames and failure paths, with real sockets and real rank processes.

What an ack means is checked from outside (each rank's ``/proc/<pid>/maps``),
never from the acks themselves; a rank whose own view disagrees with what it
acked stops (``probe``). Counting, not timing: acks the engine waits for must
not wake the watcher thread.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from allocator import BackendError, HostBackend, PageLayout, _libc
from engine_ext.ranks import RankChannelError, RankedBackend, RankGroup, RankWorker, memfd_view
from engine_ext.ranks._group import _accept, _listen, _Rank
from engine_ext.ranks._wire import (
    ACK,
    OP_HEAD,
    Ack,
    FrameReader,
    decode_ack,
    decode_op,
    encode_ack,
    encode_op,
)

LAYOUT = PageLayout(page_bytes=4096, num_pages=16, num_regions=2)


def _random_op(rng: random.Random, seq: int) -> tuple[str, dict[str, Any]]:
    op = rng.choice(["map", "unmap", "step", "probe", "setup"])
    pages = rng.sample(range(1 << 20), rng.randint(0, 40))
    if op == "map":
        return op, {"pages": pages}
    if op == "unmap":
        return op, {"pages": pages, "after_step": rng.randint(-1, 1 << 40)}
    if op == "step":
        n = rng.randint(0, 3000)  # up to 36 KB: split over several recvs
        cols = [[rng.randint(-(1 << 31), (1 << 31) - 1) for _ in range(n)] for _ in range(3)]
        return op, {"step": seq, "blocks": cols[0], "offsets": cols[1], "values": cols[2]}
    if op == "setup":
        return op, {"fd_path": f"/proc/1/fd/{seq}", "tp": 2, "layout": {"num_pages": seq}}
    return op, {}


def test_frames_survive_any_split_and_batching() -> None:
    rng = random.Random(17)
    sent: list[dict[str, Any]] = []
    stream = b""
    for seq in range(1, 300):
        op, fields = _random_op(rng, seq)
        stream += encode_op(op, seq, fields)
        sent.append({"op": op, "seq": seq, **fields})
    got: list[dict[str, Any]] = []
    a, b = socket.socketpair()
    with a, b:
        reader = FrameReader(b, decode_op)
        pos = 0
        while pos < len(stream):
            piece = stream[pos : pos + rng.choice([1, 3, 7, 36, 500, 70000, 100000])]
            a.sendall(piece)  # nothing else is in flight: one feed() takes exactly this piece
            pos += len(piece)
            while True:
                frames = reader.feed()
                assert frames is not None
                got += frames
                if not select_readable(b):
                    break
        a.shutdown(socket.SHUT_WR)
        assert reader.feed() is None  # clean end of stream between frames
    assert got == sent


def select_readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def test_acks_round_trip_in_one_send() -> None:
    acks = [Ack(seq, seq - 3, seq * 4096, seq) for seq in range(1, 50)]
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(encode_ack(ack) for ack in acks))
        reader = FrameReader(b, decode_ack)
        got: list[tuple[int, int, int, int]] = []
        while len(got) < len(acks):
            frames = reader.feed()
            assert frames is not None
            got += frames
    assert got == [tuple(ack) for ack in acks]


def test_bad_frames_and_bad_fields_are_refused() -> None:
    head = OP_HEAD.pack
    with pytest.raises(RankChannelError, match="unknown rank op code 99"):
        decode_op(head(99, 1, 0, 0))
    with pytest.raises(RankChannelError, match="announces 3 items"):
        decode_op(head(2, 1, 0, 3) + b"\0" * 8)
    with pytest.raises(RankChannelError, match="shorter than its header"):
        decode_op(b"\x02\0")
    with pytest.raises(RankChannelError, match="not JSON"):
        decode_op(head(1, 1, 0, 0) + b"{x]")
    with pytest.raises(RankChannelError, match="an ack of 8 bytes"):
        decode_ack(b"\0" * 8)
    with pytest.raises(RankChannelError, match="unknown rank op 'bogus'"):
        encode_op("bogus", 1, {})
    with pytest.raises(RankChannelError, match="as many offsets"):
        encode_op("step", 1, {"step": 0, "blocks": [1, 2], "offsets": [0], "values": [5, 6]})
    with pytest.raises(RankChannelError, match="bad fields"):
        encode_op("map", 1, {"pages": [1 << 40]})  # not an int32 page number
    with pytest.raises(RankChannelError, match="bad fields"):
        encode_op("unmap", 1, {"pages": [1]})  # no after_step
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 1 << 30))
        with pytest.raises(RankChannelError, match="limit"):
            FrameReader(b, decode_ack).feed()
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", ACK.size) + b"\0" * 5)
        a.shutdown(socket.SHUT_WR)
        reader = FrameReader(b, decode_ack)
        assert reader.feed() == []
        with pytest.raises(RankChannelError, match="middle"):
            reader.feed()


def test_out_of_order_or_garbage_ack_fails_the_rank() -> None:
    """A peer that breaks the ack order (or sends garbage) is marked dead, never trusted."""
    for garbage in (encode_ack(Ack(2, 0, 0, 0)) + encode_ack(Ack(1, 0, 0, 0)), b"\0\0\0\x05hello"):
        ours, theirs = socket.socketpair()
        group = RankGroup([_Rank(rank=0, pid=os.getpid(), sock=ours)])
        try:
            seq = group.broadcast("probe")
            theirs.recv(1 << 16)
            theirs.sendall(garbage)
            assert group.wait(seq, 10.0).value == "rank_failed"
            assert group.any_dead()
            assert "channel error" in group.describe(group.wait(seq, 0))
        finally:
            group.close()
            theirs.close()


def test_an_ack_for_an_op_never_sent_fails_the_rank_and_confirms_nothing() -> None:
    """A well-formed ack whose seq is ahead of every op sent would confirm unmaps the rank
    never received: the owner would punch pages the rank may still read."""
    ours, theirs = socket.socketpair()
    owner = HostBackend.reserve(LAYOUT, name="kvs-ack-ahead")
    group = RankGroup([_Rank(rank=0, pid=os.getpid(), sock=ours)])
    peer = FrameReader(theirs, decode_op)
    try:
        backend = RankedBackend(owner, group, map_timeout_s=10.0)
        thread = threading.Thread(target=backend.map_many, args=([1, 2],))
        thread.start()
        (op,) = peer.read() or []
        assert op["op"] == "map"
        theirs.sendall(encode_ack(Ack(op["seq"], -1, 2 * LAYOUT.bundle_bytes, 2)))
        thread.join()
        backend.unmap_many([1])
        assert backend.settle(0.0).outcome.value == "rank_timeout"  # sent, not acked
        (op,) = peer.read() or []
        assert op["op"] == "unmap"
        theirs.sendall(encode_ack(Ack(op["seq"] + 5, -1, 0, 0)))  # claims five ops more
        result = backend.settle(10.0)
        assert result.outcome.value == "rank_failed" and group.any_dead()
        assert "never sent" in group.describe(result.outcome)
    finally:
        group.close()
        theirs.close()
        owner.release()


def test_acks_wake_only_the_engine_and_an_idle_death_wakes_it(tmp_path: Path) -> None:
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30)
    owner = HostBackend.reserve(LAYOUT, name="kvs-wake")
    woken = threading.Event()
    group.set_wake(woken.set)
    try:
        backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=1024, slot_bytes=64)
        for i in range(100):
            pages = [i % 16, (i + 5) % 16]
            backend.map_many(pages)
            block = pages[0] * (LAYOUT.page_bytes // 1024)  # a block of a mapped page
            group.run_step({"blocks": [block], "offsets": [0], "values": [i]}, timeout_s=10)
            backend.unmap_many(pages)
            assert backend.settle(10.0).outcome.value == "confirmed"
        # the engine thread read every ack itself: the watcher never woke, no wake-up sent
        assert group.watcher_wakeups == 0 and not woken.is_set()
        os.kill(group.pids[1], signal.SIGKILL)  # dies while nothing is in flight
        assert woken.wait(30), "an idle rank's death did not wake the engine"
        assert group.deaths == 1 and [s.alive for s in group.states()] == [True, False]
        assert "exited" in group.describe(group.wait(group.broadcast("probe"), 10.0))
    finally:
        group.close()
        owner.release()


def _in_process_rank(tmp_path: Path) -> tuple[RankGroup, RankWorker, threading.Thread, list[int]]:
    """A real RankWorker on a thread of this process (so the test can reach its view)."""
    path = str(tmp_path / "r.sock")
    listener = _listen(path)
    worker = RankWorker(path, 0)
    rc: list[int] = []
    thread = threading.Thread(target=lambda: rc.append(worker.run()), name="rank-0")
    thread.start()
    try:
        ranks = _accept(listener, 1, [], 30.0)
    finally:
        listener.close()
        os.unlink(path)
    return RankGroup(ranks), worker, thread, rc


def test_a_rank_whose_view_disagrees_with_its_acks_stops(tmp_path: Path, capsys) -> None:
    group, worker, thread, rc = _in_process_rank(tmp_path)
    owner = HostBackend.reserve(LAYOUT, name="kvs-view")
    try:
        backend = RankedBackend.start(owner, group, tp=1, pp=1, block_bytes=1024, slot_bytes=64)
        backend.map_many([1, 2])
        backend.unmap_many([2])
        assert backend.settle(10.0).outcome.value == "confirmed"
        backend.probe(10.0)  # the rank re-measures its /proc/self/maps: it agrees
        assert worker.backend is not None
        view = worker.backend.base_address + LAYOUT.page_offset(1, 2)
        _libc.open_range(view, LAYOUT.page_bytes)  # page 2 readable behind the rank's back
        with pytest.raises(BackendError, match="rank 0"):
            backend.probe(10.0)
        thread.join(30)
        assert rc == [1] and group.any_dead()
        assert "the view is corrupt" in capsys.readouterr().out
    finally:
        group.close()
        thread.join(30)
        owner.release()


class _CommitFails(HostBackend):
    """The real owner memfd, whose commit of the pages in ``fail`` reports ENOMEM."""

    fail: frozenset[int] = frozenset()

    def map_many(self, pages: Any) -> None:
        if self.fail.intersection(pages):
            raise BackendError("fallocate(commit) failed: Cannot allocate memory (errno 12)")
        super().map_many(pages)


def test_owner_commit_failure_rolls_back_every_rank(tmp_path: Path) -> None:
    """The owner commits while the ranks map: if the commit fails, the ranks unmap again."""
    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30)
    owner = _CommitFails.reserve(LAYOUT, name="kvs-commit-fails")
    assert isinstance(owner, _CommitFails)

    def views() -> list[int]:
        return [sum(n for _, n in memfd_view(pid, "kvs-commit-fails")) for pid in group.pids]

    try:
        backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=1024, slot_bytes=64)
        backend.map_many([5])
        backend.unmap_many([5])
        assert backend.settle(0.0).outcome.value == "rank_timeout"  # 5's unmap in flight
        owner.fail = frozenset({6})
        with pytest.raises(BackendError, match="ENOMEM|allocate memory"):
            backend.map_many([5, 6])  # 5 revived, 6 fresh: the commit of 6 fails
        assert not backend.is_mapped(5) and not backend.is_mapped(6)
        assert backend.settle(10.0).outcome.value == "confirmed"
        assert views() == [0, 0] and owner.mapped_bytes() == 0 and owner.mapped_pages() == []
        owner.fail = frozenset()
        backend.map_many([5, 6])  # nothing left over: works as if never tried
        assert views() == [2 * LAYOUT.bundle_bytes] * 2
        assert [s.mapped_bytes for s in backend.settle(10.0).ranks] == [2 * LAYOUT.bundle_bytes] * 2
    finally:
        group.close()
        owner.release()


def test_a_pending_rank_dying_during_a_wait_is_noticed_in_that_wait(
    tmp_path: Path,
) -> None:
    """The engine sleeps on the socket of the rank told last and on the others' pidfds.

    Ranks 0 and 2 hold their unmap acks; rank 0 is killed while the engine
    sleeps on rank 2: the engine must notice (mark it dead, wake) during that
    same wait, not only when rank 2 answers.
    """
    group = RankGroup.spawn(
        str(tmp_path / "r.sock"), 3, timeout_s=30, barrier_delay_s={0: 600.0, 2: 600.0}
    )
    owner = HostBackend.reserve(LAYOUT, name="kvs-dies")
    woken = threading.Event()
    noticed: list[bool] = []

    def kill_then_release() -> None:
        time.sleep(0.5)  # the engine is (or soon will be) asleep in the settle's wait
        os.kill(group.pids[0], signal.SIGKILL)
        noticed.append(woken.wait(60))  # bounds a failing test only
        os.kill(group.pids[2], signal.SIGKILL)  # lets the wait end

    try:
        backend = RankedBackend.start(owner, group, tp=3, pp=1, block_bytes=1024, slot_bytes=64)
        group.set_wake(woken.set)
        backend.map_many([3])
        backend.unmap_many([3])
        helper = threading.Thread(target=kill_then_release)
        helper.start()
        result = backend.settle(300.0)
        helper.join()
        assert noticed == [True], "rank 0's death went unnoticed while the engine waited"
        assert result.outcome.value == "rank_failed"
        assert [s.alive for s in result.ranks] == [False, True, False]
    finally:
        group.close()
        owner.release()


@pytest.mark.parametrize(
    ("tp", "pp", "blocks", "offsets"),
    [
        (2, 1, [0], [16]),  # one slot past a 16-slot block: block 1's first slot
        (2, 1, [1], [-16]),  # before the block: block 0's first slot
        (1, 2, [16], [0]),  # past the region: the next stage's layer, or past the view
        (2, 1, [4], [0]),  # block 4 lies in page 1, which no rank maps
    ],
    ids=["offset-past-block", "negative-offset", "block-past-region", "unmapped-page"],
)
def test_a_step_writing_outside_its_slots_stops_the_rank_and_writes_nothing(
    tmp_path: Path, tp: int, pp: int, blocks: list[int], offsets: list[int]
) -> None:
    group = RankGroup.spawn(str(tmp_path / "r.sock"), tp * pp, timeout_s=30)
    layout = PageLayout(page_bytes=4096, num_pages=4, num_regions=2)
    owner = HostBackend.reserve(layout, name="kvs-bad-step")
    try:
        backend = RankedBackend.start(owner, group, tp=tp, pp=pp, block_bytes=1024, slot_bytes=64)
        backend.map_many([0, 2, 3])
        group.run_step({"blocks": [8], "offsets": [3], "values": [5]}, timeout_s=10)  # valid

        def mapped_memory() -> list[
            bytes
        ]:  # every mapped page of every region, as the owner reads it
            return [
                ctypes.string_at(
                    owner.base_address + region * layout.region_bytes + page * layout.page_bytes,
                    layout.page_bytes,
                )
                for region in range(layout.num_regions)
                for page in (0, 2, 3)
            ]

        before = mapped_memory()
        assert any(any(page) for page in before)  # the valid step's writes are there
        with pytest.raises(RankChannelError, match="dead"):
            group.run_step({"blocks": blocks, "offsets": offsets, "values": [777]}, timeout_s=10)
        assert mapped_memory() == before  # no word changed anywhere in the memfd
    finally:
        group.close()
        owner.release()
    # each rank refused the step and exited (status 1), none died of a fault on the page
    assert [proc.returncode for proc in group._procs] == [1] * (tp * pp)


def test_a_watch_after_close_writes_to_no_descriptor() -> None:
    """close() frees the kick pipe's numbers; a barrier pass that still asks to be woken
    (the engine thread racing a shutdown) must not write into whatever reuses them."""
    ours, theirs = socket.socketpair()
    group = RankGroup([_Rank(rank=0, pid=os.getpid(), sock=ours)])
    seq = group.broadcast("probe")  # sent, never acked
    group.close()
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    reused = [os.dup(w) for _ in range(8)]  # the numbers close() freed: one pipe's write end
    try:
        group.watch(seq)
        with pytest.raises(BlockingIOError):
            os.read(r, 16)  # nothing was written into a reused descriptor
    finally:
        for fd in (r, w, *reused):
            os.close(fd)
        theirs.close()
