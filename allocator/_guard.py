"""Enforcement of the one rule: only the engine thread mutates allocator state."""

from __future__ import annotations

import threading
from typing import ClassVar

from ._errors import ForeignThreadError


class ThreadGuard:
    """Records the thread that owns some state and rejects mutations from others.

    Owns only the owner's thread id. ``check()`` costs one attribute read when
    disabled and one ``threading.get_ident()`` compare when enabled, so it can
    sit on every mutating call. The first ``check()`` (or ``bind_current()``)
    makes the calling thread the owner.

    ``enabled=None`` takes the process default at construction: off, unless
    :meth:`set_default_enabled` turned it on (tests do). Engines pass
    ``enabled`` from ``KVSIDECAR_THREAD_GUARD`` (``EngineSettings.new_thread_guard``).

    Any thread may construct a guard; ``bind_current`` and ``check`` are meant
    for the owning thread (a foreign ``check`` raises, which is the point).
    """

    _default_enabled: ClassVar[bool] = False

    def __init__(self, name: str, *, enabled: bool | None = None) -> None:
        self.name = name
        self.enabled = ThreadGuard._default_enabled if enabled is None else enabled
        self.owner_ident: int | None = None
        self._owner_name = ""

    @staticmethod
    def set_default_enabled(flag: bool) -> None:
        """Turn the guard on or off for every guard constructed with ``enabled=None`` later."""
        ThreadGuard._default_enabled = bool(flag)

    def bind_current(self) -> None:
        """Make the calling thread the owner (e.g. when the engine loop starts)."""
        self.owner_ident = threading.get_ident()
        self._owner_name = threading.current_thread().name

    def check(self) -> None:
        """Raise :class:`ForeignThreadError` if enabled and the caller is not the owner."""
        if not self.enabled:
            return
        ident = threading.get_ident()
        if ident == self.owner_ident:
            return
        if self.owner_ident is None:
            self.bind_current()
            return
        raise ForeignThreadError(
            f"{self.name} is owned by thread {self._owner_name!r} ({self.owner_ident}) but "
            f"thread {threading.current_thread().name!r} ({ident}) tried to change it; publish a "
            "target through the LimitMailbox and let the engine thread apply it"
        )
