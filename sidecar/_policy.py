"""The autopilot's policy: pure functions from a device snapshot to limits and an order.

Nothing here does I/O or keeps state; :mod:`sidecar._autopilot` builds the
snapshot and writes what :func:`plan` returns. Two steps (docs/autopilot.md):

1. :func:`compute_targets` -- the limit each instance *should* have: its min,
   then its demand (pinned + waiting bytes), then a weighted share of the
   rest among the busy instances (all of them when none is busy), each bounded
   by its min and max, rounded down to whole pages. Operator pins are fixed.
2. :func:`plan` -- the changes that may be written *now*: every shrink, and a
   grow only when the bytes every other instance may hold (its
   :func:`committed` bytes) plus the new limit fit in the budget. An instance
   that lowered its limit holds the old amount until it reports ``applied``,
   so a grow waits for the shrinks it needs: shrink before grow.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "Change",
    "Member",
    "Target",
    "committed",
    "compute_targets",
    "held_after_report",
    "held_after_write",
    "plan",
    "room_for",
]

#: Stands for "could map anything" (unlimited, or not heard from since the sidecar started).
UNBOUNDED = 1 << 62


@dataclass(frozen=True, slots=True)
class Member:
    """One instance on a budgeted device, as the policy sees it.

    ``desired`` is the stored desired limit (None: unlimited); ``held`` the
    most the engine may map until it next reports ``applied`` (None: unbounded),
    kept by :func:`held_after_write` and :func:`held_after_report`;
    ``reported`` whether the engine has reported since the sidecar started.
    """

    id: str
    live: bool  # registered and reporting (not unreachable, not stopped)
    reported: bool = True
    desired: int | None = None
    held: int | None = None
    mapped: int = 0
    pinned: int = 0  # bytes held by running requests
    waiting: int = 0  # bytes the waiting requests need to start
    recent: int = 0  # the largest pinned + waiting seen within the busy hold (a gap holds it)
    busy: bool = False  # running or waiting requests (recently)
    floor: int = 0  # what the engine never gives back
    capacity: int = 0  # what it could map with no limit (0: unknown)
    page: int = 1  # bytes of one page bundle (limits are rounded down to it)
    min: int = 0
    max: int | None = None
    weight: float = 1.0
    pin: int | None = None  # an operator's limit: fixed, the policy does not move it


@dataclass(frozen=True, slots=True)
class Target:
    """Where one instance should go, and why (for the view and the log line)."""

    id: str
    limit: int
    reason: str


@dataclass(frozen=True, slots=True)
class Change:
    """One write the loop may do now: ``old`` -> ``new`` for ``id``."""

    id: str
    old: int | None
    new: int
    reason: str

    @property
    def shrink(self) -> bool:
        return self.old is None or self.new < self.old


def _max_bound(*values: int | None) -> int | None:
    """The largest of ``values``, where None (unbounded) is larger than any number."""
    if any(v is None for v in values):
        return None
    return max(v for v in values if v is not None)


def held_after_write(held: int | None, limit: int | None) -> int | None:
    """A new desired limit was stored: the engine may take it at any moment and admit
    requests under it, so what it may hold rises to it (a lower one changes nothing yet)."""
    return _max_bound(held, limit)


def held_after_report(
    held: int | None, *, applied: bool, effective: int | None, mapped: int
) -> int | None:
    """What an engine may hold after a report (None: unbounded).

    Only an ``applied`` report at the desired revision lowers it, to the limit
    the engine then holds: mapped bytes are under it and (with the output
    reservation) so is the running requests' remaining output. Any other
    report -- ``deferred`` for a lower limit, ``applied`` for an older revision
    -- lowers nothing. The engine reports a new limit as soon as it takes it,
    also while its running requests, admitted under the higher one, still
    grow: they may map up to that one, even while they map less than the new
    limit now. A (re)started engine starts from ``held=0``.
    """
    if applied:
        return effective
    return _max_bound(held, effective, mapped)


def committed(m: Member) -> int:
    """The most an instance may map before it next reports (what the budget must cover).

    A dead instance (unreachable or stopped) counts its floor only: the rest of
    its memory is reassigned, but an engine maps its floor again the moment it
    restarts, before it registers and can be told any limit, so that much stays
    free for its return. One not heard from since the sidecar started counts
    as unbounded (nothing grows until it reports). Otherwise the largest of its
    desired limit, what it may hold (a lower limit counts only once reported
    ``applied``, see :func:`held_after_report`) and what it maps.
    """
    if not m.live:
        return m.floor
    if not m.reported:
        return UNBOUNDED
    bound = m.capacity if m.capacity > 0 else UNBOUNDED
    desired = bound if m.desired is None else m.desired
    held = bound if m.held is None else m.held
    return max(desired, held, m.mapped, m.floor)


def _lo(m: Member) -> int:
    return max(m.min, m.floor)


def _hi(m: Member, budget: int) -> int:
    hi = budget
    if m.max is not None:
        hi = min(hi, m.max)
    if m.capacity > 0:
        hi = min(hi, m.capacity)
    return max(hi, _lo(m))


def _fill(amount: float, caps: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Weighted water-filling: share ``amount`` by weight, nobody above its cap."""
    given = dict.fromkeys(caps, 0.0)
    open_ids = {i for i, c in caps.items() if c > 0}
    while amount > 1e-6 and open_ids:
        total_w = sum(weights[i] for i in open_ids)
        share = amount / total_w
        spent = 0.0
        for i in sorted(open_ids):
            take = min(caps[i] - given[i], share * weights[i])
            given[i] += take
            spent += take
        open_ids = {i for i in open_ids if caps[i] - given[i] > 1e-6}
        amount -= spent
        if spent <= 1e-6:
            break
    return given


def compute_targets(budget: int, members: Sequence[Member]) -> dict[str, Target]:
    """Targets for the live instances that follow the policy (pins and dead ones excluded).

    The sum of the targets plus the pins plus the dead instances' floors (kept
    for their return, see :func:`committed`) never exceeds ``budget`` (when the
    budget covers the pins and the mins, which the API checks). Each target
    is within [max(min, floor), min(max, capacity)] when the budget allows it.
    """
    managed = [m for m in members if m.live and m.pin is None]
    reserved = sum(m.pin for m in members if m.live and m.pin is not None)
    reserved += sum(m.floor for m in members if not m.live)
    avail = max(0, budget - reserved)
    if not managed:
        return {}
    lo = {m.id: float(_lo(m)) for m in managed}
    weights = {m.id: m.weight for m in managed}
    if sum(lo.values()) > avail:  # pins (or floors) leave less than the mins: scale down
        scale = avail / sum(lo.values())
        return {m.id: Target(m.id, _round(lo[m.id] * scale, m), "budget_short") for m in managed}
    hi = {m.id: float(_hi(m, budget)) for m in managed}
    demand = {m.id: min(max(float(m.pinned + m.waiting), lo[m.id]), hi[m.id]) for m in managed}
    rest = avail - sum(lo.values())
    extra = _fill(rest, {i: demand[i] - lo[i] for i in lo}, weights)
    got = {i: lo[i] + extra[i] for i in lo}
    rest -= sum(extra.values())
    # then the demand seen within the busy hold, from what the demand now leaves: a gap
    # between requests moves no memory, and a demand now is never held back by it
    recent = {m.id: min(float(m.recent), hi[m.id]) for m in managed}
    held = _fill(rest, {i: recent[i] - got[i] for i in lo}, weights)
    got = {i: got[i] + held[i] for i in lo}
    rest -= sum(held.values())
    busy = [m.id for m in managed if m.busy] or [m.id for m in managed]
    spare = _fill(rest, {i: hi[i] - got[i] for i in busy}, {i: weights[i] for i in busy})
    out: dict[str, Target] = {}
    for m in managed:
        share = spare.get(m.id, 0.0)
        total = got[m.id] + share
        if demand[m.id] - got[m.id] > 1.0:
            reason = "demand_capped"  # wants more than its weighted share
        elif total >= hi[m.id] - 1.0 and m.max is not None and hi[m.id] == m.max:
            reason = "max"
        elif share > 1.0:
            reason = "fair_share" if m.busy else "idle_share"
        elif demand[m.id] > lo[m.id]:
            reason = "demand"
        else:
            reason = "min"
        out[m.id] = Target(m.id, _round(total, m), reason)
    return out


def _round(value: float, m: Member) -> int:
    """Down to whole pages, never below the instance's own lower bound if it fits."""
    page = max(1, m.page)
    rounded = int(value) // page * page
    return max(rounded, min(_lo(m), int(value)))


def room_for(member_id: str, budget: int, members: Iterable[Member]) -> int:
    """What ``member_id`` may hold now: the budget minus what every other instance may hold."""
    return budget - sum(committed(m) for m in members if m.id != member_id)


def plan(
    budget: int, members: Sequence[Member], targets: dict[str, Target], hysteresis: int
) -> list[Change]:
    """The changes to write now, shrinks first, then the grows that fit.

    ``targets`` holds the policy's targets and the operator pins (with reason
    ``operator``). A policy change smaller than ``hysteresis`` is skipped,
    unless the device is over its budget. A grow that does not fit whole is
    written in part when the part is at least ``hysteresis`` (a page at least);
    the rest follows once the shrinks are applied.
    """
    by_id = {m.id: m for m in members}
    # what every instance may hold, kept as one total: the grows below each need the room
    # the others leave, and summing the others per grow made a pass O(members^2)
    held = {m.id: committed(m) for m in members}
    total = sum(held.values())
    over = total > budget
    shrinks: list[Change] = []
    grows: list[tuple[Member, Target]] = []
    for iid, target in sorted(targets.items()):
        m = by_id[iid]
        if not m.live:
            continue
        old = m.desired
        small = old is not None and abs(target.limit - old) < hysteresis
        if target.reason != "operator" and small and not over:
            continue
        if old is None or target.limit < old:
            shrinks.append(Change(iid, old, target.limit, target.reason))
        elif target.limit > old:
            grows.append((m, target))
    changes = list(shrinks)
    # what every instance may hold once the shrinks are written: a shrink counts only once
    # applied, so it frees nothing yet (committed() keeps the held limit and mapped bytes)
    grows.sort(key=lambda mt: (mt[1].reason != "operator", -(mt[1].limit - (mt[0].desired or 0))))
    for m, target in grows:
        room = budget - (total - held[m.id])  # room_for(m.id, ...) over the state so far
        new = min(target.limit, room)
        new = new // max(1, m.page) * max(1, m.page) if new < target.limit else new
        old = m.desired or 0
        if new <= old:
            continue
        if new < target.limit and new - old < max(hysteresis, m.page):
            continue
        changes.append(Change(m.id, m.desired, new, target.reason))
        grown = committed(replace(m, desired=new))
        total += grown - held[m.id]
        held[m.id] = grown
    return changes
