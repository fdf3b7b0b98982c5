"""An httpx transport that sends each request to the unix socket it names.

One shared :class:`httpx.AsyncClient` serves every engine: the request names
its engine's control socket in ``extensions[SOCKET_EXTENSION]`` and this
router hands it to a per-socket :class:`httpx.AsyncHTTPTransport` (kept, so
connections are reused). The transports share one SSL context (a unix socket
never speaks TLS, and each context costs ~0.8 MiB), and only the most recently
used ones are kept: engines come and go (a new pod, a new socket path), and a
kept transport holds its connection to a dead engine open.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import OrderedDict
from functools import cache
from typing import Any

import httpx

from engine_ext.protocol import MAX_REPLY_BYTES

__all__ = [
    "SOCKET_EXTENSION",
    "ReplyTooLarge",
    "UnixSocketRouter",
    "bounded_exchange",
    "unix_transport",
]

SOCKET_EXTENSION = "kvsidecar.unix_socket"
_MAX_SOCKETS = 64  # close the least recently used transports beyond this many sockets


@cache
def _ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def unix_transport(path: str) -> httpx.AsyncHTTPTransport:
    """A transport to the unix socket ``path`` (sharing the one SSL context)."""
    return httpx.AsyncHTTPTransport(uds=path, verify=_ssl_context())


class UnixSocketRouter(httpx.AsyncBaseTransport):
    """Owns one transport per socket path. Event-loop thread only."""

    def __init__(self) -> None:
        self._transports: OrderedDict[str, httpx.AsyncHTTPTransport] = OrderedDict()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.extensions.get(SOCKET_EXTENSION)
        if not isinstance(path, str):
            raise httpx.UnsupportedProtocol(
                f"request to {request.url} names no unix socket in "
                f"extensions[{SOCKET_EXTENSION!r}]",
                request=request,
            )
        transport = self._transports.get(path)
        if transport is None:
            if len(self._transports) >= _MAX_SOCKETS:
                _, oldest = self._transports.popitem(last=False)
                await oldest.aclose()
            transport = self._transports[path] = unix_transport(path)
        else:
            self._transports.move_to_end(path)
        return await transport.handle_async_request(request)

    async def forget(self, path: str) -> None:
        """Close the transport to ``path`` (its engine was forgotten or moved)."""
        transport = self._transports.pop(path, None)
        if transport is not None:
            await transport.aclose()

    async def aclose(self) -> None:
        transports, self._transports = list(self._transports.values()), OrderedDict()
        for transport in transports:
            await transport.aclose()


class ReplyTooLarge(Exception):
    """An engine's answer passed :data:`MAX_REPLY_BYTES` (read no further)."""


async def bounded_exchange(
    client: httpx.AsyncClient, method: str, url: str, *, timeout_s: float, **kwargs: Any
) -> tuple[int, bytes]:
    """One request to an engine: the status and the whole answer, read within
    ``timeout_s`` in all and up to :data:`MAX_REPLY_BYTES`. httpx's timeout is per read:
    a socket sending a byte now and then would hold the caller for ever, and one
    streaming without end would fill the sidecar's memory. Raises ``TimeoutError``,
    :class:`ReplyTooLarge` or ``httpx.HTTPError``."""
    async with asyncio.timeout(timeout_s):
        async with client.stream(method, url, timeout=timeout_s, **kwargs) as resp:
            content = bytearray()
            async for chunk in resp.aiter_bytes():
                content += chunk
                if len(content) > MAX_REPLY_BYTES:
                    raise ReplyTooLarge(f"the answer passed {MAX_REPLY_BYTES} bytes")
            return resp.status_code, bytes(content)
