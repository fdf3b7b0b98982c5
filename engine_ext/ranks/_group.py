"""The scheduler side of the rank channel: one unix socket per rank, acks in order.

Threads: the engine thread calls everything except :meth:`RankGroup.close`
(any thread, idempotent). Acks are read by whoever holds the read lock: the
engine thread itself while it waits for them (a direct receive, no hand-off
through another thread), else one daemon watcher thread that sleeps in
``select`` on every rank socket, records acks that arrive while the engine
does not wait, notices deaths (end of stream, error) and wakes the engine.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_ext._barrier import BarrierOutcome
from engine_ext._runtime_dir import RANK_SOCKET_FILE, RuntimeDir
from engine_ext.protocol import RankState

from ._wire import RankChannelError, recv_message, send_message

__all__ = ["RankGroup"]

_log = logging.getLogger("engine_ext.ranks")


@dataclass(slots=True)
class _Rank:
    rank: int
    pid: int
    sock: socket.socket
    alive: bool = True
    acked: int = 0  # highest seq this rank acknowledged (acks arrive in order)
    finished_step: int = -1
    mapped_bytes: int = 0  # the rank's own view (its mprotects; /proc-checked on probe)
    mapped_pages: int = 0
    error: str | None = None


class RankGroup:
    """Broadcasts ops to every rank and waits for their acks.

    Owns the listening socket (unlinked as soon as every rank connected), the
    per-rank sockets, the watcher thread and its stop pipe, and the rank
    processes it spawned. Rank fields change under ``_cond``; socket reads
    happen only under ``_read_lock`` (acks of one rank stay in order).
    ``step`` is the last step handed to the ranks; an ``unmap`` is tagged
    with it, so a rank applies it only after finishing that step.
    """

    def __init__(
        self, ranks: Sequence[_Rank], procs: Sequence[subprocess.Popen[bytes]] = ()
    ) -> None:
        self._ranks = list(ranks)
        self._procs = list(procs)
        self._cond = threading.Condition()
        self._seq = 0
        self._watch = 0  # wake the engine when a rank acks this seq (0: nothing watched)
        self._wake: Callable[[], None] | None = None
        self._flush: Callable[[], None] | None = None
        self._closed = False
        self.deaths = 0  # ranks that died so far; the barrier's liveness epoch
        self.step = -1
        self._read_lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._watcher = threading.Thread(target=self._watch_loop, name="rank-watcher", daemon=True)
        self._watcher.start()

    # -- start-up ----------------------------------------------------------------------
    @classmethod
    def spawn(
        cls,
        socket_path: str,
        world_size: int,
        *,
        timeout_s: float = 60.0,
        barrier_delay_s: Mapping[int, float] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RankGroup:
        """Listen on ``socket_path``, start ``world_size`` rank processes, accept them all."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1; got {world_size}")
        listener = _listen(socket_path)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(world_size):
                args = [
                    sys.executable,
                    "-m",
                    "engine_ext.ranks",
                    "--socket",
                    socket_path,
                    "--rank",
                    str(rank),
                ]
                delay = (barrier_delay_s or {}).get(rank, 0.0)
                if delay:
                    args += ["--barrier-delay-s", str(delay)]
                procs.append(subprocess.Popen(args, env={**os.environ, **(env or {})}))
            ranks = _accept(listener, world_size, procs, timeout_s)
        except BaseException:
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        finally:
            listener.close()
            _unlink(socket_path)
        return cls(ranks, procs)

    @classmethod
    def spawn_private(
        cls,
        runtime_root: Path,
        label: str,
        world_size: int,
        *,
        timeout_s: float = 60.0,
        barrier_delay_s: Mapping[int, float] | None = None,
    ) -> RankGroup:
        """:meth:`spawn` with the rank socket in a fresh private dir under ``runtime_root``.

        The dir (mode 0700, with an owner record so a crash's leftover is
        swept) and the socket exist only while the ranks connect.
        """
        private = RuntimeDir.create_unique(runtime_root, f".ranks-{label}-")
        try:
            return cls.spawn(
                str(private.file(RANK_SOCKET_FILE)),
                world_size,
                timeout_s=timeout_s,
                barrier_delay_s=barrier_delay_s,
            )
        finally:
            private.remove()

    def set_flush(self, flush: Callable[[], None] | None) -> None:
        """Called before every ``call``/``run_step``: the backend sends its queued unmaps first."""
        self._flush = flush

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Called (from a reader thread) when a watched ack arrives or a rank dies."""
        self._wake = wake

    # -- engine thread -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self._ranks]

    def broadcast(self, op: str, **fields: Any) -> int:
        """Send ``op`` to every live rank; returns its sequence number. Never waits for acks."""
        with self._cond:
            self._seq += 1
            seq = self._seq
        message = {"op": op, "seq": seq, **fields}
        for rank in self._ranks:
            if not rank.alive:
                continue
            try:
                send_message(rank.sock, message)
            except (OSError, RankChannelError) as exc:
                self._mark_dead(rank, f"send failed: {exc}")
        return seq

    def watch(self, seq: int) -> None:
        """Wake the engine when ranks acknowledge ``seq`` (the barrier waits for it)."""
        with self._cond:
            self._watch = max(self._watch, seq)

    def acked_by_all_alive(self, seq: int) -> bool:
        with self._cond:
            return all(r.acked >= seq for r in self._ranks if r.alive)

    def any_dead(self) -> bool:
        with self._cond:
            return any(not r.alive for r in self._ranks)

    def wait(self, seq: int, timeout_s: float) -> BarrierOutcome:
        """Wait at most ``timeout_s`` until every live rank acked ``seq``; a dead rank fails it.

        Reads the acks on this thread (under the read lock, so the watcher
        cannot take one between the check and the ``select``).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._read_lock:
                with self._cond:
                    if self._closed or all(r.acked >= seq or not r.alive for r in self._ranks):
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._pump(left)
        with self._cond:
            if any(not r.alive for r in self._ranks):
                return BarrierOutcome.FAILED
            if all(r.acked >= seq for r in self._ranks):
                return BarrierOutcome.CONFIRMED
            return BarrierOutcome.TIMEOUT

    def call(self, op: str, timeout_s: float, **fields: Any) -> None:
        """Broadcast ``op`` and wait for every ack; raise if a rank is dead or too slow."""
        if self._flush is not None:
            self._flush()
        seq = self.broadcast(op, **fields)
        outcome = self.wait(seq, timeout_s)
        if outcome is not BarrierOutcome.CONFIRMED:
            raise RankChannelError(f"{op} #{seq}: {self.describe(outcome)}")

    def run_step(self, fields: Mapping[str, Any], timeout_s: float) -> int:
        """Hand the next step to every rank and wait until all finished it."""
        self.step += 1
        self.call("step", timeout_s, step=self.step, **fields)
        return self.step

    def states(self) -> tuple[RankState, ...]:
        """Each rank's last measured mapped bytes and whether it is alive."""
        with self._cond:
            return tuple(
                RankState(rank=r.rank, mapped_bytes=r.mapped_bytes, alive=r.alive)
                for r in self._ranks
            )

    def describe(self, outcome: BarrierOutcome) -> str:
        """What a failed or timed-out wait means, for an error message."""
        with self._cond:
            dead = [f"rank {r.rank} (pid {r.pid}): {r.error}" for r in self._ranks if not r.alive]
            slow = [str(r.rank) for r in self._ranks if r.alive and r.acked < self._seq]
        if outcome is BarrierOutcome.FAILED:
            return (
                "dead: " + "; ".join(dead) + ". The engine cannot use this rank any more: "
                "restart the instance"
            )
        return f"ranks {', '.join(slow)} did not answer in time"

    # -- shutdown (any thread) ---------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Tell every rank to stop, close the sockets, reap the processes. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        os.write(self._stop_w, b"x")  # the watcher (and any waiting select) returns
        for rank in self._ranks:
            if rank.alive:
                try:
                    send_message(rank.sock, {"op": "stop", "seq": 0})
                except (OSError, RankChannelError):
                    pass
            try:
                rank.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            rank.sock.close()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=max(0.1, deadline - time.monotonic()))
        if not self._watcher.is_alive():
            os.close(self._stop_r)
        os.close(self._stop_w)

    # -- reading acks (under _read_lock) ----------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        """Read the acks that arrive within ``timeout_s`` (those already there: 0)."""
        live = [r for r in self._ranks if r.alive]
        try:
            ready = select.select([r.sock for r in live] + [self._stop_r], [], [], timeout_s)[0]
        except (OSError, ValueError):  # a socket closed under us: close() is running
            return
        for rank in live:
            if rank.sock in ready:
                self._read_one(rank)

    def _read_one(self, rank: _Rank) -> None:
        try:
            message = recv_message(rank.sock)
            if message is None:
                self._mark_dead(rank, "the rank closed its socket (process gone?)")
                return
            seq = int(message["seq"])
            with self._cond:
                rank.acked = seq
                rank.finished_step = int(message["finished_step"])
                rank.mapped_bytes = int(message["mapped_bytes"])
                rank.mapped_pages = int(message["mapped_pages"])
                watched = 0 < self._watch <= seq
                self._cond.notify_all()
            if watched:
                self._notify()
        except (OSError, RankChannelError, KeyError, ValueError) as exc:
            self._mark_dead(rank, f"channel error: {exc}")

    def _watch_loop(self) -> None:
        """Sleep until a rank socket is readable; read what the engine does not wait for."""
        while True:
            with self._cond:
                if self._closed:
                    return
                socks = [r.sock for r in self._ranks if r.alive]
            try:
                ready = select.select(socks + [self._stop_r], [], [])[0]
            except (OSError, ValueError):
                if self._closed:
                    return
                continue
            if self._stop_r in ready:
                return
            with self._read_lock:
                self._pump(0)

    def _mark_dead(self, rank: _Rank, why: str) -> None:
        with self._cond:
            if not rank.alive:
                return
            rank.alive = False
            rank.error = why
            self.deaths += 1
            closing = self._closed
            self._cond.notify_all()
        if not closing:
            _log.error("kvsidecar: rank %d (pid %d) failed: %s", rank.rank, rank.pid, why)
            self._notify()

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None:
            try:
                wake()
            except Exception:  # noqa: BLE001 -- a wake must never kill the reader thread
                _log.exception("waking the engine after a rank event failed")


def _listen(path: str) -> socket.socket:
    _unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(old)
        listener.listen(64)
    except OSError as exc:
        listener.close()
        raise RankChannelError(
            f"cannot listen for ranks on {path!r}: {exc}; check "
            "KVSIDECAR_RUNTIME_DIR (a private dir, short path)"
        ) from exc
    return listener


def _accept(
    listener: socket.socket,
    world_size: int,
    procs: Sequence[subprocess.Popen[bytes]],
    timeout_s: float,
) -> list[_Rank]:
    deadline = time.monotonic() + timeout_s
    found: dict[int, _Rank] = {}
    while len(found) < world_size:
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RankChannelError(f"a rank process exited during start-up: {dead}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankChannelError(
                f"only {len(found)} of {world_size} ranks connected within {timeout_s:.0f}s"
            )
        listener.settimeout(min(left, 0.5))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(left)
        try:
            hello = recv_message(conn)
        except (OSError, RankChannelError):
            conn.close()
            continue
        rank = None if hello is None else hello.get("hello")
        if not isinstance(rank, int) or not 0 <= rank < world_size or rank in found:
            conn.close()  # not one of our ranks (a probe, a duplicate): ignore it
            continue
        conn.settimeout(None)
        found[rank] = _Rank(rank=rank, pid=int(hello["pid"]), sock=conn)  # type: ignore[index]
    return [found[r] for r in range(world_size)]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
