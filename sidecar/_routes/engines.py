"""Engine-facing endpoints: registration, reports (the heartbeat) and deregistration."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header

from engine_ext.protocol import (
    REGISTRATION_HEADER,
    REGISTRATION_TOKEN_PATTERN,
    EngineState,
    RegisterBody,
    RegisterReply,
)

from .._deps import Authorized, AutopilotDep, InstanceId, Service
from .._models import InstanceView
from .instances import _PROBLEMS

__all__ = ["router"]

router = APIRouter(
    prefix="/instances", tags=["engines"], dependencies=[Authorized], responses=_PROBLEMS
)

RegistrationToken = Annotated[
    str | None,
    Header(
        alias=REGISTRATION_HEADER,
        pattern=REGISTRATION_TOKEN_PATTERN,
        description="the registration_token the engine process registered with",
    ),
]


@router.post(
    "/{instance_id}/register",
    response_model=RegisterReply,
    summary="An engine starts: record it, answer with the retained desired limit",
)
async def register(
    instance_id: InstanceId, body: RegisterBody, autopilot: AutopilotDep
) -> RegisterReply:
    return await autopilot.register(instance_id, body)  # its device, fit, floor; the service


@router.post(
    "/{instance_id}/report",
    response_model=RegisterReply,
    summary="An engine's status report; doubles as its heartbeat",
)
async def report(
    instance_id: InstanceId, body: EngineState, service: Service, token: RegistrationToken = None
) -> RegisterReply:
    return await service.report(instance_id, body, token)


@router.post(
    "/{instance_id}/deregister",
    response_model=InstanceView,
    summary="An engine stops cleanly: status 'stopped', the desired limit is kept",
)
async def deregister(
    instance_id: InstanceId, service: Service, token: RegistrationToken = None
) -> InstanceView:
    return await service.deregister(instance_id, token)
