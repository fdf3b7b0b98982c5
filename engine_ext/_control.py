"""The control socket: HTTP/1.1 over a unix socket inside the engine process.

``PUT /limit`` publishes into the :class:`LimitMailbox`; ``GET /state``
returns the engine's latest snapshot; ``GET /healthz`` says the socket is up (and, with a
sidecar, which registered process serves it: ``registration``).
The server touches nothing else: no allocator, no prefix cache (the thread
guard would raise if it did). Errors are ``application/problem+json``.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import selectors
import socket
import socketserver
import stat
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from pydantic import ValidationError

from ._errors import EngineExtConfigError
from ._mailbox import LimitMailbox
from .protocol import (
    MAX_SOCKET_PATH_BYTES,
    EngineState,
    LimitBody,
    duplicate_json_key,
    duplicate_key_message,
    socket_path_fits,
)

__all__ = ["MAX_BODY_BYTES", "MAX_CONNECTIONS", "ControlServer"]

_log = logging.getLogger("engine_ext.control")

#: Largest request body accepted; a limit body is a few dozen bytes.
MAX_BODY_BYTES = 64 * 1024
#: A client that sends nothing for this long is dropped; a request (its wait on a kept-alive
#: connection included) must have arrived whole by then, however it trickles in.
_CLIENT_TIMEOUT_S = 10.0
#: Connections served at once (a thread each). The sidecar and kvctl use one or two; a
#: client that leaks connections must not start a thread per connection in the engine.
MAX_CONNECTIONS = 32

_BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/problem+json\r\n"
    b"Connection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 64  # listen backlog: a burst of clients waits, not EAGAIN
    mailbox: LimitMailbox
    registration_mark: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse_busy(request)
            return
        try:
            thread = threading.Thread(
                target=self._serve_one,
                args=(request, client_address),
                name="control-handler",
                daemon=True,
            )
            thread.start()
        except BaseException:
            self._slots.release()
            raise

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-reply is routine; never print tracebacks to stderr.
        _log.debug("control socket request failed", exc_info=True)


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each given only what is left of the handler's deadline: the
    base class's timeout is per read, so a client sending a byte every few seconds would
    hold a handler thread (one of ``MAX_CONNECTIONS``) for ever."""

    def __init__(self, sock: socket.socket, handler: _Handler) -> None:
        super().__init__()
        self._sock = sock
        self._handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._handler.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive whole in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # an answer to a request line that could not be read still has a status line and
    # headers (the base class would answer such a request the HTTP/0.9 way: a bare body)
    default_request_version = "HTTP/1.1"
    timeout = _CLIENT_TIMEOUT_S
    server_version = "kvsidecar-engine"
    _body_read = False  # the current request's body was consumed
    raw_requestline: bytes  # set by the base class before parse_request()

    deadline = 0.0  # monotonic: the current request must have arrived by then

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self))

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + _CLIENT_TIMEOUT_S
        super().handle_one_request()

    def send_response(self, code: int, message: str | None = None) -> None:
        # the answer gets the whole client timeout, not what the request left of it
        self.connection.settimeout(_CLIENT_TIMEOUT_S)
        super().send_response(code, message)

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("control socket: " + format, *args)

    def parse_request(self) -> bool:
        # HTTP/1.x only: the base class takes a two-word line as HTTP/0.9 and then waits
        # for headers the client never sends
        words = self.raw_requestline.split()
        if len(words) != 3 or not words[2].startswith(b"HTTP/1."):
            self.close_connection = True
            line = self.raw_requestline.decode("latin-1").rstrip("\r\n")[:80]
            self.command, self.request_version, self.requestline = "", "HTTP/1.1", line
            self._problem(
                HTTPStatus.BAD_REQUEST, f"cannot read the request line {line!r}: send HTTP/1.1"
            )
            return False
        return bool(super().parse_request())

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's own refusals (an unknown method, a request line or headers too
        long, a bad header) as problem+json like every other answer; the connection closes."""
        self.close_connection = True
        status = HTTPStatus(code)
        if status is HTTPStatus.NOT_IMPLEMENTED:
            detail = (
                f"unsupported method {self.command!r}; this socket serves PUT /limit, "
                "GET /state, GET /healthz"
            )
        else:
            detail = message or status.description
        self._problem(status, detail)

    def do_GET(self) -> None:
        if self._has_body():  # never read: it would be taken for the next request
            self.close_connection = True
        if self.path == "/state":
            self._send_json(HTTPStatus.OK, self.server.mailbox.latest_state.model_dump(mode="json"))
        elif self.path == "/healthz":
            mark = self.server.registration_mark
            self._send_json(
                HTTPStatus.OK,
                {"status": "ok"} if mark is None else {"status": "ok", "registration": mark},
            )
        elif self.path == "/limit":
            self._problem(HTTPStatus.METHOD_NOT_ALLOWED, "use PUT /limit to set a limit")
        else:
            self._not_found()

    def do_PUT(self) -> None:
        body = self._read_body()  # read first: a reply must never leave a body unread
        if body is None:
            return
        if self.path != "/limit":
            self._not_found()
            return
        repeated = duplicate_json_key(body)
        if repeated is not None:
            self._problem(HTTPStatus.UNPROCESSABLE_ENTITY, duplicate_key_message(repeated))
            return
        try:
            req = LimitBody.model_validate_json(body)
        except ValidationError as exc:
            self._problem(HTTPStatus.UNPROCESSABLE_ENTITY, _describe(exc))
            return
        mailbox = self.server.mailbox
        if req.revision is None:
            result = mailbox.publish_next(req.limit)
        else:
            result = mailbox.publish(req.limit, req.revision)
        code = HTTPStatus.OK if result.accepted else HTTPStatus.CONFLICT
        self._send_json(code, _state_json(result.state))

    def do_POST(self) -> None:
        if self._read_body() is not None:
            self._wrong_method()

    def do_DELETE(self) -> None:
        if self._read_body(required=False) is not None:
            self._wrong_method()

    do_PATCH = do_OPTIONS = do_DELETE

    def do_HEAD(self) -> None:
        self.close_connection = True  # the answer has a body, which a HEAD client does not read
        self._wrong_method()

    def _has_body(self) -> bool:
        return bool(self.headers.get("Transfer-Encoding")) or self.headers.get(
            "Content-Length", "0"
        ).strip() not in ("", "0")

    def _wrong_method(self) -> None:
        if self.path in ("/limit", "/state", "/healthz"):
            self._problem(
                HTTPStatus.METHOD_NOT_ALLOWED, "use PUT /limit, GET /state or GET /healthz"
            )
        else:
            self._not_found()

    def _not_found(self) -> None:
        self._problem(
            HTTPStatus.NOT_FOUND,
            f"no such path {self.path!r}; this socket serves PUT /limit, GET /state, GET /healthz",
        )

    def _read_body(self, *, required: bool = True) -> bytes | None:
        """The request body, or None after answering 411/413 (connection then closed)."""
        self._body_read = True
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            self._problem(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length header")
            return None
        values = {v.strip() for v in self.headers.get_all("Content-Length", [])}
        if not values and not required:
            return b""
        if not values:
            self.close_connection = True
            self._problem(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length header")
            return None
        raw = values.pop()
        if values or not (raw.isascii() and raw.isdigit()):  # no sign, "_", or a second value
            self.close_connection = True
            self._problem(
                HTTPStatus.BAD_REQUEST,
                "Content-Length must be one byte count in ASCII digits, sent once; "
                f"got {sorted(values | {raw})!r}",
            )
            return None
        length = int(raw)
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read: the connection cannot be reused
            self._problem(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body has {length} bytes; a limit body may have at most "
                f"{MAX_BODY_BYTES} bytes (64 KiB)",
            )
            return None
        return self.rfile.read(length)

    def _problem(self, code: HTTPStatus, detail: str) -> None:
        body = {"type": "about:blank", "title": code.phrase, "status": int(code), "detail": detail}
        self._send_json(code, body, content_type="application/problem+json")

    def _send_json(
        self, code: HTTPStatus, body: Any, *, content_type: str = "application/json"
    ) -> None:
        if self.command != "GET" and not self._body_read:
            self.close_connection = True  # an unread body would be parsed as the next request
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self._body_read = False


def _refuse_busy(request: socket.socket) -> None:
    """Answer 503 and close, on the server thread: never blocks (a full send buffer or a
    client gone drops the answer, not the server)."""
    detail = (
        f"the control socket already serves {MAX_CONNECTIONS} connections; close idle ones "
        "(a client that opens a connection per request and never closes it) and retry"
    )
    body = json.dumps(
        {"type": "about:blank", "title": "Service Unavailable", "status": 503, "detail": detail}
    ).encode()
    try:
        request.setblocking(False)
        request.send(_BUSY_ANSWER % (len(body), body))
    except OSError:
        pass
    finally:
        request.close()


def _state_json(state: EngineState) -> dict[str, Any]:
    return state.model_dump(mode="json")


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"field {field!r}: {err['msg']}")
    return "; ".join(parts)


class ControlServer:
    """Serves the control socket on its own daemon thread.

    Owns the listening socket file (mode 0600), its server thread and a
    shutdown pipe: the thread blocks in ``select`` on the socket and the pipe
    (no polling, no wake-up while idle). The directory holding the socket
    must exist; :class:`ElasticInstance` creates
    it with mode 0700. ``start()``/``stop()`` from the thread that owns the
    instance; handlers run on threads named ``control-handler`` and touch only
    the mailbox.
    """

    def __init__(
        self, socket_path: str, mailbox: LimitMailbox, registration_mark: str | None = None
    ) -> None:
        if not socket_path_fits(socket_path):
            raise EngineExtConfigError(
                f"control socket path {socket_path!r} is longer than {MAX_SOCKET_PATH_BYTES} bytes; "
                "set KVSIDECAR_RUNTIME_DIR to a shorter directory"
            )
        self.socket_path = socket_path
        self._mailbox = mailbox
        #: shown by ``GET /healthz``: which registered process serves this socket
        #: (:func:`~engine_ext.protocol.registration_mark`); None without a sidecar
        self.registration_mark = registration_mark
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._wake_w = -1  # write end of the shutdown pipe (-1: not serving)

    def start(self) -> None:
        """Bind the socket (0600) and serve on a daemon thread. Idempotent."""
        if self._server is not None:
            return
        _clear_stale_socket(self.socket_path)
        server = _Server(self.socket_path, _Handler, bind_and_activate=False)
        server.mailbox = self._mailbox
        server.registration_mark = self.registration_mark
        try:
            server.server_bind()
            os.chmod(self.socket_path, 0o600)
            server.server_activate()
        except OSError as exc:
            server.server_close()
            raise EngineExtConfigError(
                f"cannot serve the control socket at {self.socket_path!r}: {exc}"
            ) from exc
        wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._server = server
        self._thread = threading.Thread(
            target=_serve, args=(server, wake_r), name="control-server", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and remove the socket file. Idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        # the file first: a process that is being killed (vLLM ends its EngineCore right
        # after SIGTERM) must not leave it behind
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        wake_w, self._wake_w = self._wake_w, -1
        try:
            os.write(wake_w, b"x")  # the server thread returns from select and exits
        finally:
            os.close(wake_w)
        if self._thread is not None:
            self._thread.join(timeout=5)
        server.server_close()


#: accept() errors that last while the process is short of a resource: the connection
#: stays in the backlog and the socket readable, so retrying at once would spin
_SHORT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

#: seconds between accept() attempts while short of descriptors or memory
ACCEPT_RETRY_S = 0.1


def _serve(server: _Server, wake_r: int) -> None:
    """Accept connections until a byte arrives on ``wake_r`` (the server thread's loop)."""
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(server.socket, selectors.EVENT_READ)
            selector.register(wake_r, selectors.EVENT_READ)
            short = False  # accept() failed for want of descriptors or memory
            while True:
                # blocks: no timeout, nothing runs while idle (while short: a retry timer)
                ready = selector.select(ACCEPT_RETRY_S if short else None)
                if any(key.fileobj == wake_r for key, _ in ready):
                    return
                if short and not ready:  # the timer: listen again, try one accept
                    selector.register(server.socket, selectors.EVENT_READ)
                    continue
                try:
                    request, address = server.get_request()
                except OSError as exc:
                    if exc.errno in _SHORT_OF_RESOURCES:
                        if not short:
                            _log.warning(
                                "control socket: cannot accept a connection (%s); retrying "
                                "every %.1f s. Raise the engine's descriptor limit (ulimit -n) "
                                "if this lasts",
                                os.strerror(exc.errno),
                                ACCEPT_RETRY_S,
                            )
                        short = True
                        selector.unregister(server.socket)
                    continue  # else the client went away between select and accept
                if short:
                    short = False
                    _log.info("control socket: accepting connections again")
                try:
                    server.process_request(request, address)
                except Exception:  # noqa: BLE001 -- one bad connection must not stop serving
                    server.handle_error(request, address)
                    server.shutdown_request(request)
    finally:
        os.close(wake_r)


def _clear_stale_socket(path: str) -> None:
    """Remove a socket left by a dead process; refuse if a live one answers."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise EngineExtConfigError(
            f"{path!r} exists and is not a socket; remove it or pick another"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover from a crash
        return
    finally:
        probe.close()
    raise EngineExtConfigError(
        f"another engine already serves {path!r}; give this instance its own KVSIDECAR_INSTANCE_ID"
    )
