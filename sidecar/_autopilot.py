"""The autopilot: budgets per device, policy fields per instance, and the loop applying them.

:mod:`sidecar._policy` decides (pure); this module builds its snapshot from the
instance table, writes its changes through :class:`InstanceService` (durable,
revisioned, pushed like any limit) and keeps the autopilot's own rows
(:mod:`sidecar._autopilot_store`). docs/autopilot.md is the operator's view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from prometheus_client import Counter, Histogram

from engine_ext.protocol import EngineState, RegisterBody, RegisterReply, Status, format_size

from ._autopilot_store import AutopilotStore, DeviceRow, PolicyRow
from ._errors import (
    BudgetError,
    DeviceMoveError,
    InvalidInputError,
    RequestError,
    StoreError,
    UnknownDeviceError,
    UnknownInstanceError,
)
from ._instances import InstanceRecord, limit_held
from ._metrics import Metrics
from ._models import DeviceMember, DeviceView, InstanceView, PlannedChange, PolicyView
from ._policy import UNBOUNDED, Change, Member, Target, committed, compute_targets, plan
from ._policy_table import PolicyTable
from ._revisions import Decision, decide
from ._service import InstanceService
from ._settings import SidecarSettings
from ._store import Store

__all__ = ["Autopilot", "PolicyFields"]

_log = logging.getLogger("kvsidecar.autopilot")

#: A policy update: the fields given (absent: unchanged; None: back to the default).
PolicyFields = Mapping[str, object]
_DEFAULTS: dict[str, object] = {"min_bytes": 0, "max_bytes": None, "weight": 1.0}


class Autopilot:
    """Owns the device budgets, the policy rows and the policy loop task.

    Event-loop thread only. Every write of a limit on a budgeted device (the
    policy's and the operator's) happens under ``_lock``, so the pass that
    plans shrink-before-grow sees every pin and budget change before it
    writes. Invariant kept by :func:`sidecar._policy.plan`: on a device not
    in dry run, the bytes its live instances may hold never exceed its budget
    by a grow of ours.
    """

    def __init__(
        self, store: Store, service: InstanceService, settings: SidecarSettings, metrics: Metrics
    ) -> None:
        self._store = AutopilotStore(store)
        self._service = service
        self._settings = settings
        self._devices: dict[str, DeviceRow] = {}
        self._policies = PolicyTable()
        self._targets: dict[str, Target] = {}  # instance -> last target of the pass
        self._would: dict[str, list[Change]] = {}  # device -> dry-run plan
        # device -> the inputs of its last pass, kept only when that pass had nothing to
        # write (or was a dry run): the same inputs plan the same nothing, so the pass is
        # skipped (an idle device costs its members' snapshot per tick, no plan)
        self._planned: dict[str, tuple[DeviceRow, int, list[Member]]] = {}
        # instance -> (what its last Member was built from, that Member): an unchanged
        # instance yields the same object, so the snapshot above compares by identity
        self._built: dict[str, tuple[tuple[object, ...], Member]] = {}
        self._busy_at: dict[str, float] = {}  # instance -> monotonic time it was last busy
        # instance -> (largest demand seen within the busy hold, monotonic time seen)
        self._peak: dict[str, tuple[int, float]] = {}
        self._awaiting: dict[str, tuple[int, float]] = {}  # instance -> (revision, decided at)
        self._pin_sources: dict[str, str] = {}  # instance -> who pinned (for the audit line)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.changes = Counter(
            "kvsidecar_limit_changes",
            "Desired limits written on budgeted devices, by source",
            ["source"],
            registry=metrics.registry,
        )
        self.decision_seconds = Histogram(
            "kvsidecar_autopilot_apply_seconds",
            "From an autopilot decision (policy or pinned operator limit) to 'applied'",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=metrics.registry,
        )
        service.decorate = self._decorate
        service.on_observed = self._on_observed

    # --- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        devices, policies = await self._store.load()
        self._devices = {d.id: d for d in devices}
        self._policies = PolicyTable(policies)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvsidecar-autopilot")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        """Run a pass now (after a report or a change), not at the next interval."""
        self._wake.set()

    def _on_observed(
        self, instance_id: str, before: EngineState | None, after: EngineState
    ) -> None:
        """An engine's report (or push answer): run a pass now if it frees memory on a
        budgeted device (a grow may be waiting for it) or changes the demand there, so the
        timer is only the fallback (time-based inputs: the busy hold, heartbeats)."""
        dev = self._devices.get(self.policy(instance_id).device_id or "")
        if dev is None or dev.budget_bytes is None:
            return
        if (
            before is None
            or _may_hold(after) < _may_hold(before)
            or _demand(after) != _demand(before)
        ):
            self.wake()

    # --- reads ---------------------------------------------------------------------------

    def policy(self, instance_id: str) -> PolicyRow:
        return self._policies.get(instance_id) or PolicyRow(instance_id)

    def manages(self, instance_id: str) -> bool:
        """The autopilot writes this instance's limits (its device has a live budget)."""
        return self._active(self.policy(instance_id).device_id)

    def _active(self, device_id: str | None) -> bool:
        return device_id is not None and self._row_active(self._devices.get(device_id))

    def _lowers(self, old: DeviceRow, new: DeviceRow) -> bool:
        """``new`` is a live budget below ``old``, or the first live one (a budget set, out
        of dry run): the limits written under ``old`` may add up to more than it."""
        if not self._row_active(new) or new.budget_bytes is None:
            return False
        return (
            not self._row_active(old)
            or old.budget_bytes is None
            or new.budget_bytes < old.budget_bytes
        )

    def _row_active(self, dev: DeviceRow | None) -> bool:
        """The autopilot writes limits under this budget (one, not in dry run)."""
        return (
            dev is not None
            and dev.budget_bytes is not None
            and not dev.dry_run
            and not self._settings.autopilot_dry_run
        )

    def device_ids(self) -> list[str]:
        known = {d for d, row in self._devices.items() if row.budget_bytes is not None}
        known |= self._policies.device_ids()
        return sorted(known)

    def device(self, device_id: str) -> DeviceView:
        if device_id not in self.device_ids():
            raise UnknownDeviceError(device_id)
        row = self._devices.get(device_id) or DeviceRow(device_id)
        members = self._members(device_id)
        records = self._service.records()
        out: list[DeviceMember] = []
        limits: int | None = 0
        mapped = 0
        for m in members:
            rec = records[m.id]
            p = self.policy(m.id)
            target = self._targets.get(m.id)
            out.append(
                DeviceMember(
                    id=m.id,
                    status=self._service.status_of(rec),
                    source=p.source,
                    pinned=p.pinned,
                    limit_bytes=m.desired,
                    target_bytes=None if target is None else target.limit,
                    reason=p.reason,
                    mapped_bytes=m.mapped,
                    committed_bytes=None if m.live and not m.reported else committed(m),
                    min_bytes=p.min_bytes,
                    max_bytes=p.max_bytes,
                    weight=p.weight,
                )
            )
            if m.live:
                mapped += m.mapped
                limits = None if limits is None or m.desired is None else limits + m.desired
        free = None if row.budget_bytes is None or limits is None else row.budget_bytes - limits
        would = [
            PlannedChange(instance=c.id, old_bytes=c.old, new_bytes=c.new, reason=c.reason)
            for c in self._would.get(device_id, [])
        ]
        return DeviceView(
            id=device_id,
            budget_bytes=row.budget_bytes,
            revision=row.revision,
            dry_run=row.dry_run or self._settings.autopilot_dry_run,
            sum_limits_bytes=limits,
            sum_mapped_bytes=mapped,
            free_bytes=free,
            instances=out,
            would=would,
        )

    def devices(self) -> list[DeviceView]:
        return [self.device(d) for d in self.device_ids()]

    def _decorate(self, view: InstanceView) -> InstanceView:
        p = self._policies.get(view.id)
        if p is None:
            return view
        target = self._targets.get(view.id)
        return view.model_copy(
            update={
                "policy": PolicyView(
                    device_id=p.device_id,
                    min_bytes=p.min_bytes,
                    max_bytes=p.max_bytes,
                    weight=p.weight,
                    source=p.source,
                    pinned=p.pinned,
                    pin_bytes=None if (pin := self._pin_of(p)) is None or pin >= UNBOUNDED else pin,
                    target_bytes=None if target is None else target.limit,
                    reason=p.reason,
                    changed_at=p.changed_at,
                    managed=self.manages(view.id),
                )
            }
        )

    # --- operator writes -----------------------------------------------------------------

    async def set_budget(
        self,
        device_id: str,
        budget: int | None,
        revision: int | None,
        dry_run: bool | None,
        *,
        source: str,
    ) -> DeviceView:
        if device_id not in self.device_ids():
            raise UnknownDeviceError(device_id)
        async with self._lock:
            if budget is not None:
                self._check_budget(device_id, budget, {})
            old = self._devices.get(device_id) or DeviceRow(device_id)
            # judged here first, so a stale or conflicting budget writes no limit either
            judged = decide(old.budget_bytes, old.revision, budget, revision)
            new = replace(
                old,
                budget_bytes=budget,
                revision=judged.revision,
                dry_run=old.dry_run if dry_run is None else dry_run,
            )
            if self._lowers(old, new):
                # its split is written before anyone reads the budget: no reader sees the
                # limits of the budget before above it (a grow it writes fits under it too)
                await self._pass(device_id, new)
            row, decision = await self._store.set_budget(device_id, budget, revision, dry_run)
            self._devices[device_id] = row
        if decision.changed:
            _log.info(
                "device %s: budget %s (revision %d, dry_run %s) by %s",
                device_id,
                format_size(budget),
                row.revision,
                row.dry_run,
                source,
                extra={
                    "fields": {
                        "event": "budget_change",
                        "device": device_id,
                        "budget_bytes": budget,
                        "revision": row.revision,
                        "dry_run": row.dry_run,
                        "source": source,
                    }
                },
            )
        self.wake()
        return self.device(device_id)

    async def set_policy(self, instance_id: str, fields: PolicyFields) -> InstanceView:
        if instance_id not in self._service.records():
            raise UnknownInstanceError(instance_id)
        async with self._lock:
            p = self.policy(instance_id)
            update = {k: (_DEFAULTS[k] if v is None else v) for k, v in fields.items()}
            new = replace(p, **update)  # type: ignore[arg-type]
            if new.weight <= 0:
                raise InvalidInputError("weight", f"must be above 0; got {new.weight:g}")
            if new.max_bytes is not None and new.min_bytes > new.max_bytes:
                raise InvalidInputError(
                    "min",
                    f"min {format_size(new.min_bytes)} is above max "
                    f"{format_size(new.max_bytes)}: lower min or raise max",
                )
            dev = self._devices.get(new.device_id or "")
            if dev is not None and dev.budget_bytes is not None:
                self._check_budget(dev.id, dev.budget_bytes, {instance_id: new})
            await self._store.put_policies([new])
            self._policies[instance_id] = new
        self.wake()
        return self._service.get(instance_id)

    async def operator_limit(
        self, instance_id: str, limit: int | None, revision: int | None, *, source: str
    ) -> InstanceView:
        """``PUT .../limit``: the operator pins the instance. On a budgeted device the limit
        is applied by the loop in shrink-before-grow order; elsewhere it is written at once.

        Whether the device has a budget is decided under the lock: a budget set meanwhile
        then sees the pin (and refuses what it cannot hold), and a pass does not move the
        limit between its write and its pin."""
        async with self._lock:
            if not self.manages(instance_id):
                view = await self._service.set_limit(instance_id, limit, revision, source=source)
                await self._pin(instance_id, True)
                return self._decorate(view)
            device_id = self.policy(instance_id).device_id
            assert device_id is not None
            p = self.policy(instance_id)
            decision = self._pin_decision(p, limit, revision)  # stale/conflict: nothing changes
            if not decision.changed:
                return self._service.get(instance_id)  # an idempotent repeat of the pin
            budget = self._devices[device_id].budget_bytes
            assert budget is not None
            if limit is None:
                raise BudgetError(
                    f"instance {instance_id!r} is on device {device_id!r}, which has a budget: "
                    "its limit cannot be unlimited. Set a size, or DELETE .../limit to hand "
                    "it back to the autopilot"
                )
            new = replace(p, pinned=True, pin_bytes=limit, pin_revision=decision.revision)
            self._check_budget(device_id, budget, {instance_id: new})
            await self._store.put_policies([new])
            self._policies[instance_id] = new
            self._pin_sources[instance_id] = source
            await self._pass(device_id)
        return self._service.get(instance_id)

    def _pin_decision(self, p: PolicyRow, limit: int | None, revision: int | None) -> Decision:
        """The revision rule for an operator's pin on a budgeted device (raises to change
        nothing). The pin may wait for room (shrink before grow) while the instance's stored
        limit keeps its older revision, so a revision is judged against the pin's own while
        that is the newer one: a repeat is idempotent, an older one stale."""
        rec = self._service.records()[p.id]
        row_limit, row_revision = rec.row.limit_bytes, rec.row.revision
        if p.pinned and p.pin_revision is not None and p.pin_revision >= row_revision:
            return decide(p.pin_bytes, p.pin_revision, limit, revision)
        decision = decide(row_limit, row_revision, limit, revision)
        if not decision.changed and p.pin_bytes != limit:
            return Decision(decision.revision, True)  # the stored limit, now pinned
        return decision

    async def unpin(self, instance_id: str, *, source: str) -> InstanceView:
        """``DELETE .../limit``: back to the autopilot on a budgeted device (the current limit
        stays until its next pass), back to unlimited elsewhere (decided under the lock, as
        for :meth:`operator_limit`)."""
        async with self._lock:
            if not self.manages(instance_id):
                view = await self._service.clear_limit(instance_id, source=source)
                await self._pin(instance_id, False)
                return self._decorate(view)
            new = replace(self.policy(instance_id), pinned=False, pin_bytes=None, pin_revision=None)
            await self._store.put_policies([new])
            self._policies[instance_id] = new
            await self._pass(self.policy(instance_id).device_id or "")
        _log.info("instance %s: unpinned by %s; the autopilot sets its limit", instance_id, source)
        return self._service.get(instance_id)

    async def set_device_limits(
        self, device_id: str, limits: Mapping[str, int], *, source: str
    ) -> DeviceView:
        """``PUT /devices/{id}/limits``: pin several instances at once (all or none), applied
        shrink before grow."""
        if device_id not in self.device_ids():
            raise UnknownDeviceError(device_id)
        if not limits:
            raise InvalidInputError("limits", "name at least one instance")
        async with self._lock:  # the budget checked is the one the pass will use
            dev = self._devices.get(device_id)
            if dev is None or dev.budget_bytes is None:
                raise BudgetError(
                    f"device {device_id!r} has no budget; set one first (PUT "
                    f"/devices/{device_id}/budget) so the order can be kept"
                )
            for iid in limits:
                if self.policy(iid).device_id != device_id:
                    raise InvalidInputError(
                        "limits",
                        f"instance {iid!r} is not on device {device_id!r} (GET "
                        f"/devices/{device_id} lists its instances)",
                    )
            rows = {
                iid: replace(
                    self.policy(iid),
                    pinned=True,
                    pin_bytes=size,
                    pin_revision=self._pin_decision(self.policy(iid), size, None).revision,
                )
                for iid, size in limits.items()
            }
            self._check_budget(device_id, dev.budget_bytes, rows)
            await self._store.put_policies(list(rows.values()))
            self._policies.update(rows.values())
            for iid in rows:
                self._pin_sources[iid] = source
            if self._active(device_id):
                await self._pass(device_id)
        return self.device(device_id)

    async def forget(
        self, instance_id: str, *, source: str, only_if: Callable[[], bool] | None = None
    ) -> bool:
        """``DELETE /instances/{id}``: drop the instance and its policy row. Under the lock: a
        pass that planned a change for it writes it before (the instance is then dropped
        with it) or not at all, never after, which would store its limit again, a new
        pending instance where the operator had just forgotten one.

        ``only_if`` is asked under the lock (the retention sweep: the engine is still
        gone); False leaves the instance as it is. Returns whether it was forgotten.
        """
        async with self._lock:
            if only_if is not None and not only_if():
                return False
            await self._service.forget(instance_id, source=source)
            await self._store.forget(instance_id)
            for table in (
                self._policies,
                self._targets,
                self._busy_at,
                self._peak,
                self._awaiting,
                self._pin_sources,
                self._built,
            ):
                table.pop(instance_id, None)
        return True

    # --- engine-facing -------------------------------------------------------------------

    async def register(self, instance_id: str, body: RegisterBody) -> RegisterReply:
        """An engine registers: refuse a move to another device; record the device; fit a
        returning engine's kept limit into what its device has left (others may hold its
        memory now); register it with the service; store its floor (kept free should it
        die). All under the lock: a pass that ran between the fit and the registration
        would still count the instance dead (its floor only) and grow the others into the
        room it was just given. The service vets the registration before anything is
        stored; a new id's place under the cap is held while it is stored."""
        p = self.policy(instance_id)
        if p.device_id is not None and body.device_id is not None and body.device_id != p.device_id:
            raise DeviceMoveError(
                f"instance {instance_id!r} is recorded on device {p.device_id!r} but its "
                f"engine registered on {body.device_id!r}; an instance cannot move devices: "
                f"forget it (kvctl forget {instance_id}) and start the engine again, or give "
                "it another KVSIDECAR_INSTANCE_ID"
            )
        async with self._lock:
            # every refusal first: a refused registration must not leave its device (a
            # policy row, a device in GET /devices) or a fitted limit behind; a new id's
            # place under the cap is then held until it is stored
            await self._service.vet_register(instance_id, body)
            async with self._service.admission(instance_id):
                await self._fit_returning(instance_id, body)
                reply = await self._service.register(instance_id, body, vetted=True)
            await self._store_floors([instance_id])
        return reply

    async def _fit_returning(self, instance_id: str, body: RegisterBody) -> None:
        """Record the device of a joining instance; fit a returning engine's kept limit into
        what its device has left (under the lock)."""
        p = self.policy(instance_id)
        if body.device_id is not None and p.device_id is None:
            p = self._joining_policy(replace(p, device_id=body.device_id))
            await self._store.put_policies([p])
            self._policies[instance_id] = p
        device_id = p.device_id
        if device_id is None or not self._active(device_id):
            return
        budget = self._devices[device_id].budget_bytes
        assert budget is not None
        others = [m for m in self._members(device_id) if m.id != instance_id]
        room = max(0, budget - sum(committed(m) for m in others))
        rec = self._service.records().get(instance_id)
        kept = None if rec is None else rec.row.limit_bytes
        if kept is not None and kept <= room:
            return
        if p.pinned and p.pin_bytes is None and kept is not None:
            p = replace(p, pin_bytes=kept)  # the pin is the kept limit, not the fitted one
            await self._store.put_policies([p])
            self._policies[instance_id] = p
        page = max(1, body.state.page_bundle_bytes)
        new = room // page * page
        await self._write(
            device_id,
            Change(instance_id, kept, new, "returned_fit"),
            reason_text=f"kept {format_size(kept)}, {format_size(room)} free on the device",
        )

    def _joining_policy(self, p: PolicyRow) -> PolicyRow:
        """An instance joins its device. Its operator's limit and its min, stored before its
        engine first registered (no device known then, so never checked), stay only if the
        device's budget holds them beside the others' mins and pins, as a PUT would have
        been checked: otherwise the pin is dropped (the autopilot sets the limit), then the
        min (back to 0), each with a warning. The others' promises stand."""
        dev = self._devices.get(p.device_id or "")
        if dev is None or dev.budget_bytes is None:
            return p
        while p.pinned or p.min_bytes:
            try:
                self._check_budget(dev.id, dev.budget_bytes, {p.id: p})
                return p
            except BudgetError as exc:
                dropped = "its pinned limit" if p.pinned else f"its min {format_size(p.min_bytes)}"
                _log.warning(
                    "instance %s joined device %s, whose budget cannot hold %s: dropped (%s)",
                    p.id,
                    dev.id,
                    dropped,
                    exc.detail,
                )
                if p.pinned:
                    p = replace(p, pinned=False, pin_bytes=None, pin_revision=None)
                else:
                    p = replace(p, min_bytes=0)
        return p

    async def _store_floors(self, instance_ids: list[str]) -> None:
        """Store each instance's reported floor where it differs from the stored one (under
        the lock: the policy rows' other writers hold it too; a forgotten instance has no
        row left to write)."""
        records = self._service.records()
        rows = []
        for iid in instance_ids:
            p, rec = self._policies.get(iid), records.get(iid)
            if p is None or p.device_id is None or rec is None or rec.observed is None:
                continue
            if rec.observed.floor_bytes != p.floor_bytes:
                rows.append(replace(p, floor_bytes=rec.observed.floor_bytes))
        if rows:
            await self._store.put_policies(rows)
            self._policies.update(rows)

    # --- the loop ------------------------------------------------------------------------

    async def _run(self) -> None:
        interval = self._settings.autopilot_interval_s
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except TimeoutError:
                pass
            self._wake.clear()
            async with self._lock:
                try:
                    await self._store_floors(list(self._policies))
                except StoreError as exc:
                    _log.warning("autopilot: %s; storing the floors next pass", exc.detail)
                for device_id in self.device_ids():
                    # one device's failure must not hold the others' passes back
                    try:
                        await self._pass(device_id)
                    except asyncio.CancelledError:
                        raise
                    except RequestError as exc:
                        _log.warning(
                            "autopilot pass on device %s: %s; retrying next pass",
                            device_id,
                            exc.detail,
                        )
                    except Exception:  # noqa: BLE001  (a bug must not end the loop)
                        _log.exception(
                            "autopilot pass on device %s failed; retrying next pass", device_id
                        )
            self._observe_applied()

    async def _pass(self, device_id: str, dev: DeviceRow | None = None) -> None:
        """One policy pass over one device (under the lock), under its stored budget or
        under ``dev``, a budget about to be stored."""
        dev = self._devices.get(device_id) if dev is None else dev
        if dev is None or dev.budget_bytes is None:
            self._would.pop(device_id, None)
            self._planned.pop(device_id, None)
            return
        members = self._members(device_id)  # (the busy hold and liveness: time moves them)
        hysteresis = int(self._settings.autopilot_hysteresis * dev.budget_bytes)
        inputs = (dev, hysteresis, members)
        if self._planned.get(device_id) == inputs:
            return  # a pure function of these inputs planned nothing to write last time
        self._planned.pop(device_id, None)
        targets = compute_targets(dev.budget_bytes, members)
        for m in members:
            if m.live and m.pin is not None:
                targets[m.id] = Target(m.id, m.pin, "operator")
        self._targets.update(targets)
        changes = plan(dev.budget_bytes, members, targets, hysteresis)
        if not changes or not self._row_active(dev):
            self._planned[device_id] = inputs  # writes fail and are retried: never kept
        if not self._row_active(dev):
            if changes != self._would.get(device_id):
                for c in changes:
                    _log.info(
                        "device %s (dry run): would set %s %s -> %s (%s)",
                        device_id,
                        c.id,
                        format_size(c.old),
                        format_size(c.new),
                        c.reason,
                        extra={
                            "fields": {
                                "event": "autopilot_dry_run",
                                "device": device_id,
                                "instance": c.id,
                                "old_limit_bytes": c.old,
                                "new_limit_bytes": c.new,
                                "reason": c.reason,
                            }
                        },
                    )
            self._would[device_id] = changes
            return
        self._would.pop(device_id, None)
        await self._write_all(device_id, changes)

    async def _write(self, device_id: str, change: Change, *, reason_text: str = "") -> None:
        await self._write_all(device_id, [change], reason_text=reason_text)

    async def _write_all(
        self, device_id: str, changes: list[Change], *, reason_text: str = ""
    ) -> None:
        """Write a pass's changes: the limits in one durable write, then the policy rows in
        another (one commit each, however many instances the pass moves: a pin on a
        device of 128 instances shrinks 127 of them). All or none: a refused write
        leaves every limit and source as it was, and the next pass plans it again."""
        if not changes:
            return
        records = self._service.records()
        previous: dict[str, PolicyRow] = {}
        rows: list[PolicyRow] = []
        writes: list[tuple[str, int | None, int | None, str]] = []
        now = time.time()
        for change in changes:
            source = "operator" if change.reason == "operator" else "policy"
            who = (
                self._pin_sources.get(change.id, "an operator")
                if source == "operator"
                else "the autopilot"
            )
            old = previous[change.id] = self.policy(change.id)
            rows.append(replace(old, source=source, reason=change.reason, changed_at=now))
            # An operator's pin is written under its own revision (the one the PUT was
            # judged by), so a client that repeats it reads an idempotent repeat, not a
            # stale one; if the engine reported a newer one meanwhile, the next one.
            rec = records.get(change.id)
            revision = old.pin_revision
            if (
                change.reason != "operator"
                or revision is None
                or change.new != old.pin_bytes
                or rec is None
                or revision <= rec.row.revision
            ):
                revision = None
            what = f"{who} on device {device_id} ({change.reason}; shrink before grow)"
            writes.append((change.id, change.new, revision, what))
        # The policies' sources and reasons first: a reader (GET runs while this awaits)
        # never sees a new limit beside the source and reason of the one before it.
        self._policies.update(rows)
        try:
            stored = await self._service.set_limits(writes)
        except BaseException:
            for p in rows:
                if self._policies.get(p.id) is p:
                    self._policies[p.id] = previous[p.id]  # no limit written: nor its source
            raise
        await self._store.put_policies(rows)
        decided = time.monotonic()
        for change, p, row in zip(changes, rows, stored, strict=True):
            self.changes.labels(p.source).inc()
            self._awaiting[change.id] = (row.revision, decided)
            _log.info(
                "autopilot %s: %s %s -> %s (%s%s)",
                device_id,
                change.id,
                format_size(change.old),
                format_size(change.new),
                change.reason,
                f"; {reason_text}" if reason_text else "",
                extra={
                    "fields": {
                        "event": "autopilot_change",
                        "device": device_id,
                        "instance": change.id,
                        "source": p.source,
                        "old_limit_bytes": change.old,
                        "new_limit_bytes": change.new,
                        "reason": change.reason,
                        "revision": row.revision,
                    }
                },
            )

    def _observe_applied(self) -> None:
        for iid, (revision, since) in list(self._awaiting.items()):
            rec = self._service.records().get(iid)
            if rec is None:
                del self._awaiting[iid]
                continue
            obs = rec.observed
            if (
                obs is not None
                and obs.revision >= revision
                and self._service.status_of(rec) is Status.APPLIED
            ):
                self.decision_seconds.observe(time.monotonic() - since)
                del self._awaiting[iid]

    # --- helpers -------------------------------------------------------------------------

    def _members(self, device_id: str) -> list[Member]:
        records = self._service.records()
        now = time.monotonic()
        hold = self._settings.autopilot_busy_hold_s
        out = []
        for p in self._policies.on_device(device_id):
            rec = records.get(p.id)
            if rec is not None:
                out.append(self._member(rec, p, now, hold))
        return out

    def _member(self, rec: InstanceRecord, p: PolicyRow, now: float, hold: float) -> Member:
        status = self._service.status_of(rec)
        live = rec.row.registered_at is not None and status not in (
            Status.UNREACHABLE,
            Status.STOPPED,
        )
        obs = rec.observed
        if obs is not None and (obs.num_running_requests or obs.num_waiting_requests):
            self._busy_at[rec.row.id] = now
        busy = now - self._busy_at.get(rec.row.id, -1e9) <= hold
        pin = self._pin_of(p)
        # pinned bytes are a periodic scan: without running requests nothing is pinned;
        # with the output reservation (vLLM) what they may still add is theirs too
        pinned = demand = 0
        if obs is not None:
            if obs.num_running_requests:
                pinned = obs.pinned_bytes + obs.reserved_bytes
            demand = pinned + obs.waiting_bytes
        # the demand of a busy instance holds for the busy hold: a gap between its requests
        # (demand 0 for a moment) moves no memory, as the hold keeps its share
        peak = self._peak.get(rec.row.id)
        if peak is None or demand >= peak[0] or now - peak[1] > hold:
            peak = self._peak[rec.row.id] = (demand, now)
        recent = peak[0] if busy else 0
        # everything the Member is made of: the row, report and policy objects (replaced,
        # never changed in place, on every change) and the values computed above
        made_of = (rec.row, obs, p, rec.may_hold, live, busy, recent)
        built = self._built.get(rec.row.id)
        if built is not None and _same_inputs(built[0], made_of):
            return built[1]
        member = self._build_member(rec, p, live, busy, recent, pinned, pin)
        self._built[rec.row.id] = (made_of, member)
        return member

    def _build_member(
        self,
        rec: InstanceRecord,
        p: PolicyRow,
        live: bool,
        busy: bool,
        recent: int,
        pinned: int,
        pin: int | None,
    ) -> Member:
        obs = rec.observed
        if obs is None:  # not heard from since the sidecar started: its stored floor
            return Member(
                rec.row.id,
                live,
                reported=False,
                desired=rec.row.limit_bytes,
                floor=p.floor_bytes,
                min=p.min_bytes,
                max=p.max_bytes,
                weight=p.weight,
                pin=pin,
            )
        return Member(
            rec.row.id,
            live,
            reported=True,
            desired=rec.row.limit_bytes,
            held=rec.may_hold,
            mapped=obs.mapped_bytes,
            waiting=obs.waiting_bytes,
            pinned=pinned,
            recent=recent,
            busy=busy,
            floor=obs.floor_bytes,
            capacity=obs.capacity_bytes,
            page=max(1, obs.page_bundle_bytes),
            min=p.min_bytes,
            max=p.max_bytes,
            weight=p.weight,
            pin=pin,
        )

    def _check_budget(self, device_id: str, budget: int, changed: Mapping[str, PolicyRow]) -> None:
        """The budget must hold every instance's min (or pinned limit, or both: the larger)
        on the device."""
        need = 0
        parts = []
        rows = {**{p.id: p for p in self._policies.on_device(device_id)}, **changed}
        for iid, p in sorted(rows.items()):
            pin = self._pin_of(p)
            if pin is not None:
                if pin >= UNBOUNDED:
                    raise BudgetError(
                        f"instance {iid!r} on device {device_id!r} is pinned to unlimited; "
                        f"set its limit (kvctl limit {iid} SIZE) or hand it to the autopilot "
                        f"(kvctl delete {iid}) before budgeting the device"
                    )
                # its min counts as soon as the pin goes (DELETE .../limit checks nothing)
                need += max(pin, p.min_bytes)
                parts.append(
                    f"{iid} pinned {format_size(pin)}"
                    + (f" (min {format_size(p.min_bytes)})" if p.min_bytes > pin else "")
                )
            elif p.min_bytes:
                need += p.min_bytes
                parts.append(f"{iid} min {format_size(p.min_bytes)}")
        if need > budget:
            raise BudgetError(
                f"device {device_id!r}: the budget {format_size(budget)} is below what its "
                f"instances are promised, {format_size(need)} ({', '.join(parts)}); raise the "
                "budget or lower those mins and pinned limits"
            )

    async def _pin(self, instance_id: str, pinned: bool) -> None:
        """Record that an operator set (or cleared) the limit of an instance the autopilot
        does not manage now (under the lock). Its desired limit is the pin (``pin_bytes``
        stays None), so the row is written only when the flag flips: a PUT costs no second
        write."""
        p = self.policy(instance_id)
        if instance_id not in self._service.records() or p.pinned == pinned:
            return
        p = replace(
            p,
            pinned=pinned,
            pin_bytes=None,
            source="operator",
            reason=None,
            changed_at=time.time(),
        )
        await self._store.put_policies([p])
        self._policies[instance_id] = p

    def _pin_of(self, p: PolicyRow) -> int | None:
        """The pinned limit (None: not pinned); an unlimited pin reads as UNBOUNDED."""
        if not p.pinned:
            return None
        if p.pin_bytes is not None:
            return p.pin_bytes
        rec = self._service.records().get(p.id)
        limit = None if rec is None else rec.row.limit_bytes
        return UNBOUNDED if limit is None else limit


def _same_inputs(old: tuple[object, ...], new: tuple[object, ...]) -> bool:
    """The row, report and policy are the same objects; the computed values are equal."""
    return old[0] is new[0] and old[1] is new[1] and old[2] is new[2] and old[3:] == new[3:]


def _may_hold(state: EngineState) -> int:
    """What an engine reported it may hold: once ``applied``, the larger of its limit
    (unlimited: unbounded) and its mapped bytes; otherwise unbounded (a deferred engine's
    running requests may still grow to the limit they were admitted under). A drop is
    memory given back (a lower limit ``applied``)."""
    if state.status is not Status.APPLIED:
        return UNBOUNDED
    held = limit_held(state)
    return max(UNBOUNDED if held is None else held, state.mapped_bytes)


def _demand(state: EngineState) -> tuple[int, int, int]:
    """The demand the policy reads from a report (pinned bytes change with every step of a
    running request: their scan is not compared, the request counts are)."""
    return (state.num_running_requests, state.num_waiting_requests, state.waiting_bytes)
