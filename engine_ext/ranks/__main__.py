"""``python -m engine_ext.ranks --socket PATH --rank N``: run one rank process."""

from __future__ import annotations

import argparse
import signal
import sys

from ._worker import RankWorker


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
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # runs finally: releases the view
    try:
        return RankWorker(args.socket, args.rank, barrier_delay_s=args.barrier_delay_s).run()
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
