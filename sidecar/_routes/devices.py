"""Autopilot endpoints: ``/devices`` (budgets, atomic limits) and ``/instances/{id}/policy``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from engine_ext.protocol import MAX_CLIENT_REVISION, parse_limit, parse_size

from .._deps import Authorized, AutopilotDep, DeviceId, InstanceId
from .._models import DeviceList, DeviceView, InstanceView
from .instances import _PROBLEMS, _json, _source

__all__ = ["router"]

router = APIRouter(tags=["autopilot"], responses=_PROBLEMS)


def _size(value: Any) -> int:
    return parse_size(value)


def _size_or_none(value: Any) -> int | None:
    return parse_limit(value)


Size = Annotated[int, BeforeValidator(_size)]
SizeOrNone = Annotated[int | None, BeforeValidator(_size_or_none)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BudgetBody(_Strict):
    """Body of ``PUT /devices/{id}/budget``."""

    budget: Size = Field(description="bytes the device's instances may map together, e.g. '8G'")
    revision: int | None = Field(default=None, ge=1, le=MAX_CLIENT_REVISION, strict=True)
    dry_run: bool | None = Field(
        default=None, description="compute and show the plan, write no limit"
    )


class DeviceLimitsBody(_Strict):
    """Body of ``PUT /devices/{id}/limits``: instance id -> limit (each is pinned)."""

    limits: dict[str, Size] = Field(max_length=1024)


class PolicyBody(_Strict):
    """Body of ``PUT /instances/{id}/policy``: the fields given change; null = the default."""

    min: SizeOrNone = Field(default=None, description="the least the autopilot gives (0)")
    max: SizeOrNone = Field(default=None, description="the most it gives (null: no max)")
    weight: float | None = Field(default=None, description="share of the spare memory (1)")

    @field_validator("weight")
    @classmethod
    def _weight(cls, value: float | None) -> float | None:
        if value is not None and not (0 < value <= 1e6):
            raise ValueError(f"weight must be above 0 and at most 1e6; got {value!r}")
        return value

    def fields(self) -> dict[str, object]:
        names = {"min": "min_bytes", "max": "max_bytes", "weight": "weight"}
        return {names[k]: getattr(self, k) for k in self.model_fields_set}


@router.get(
    "/devices",
    response_model=DeviceList,
    summary="Every known device: budget, sum of limits, sum of mapped, instances",
)
async def list_devices(autopilot: AutopilotDep) -> Response:
    return _json(DeviceList(devices=autopilot.devices()))


@router.get(
    "/devices/{device_id}",
    response_model=DeviceView,
    summary="One device: budget, sum of limits and mapped, free, its instances",
)
async def get_device(device_id: DeviceId, autopilot: AutopilotDep) -> Response:
    return _json(autopilot.device(device_id))


@router.put(
    "/devices/{device_id}/budget",
    response_model=DeviceView,
    dependencies=[Authorized],
    summary="Set the device's budget: the autopilot shares it among the instances",
)
async def put_budget(
    device_id: DeviceId, body: BudgetBody, autopilot: AutopilotDep, request: Request
) -> Response:
    return _json(
        await autopilot.set_budget(
            device_id, body.budget, body.revision, body.dry_run, source=_source(request, "PUT")
        )
    )


@router.delete(
    "/devices/{device_id}/budget",
    response_model=DeviceView,
    dependencies=[Authorized],
    summary="Remove the budget: the autopilot stops; the limits stay as they are",
)
async def delete_budget(device_id: DeviceId, autopilot: AutopilotDep, request: Request) -> Response:
    return _json(
        await autopilot.set_budget(device_id, None, None, None, source=_source(request, "DELETE"))
    )


@router.put(
    "/devices/{device_id}/limits",
    response_model=DeviceView,
    dependencies=[Authorized],
    summary="Pin several instances' limits at once, applied shrink before grow",
)
async def put_device_limits(
    device_id: DeviceId, body: DeviceLimitsBody, autopilot: AutopilotDep, request: Request
) -> Response:
    return _json(
        await autopilot.set_device_limits(device_id, body.limits, source=_source(request, "PUT"))
    )


@router.put(
    "/instances/{instance_id}/policy",
    response_model=InstanceView,
    dependencies=[Authorized],
    tags=["instances"],
    summary="Set an instance's autopilot fields: min, max, weight",
)
async def put_policy(
    instance_id: InstanceId, body: PolicyBody, autopilot: AutopilotDep
) -> Response:
    return _json(await autopilot.set_policy(instance_id, body.fields()))
