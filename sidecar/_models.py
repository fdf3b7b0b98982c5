"""Typed response models of the sidecar API (request bodies live in engine_ext.protocol)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from engine_ext.protocol import EngineState, Status

__all__ = ["DesiredLimit", "EngineInfo", "InstanceList", "InstanceView", "Problem"]


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
    stopped_at: float | None = Field(default=None,
                                     description="unix seconds of a clean shutdown, if stopped")


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
