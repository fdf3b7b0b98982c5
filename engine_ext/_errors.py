"""Errors raised by the engine-extension core.

::

    EngineExtError                  base: catch this to catch everything below
    ├── EngineExtConfigError        bad settings or runtime dir; fatal at start-up, fix the config
    └── EngineExtContractError      a caller bug: a bad limit or revision from in-process code

Allocator errors (:class:`allocator.AllocatorError`, including
``ForeignThreadError``) pass through unchanged: they already say what broke.
"""

from __future__ import annotations


class EngineExtError(Exception):
    """Base of every error raised by the engine-extension core."""


class EngineExtConfigError(EngineExtError):
    """Settings or the runtime directory cannot work. Raised at start-up."""


class EngineExtContractError(EngineExtError, ValueError):
    """An in-process caller passed a value the core cannot accept."""
