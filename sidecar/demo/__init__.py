"""``kvsidecar demo``: the CPU colocation demo (the README's main job).

Starts the sidecar and vLLM and SGLang CPU-harness engines as separate
processes (in parallel: an SGLang server takes minutes to start on a loaded
machine), runs the two scenarios of :mod:`sidecar.demo._scenarios` (or, with
``--autopilot``, the one of :mod:`sidecar.demo._autopilot`), prints the limit
tables, writes ``demo-results.json`` and ``demo-mapped.png`` and exits
non-zero if any check failed. Embedded defaults only: SQLite in a temporary directory,
host memory, loopback, no GPU, no network.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

if TYPE_CHECKING:
    from ._cluster import Cluster, EngineKind, EngineSpec
    from ._sampler import Sampler

__all__ = ["ENGINES", "missing_dependencies", "run_demo"]

#: the engine kinds of the default run, side by side under one sidecar
ENGINES: tuple[EngineKind, ...] = ("vllm", "sglang")
# what the demo imports beyond kvsidecar's own dependencies, and where it comes from
_DEMO_MODULES = (("vllm", "vLLM 0.33"), ("sglang", "SGLang 0.5.23"), ("torch", "PyTorch"))
_INSTALL_HINT = (
    "from a checkout, 'bash scripts/dev.sh demo' builds an environment with the "
    "CPU builds of all three and runs the demo; or install them: "
    "pip install 'kvsidecar[vllm,sglang]'"
)


def _parse(argv: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvsidecar demo",
        description="The CPU colocation demo: a sidecar and vLLM and SGLang CPU-harness "
        "engines on loopback; prints the limit table of each engine (with and without "
        "reclamation), runs a vLLM and an SGLang engine on one KV budget, writes "
        "demo-results.json and demo-mapped.png, exits 1 if a check failed. "
        "Needs vLLM, SGLang and torch (bash scripts/dev.sh demo installs them).",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo-out"),
        help="where demo-results.json and the plot go [./demo-out]",
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=10.0,
        help="seconds to stay idle after lowering a limit [10]",
    )
    parser.add_argument("--quick", action="store_true", help="smaller workload (tests)")
    parser.add_argument(
        "--output-tokens",
        type=int,
        default=48,
        help="--autopilot: max_tokens of each request (a decode-heavy load: e.g. 600) [48]",
    )
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs and the DB")
    parser.add_argument(
        "--autopilot",
        action="store_true",
        help="run the autopilot scenario instead: three engines (vLLM, SGLang, vLLM) "
        "on one budgeted host device, load moving A->B->C, against a static "
        "equal split",
    )
    return parser.parse_args(list(argv))


def run_demo(*argv: str) -> None:
    """Run the demo; exits the process with 0 (all checks passed) or 1."""
    args = _parse(argv)
    if args.idle_s < 0:
        sys.exit("kvsidecar demo: --idle-s must be >= 0")
    if not 1 <= args.output_tokens <= 2048:
        sys.exit(
            "kvsidecar demo: --output-tokens must be between 1 and 2048 (1200-word prompts in a 4096-token context)"
        )
    missing = missing_dependencies()
    if missing:  # before anything is created: no output dir, no temp dir, no process
        sys.exit(
            f"kvsidecar demo: needs {_and(missing)}, not installed in {sys.prefix}; {_INSTALL_HINT}"
        )
    try:  # before the engines start: an --out that cannot be created was a traceback at once
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        sys.exit(
            f"kvsidecar demo: cannot create --out {str(args.out)!r}: "
            f"{exc.strerror or exc}; give a writable directory"
        )
    console = Console()
    sys.exit(0 if _run(args, console) else 1)


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def missing_dependencies() -> list[str]:
    """The demo's third-party dependencies that cannot be imported here (names for a person)."""
    missing = []
    for module, name in _DEMO_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(f"{name} ({module})")
    return missing


#: the body of a demo run: starts its engines on the cluster, fills ``results``, returns checks
_Body = Callable[["Cluster", "Sampler", dict[str, Any], float], list[dict[str, Any]]]


_INTERRUPT_GRACE_S = 2.0  # after Ctrl-C: how long an engine may take to stop on SIGTERM


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached the demo: stopped as Ctrl-C stops it."""

    def __init__(self, signum: int) -> None:
        self.signame = signal.Signals(signum).name
        super().__init__(self.signame)


def _stop_on_signals() -> tuple[int, ...]:
    """Main thread: SIGTERM (``kill``) and SIGHUP (the terminal closing) end the demo the way
    Ctrl-C does, through its cleanup. By default they ended the process at once, and the
    engines and the sidecar, in sessions of their own, ran on with nobody to stop them.
    Only a signal left at its default is taken (an ignored one, ``nohup``, stays so); the
    first one ignores the rest while the cleanup runs. Returns the signals taken (their
    default is restored afterwards)."""
    taken = tuple(
        s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) == signal.SIG_DFL
    )

    def stop(signum: int, _frame: Any) -> None:
        for sig in taken:
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped(signum)

    for sig in taken:
        signal.signal(sig, stop)
    return taken


def _run(args: argparse.Namespace, console: Console) -> bool:
    if args.autopilot:
        return _session(args, console, "autopilot", _autopilot_body(args, console))
    return _session(args, console, "colocation", _colocation_body(args, console))


def _session(args: argparse.Namespace, console: Console, scenario: str, body: _Body) -> bool:
    """What every demo run shares: output and work directories, the sidecar, the sampler,
    the last-resort error record, ``demo-results.json`` and the plot, and teardown."""
    from engine_ext.cpu_harness import make_tiny_model_dir

    from ._cluster import Cluster
    from ._report import print_checks, write_json, write_plot
    from ._sampler import Sampler

    out: Path = args.out  # created by run_demo
    workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-demo-"))
    t0 = time.monotonic()
    results: dict[str, Any] = {"scenario": scenario, "workdir": str(workdir)}
    cluster = Cluster(workdir, make_tiny_model_dir(workdir / "model"))
    sampler = Sampler(cluster.sidecar_url, t0)
    ok = False
    interrupted = False
    taken = _stop_on_signals()
    try:
        cluster.start_sidecar()
        sampler.start()
        checks = body(cluster, sampler, results, t0)
        print_checks(console, checks)
        ok = bool(checks) and all(c["ok"] for c in checks)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: stop everything at once, say so
        interrupted = True
        how = f" ({exc.signame})" if isinstance(exc, _Stopped) else ""
        results["error"] = f"interrupted{how}"
        console.print(f"[yellow]interrupted{how}:[/yellow] stopping the engines and the sidecar")
        raise
    except Exception as exc:  # noqa: BLE001 -- last resort: record why, fail the demo, keep logs
        results["error"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]demo failed:[/red] {results['error']}\nlogs in {workdir}")
        args.keep_workdir = True
    finally:
        for sig in taken:  # the cleanup below runs to its end (bounded: SIGKILL after)
            signal.signal(sig, signal.SIG_IGN)
        sampler.stop()
        # interrupted: no clean shutdown to wait for (vLLM ignores SIGTERM while its
        # EngineCore starts, docs/vllm.md): SIGKILL after a short grace
        cluster.close(engine_grace_s=_INTERRUPT_GRACE_S if interrupted else None)
        results["ok"] = ok
        results["elapsed_s"] = round(time.monotonic() - t0, 1)
        results["samples"] = [asdict(s) for s in sampler.samples]
        write_json(out / "demo-results.json", results)
        plotted = write_plot(out / "demo-mapped.png", sampler.samples)
        console.print(
            f"results: {out / 'demo-results.json'}"
            + (f"; plot: {out / 'demo-mapped.png'}" if plotted else "")
        )
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)
    return ok


def _start(console: Console, cluster: Cluster, specs: list[EngineSpec], t0: float) -> None:
    kinds = ", ".join(f"{s.instance_id} ({s.engine})" for s in specs)
    with console.status(f"starting {kinds} in parallel (CPU harness; SGLang takes minutes)…"):
        cluster.start_engines(specs)
    console.print(f"engines up in {time.monotonic() - t0:.0f}s; sidecar {cluster.sidecar_url}")


def _colocation_body(args: argparse.Namespace, console: Console) -> _Body:
    """The default run: the limit table per engine, then vLLM and SGLang on one budget."""
    from ._cluster import EngineSpec
    from ._report import print_limit_table
    from ._scenarios import DemoConfig, elastic_colocation, limit_table

    cfg = DemoConfig(idle_s=args.idle_s, quick=args.quick)

    def body(
        cluster: Cluster, sampler: Sampler, results: dict[str, Any], t0: float
    ) -> list[dict[str, Any]]:
        results["config"] = vars(cfg)
        _start(
            console,
            cluster,
            [
                EngineSpec(f"{engine}-{kind}-reclaim", kind == "with", 64 << 20, engine=engine)
                for engine in ENGINES
                for kind in ("without", "with")
            ],
            t0,
        )
        with (
            console.status("scenario 1: fill, lower the limit, idle, traffic (both engines)…"),
            ThreadPoolExecutor(max_workers=len(ENGINES)) as pool,
        ):
            futures = {
                e: pool.submit(
                    limit_table,
                    cluster,
                    sampler,
                    f"{e}-without-reclaim",
                    f"{e}-with-reclaim",
                    cfg,
                    t0,
                )
                for e in ENGINES
            }
            tables: dict[str, dict[str, Any]] = {e: f.result() for e, f in futures.items()}
        results["limit_table"] = tables
        print_limit_table(console, tables)
        with console.status("scenario 2: vLLM and SGLang elastic on one budget…"):
            cluster.stop_engines([f"{e}-without-reclaim" for e in ENGINES])
            elastic = elastic_colocation(cluster, "vllm-with-reclaim", "sglang-with-reclaim", cfg)
        results["elastic"] = elastic
        checks: list[dict[str, Any]] = [c for t in tables.values() for c in t["checks"]]
        checks += elastic["checks"]
        return checks

    return body


def _autopilot_body(args: argparse.Namespace, console: Console) -> _Body:
    """``--autopilot``: vLLM, SGLang and vLLM engines share one budgeted device
    (docs/autopilot.md)."""
    from ._autopilot import DEVICE, autopilot_vs_static
    from ._cluster import EngineSpec

    engines: dict[str, EngineKind] = {"engine-a": "vllm", "engine-b": "sglang", "engine-c": "vllm"}

    def body(
        cluster: Cluster, sampler: Sampler, results: dict[str, Any], t0: float
    ) -> list[dict[str, Any]]:
        _start(
            console,
            cluster,
            [EngineSpec(i, True, 64 << 20, DEVICE, engine=e) for i, e in engines.items()],
            t0,
        )
        with console.status("load A->B->C: static equal split, then the autopilot…"):
            results["autopilot"] = autopilot_vs_static(
                cluster,
                list(engines),
                6 << 20,
                per_engine=12 if args.quick else 24,
                words=1200,
                output_tokens=args.output_tokens,
            )
        a = results["autopilot"]
        console.print(
            f"completion: static split {a['static_split']['completion_s']}s, "
            f"autopilot {a['autopilot']['completion_s']}s; p99 latency: static "
            f"{a['static_split']['p99_latency_s']}s, autopilot "
            f"{a['autopilot']['p99_latency_s']}s"
        )
        checks: list[dict[str, Any]] = a["checks"]
        return checks

    return body
