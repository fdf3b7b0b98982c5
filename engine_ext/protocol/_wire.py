"""The JSON bodies exchanged over HTTP (pydantic models) and the caps on their fields."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ._paths import DEVICE_ID_PATTERN, MAX_SOCKET_PATH_BYTES
from ._revisions import MAX_CLIENT_REVISION, MAX_REVISION
from ._sizes import MAX_LIMIT_BYTES, parse_limit
from ._status import Status

__all__ = [
    "MAX_FIGURE",
    "MAX_MESSAGE_CHARS",
    "MAX_NAME_CHARS",
    "MAX_RANKS",
    "MAX_REASON_CHARS",
    "MAX_REPLY_BYTES",
    "MAX_VERSION_CHARS",
    "REGISTRATION_HEADER",
    "REGISTRATION_TOKEN_PATTERN",
    "ByteCount",
    "Count",
    "EngineState",
    "LimitBody",
    "LimitSize",
    "RankState",
    "RegisterBody",
    "RegisterReply",
    "Revision",
    "registration_mark",
    "token_fits_a_header",
]


def _size_or_none(value: Any) -> int | None:
    return parse_limit(value)


LimitSize = Annotated[int | None, BeforeValidator(_size_or_none)]


def _a_number(value: Any) -> Any:
    """A count on the wire is a JSON number: ``true`` or ``"5"`` is a mistake, not 1 or 5
    (pydantic's lax mode would take both). An integral float still reads as its int."""
    if isinstance(value, bool | str):
        raise ValueError(  # noqa: TRY004  (pydantic turns only ValueError into a 422)
            f"must be a whole number, not {type(value).__name__} {value!r}"
        )
    return value


#: A revision on the wire: 0 (none yet) up to :data:`MAX_REVISION`.
Revision = Annotated[int, Field(ge=0, le=MAX_REVISION), BeforeValidator(_a_number)]

#: Largest count or byte figure a report may carry (4 EiB): far above anything measured,
#: and it keeps every figure exact as a float (metrics, the autopilot's shares).
MAX_FIGURE = 1 << 62

#: A byte count the engine measured: never negative, at most :data:`MAX_FIGURE`.
ByteCount = Annotated[int, Field(ge=0, le=MAX_FIGURE), BeforeValidator(_a_number)]

#: A count the engine keeps (requests, passes, preemptions): the same bounds.
Count = Annotated[int, Field(ge=0, le=MAX_FIGURE), BeforeValidator(_a_number)]

#: Per-process registration token: sent in ``RegisterBody.registration_token`` and in this
#: header on reports and deregistration, so the sidecar can tell two live processes that
#: claim one instance id apart (the second is refused with 409).
REGISTRATION_HEADER = "X-KVSidecar-Registration"
REGISTRATION_TOKEN_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"


def token_fits_a_header(token: str) -> bool:
    """Whether ``Authorization: Bearer <token>`` can be sent: printable ASCII, no spaces.
    The one rule for the sidecar, engines and kvctl (an HTTP client cannot encode 'é' in a
    header: such a token locked every client out, and kvctl ended in a traceback)."""
    return bool(token) and all("!" <= c <= "~" for c in token)


def registration_mark(token: str) -> str:
    """What the engine's control socket shows of its registration token (``GET /healthz``,
    ``registration``): a digest, so the socket tells the sidecar which process serves it
    without handing out the token that process's reports carry."""
    return hashlib.sha256(token.encode()).hexdigest()[:32]


#: Caps on free-text fields (a report is small; larger is a bug or an attack).
MAX_NAME_CHARS = 64  # engine name
MAX_VERSION_CHARS = 128  # engine version string
MAX_REASON_CHARS = 64  # a reason word, e.g. running_requests
MAX_MESSAGE_CHARS = 1024  # a human message
MAX_RANKS = 1024  # ranks of one instance
#: The most bytes either side reads of an answer (a push reply, a register/report reply):
#: far above any message of this contract (an EngineState with MAX_RANKS ranks is ~150 KB),
#: so a peer that streams without end cannot fill the reader's memory.
MAX_REPLY_BYTES = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LimitBody(_Strict):
    """Body of ``PUT .../limit`` (sidecar API and engine control socket)."""

    limit: LimitSize = Field(description="bytes per GPU: int, '4GiB', or null for unlimited")
    revision: int | None = Field(default=None, ge=1, le=MAX_CLIENT_REVISION, strict=True)


class RankState(BaseModel):
    """What one TP/PP rank maps."""

    rank: Annotated[int, Field(ge=0, lt=MAX_RANKS), BeforeValidator(_a_number)]
    mapped_bytes: ByteCount
    alive: bool = True


class EngineState(BaseModel):
    """A snapshot of one instance's limit state, as the engine reports it.

    Returned by the control socket's ``GET /state`` and ``PUT /limit``, and
    sent to the sidecar in ``/report`` (which doubles as the heartbeat).
    Fields it does not know are ignored (not refused), so an engine on a newer
    kvsidecar can report to an older sidecar during a rolling upgrade; the
    fields it knows are checked strictly (a count is a JSON number).
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
    num_ranks: Annotated[int, Field(ge=1, le=MAX_RANKS), BeforeValidator(_a_number)] = 1
    ranks: list[RankState] = Field(default_factory=list, max_length=MAX_RANKS)
    passes: Count = 0  # engine passes (step() calls that took or worked on a target)
    message: str | None = Field(default=None, max_length=MAX_MESSAGE_CHARS)  # stale/conflict
    # -- demand: what the engine's requests need (refreshed at every scheduler step) --
    num_running_requests: Count = 0
    num_waiting_requests: Count = 0
    waiting_bytes: ByteCount = 0  # KV bytes the waiting requests still need to start
    # KV bytes the running requests may still add (their output up to max_tokens), counted
    # with KVSIDECAR_RESERVE_OUTPUT=1 (docs/limits.md, "Output reservation"); 0 otherwise
    reserved_bytes: ByteCount = 0
    # why waiting requests do not start: "waiting_for_memory" when the limit (not the
    # engine's own batch limits) keeps at least one of them out; None otherwise. Independent
    # of ``status``: a limit can be applied while requests wait for memory under it.
    waiting_reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)
    num_preemptions: Count = 0  # running requests preempted since start
    prefix_hit_rate: float | None = Field(default=None, ge=0.0, le=1.0)  # recent window


class RegisterBody(_Strict):
    """``POST /instances/{id}/register``: sent by an engine at start-up."""

    engine: str = Field(min_length=1, max_length=MAX_NAME_CHARS)  # "vllm" or "sglang"
    engine_version: str = Field(max_length=MAX_VERSION_CHARS)
    # the engine's control socket
    socket_path: str | None = Field(default=None, max_length=MAX_SOCKET_PATH_BYTES)
    # device memory of one rank (limit-percent)
    device_total_bytes: int | None = Field(default=None, ge=0, le=MAX_LIMIT_BYTES)
    state: EngineState
    # random per engine process (see REGISTRATION_HEADER); None: an older engine, not checked
    registration_token: str | None = Field(default=None, pattern=REGISTRATION_TOKEN_PATTERN)
    # the device the instance's ranks use (KVSIDECAR_DEVICE_ID; docs/autopilot.md); None: not
    # placed on any device (no budget applies to it)
    device_id: str | None = Field(default=None, pattern=DEVICE_ID_PATTERN)


class RegisterReply(BaseModel):
    """The retained desired limit; ``revision`` 0 means none is retained."""

    limit: LimitSize = None
    revision: Revision = 0
