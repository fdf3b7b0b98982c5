"""The wire contract between the engine extension and the sidecar.

One module, imported by both sides, so the two can never disagree on a field:

* :func:`parse_size` -- the one size parser (API, CLI, settings);
* :class:`Status` -- the one status vocabulary (API, CLI, metrics, logs);
* the JSON bodies exchanged over HTTP (pydantic models).

Dependency rule: this module imports only pydantic and the standard library,
so the sidecar may import it without pulling in any engine.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "ID_PATTERN",
    "MAX_CLIENT_REVISION",
    "MAX_LIMIT_BYTES",
    "MAX_REVISION",
    "REGISTRATION_HEADER",
    "REGISTRATION_TOKEN_PATTERN",
    "EngineState",
    "LimitBody",
    "RankState",
    "RegisterBody",
    "RegisterReply",
    "SizeError",
    "Status",
    "format_size",
    "parse_limit",
    "parse_size",
]

#: Instance ids: what fits in a URL path segment, a file name and a metric label.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"

#: Largest limit accepted anywhere: 1 EiB. Anything larger is a typo.
MAX_LIMIT_BYTES = 1 << 60

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([KMGT]?)(?:I?B|I)?\s*$", re.IGNORECASE)


class SizeError(ValueError):
    """A size that cannot be read. The message says what forms are accepted."""


def parse_size(value: object) -> int:
    """Read a byte size: an int, or a string like ``512M``, ``2G``, ``1.5GiB``.

    Units ``K``, ``M``, ``G``, ``T`` are powers of 1024 (as kvctl and Docker
    read them), optionally followed by ``B``, ``i`` or ``iB`` in any case.
    Fractions are rounded down to whole bytes. Negative, NaN, infinite,
    boolean and oversized values are rejected with :class:`SizeError`.
    """
    if isinstance(value, bool):
        raise SizeError("a size must be a byte count or a string like '512M'; got a boolean")
    if isinstance(value, int):
        num = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise SizeError(f"a size must be a finite number of bytes; got {value!r}")
        if value != int(value):
            raise SizeError(f"a byte count must be whole; got {value!r} (use a unit, e.g. '1.5G')")
        num = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None:
            raise SizeError(
                f"cannot read size {value!r}: use a byte count or a number with a unit "
                "K, M, G or T (powers of 1024), e.g. '512M', '2G', '1.5GiB'"
            )
        num = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    else:
        raise SizeError(
            f"a size must be a byte count or a string like '512M'; got {type(value).__name__}"
        )
    if num < 0:
        raise SizeError(f"a size cannot be negative; got {value!r}")
    if num > MAX_LIMIT_BYTES:
        raise SizeError(f"size {value!r} is larger than 1 EiB; check the unit")
    return num


def parse_limit(value: object) -> int | None:
    """A limit: a size, or ``None``/``"none"``/``"unlimited"`` for no limit."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in {"none", "null", "unlimited"}:
        return None
    return parse_size(value)


def format_size(num_bytes: int | None) -> str:
    """Human form of a byte count (``1.5GiB``); ``unlimited`` for None."""
    if num_bytes is None:
        return "unlimited"
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.4g}{unit}"
    return f"{num_bytes}B"


class Status(str, Enum):
    """The one status vocabulary (docs/design.md, "Statuses")."""

    PENDING = "pending"  # sidecar holds the limit; the engine has not acknowledged it
    DEFERRED = "deferred"  # engine holds the target but maps more; carries reason + overage
    APPLIED = "applied"  # mapped <= limit on every rank, after the rank barrier
    UNREACHABLE = "unreachable"  # the engine stopped answering heartbeats/pushes
    STOPPED = "stopped"  # the engine deregistered on a clean shutdown (desired limit kept)
    STALE = "stale"  # rejected: an older revision (response only)
    CONFLICT = "conflict"  # rejected: same revision, other limit (response only)


def _size_or_none(value: Any) -> int | None:
    return parse_limit(value)


LimitSize = Annotated[int | None, BeforeValidator(_size_or_none)]

#: Largest revision accepted anywhere (fits SQLite's signed 64-bit integers with room to grow).
MAX_REVISION = 1 << 62

#: Largest revision a client may name (PUT with ``revision``): 2^53, what every JSON
#: client reads exactly. The range above it is left to revisions the sidecar and the
#: engine take themselves (current + 1), so a client-named revision can never use up
#: the space: 2^62 - 2^53 increments remain after the largest one.
MAX_CLIENT_REVISION = 1 << 53

#: A revision on the wire: 0 (none yet) up to :data:`MAX_REVISION`.
Revision = Annotated[int, Field(ge=0, le=MAX_REVISION)]

#: A byte count the engine measured: never negative.
ByteCount = Annotated[int, Field(ge=0)]

#: Per-process registration token: sent in ``RegisterBody.registration_token`` and in this
#: header on reports and deregistration, so the sidecar can tell two live processes that
#: claim one instance id apart (the second is refused with 409).
REGISTRATION_HEADER = "X-KVSidecar-Registration"
REGISTRATION_TOKEN_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"

#: Caps on free-text fields (a report is small; larger is a bug or an attack).
MAX_NAME_CHARS = 64  # engine name
MAX_VERSION_CHARS = 128  # engine version string
MAX_REASON_CHARS = 64  # a reason word, e.g. running_requests
MAX_MESSAGE_CHARS = 1024  # a human message
MAX_RANKS = 1024  # ranks of one instance
MAX_SOCKET_PATH_CHARS = 107  # sockaddr_un.sun_path, minus the terminating NUL


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LimitBody(_Strict):
    """Body of ``PUT .../limit`` (sidecar API and engine control socket)."""

    limit: LimitSize = Field(description="bytes per GPU: int, '4GiB', or null for unlimited")
    revision: int | None = Field(default=None, ge=1, le=MAX_CLIENT_REVISION, strict=True)


class RankState(BaseModel):
    """What one TP/PP rank maps."""

    rank: int = Field(ge=0)
    mapped_bytes: ByteCount
    alive: bool = True


class EngineState(BaseModel):
    """A snapshot of one instance's limit state, as the engine reports it.

    Returned by the control socket's ``GET /state`` and ``PUT /limit``, and
    sent to the sidecar in ``/report`` (which doubles as the heartbeat).
    """

    status: Status
    revision: Revision = 0  # newest revision the engine accepted (0 = none yet)
    limit_bytes: LimitSize = None  # the limit the engine holds (as requested)
    # what the engine works towards: max(limit, floor), the floor being memory the engine
    # itself can never give back (vLLM's null block keeps its page mapped); None: unlimited
    effective_limit_bytes: LimitSize = None
    floor_bytes: ByteCount = 0
    mapped_bytes: ByteCount = 0  # largest per-rank mapped KV bytes (page bundles)
    overage_bytes: ByteCount = 0  # mapped - effective limit while deferred, else 0
    reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)  # why deferred
    capacity_bytes: ByteCount = 0  # KV bytes the instance could map with no limit
    page_bundle_bytes: ByteCount = 0  # bytes one page costs (all layers and K/V buffers)
    evictable_bytes: ByteCount = 0  # prefix-cache pages that could be given back now
    pinned_bytes: ByteCount = 0  # pages held by running requests
    num_ranks: int = Field(default=1, ge=1, le=MAX_RANKS)
    ranks: list[RankState] = Field(default_factory=list, max_length=MAX_RANKS)
    passes: int = Field(default=0, ge=0)  # engine passes (step() calls that took or worked on a target)
    message: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)  # stale/conflict
    # -- demand: what the engine's requests need (refreshed at every scheduler step) --
    num_running_requests: int = Field(default=0, ge=0)
    num_waiting_requests: int = Field(default=0, ge=0)
    waiting_bytes: ByteCount = 0  # KV bytes the waiting requests still need to start
    # why waiting requests do not start: "waiting_for_memory" when the limit (not the
    # engine's own batch limits) keeps at least one of them out; None otherwise. Independent
    # of ``status``: a limit can be applied while requests wait for memory under it.
    waiting_reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)
    num_preemptions: int = Field(default=0, ge=0)  # running requests preempted since start
    prefix_hit_rate: float | None = Field(default=None, ge=0.0, le=1.0)  # recent window


class RegisterBody(_Strict):
    """``POST /instances/{id}/register``: sent by an engine at start-up."""

    engine: str = Field(min_length=1, max_length=MAX_NAME_CHARS)  # "vllm" or "sglang"
    engine_version: str = Field(max_length=MAX_VERSION_CHARS)
    # the engine's control socket
    socket_path: str | None = Field(default=None, max_length=MAX_SOCKET_PATH_CHARS)
    # device memory of one rank (limit-percent)
    device_total_bytes: int | None = Field(default=None, ge=0, le=MAX_LIMIT_BYTES)
    state: EngineState
    # random per engine process (see REGISTRATION_HEADER); None: an older engine, not checked
    registration_token: str | None = Field(default=None, pattern=REGISTRATION_TOKEN_PATTERN)


class RegisterReply(BaseModel):
    """The retained desired limit; ``revision`` 0 means none is retained."""

    limit: LimitSize = None
    revision: Revision = 0
