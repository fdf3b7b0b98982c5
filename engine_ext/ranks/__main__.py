"""``python -m engine_ext.ranks --socket PATH --rank N``: run one rank process.

A rank lives as long as its engine: it exits when the engine ends the stream
(``stop``, the socket closed, the engine dead). SIGINT and SIGTERM do not end it at
once: Ctrl-C in a terminal and a service manager's stop reach every process of the
group, the engine included, which may be in a step just then (vLLM's busy loop
runs one before its shutdown starts); a rank gone first fails that step and the
engine ends with a fatal "rank dead" error instead of its orderly shutdown. So a
signalled rank keeps serving until the engine closes the stream, at most
:data:`SIGNAL_GRACE_S` (then it exits on its own: an engine that did not stop, or
a signal sent to the rank alone).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

from ._worker import RankWorker

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: After SIGINT or SIGTERM a rank serves its engine at most this long more (module doc).
SIGNAL_GRACE_S = 10


def _die_with_parent(parent_pid: int) -> bool:
    """Have the kernel SIGKILL this rank when its parent dies; False if the engine that
    started it (``parent_pid``) is gone already. The end of the socket ends a running rank,
    but not one stopped (SIGSTOP, a debugger) or hung in a call, which would hold the KV
    memfd for good."""
    libc = ctypes.CDLL(None, use_errno=True)  # libc's symbols are the process's
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == parent_pid:
        return True
    # another parent: the engine died before the prctl (no signal will come), or the rank
    # was started through a wrapper process (then the signal follows the wrapper)
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid): not the engine
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_ext.ranks", description="one kvsidecar TP/PP rank process"
    )
    parser.add_argument("--socket", required=True, help="the scheduler's rank socket")
    parser.add_argument("--rank", type=int, required=True, help="rank number (0-based)")
    parser.add_argument(
        "--barrier-delay-s",
        type=float,
        default=0.0,
        help="delay every unmap ack by this long (drills and tests)",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="the engine's pid: this rank is killed when that process dies",
    )
    args = parser.parse_args(argv)
    if args.parent_pid is not None and not _die_with_parent(args.parent_pid):
        print(f"kvsidecar rank {args.rank}: the engine (pid {args.parent_pid}) is gone", flush=True)
        return 0  # nothing to serve
    _follow_the_engine(args.rank)
    return RankWorker(args.socket, args.rank, barrier_delay_s=args.barrier_delay_s).run()


def _follow_the_engine(rank: int) -> None:
    """SIGINT/SIGTERM: serve on until the engine ends the stream, at most SIGNAL_GRACE_S
    (module docstring); SIGALRM then exits (``sys.exit`` runs ``finally``: the view is
    released)."""

    def on_signal(signum: int, frame: object) -> None:
        del frame
        left = signal.alarm(SIGNAL_GRACE_S)
        if left:  # a later signal keeps the first one's deadline
            signal.alarm(left)
            return
        print(
            f"kvsidecar rank {rank}: {signal.Signals(signum).name}: serving until the engine "
            f"ends the stream (at most {SIGNAL_GRACE_S} s)",
            flush=True,
        )

    signal.signal(signal.SIGALRM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


if __name__ == "__main__":
    sys.exit(main())
