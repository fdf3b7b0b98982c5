"""One log format for the sidecar and uvicorn: text (default) or JSON lines.

``configure_logging`` installs one handler on the root logger; uvicorn is run
with ``log_config=None`` so its loggers (``uvicorn``, ``uvicorn.error``)
propagate to that handler instead of printing their own format. Structured
fields go in ``extra={"fields": {...}}``: the text format appends them as
``key=value``, the JSON format as top-level keys. Call from the main thread
before the server starts.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

__all__ = [
    "LogFormat",
    "audit_deregister",
    "audit_forget",
    "audit_limit_change",
    "configure_logging",
]

LogFormat = Literal["text", "json"]
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_audit = logging.getLogger("kvsidecar.audit")


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> key=value ...``."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={_text_value(v)}" for k, v in _fields(record).items())
        return f"{line} {extra}" if extra else line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the record's fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _text_value(value: object) -> str:
    text = "null" if value is None else str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=')) else text


def configure_logging(level: str, fmt: LogFormat, stream: TextIO | None = None) -> None:
    """Route every logger (ours and uvicorn's) through one handler in ``fmt``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        for old in list(uv.handlers):
            uv.removeHandler(old)
        uv.propagate = True


def audit_limit_change(
    instance_id: str,
    *,
    source: str,
    old_limit: int | None,
    new_limit: int | None,
    old_revision: int,
    revision: int,
) -> None:
    """The one audit line written for every change of a desired limit."""
    _audit.info(
        "limit change %s: %s -> %s (revision %d -> %d) by %s",
        instance_id,
        _size(old_limit),
        _size(new_limit),
        old_revision,
        revision,
        source,
        extra={
            "fields": {
                "event": "limit_change",
                "instance": instance_id,
                "source": source,
                "old_limit_bytes": old_limit,
                "new_limit_bytes": new_limit,
                "old_revision": old_revision,
                "revision": revision,
            }
        },
    )


def audit_forget(
    instance_id: str, *, source: str, old_limit: int | None, old_revision: int
) -> None:
    """The audit line for DELETE /instances/{id}: the desired limit is dropped with the id."""
    _audit.info(
        "forget %s: desired limit %s (revision %d) dropped by %s",
        instance_id,
        _size(old_limit),
        old_revision,
        source,
        extra={
            "fields": {
                "event": "forget",
                "instance": instance_id,
                "source": source,
                "old_limit_bytes": old_limit,
                "old_revision": old_revision,
            }
        },
    )


def audit_deregister(instance_id: str, *, limit: int | None, revision: int) -> None:
    """The audit line for an engine's clean stop (status ``stopped``; the limit is kept)."""
    _audit.info(
        "deregister %s: the engine stopped; desired limit %s (revision %d) kept",
        instance_id,
        _size(limit),
        revision,
        extra={
            "fields": {
                "event": "deregister",
                "instance": instance_id,
                "source": "engine",
                "limit_bytes": limit,
                "revision": revision,
            }
        },
    )


def _size(limit: int | None) -> str:
    return "unlimited" if limit is None else f"{limit}B"
