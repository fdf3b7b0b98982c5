"""Durable autopilot state: device budgets and per-instance policies (SQLite, via the Store).

Rows are read whole at start-up and written one transaction per request on
the store's writer thread (:meth:`Store.call`), so an answered request has
reached the disk. Event-loop thread only.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, replace

from ._revisions import Decision, decide
from ._store import Store

__all__ = ["AutopilotStore", "DeviceRow", "PolicyRow"]

_DEVICE_COLUMNS = "id, budget_bytes, revision, updated_at, dry_run"
_POLICY_COLUMNS = (
    "id, device_id, min_bytes, max_bytes, weight, pinned, pin_bytes, source, reason, changed_at, "
    "pin_revision, floor_bytes"
)


@dataclass(frozen=True, slots=True)
class DeviceRow:
    """One row of ``devices``: a device's budget (None: no budget, the autopilot is off)."""

    id: str
    budget_bytes: int | None = None
    revision: int = 0
    updated_at: float = 0.0
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class PolicyRow:
    """One row of ``policies``: an instance's device, policy fields, pin and last change."""

    id: str
    device_id: str | None = None
    min_bytes: int = 0
    max_bytes: int | None = None
    weight: float = 1.0
    pinned: bool = False  # an operator's limit holds until DELETE .../limit
    pin_bytes: int | None = None
    source: str | None = None  # "operator" or "policy": who set the current desired limit
    reason: str | None = None
    changed_at: float | None = None
    # the revision of the operator's pin on a budgeted device (the client's, or the next one
    # when it gave none); None: no pin, or a pin that is the instance's own desired limit
    pin_revision: int | None = None
    # the floor its engine last reported (what it maps again the moment it restarts): kept
    # free while the instance is dead, also across a sidecar restart (docs/autopilot.md)
    floor_bytes: int = 0


def _device(row: tuple[object, ...]) -> DeviceRow:
    iid, budget, revision, updated_at, dry_run = row
    assert isinstance(iid, str) and isinstance(revision, int) and isinstance(updated_at, float)
    assert budget is None or isinstance(budget, int)
    return DeviceRow(iid, budget, revision, updated_at, bool(dry_run))


def _policy(row: tuple[object, ...]) -> PolicyRow:
    (iid, device, lo, hi, weight, pinned, pin, source, reason, changed, pin_rev, floor) = row
    assert isinstance(iid, str) and isinstance(lo, int) and isinstance(weight, float)
    assert device is None or isinstance(device, str)
    assert hi is None or isinstance(hi, int)
    assert pin is None or isinstance(pin, int)
    assert source is None or isinstance(source, str)
    assert reason is None or isinstance(reason, str)
    assert changed is None or isinstance(changed, float)
    assert pin_rev is None or isinstance(pin_rev, int)
    assert isinstance(floor, int)
    return PolicyRow(
        iid, device, lo, hi, weight, bool(pinned), pin, source, reason, changed, pin_rev, floor
    )


def _put_policy(conn: sqlite3.Connection, row: PolicyRow) -> PolicyRow:
    conn.execute(
        f"INSERT OR REPLACE INTO policies ({_POLICY_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            row.id,
            row.device_id,
            row.min_bytes,
            row.max_bytes,
            row.weight,
            int(row.pinned),
            row.pin_bytes,
            row.source,
            row.reason,
            row.changed_at,
            row.pin_revision,
            row.floor_bytes,
        ),
    )
    return row


class AutopilotStore:
    """The autopilot's tables over the one :class:`Store`. Event-loop thread only."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def load(self) -> tuple[list[DeviceRow], list[PolicyRow]]:
        def body(conn: sqlite3.Connection) -> tuple[list[DeviceRow], list[PolicyRow]]:
            devices = [
                _device(r)
                for r in conn.execute(f"SELECT {_DEVICE_COLUMNS} FROM devices ORDER BY id")
            ]
            policies = [
                _policy(r)
                for r in conn.execute(f"SELECT {_POLICY_COLUMNS} FROM policies ORDER BY id")
            ]
            return devices, policies

        return await self._store.call(body)

    async def set_budget(
        self, device_id: str, budget: int | None, revision: int | None, dry_run: bool | None
    ) -> tuple[DeviceRow, Decision]:
        """Validate ``revision`` against the stored one and write (raises to change nothing)."""

        def body(conn: sqlite3.Connection) -> tuple[DeviceRow, Decision]:
            found = conn.execute(
                f"SELECT {_DEVICE_COLUMNS} FROM devices WHERE id = ?", (device_id,)
            ).fetchone()
            current = DeviceRow(device_id) if found is None else _device(found)
            decision = decide(current.budget_bytes, current.revision, budget, revision)
            flag = current.dry_run if dry_run is None else dry_run
            if not decision.changed and flag == current.dry_run:
                return current, decision
            row = replace(
                current,
                budget_bytes=budget,
                revision=decision.revision,
                updated_at=time.time(),
                dry_run=flag,
            )
            conn.execute(
                f"INSERT OR REPLACE INTO devices ({_DEVICE_COLUMNS}) VALUES (?,?,?,?,?)",
                (row.id, row.budget_bytes, row.revision, row.updated_at, int(row.dry_run)),
            )
            return row, Decision(row.revision, True)

        return await self._store.call(body)

    async def put_policies(self, rows: list[PolicyRow]) -> list[PolicyRow]:
        """Write the rows in one transaction (all or none)."""

        def body(conn: sqlite3.Connection) -> list[PolicyRow]:
            return [_put_policy(conn, row) for row in rows]

        return await self._store.call(body)

    async def forget(self, instance_id: str) -> None:
        def body(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM policies WHERE id = ?", (instance_id,))

        await self._store.call(body)
