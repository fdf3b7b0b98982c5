"""ASGI middleware that checks the token, then caps the body (401/413 before the app) and
refuses a JSON body that gives one key twice (422)."""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_ext.protocol import duplicate_json_key, duplicate_key_message

__all__ = ["BodyLimitMiddleware"]


_READS = frozenset({"GET", "HEAD", "OPTIONS"})  # need no token


class BodyLimitMiddleware:
    """Checks the bearer token of mutating requests, then reads at most
    ``max_body_bytes`` of the body and replays it to the app.

    The token is checked on the headers alone, before a byte of the body is
    read: a client without it gets 401 and the connection is closed, so it
    cannot hold the server busy with bodies. (The routes check it again, for
    the schema.) A body over the cap (by ``Content-Length`` or as streamed)
    gets a 413 problem+json and never reaches a route, so nothing is parsed or
    stored. Bodies here are small JSON documents: buffering them costs nothing.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, token: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._token = None if token is None else token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._token is not None and scope["method"] not in _READS:
            problem = self._auth_problem(scope)
            if problem is not None:
                await self._send(
                    send,
                    401,
                    "Unauthorized",
                    problem,
                    [(b"www-authenticate", b'Bearer realm="kvsidecar"')],
                )
                return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (
                not value.isdigit() or int(value) > self.max_body_bytes
            ):
                await self._reject(send)
                return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away (or timed out): a partial body is never used
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        repeated = duplicate_json_key(body)
        if repeated is not None:  # json.loads would keep the last one: refuse the ambiguity
            await self._send(send, 422, "Invalid input", f"body: {duplicate_key_message(repeated)}")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _auth_problem(self, scope: Scope) -> str | None:
        assert self._token is not None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer" and secrets.compare_digest(
                    credentials.strip(), self._token
                ):
                    return None
                if scheme.lower() == b"bearer":
                    return "the bearer token is wrong; use the sidecar's KVSIDECAR_TOKEN"
        return (
            "this sidecar requires a bearer token: send 'Authorization: Bearer <token>' "
            "(kvctl --token or KVSIDECAR_TOKEN)"
        )

    async def _reject(self, send: Send) -> None:
        await self._send(
            send,
            413,
            "Request body too large",
            f"the request body is larger than {self.max_body_bytes} bytes "
            "(KVSIDECAR_MAX_BODY_BYTES); send a smaller body",
        )

    @staticmethod
    async def _send(
        send: Send,
        status: int,
        title: str,
        detail: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        body = json.dumps(
            {"type": "about:blank", "title": title, "status": status, "detail": detail}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/problem+json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                    *(extra or []),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
