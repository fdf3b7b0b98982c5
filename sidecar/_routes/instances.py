"""Operator endpoints: ``/instances`` and ``/instances/{id}/limit``."""

from __future__ import annotations

import asyncio
from contextlib import AbstractContextManager, nullcontext
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel

from engine_ext.protocol import LimitBody, Status

from .._deps import Authorized, AutopilotDep, InstanceId, Service, Settings, Waits, WaitSeconds
from .._models import InstanceList, InstanceView, Problem
from .._service import InstanceService
from .._waits import WaitSlots
from . import watch as watch_events

__all__ = ["router"]

router = APIRouter(prefix="/instances", tags=["instances"])

_PROBLEMS: dict[int | str, dict[str, Any]] = {
    code: {"model": Problem, "content": {"application/problem+json": {}}}
    for code in (401, 404, 409, 413, 422, 503)
}


def _json(model: BaseModel, status_code: int = 200) -> Response:
    """Serialize once (``response_model`` stays for the schema; FastAPI would validate again)."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


@router.get(
    "",
    response_model=InstanceList,
    responses={
        200: {
            "content": {watch_events.MEDIA_TYPE: {}},
            "description": "the list; with ?watch=1 an event stream of it",
        },
        503: {**_PROBLEMS[503], "description": "?watch=1 while KVSIDECAR_MAX_WAITS clients wait"},
    },
    summary="Every known instance; ?watch=1 streams the list (server-sent events)",
)
async def list_instances(
    service: Service,
    settings: Settings,
    waits: Waits,
    request: Request,
    watch: Annotated[
        bool,
        Query(
            description="stream the list as server-sent events, one event "
            "per change, for up to KVSIDECAR_MAX_WAIT_S"
        ),
    ] = False,
) -> Response:
    if watch:
        listing: watch_events.SharedListing = request.app.state.watch_listing
        return watch_events.instance_events(request, listing, settings.max_wait_s, waits)
    return _json(InstanceList(instances=service.list()))


@router.get(
    "/{instance_id}",
    response_model=InstanceView,
    responses=_PROBLEMS,
    summary="One instance; ?wait=S long-polls until it is applied",
)
async def get_instance(
    instance_id: InstanceId,
    service: Service,
    waits: Waits,
    request: Request,
    wait: WaitSeconds = None,
) -> Response:
    view = service.get(instance_id)  # 404 before any waiting
    if wait:
        with waits.held():  # 503 when KVSIDECAR_MAX_WAITS clients already wait
            view = await _wait_or_disconnect(
                request, service, instance_id, lambda v: v.status is Status.APPLIED, wait
            )
    return _json(view)


@router.put(
    "/{instance_id}/limit",
    response_model=InstanceView,
    dependencies=[Authorized],
    responses={
        202: {"model": InstanceView, "description": "?wait deadline passed before 'applied'"},
        **_PROBLEMS,
    },
    summary="Set the desired limit (stored durably before the answer)",
)
async def put_limit(
    instance_id: InstanceId,
    body: LimitBody,
    service: Service,
    autopilot: AutopilotDep,
    waits: Waits,
    request: Request,
    wait: WaitSeconds = None,
) -> Response:
    with _slot_if(waits, wait):  # a wait that cannot be served is refused before the write
        # an operator's limit pins the instance (docs/autopilot.md, "Precedence")
        view = await autopilot.operator_limit(
            instance_id, body.limit, body.revision, source=_source(request, "PUT")
        )
        return await _finish(request, service, view, wait)


@router.delete(
    "/{instance_id}/limit",
    response_model=InstanceView,
    dependencies=[Authorized],
    responses={202: {"model": InstanceView}, **_PROBLEMS},
    summary="Back to unlimited, as a new revision",
)
async def delete_limit(
    instance_id: InstanceId,
    service: Service,
    autopilot: AutopilotDep,
    waits: Waits,
    request: Request,
    wait: WaitSeconds = None,
) -> Response:
    # on a budgeted device: back to the autopilot; elsewhere: back to unlimited
    service.get(instance_id)  # 404 before anything
    with _slot_if(waits, wait):
        view = await autopilot.unpin(instance_id, source=_source(request, "DELETE"))
        return await _finish(request, service, view, wait)


@router.delete(
    "/{instance_id}",
    status_code=204,
    dependencies=[Authorized],
    responses=_PROBLEMS,
    response_class=Response,
    summary="Forget the instance: its desired limit, registration and metrics",
)
async def forget_instance(
    instance_id: InstanceId, autopilot: AutopilotDep, request: Request
) -> Response:
    await autopilot.forget(instance_id, source=_source(request, "DELETE"))
    return Response(status_code=204)


def _source(request: Request, method: str) -> str:
    """Who asked, for the audit line: the method and the client address."""
    client = request.client
    return f"{method} from {client.host if client else 'unknown'}"


def _slot_if(waits: WaitSlots, wait: float | None) -> AbstractContextManager[None]:
    """A wait slot for a request that will wait (``?wait=`` above 0), else nothing."""
    return waits.held() if wait else nullcontext()


async def _finish(
    request: Request, service: InstanceService, view: InstanceView, wait: float | None
) -> Response:
    """Without ``wait``: 200 (stored). With it: 200 once applied, 202 at the deadline."""
    if wait is None:
        return _json(view)
    revision = view.desired.revision
    view = await _wait_or_disconnect(
        request,
        service,
        view.id,
        lambda v: (
            v.status is Status.APPLIED
            and (v.observed is not None and v.observed.revision >= revision)
        ),
        wait,
    )
    return _json(view, 200 if view.status is Status.APPLIED else 202)


async def _wait_or_disconnect(
    request: Request, service: InstanceService, instance_id: str, until: Any, wait: float
) -> InstanceView:
    """Long-poll, but stop as soon as the client hangs up (no waiting for nobody)."""
    waiter = asyncio.ensure_future(service.wait(instance_id, until, wait))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((waiter, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiter.done():
            waiter.cancel()
    if not waiter.done() or waiter.cancelled():  # the client went first (the cancel
        # above lands at the waiter's next step: it is not done yet, and has no result)
        return service.get(instance_id)  # the answer goes nowhere; keep the types honest
    return waiter.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
