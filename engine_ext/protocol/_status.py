"""The status vocabulary and the reasons that go with it.

* :class:`Status` -- the one status of a limit (API, CLI, metrics, logs);
* :class:`DeferReason` -- ``EngineState.reason``: why the engine reports ``deferred``;
* :class:`WaitReason` -- ``EngineState.waiting_reason``: why waiting requests do not start;
* :class:`InstanceReason` -- the sidecar's own reasons for ``pending``, ``stopped`` and
  ``unreachable`` (``InstanceView.reason``).

All are ``str`` enums: a member equals its wire string, and the wire fields stay plain
strings (a newer engine's reason is shown, not refused).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["DeferReason", "InstanceReason", "Status", "WaitReason"]


class Status(str, Enum):
    """The one status vocabulary (docs/design.md, "Statuses")."""

    PENDING = "pending"  # sidecar holds the limit; the engine has not acknowledged it
    DEFERRED = "deferred"  # engine holds the target but maps more; carries reason + overage
    APPLIED = "applied"  # mapped <= limit on every rank, after the rank barrier
    UNREACHABLE = "unreachable"  # the engine stopped answering heartbeats/pushes
    STOPPED = "stopped"  # the engine deregistered on a clean shutdown (desired limit kept)
    STALE = "stale"  # rejected: an older revision (response only)
    CONFLICT = "conflict"  # rejected: same revision, other limit (response only)


class DeferReason(str, Enum):
    """The reason carried by a ``deferred`` state (docs/limits.md, "Statuses")."""

    ENGINE_PASS = "engine_pass"  # published; the engine thread has not run a pass since
    EVICTING = "evicting"  # reclaimable pages remain; the next pass continues
    RUNNING_REQUESTS = "running_requests"  # what is left over the limit is held by requests
    RECLAIM_DISABLED = "reclaim_disabled"  # reclaim is off: the target is recorded, nothing evicted
    RANK_TIMEOUT = "rank_timeout"  # a TP/PP rank did not confirm its unmaps in time
    RANK_FAILED = "rank_failed"  # a TP/PP rank is dead or reported an error
    BACKEND_ERROR = "backend_error"  # a map/unmap failed (OS/driver); the next pass retries
    DEVICE_OUT_OF_MEMORY = "device_out_of_memory"  # under its limit, but the device is full


class WaitReason(str, Enum):
    """Why waiting requests do not start (``EngineState.waiting_reason``; docs/limits.md)."""

    WAITING_FOR_MEMORY = "waiting_for_memory"  # the limit keeps a waiting request out
    # the device could not back the pages an admission needed (other engines hold the
    # memory): the request waits, as under a limit, until memory is free again
    DEVICE_OUT_OF_MEMORY = "device_out_of_memory"


class InstanceReason(str, Enum):
    """Why the sidecar shows an instance ``pending``, ``stopped`` or ``unreachable``
    (docs/api.md, the status table); ``deferred`` carries the engine's :class:`DeferReason`."""

    NOT_REGISTERED = "not_registered"  # pending: no engine has registered this id
    DEREGISTERED = "deregistered"  # stopped: the engine shut down cleanly
    NO_HEARTBEAT = "no_heartbeat"  # unreachable: silent for longer than the heartbeat timeout
    AWAITING_REPORT = "awaiting_report"  # pending: registered, nothing heard since
    PUSH_IN_FLIGHT = "push_in_flight"  # pending: the desired revision is not acknowledged yet
    LIMIT_MISMATCH = "limit_mismatch"  # pending: the engine holds the revision, another limit
