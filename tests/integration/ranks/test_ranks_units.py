"""Small pieces of the rank layer: owner records, the stale-dir sweep, framing, bad input."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from allocator import AllocatorContractError, HostBackend, PageLayout
from engine_ext._runtime_dir import (
    OWNER_FILE,
    SOCKET_FILE,
    owner_alive,
    sweep_stale_runtime_dirs,
    write_owner,
)
from engine_ext.protocol import socket_path_fits
from engine_ext.ranks import RankChannelError, RankedBackend, RankGroup
from engine_ext.ranks._wire import FrameReader, decode_message, recv_message, send_message


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _connect_first(path: Path) -> socket.socket:
    """Connect to the rank socket as soon as it listens (before the ranks, which take a
    Python start-up): the path exists from ``bind``, but a connect before ``listen`` is
    refused, so retry that too."""
    deadline = time.monotonic() + 20
    while True:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)
        else:
            return sock


def test_owner_record_live_dead_reused_missing(tmp_path: Path) -> None:
    write_owner(tmp_path)
    assert owner_alive(tmp_path) is True
    (tmp_path / OWNER_FILE).write_text(f"{_dead_pid()} 12345\n")
    assert owner_alive(tmp_path) is False
    (tmp_path / OWNER_FILE).write_text(f"{os.getpid()} 1\n")  # our pid, another start time
    assert owner_alive(tmp_path) is False
    (tmp_path / OWNER_FILE).unlink()
    assert owner_alive(tmp_path) is None


def test_sweep_removes_only_dead_owners_sockets(tmp_path: Path) -> None:
    def instance_dir(name: str, pid: int) -> Path:
        path = tmp_path / name
        path.mkdir()
        write_owner(path, pid)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path / "control.sock"))
        sock.close()
        return path

    dead = _dead_pid()
    stale = instance_dir("stale", os.getpid())
    (stale / OWNER_FILE).write_text(f"{dead} 1\n")
    live = instance_dir("live", os.getpid())
    odd = instance_dir("odd", os.getpid())
    (odd / OWNER_FILE).write_text(f"{dead} 1\n")
    (odd / "notes.txt").write_text("not ours")  # anything else: left alone
    kept = instance_dir("me", os.getpid())
    (kept / OWNER_FILE).write_text(f"{dead} 1\n")
    removed = sweep_stale_runtime_dirs(tmp_path, keep="me")
    assert removed == [stale] and not stale.exists()
    assert (live / "control.sock").exists() and (odd / "notes.txt").exists() and kept.exists()


def test_framing_rejects_garbage() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_message(a, {"seq": 1})
        assert recv_message(b) == {"seq": 1}
        a.sendall(struct.pack(">I", 1 << 30))
        with pytest.raises(RankChannelError, match="limit"):
            recv_message(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 3) + b"{x]")
        with pytest.raises(RankChannelError, match="not JSON"):
            recv_message(b)
        a.sendall(struct.pack(">I", 10) + b"{}")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(RankChannelError, match="middle"):
            recv_message(b)
        assert recv_message(b) is None  # clean end of stream


def test_foreign_connection_is_ignored_and_bad_topology_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sock"

    def intruder() -> None:
        with _connect_first(path) as sock:
            send_message(sock, {"hello": 7, "pid": 1})  # not a rank of this group

    thread = threading.Thread(target=intruder)
    thread.start()
    group = RankGroup.spawn(str(path), 2, timeout_s=30)
    thread.join()
    layout = PageLayout(page_bytes=4096, num_pages=4, num_regions=2)
    owner = HostBackend.reserve(layout, name="kvs-units")
    try:
        assert not path.exists()  # the listening socket is gone once the ranks connected
        with pytest.raises(ValueError, match="must equal"):
            RankedBackend.start(owner, group, tp=2, pp=2, block_bytes=1024, slot_bytes=64)
        backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=1024, slot_bytes=64)
        backend.map(1)
        with pytest.raises(AllocatorContractError, match="already mapped"):
            backend.map(1)
        with pytest.raises(AllocatorContractError, match="not mapped"):
            backend.unmap(2)
        backend.unmap(1)
        assert backend.unmaps_in_flight == 1 and owner.is_mapped(1)  # counted until acked
        assert backend.settle(5.0).outcome.value == "confirmed"
        assert backend.unmaps_in_flight == 0 and not owner.is_mapped(1)
    finally:
        group.close()
        owner.release()


def test_acked_view_sizes_match_each_ranks_proc_maps(tmp_path: Path) -> None:
    """Acks count the rank's own mprotects; /proc/<pid>/maps, read from here, must agree."""
    import random

    from engine_ext.ranks import memfd_view

    group = RankGroup.spawn(str(tmp_path / "r.sock"), 2, timeout_s=30)
    layout = PageLayout(page_bytes=4096, num_pages=16, num_regions=2)
    owner = HostBackend.reserve(layout, name="kvs-acks")
    rng = random.Random(5)
    try:
        backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=1024, slot_bytes=64)
        mapped: set[int] = set()
        for _ in range(40):
            if mapped and rng.random() < 0.5:
                gone = rng.sample(sorted(mapped), rng.randint(1, len(mapped)))
                backend.unmap_many(gone)
                mapped -= set(gone)
            else:
                fresh = rng.sample([p for p in range(16) if p not in mapped], rng.randint(1, 3))
                backend.map_many(fresh)
                mapped |= set(fresh)
            assert backend.settle(5.0).outcome.value == "confirmed"
            for pid, state in zip(group.pids, group.states(), strict=True):
                seen = sum(length for _, length in memfd_view(pid, "kvs-acks"))
                assert state.mapped_bytes == seen == len(mapped) * layout.bundle_bytes
        backend.probe(5.0)  # every rank re-measures its own /proc/self/maps and agrees
        assert not group.any_dead()
    finally:
        group.close()
        owner.release()


def test_commit_is_the_owners_job_an_attached_view_commits_nothing() -> None:
    layout = PageLayout(page_bytes=4096, num_pages=4, num_regions=1)
    owner = HostBackend.reserve(layout, name="kvs-commit")
    view = HostBackend.attach(layout, owner.fd_path)
    try:
        view.map(2)  # the owner has not committed page 2: the view maps a hole
        assert owner.mapped_bytes() == 0 and view.num_mapped_pages == 1
        owner.map(2)
        assert owner.mapped_bytes() == layout.bundle_bytes
        view.unmap(2)
        assert owner.mapped_bytes() == layout.bundle_bytes  # a view never frees memory
    finally:
        view.release()
        owner.release()


def test_ranks_start_for_any_instance_whose_control_socket_fits() -> None:
    # a runtime root as long as /run/user/1000/kvsidecar and the longest instance id (63):
    # the control socket fits in sun_path (107 bytes), so the rank socket must fit too
    base = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    root = base / ("k" * (24 - len(str(base)) - 1)) if len(str(base)) < 23 else base
    instance_id = "i" * 63
    assert socket_path_fits(str(root / instance_id / SOCKET_FILE))
    try:
        group = RankGroup.spawn_private(root, instance_id, 2, timeout_s=30)
        try:
            assert group.world_size == 2
            group.call("probe", 30)  # both ranks connected and answer
        finally:
            group.close()
        assert os.listdir(root) == []  # the private socket dir went once the ranks connected
    finally:
        shutil.rmtree(base)


def test_a_silent_connection_does_not_hold_up_the_ranks(tmp_path: Path) -> None:
    """A client that connects to the rank socket and says nothing (a probe, a stray process
    of this user) is left waiting alone; the real ranks behind it are accepted."""
    path = tmp_path / "r.sock"
    silent: list[socket.socket] = []

    def intruder() -> None:
        sock = _connect_first(path)
        silent.append(sock)  # connected before the ranks, never sends a byte

    thread = threading.Thread(target=intruder)
    thread.start()
    try:
        group = RankGroup.spawn(str(path), 2, timeout_s=15)
        try:
            thread.join()
            assert silent, "the intruder did not connect"
            group.call("probe", 15)  # both ranks connected and answer
            # the silent client's connection was closed, not handed a rank's place
            assert silent[0].recv(1) == b""
        finally:
            group.close()
    finally:
        thread.join()
        for sock in silent:
            sock.close()


def test_frame_reader_refuses_a_frame_over_its_cap() -> None:
    """The cap holds whether the frame is announced alone or arrives whole in one recv."""
    a, b = socket.socketpair()
    with a, b:
        reader = FrameReader(b, decode_message, max_frame_bytes=64)
        body = b'{"hello": 0, "pad": "' + b"x" * 41 + b'"}'  # exactly 64 bytes: taken
        a.sendall(struct.pack(">I", len(body)) + body[:10])
        assert reader.feed() == [] and reader.buffered == 14
        a.sendall(body[10:])
        assert reader.feed() == [{"hello": 0, "pad": "x" * 41}] and reader.buffered == 0
        a.sendall(struct.pack(">I", 65))  # announced alone
        with pytest.raises(RankChannelError, match="65-byte message; the limit is 64"):
            reader.feed()
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 65) + b"{" + b" " * 63 + b"}")  # whole, in one recv
        with pytest.raises(RankChannelError, match="65-byte message; the limit is 64"):
            FrameReader(b, decode_message, max_frame_bytes=64).feed()


@pytest.mark.parametrize(
    "hello",
    [
        struct.pack(">I", 5000) + b"{" + b" " * 4998 + b"}",  # over the 4 KiB cap
        struct.pack(">I", 2) + b"{}" + struct.pack(">I", 2) + b"{}",  # two messages
        struct.pack(">I", 3) + b"{x]",  # not JSON
    ],
    ids=["over-4KiB", "two-messages", "not-json"],
)
def test_a_bad_hello_is_closed_and_the_ranks_are_accepted(tmp_path: Path, hello: bytes) -> None:
    path = tmp_path / "r.sock"
    answers: list[bytes] = []

    def intruder() -> None:
        with _connect_first(path) as sock:
            sock.sendall(hello)
            sock.settimeout(20)
            answers.append(sock.recv(1))  # b"": the scheduler closed this connection

    thread = threading.Thread(target=intruder)
    thread.start()
    try:
        group = RankGroup.spawn(str(path), 2, timeout_s=15)
        try:
            thread.join()
            group.call("probe", 15)
        finally:
            group.close()
    finally:
        thread.join()
    assert answers == [b""]
