"""Why a limit is ``deferred`` or requests wait: the vocabularies of ``EngineState.reason``
and ``EngineState.waiting_reason``."""

from __future__ import annotations

from enum import Enum


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
