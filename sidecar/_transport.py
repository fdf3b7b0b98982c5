"""An httpx transport that sends each request to the unix socket it names.

One shared :class:`httpx.AsyncClient` serves every engine: the request names
its engine's control socket in ``extensions[SOCKET_EXTENSION]`` and this
router hands it to a per-socket :class:`httpx.AsyncHTTPTransport` (kept, so
connections are reused).
"""

from __future__ import annotations

import httpx

__all__ = ["SOCKET_EXTENSION", "UnixSocketRouter"]

SOCKET_EXTENSION = "kvsidecar.unix_socket"
_MAX_SOCKETS = 1024  # forget the oldest transports beyond this many sockets


class UnixSocketRouter(httpx.AsyncBaseTransport):
    """Owns one transport per socket path. Event-loop thread only."""

    def __init__(self) -> None:
        self._transports: dict[str, httpx.AsyncHTTPTransport] = {}

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
                oldest = next(iter(self._transports))
                await self._transports.pop(oldest).aclose()
            transport = self._transports[path] = httpx.AsyncHTTPTransport(uds=path)
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            await transport.aclose()
