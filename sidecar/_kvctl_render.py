"""kvctl's output: one-line summaries and the instance table with bars (rich)."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from engine_ext.protocol import Status, format_size

__all__ = ["bar", "instance_line", "instance_table", "state_line"]

_BAR_WIDTH = 24
_STATUS_STYLE = {
    Status.APPLIED: "green",
    Status.DEFERRED: "yellow",
    Status.PENDING: "cyan",
    Status.UNREACHABLE: "red",
}


def bar(mapped_bytes: int, limit_bytes: int | None, capacity_bytes: int) -> Text:
    """``mapped`` against the limit (or the capacity when unlimited); red past the limit."""
    scale = limit_bytes if limit_bytes is not None else capacity_bytes
    if not scale:
        filled = _BAR_WIDTH if mapped_bytes else 0
    else:
        filled = min(_BAR_WIDTH, round(_BAR_WIDTH * mapped_bytes / scale))
    over = limit_bytes is not None and mapped_bytes > limit_bytes
    style = "red" if over else ("green" if limit_bytes is not None else "blue")
    text = Text("█" * filled, style=style)
    text.append("░" * (_BAR_WIDTH - filled), style="dim")
    return text


def instance_line(view: dict[str, Any]) -> str:
    desired = view["desired"]
    parts = [f"{view['id']}: {view['status']}"]
    if view.get("reason"):
        parts.append(f"({view['reason']})")
    parts.append(f"limit {format_size(desired['limit_bytes'])} rev {desired['revision']}")
    parts.append(f"mapped {format_size(view['mapped_bytes'])}")
    if view.get("overage_bytes"):
        parts.append(f"over by {format_size(view['overage_bytes'])}")
    policy = view.get("policy")
    if policy and policy.get("device_id"):
        source = policy.get("source") or "-"
        why = f" ({policy['reason']})" if source == "policy" and policy.get("reason") else ""
        pin = " pinned" if policy.get("pinned") else ""
        parts.append(f"device {policy['device_id']} source {source}{why}{pin}")
    return "  ".join(parts)


def device_lines(view: dict[str, Any]) -> list[str]:
    """A device: its budget line, then one line per instance (``kvctl devices``)."""
    head = (
        f"{view['id']}: budget {format_size(view['budget_bytes'])}"
        f"{' (dry run)' if view.get('dry_run') else ''}  limits "
        f"{format_size(view['sum_limits_bytes'])}  mapped "
        f"{format_size(view['sum_mapped_bytes'])}  free "
        f"{'-' if view['free_bytes'] is None else format_size(view['free_bytes'])}"
    )
    lines = [head]
    for m in view["instances"]:
        bounds = (
            f"min {format_size(m['min_bytes'])} max {format_size(m['max_bytes'])} "
            f"weight {m['weight']:g}"
        )
        lines.append(
            f"  {m['id']}: {m['status']}  limit {format_size(m['limit_bytes'])}  "
            f"target {format_size(m['target_bytes'])}  mapped "
            f"{format_size(m['mapped_bytes'])}  {m['source'] or '-'}"
            f"{' pinned' if m['pinned'] else ''}  {m['reason'] or ''}  {bounds}"
        )
    for w in view.get("would", []):
        lines.append(
            f"  would set {w['instance']}: {format_size(w['old_bytes'])} -> "
            f"{format_size(w['new_bytes'])} ({w['reason']})"
        )
    return lines


def state_line(state: dict[str, Any]) -> str:
    """One line for an engine state read from a control socket."""
    parts = [f"engine: {state['status']}"]
    if state.get("reason"):
        parts.append(f"({state['reason']})")
    parts.append(f"limit {format_size(state.get('limit_bytes'))} rev {state.get('revision', 0)}")
    parts.append(f"mapped {format_size(state.get('mapped_bytes', 0))}")
    if state.get("overage_bytes"):
        parts.append(f"over by {format_size(state['overage_bytes'])}")
    if state.get("message"):
        parts.append(f"- {state['message']}")
    return "  ".join(parts)


def instance_table(views: list[dict[str, Any]]) -> Table:
    table = Table(title="kvsidecar instances", expand=False)
    for name, justify in (
        ("instance", "left"),
        ("status", "left"),
        ("mapped", "right"),
        ("limit", "right"),
        ("mapped vs limit", "left"),
        ("over", "right"),
        ("rev", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for view in views:
        observed = view.get("observed") or {}
        limit = view["desired"]["limit_bytes"]
        status = view["status"]
        table.add_row(
            view["id"],
            Text(status, style=_STATUS_STYLE.get(status, "")),
            format_size(view["mapped_bytes"]),
            format_size(limit),
            bar(view["mapped_bytes"], limit, int(observed.get("capacity_bytes", 0))),
            format_size(view["overage_bytes"]) if view["overage_bytes"] else "",
            str(view["desired"]["revision"]),
        )
    if not views:
        table.caption = "no instances yet: set a limit (kvctl limit ID SIZE) or start an engine"
    return table
