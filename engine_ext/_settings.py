"""Settings of the engine extension, read from ``KVSIDECAR_*`` variables."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from allocator import ThreadGuard

from ._errors import EngineExtConfigError
from .protocol import (
    DEVICE_ID_PATTERN,
    ID_PATTERN,
    parse_limit,
    parse_size,
    sidecar_url_problem,
    token_fits_a_header,
    unknown_settings,
)

__all__ = ["EngineSettings", "load_engine_settings", "settings_error"]

_log = logging.getLogger("engine_ext.settings")


def _limit(value: Any) -> int | None:
    return parse_limit(value)


def _size(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    return parse_size(value)


class EngineSettings(BaseSettings):
    """Everything the engine extension reads from the environment.

    Read once by :func:`load_engine_settings` (from the plugin's entry point),
    never at import time, and passed down.
    """

    model_config = SettingsConfigDict(env_prefix="KVSIDECAR_", extra="ignore", frozen=True)

    enable: bool = False  # off: the adapter leaves the engine untouched
    instance_id: str | None = None  # None: "<engine>-<pid>"
    sidecar_url: str | None = None  # None: no sidecar (control socket / in-process API only)
    token: SecretStr | None = None  # bearer token for the sidecar's engine endpoints
    runtime_dir: Path | None = None  # None: $XDG_RUNTIME_DIR/kvsidecar or /tmp/kvsidecar-<uid>
    limit: Annotated[int | None, BeforeValidator(_limit)] = None  # start-up limit, e.g. "4G"
    reclaim: bool = True  # False: record limits but never evict (baseline)
    thread_guard: bool = False  # raise on allocator mutation from a foreign thread
    reserve_pages: int = Field(default=0, ge=0)  # pre-mapped free pages (adapters pass it on)
    max_evict_pages_per_step: int | None = Field(default=None, ge=1)  # None: whole overage
    #: Virtual KV capacity of this engine (GPU path, docs/overcommit.md): the engine sizes
    #: its KV cache for this many bytes whatever its physical share; pages are mapped on
    #: demand up to the limit. None: the device's total memory.
    virtual_kv_bytes: Annotated[int | None, BeforeValidator(_size)] = Field(default=None, gt=0)
    # at least 50 ms: each beat is a POST that costs the engine process 2-3 ms of CPU
    heartbeat_s: float = Field(default=5.0, ge=0.05, le=3600)
    #: The shortest time between two reports to the sidecar that change only figures
    #: (mapped bytes, evictable/pinned, demand counts): under traffic mapped bytes move
    #: with nearly every page, and each report costs the engine process a POST (2-3 ms of
    #: its CPU on the CI host, under the GIL its busy loop needs; bench/bench_reports.py).
    #: A change of status, revision, reason or waiting reason is reported at once. 0:
    #: every change at once (docs/limits.md, "Retained limits and start-up").
    report_interval_s: float = Field(default=0.5, ge=0, le=60)
    #: The device this engine's ranks use, sent at registration (docs/autopilot.md): a GPU
    #: UUID, ``node1-gpu0``, or a named host device on CPU. None: derived from the pool's
    #: backend (the CUDA device UUID on a GPU, ``host-<hostname>`` on CPU; engine_ext._device_id).
    device_id: str | None = Field(default=None, pattern=DEVICE_ID_PATTERN)
    register_timeout_s: float = Field(default=10.0, ge=0, le=600)
    #: Admit a request under a limit only if its whole output (``max_tokens``) fits beside
    #: what the running requests may still add; ``applied`` then includes that growth
    #: (docs/limits.md, "Output reservation"). For engines on a budgeted device.
    reserve_output: bool = False

    @field_validator("enable", mode="before")
    @classmethod
    def _empty_is_off(cls, value: Any) -> Any:
        # an empty KVSIDECAR_ENABLE (a compose ${VAR} left unset) is off, not a bad boolean
        return False if isinstance(value, str) and not value.strip() else value

    @field_validator("instance_id")
    @classmethod
    def _check_id(cls, value: str | None) -> str | None:
        if value is not None and not re.match(ID_PATTERN, value):
            raise ValueError(
                f"{value!r} is not a valid instance id: use 1-63 letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
        return value

    @field_validator("token")
    @classmethod
    def _strip_token(cls, value: SecretStr | None) -> SecretStr | None:
        # the sidecar and kvctl strip surrounding whitespace the same way
        if value is None or not value.get_secret_value().strip():
            return None
        stripped = value.get_secret_value().strip()
        if not token_fits_a_header(stripped):  # httpx could not send it (UnicodeEncodeError)
            raise ValueError("must be printable ASCII without spaces or control characters")
        return SecretStr(stripped)

    @field_validator("runtime_dir", mode="before")
    @classmethod
    def _check_runtime_dir(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError(
                "KVSIDECAR_RUNTIME_DIR is empty (that would be the current directory): set "
                "it to a private directory, or unset it for the default"
            )
        return value

    @field_validator("sidecar_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        value = value.strip()
        problem = sidecar_url_problem(value)
        if problem is not None:
            raise ValueError(f"{value!r} {problem} (e.g. http://127.0.0.1:8570)")
        return value.rstrip("/")

    def new_thread_guard(self, name: str) -> ThreadGuard:
        """The guard for an adapter's allocators: the one place ``KVSIDECAR_THREAD_GUARD`` acts.

        On when the setting asks; otherwise the process default (off, unless
        tests switched it on for the whole process).
        """
        return ThreadGuard(name, enabled=self.thread_guard or None)

    def resolved_instance_id(self, engine: str) -> str:
        """The instance id, defaulting to ``<engine>-<pid>``."""
        return self.instance_id or f"{engine}-{os.getpid()}"

    def resolved_runtime_dir(self) -> Path:
        """Where per-instance runtime directories (sockets) live."""
        if self.runtime_dir is not None:
            return self.runtime_dir.absolute()
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg:
            return Path(xdg) / "kvsidecar"
        return Path(f"/tmp/kvsidecar-{os.getuid()}")


def load_engine_settings(**overrides: Any) -> EngineSettings:
    """Read ``KVSIDECAR_*`` now; keyword overrides win. Bad values raise a config error,
    unless the extension is off (``KVSIDECAR_ENABLE`` unset or false and itself valid).

    With the extension off nothing reads the other values, so a bad one must not stop
    the engine: vLLM calls the plugin in every process of every ``vllm serve`` on a host
    where kvsidecar is installed, and a refusal there ended vLLM. The bad fields then take
    their defaults and one warning names them.
    """
    _warn_unknown_once()
    try:
        return EngineSettings(**overrides)
    except ValidationError as exc:
        off = _disabled_despite(exc, overrides)
        if off is None:
            raise settings_error(exc, "engine") from None
        _log.warning(
            "kvsidecar is off (KVSIDECAR_ENABLE): ignoring %s", settings_error(exc, "engine")
        )
        return off


_warned: set[str] = set()  # unknown variables already logged by this process


def _warn_unknown_once() -> None:
    """Log each ``KVSIDECAR_*`` variable no part of kvsidecar reads, once per process, on
    or off: ``KVSIDECAR_ENABLED=1`` (a typo) leaves the extension off without a word."""
    for line in unknown_settings(os.environ):
        if line not in _warned:
            _warned.add(line)
            _log.warning(line)


def _disabled_despite(exc: ValidationError, overrides: dict[str, Any]) -> EngineSettings | None:
    """The settings with the fields ``exc`` refused at their defaults, if that leaves the
    extension off; None if it is on, or if ``enable`` itself is what was refused."""
    fields = EngineSettings.model_fields
    bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
    if not bad or "enable" in bad or not bad <= fields.keys():
        return None
    defaults = {name: fields[name].get_default(call_default_factory=True) for name in bad}
    try:
        settings = EngineSettings(**{**overrides, **defaults})
    except ValidationError:
        return None
    return None if settings.enable else settings


def settings_error(exc: ValidationError, what: str) -> EngineExtConfigError:
    """The one message for bad ``KVSIDECAR_*`` values: each variable with what is wrong."""
    problems = "; ".join(
        f"KVSIDECAR_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in exc.errors()
    )
    return EngineExtConfigError(
        f"bad kvsidecar {what} settings: {problems} (fix or unset these variables)"
    )
