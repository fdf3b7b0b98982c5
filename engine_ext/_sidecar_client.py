"""The engine's client of the sidecar: register, report, heartbeat; never on the engine thread."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from ._errors import EngineExtContractError
from ._mailbox import LimitMailbox
from ._settings import EngineSettings
from .protocol import (
    MAX_REPLY_BYTES,
    REGISTRATION_HEADER,
    EngineState,
    RegisterBody,
    RegisterReply,
    Status,
)

__all__ = ["SidecarClient"]

#: What a report must carry at once when it changes (see :meth:`SidecarClient.report`)
_Key = tuple[Status, int, str | None, str | None]

_log = logging.getLogger("engine_ext.sidecar_client")

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0
_REQUEST_TIMEOUT_S = 5.0
_DEREGISTER_TIMEOUT_S = 2.0  # a clean shutdown waits at most this long for the sidecar
#: stop() waits this long for the client thread to end its call and deregister; past it the
#: engine goes on shutting down (a call whose host name does not resolve is not bounded by
#: httpx's timeouts: name resolution has none)
_STOP_WAIT_S = _DEREGISTER_TIMEOUT_S + 0.5


class SidecarClient:
    """Talks to the sidecar on its own daemon thread (``sidecar-client``).

    Owns one ``httpx.Client``, the registered flag and the newest state not
    sent yet. Only the client thread does network I/O: ``register_blocking``
    starts it and waits (bounded) for its registration, ``stop`` waits
    (bounded) for its deregistration, so a sidecar whose host name hangs in
    the resolver holds neither the engine's start nor its shutdown longer than
    said. ``report`` may be called from the engine thread: it stores the state
    (latest wins) and returns at once.

    Retained limits from the sidecar are *published* into the mailbox like
    any other source, so revisions decide what wins.

    Each process draws a random registration token, sent with every
    register/report/deregister: the sidecar refuses a second live process
    that claims the same instance id. :meth:`stop` deregisters (status
    ``stopped``) when the instance was registered.
    """

    def __init__(
        self,
        settings: EngineSettings,
        mailbox: LimitMailbox,
        register_body_factory: Callable[[], RegisterBody],
        *,
        instance_id: str,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if settings.sidecar_url is None:
            raise ValueError("SidecarClient needs settings.sidecar_url")
        self.registration_token = secrets.token_urlsafe(24)  # this process, for the sidecar
        headers = {REGISTRATION_HEADER: self.registration_token}
        if settings.token is not None:
            headers["Authorization"] = f"Bearer {settings.token.get_secret_value()}"
        self._client = httpx.Client(
            base_url=f"{settings.sidecar_url}/instances/{instance_id}",
            headers=headers,
            timeout=_REQUEST_TIMEOUT_S,
            transport=transport,
            # keep the heartbeat's connection across intervals (httpx's 5 s default equals
            # the default heartbeat, so every beat reconnected); the sidecar keeps idle
            # connections for 75 s (sidecar/cli.py), and one it closed is simply replaced
            limits=httpx.Limits(keepalive_expiry=2 * settings.heartbeat_s + 1),
        )
        self._mailbox = mailbox
        self._body = register_body_factory
        self._heartbeat_s = settings.heartbeat_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._joined = threading.Event()  # registered once (register_blocking waits on it)
        self._life = threading.Lock()  # start() and stop() hand the thread over under it
        self._unsent: EngineState | None = None
        self._interval_s = settings.report_interval_s
        self._sent_key: _Key | None = None  # _key() of the last state the sidecar took
        self._sent_at = float("-inf")  # when the last report was sent (monotonic)
        self._pacing = False  # the client thread waits out the interval for _unsent
        self._registered = False
        # a report was taken (200) since the last registration: a 404 then means the
        # sidecar forgot this instance (kvctl forget, retention), not that /report goes
        # somewhere the registration did not
        self._reported_since_register = False
        self._healthy = True  # last call succeeded (only for logging transitions)
        self._thread: threading.Thread | None = None

    @property
    def registered(self) -> bool:
        """Whether the sidecar acknowledged this instance (since the last 404)."""
        return self._registered

    def register_blocking(self, timeout_s: float) -> bool:
        """Start the client thread, which registers (retrying with backoff) and publishes
        the retained limit; wait for that at most ``timeout_s``.

        Returns whether registration succeeded in that time. Otherwise the client
        thread keeps trying; the engine runs unlimited meanwhile.
        """
        self.start()
        if self._joined.wait(timeout_s) and not self._stop.is_set():
            return True
        if not self._stop.is_set():
            _log.warning(
                "the sidecar did not answer within %.1fs; starting without its retained "
                "limit and registering in the background",
                timeout_s,
            )
        return False

    def report(self, state: EngineState) -> None:
        """Queue ``state`` for the sidecar (latest wins); never blocks.

        A change of status, revision, reason or waiting reason is sent at once; one
        of figures alone (mapped bytes, evictable/pinned, demand counts) at most every
        ``report_interval_s`` after the last report, the latest state then. While
        the client thread waits out that interval, a figures-only report costs a
        lock and a compare here (no wake-up of the client thread).
        """
        with self._lock:
            self._unsent = state
            wake = not self._pacing or _key(state) != self._sent_key
        if wake:
            self._wake.set()

    def start(self) -> None:
        """Start the client thread (registers if not registered, then reports). Idempotent;
        nothing after :meth:`stop`."""
        with self._life:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="sidecar-client", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread, which deregisters (a clean shutdown) and closes the HTTP client;
        wait for it at most ``_STOP_WAIT_S``. Idempotent."""
        self._stop.set()
        self._wake.set()
        self._joined.set()  # a register_blocking() in another thread returns
        with self._life:  # a start() racing this one either ran or never will
            thread = self._thread
        if thread is None:
            self._client.close()
            return
        thread.join(timeout=_STOP_WAIT_S)
        if thread.is_alive():
            _log.info(
                "the sidecar did not answer within %.1fs at shutdown; going on without "
                "deregistering (it will show the instance unreachable)",
                _STOP_WAIT_S,
            )

    def _deregister(self) -> None:
        """Tell the sidecar this engine stopped on purpose (``stopped``, not ``unreachable``)."""
        try:
            response = _bounded_post(self._client, "/deregister", timeout_s=_DEREGISTER_TIMEOUT_S)
        except httpx.HTTPError as exc:
            _log.info(
                "could not deregister from the sidecar (%s); it will show the instance unreachable",
                exc,
            )
            return
        self._registered = False
        if response.status_code >= 300:
            _log.info(
                "the sidecar answered %d to the deregistration: %s",
                response.status_code,
                response.text[:200],
            )

    # -- client thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._talk()
            if self._registered:
                self._deregister()
        finally:
            self._client.close()

    def _talk(self) -> None:
        delay = _BACKOFF_FIRST_S
        while not self._stop.is_set():
            ok = self._attempt(self._report_once if self._registered else self._register)
            if not ok:
                self._stop.wait(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S, self._heartbeat_s)
                continue
            if self._reported_since_register:  # a registration alone proves too little
                delay = _BACKOFF_FIRST_S
            if not self._registered:
                continue  # the sidecar forgot us (404): register again at once
            self._wait_for_next_report()

    def _attempt(self, call: Callable[[], bool]) -> bool:
        """``call()``; a bug in it (an exception no answer should cause) is logged with its
        traceback and counts as a failed attempt, retried with backoff: it must neither
        stop the engine's start nor end this thread (reports, heartbeats, pulled limits)."""
        try:
            return call()
        except Exception:  # noqa: BLE001 -- logged with its traceback, then retried
            _log.exception("kvsidecar: talking to the sidecar failed unexpectedly; retrying")
            return False

    def _wait_for_next_report(self) -> None:
        """Until a report is due: a state whose status, revision or reasons moved at once,
        one whose figures alone moved ``report_interval_s`` after the last report, and
        the heartbeat after ``heartbeat_s`` without anything to send."""
        beat_at = time.monotonic() + self._heartbeat_s
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                state = self._unsent
                due = beat_at
                if state is not None:
                    due = (
                        now
                        if _key(state) != self._sent_key
                        else min(beat_at, self._sent_at + self._interval_s)
                    )
                self._pacing = state is not None and due > now
            if due <= now:
                return
            # a report that arrives now sets the event unless it can wait for ``due``
            # (_pacing); the loop reads _unsent again after every wake-up
            self._wake.wait(due - now)
            self._wake.clear()

    def _register(self) -> bool:
        body = self._body().model_copy(update={"registration_token": self.registration_token})
        response = self._post("/register", body.model_dump_json())
        if response is None:
            return False
        if response.status_code >= 300:
            if response.status_code == 409:  # another live process holds this id: say so loudly
                _log.error("the sidecar refused this engine's registration: %s", _detail(response))
            self._log_failure(f"register answered {response.status_code}: {_detail(response)}")
            return False
        self._registered = True
        self._reported_since_register = False
        self._adopt(response)
        self._joined.set()  # after the retained limit is in the mailbox
        with self._lock:  # report at once: the state may have moved since the body was built
            if self._unsent is None:
                self._unsent = self._mailbox.latest_state
            self._sent_key = None
        _log.info("registered with the sidecar")
        return True

    def _report_once(self) -> bool:
        with self._lock:
            state, self._unsent = self._unsent, None
            self._pacing = False
        if state is None:
            state = self._mailbox.latest_state  # heartbeat: the latest snapshot
        self._sent_at = time.monotonic()
        response = self._post("/report", state.model_dump_json())
        if response is None or (response.status_code >= 300 and response.status_code != 404):
            if response is not None:
                self._log_failure(f"report answered {response.status_code}: {_detail(response)}")
            with self._lock:
                if self._unsent is None:
                    self._unsent = state  # resend unless something newer arrived
            return False
        if response.status_code == 404:
            self._registered = False
            with self._lock:
                if self._unsent is None:
                    self._unsent = state
            if not self._reported_since_register:
                # unknown right after its registration: /report reaches another server
                # than /register did (several sidecars behind one address, a proxy). Again
                # at once, the two calls would loop as fast as the network answers
                self._log_failure(
                    "the sidecar answered 404 to the first report after registering "
                    "(is KVSIDECAR_SIDECAR_URL one sidecar, not several behind one address "
                    "or a proxy that sends /report elsewhere?); registering again"
                )
                return False
            _log.info("the sidecar does not know this instance any more; registering again")
            return True
        self._reported_since_register = True
        with self._lock:
            self._sent_key = _key(state)
        self._adopt(response)  # the reply carries the desired limit: a pull fallback for pushes
        return True

    def _adopt(self, response: httpx.Response) -> None:
        """Publish the desired limit of a register/report reply, if it is newer than ours."""
        try:
            reply = RegisterReply.model_validate_json(response.content)
        except ValidationError as exc:
            _log.warning("the sidecar's reply is not a RegisterReply (%s); ignored", exc)
            return
        if reply.revision > self._mailbox.revision:
            try:
                result = self._mailbox.publish(reply.limit, reply.revision)
            except EngineExtContractError as exc:
                # a sidecar bug must not end this thread: keep the current limit, keep reporting
                _log.warning("the sidecar's retained limit cannot be taken (%s); ignored", exc)
                return
            if result.status in (Status.STALE, Status.CONFLICT):
                _log.warning("retained limit from the sidecar rejected: %s", result.message)

    def _post(self, path: str, content: str) -> httpx.Response | None:
        try:
            response = _bounded_post(
                self._client,
                path,
                content=content,
                headers={"Content-Type": "application/json"},
                timeout_s=_REQUEST_TIMEOUT_S,
            )
        except httpx.HTTPError as exc:
            self._log_failure(f"cannot reach the sidecar: {exc}")
            return None
        if not self._healthy:
            _log.info("the sidecar answers again")
            self._healthy = True
        return response

    def _log_failure(self, message: str) -> None:
        if self._healthy:
            _log.warning("%s; retrying with backoff", message)
            self._healthy = False


class ReplyTooLarge(httpx.HTTPError):
    """The sidecar's answer passed :data:`MAX_REPLY_BYTES` (read no further)."""


def _bounded_post(
    client: httpx.Client,
    path: str,
    *,
    timeout_s: float,
    content: str | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST and read the whole answer within ``timeout_s`` in all and at most
    :data:`MAX_REPLY_BYTES`: httpx's timeout is per read, so a server sending a byte a
    second would hold this thread (and a clean shutdown) for ever, and one that streams
    without end would fill the engine's memory. Raises ``httpx.HTTPError`` (a
    ``ReadTimeout`` past the deadline, :class:`ReplyTooLarge`). The answer comes back
    read, as a plain ``httpx.Response`` (status, content type, body)."""
    deadline = time.monotonic() + timeout_s
    with client.stream("POST", path, content=content, headers=headers, timeout=timeout_s) as r:
        body = bytearray()
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_REPLY_BYTES:
                raise ReplyTooLarge(
                    f"the answer passed {MAX_REPLY_BYTES} bytes; is that the sidecar?"
                )
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"no whole answer within {timeout_s:g} s")
        kind = r.headers.get("content-type")
        return httpx.Response(
            r.status_code,
            headers={"content-type": kind} if kind else None,
            content=bytes(body),
            request=r.request,
        )


def _detail(response: httpx.Response) -> str:
    """A refusal's ``detail``, else what answered, on one line for the log (a proxy's or
    another server's HTML page is named as such, not logged line by line)."""
    try:
        body = response.json()
    except ValueError:  # not JSON, not UTF-8
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if detail:
        return " ".join(str(detail).split())[:1024]
    kind = response.headers.get("content-type") or "no content type"
    if "html" in kind:
        return f"an HTML page ({kind}); is KVSIDECAR_SIDECAR_URL the sidecar?"
    return repr(" ".join(response.text.split())[:200])


def _key(state: EngineState) -> _Key:
    """The part of a state the sidecar must see at once (status, revision, reasons)."""
    return (state.status, state.revision, state.reason, state.waiting_reason)
