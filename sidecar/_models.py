"""Typed response models of the sidecar API (request bodies live in engine_ext.protocol)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from engine_ext.protocol import EngineState, Status

__all__ = [
    "DesiredLimit",
    "DeviceList",
    "DeviceMember",
    "DeviceView",
    "EngineInfo",
    "InstanceList",
    "InstanceView",
    "PlannedChange",
    "PolicyView",
    "Problem",
]


class DesiredLimit(BaseModel):
    """The durable desired limit of an instance."""

    limit_bytes: int | None = Field(description="bytes per GPU; null = unlimited")
    revision: int = Field(description="strictly increasing; 0 = no limit set yet")
    updated_at: float = Field(description="unix seconds of the last change")


class EngineInfo(BaseModel):
    """What the engine said when it registered."""

    engine: str
    engine_version: str
    socket_path: str | None
    device_total_bytes: int | None
    registered_at: float
    stopped_at: float | None = Field(
        default=None, description="unix seconds of a clean shutdown, if stopped"
    )


class InstanceView(BaseModel):
    """One instance: desired limit, the engine's observed state and the combined status."""

    id: str
    status: Status = Field(description="pending, deferred, applied, unreachable or stopped")
    reason: str | None = Field(description="why not applied (deferred/pending/unreachable)")
    desired: DesiredLimit
    effective_limit_bytes: int | None = Field(description="the target the engine works towards")
    mapped_bytes: int = Field(description="largest per-rank mapped KV bytes")
    overage_bytes: int = Field(description="mapped - limit while deferred, else 0")
    last_seen_s_ago: float | None = Field(description="seconds since the engine's last report")
    engine: EngineInfo | None
    observed: EngineState | None = Field(description="the engine's last report, as sent")
    policy: PolicyView | None = Field(
        default=None, description="device, autopilot fields, limit source (docs/autopilot.md)"
    )


class InstanceList(BaseModel):
    """``GET /instances``: every known instance, sorted by id."""

    instances: list[InstanceView]


class Problem(BaseModel):
    """An ``application/problem+json`` body (RFC 9457)."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[dict[str, str]] | None = None


class PolicyView(BaseModel):
    """An instance's place under the autopilot (docs/autopilot.md)."""

    device_id: str | None = Field(description="the device its ranks use (from registration)")
    min_bytes: int
    max_bytes: int | None
    weight: float
    source: str | None = Field(description="who set the current desired limit: operator|policy")
    pinned: bool = Field(description="an operator's limit holds until DELETE .../limit")
    pin_bytes: int | None = Field(description="the operator's limit while pinned")
    target_bytes: int | None = Field(description="where the autopilot takes the limit")
    reason: str | None = Field(description="why the policy set the current limit")
    changed_at: float | None = Field(description="unix seconds of the last autopilot change")
    managed: bool = Field(description="the autopilot writes this instance's limit")


class DeviceMember(BaseModel):
    """One instance in a device view."""

    id: str
    status: Status
    source: str | None
    pinned: bool
    limit_bytes: int | None = Field(description="desired limit (null = unlimited)")
    target_bytes: int | None
    reason: str | None
    mapped_bytes: int
    committed_bytes: int | None = Field(
        description="the most it may map before its next report (null: not heard from yet)"
    )
    min_bytes: int
    max_bytes: int | None
    weight: float


class PlannedChange(BaseModel):
    """A limit change the autopilot would write (dry run) or writes next."""

    instance: str
    old_bytes: int | None
    new_bytes: int
    reason: str


class DeviceView(BaseModel):
    """``GET /devices/{id}``: a device's budget and what its instances hold."""

    id: str
    budget_bytes: int | None = Field(description="null: no budget, the autopilot leaves it")
    revision: int
    dry_run: bool = Field(description="the autopilot computes and shows, writes nothing")
    sum_limits_bytes: int | None = Field(
        description="sum of the live instances' desired limits (null if one is unlimited)"
    )
    sum_mapped_bytes: int = Field(description="sum of the live instances' mapped bytes")
    free_bytes: int | None = Field(description="budget - sum of limits (null: no budget)")
    instances: list[DeviceMember]
    would: list[PlannedChange] = Field(
        description="dry run: the changes the autopilot would write now"
    )


class DeviceList(BaseModel):
    """``GET /devices``: every known device, sorted by id."""

    devices: list[DeviceView]


InstanceView.model_rebuild()
