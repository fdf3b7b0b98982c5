"""``kvctl``: the operator CLI (typer + rich). Exit codes in ``_kvctl_client``."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console
from rich.live import Live

from engine_ext.protocol import (
    ID_PATTERN,
    SizeError,
    Status,
    parse_limit,
    sidecar_url_problem,
    token_fits_a_header,
)

from ._cli_run import run_app
from ._kvctl_client import (
    EXIT_DEFERRED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CtlError,
    Reply,
    SidecarApi,
    SocketApi,
)
from ._kvctl_render import device_lines, instance_line, instance_table, state_line
from ._version import version_line

__all__ = ["CtlSettings", "app", "main"]


class CtlSettings(BaseSettings):
    """kvctl's defaults from the environment; command-line options win."""

    model_config = SettingsConfigDict(env_prefix="KVSIDECAR_", extra="ignore")

    url: str = "http://127.0.0.1:8570"  # KVSIDECAR_URL
    token: SecretStr | None = None  # KVSIDECAR_TOKEN


@dataclass(slots=True)
class _Ctx:
    url: str
    token: str | None
    socket: str | None


app = typer.Typer(
    name="kvctl",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Set and watch KV-cache limits of LLM engines (kvsidecar).\n\n"
    "Exit codes: 0 applied/ok, 1 refused, 2 usage, 3 deferred at the "
    "--wait deadline, 4 unreachable.",
)
_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="print the raw JSON answer")]
WaitOpt = Annotated[
    float | None,
    typer.Option("--wait", min=0, max=300, help="wait up to this many seconds for 'applied'"),
]
_ID_RE = re.compile(ID_PATTERN)


def _check_id(value: str) -> str:
    """The API's id pattern, checked before any request: ``a/../b`` never reaches a URL."""
    if not _ID_RE.fullmatch(value):
        raise _fail(
            f"instance_id {value!r} is not valid: use 1-63 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit",
            EXIT_USAGE,
        )
    return value


IdArg = Annotated[str, typer.Argument(help="instance id, e.g. llama-a", callback=_check_id)]


def _print_version(value: bool) -> None:
    if value:
        _out.print(version_line("kvctl"), markup=False)
        raise typer.Exit(EXIT_OK)


def sidecar_url(raw: str) -> str:
    """``host:port`` → ``http://host:port``; only http(s) URLs pass (usage error otherwise)."""
    url = raw.strip()
    if "://" not in url:
        url = f"http://{url}"
    problem = sidecar_url_problem(url)
    if problem is not None:
        raise _fail(
            f"--url/KVSIDECAR_URL {raw!r} cannot be used: it {problem} "
            "(e.g. --url 127.0.0.1:8570 or http://sidecar.example:8570)",
            EXIT_USAGE,
        )
    return url


@app.callback()
def _global(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option(help="sidecar URL or host:port [KVSIDECAR_URL]")
    ] = None,
    token: Annotated[str | None, typer.Option(help="bearer token [KVSIDECAR_TOKEN]")] = None,
    socket: Annotated[
        str | None,
        typer.Option(help="talk to this engine control socket directly (limit/status only)"),
    ] = None,
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
    settings = CtlSettings()
    env_token = settings.token.get_secret_value() if settings.token else None
    # surrounding whitespace is never part of a token (the sidecar strips it too)
    chosen = (token or env_token or "").strip() or None
    if chosen is not None and not token_fits_a_header(chosen):
        raise _fail(
            "--token/KVSIDECAR_TOKEN must be printable ASCII without spaces or control "
            "characters (as the sidecar requires)",
            EXIT_USAGE,
        )
    # with --socket no sidecar is asked: an unrelated KVSIDECAR_URL must not stop the command
    # (a malformed --url given with --socket still is a usage error)
    raw_url = url or settings.url
    ctx.obj = _Ctx(raw_url if socket and url is None else sidecar_url(raw_url), chosen, socket)


def _fail(message: str, code: int) -> typer.Exit:
    _err.print(f"kvctl: {message}", markup=False)
    return typer.Exit(code)


def _run(ctx: typer.Context, fn: Any) -> Any:
    """Run ``fn(api)`` against the sidecar or the socket; CtlError → one line + exit code."""
    obj: _Ctx = ctx.obj
    api: SidecarApi | SocketApi = (
        SocketApi(obj.socket) if obj.socket else SidecarApi(obj.url, obj.token)
    )
    try:
        return fn(api)
    except CtlError as exc:
        raise _fail(exc.message, exc.code) from None
    finally:
        api.close()


def _sidecar_only(ctx: typer.Context, command: str) -> None:
    if ctx.obj.socket:
        raise _fail(
            f"'{command}' needs the sidecar; with --socket only 'limit' and 'status' work",
            EXIT_USAGE,
        )


def _exit_for(body: dict[str, Any], waited: bool) -> int:
    status = body.get("status")
    if status == Status.UNREACHABLE:
        return EXIT_UNREACHABLE
    if waited and status != Status.APPLIED:
        return EXIT_DEFERRED
    return EXIT_OK


def _show(ctx: typer.Context, reply: Reply, as_json: bool, waited: bool) -> None:
    body = reply.body
    if as_json:
        _out.print_json(json.dumps(body))
    elif ctx.obj.socket:
        _out.print(state_line(body), markup=False)
    else:
        _out.print(instance_line(body), markup=False)
    raise typer.Exit(_exit_for(body, waited))


def _size(value: str) -> int | None:
    try:
        return parse_limit(value)
    except SizeError as exc:
        raise _fail(f"SIZE: {exc}", EXIT_USAGE) from None


@app.command()
def limit(
    ctx: typer.Context,
    instance_id: IdArg,
    size: Annotated[str, typer.Argument(help="512M, 2G, 1.5GiB, a byte count, or none")],
    wait: WaitOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Set the KV-cache limit of an instance (bytes per GPU)."""
    num = _size(size)
    if ctx.obj.socket:
        reply = _run(ctx, lambda api: api.set_limit(num, wait))
    else:
        reply = _run(ctx, lambda api: api.set_limit(instance_id, num, wait))
    _show(ctx, reply, as_json, waited=bool(wait))


@app.command("limit-percent")
def limit_percent(
    ctx: typer.Context,
    instance_id: IdArg,
    percent: Annotated[
        float, typer.Argument(help="percent (0 to 100) of the device memory the engine registered")
    ],
    wait: WaitOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Set the limit as a percentage of the engine's device memory (per GPU)."""
    _sidecar_only(ctx, "limit-percent")
    # checked here, not by click's range: NaN slips through a range check, and a usage
    # error here is one line like every other kvctl error
    if not (math.isfinite(percent) and 0 <= percent <= 100):
        raise _fail(
            f"percent must be a number from 0 to 100; got {percent!r} "
            "(e.g. 'kvctl limit-percent ID 12.5')",
            EXIT_USAGE,
        )

    def call(api: SidecarApi) -> Reply:
        view = api.status(instance_id, None).body
        total = (view.get("engine") or {}).get("device_total_bytes")
        if not total:
            raise CtlError(
                f"instance {instance_id!r} has not registered its device memory; "
                "use 'kvctl limit ID SIZE'",
                EXIT_USAGE,
            )
        return api.set_limit(instance_id, int(total * percent / 100), wait)

    _show(ctx, _run(ctx, call), as_json, waited=bool(wait))


@app.command()
def status(
    ctx: typer.Context, instance_id: IdArg, wait: WaitOpt = None, as_json: JsonOpt = False
) -> None:
    """Show one instance (with --wait: wait until it is applied)."""
    if ctx.obj.socket:
        reply = _run(ctx, lambda api: api.status(wait))
    else:
        reply = _run(ctx, lambda api: api.status(instance_id, wait))
    _show(ctx, reply, as_json, waited=bool(wait))


@app.command()
def delete(
    ctx: typer.Context, instance_id: IdArg, wait: WaitOpt = None, as_json: JsonOpt = False
) -> None:
    """Remove the limit (back to unlimited, as a new revision)."""
    _sidecar_only(ctx, "delete")
    _show(
        ctx, _run(ctx, lambda api: api.delete_limit(instance_id, wait)), as_json, waited=bool(wait)
    )


@app.command()
def forget(ctx: typer.Context, instance_id: IdArg) -> None:
    """Forget an instance: its desired limit, registration and metrics (for a typo or a
    retired engine; a running engine registers again on its next report)."""
    _sidecar_only(ctx, "forget")
    _run(ctx, lambda api: api.forget(instance_id))
    _out.print(f"{instance_id}: forgotten", markup=False)


@app.command("list")
def list_(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List every instance with its status, mapped bytes and limit."""
    _sidecar_only(ctx, "list")
    views = _run(ctx, lambda api: api.list()).body["instances"]
    if as_json:
        _out.print_json(json.dumps(views))
    else:
        _out.print(instance_table(views))


@app.command()
def watch(
    ctx: typer.Context,
    # bounded: time.sleep(inf) raised OverflowError (a traceback) after the first refresh
    interval: Annotated[
        float, typer.Option(min=0.1, max=3600, help="refresh period, seconds")
    ] = 1.0,
    once: Annotated[bool, typer.Option(help="draw the table once and exit")] = False,
    count: Annotated[int | None, typer.Option(min=1, help="stop after this many refreshes")] = None,
) -> None:
    """A live table: mapped vs limit per instance (Ctrl-C to quit).

    When stdout is not a terminal (a pipe, a file, a log collector) it writes
    one timestamped line per instance and refresh instead, flushed each time."""
    _sidecar_only(ctx, "watch")

    def fetch() -> list[dict[str, Any]]:
        views: list[dict[str, Any]] = _run(ctx, lambda api: api.list()).body["instances"]
        return views

    if once:
        _out.print(instance_table(fetch()))
        return
    refreshes = itertools.count(1) if count is None else range(1, count + 1)
    try:
        if not _out.is_terminal:
            for n in refreshes:
                _write_lines(fetch())
                if n != count:
                    time.sleep(interval)
            return
        with Live(instance_table(fetch()), console=_out, auto_refresh=False) as live:
            for n in refreshes:
                if n == count:
                    break
                time.sleep(interval)
                live.update(instance_table(fetch()), refresh=True)
    except KeyboardInterrupt:
        pass


@app.command()
def devices(
    ctx: typer.Context,
    device_id: Annotated[str | None, typer.Argument(help="one device")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Devices: budget, sum of limits and mapped, free, and each instance's share."""
    _sidecar_only(ctx, "devices")
    if device_id is None:
        views = _run(ctx, lambda api: api.devices()).body["devices"]
    else:
        views = [_run(ctx, lambda api: api.device(device_id)).body]
    if as_json:
        _out.print_json(json.dumps(views if device_id is None else views[0]))
        return
    for view in views:
        _out.print("\n".join(device_lines(view)), markup=False)
    if not views:
        _out.print("(no devices: start engines with KVSIDECAR_DEVICE_ID)", markup=False)


@app.command()
def budget(
    ctx: typer.Context,
    device_id: Annotated[str, typer.Argument(help="device id, e.g. GPU-8f3c... or host0")],
    size: Annotated[
        str,
        typer.Argument(
            help="what the device's instances may map together (8G), or none to stop "
            "the autopilot there"
        ),
    ],
    dry_run: Annotated[
        bool | None, typer.Option("--dry-run/--live", help="only show what the autopilot would do")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Give a device a budget: the autopilot shares it among the device's instances."""
    _sidecar_only(ctx, "budget")
    num = _size(size)
    body = _run(ctx, lambda api: api.set_budget(device_id, num, dry_run)).body
    if as_json:
        _out.print_json(json.dumps(body))
    else:
        _out.print("\n".join(device_lines(body)), markup=False)


@app.command()
def policy(
    ctx: typer.Context,
    instance_id: IdArg,
    min_size: Annotated[
        str | None, typer.Option("--min", help="the least the autopilot gives (none: 0)")
    ] = None,
    max_size: Annotated[
        str | None, typer.Option("--max", help="the most it gives (none: no max)")
    ] = None,
    weight: Annotated[
        float | None, typer.Option(help="share of the spare memory, above 0 (default 1)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Set an instance's autopilot fields (only the options given change)."""
    _sidecar_only(ctx, "policy")
    fields: dict[str, Any] = {}
    if min_size is not None:
        fields["min"] = _size(min_size)
    if max_size is not None:
        fields["max"] = _size(max_size)
    if weight is not None:
        if not (math.isfinite(weight) and weight > 0):
            raise _fail(f"--weight must be a number above 0; got {weight!r}", EXIT_USAGE)
        fields["weight"] = weight
    _show(ctx, _run(ctx, lambda api: api.set_policy(instance_id, fields)), as_json, waited=False)


@app.command("device-limits")
def device_limits(
    ctx: typer.Context,
    device_id: Annotated[str, typer.Argument(help="device id")],
    pairs: Annotated[list[str], typer.Argument(help="ID=SIZE pairs, e.g. llama-a=2G llama-b=6G")],
    as_json: JsonOpt = False,
) -> None:
    """Pin several instances' limits at once; applied shrink before grow."""
    _sidecar_only(ctx, "device-limits")
    limits: dict[str, int] = {}
    for pair in pairs:
        iid, sep, size = pair.partition("=")
        num = _size(size) if sep else None
        if not sep or num is None:
            raise _fail(f"{pair!r}: write ID=SIZE with a size (e.g. llama-a=2G)", EXIT_USAGE)
        if _check_id(iid) in limits:  # the last one silently won
            raise _fail(f"{iid!r} is given twice: give each instance one size", EXIT_USAGE)
        limits[iid] = num
    body = _run(ctx, lambda api: api.set_device_limits(device_id, limits)).body
    if as_json:
        _out.print_json(json.dumps(body))
    else:
        _out.print("\n".join(device_lines(body)), markup=False)


def _write_lines(views: list[dict[str, Any]]) -> None:
    """One refresh for a pipe: ``<UTC time> <instance line>`` per instance, then flush."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [f"{stamp} {instance_line(v)}" for v in views] or [f"{stamp} (no instances)"]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def main() -> None:
    run_app(app, "kvctl")
