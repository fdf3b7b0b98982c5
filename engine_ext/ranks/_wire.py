"""Framing of the rank channel: length-prefixed JSON over a unix stream socket.

Every message is a JSON object preceded by its length (4 bytes, big endian).
Scheduler -> rank: ``{"op": ..., "seq": n, ...}``; rank -> scheduler: the ack
``{"seq": n, "finished_step": e, "mapped_bytes": b, "mapped_pages": k}`` or,
once, the hello ``{"hello": rank, "pid": pid}``. One socket per rank keeps the
messages of that rank in order.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from engine_ext._errors import EngineExtError

__all__ = ["MAX_MESSAGE_BYTES", "RankChannelError", "recv_message", "send_message"]

#: A step's writes for a long prompt fit comfortably; anything larger is a bug.
MAX_MESSAGE_BYTES = 64 << 20
_HEADER = struct.Struct(">I")


class RankChannelError(EngineExtError):
    """The rank channel broke: a peer sent garbage, or a rank cannot be reached."""


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one message (blocking). Raises ``OSError`` if the peer is gone."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise RankChannelError(f"a rank message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """Receive one message; ``None`` on a clean end of stream before a header."""
    header = _recv_exact(sock, _HEADER.size, allow_eof=True)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise RankChannelError(
            f"a peer announced a {length}-byte message; the limit is "
            f"{MAX_MESSAGE_BYTES}: is something else on the rank socket?"
        )
    body = _recv_exact(sock, length, allow_eof=False)
    assert body is not None
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise RankChannelError(f"a peer sent a message that is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise RankChannelError("a peer sent a JSON message that is not an object")
    return message


def _recv_exact(sock: socket.socket, count: int, *, allow_eof: bool) -> bytes | None:
    chunks: list[bytes] = []
    remaining = count
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            if allow_eof and remaining == count:
                return None
            raise RankChannelError("the peer closed the rank socket in the middle of a message")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
