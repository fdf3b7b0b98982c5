"""``kvsidecar demo``: the CPU colocation demo (the README's main job).

Starts the sidecar and vLLM CPU-harness engines as separate processes, runs
the two scenarios of :mod:`sidecar.demo._scenarios`, prints the limit table,
writes ``demo-results.json`` and ``demo-mapped.png`` and exits non-zero if
any check failed. Embedded defaults only: SQLite in a temporary directory,
host memory, loopback, no GPU, no network.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

__all__ = ["missing_dependencies", "run_demo"]

# what the demo imports beyond kvsidecar's own dependencies, and where it comes from
_DEMO_MODULES = (("vllm", "vLLM 0.33"), ("torch", "PyTorch"))
_INSTALL_HINT = (
    "from a checkout, 'bash scripts/dev.sh demo' builds an environment with the "
    "CPU builds of both and runs the demo; or install them: "
    "pip install 'kvsidecar[vllm]'"
)


def _parse(argv: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvsidecar demo",
        description="The CPU colocation demo: a sidecar and two vLLM CPU-harness engines on "
        "loopback share one KV budget; prints the limit table, writes "
        "demo-results.json and demo-mapped.png, exits 1 if a check failed. "
        "Needs vLLM and torch (bash scripts/dev.sh demo installs them).",
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
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs and the DB")
    parser.add_argument(
        "--autopilot",
        action="store_true",
        help="run the autopilot scenario instead: three engines on one "
        "budgeted host device, load moving A->B->C, against a static "
        "equal split (heavier: three vLLM engines)",
    )
    return parser.parse_args(list(argv))


def run_demo(*argv: str) -> None:
    """Run the demo; exits the process with 0 (all checks passed) or 1."""
    args = _parse(argv)
    if args.idle_s < 0:
        sys.exit("kvsidecar demo: --idle-s must be >= 0")
    missing = missing_dependencies()
    if missing:  # before anything is created: no output dir, no temp dir, no process
        sys.exit(
            f"kvsidecar demo: needs {' and '.join(missing)}, not installed in "
            f"{sys.prefix}; {_INSTALL_HINT}"
        )
    console = Console()
    sys.exit(0 if _run(args, console) else 1)


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


def _run(args: argparse.Namespace, console: Console) -> bool:
    from engine_ext.cpu_harness import make_tiny_model_dir

    from ._cluster import Cluster, EngineSpec
    from ._report import print_checks, print_limit_table, write_json, write_plot
    from ._sampler import Sampler
    from ._scenarios import DemoConfig, elastic_colocation, limit_table

    if args.autopilot:
        return _run_autopilot(args, console)
    cfg = DemoConfig(idle_s=args.idle_s, quick=args.quick)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-demo-"))
    t0 = time.monotonic()
    results: dict[str, Any] = {"config": vars(cfg), "workdir": str(workdir)}
    cluster = Cluster(workdir, make_tiny_model_dir(workdir / "model"))
    sampler = Sampler(cluster.sidecar_url, t0)
    ok = False
    try:
        with console.status("starting the sidecar and two vLLM engines (CPU harness)…"):
            cluster.start_sidecar()
            sampler.start()
            cluster.start_engines(
                [
                    EngineSpec("without-reclaim", False, 64 << 20),
                    EngineSpec("with-reclaim", True, 64 << 20),
                ]
            )
        console.print(f"engines up in {time.monotonic() - t0:.0f}s; sidecar {cluster.sidecar_url}")
        with console.status("scenario 1: fill, lower the limit, idle, traffic…"):
            results["limit_table"] = limit_table(
                cluster, sampler, "without-reclaim", "with-reclaim", cfg, t0
            )
        print_limit_table(console, results["limit_table"])
        with console.status("scenario 2: elastic colocation on one budget…"):
            cluster.stop_engine("without-reclaim")
            cluster.start_engines([EngineSpec("engine-b", True, 64 << 20)])
            results["elastic"] = elastic_colocation(cluster, "with-reclaim", "engine-b", cfg)
        checks = results["limit_table"]["checks"] + results["elastic"]["checks"]
        print_checks(console, checks)
        ok = all(c["ok"] for c in checks)
    except Exception as exc:  # noqa: BLE001 -- last resort: record why, fail the demo, keep logs
        results["error"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]demo failed:[/red] {results['error']}\nlogs in {workdir}")
        args.keep_workdir = True
    finally:
        sampler.stop()
        cluster.close()
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
    return ok


def _run_autopilot(args: argparse.Namespace, console: Console) -> bool:
    """``--autopilot``: three engines share one budgeted device (docs/autopilot.md)."""
    from engine_ext.cpu_harness import make_tiny_model_dir

    from ._autopilot import DEVICE, autopilot_vs_static
    from ._cluster import Cluster, EngineSpec
    from ._report import print_checks, write_json, write_plot
    from ._sampler import Sampler

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-demo-"))
    t0 = time.monotonic()
    ids = ["engine-a", "engine-b", "engine-c"]
    budget = 6 << 20
    results: dict[str, Any] = {"workdir": str(workdir), "scenario": "autopilot"}
    cluster = Cluster(workdir, make_tiny_model_dir(workdir / "model"))
    sampler = Sampler(cluster.sidecar_url, t0)
    ok = False
    try:
        with console.status("starting the sidecar and three vLLM engines (CPU harness)…"):
            cluster.start_sidecar()
            sampler.start()
            cluster.start_engines([EngineSpec(i, True, 64 << 20, DEVICE) for i in ids])
        console.print(f"engines up in {time.monotonic() - t0:.0f}s; sidecar {cluster.sidecar_url}")
        with console.status("load A->B->C: static equal split, then the autopilot…"):
            results["autopilot"] = autopilot_vs_static(
                cluster, ids, budget, per_engine=12 if args.quick else 24, words=1200
            )
        a = results["autopilot"]
        console.print(
            f"completion: static split {a['static_split']['completion_s']}s, "
            f"autopilot {a['autopilot']['completion_s']}s; p99 latency: static "
            f"{a['static_split']['p99_latency_s']}s, autopilot "
            f"{a['autopilot']['p99_latency_s']}s"
        )
        checks = a["checks"]
        print_checks(console, checks)
        ok = all(c["ok"] for c in checks)
    except Exception as exc:  # noqa: BLE001 -- last resort: record why, fail the demo, keep logs
        results["error"] = f"{type(exc).__name__}: {exc}"
        console.print(f"[red]demo failed:[/red] {results['error']}\nlogs in {workdir}")
        args.keep_workdir = True
    finally:
        sampler.stop()
        cluster.close()
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
    return ok
