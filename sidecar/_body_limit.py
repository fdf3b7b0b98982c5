"""ASGI middleware that caps request bodies (413 before the app sees them)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimitMiddleware"]


class BodyLimitMiddleware:
    """Reads at most ``max_body_bytes`` of each request body, then replays it to the app.

    A body over the cap (by ``Content-Length`` or as streamed) gets a 413
    problem+json and never reaches a route, so nothing is parsed or stored.
    Bodies here are small JSON documents: buffering them costs nothing.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (
                    not value.isdigit() or int(value) > self.max_body_bytes):
                await self._reject(send)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away; let the app see it
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps({
            "type": "about:blank", "title": "Request body too large", "status": 413,
            "detail": f"the request body is larger than {self.max_body_bytes} bytes "
                      "(KVSIDECAR_MAX_BODY_BYTES); send a smaller body",
        }).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]})
        await send({"type": "http.response.body", "body": body})
