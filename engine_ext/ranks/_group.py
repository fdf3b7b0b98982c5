"""The scheduler side of the rank channel: one unix socket per rank, acks in order.

Threads: the engine thread calls everything except :meth:`RankGroup.close`
(any thread, idempotent). The engine thread reads the acks it waits for
itself, under the read lock (a direct receive, no hand-off through another
thread). One daemon watcher thread sleeps in ``poll`` on each rank's
*pidfd* (readable when the process exits) and on a kick pipe, so an ack the
engine waits for wakes only the engine; the watcher adds the rank sockets to
its ``poll`` only while a :meth:`RankGroup.watch` is outstanding (acks that
arrive while the engine does not wait: it reads them and wakes the engine).
Where no pidfd can be opened the watcher watches that rank's socket always
(correct, just a second wake-up per ack). Every wait is a ``poll``, never a
``select``: an engine process may hold more than 1024 descriptors, and
``select`` cannot take a descriptor numbered 1024 or above.

Sends never wait: what a rank's socket does not take at once (its buffer is
full) stays in that rank's backlog, in order, and is pushed whenever its socket
takes more -- by the engine thread while it waits for acks, by the watcher
otherwise. So a call waits on one deadline, its own, however many ranks are
stuck. A rank that makes no progress for ``send_timeout_s`` while it owes
something -- its socket takes no byte of its backlog, or it acks nothing while
ops it received are outstanding (its process stopped by SIGSTOP or a debugger,
or wedged) -- is declared dead as if it had exited, and killed if this group
started it (a stopped rank would still map pages the owner gives back once it
counts as dead). Every stuck rank is judged against the same clock, so two
stuck ranks die together, not one ``send_timeout_s`` after the other. A rank
that breaks the channel (garbage, an ack out of order) is ended the same way.
``close()`` sends ``stop`` only to a rank whose stream is between frames (no
backlog), so ``stop`` never lands inside a half-sent op.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_ext._barrier import BarrierOutcome
from engine_ext._runtime_dir import RANK_SOCKET_FILE, RuntimeDir
from engine_ext.protocol import MAX_SOCKET_PATH_BYTES, RankState

from ._procmaps import file_view_bytes
from ._wire import FrameReader, RankChannelError, decode_ack, decode_message, encode_op

__all__ = ["RankGroup"]

_log = logging.getLogger("engine_ext.ranks")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: How long a rank may take no byte of what the engine sends before it counts as dead.
DEFAULT_SEND_TIMEOUT_S = 60.0
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL  # a send never sleeps in the kernel


@dataclass(slots=True)
class _Rank:
    rank: int
    pid: int  # from the kernel (SO_PEERCRED) where the socket says, else from the hello
    sock: socket.socket
    reader: FrameReader[tuple[int, int, int, int]] = field(init=False)  # acks
    fd: int = field(init=False)  # the socket's descriptor, for select
    pidfd: int | None = None  # readable once the process exited; None: watch the socket
    alive: bool = True
    acked: int = 0  # highest seq this rank acknowledged (acks arrive in order)
    finished_step: int = -1
    mapped_bytes: int = 0  # the rank's own view (its mprotects; /proc-checked on probe)
    mapped_pages: int = 0
    error: str | None = None
    # what its socket has not taken yet (under _send_lock): the frames handed over when it
    # took them all (the usual case), else a bytearray (appends amortized, and taking bytes
    # off its front is O(1) in CPython: no copy of the whole backlog per send or per op)
    unsent: bytes | bytearray = b""
    progress_at: float = 0.0  # last byte taken or ack read, or since when it owes anything

    def __post_init__(self) -> None:
        self.reader = FrameReader(self.sock, decode_ack)
        self.fd = self.sock.fileno()


class RankGroup:
    """Broadcasts ops to every rank and waits for their acks.

    Owns the listening socket (unlinked as soon as every rank connected), the
    per-rank sockets and pidfds, the watcher thread and its kick pipe, and
    the rank processes it spawned. Rank fields change under ``_lock``; socket
    reads happen only under ``_read_lock`` (acks of one rank stay in order);
    sends, and each rank's backlog, only under ``_send_lock`` (taken last).
    Frames from :meth:`queue` wait in ``_held`` and leave with the next
    :meth:`broadcast`, :meth:`wait` or :meth:`watch` (one ``send`` per rank).
    ``step`` is the last step handed to the ranks; an ``unmap`` is tagged
    with it, so a rank applies it only after finishing that step.
    """

    def __init__(
        self,
        ranks: Sequence[_Rank],
        procs: Sequence[subprocess.Popen[bytes]] = (),
        *,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        if not send_timeout_s > 0:
            raise ValueError(f"send_timeout_s must be positive; got {send_timeout_s}")
        self._ranks = list(ranks)
        self._procs = list(procs)
        self.send_timeout_s = send_timeout_s  # a rank that takes no byte this long is dead
        self._lock = threading.Lock()  # rank fields, _watch, _armed, _closed
        self._seq = 0
        self._states: tuple[RankState, ...] = ()  # last answer of states() (engine thread)
        self._states_key: tuple[tuple[int, bool], ...] | None = None  # what it was built from
        self._held: list[bytes] = []  # queued frames, not sent yet (engine thread)
        self._watch = 0  # wake the engine when every live rank acked this seq (0: none)
        self._armed = False  # the watcher's select includes the rank sockets
        self._wake: Callable[[], None] | None = None
        self._flush: Callable[[], None] | None = None
        self._closed = False
        self.deaths = 0  # ranks that died so far; the barrier's liveness epoch
        self.watcher_wakeups = 0  # times the watcher woke for a rank (tests, bench: acks must not)
        self.step = -1
        self._read_lock = threading.Lock()
        self._send_lock = threading.Lock()  # rank.unsent, rank.progress_at, every send
        self._sent = 0  # the highest seq in every live rank's stream (sent or in its backlog)
        self._kick_r, self._kick_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)  # re-arm the watcher
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)  # close(): every select returns
        for rank in self._ranks:
            rank.pidfd = _open_pidfd(rank.pid)
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
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> RankGroup:
        """Listen on ``socket_path``, start ``world_size`` rank processes, accept them all.

        ``send_timeout_s``: a rank that makes no progress for this long is
        declared dead (and killed); see the module docstring. Called from the
        process's main thread (the engine's busy loop), each rank is killed by the
        kernel when this process dies, so a ``kill -9`` of the engine ends a stopped
        or hung rank too. The parent-death signal follows the *thread* that started
        the process, so from any other thread (which may end before the engine)
        the ranks do without it: they end with their socket, as before."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1; got {world_size}")
        tie = ["--parent-pid", str(os.getpid())]  # killed by the kernel when this process dies
        if threading.current_thread() is not threading.main_thread():
            _log.info(
                "rank processes started from thread %r, not the main thread: they are not "
                "tied to this process's death (a stopped rank outlives a kill -9 of the engine)",
                threading.current_thread().name,
            )
            tie = []
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
                    *tie,
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
        return cls(ranks, procs, send_timeout_s=send_timeout_s)

    @classmethod
    def spawn_private(
        cls,
        runtime_root: Path,
        label: str,
        world_size: int,
        *,
        timeout_s: float = 60.0,
        barrier_delay_s: Mapping[int, float] | None = None,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> RankGroup:
        """:meth:`spawn` with the rank socket in a fresh private dir under ``runtime_root``.

        The dir (mode 0700, with an owner record so a crash's leftover is
        swept) and the socket exist only while the ranks connect. ``label``
        (the instance id) only names the dir: it is cut short where the whole
        socket path would not fit in ``sun_path``, so any instance whose
        control socket fits can start its ranks too.
        """
        private = RuntimeDir.create_unique(runtime_root, _private_prefix(runtime_root, label))
        try:
            return cls.spawn(
                str(private.file(RANK_SOCKET_FILE)),
                world_size,
                timeout_s=timeout_s,
                barrier_delay_s=barrier_delay_s,
                send_timeout_s=send_timeout_s,
            )
        finally:
            private.remove()

    def set_flush(self, flush: Callable[[], None] | None) -> None:
        """Called before every ``call``/``run_step``: the backend queues its unmaps first."""
        self._flush = flush

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Called (from the watcher thread) when a watched ack arrives or a rank dies."""
        self._wake = wake

    # -- engine thread -------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self._ranks]

    def queue(self, op: str, **fields: Any) -> int:
        """Number ``op`` and hold it for the next send to the ranks; returns its seq.

        It leaves with the next :meth:`broadcast`, :meth:`wait` or
        :meth:`watch`, in the order queued, in the same ``send``.
        """
        self._seq += 1  # only the engine thread numbers ops
        seq = self._seq
        self._held.append(encode_op(op, seq, fields))
        return seq

    def broadcast(self, op: str, **fields: Any) -> int:
        """Send the queued frames and ``op`` to every live rank; returns its seq. Never waits."""
        seq = self.queue(op, **fields)
        self._send_held()
        return seq

    def watch(self, seq: int) -> None:
        """Wake the engine when every live rank acked ``seq`` (the barrier waits for it).

        From now until then the watcher thread also reads the rank sockets,
        so acks that arrive while the engine does not wait still wake it.
        """
        self._send_held()
        with self._lock:  # kicks under the lock: close() sets _closed under it, then closes
            self._watch = max(self._watch, seq)
            if not (self._closed or self._armed) and self._watch_outstanding():
                _kick(self._kick_w)

    def acked_by_all_alive(self, seq: int) -> bool:
        return self.acked_by_all() >= seq

    def acked_by_all(self) -> int:
        """The highest seq every live rank acknowledged (all acked: the last seq sent)."""
        with self._lock:
            return min((r.acked for r in self._ranks if r.alive), default=self._seq)

    def any_dead(self) -> bool:
        with self._lock:
            return any(not r.alive for r in self._ranks)

    def wait(self, seq: int, timeout_s: float) -> BarrierOutcome:
        """Wait at most ``timeout_s`` until every live rank acked ``seq``; a dead rank fails it.

        Sends what is queued, then reads the acks on this thread, holding the
        read lock throughout (the watcher cannot take one meanwhile), and
        pushes every backlog its socket takes. One deadline for every rank; a
        rank that makes no progress for ``send_timeout_s`` meanwhile is dead.
        """
        self._send_held()
        deadline = time.monotonic() + timeout_s
        ranks = self._ranks
        with self._read_lock:
            while True:
                # rank fields change only under the read lock, which this thread holds
                pending = [r for r in ranks if r.alive and r.acked < seq]
                if not pending or self._closed:
                    break
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    break
                with self._send_lock:
                    backlog = [r for r in ranks if r.alive and r.unsent]
                    owing = pending + [r for r in backlog if r not in pending]
                    stall = min(r.progress_at for r in owing) + self.send_timeout_s - now
                ready = _poll_io(
                    [r.fd for r in pending],
                    [r.fd for r in backlog],
                    self._stop_r,
                    min(left, max(stall, 0.0)),
                )
                if ready is None:  # close() is running (a socket closed under us)
                    break
                readable, writable = ready
                for rank in pending:
                    if rank.fd in readable:
                        self._read_one(rank)
                self._push_ready([r for r in backlog if r.fd in writable])
                self._judge(pending)
        outcome = BarrierOutcome.CONFIRMED
        for rank in ranks:
            if not rank.alive:
                return BarrierOutcome.FAILED
            if rank.acked < seq:
                outcome = BarrierOutcome.TIMEOUT
        return outcome

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
        """Each rank's last measured mapped bytes and whether it is alive. A dead rank maps
        nothing: its address space (on a GPU, its context and allocations) went with it."""
        with self._lock:
            key = tuple((r.mapped_bytes if r.alive else 0, r.alive) for r in self._ranks)
        if key != self._states_key:  # built (validated) only when a figure changed
            self._states = tuple(
                RankState(rank=r.rank, mapped_bytes=mapped, alive=alive)
                for r, (mapped, alive) in zip(self._ranks, key, strict=True)
            )
            self._states_key = key
        return self._states

    def describe(self, outcome: BarrierOutcome) -> str:
        """What a failed or timed-out wait means, for an error message."""
        with self._lock:
            dead = [f"rank {r.rank} (pid {r.pid}): {r.error}" for r in self._ranks if not r.alive]
            slow = [str(r.rank) for r in self._ranks if r.alive and r.acked < self._seq]
        if outcome is BarrierOutcome.FAILED:
            return (
                "dead: " + "; ".join(dead) + ". The engine cannot use this rank any more: "
                "restart the instance"
            )
        return f"ranks {', '.join(slow)} did not answer in time"

    def check_views(self, device: int, inode: int) -> None:
        """Compare every live, caught-up rank's view of the file ``(device, inode)`` in
        ``/proc/<pid>/maps`` (the kernel's list, not the rank's word) with what it acked;
        a rank whose view disagrees is dead (and killed).

        Only ranks that acked every op sent and have nothing unsent are compared:
        they are idle, so their view is final. 0.5 ms per rank (a 370-line maps
        file, the view in 64 pieces): called by ``RankedBackend.probe``, never on the
        engine's passes (per release it would cost more than the release; issue 17).
        """
        with self._read_lock:  # no ack is read meanwhile
            with self._send_lock:
                idle = [r for r in self._ranks if r.alive and not r.unsent]
                # a rank inside this process (tests) shares its maps with the owner's view
                idle = [r for r in idle if r.acked >= self._sent and r.pid != os.getpid()]
            wrong: list[tuple[_Rank, str]] = []
            for rank in idle:
                try:
                    seen = file_view_bytes(rank.pid, device, inode)
                except OSError:  # gone (its pidfd tells the watcher) or not ours to read
                    continue
                if seen != rank.mapped_bytes:
                    wrong.append(
                        (
                            rank,
                            f"its /proc/{rank.pid}/maps shows {seen} bytes of "
                            f"the KV memory readable but it acknowledged "
                            f"{rank.mapped_bytes} (it acked an op it did not apply, "
                            "or its view is corrupt): it counts as dead"
                            + (" and was killed" if self._proc_of(rank) else "")
                            + "; restart the instance",
                        )
                    )
            for rank, why in wrong:
                self._mark_dead(rank, why, kill=True)

    # -- shutdown (any thread) ---------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Tell every rank to stop, close the sockets, reap the processes. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._stop_w, b"x")  # the watcher (and any waiting poll) returns
        stop = encode_op("stop", 0, {})
        with self._send_lock:  # no send of the engine thread's is half done
            for rank in self._ranks:
                # stop only between frames (after a half-sent op it would be read as the
                # op's payload) and only if the socket takes it at once (a stopped rank's
                # buffer may be full): the end of stream below stops a rank as well
                if rank.alive and not rank.unsent:
                    try:
                        rank.sock.send(stop, _SEND_FLAGS)
                    except OSError:
                        pass
                rank.unsent = b""
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
        if not self._watcher.is_alive():  # else the watcher may still select on them
            os.close(self._kick_r)
            os.close(self._stop_r)
            for rank in self._ranks:
                if rank.pidfd is not None:
                    os.close(rank.pidfd)
                    rank.pidfd = None
        os.close(self._kick_w)
        os.close(self._stop_w)

    # -- sending (engine thread) -------------------------------------------------------
    def _send_held(self) -> None:
        """Hand the held frames to every live rank's socket; what a socket does not take at
        once stays in that rank's backlog (pushed by :meth:`wait` and the watcher). Never
        waits."""
        if not self._held:
            return
        frames = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held = []
        failed: list[tuple[_Rank, str]] = []
        with self._send_lock:
            if self._closed:  # close() ended every stream
                return
            now = time.monotonic()
            backlog = False
            for rank in self._ranks:
                if not rank.alive:
                    continue
                if not rank.unsent:
                    if rank.acked >= self._sent:  # it owes nothing until now
                        rank.progress_at = now
                    rank.unsent = frames
                else:  # behind what it was sent before: after that, in order
                    if not isinstance(rank.unsent, bytearray):
                        rank.unsent = bytearray(rank.unsent)
                    rank.unsent += frames
                error = self._push(rank, now)
                if error is not None:
                    failed.append((rank, error))
                backlog = backlog or bool(rank.unsent)
            self._sent = self._seq
        for rank, error in failed:
            self._mark_dead(rank, error)
        if backlog:  # the watcher pushes it while the engine does not wait
            with self._lock:
                if not self._closed:
                    _kick(self._kick_w)

    def _push(self, rank: _Rank, now: float) -> str | None:
        """Under ``_send_lock``: send what ``rank``'s socket takes of its backlog now; why it
        failed (the rank is gone), else None."""
        if not rank.alive or self._closed or not rank.unsent:
            return None
        try:
            sent = rank.sock.send(rank.unsent, _SEND_FLAGS)
        except BlockingIOError:
            return None
        except OSError as exc:
            rank.unsent = b""
            return f"send failed: {exc}"
        if sent:
            rank.progress_at = now
            if sent == len(rank.unsent):
                rank.unsent = b""
            elif isinstance(rank.unsent, bytearray):
                del rank.unsent[:sent]
            else:
                rank.unsent = bytearray(memoryview(rank.unsent)[sent:])
        return None

    def _push_ready(self, ranks: Sequence[_Rank]) -> None:
        """Push the backlogs of ``ranks`` (their sockets said they take more)."""
        if not ranks:
            return
        with self._send_lock:
            now = time.monotonic()
            failed = [(r, e) for r in ranks if (e := self._push(r, now)) is not None]
        for rank, error in failed:
            self._mark_dead(rank, error)

    def _judge(self, read: Sequence[_Rank]) -> None:
        """Declare dead (and kill) every live rank that made no progress for ``send_timeout_s``
        while it owed something: a backlog its socket took no byte of, or -- for the ranks in
        ``read``, whose sockets the caller just read -- the acks of ops it received."""
        stuck: list[tuple[_Rank, str]] = []
        with self._send_lock:
            now = time.monotonic()
            for rank in self._ranks:
                if not rank.alive or rank.progress_at + self.send_timeout_s > now:
                    continue
                if rank.unsent:
                    stuck.append((rank, "its socket took no data"))
                elif rank in read and rank.acked < self._sent:
                    stuck.append((rank, "it acknowledged none of the ops it received"))
        for rank, what in stuck:
            self._mark_dead(rank, self._stalled(rank, what), kill=True)

    def _stalled(self, rank: _Rank, what: str) -> str:
        """Why a rank that made no progress for ``send_timeout_s`` is dead; what to do."""
        return (
            f"{what} for {self.send_timeout_s:g} s (the process is stopped, "
            "e.g. by SIGSTOP or a debugger, or hung): it counts as dead"
            + (" and was killed" if self._proc_of(rank) is not None else "")
            + "; restart the instance, and raise KVSIDECAR_RANK_SEND_TIMEOUT_S if the rank "
            "was only slow"
        )

    # -- reading acks (under _read_lock) ----------------------------------------------
    def _read_one(self, rank: _Rank) -> None:
        """One ``recv`` from a readable socket; records every ack it completes."""
        try:
            messages = rank.reader.feed()
            if messages is None:
                self._mark_dead(rank, "the rank closed its socket (process gone?)")
                return
            if not messages:
                return
            seq = rank.acked
            for ack in messages:  # (seq, finished_step, mapped_bytes, mapped_pages), in order
                if ack[0] <= seq:
                    raise RankChannelError(f"ack #{ack[0]} arrived after #{seq}")
                seq = ack[0]
            if seq > self._seq:  # it would confirm ops (unmaps) the rank never received
                raise RankChannelError(
                    f"ack #{seq} for an op never sent (the last is #{self._seq})"
                )
            _, finished, mapped, pages = messages[-1]  # only the last one's figures matter
        except (OSError, RankChannelError) as exc:
            self._mark_dead(rank, f"channel error: {exc}", kill=True)  # may still run
            return
        with self._send_lock:
            rank.progress_at = time.monotonic()  # it answers: not stuck
        with self._lock:
            rank.acked = seq
            rank.finished_step = finished
            rank.mapped_bytes = mapped
            rank.mapped_pages = pages
            woke = self._watch > 0 and not self._watch_outstanding()
            if woke:
                self._watch = 0  # wake once per watch
        if woke:
            self._notify()

    def _watch_outstanding(self) -> bool:
        """Under ``_lock``: a watched seq that some live rank has not acked."""
        return self._watch > 0 and any(r.alive and r.acked < self._watch for r in self._ranks)

    def _watch_loop(self) -> None:
        """Sleep until a rank exits, a backlogged rank's socket takes more (pushed here while
        the engine does not wait) or stalls for ``send_timeout_s`` (dead), or, while a watch is
        outstanding, a rank socket is readable."""
        while True:
            with self._lock:
                if self._closed:
                    return
                self._armed = armed = self._watch_outstanding()
                live = [r for r in self._ranks if r.alive]
            with self._send_lock:
                backlog = {r.fd: r for r in live if r.unsent}
                stall = min((r.progress_at for r in backlog.values()), default=None)
            exits = {r.pidfd: r for r in live if r.pidfd is not None}
            socks = {r.fd: r for r in live if armed or r.pidfd is None}
            timeout = None
            if stall is not None:
                timeout = max(0.0, stall + self.send_timeout_s - time.monotonic())
            ready = _poll_io([self._kick_r, *exits, *socks], list(backlog), self._stop_r, timeout)
            if ready is None:  # stop, or a descriptor closed under us: close() is running
                if self._closed:
                    return
                continue
            readable_fds, writable_fds = ready
            if self._kick_r in readable_fds:
                try:
                    os.read(self._kick_r, 4096)
                except (BlockingIOError, OSError):
                    pass
            self._push_ready([backlog[fd] for fd in writable_fds])
            exited = [exits[fd] for fd in readable_fds if fd in exits]
            readable = [socks[s] for s in readable_fds if s in socks]
            if backlog:
                with self._read_lock:
                    self._judge(())  # backlogs only: the acks are read where they are awaited
            if not (exited or readable):
                continue
            self.watcher_wakeups += 1
            with self._read_lock:  # waits while the engine thread reads its own acks
                for rank in exited:  # what it sent last no longer matters: it maps nothing
                    self._mark_dead(rank, "the rank process exited")
                for rank in readable:
                    self._drain(rank)

    def _drain(self, rank: _Rank) -> None:
        """Read whatever the socket holds now, without blocking (under ``_read_lock``)."""
        while rank.alive:
            if not _poll([rank.fd], 0.0):  # nothing there, or closed under us (close() runs)
                return
            self._read_one(rank)

    def _mark_dead(self, rank: _Rank, why: str, *, kill: bool = False) -> None:
        """Count ``rank`` dead; ``kill``: its process may still run (stopped, wedged), so end
        its stream and kill it if this group started it: a dead rank must map nothing, as
        the owner gives back the pages the live ranks released."""
        with self._lock:
            if not rank.alive:
                return
            rank.alive = False
            rank.error = why
            self.deaths += 1
            closing = self._closed
        if kill and not closing:
            try:
                rank.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            proc = self._proc_of(rank)
            if proc is not None:
                proc.kill()  # SIGKILL ends a stopped process too; close() reaps it
        if not closing:
            _log.error("kvsidecar: rank %d (pid %d) failed: %s", rank.rank, rank.pid, why)
            self._notify()

    def _proc_of(self, rank: _Rank) -> subprocess.Popen[bytes] | None:
        """The process this group started for ``rank``, while it was not reaped."""
        for proc in self._procs:
            if proc.pid == rank.pid and proc.returncode is None:
                return proc
        return None

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None:
            try:
                wake()
            except Exception:  # noqa: BLE001 -- a wake must never kill the watcher thread
                _log.exception("waking the engine after a rank event failed")


_READY = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


def _poll(fds: Sequence[int], timeout_s: float | None) -> set[int] | None:
    """The descriptors of ``fds`` that are readable or ended, waiting at most ``timeout_s``
    (None: no limit); None if one of them is closed (``close()`` is running).

    ``poll``, not ``select``: ``select`` refuses any descriptor numbered 1024 or above
    (FD_SETSIZE), which an engine process with many files or connections reaches."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLPRI)
    timeout = None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
    try:
        events = poller.poll(timeout)
    except OSError:  # EINTR is retried by Python; anything else: treat as closed under us
        return None
    if any(event & select.POLLNVAL for _, event in events):
        return None
    return {fd for fd, event in events if event & _READY}


def _poll_io(
    reads: Sequence[int], writes: Sequence[int], stop: int, timeout_s: float | None
) -> tuple[set[int], set[int]] | None:
    """The descriptors of ``reads`` that are readable or ended and of ``writes`` that take
    data (or ended: the send says how), waiting at most ``timeout_s`` (None: no limit);
    None if ``stop`` is readable or a descriptor was closed (``close()`` is running)."""
    poller = select.poll()
    masks: dict[int, int] = {}
    for fd in reads:
        masks[fd] = masks.get(fd, 0) | select.POLLIN | select.POLLPRI
    for fd in writes:
        masks[fd] = masks.get(fd, 0) | select.POLLOUT
    for fd, mask in masks.items():
        poller.register(fd, mask)
    poller.register(stop, select.POLLIN)
    timeout = None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))
    try:
        events = poller.poll(timeout)
    except OSError:
        return None
    if any(fd == stop or event & select.POLLNVAL for fd, event in events):
        return None
    readable = {fd for fd, event in events if fd in reads and event & _READY}
    ended = select.POLLOUT | select.POLLHUP | select.POLLERR
    writable = {fd for fd, event in events if fd in writes and event & ended}
    return readable, writable


_RANKS_PREFIX = ".ranks-"
_UNIQUE_SUFFIX_BYTES = 8  # the random part ``tempfile.mkdtemp`` appends to a prefix


def _private_prefix(runtime_root: Path, label: str) -> str:
    """``.ranks-<label>-``, the label cut so ``<root>/<prefix><random>/r.sock`` fits."""
    fixed = len(os.fsencode(runtime_root.absolute())) + len(f"/{_RANKS_PREFIX}-/{RANK_SOCKET_FILE}")
    room = MAX_SOCKET_PATH_BYTES - fixed - _UNIQUE_SUFFIX_BYTES
    while label and len(os.fsencode(label)) > room:  # too long a root: _listen says so
        label = label[:-1]
    return f"{_RANKS_PREFIX}{label}-"


def _kick(fd: int) -> None:
    try:
        os.write(fd, b"k")
    except (BlockingIOError, OSError):  # full (a kick is pending anyway) or closed
        pass


def _peer_pid(conn: socket.socket) -> int:
    """The pid of the process that connected (the kernel's word, not the peer's)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return int(_PEERCRED.unpack(raw)[0])


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of the rank process, or None where the kernel has none (then the socket tells)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


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


_HELLO_MAX_BYTES = 4096  # a hello is a small JSON object; a longer one is not from a rank


def _accept(
    listener: socket.socket,
    world_size: int,
    procs: Sequence[subprocess.Popen[bytes]],
    timeout_s: float,
) -> list[_Rank]:
    """Accept the ranks' connections and read their hellos, all at once (one ``poll``).

    A connection that says nothing, or is slow to, holds up no other: a silent
    client (a probe, a stray process of this user) waited on alone would keep
    the ranks behind it in the backlog until the start-up timed out."""
    deadline = time.monotonic() + timeout_s
    found: dict[int, _Rank] = {}
    waiting: dict[int, FrameReader[dict[str, Any]]] = {}  # fd -> its connection's hello
    listener.setblocking(False)
    try:
        while len(found) < world_size:
            dead = [p.args for p in procs if p.poll() is not None]
            if dead:
                raise RankChannelError(f"a rank process exited during start-up: {dead}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankChannelError(
                    f"only {len(found)} of {world_size} ranks connected within {timeout_s:.0f}s"
                )
            ready = _poll([listener.fileno(), *waiting], min(left, 0.5)) or set()
            if listener.fileno() in ready:
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    pass
                else:
                    conn.setblocking(False)
                    waiting[conn.fileno()] = FrameReader(
                        conn, decode_message, max_frame_bytes=_HELLO_MAX_BYTES
                    )
            for fd in ready.intersection(waiting):
                reader = waiting[fd]
                try:
                    hellos = reader.feed()
                except BlockingIOError:
                    continue
                except (OSError, RankChannelError):  # too long, not JSON, cut short
                    hellos = None
                if hellos == []:
                    continue  # still arriving
                del waiting[fd]
                conn = reader.sock
                hello = _hello(hellos, reader.buffered, world_size)
                if hello is None or hello[0] in found or hello[1] != _peer_pid(conn):
                    conn.close()  # not one of our ranks (a probe, a duplicate, a lie): ignore it
                    continue
                conn.setblocking(True)
                found[hello[0]] = _Rank(rank=hello[0], pid=_peer_pid(conn), sock=conn)
    except BaseException:
        for rank_ in found.values():
            rank_.sock.close()
        raise
    finally:
        for reader in waiting.values():
            reader.sock.close()
    return [found[r] for r in range(world_size)]


def _hello(
    hellos: list[dict[str, Any]] | None, extra: int, world_size: int
) -> tuple[int, Any] | None:
    """The rank a connection's first frames name and the pid they claim, or None if they are
    not one rank's hello: a rank sends its hello alone (``extra``: bytes received after it)."""
    if hellos is None or len(hellos) != 1 or extra:
        return None
    rank = hellos[0].get("hello")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        return None
    return rank, hellos[0].get("pid")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
