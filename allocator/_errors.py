"""Errors raised by the allocator package.

::

    AllocatorError                  base: catch this to catch everything below
    ├── AllocatorConfigError        bad layout or sizes; fatal at start-up, fix the config
    ├── BackendError                an OS or driver call failed (errno / CUresult inside)
    │   └── DeviceOutOfMemory       the device has no memory for a map right now
    └── AllocatorContractError      a caller bug: double free, double map, bad id
        └── ForeignThreadError      a mutation from a thread that does not own the allocator

Lower-layer failures (``OSError`` from libc, ``CUresult`` codes) are translated
into :class:`BackendError` once, at the backend boundary.
"""

from __future__ import annotations


class AllocatorError(Exception):
    """Base of every error raised by :mod:`allocator`."""


class AllocatorConfigError(AllocatorError):
    """A layout or size that cannot work. Raised before anything is reserved."""


class BackendError(AllocatorError):
    """An OS or driver call failed.

    ``errno`` is set when the failure came from libc (``ENOMEM``/``ENOSPC``
    mean the memory is not there right now: retry later or lower a limit).
    ``fatal`` says that no retry can succeed (e.g. a TP/PP rank died): the
    allocation path raises it instead of treating it as a refusal.
    """

    def __init__(self, message: str, *, errno: int | None = None, fatal: bool = False) -> None:
        super().__init__(message)
        self.errno = errno
        self.fatal = fatal


class DeviceOutOfMemory(BackendError):
    """The device could not back a map (``CUDA_ERROR_OUT_OF_MEMORY``); nothing was mapped.

    Not a bug: free device memory (lower another engine's limit, empty a cache)
    and retry, or lower this engine's limit.
    """


class AllocatorContractError(AllocatorError):
    """The caller broke the allocator's contract (a bug in the caller)."""


class ForeignThreadError(AllocatorContractError):
    """A thread other than the owner tried to mutate allocator state."""
