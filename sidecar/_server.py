"""The uvicorn configuration of the service: read timeouts and a connection cap.

uvicorn closes idle keep-alive connections, but waits for ever for a request
that is sent slowly or not at all, and takes every connection it is offered.
:func:`server_config` serves the app with an HTTP protocol that

* closes (with 408) a connection whose request headers have not all arrived
  ``header_timeout_s`` after its first byte (or after it was opened), and one
  whose body has not all arrived ``body_timeout_s`` after the headers;
* keeps at most ``max_connections`` open: one more evicts (with 408) the
  connection that has waited longest on its client (request headers or body
  still arriving, idle keep-alive, or an answer the client does not read), so
  a client holding half-sent requests or unread answers cannot lock others
  out (``/healthz`` keeps answering); when every connection is busy in the
  app, the new one gets 503 and is closed at once. Long-polls and event
  streams, which are busy in the app for as long as they wait, take at most
  ``max_waits`` of them (``_waits.py``): waiting clients alone cannot fill them
  all.

On SIGTERM/SIGINT, open long-polls and event streams are cut after
``shutdown_grace_s`` (a connected dashboard would otherwise keep the process
up for ``max_wait_s``). uvicorn leaves logging alone (``log_config=None``):
its loggers propagate to the handler that
:func:`sidecar._logging.configure_logging` installs, so they share our format
(text or JSON).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ._settings import SidecarSettings

__all__ = ["server_config"]

_log = logging.getLogger("kvsidecar.http")


def _problem_reply(status: int, title: str, detail: str, *headers: str) -> bytes:
    """A whole problem+json answer that closes the connection, as raw bytes (for answers
    given outside the app: the protocol's own refusals)."""
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail})
    head = [
        f"HTTP/1.1 {status} {title}",
        "content-type: application/problem+json",
        "connection: close",
        f"content-length: {len(body)}",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n" + body).encode()


_TIMEOUT_408 = _problem_reply(
    408,
    "Request Timeout",
    "the request's headers or body did not arrive in time (KVSIDECAR_HEADER_TIMEOUT_S, "
    "KVSIDECAR_BODY_TIMEOUT_S); send the whole request at once",
)
_BUSY_503 = _problem_reply(
    503,
    "Service Unavailable",
    "every connection the sidecar keeps (KVSIDECAR_MAX_CONNECTIONS) is busy; retry in a "
    "second, and close connections your clients leave open",
    "retry-after: 1",
)
_BAD_400 = _problem_reply(
    400,
    "Bad Request",
    "the request is not valid HTTP/1.1: check the request line, that a Host header is "
    "sent, and that the body has one Content-Length (digits only) or chunked encoding",
)


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
        self._waiting_since = time.monotonic()  # when it began to wait for request headers

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("header", self.header_timeout_s)
        if len(self.connections) > self.max_connections:
            victim = self._longest_waiting()
            if victim is None:
                _log.warning(
                    "refused a connection: %d are open and busy (KVSIDECAR_MAX_CONNECTIONS)",
                    self.max_connections,
                )
                self._disarm()
                transport.write(_BUSY_503)
                transport.close()
                return
            _log.info(
                "closed a connection from %s that waited longest for its request "
                "(%d connections open, KVSIDECAR_MAX_CONNECTIONS)",
                victim.client,
                self.max_connections,
            )
            victim._expired(victim._stall_kind())

    def _stall_kind(self) -> str:
        """What this connection waits for: "header", "body" (the client's request), or
        "read" (the client does not read the answer: uvicorn paused the writes)."""
        if self._timer_kind is not None:
            return self._timer_kind
        return "read" if self.flow.write_paused else "header"

    def _longest_waiting(self) -> _GuardedH11 | None:
        """The open connection (not this one) waiting longest on its client: headers or a
        body still arriving, an idle keep-alive one, or one whose client does not read
        its answer (a half-sent body or an unread response must not lock others out).
        None when all are busy in the app."""
        waiting = [
            c
            for c in self.connections
            if c is not self
            and isinstance(c, _GuardedH11)
            and (
                c._timer_kind is not None
                or c.timeout_keep_alive_task is not None
                or c.flow.write_paused
            )
            and not c.transport.is_closing()
        ]
        return min(waiting, key=lambda c: c._waiting_since, default=None)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_state()

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot parse: problem+json like every other error (uvicorn: text)."""
        self._disarm()
        self.transport.write(_BAD_400)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._waiting_since = time.monotonic()
        self._disarm()
        self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow_state(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.conn.trailing_data[0] and self._timer_kind != "header":
                self._waiting_since = time.monotonic()
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
        if kind == "read":
            _log.info(
                "closed a connection from %s: its client did not read the answer", self.client
            )
        else:
            _log.info(
                "closed a connection from %s: its request %s did not arrive in time",
                self.client,
                "headers" if kind == "header" else "body",
            )
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if not answering:
            self.transport.write(_TIMEOUT_408)
        self.transport.close()


def server_config(
    app: Any,
    settings: SidecarSettings,
    *,
    host: str | None = None,
    port: int | None = None,
    log_level: str | None = None,
) -> uvicorn.Config:
    """The uvicorn config for ``app`` with this service's limits (see the module doc)."""
    protocol = type(
        "GuardedH11",
        (_GuardedH11,),
        {
            "header_timeout_s": settings.header_timeout_s,
            "body_timeout_s": settings.body_timeout_s,
            "max_connections": settings.max_connections,
        },
    )
    return uvicorn.Config(
        app,
        host=settings.host if host is None else host,
        port=settings.port if port is None else port,
        http=protocol,
        log_level=log_level or settings.log_level,
        access_log=False,
        log_config=None,
        timeout_keep_alive=settings.keepalive_timeout_s,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        lifespan="on",
    )
