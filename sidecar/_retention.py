"""Forgets instances whose engine has been gone longer than ``KVSIDECAR_FORGET_AFTER_S``.

Ids that name one engine process (Kubernetes pod names, ``<engine>-<pid>``) are
never used again once it ends, and without this their rows stay for good: each
keeps its floor free on a budgeted device (docs/autopilot.md), counts against
``KVSIDECAR_MAX_INSTANCES`` until new engines are refused, and keeps its
series in ``/metrics``. Off (0) by default: a stopped engine's desired limit is
kept for its return (docs/sidecar.md, "Retention").

Gone means ``stopped`` (since ``stopped_at``, durable) or ``unreachable``
(since the heartbeat timeout ran out: the last report plus
``KVSIDECAR_HEARTBEAT_TIMEOUT_S``; after a sidecar restart the clock starts at
start-up). Both are counted on the event loop's monotonic clock while the
sidecar runs, so a step of the wall clock (NTP, a VM resumed) forgets nothing
early and holds nothing back; a stop stored before start-up counts by the wall
clock up to start-up. An instance that never registered (a limit set ahead of its
engine, docs/limits.md) is never forgotten by time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ._instances import InstanceRecord
from ._metrics import Metrics
from ._service import InstanceService
from ._settings import SidecarSettings

__all__ = ["Retention", "gone_for"]

_log = logging.getLogger("kvsidecar.retention")

#: most seconds between two sweeps (a sweep is O(instances) on the event loop)
_MAX_SWEEP_INTERVAL_S = 60.0

#: ``forget(instance_id, source=..., only_if=...)``: the autopilot's forget (under its lock)
ForgetFn = Callable[..., Awaitable[bool]]


def gone_for(rec: InstanceRecord, *, loop_now: float, heartbeat_timeout_s: float) -> float | None:
    """Seconds since ``rec``'s engine became stopped or unreachable, on the loop's monotonic
    clock; None while it is live or if it never registered."""
    row = rec.row
    if row.registered_at is None:
        return None
    if row.stopped_at is not None:
        # set at start-up for a stored stop and at each deregistration (sidecar/_service.py)
        return None if rec.stopped_since is None else max(0.0, loop_now - rec.stopped_since)
    if rec.last_seen is None:
        return None
    silent = loop_now - rec.last_seen
    if silent <= heartbeat_timeout_s:
        return None  # live
    return silent - heartbeat_timeout_s


class Retention:
    """The sweep task; event-loop thread only. :meth:`start` does nothing when the setting
    is 0."""

    def __init__(
        self,
        service: InstanceService,
        forget: ForgetFn,
        settings: SidecarSettings,
        metrics: Metrics,
    ) -> None:
        self._service = service
        self._forget = forget
        self._after_s = settings.forget_after_s
        self._heartbeat_timeout_s = settings.heartbeat_timeout_s
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        return min(_MAX_SWEEP_INTERVAL_S, self._after_s / 4)

    def start(self) -> None:
        if self._after_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvsidecar-retention")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def due(self) -> list[str]:
        """The ids gone for at least ``forget_after_s`` now."""
        return [iid for iid, rec in self._service.records().items() if self._is_due(rec)]

    def _is_due(self, rec: InstanceRecord) -> bool:
        gone = gone_for(
            rec,
            loop_now=asyncio.get_running_loop().time(),
            heartbeat_timeout_s=self._heartbeat_timeout_s,
        )
        return gone is not None and gone >= self._after_s

    async def sweep(self) -> list[str]:
        """Forget every instance due now; returns the ids forgotten. Each is checked again
        under the forget's lock, so an engine that registered meanwhile keeps its id."""
        forgotten = []
        for iid in self.due():

            def still_due(iid: str = iid) -> bool:
                rec = self._service.records().get(iid)
                return rec is not None and self._is_due(rec)

            try:
                if await self._forget(iid, source="retention", only_if=still_due):
                    forgotten.append(iid)
                    self._metrics.retention_forgot()
            except Exception:  # noqa: BLE001 -- the store may refuse; the next sweep tries again
                _log.exception("could not forget instance %s (retention); trying again", iid)
        if forgotten:
            _log.info(
                "forgot %d instance(s) gone for over %.0f s (KVSIDECAR_FORGET_AFTER_S): %s",
                len(forgotten),
                self._after_s,
                ", ".join(forgotten),
            )
        return forgotten

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sweep()
