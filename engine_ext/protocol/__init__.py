"""The contract between the engine extension and the sidecar.

Both sides import it, so the two can never disagree on a field, a word or a rule:

* sizes -- :func:`parse_size` / :func:`parse_limit` / :func:`format_size`, the one size
  parser and printer (API, CLI, settings);
* statuses and reasons -- :class:`Status`, :class:`DeferReason`, :class:`WaitReason`,
  :class:`InstanceReason` (API, CLI, metrics, logs);
* revisions -- :func:`judge_revision`, the one revision rule (the sidecar's store and the
  engine's mailbox), and its bounds;
* paths -- instance ids and unix-socket path limits;
* settings -- the ``KVSIDECAR_*`` names some part reads (:func:`unknown_settings`);
* the JSON bodies exchanged over HTTP (pydantic models), and the rule that a key given
  twice in one object is refused (:func:`duplicate_json_key`).

Dependency rule: this package imports only pydantic and the standard library (a test
holds it to that), so the sidecar imports it without any engine, allocator or
engine-core module. Import it as ``engine_ext.protocol``; its submodules are private.
"""

from __future__ import annotations

from ._json import duplicate_json_key, duplicate_key_message
from ._paths import (
    DEVICE_ID_PATTERN,
    ID_PATTERN,
    MAX_SOCKET_PATH_BYTES,
    sidecar_url_problem,
    socket_path_fits,
)
from ._revisions import (
    MAX_CLIENT_REVISION,
    MAX_REVISION,
    RevisionOutcome,
    RevisionVerdict,
    judge_revision,
)
from ._settings_names import KNOWN_SETTINGS, unknown_settings
from ._sizes import MAX_LIMIT_BYTES, SizeError, format_size, parse_limit, parse_size
from ._status import DeferReason, InstanceReason, Status, WaitReason
from ._wire import (
    MAX_FIGURE,
    MAX_MESSAGE_CHARS,
    MAX_NAME_CHARS,
    MAX_RANKS,
    MAX_REASON_CHARS,
    MAX_REPLY_BYTES,
    MAX_VERSION_CHARS,
    REGISTRATION_HEADER,
    REGISTRATION_TOKEN_PATTERN,
    ByteCount,
    Count,
    EngineState,
    LimitBody,
    LimitSize,
    RankState,
    RegisterBody,
    RegisterReply,
    Revision,
    registration_mark,
    token_fits_a_header,
)

__all__ = [
    "DEVICE_ID_PATTERN",
    "ID_PATTERN",
    "KNOWN_SETTINGS",
    "MAX_CLIENT_REVISION",
    "MAX_FIGURE",
    "MAX_LIMIT_BYTES",
    "MAX_MESSAGE_CHARS",
    "MAX_NAME_CHARS",
    "MAX_RANKS",
    "MAX_REASON_CHARS",
    "MAX_REPLY_BYTES",
    "MAX_REVISION",
    "MAX_SOCKET_PATH_BYTES",
    "MAX_VERSION_CHARS",
    "REGISTRATION_HEADER",
    "REGISTRATION_TOKEN_PATTERN",
    "ByteCount",
    "Count",
    "DeferReason",
    "EngineState",
    "InstanceReason",
    "LimitBody",
    "LimitSize",
    "RankState",
    "RegisterBody",
    "RegisterReply",
    "Revision",
    "RevisionOutcome",
    "RevisionVerdict",
    "SizeError",
    "Status",
    "WaitReason",
    "duplicate_json_key",
    "duplicate_key_message",
    "format_size",
    "judge_revision",
    "parse_limit",
    "parse_size",
    "registration_mark",
    "sidecar_url_problem",
    "socket_path_fits",
    "token_fits_a_header",
    "unknown_settings",
]
