"""Shows and stores the demo's results: rich tables, ``demo-results.json``, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ._sampler import Sample

__all__ = ["print_checks", "print_limit_table", "write_json", "write_plot"]


def print_limit_table(console: Console, tables: dict[str, dict[str, Any]]) -> None:
    """One table for all engines: rows of scenario 1, mapped MiB measured from ``/proc``."""
    table = Table(
        title="KV MiB mapped (/proc) after a lowered limit (CPU, host backend)",
        caption="with reclaim: status in brackets; without: KVSIDECAR_RECLAIM=0",
    )
    for col in (
        "engine",
        "limit",
        "without reclaim, idle",
        "with reclaim, idle",
        "without, after traffic",
        "with, after traffic",
    ):
        table.add_column(col, justify="right")
    for engine, table1 in tables.items():
        for r in table1["rows"]:
            table.add_row(
                engine,
                f"{r['limit_mib']:.2f}",
                f"{r['without_idle_proc_mib']:.2f}",
                f"{r['with_idle_proc_mib']:.2f} ({r['with_idle_status']})",
                f"{r['without_after_traffic_proc_mib']:.2f}",
                f"{r['with_after_traffic_proc_mib']:.2f} ({r['with_after_traffic_status']})",
            )
    console.print(table)
    for table1 in tables.values():
        for row_name, per_instance in table1["status_timelines"].items():
            for instance_id, steps in per_instance.items():
                seq = " -> ".join(f"{s['status']}@{s['t_s']:.2f}s" for s in steps)
                console.print(f"  {row_name} {instance_id}: {seq or '(no samples)'}")


def print_checks(console: Console, checks: list[dict[str, Any]]) -> None:
    for c in checks:
        mark = "[green]PASS[/green]" if c["ok"] else "[red]FAIL[/red]"
        console.print(f"{mark} {c['name']}: {c['detail']}")


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


def write_plot(path: Path, samples: list[Sample]) -> bool:
    """Mapped MiB over time per instance with its limit line; False (no file) if there are
    no samples (the demo stopped before its engines registered) or matplotlib is missing."""
    if not samples:
        path.unlink(missing_ok=True)  # not a stale plot of an earlier run beside these results
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 5))
    ids = sorted({s.instance_id for s in samples})
    for n, instance_id in enumerate(ids):
        own = [s for s in samples if s.instance_id == instance_id]
        color = f"C{n}"
        ax.plot(
            [s.t_s for s in own],
            [s.mapped_bytes / 2**20 for s in own],
            color=color,
            label=f"{instance_id} mapped",
        )
        ax.step(
            [s.t_s for s in own],
            [s.limit_bytes / 2**20 if s.limit_bytes is not None else float("nan") for s in own],
            where="post",
            color=color,
            linestyle="--",
            label=f"{instance_id} limit",
        )
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("MiB mapped (KV cache)")
    ax.set_title("kvsidecar demo: mapped KV memory per instance")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
