"""``GET /instances?watch=1``: the instance list as server-sent events, for dashboards.

Each event is ``event: instances`` with the same JSON as ``GET /instances``;
one is sent at once and then whenever anything but ``last_seen_s_ago``
changes (checked every ``_POLL_S``), with a comment line as keep-alive. A
stream ends after ``KVSIDECAR_MAX_WAIT_S`` (EventSource reconnects by
itself, after the ``retry`` delay sent first), or when the client goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from .._models import InstanceList
from .._service import InstanceService
from .._waits import HeldStream, WaitSlots

__all__ = ["MEDIA_TYPE", "instance_events"]

MEDIA_TYPE = "text/event-stream"
_POLL_S = 0.25
_KEEPALIVE_S = 15.0
_RETRY_MS = 1000


def _comparable(listing: InstanceList) -> list[dict[str, Any]]:
    return [view.model_dump(exclude={"last_seen_s_ago"}) for view in listing.instances]


async def _events(request: Request, service: InstanceService, max_s: float) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    end = loop.time() + max_s
    last: list[dict[str, Any]] | None = None
    quiet_since = loop.time()
    number = 0
    yield f"retry: {_RETRY_MS}\n\n"
    while loop.time() < end and not await request.is_disconnected():
        listing = InstanceList(instances=service.list())
        now = loop.time()
        comparable = _comparable(listing)
        if comparable != last:
            number += 1
            last, quiet_since = comparable, now
            yield f"event: instances\nid: {number}\ndata: {listing.model_dump_json()}\n\n"
        elif now - quiet_since >= _KEEPALIVE_S:
            quiet_since = now
            yield ": keep-alive\n\n"
        await asyncio.sleep(min(_POLL_S, max(0.0, end - loop.time())))


def instance_events(
    request: Request, service: InstanceService, max_s: float, waits: WaitSlots
) -> HeldStream:
    """The event stream response (no caching, no proxy buffering). It holds one of
    ``waits`` while it runs; with none free it raises ``TooManyWaitsError`` (503)."""
    waits.take()
    return HeldStream(
        waits,
        _events(request, service, max_s),
        media_type=MEDIA_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
