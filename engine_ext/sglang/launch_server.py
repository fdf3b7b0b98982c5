"""``python -m engine_ext.sglang.launch_server <sglang args>``: SGLang's HTTP server with kvsidecar.

SGLang has no plugin hook that runs before its scheduler builds the KV
cache in every process, so this launcher installs the adapter (version
guard + patch table) and starts SGLang's own HTTP server with its scheduler
processes entering through :func:`engine_ext.sglang._install.run_scheduler_process`.
``KVSIDECAR_ENABLE`` defaults to on here; every other setting comes from
``KVSIDECAR_*`` (see docs/sglang.md). From Python, the one-line alternative
is ``engine_ext.sglang.install()`` before ``sglang.Engine(...)``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import EngineExtConfigError

__all__ = ["main", "prepare"]


def prepare(argv: Sequence[str]) -> tuple[Any, Any]:
    """Install kvsidecar and parse SGLang's arguments; returns (server_args, scheduler entry).

    Separate from :func:`main` so the installation can be tested without a model.
    """
    os.environ.setdefault("KVSIDECAR_ENABLE", "1")  # spawned schedulers inherit it
    from . import install
    from ._install import run_scheduler_process

    if not install():
        raise EngineExtConfigError("KVSIDECAR_ENABLE is off; run `python -m sglang.launch_server`")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    server_args = prepare_server_args(list(argv))
    return server_args, run_scheduler_process


def main(
    argv: Sequence[str] | None = None, *, scheduler_entry: Callable[..., Any] | None = None
) -> int:
    """Run SGLang's HTTP server (the default mode of ``sglang.launch_server``) with kvsidecar.

    ``scheduler_entry`` replaces the scheduler processes' entry (the CPU
    harness wraps kvsidecar's to install its stub model runner first); it
    must itself end in :func:`engine_ext.sglang.run_scheduler_process`.
    """
    try:
        server_args, entry = prepare(sys.argv[1:] if argv is None else argv)
    except EngineExtConfigError as exc:
        print(f"kvsidecar: {exc}", file=sys.stderr)
        return 2
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.utils import kill_process_tree

    server_args.resolve_once()
    cfg = resolving_view(server_args)
    if cfg.encoder_only or cfg.smg_grpc_mode or cfg.use_ray:
        print(
            "kvsidecar: only SGLang's HTTP server mode is supported (no --encoder-only, "
            "--grpc-mode or --use-ray)",
            file=sys.stderr,
        )
        return 2
    try:
        launch_server(server_args, run_scheduler_process_func=scheduler_entry or entry)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
