"""The autopilot's policy rows by instance id, with the ids on each device kept beside them.

A pass over one device used to find its instances by scanning (and sorting) every policy
row, and the loop passes over every budgeted device each tick: at 1,024 instances on 128
devices, ~131k row visits and 128 sorts of 1,024 rows a tick, five ticks a second
(bench/bench_autopilot_scale.py). The index is updated on every write, so a pass visits
the device's own instances only. Event-loop thread, like the autopilot.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ._autopilot_store import PolicyRow

__all__ = ["PolicyTable"]


class PolicyTable:
    """``instance id -> PolicyRow``, and ``device id -> instance ids`` kept in step."""

    def __init__(self, rows: Iterable[PolicyRow] = ()) -> None:
        self._rows: dict[str, PolicyRow] = {}
        self._on: dict[str, set[str]] = {}  # device id -> ids of the rows placed on it
        self.update(rows)

    # --- reads ---------------------------------------------------------------------------

    def get(self, instance_id: str) -> PolicyRow | None:
        return self._rows.get(instance_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def on_device(self, device_id: str) -> list[PolicyRow]:
        """The rows placed on ``device_id``, by instance id."""
        return [self._rows[iid] for iid in sorted(self._on.get(device_id, ()))]

    def device_ids(self) -> set[str]:
        """Every device some row is placed on."""
        return set(self._on)

    # --- writes --------------------------------------------------------------------------

    def __setitem__(self, instance_id: str, row: PolicyRow) -> None:
        if row.id != instance_id:
            raise ValueError(f"policy row {row.id!r} stored under {instance_id!r}")
        self._unplace(instance_id)
        self._rows[instance_id] = row
        if row.device_id is not None:
            self._on.setdefault(row.device_id, set()).add(instance_id)

    def update(self, rows: Iterable[PolicyRow]) -> None:
        for row in rows:
            self[row.id] = row

    def pop(self, instance_id: str, default: PolicyRow | None = None) -> PolicyRow | None:
        self._unplace(instance_id)
        return self._rows.pop(instance_id, default)

    def _unplace(self, instance_id: str) -> None:
        old = self._rows.get(instance_id)
        if old is None or old.device_id is None:
            return
        ids = self._on[old.device_id]
        ids.discard(instance_id)
        if not ids:
            del self._on[old.device_id]
