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

__all__ = ["MEDIA_TYPE", "SharedListing", "instance_events"]

MEDIA_TYPE = "text/event-stream"
_POLL_S = 0.25
_KEEPALIVE_S = 15.0
_RETRY_MS = 1000


def _comparable(listing: InstanceList) -> list[dict[str, Any]]:
    return [view.model_dump(exclude={"last_seen_s_ago"}) for view in listing.instances]


class SharedListing:
    """The list every event stream sends, built at most once per ``_POLL_S`` for all of
    them: each stream used to build and compare the whole list itself four times a
    second, so ten dashboards on a sidecar with a thousand instances took more than the
    event loop's whole time (reports and writes waited behind them). ``seq`` goes up
    when anything but ``last_seen_s_ago`` changed. Event-loop thread only."""

    def __init__(self, service: InstanceService) -> None:
        self._service = service
        self._built_at = float("-inf")
        self._last: list[dict[str, Any]] | None = None
        self.seq = 0
        self.data = ""
        self.builds = 0  # lists built (for the tests: one per poll, not one per stream)

    def current(self, now: float, *, fresh: bool = False) -> tuple[int, str]:
        """``(seq, JSON)`` as of at most ``_POLL_S`` ago (``fresh``: as of now)."""
        if fresh or now - self._built_at >= _POLL_S:
            listing = InstanceList(instances=self._service.list())
            comparable = _comparable(listing)
            self.builds += 1
            self._built_at = now
            if comparable != self._last:
                self._last = comparable
                self.seq += 1
                self.data = listing.model_dump_json()
        return self.seq, self.data


async def _events(request: Request, listing: SharedListing, max_s: float) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    end = loop.time() + max_s
    seq = -1
    quiet_since = loop.time()
    number = 0
    fresh = True  # the first event shows the list as of the connection
    yield f"retry: {_RETRY_MS}\n\n"
    while loop.time() < end and not await request.is_disconnected():
        now = loop.time()
        current, data = listing.current(now, fresh=fresh)
        fresh = False
        if current != seq:
            number += 1
            seq, quiet_since = current, now
            yield f"event: instances\nid: {number}\ndata: {data}\n\n"
        elif now - quiet_since >= _KEEPALIVE_S:
            quiet_since = now
            yield ": keep-alive\n\n"
        await asyncio.sleep(min(_POLL_S, max(0.0, end - loop.time())))


def instance_events(
    request: Request, listing: SharedListing, max_s: float, waits: WaitSlots
) -> HeldStream:
    """The event stream response (no caching, no proxy buffering). It holds one of
    ``waits`` while it runs; with none free it raises ``TooManyWaitsError`` (503)."""
    waits.take()
    return HeldStream(
        waits,
        _events(request, listing, max_s),
        media_type=MEDIA_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
