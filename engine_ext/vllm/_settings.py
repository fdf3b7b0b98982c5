"""Settings of the vLLM adapter (env prefix ``KVSIDECAR_``), read once per process.

Core settings (the ``enable`` switch, instance id, sidecar URL, socket
directory, reclaim switch, thread guard, ...) live in ``engine_ext.EngineSettings``; this class adds what
only the vLLM adapter reads. Both read the same environment, so one
``KVSIDECAR_*`` set configures an engine.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine_ext._settings import settings_error
from engine_ext.protocol import parse_size

__all__ = ["VllmSettings", "load_vllm_settings"]

Size = Annotated[int, BeforeValidator(parse_size)]


class VllmSettings(BaseSettings):
    """vLLM adapter settings; construct in ``register()``/the executor, pass down."""

    model_config = SettingsConfigDict(env_prefix="KVSIDECAR_", extra="ignore")

    #: Bytes of one mapping page in one KV region (CPU harness; 64 KiB = 16 blocks of
    #: 16 tokens for the tiny model). On GPU the CUDA granularity (2 MiB) is the minimum.
    page_bytes: Size = Field(default=64 << 10, gt=0)
    #: Bound on prefix-cache tokens kept after their requests finish:
    #: -1 unlimited (vLLM's behaviour), 0 evict on free, N keep at most N tokens.
    max_cached_tokens: int = Field(default=-1, ge=-1)


def load_vllm_settings() -> VllmSettings:
    """Read ``KVSIDECAR_*`` now; a bad value raises a config error naming the variable."""
    try:
        return VllmSettings()
    except ValidationError as exc:
        raise settings_error(exc, "vLLM") from None
