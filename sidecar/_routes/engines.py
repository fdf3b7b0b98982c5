"""Engine-facing endpoints: registration and reports (the heartbeat)."""

from __future__ import annotations

from fastapi import APIRouter

from engine_ext.protocol import EngineState, RegisterBody, RegisterReply

from .._deps import Authorized, InstanceId, Service
from .instances import _PROBLEMS

__all__ = ["router"]

router = APIRouter(prefix="/instances", tags=["engines"], dependencies=[Authorized],
                   responses=_PROBLEMS)


@router.post("/{instance_id}/register", response_model=RegisterReply,
             summary="An engine starts: record it, answer with the retained desired limit")
async def register(instance_id: InstanceId, body: RegisterBody,
                   service: Service) -> RegisterReply:
    return await service.register(instance_id, body)


@router.post("/{instance_id}/report", response_model=RegisterReply,
             summary="An engine's status report; doubles as its heartbeat")
async def report(instance_id: InstanceId, body: EngineState, service: Service) -> RegisterReply:
    return await service.report(instance_id, body)
