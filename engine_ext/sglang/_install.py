"""Apply (and, for tests, undo) the patch table, once per process.

:func:`install` reads the settings (``KVSIDECAR_*``) unless given, does
nothing when ``KVSIDECAR_ENABLE`` is off, refuses an SGLang outside every
patch's version range, then applies :data:`._patches.PATCHES`. Calling it
again is a no-op; nothing is patched at import time.

Thread: the process's main thread, before SGLang builds its engine/scheduler.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

from pydantic import SecretStr

from .. import EngineSettings, load_engine_settings
from .._errors import EngineExtConfigError
from ._cpu_imports import prepare_cpu_imports
from ._patches import PATCHES, Patch, Session
from ._version import check_version, installed_sglang_version

__all__ = ["export_settings", "install", "installed_patches", "uninstall"]

_lock = threading.Lock()
_applied: list[tuple[Patch, Any, Any]] = []  # (patch, owner class, original attribute)
_session: Session | None = None


def install(settings: EngineSettings | None = None, *, version: str | None = None) -> bool:
    """Patch SGLang for kvsidecar. Returns False (and patches nothing) when disabled.

    ``version`` overrides the installed version (tests of the guard).
    Raises :class:`EngineExtConfigError` for an unsupported SGLang.
    """
    global _session
    explicit = settings is not None
    settings = settings if settings is not None else load_engine_settings()
    if not settings.enable:
        return False
    engine_version = version if version is not None else installed_sglang_version()
    parsed = check_version(engine_version)
    for patch in PATCHES:
        if not patch.versions.contains(parsed, prereleases=True):
            raise EngineExtConfigError(
                f"SGLang {engine_version} is outside the range of patch {patch.target} "
                f"(sglang{patch.versions}); kvsidecar refuses to start half-patched")
    with _lock:
        if _session is not None:
            return True
        if explicit:
            export_settings(settings)  # spawned scheduler processes read the environment
        prepare_cpu_imports()
        session = Session(settings, engine_version, [])
        resolved = [(p, _owner(p)) for p in PATCHES]  # resolve all before changing any
        for patch, owner in resolved:
            original = owner.__dict__[patch.attr]
            replacement = patch.wrap(original.__func__ if patch.static else original, session)
            setattr(owner, patch.attr, staticmethod(replacement) if patch.static else replacement)
            _applied.append((patch, owner, original))
        _session = session
    return True


def export_settings(settings: EngineSettings) -> None:
    """Write ``settings`` to ``KVSIDECAR_*`` so processes SGLang spawns read the same ones."""
    for name, value in settings.model_dump(exclude_none=True).items():
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        os.environ[f"KVSIDECAR_{name.upper()}"] = str(value)


def uninstall() -> None:
    """Restore every patched attribute and close the pools attached in this process."""
    global _session
    with _lock:
        while _applied:
            patch, owner, original = _applied.pop()
            setattr(owner, patch.attr, original)
        if _session is not None:
            for pool in _session.pools:
                pool.close()
        _session = None


def installed_patches() -> list[str]:
    """Targets patched in this process, in order."""
    return [patch.target for patch, _, _ in _applied]


def _owner(patch: Patch) -> Any:
    try:
        module = importlib.import_module(patch.module)
        owner = getattr(module, patch.owner)
    except (ImportError, AttributeError) as exc:
        raise EngineExtConfigError(
            f"cannot patch {patch.target}: {exc}; this SGLang does not match sglang"
            f"{patch.versions}") from exc
    if patch.attr not in owner.__dict__:
        raise EngineExtConfigError(
            f"{patch.target} does not exist in this SGLang; supported: sglang{patch.versions}")
    return owner
