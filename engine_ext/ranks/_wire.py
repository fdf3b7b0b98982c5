"""Framing of the rank channel: length-prefixed binary frames over a unix stream socket.

Every frame is a body preceded by its length (4 bytes, big endian). One
socket per rank keeps the frames of that rank in order. Both ends run on one
host, so bodies use the native byte order.

* rank -> scheduler, once: the hello, a JSON object ``{"hello": rank, "pid": pid}``
  (:func:`send_message`; read with a :class:`FrameReader` over :func:`decode_message`
  capped to a small size, or :func:`recv_message`);
* scheduler -> rank: an op, :data:`OP_HEAD` (op code, seq, one integer
  argument, a count) then its payload: ``map``/``unmap`` the pages (int32;
  ``unmap``'s argument is ``after_step``), ``step`` the blocks, offsets and
  values of its KV writes (3 x count int32; the argument is the step),
  ``setup`` a JSON object, ``probe``/``stop`` nothing;
* rank -> scheduler: the ack, :data:`ACK` (seq, finished_step, mapped_bytes,
  mapped_pages).

The ops a step sends are tiny binary frames, not JSON: encoding and parsing
JSON was most of the Python time of a one-page round trip. Several frames may
travel in one ``send`` (the scheduler sends a pass's unmaps and the next
``map`` together; a rank acks everything it read in one go) and a frame may
arrive in pieces: :class:`FrameReader` reads whatever is there with one
``recv`` and returns every complete frame, decoded.
"""

from __future__ import annotations

import json
import socket
import struct
from array import array
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, NoReturn, TypeVar

from engine_ext._errors import EngineExtError

__all__ = [
    "ACK",
    "MAX_MESSAGE_BYTES",
    "OP_HEAD",
    "Ack",
    "FrameReader",
    "RankChannelError",
    "StreamCutError",
    "decode_ack",
    "decode_message",
    "decode_op",
    "encode_ack",
    "encode_op",
    "recv_message",
    "send_message",
]

#: A step's writes for a long prompt fit comfortably; anything larger is a bug.
MAX_MESSAGE_BYTES = 64 << 20
_HEADER = struct.Struct(">I")
#: An op: code, seq, argument (after_step / step / 0), count of int32 items that follow.
OP_HEAD = struct.Struct("=BqqI")
#: An ack: seq, finished_step, mapped_bytes, mapped_pages.
ACK = struct.Struct("=qqqq")
_RECV_BYTES = 1 << 16  # one recv takes this much at most (an ack is 36 bytes)
_CODES = {"setup": 1, "map": 2, "unmap": 3, "step": 4, "probe": 5, "stop": 6}
_NAMES = {code: name for name, code in _CODES.items()}
_STEP_ARRAYS = ("blocks", "offsets", "values")
_encoder = json.JSONEncoder(separators=(",", ":"))

T = TypeVar("T")


class RankChannelError(EngineExtError):
    """The rank channel broke: a peer sent garbage, or a rank cannot be reached."""


class StreamCutError(RankChannelError):
    """The peer ended its stream in the middle of a frame (it closed or died while sending)."""


class Ack(NamedTuple):
    """What a rank reports after applying op ``seq`` in its own address space."""

    seq: int
    finished_step: int
    mapped_bytes: int  # counted from its own successful mprotects
    mapped_pages: int


# -- frames ------------------------------------------------------------------------------
def _frame(body: bytes) -> bytes:
    if len(body) > MAX_MESSAGE_BYTES:
        raise RankChannelError(f"a rank message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def encode_op(op: str, seq: int, fields: Mapping[str, Any]) -> bytes:
    """One op frame, ready to send to any number of ranks."""
    code = _CODES.get(op)
    if code is None:
        raise RankChannelError(f"unknown rank op {op!r}; known: {', '.join(_CODES)}")
    try:
        if op in ("map", "unmap"):
            pages = array("i", fields["pages"])
            arg = int(fields["after_step"]) if op == "unmap" else 0
            return _frame(OP_HEAD.pack(code, seq, arg, len(pages)) + pages.tobytes())
        if op == "step":
            columns = [array("i", fields[name]) for name in _STEP_ARRAYS]
            count = len(columns[0])
            if any(len(c) != count for c in columns):
                raise RankChannelError("a step needs as many offsets and values as blocks")
            head = OP_HEAD.pack(code, seq, int(fields["step"]), count)
            return _frame(head + b"".join(c.tobytes() for c in columns))
        if op == "setup":
            return _frame(OP_HEAD.pack(code, seq, 0, 0) + _encoder.encode(dict(fields)).encode())
    except (KeyError, TypeError, OverflowError) as exc:
        raise RankChannelError(f"bad fields for rank op {op!r}: {exc!r}") from None
    return _frame(OP_HEAD.pack(code, seq, 0, 0))


def decode_op(body: bytes) -> dict[str, Any]:
    """An op frame's body as ``{"op": name, "seq": n, ...fields}``."""
    if len(body) < OP_HEAD.size:
        raise RankChannelError(f"a rank op of {len(body)} bytes is shorter than its header")
    code, seq, arg, count = OP_HEAD.unpack_from(body)
    op = _NAMES.get(code)
    if op is None:
        raise RankChannelError(f"unknown rank op code {code}: is something else on the socket?")
    payload = memoryview(body)[OP_HEAD.size :]
    message: dict[str, Any] = {"op": op, "seq": seq}
    if op == "setup":
        message.update(decode_message(bytes(payload)))
        return message
    width = {"map": 1, "unmap": 1, "step": 3}.get(op, 0)
    if len(payload) != 4 * width * count:
        raise RankChannelError(
            f"rank op {op} #{seq} announces {count} items but carries {len(payload)} bytes"
        )
    if op == "step":
        ints = payload.cast("i")
        message["step"] = arg
        for i, name in enumerate(_STEP_ARRAYS):
            message[name] = ints[i * count : (i + 1) * count].tolist()
    elif width:
        message["pages"] = payload.cast("i").tolist()
        if op == "unmap":
            message["after_step"] = arg
    return message


def encode_ack(ack: Ack) -> bytes:
    return _HEADER.pack(ACK.size) + ACK.pack(*ack)


def decode_ack(body: bytes) -> tuple[int, int, int, int]:
    """An ack frame's body as the plain tuple of :class:`Ack`'s fields (cheaper to build)."""
    if len(body) != ACK.size:
        raise RankChannelError(f"an ack of {len(body)} bytes (expected {ACK.size})")
    fields: tuple[int, int, int, int] = ACK.unpack(body)
    return fields


class FrameReader(Generic[T]):
    """Reassembles the frames of one socket. Owns the bytes of a partial frame.

    :meth:`feed` does exactly one ``recv`` (it blocks only if nothing is
    there: call it when the socket is readable; on a non-blocking socket with
    nothing there it raises ``BlockingIOError``) and returns every frame
    completed by it, decoded, in order; :meth:`read` blocks until at least
    one is complete. Never holds a complete frame back, so a readable socket
    is the only sign that something is left to read. A frame announced longer
    than ``max_frame_bytes`` is refused (``RankChannelError``) before its body
    is read. One reader per socket; whoever calls it must hold that socket's
    read side alone.
    """

    def __init__(
        self,
        sock: socket.socket,
        decode: Callable[[bytes], T],
        *,
        max_frame_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.sock = sock
        self._decode = decode
        self._max = max_frame_bytes
        self._chunks: list[bytes] = []  # bytes received but not yet a complete frame
        self._have = 0  # their total length
        self._need = _HEADER.size  # bytes needed before the next frame can complete

    @property
    def buffered(self) -> int:
        """Bytes received that are not part of a complete frame yet (0: between frames)."""
        return self._have

    def feed(self) -> list[T] | None:
        """One ``recv``; the frames it completed (maybe none); ``None`` at a clean end of stream."""
        want = self._need - self._have
        chunk = self.sock.recv(_RECV_BYTES if want <= _RECV_BYTES else min(want, 1 << 20))
        if not chunk:
            if self._have:
                raise StreamCutError("the peer closed the rank socket in the middle of a message")
            return None
        if self._have:  # the rest of a frame that came in pieces: join once, when complete
            self._chunks.append(chunk)
            self._have += len(chunk)
            if self._have < self._need:
                return []
            chunk = b"".join(self._chunks)
        out: list[T] = []
        decode, unpack_from, header, limit = (
            self._decode,
            _HEADER.unpack_from,
            _HEADER.size,
            self._max,
        )
        start, end = 0, len(chunk)
        while end - start >= header:
            (length,) = unpack_from(chunk, start)
            if length > limit:
                _refuse_length(length, limit)
            stop = start + header + length
            if stop > end:
                self._chunks, self._have, self._need = [chunk[start:]], end - start, header + length
                return out
            out.append(decode(chunk[start + header : stop]))
            start = stop
        if start < end:  # part of a header
            self._chunks, self._have, self._need = [chunk[start:]], end - start, header
        elif self._have:
            self._chunks, self._have, self._need = [], 0, header
        return out

    def read(self) -> list[T] | None:
        """Block until at least one frame is complete; ``None`` at a clean end of stream."""
        while True:
            frames = self.feed()
            if frames is None or frames:
                return frames


# -- the JSON hello ------------------------------------------------------------------------
def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one JSON message (the hello). Raises ``OSError`` if the peer is gone."""
    sock.sendall(_frame(_encoder.encode(message).encode()))


def recv_message(sock: socket.socket) -> dict[str, Any] | None:
    """Receive exactly one JSON message (no read-ahead); ``None`` on a clean end of stream."""
    header = _recv_exact(sock, _HEADER.size, allow_eof=True)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    _check_length(length)
    body = _recv_exact(sock, length, allow_eof=False)
    assert body is not None
    return decode_message(body)


def _check_length(length: int) -> None:
    if length > MAX_MESSAGE_BYTES:
        _refuse_length(length, MAX_MESSAGE_BYTES)


def _refuse_length(length: int, limit: int) -> NoReturn:
    raise RankChannelError(
        f"a peer announced a {length}-byte message; the limit is "
        f"{limit}: is something else on the rank socket?"
    )


def decode_message(body: bytes) -> dict[str, Any]:
    """A JSON frame's body (the hello, a ``setup``'s fields) as the object it must be."""
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
