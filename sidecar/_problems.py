"""Errors → ``application/problem+json``: the one handler table of the service."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ._errors import (
    BudgetError,
    DeviceMoveError,
    DuplicateInstanceError,
    InvalidInputError,
    RevisionRejectedError,
    SidecarError,
    StoreError,
    TooManyInstancesError,
    TooManyWaitsError,
    UnauthorizedError,
    UnknownDeviceError,
    UnknownInstanceError,
)

__all__ = ["PROBLEM_TABLE", "install_problem_handlers", "problem_response"]

_log = logging.getLogger("kvsidecar.http")

#: Domain error → (HTTP status, title). Most specific first; the first match wins.
PROBLEM_TABLE: tuple[tuple[type[SidecarError], int, str], ...] = (
    (InvalidInputError, 422, "Invalid input"),
    (UnknownInstanceError, 404, "Unknown instance"),
    (RevisionRejectedError, 409, "Revision rejected"),
    (DuplicateInstanceError, 409, "Instance id in use"),
    (TooManyInstancesError, 409, "Too many instances"),
    (UnauthorizedError, 401, "Unauthorized"),
    (UnknownDeviceError, 404, "Unknown device"),
    (BudgetError, 409, "Over the device budget"),
    (DeviceMoveError, 409, "Instance on another device"),
    (StoreError, 503, "Database unavailable"),
    (TooManyWaitsError, 503, "Too many waiting clients"),
)


def problem_response(
    status: int, title: str, detail: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    return JSONResponse(
        body, status_code=status, headers=headers, media_type="application/problem+json"
    )


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SidecarError)
    for cls, status, title in PROBLEM_TABLE:
        if isinstance(exc, cls):
            headers: dict[str, str] | None = None
            if isinstance(exc, UnauthorizedError):
                headers = {"WWW-Authenticate": 'Bearer realm="kvsidecar"'}
            elif isinstance(exc, TooManyWaitsError):
                headers = {"Retry-After": str(exc.retry_after_s)}
            return problem_response(status, title, exc.detail, headers, **exc.extensions())
    _log.error("unmapped sidecar error on %s %s: %s", request.method, request.url.path, exc)
    return problem_response(500, "Internal error", exc.detail)


def _field_name(loc: tuple[int | str, ...]) -> str:
    where, *rest = loc if loc else ("body",)
    if where == "body":
        return ".".join(str(p) for p in rest) or "body"
    return f"{where}.{'.'.join(str(p) for p in rest)}" if rest else str(where)


def _clean(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def _is_json(content_type: str | None) -> bool:
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def _one_error(err: dict[str, Any], content_type: str | None) -> dict[str, str]:
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "json_invalid":  # FastAPI puts the character offset in loc
        reason = (err.get("ctx") or {}).get("error") or "malformed"
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return {"field": "body", "message": f"not valid JSON ({reason}{at})"}
    message = _clean(err["msg"])
    if loc == ("body",) and not _is_json(content_type):
        message += (
            f" (the body was sent as {content_type or 'no content type'}: send JSON with "
            "'content-type: application/json', e.g. curl -H 'content-type: application/json')"
        )
    return {"field": _field_name(loc), "message": message}


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    content_type = request.headers.get("content-type")
    errors = [_one_error(err, content_type) for err in exc.errors()]
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return problem_response(422, "Invalid input", detail, errors=errors)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        detail = f"no such endpoint: {request.method} {request.url.path}; see /docs"
    return problem_response(
        exc.status_code, detail.split(":")[0], detail, dict(exc.headers) if exc.headers else None
    )


async def _last_resort(request: Request, exc: Exception) -> JSONResponse:
    _log.exception("unhandled error on %s %s", request.method, request.url.path)
    return problem_response(
        500, "Internal error", "the sidecar hit an unexpected error; see its log and report it"
    )


def install_problem_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SidecarError, _domain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _last_resort)
