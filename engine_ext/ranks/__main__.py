"""``python -m engine_ext.ranks --socket PATH --rank N``: run one rank process."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

from ._worker import RankWorker

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # runs finally: releases the view
    try:
        return RankWorker(args.socket, args.rank, barrier_delay_s=args.barrier_delay_s).run()
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
