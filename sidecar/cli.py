"""``kvsidecar``: run the sidecar service (``serve``) or the CPU demo (``demo``)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import socket
from pathlib import Path
from typing import Annotated, Any

import typer

from ._cli_run import run_app
from ._errors import SidecarError
from ._logging import configure_logging
from ._settings import SidecarSettings, unknown_variables
from ._store import Store
from ._version import version_line

app = typer.Typer(
    name="kvsidecar",
    no_args_is_help=True,
    add_completion=False,
    help="Elastic KV-cache memory for LLM engines: the control-plane service.",
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line("kvsidecar"))
        raise typer.Exit(0)


@app.callback()
def _global(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="print the version and build facts, then exit",
        ),
    ] = False,
) -> None:
    """Elastic KV-cache memory for LLM engines: the control-plane service."""


@app.command()
def serve(
    host: Annotated[
        str | None, typer.Option(help="bind address [KVSIDECAR_HOST, 127.0.0.1]")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port [KVSIDECAR_PORT, 8570]")] = None,
    db: Annotated[
        Path | None,
        typer.Option(help="SQLite file [KVSIDECAR_DB_PATH, ~/.local/state/kvsidecar/sidecar.db]"),
    ] = None,
    log_format: Annotated[
        str | None,
        typer.Option(help="text or json (one object per line) [KVSIDECAR_LOG_FORMAT, text]"),
    ] = None,
) -> None:
    """Run the sidecar HTTP service until SIGINT/SIGTERM."""
    import uvicorn
    from pydantic import ValidationError

    from ._app import create_app
    from ._gc import freeze_start_up
    from ._server import server_config

    overrides: dict[str, Any] = {
        k: v
        for k, v in {"host": host, "port": port, "db_path": db, "log_format": log_format}.items()
        if v is not None
    }
    try:
        settings = SidecarSettings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"]) or "settings"
        typer.echo(
            f"kvsidecar: bad setting KVSIDECAR_{name.upper()} (or its flag): {first['msg']}",
            err=True,
        )
        raise typer.Exit(2) from None
    try:
        asyncio.run(_check_database(settings))
    except SidecarError as exc:
        typer.echo(f"kvsidecar: {exc.detail}", err=True)
        raise typer.Exit(2) from None
    try:
        _check_listen(settings.host, settings.port)
    except OSError as exc:
        typer.echo(
            f"kvsidecar: cannot listen on {settings.host} port {settings.port}: "
            f"{exc.strerror or exc}; set --host/--port (KVSIDECAR_HOST/KVSIDECAR_PORT) to "
            "an address of this machine and a free port",
            err=True,
        )
        raise typer.Exit(2) from None
    configure_logging(settings.log_level, settings.log_format)
    for line in unknown_variables():
        logging.getLogger("kvsidecar").warning(line)
    if settings.host not in ("127.0.0.1", "::1", "localhost") and settings.token is None:
        logging.getLogger("kvsidecar").warning(
            "binding %s without KVSIDECAR_TOKEN: anyone who can reach it can set limits",
            settings.host,
        )
    server = uvicorn.Server(server_config(create_app(settings), settings))
    freeze_start_up()  # (sidecar/_gc.py: the p99 of a listing at 1,024 instances halves)
    server.run()


def _check_listen(host: str, port: int) -> None:
    """Bind every address ``host`` names once, and let go: a port in use or a name that
    does not resolve is one line and exit 2 here, not uvicorn's log lines and exit 3.
    (Another process may still take the port before uvicorn binds it; that is rare.)"""
    for family, kind, proto, _, address in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)


async def _check_database(settings: SidecarSettings) -> None:
    """Open the database once before uvicorn starts: a bad path is one line, not a traceback."""
    store = Store(settings.db_path)
    try:
        await store.open()
    finally:
        await store.close()


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)  # --help goes to the demo's own parser, which lists options
def demo(ctx: typer.Context) -> None:
    """Run the CPU colocation demo (two engines, one budget); --help lists its options."""
    if importlib.util.find_spec("sidecar.demo") is None:
        typer.echo("kvsidecar: demo not built yet", err=True)
        raise typer.Exit(1)
    module = importlib.import_module("sidecar.demo")
    module.run_demo(*ctx.args)


def main() -> None:
    run_app(app, "kvsidecar")


if __name__ == "__main__":
    main()
