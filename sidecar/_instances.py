"""The in-memory instance table: desired (mirrored from the store) + observed state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine_ext.protocol import EngineState, InstanceReason, Status

from ._models import DesiredLimit, EngineInfo, InstanceView
from ._policy import held_after_report, held_after_write
from ._store import InstanceRow

__all__ = ["InstanceRecord", "derive_status", "limit_held"]


def limit_held(state: EngineState) -> int | None:
    """The limit an engine works towards: its effective limit (max of limit and floor),
    or the limit when the report has none (None: unlimited)."""
    if state.effective_limit_bytes is not None:
        return state.effective_limit_bytes
    return state.limit_bytes


@dataclass(slots=True)
class InstanceRecord:
    """One instance as the sidecar knows it right now.

    Owned by the service; event-loop thread only. ``row`` mirrors the durable
    row and only moves to a newer revision (concurrent writers may finish in
    any order). ``changed`` is replaced on every change and the old event set,
    so every waiter wakes once per change (a broadcast, no polling).
    """

    row: InstanceRow
    observed: EngineState | None = None  # the engine's last report/push answer
    last_seen: float | None = None  # loop time of the last sign of life
    # loop time the engine stopped (deregistered), on this process's monotonic clock, so a
    # step of the wall clock moves no duration (sidecar/_retention.py); a stop stored
    # before start-up is placed on it at start-up; None: not stopped
    stopped_since: float | None = None
    reg_token: str | None = None  # the registration token of the engine process holding the id
    # the most the engine may map until it next reports applied (None: unbounded), for the
    # autopilot's budget (sidecar/_policy.py held_after_write / held_after_report)
    may_hold: int | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        event, self.changed = self.changed, asyncio.Event()
        event.set()

    def set_row(self, row: InstanceRow) -> None:
        """Take ``row`` unless a later write already arrived (writes finish in any order)."""
        if row.seq > self.row.seq:
            self.row = row
            self.may_hold = held_after_write(self.may_hold, row.limit_bytes)

    def take_report(self, state: EngineState, *, restarted: bool = False) -> None:
        """Keep ``state`` as the engine's last report and update what it may hold.

        ``restarted``: a new engine process (registration), whose memory starts afresh.
        """
        self.observed = state
        self.may_hold = held_after_report(
            0 if restarted else self.may_hold,
            applied=state.status is Status.APPLIED and state.revision >= self.row.revision,
            effective=limit_held(state),
            mapped=state.mapped_bytes,
        )

    @property
    def stopped(self) -> bool:
        """The engine deregistered on a clean shutdown (until it registers again)."""
        return self.row.stopped_at is not None

    def live(self, now: float, heartbeat_timeout_s: float) -> bool:
        """An engine process holds the id: registered, not stopped, heard from recently."""
        return (
            self.row.registered_at is not None
            and not self.stopped
            and self.last_seen is not None
            and now - self.last_seen <= heartbeat_timeout_s
        )

    def needs_push(self) -> bool:
        """The engine is registered and has not acknowledged the desired revision."""
        if self.row.socket_path is None or self.row.revision == 0 or self.stopped:
            return False
        return self.observed is None or self.observed.revision < self.row.revision

    def view(self, now: float, heartbeat_timeout_s: float) -> InstanceView:
        status, reason = derive_status(self, now, heartbeat_timeout_s)
        obs = self.observed
        row = self.row
        engine = None
        if row.engine is not None and row.registered_at is not None:
            engine = EngineInfo(
                engine=row.engine,
                engine_version=row.engine_version or "",
                socket_path=row.socket_path,
                device_total_bytes=row.device_total_bytes,
                registered_at=row.registered_at,
                stopped_at=row.stopped_at,
            )
        return InstanceView(
            id=row.id,
            status=status,
            reason=reason,
            desired=DesiredLimit(
                limit_bytes=row.limit_bytes, revision=row.revision, updated_at=row.updated_at
            ),
            effective_limit_bytes=None if obs is None else limit_held(obs),
            mapped_bytes=0 if obs is None else obs.mapped_bytes,
            overage_bytes=0 if obs is None or status is not Status.DEFERRED else obs.overage_bytes,
            last_seen_s_ago=None if self.last_seen is None else round(now - self.last_seen, 3),
            engine=engine,
            observed=obs,
        )


def derive_status(
    rec: InstanceRecord, now: float, heartbeat_timeout_s: float
) -> tuple[Status, str | None]:
    """The one status of an instance, from desired, observed and last sign of life.

    * never heard from the engine: ``pending`` (``not_registered``);
    * the engine deregistered on a clean shutdown: ``stopped`` (``deregistered``);
    * silent for longer than the heartbeat timeout: ``unreachable``;
    * the engine has not acknowledged the desired revision: ``pending``;
    * the engine holds the desired revision with another limit: ``pending``
      (``limit_mismatch``; the service re-issues the desired limit as the next revision);
    * otherwise what the engine reported (``deferred`` with its reason, or ``applied``).
    """
    obs = rec.observed
    if obs is None and rec.row.registered_at is None:
        return Status.PENDING, InstanceReason.NOT_REGISTERED.value
    if rec.stopped:
        return Status.STOPPED, InstanceReason.DEREGISTERED.value
    if rec.last_seen is not None and now - rec.last_seen > heartbeat_timeout_s:
        return Status.UNREACHABLE, InstanceReason.NO_HEARTBEAT.value
    if obs is None:
        return Status.PENDING, InstanceReason.AWAITING_REPORT.value
    if obs.revision < rec.row.revision:
        return Status.PENDING, InstanceReason.PUSH_IN_FLIGHT.value
    if obs.revision == rec.row.revision and obs.limit_bytes != rec.row.limit_bytes:
        return Status.PENDING, InstanceReason.LIMIT_MISMATCH.value
    if obs.status in (Status.APPLIED, Status.DEFERRED):
        return obs.status, obs.reason if obs.status is Status.DEFERRED else None
    return Status.PENDING, obs.reason
