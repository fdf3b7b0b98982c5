"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from .._deps import Service
from .._metrics import Metrics
from .._version import build_info

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers (with its version and build)")
async def healthz() -> dict[str, str | dict[str, str]]:
    info = build_info()
    return {"status": "ok", "version": info["version"], "build": info}


@router.get(
    "/readyz",
    summary="Readiness: the database takes a write",
    responses={503: {"description": "the database is not writable"}},
)
async def readyz(service: Service) -> dict[str, str]:
    await service.check_ready()
    return {"status": "ready"}


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    registry: Metrics = request.app.state.metrics
    body, content_type = registry.render()
    return Response(body, media_type=content_type)
