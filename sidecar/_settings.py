"""Settings of the sidecar service (``kvsidecar serve``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine_ext.protocol import token_fits_a_header, unknown_settings

__all__ = ["SidecarSettings", "default_db_path", "unknown_variables"]


def default_db_path() -> Path:
    """``$XDG_STATE_HOME/kvsidecar/sidecar.db`` (``~/.local/state/kvsidecar/sidecar.db``)."""
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "kvsidecar" / "sidecar.db"


def unknown_variables() -> list[str]:
    """One line per ``KVSIDECAR_*`` variable set here that no part of kvsidecar reads (a
    typo, which the settings would ignore), to log at start."""
    return unknown_settings(os.environ)


class SidecarSettings(BaseSettings):
    """Everything the service reads from its environment (``KVSIDECAR_*``).

    Read once, in the app factory or the CLI, and passed down; nothing else
    reads the environment.
    """

    model_config = SettingsConfigDict(env_prefix="KVSIDECAR_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"  # loopback by default: expose on purpose, with a token
    port: int = Field(default=8570, ge=0, le=65535)
    db_path: Path = Field(default_factory=default_db_path)
    token: SecretStr | None = None  # bearer token for every mutating endpoint
    heartbeat_timeout_s: float = Field(
        default=15.0, gt=0, le=86400
    )  # no report for this long: unreachable
    max_body_bytes: int = Field(default=64 * 1024, ge=256)  # larger bodies get 413
    max_wait_s: float = Field(default=300.0, gt=0, le=300.0)  # cap for ?wait=
    push_timeout_s: float = Field(default=5.0, gt=0, le=600)  # one push to an engine control socket
    push_backoff_initial_s: float = Field(default=0.05, ge=0.001)  # first retry delay
    push_backoff_max_s: float = Field(default=5.0, gt=0, le=3600)  # retry delay cap
    max_instances: int = Field(default=1024, ge=1)  # new ids beyond this get 409
    # forget an instance whose engine has been stopped or unreachable this long (seconds;
    # 0: never, the default; at least 1, at most ~10 years). docs/sidecar.md, "Retention"
    forget_after_s: float = Field(default=0.0, ge=0, le=3.2e8)
    header_timeout_s: float = Field(
        default=10.0, gt=0, le=600
    )  # a request's headers must arrive by then
    body_timeout_s: float = Field(
        default=10.0, gt=0, le=600
    )  # ... and its body this long after them
    # an idle keep-alive connection closes after this; well above the engines' heartbeat
    # (5 s) so each engine keeps one connection (idle ones are closed first at the cap)
    keepalive_timeout_s: int = Field(default=75, ge=1)
    max_connections: int = Field(default=256, ge=8)  # open connections; more are closed at once
    # clients waiting in the app at once (?wait= long-polls, ?watch=1 streams); more get 503.
    # Unset: half of max_connections, so engine reports and writes always find a connection
    max_waits: int | None = Field(default=None, ge=1)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    # on SIGTERM/SIGINT: how long open long-polls and event streams may go on before they
    # are cut (without it a connected dashboard keeps the process up for max_wait_s)
    shutdown_grace_s: int = Field(default=5, ge=0, le=300)  # seconds (uvicorn takes an int)
    log_format: Literal["text", "json"] = "text"  # json: one object per line (ours and uvicorn's)
    # -- the autopilot (docs/autopilot.md): devices with a budget get their limits from it --
    # most seconds between passes; at least 10 ms (a pass is work on the event loop)
    autopilot_interval_s: float = Field(default=0.2, ge=0.01, le=60)
    # a policy change smaller than this fraction of the budget (and a page) is not written
    autopilot_hysteresis: float = Field(default=0.05, ge=0, le=0.5)
    # an instance stays "busy" (in the share of the spare memory) this long after its last
    # running or waiting request, so a short gap between requests does not move memory
    autopilot_busy_hold_s: float = Field(default=3.0, ge=0, le=3600)
    autopilot_dry_run: bool = False  # every device: compute and show, write nothing

    @field_validator("db_path", mode="before")
    @classmethod
    def _db_path_not_blank(cls, value: object) -> object:
        # Path("") is "." (the working directory): an unset variable in a compose file or
        # a unit would otherwise point the store at a directory
        if isinstance(value, str) and not value.strip():
            raise ValueError(
                "KVSIDECAR_DB_PATH is empty; unset it for the default "
                "(~/.local/state/kvsidecar/sidecar.db) or name a file"
            )
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_any_case(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("host")
    @classmethod
    def _host_not_blank(cls, value: str) -> str:
        # uvicorn binds an empty host on every interface (0.0.0.0 and ::): an empty
        # KVSIDECAR_HOST (a compose ${VAR} that was not set) must not expose the sidecar
        if not value.strip():
            raise ValueError(
                "empty: that would listen on every interface; unset KVSIDECAR_HOST for "
                "loopback (127.0.0.1), or name the address (0.0.0.0 for all, on purpose)"
            )
        return value.strip()

    @field_validator("token")
    @classmethod
    def _token_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        # surrounding whitespace (a trailing newline from a file or a secret) is never part
        # of the token: every side (sidecar, engines, kvctl) strips it the same way
        stripped = value.get_secret_value().strip()
        if not stripped:
            return None  # an empty KVSIDECAR_TOKEN means "no token", not "the empty token"
        if not token_fits_a_header(stripped):
            raise ValueError(
                "KVSIDECAR_TOKEN must be printable ASCII without spaces or control characters"
            )
        return SecretStr(stripped)

    @property
    def wait_slots(self) -> int:
        """How many clients may wait at once: ``max_waits``, or half the connections."""
        return self.max_waits if self.max_waits is not None else self.max_connections // 2

    @model_validator(mode="after")
    def _waits_within_connections(self) -> SidecarSettings:
        if self.max_waits is not None and self.max_waits > self.max_connections:
            raise ValueError(
                f"KVSIDECAR_MAX_WAITS ({self.max_waits}) must not exceed "
                f"KVSIDECAR_MAX_CONNECTIONS ({self.max_connections}); leave it unset for half "
                "the connections, so engine reports always find one"
            )
        return self

    @field_validator("forget_after_s")
    @classmethod
    def _forget_after_off_or_a_second(cls, value: float) -> float:
        if 0 < value < 1:
            raise ValueError(
                "must be 0 (never forget on its own) or at least 1 second; a few seconds "
                "would forget an engine that merely restarts"
            )
        return value

    @model_validator(mode="after")
    def _backoff_order(self) -> SidecarSettings:
        if self.push_backoff_initial_s > self.push_backoff_max_s:
            raise ValueError(
                "KVSIDECAR_PUSH_BACKOFF_INITIAL_S must not exceed KVSIDECAR_PUSH_BACKOFF_MAX_S"
            )
        return self
