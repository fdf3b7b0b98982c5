"""``python -m engine_ext.cpu_harness.run_engine {vllm,sglang}``: one CPU-harness engine in
the foreground, for the compose CPU demo and for trying the sidecar by hand.

Writes the tiny model (:func:`make_tiny_model_dir`) to ``--model-dir``, starts
the real ``vllm serve`` (stub executor) or SGLang's real server (stub forward,
through kvsidecar's launcher) on ``--host:--port`` with the process's
``KVSIDECAR_*`` environment, prints one line when it is healthy and stays
until the engine exits or this process gets SIGTERM/SIGINT (or SIGHUP, unless
ignored), which stops the engine's whole process group. Exit code: the engine's (0 after a clean stop).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from engine_ext.cpu_harness import (
    ServerProcess,
    launch_sglang_server,
    launch_vllm_server,
    make_tiny_model_dir,
)

__all__ = ["main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine_ext.cpu_harness.run_engine",
        description="Run one CPU-harness engine (tiny model, no weights, KV cache in host "
        "memory) in the foreground with the kvsidecar extension; KVSIDECAR_* from the "
        "environment (KVSIDECAR_INSTANCE_ID, KVSIDECAR_SIDECAR_URL, ...).",
    )
    parser.add_argument("engine", choices=("vllm", "sglang"))
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on [127.0.0.1]")
    parser.add_argument("--port", type=int, required=True, help="HTTP port of the engine")
    parser.add_argument("--model-dir", type=Path, help="where the tiny model goes [a temp dir]")
    parser.add_argument(
        "--served-model-name", default="tiny", help="the model name clients send [tiny]"
    )
    parser.add_argument(
        "--start-timeout-s",
        type=float,
        default=900.0,
        help="seconds to wait for /health (SGLang takes minutes on a small CPU) [900]",
    )
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: must be 1-65535")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # SIGTERM/SIGINT become SystemExit: during start-up the launcher stops the half-started
    # engine group on it, afterwards the ``finally`` below does. SIGHUP too (a terminal
    # closing), unless ignored (nohup): by default it ended this process at once and the
    # engine, in a session of its own, ran on
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _exit)
    model_dir = make_tiny_model_dir(args.model_dir or Path(tempfile.mkdtemp()) / "model")
    extra = ["--host", args.host, "--served-model-name", args.served_model_name]
    server: ServerProcess
    if args.engine == "sglang":
        server = launch_sglang_server(
            model_dir, port=args.port, extra_args=extra, timeout_s=args.start_timeout_s
        )
    else:
        server = launch_vllm_server(
            model_dir, port=args.port, extra_args=extra, timeout_s=args.start_timeout_s
        )
    try:
        print(f"{args.engine} engine healthy on {args.host}:{args.port} (log {server.log_path})")
        sys.stdout.flush()
        return server.proc.wait()
    finally:
        server.stop()


def _exit(signum: int, _frame: FrameType | None) -> None:
    sys.exit(0)


if __name__ == "__main__":
    sys.exit(main())
