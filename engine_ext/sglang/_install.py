"""Apply (and, for tests, undo) the SGLang tables, once per process; the scheduler entry.

:func:`install` reads the settings (``KVSIDECAR_*``) unless given, does
nothing when ``KVSIDECAR_ENABLE`` is off, refuses an SGLang outside the
supported range, then applies :data:`._patches.PATCHES` after checking every
patch and :data:`._patches.TOUCHES` target (all or nothing, see
:mod:`engine_ext._patching`). Calling it again is a no-op; nothing is patched
at import time.

SGLang starts schedulers with the ``spawn`` method, so a spawned process
imports its target by name and sees none of the parent's patches. The
parent's ``Engine.run_scheduler_process_func`` (and the launcher's
``launch_server`` argument) therefore point to :func:`run_scheduler_process`:
install in that process (settings from the inherited ``KVSIDECAR_*``
environment), then run SGLang's own ``run_scheduler_process`` unchanged.

Thread: the process's main thread, before SGLang builds its engine/scheduler.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from pydantic import SecretStr

from .. import EngineSettings, load_engine_settings
from .._patching import AppliedPatches, apply_patches
from ._cpu_imports import prepare_cpu_imports
from ._patches import PATCHES, TOUCHES, Session
from ._version import check_version, installed_sglang_version

__all__ = ["export_settings", "install", "installed_patches", "run_scheduler_process", "uninstall"]

_lock = threading.Lock()
_applied: AppliedPatches | None = None
_session: Session | None = None


def install(settings: EngineSettings | None = None, *, version: str | None = None) -> bool:
    """Patch SGLang for kvsidecar. Returns False (and patches nothing) when disabled.

    ``version`` overrides the installed version (tests of the guard).
    Raises :class:`EngineExtConfigError` for an unsupported SGLang.
    """
    global _applied, _session
    explicit = settings is not None
    settings = settings if settings is not None else load_engine_settings()
    if not settings.enable:
        return False
    engine_version = version if version is not None else installed_sglang_version()
    check_version(engine_version)
    with _lock:
        if _session is not None:
            return True
        if explicit:
            export_settings(settings)  # spawned scheduler processes read the environment
        prepare_cpu_imports()
        session = Session(settings, engine_version, run_scheduler_process)
        _applied = apply_patches("SGLang", engine_version, PATCHES, TOUCHES, context=session)
        _session = session
    return True


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """Install kvsidecar in this scheduler process, then run SGLang's scheduler."""
    install()
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    return sglang_run(*args, **kwargs)


def export_settings(settings: EngineSettings) -> None:
    """Write ``settings`` to ``KVSIDECAR_*`` so processes SGLang spawns read the same ones."""
    for name, value in settings.model_dump(exclude_none=True).items():
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        os.environ[f"KVSIDECAR_{name.upper()}"] = str(value)


def uninstall() -> None:
    """Restore every patched attribute and close the pools attached in this process."""
    global _applied, _session
    with _lock:
        if _applied is not None:
            _applied.undo()
        _applied = None
        if _session is not None:
            for runtime in _session.runtimes:
                runtime.close()
        _session = None


def installed_patches() -> list[str]:
    """Targets patched in this process, in order."""
    return [] if _applied is None else _applied.targets
