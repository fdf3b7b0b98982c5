"""Every ``KVSIDECAR_*`` variable a part of kvsidecar reads, so a misspelt one is noticed.

The settings classes ignore variables they do not declare (the sidecar, the engines and
kvctl share the prefix and often one environment), so ``KVSIDECAR_HEARTBEAT_TIMEOUT=3``
(without ``_S``) used to be dropped without a word. ``tests/unit/test_settings_names.py``
holds this list to the settings classes' fields.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

__all__ = ["KNOWN_SETTINGS", "unknown_settings"]

_PREFIX = "KVSIDECAR_"

_NAMES = (
    # the engine extension (engine_ext.EngineSettings)
    "ENABLE",
    "INSTANCE_ID",
    "SIDECAR_URL",
    "TOKEN",
    "RUNTIME_DIR",
    "LIMIT",
    "RECLAIM",
    "THREAD_GUARD",
    "RESERVE_PAGES",
    "MAX_EVICT_PAGES_PER_STEP",
    "VIRTUAL_KV_BYTES",
    "HEARTBEAT_S",
    "REPORT_INTERVAL_S",
    "DEVICE_ID",
    "REGISTER_TIMEOUT_S",
    "RESERVE_OUTPUT",
    # the vLLM adapter (VllmSettings) and the CPU harness's rank processes
    "PAGE_BYTES",
    "MAX_CACHED_TOKENS",
    "STUB_TP",
    "STUB_PP",
    "RANK_BARRIER_WAIT_S",
    "RANK_TIMEOUT_S",
    "RANK_SEND_TIMEOUT_S",
    "HARNESS_ASYNC_SCHEDULING",
    # the sidecar (sidecar.SidecarSettings)
    "HOST",
    "PORT",
    "DB_PATH",
    "HEARTBEAT_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "MAX_WAIT_S",
    "PUSH_TIMEOUT_S",
    "PUSH_BACKOFF_INITIAL_S",
    "PUSH_BACKOFF_MAX_S",
    "MAX_INSTANCES",
    "FORGET_AFTER_S",
    "HEADER_TIMEOUT_S",
    "BODY_TIMEOUT_S",
    "KEEPALIVE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_WAITS",
    "LOG_LEVEL",
    "SHUTDOWN_GRACE_S",
    "LOG_FORMAT",
    "AUTOPILOT_INTERVAL_S",
    "AUTOPILOT_HYSTERESIS",
    "AUTOPILOT_BUSY_HOLD_S",
    "AUTOPILOT_DRY_RUN",
    # kvctl; scripts/dev.sh's cache; the test suite's knobs
    "URL",
    "CACHE",
    "SOAK",
    "FAKECUDA",
)
#: the full names (``KVSIDECAR_`` and one of ``_NAMES``)
KNOWN_SETTINGS: frozenset[str] = frozenset(_PREFIX + name for name in _NAMES)


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """One line per ``KVSIDECAR_*`` variable in ``environ`` that no part of kvsidecar reads
    (any case, as the settings read them), naming the closest known one."""
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(_PREFIX) or upper in KNOWN_SETTINGS:
            continue
        # compared without the prefix, which every name shares
        close = difflib.get_close_matches(upper.removeprefix(_PREFIX), _NAMES, n=1, cutoff=0.6)
        hint = f"; did you mean {_PREFIX}{close[0]}?" if close else ""
        lines.append(f"{name} is not a kvsidecar setting, so it is ignored{hint}")
    return lines
