"""Errors raised by the engine-extension core.

::

    EngineExtError                  base: catch this to catch everything below
    ├── EngineExtConfigError        every start-up refusal: bad settings, runtime dir, an engine
    │   │                           set-up or version kvsidecar does not support; the message
    │   │                           says the reason and the fix
    │   └── UnsupportedEngineError  (engine_ext._patching) the engine does not match a patch table
    └── EngineExtContractError      a caller bug: a bad limit or revision from in-process code

Allocator errors (:class:`allocator.AllocatorError`, including
``ForeignThreadError``) pass through unchanged: they already say what broke.
"""

from __future__ import annotations


class EngineExtError(Exception):
    """Base of every error raised by the engine-extension core."""


class EngineExtConfigError(EngineExtError):
    """kvsidecar refuses to start: settings, runtime directory or engine set-up cannot work.

    Every start-up refusal of the core and the adapters is this class or a
    subclass, and its message names the reason and the fix (a setting to
    change, an engine option to drop, or ``KVSIDECAR_ENABLE=0``).
    """


class EngineExtContractError(EngineExtError, ValueError):
    """An in-process caller passed a value the core cannot accept."""
