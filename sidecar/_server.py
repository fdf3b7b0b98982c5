"""The uvicorn configuration of the service: read timeouts and a connection cap.

uvicorn closes idle keep-alive connections, but waits for ever for a request
that is sent slowly or not at all, and takes every connection it is offered.
:func:`server_config` serves the app with an HTTP protocol that

* closes (with 408) a connection whose request headers have not all arrived
  ``header_timeout_s`` after its first byte (or after it was opened), and one
  whose body has not all arrived ``body_timeout_s`` after the headers;
* closes (with 503) any connection beyond ``max_connections`` at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ._settings import SidecarSettings

__all__ = ["server_config"]

_log = logging.getLogger("kvsidecar.http")
_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n"
                b"content-length: 0\r\n\r\n")
_BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n"
             b"content-length: 0\r\nretry-after: 1\r\n\r\n")


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol plus read deadlines and a connection cap.

    One instance per connection, on the event-loop thread. ``_timer`` is the
    running read deadline (``_timer_kind`` "header" or "body"), or None while
    the app answers or the connection idles (uvicorn's keep-alive timer).
    """

    header_timeout_s = 10.0
    body_timeout_s = 10.0
    max_connections = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            _log.warning("refused a connection: %d are open (KVSIDECAR_MAX_CONNECTIONS)",
                         self.max_connections)
            transport.write(_BUSY_503)
            transport.close()
            return
        self._arm("header", self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()
        self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_state(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.conn.trailing_data[0] and self._timer_kind != "header":
                self._arm("header", self.header_timeout_s)  # a request has begun to arrive
        elif state is h11.SEND_BODY:
            if self._timer_kind != "body":
                self._arm("body", self.body_timeout_s)
        else:
            self._disarm()  # the whole request is in: the app answers

    def _arm(self, kind: str, delay: float) -> None:
        self._disarm()
        self._timer_kind = kind
        self._timer = self.loop.call_later(delay, self._expired, kind)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_kind = None

    def _expired(self, kind: str) -> None:
        self._timer = None
        self._timer_kind = None
        if self.transport.is_closing():
            return
        _log.info("closed a connection from %s: its request %s did not arrive in time",
                  self.client, "headers" if kind == "header" else "body")
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_TIMEOUT_408)
        self.transport.close()


def server_config(app: Any, settings: SidecarSettings, *, host: str | None = None,
                  port: int | None = None, log_level: str | None = None) -> uvicorn.Config:
    """The uvicorn config for ``app`` with this service's limits (see the module doc)."""
    protocol = type("GuardedH11", (_GuardedH11,), {
        "header_timeout_s": settings.header_timeout_s,
        "body_timeout_s": settings.body_timeout_s,
        "max_connections": settings.max_connections,
    })
    return uvicorn.Config(
        app, host=settings.host if host is None else host,
        port=settings.port if port is None else port,
        http=protocol, log_level=log_level or settings.log_level, access_log=False,
        timeout_keep_alive=settings.keepalive_timeout_s, lifespan="on")
