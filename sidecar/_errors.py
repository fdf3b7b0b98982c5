"""The sidecar's error hierarchy.

Services raise these; the HTTP layer maps each class to one status code and an
``application/problem+json`` body in a single table (``_problems.py``)::

    SidecarError
     ├── SidecarConfigError       bad settings or database path: fatal at start-up
     ├── StoreError               the database could not be written: transient (503)
     ├── TooManyWaitsError        KVSIDECAR_MAX_WAITS clients already wait: transient (503)
     └── RequestError             the caller's request cannot be honoured (4xx)
          ├── InvalidInputError       a field is malformed (422)
          ├── UnknownInstanceError    no such instance (404)
          ├── RevisionRejectedError   stale or conflicting revision (409)
          ├── DuplicateInstanceError  another live engine process holds the id (409)
          ├── TooManyInstancesError   the instance cap is reached (409)
          ├── UnknownDeviceError      no such device (404)
          ├── BudgetError             a budget cannot hold the mins and pins asked for (409)
          ├── DeviceMoveError         an instance registers on another device (409)
          └── UnauthorizedError       missing or wrong bearer token (401)

(An oversized body never reaches a service: ``BodyLimitMiddleware`` answers 413.)

Every message says what to do about it.
"""

from __future__ import annotations

from typing import Any

from engine_ext.protocol import Status

__all__ = [
    "BudgetError",
    "DeviceMoveError",
    "DuplicateInstanceError",
    "InvalidInputError",
    "RequestError",
    "RevisionRejectedError",
    "SidecarConfigError",
    "SidecarError",
    "StoreError",
    "TooManyInstancesError",
    "TooManyWaitsError",
    "UnauthorizedError",
    "UnknownDeviceError",
    "UnknownInstanceError",
]


class SidecarError(Exception):
    """Base class of every error the sidecar raises on purpose."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def extensions(self) -> dict[str, Any]:
        """Extra members for the problem+json body (machine-readable context)."""
        return {}


class SidecarConfigError(SidecarError):
    """A setting or the database path is unusable; the service cannot start."""


class StoreError(SidecarError):
    """The database refused a read or write (disk full, locked, read-only)."""


class TooManyWaitsError(SidecarError):
    """``KVSIDECAR_MAX_WAITS`` clients already long-poll or stream; nothing was changed."""

    retry_after_s = 1

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"{limit} client{'s' if limit != 1 else ''} already wait{'' if limit != 1 else 's'} "
            "here (long-polls with ?wait= and event streams with ?watch=1; KVSIDECAR_MAX_WAITS="
            f"{limit}); nothing was changed. Retry in a second, "
            "send the request without ?wait (then poll GET /instances/<id>), or close "
            "dashboards and watches you do not need"
        )
        self.limit = limit

    def extensions(self) -> dict[str, Any]:
        return {"max_waits": self.limit}


class RequestError(SidecarError):
    """The request cannot be honoured as sent; nothing was changed."""


class InvalidInputError(RequestError):
    """A field of the request is malformed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def extensions(self) -> dict[str, Any]:
        return {"errors": [{"field": self.field, "message": self.message}]}


class UnknownInstanceError(RequestError):
    """The instance id is not known to the sidecar."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(
            f"instance {instance_id!r} is not known: set a limit with "
            f"PUT /instances/{instance_id}/limit or start its engine so it registers"
        )
        self.instance_id = instance_id


class RevisionRejectedError(RequestError):
    """A client-given revision is older than (stale) or equal to (conflict) the current one."""

    def __init__(
        self, status: Status, detail: str, current_revision: int, current_limit: int | None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.current_revision = current_revision
        self.current_limit = current_limit

    def extensions(self) -> dict[str, Any]:
        return {
            "revision_status": self.status.value,
            "current_revision": self.current_revision,
            "current_limit_bytes": self.current_limit,
        }


class DuplicateInstanceError(RequestError):
    """A second live engine process registers (or reports for) an id another one holds."""


class TooManyInstancesError(RequestError):
    """A new instance id would exceed ``KVSIDECAR_MAX_INSTANCES``."""


class UnauthorizedError(RequestError):
    """The bearer token is missing or wrong."""


class UnknownDeviceError(RequestError):
    """The device id is not known: no engine registered on it and no budget names it."""

    def __init__(self, device_id: str) -> None:
        super().__init__(
            f"device {device_id!r} is not known: start an engine with "
            f"KVSIDECAR_DEVICE_ID={device_id} so it registers there (GET /devices lists "
            "the known devices)"
        )
        self.device_id = device_id


class BudgetError(RequestError):
    """A budget, min or pinned limit that the device's budget cannot hold."""


class DeviceMoveError(RequestError):
    """An instance registers on another device than the one it is recorded on."""
