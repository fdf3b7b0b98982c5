"""kvctl's HTTP side: the sidecar API, or one engine's control socket (``--socket``).

Every failure becomes a :class:`CtlError` with one line for a person and the
exit code kvctl ends with; nothing here prints.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from engine_ext.protocol import EngineState, LimitBody, Status

from ._models import DeviceList, DeviceView, InstanceList, InstanceView

__all__ = [
    "EXIT_DEFERRED",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CtlError",
    "Reply",
    "SidecarApi",
    "SocketApi",
]

EXIT_OK = 0  # applied, or the request was stored / read
EXIT_ERROR = 1  # the sidecar refused (unknown instance, stale revision, auth...)
EXIT_USAGE = 2  # bad arguments (bad size, bad id, option not valid here)
EXIT_DEFERRED = 3  # --wait deadline passed while deferred/pending
EXIT_UNREACHABLE = 4  # the sidecar/engine cannot be reached, or the instance is unreachable

_CONNECT_TIMEOUT_S = 5.0
_URL_HINT = "--url/KVSIDECAR_URL"
_SOCKET_POLL_S = 0.1  # --socket --wait: the control socket has no long-poll


#: The most of an answer kvctl reads (the instance list of a full sidecar is a few MB).
MAX_ANSWER_BYTES = 64 << 20


class AnswerTooLarge(httpx.TransportError):
    """An answer passed :data:`MAX_ANSWER_BYTES` (read no further)."""


def _bounded_request(
    client: httpx.Client, method: str, path: str, *, total_s: float, **kwargs: Any
) -> httpx.Response:
    """One request whose whole answer is read within ``total_s`` and up to
    :data:`MAX_ANSWER_BYTES`: httpx's timeout is per read, so a server sending a byte now
    and then would hold kvctl (a cron job, a script) for ever. Past either bound it raises
    an ``httpx.TransportError`` (``ReadTimeout``, :class:`AnswerTooLarge`).

    The request runs on a daemon thread, waited for at most ``total_s`` (plus a moment):
    resolving the host name comes before httpx's timeouts and has none of its own, so a
    resolver that does not answer held kvctl for its whole retry time. Past that it
    raises ``ConnectTimeout``; the thread is left to end with the process."""
    outcome: list[httpx.Response | BaseException] = []

    def run() -> None:
        try:
            outcome.append(_read_whole(client, method, path, total_s=total_s, **kwargs))
        except BaseException as exc:  # noqa: BLE001 -- handed to the waiting thread
            outcome.append(exc)

    worker = threading.Thread(target=run, name="kvctl-request", daemon=True)
    worker.start()
    worker.join(total_s + _JOIN_GRACE_S)
    if not outcome:
        raise httpx.ConnectTimeout(
            f"no answer within {total_s:g} s (does the host name resolve? name resolution "
            "has no timeout of its own)"
        )
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


#: how much longer than its own bound a request thread is waited for
_JOIN_GRACE_S = 0.5


def _read_whole(
    client: httpx.Client, method: str, path: str, *, total_s: float, **kwargs: Any
) -> httpx.Response:
    deadline = time.monotonic() + total_s
    with client.stream(method, path, **kwargs) as resp:
        body = bytearray()
        for chunk in resp.iter_bytes():
            body += chunk
            if len(body) > MAX_ANSWER_BYTES:
                raise AnswerTooLarge(f"the answer passed {MAX_ANSWER_BYTES >> 20} MiB")
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"no whole answer within {total_s:g} s")
        kind = resp.headers.get("content-type")
        return httpx.Response(
            resp.status_code,
            headers={"content-type": kind} if kind else None,
            content=bytes(body),
            request=resp.request,
        )


class CtlError(Exception):
    """A failure to report as ``kvctl: <message>`` and exit with ``code``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class Reply:
    """A decoded answer: the JSON body and the HTTP status."""

    body: Any
    http_status: int


def _raise_for(resp: httpx.Response, where: str, hint: str) -> None:
    """An error answer as one line: kvsidecar's problem detail, or, for an answer kvsidecar
    does not give (a proxy's or another server's HTML page, JSON without a detail), what
    answered and a hint that ``where`` may not be kvsidecar."""
    if resp.status_code < 400:
        return
    code = EXIT_USAGE if resp.status_code == 422 else EXIT_ERROR
    try:
        problem = resp.json()
    except ValueError:
        problem = None
    detail = problem.get("detail") or problem.get("title") if isinstance(problem, dict) else None
    if detail:
        raise CtlError(f"{_one_line(str(detail))} (HTTP {resp.status_code})", code)
    kind = resp.headers.get("content-type") or "no content type"
    if "html" in kind:  # a page for a browser: its markup says nothing on one line
        what = f"an HTML page ({kind})"
    else:
        what = f"{kind} ({_one_line(resp.text)[:120] or resp.reason_phrase!r})"
    raise CtlError(
        f"{where} answered HTTP {resp.status_code} with {what}, not a kvsidecar problem; "
        f"is that kvsidecar? Check {hint}",
        EXIT_ERROR,
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _json(resp: httpx.Response, what: str) -> Any:
    """The body of a successful answer; one that is not JSON is an error that names the
    likely cause (the URL or socket points at something other than kvsidecar)."""
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        kind = resp.headers.get("content-type") or "no content type"
        raise CtlError(
            f"{what} answered HTTP {resp.status_code} with a body that is not JSON ({kind}); "
            "is that kvsidecar? Check --url/KVSIDECAR_URL (or --socket)",
            EXIT_ERROR,
        ) from None


def _checked(body: Any, model: type[BaseModel], where: str, http_status: int, check: str) -> Any:
    """``body`` once it has the shape of kvsidecar's ``model``. JSON of another shape (another
    service on that port, a proxy's error object, ``{}``) is one line naming the first field
    that does not fit, not a traceback from the code that prints it."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "the body"
        raise CtlError(
            f"{where} answered HTTP {http_status} with JSON that is not a kvsidecar "
            f"{model.__name__} ({field}: {first['msg']}); is that kvsidecar? Check {check}",
            EXIT_ERROR,
        ) from None
    return body


class SidecarApi:
    """The sidecar REST API. One :class:`httpx.Client` per command."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(_CONNECT_TIMEOUT_S)
        )

    def close(self) -> None:
        self._client.close()

    def _call(
        self,
        method: str,
        path: str,
        answer: type[BaseModel] | None,
        *,
        wait: float | None = None,
        json_body: Any = None,
    ) -> Reply:
        """One request; the answer's body must be JSON of the shape of ``answer`` (None: an
        empty ``204``, as ``DELETE /instances/{id}`` answers)."""
        params = {"wait": wait} if wait else None
        timeout = httpx.Timeout(_CONNECT_TIMEOUT_S + (wait or 0.0), connect=_CONNECT_TIMEOUT_S)
        try:
            resp = _bounded_request(
                self._client,
                method,
                path,
                params=params,
                json=json_body,
                timeout=timeout,
                total_s=2 * _CONNECT_TIMEOUT_S + (wait or 0.0),
            )
        except httpx.TransportError as exc:
            raise CtlError(
                f"cannot reach the sidecar at {self.url} ({exc.__class__.__name__}: "
                f"{exc}); is 'kvsidecar serve' running? (--url)",
                EXIT_UNREACHABLE,
            ) from None
        where = f"the sidecar at {self.url}"
        _raise_for(resp, where, _URL_HINT)
        if answer is None:
            if resp.status_code != 204:
                raise CtlError(
                    f"{where} answered HTTP {resp.status_code} where kvsidecar answers 204; "
                    f"is that kvsidecar? Check {_URL_HINT}",
                    EXIT_ERROR,
                )
            return Reply(None, resp.status_code)
        return Reply(
            _checked(_json(resp, where), answer, where, resp.status_code, _URL_HINT),
            resp.status_code,
        )

    def set_limit(self, instance_id: str, limit: int | None, wait: float | None) -> Reply:
        return self._call(
            "PUT",
            f"{_path(instance_id)}/limit",
            InstanceView,
            wait=wait,
            json_body={"limit": limit},
        )

    def delete_limit(self, instance_id: str, wait: float | None) -> Reply:
        return self._call("DELETE", f"{_path(instance_id)}/limit", InstanceView, wait=wait)

    def forget(self, instance_id: str) -> Reply:
        return self._call("DELETE", _path(instance_id), None)

    def status(self, instance_id: str, wait: float | None) -> Reply:
        return self._call("GET", _path(instance_id), InstanceView, wait=wait)

    def list(self) -> Reply:
        return self._call("GET", "/instances", InstanceList)

    # --- the autopilot (docs/autopilot.md) ---

    def devices(self) -> Reply:
        return self._call("GET", "/devices", DeviceList)

    def device(self, device_id: str) -> Reply:
        return self._call("GET", _device_path(device_id), DeviceView)

    def set_budget(self, device_id: str, budget: int | None, dry_run: bool | None) -> Reply:
        if budget is None:
            return self._call("DELETE", f"{_device_path(device_id)}/budget", DeviceView)
        body: dict[str, Any] = {"budget": budget}
        if dry_run is not None:
            body["dry_run"] = dry_run
        return self._call("PUT", f"{_device_path(device_id)}/budget", DeviceView, json_body=body)

    def set_device_limits(self, device_id: str, limits: dict[str, int]) -> Reply:
        return self._call(
            "PUT", f"{_device_path(device_id)}/limits", DeviceView, json_body={"limits": limits}
        )

    def set_policy(self, instance_id: str, fields: dict[str, Any]) -> Reply:
        return self._call("PUT", f"{_path(instance_id)}/policy", InstanceView, json_body=fields)


def _device_path(device_id: str) -> str:
    return f"/devices/{quote(device_id, safe='')}"


def _path(instance_id: str) -> str:
    """``/instances/<id>`` with the id encoded as one path segment (no '/', '?', '..')."""
    return f"/instances/{quote(instance_id, safe='')}"


class SocketApi:
    """One engine's control socket (no sidecar): ``PUT /limit`` and ``GET /state``."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._client = httpx.Client(
            transport=httpx.HTTPTransport(uds=socket_path),
            base_url="http://engine",
            timeout=_CONNECT_TIMEOUT_S,
        )

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, json_body: Any = None) -> Reply:
        try:
            resp = _bounded_request(
                self._client, method, path, json=json_body, total_s=2 * _CONNECT_TIMEOUT_S
            )
        except httpx.TransportError as exc:
            raise CtlError(
                f"cannot reach the engine control socket {self.socket_path} "
                f"({exc.__class__.__name__}: {exc}); is the engine running with "
                "KVSIDECAR_ENABLE=1?",
                EXIT_UNREACHABLE,
            ) from None
        where = f"the engine control socket {self.socket_path}"
        if resp.status_code == 409:  # stale/conflict: the body is the engine state + message
            body = _json(resp, where)
            message = body.get("message") if isinstance(body, dict) else None
            raise CtlError(str(message or "revision rejected"), EXIT_ERROR)
        _raise_for(resp, where, "--socket")
        return Reply(
            _checked(_json(resp, where), EngineState, where, resp.status_code, "--socket"),
            resp.status_code,
        )

    def set_limit(self, limit: int | None, wait: float | None) -> Reply:
        body = LimitBody(limit=limit).model_dump(mode="json")
        reply = self._call("PUT", "/limit", body)
        if not wait:
            return reply
        return self._poll_applied(int(reply.body.get("revision", 0)), wait)

    def status(self, wait: float | None) -> Reply:
        reply = self._call("GET", "/state")
        if not wait:
            return reply
        return self._poll_applied(int(reply.body.get("revision", 0)), wait)

    def _poll_applied(self, revision: int, wait: float) -> Reply:
        deadline = time.monotonic() + wait
        while True:
            reply = self._call("GET", "/state")
            body = reply.body
            if body.get("status") == Status.APPLIED and int(body.get("revision", 0)) >= revision:
                return reply
            if time.monotonic() >= deadline:
                return reply
            time.sleep(min(_SOCKET_POLL_S, max(0.0, deadline - time.monotonic())))
