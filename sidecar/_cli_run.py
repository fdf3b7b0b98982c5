"""Run a Typer app as a console script: a command line the parser refuses is one line.

Typer prints the parser's errors (unknown command, missing argument, bad
option value) as a usage line plus a boxed message. The rest of ``kvctl`` and
``kvsidecar`` says what went wrong in one line on stderr, ``<prog>: ...``;
:func:`run_app` makes the parser's errors read the same, with the same exit
code (2 for usage), and points at the ``--help`` of the command concerned.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

try:  # typer >= 0.2x carries its own copy of click
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover - older typer on the real click
    from click import exceptions as _click_errors  # type: ignore[no-redef]

__all__ = ["run_app"]


def run_app(app: typer.Typer, prog: str, args: Sequence[str] | None = None) -> None:
    """Run ``app``; exit with its code. Parser errors are one line, ``<prog>: <message>``."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv:  # "no arguments" shows the help, as Typer does on its own
        app(args=argv, prog_name=prog)
        return
    try:
        code = app(args=argv, prog_name=prog, standalone_mode=False)
    except _click_errors.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else prog
        print(f"{prog}: {_one_line(exc.format_message())} (see '{where} --help')", file=sys.stderr)
        sys.exit(exc.exit_code)
    except _click_errors.ClickException as exc:
        print(f"{prog}: {_one_line(exc.format_message())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        print(f"{prog}: aborted", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _one_line(message: str) -> str:
    return " ".join(message.split())
