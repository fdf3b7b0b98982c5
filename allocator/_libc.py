"""The few libc calls the host backend needs, through ctypes.

Python's :mod:`mmap` module cannot map ``PROT_NONE`` nor change protection,
and :func:`os.posix_fallocate` cannot punch holes, so ``mmap``, ``mprotect``,
``munmap`` and ``fallocate`` are called directly. The two per-page calls
(``mprotect``, ``fallocate``) go through ``allocator._speedups`` when it is
built (the same libc calls, without ctypes' per-call argument conversion).
Every failure becomes a :class:`~allocator.BackendError` carrying ``errno``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource

from ._errors import BackendError

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_NORESERVE = 0x4000
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
)
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_mprotect = _libc.mprotect
_mprotect.restype = ctypes.c_int
_mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_fallocate = _libc.fallocate64
_fallocate.restype = ctypes.c_int
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


try:  # mprotect and fallocate in C (allocator/_speedups.c): a ctypes call costs ~20x more
    from ._speedups import fallocate as _errno_of_fallocate
    from ._speedups import mprotect as _errno_of_mprotect
except ImportError:  # not built: the same calls through ctypes

    def _errno_of_mprotect(addr: int, length: int, prot: int) -> int:
        return 0 if _mprotect(addr, length, prot) == 0 else ctypes.get_errno()

    def _errno_of_fallocate(fd: int, mode: int, offset: int, length: int) -> int:
        return 0 if _fallocate(fd, mode, offset, length) == 0 else ctypes.get_errno()


def _fail(call: str, detail: str, err: int | None = None) -> BackendError:
    if err is None:
        err = ctypes.get_errno()
    return BackendError(f"{call}({detail}) failed: {os.strerror(err)} (errno {err})", errno=err)


def reserve_file(fd: int, length: int) -> int:
    """Map all of ``fd`` shared but inaccessible (``PROT_NONE``): a reservation with no memory."""
    addr = _mmap(None, length, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        failed = _fail("mmap", f"reserve {length} bytes of fd {fd} PROT_NONE", err)
        if err == errno.ENOMEM:  # a reservation takes no memory: the address space is short
            limit = resource.getrlimit(resource.RLIMIT_AS)[0]
            shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
            raise BackendError(
                f"{failed}; the reservation takes address space, not memory: the process's "
                f"address-space limit (ulimit -v, RLIMIT_AS: {shown}) or the kernel's "
                "overcommit policy refused it. Raise the limit, or reserve a smaller KV "
                "cache (KVSIDECAR_VIRTUAL_KV_BYTES, or the engine's KV cache size)",
                errno=err,
            )
        raise failed
    return int(addr)


def open_range(addr: int, length: int) -> None:
    """Make a reserved range readable and writable (``mprotect`` RW)."""
    err = _errno_of_mprotect(addr, length, PROT_READ | PROT_WRITE)
    if err:
        raise _fail("mprotect", f"{addr:#x}, {length} bytes, read/write", err)


def close_range(addr: int, length: int) -> None:
    """Make a range inaccessible again (``mprotect`` PROT_NONE)."""
    err = _errno_of_mprotect(addr, length, PROT_NONE)
    if err:
        raise _fail("mprotect", f"{addr:#x}, {length} bytes, PROT_NONE", err)


def unreserve(addr: int, length: int) -> None:
    """Give the address range back (``munmap``)."""
    if _munmap(addr, length) != 0:
        raise _fail("munmap", f"{addr:#x}, {length} bytes")


def commit(fd: int, offset: int, length: int) -> None:
    """Allocate memory for a file range now (``fallocate`` mode 0)."""
    err = _errno_of_fallocate(fd, 0, offset, length)
    if err:
        raise _fail("fallocate", f"fd {fd}, commit {length} bytes at {offset}", err)


def punch(fd: int, offset: int, length: int) -> None:
    """Free the memory of a file range (``fallocate`` PUNCH_HOLE|KEEP_SIZE)."""
    err = _errno_of_fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
    if err:
        raise _fail("fallocate", f"fd {fd}, punch {length} bytes at {offset}", err)
