"""``Annotated`` dependencies shared by the routers."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from engine_ext.protocol import DEVICE_ID_PATTERN, ID_PATTERN

from ._autopilot import Autopilot
from ._errors import UnauthorizedError
from ._service import InstanceService
from ._settings import SidecarSettings
from ._waits import WaitSlots

__all__ = [
    "Authorized",
    "AutopilotDep",
    "DeviceId",
    "InstanceId",
    "Service",
    "Settings",
    "WaitSeconds",
    "Waits",
]

MAX_WAIT_S = 300.0
# Dependencies are ``async def``: FastAPI runs plain ``def`` ones in a worker thread (a
# profile of bench/bench_sidecar.py showed 12 thread hops per PUT; throughput 0.70x -> 0.83x).
_bearer = HTTPBearer(auto_error=False, description="KVSIDECAR_TOKEN, when one is set")


async def _service(request: Request) -> InstanceService:
    service: InstanceService = request.app.state.service
    return service


async def _settings(request: Request) -> SidecarSettings:
    settings: SidecarSettings = request.app.state.settings
    return settings


async def _autopilot(request: Request) -> Autopilot:
    autopilot: Autopilot = request.app.state.autopilot
    return autopilot


async def _waits(request: Request) -> WaitSlots:
    waits: WaitSlots = request.app.state.waits
    return waits


Service = Annotated[InstanceService, Depends(_service)]
Waits = Annotated[WaitSlots, Depends(_waits)]
AutopilotDep = Annotated[Autopilot, Depends(_autopilot)]
Settings = Annotated[SidecarSettings, Depends(_settings)]


async def _authorize(
    settings: Settings, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    if settings.token is None:
        return
    if creds is None:
        raise UnauthorizedError(
            "this sidecar requires a bearer token: send 'Authorization: Bearer <token>' "
            "(kvctl --token or KVSIDECAR_TOKEN)"
        )
    expected = settings.token.get_secret_value().encode()
    if not secrets.compare_digest(creds.credentials.encode(), expected):
        raise UnauthorizedError("the bearer token is wrong; use the sidecar's KVSIDECAR_TOKEN")


#: Add to every mutating route: a no-op without a configured token.
Authorized = Depends(_authorize)

InstanceId = Annotated[
    str,
    Path(
        pattern=ID_PATTERN,
        max_length=63,
        description="1-63 characters: letters, digits, '.', '_' or '-', starting with a letter "
        "or digit",
    ),
]

DeviceId = Annotated[
    str,
    Path(
        pattern=DEVICE_ID_PATTERN,
        max_length=128,
        description="a device id as engines register it (KVSIDECAR_DEVICE_ID): 1-128 letters, "
        "digits, '.', '_', ':' or '-'",
    ),
]

WaitSeconds = Annotated[
    float | None,
    Query(
        ge=0,
        le=MAX_WAIT_S,
        description=f"long-poll up to this many seconds (at most {MAX_WAIT_S:g}) for 'applied'",
    ),
]
