"""How many clients may wait in the app at once: long-polls (``?wait=``) and event
streams (``?watch=1``).

A waiting client holds its connection busy in the app, where the connection cap
(``KVSIDECAR_MAX_CONNECTIONS``, ``_server.py``) cannot evict it. Without a cap of
their own, enough dashboards and ``kvctl --wait`` calls would take every
connection, and engine reports (which keep limits ``applied``) and operator
writes would get 503. :class:`WaitSlots` keeps them to ``KVSIDECAR_MAX_WAITS``
(by default half the connections); one more is refused with 503 before it
changes anything, and everything that does not wait is served as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ._errors import TooManyWaitsError

__all__ = ["HeldStream", "WaitSlots"]


class WaitSlots:
    """A count of waiting clients and its cap. Event-loop thread only (no lock)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1; got {limit}")
        self.limit = limit
        self.in_use = 0
        self.refused = 0  # waits refused since start (kvsidecar_waits_refused)

    def take(self) -> None:
        """Take a slot, or raise :class:`TooManyWaitsError` (nothing taken)."""
        if self.in_use >= self.limit:
            self.refused += 1
            raise TooManyWaitsError(self.limit)
        self.in_use += 1

    def give(self) -> None:
        """Give back a slot taken with :meth:`take`."""
        if self.in_use <= 0:
            raise RuntimeError("WaitSlots.give() without a take()")
        self.in_use -= 1

    @contextmanager
    def held(self) -> Iterator[None]:
        """A slot for the ``with`` block (raises before it when none is free)."""
        self.take()
        try:
            yield
        finally:
            self.give()


class HeldStream(StreamingResponse):
    """A streaming response that gives its wait slot back however it ends: the stream
    ran out, the client went, the send failed, or the server cut it at shutdown.

    The slot is taken by whoever builds it (so a refusal is a plain 503 answer);
    ``slots.give()`` runs once, when the response's ASGI call returns or raises.
    """

    def __init__(self, slots: WaitSlots, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots: WaitSlots | None = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing)."""
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.give()
