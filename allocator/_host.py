"""Host-memory backend: a memfd behind a PROT_NONE reservation.

Why a memfd: its pages are shared memory that ``fallocate`` commits and
``fallocate(PUNCH_HOLE)`` returns, so what the allocator maps is what
``/proc`` and ``fstat`` show, and another process (a TP rank, a test) can map
the same pages through ``/proc/<pid>/fd/<fd>``.

Mechanism: the reservation is one ``MAP_SHARED`` mapping of the whole memfd
with ``PROT_NONE`` (address space, no memory). ``map`` = ``fallocate`` (commit,
as ``cuMemCreate`` commits on a GPU) + ``mprotect(READ|WRITE)``; ``unmap`` =
``mprotect(PROT_NONE)`` + ``fallocate(PUNCH_HOLE|KEEP_SIZE)``, which frees the
pages and zaps them from every process's page tables. This keeps the same
observable contract as re-``mmap``-ing each page with ``MAP_FIXED`` but is
about 1.5x cheaper per page in the kernel (no VMA replacement), see
``bench/bench_allocator.py``.

File layout equals reservation layout: region ``r`` page ``p`` lives at
``layout.page_offset(r, p)`` both in the file and from ``base_address``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

from . import _libc
from ._errors import AllocatorConfigError, AllocatorContractError, BackendError
from ._layout import PageLayout, check_granularity
from ._pageset import check_pages, runs

if TYPE_CHECKING:
    import torch

__all__ = ["HostBackend"]


class HostBackend:
    """Pages of a memfd made accessible on demand inside one reserved address range.

    Owns the memfd (``fd``), the reservation at ``base_address`` and the
    per-page mapped flags of *this* process. The creating process (the owner)
    commits memory on ``map`` and punches it out on ``unmap``; an attached
    process only maps and unmaps its own view, never frees the owner's memory
    (so every attached view of a page must be unmapped before the owner unmaps
    it, or the view reads zeros and a write there commits memory again).

    Not thread-safe: call from the thread that owns the allocator.
    Tensors from :meth:`tensor` must not be touched on unmapped pages
    (``SIGSEGV``) nor after :meth:`release`.
    """

    layout: PageLayout
    base_address: int
    fd: int
    fd_path: str

    def __init__(self, layout: PageLayout, fd: int, *, owner: bool) -> None:
        """Use :meth:`reserve` or :meth:`attach`; this adopts an open memfd."""
        self.layout = layout
        self.fd = fd
        self.fd_path = f"/proc/{os.getpid()}/fd/{fd}"
        self.owner = owner
        self._mapped = bytearray(layout.num_pages)  # 1 where this process maps the page
        self._num_mapped = 0  # sum(self._mapped), kept per call
        # Pages whose map failed and whose rollback failed too: some region may still be
        # open (and, for the owner, committed) although the page is *not* mapped for the
        # caller (a failed map maps nothing). The next map of the page, trim_spares() and
        # release() drop what is left.
        self._stuck: set[int] = set()
        self._released = False
        self.base_address = _libc.reserve_file(fd, layout.total_bytes)
        # Frees the range, the memory and the fd if the backend is dropped without
        # release(); tensors from tensor() keep the backend alive, so this never pulls
        # memory from under a live view.
        self._finalizer = weakref.finalize(
            self, _free_resources, self.base_address, layout.total_bytes, fd, owner
        )
        self._finalizer.atexit = False

    # ------------------------------------------------------------------ life cycle
    @classmethod
    def reserve(cls, layout: PageLayout, *, name: str = "kvsidecar") -> HostBackend:
        """Create a memfd of ``layout.total_bytes`` (no memory yet) and reserve its range."""
        check_granularity(layout, mmap.PAGESIZE, "host page size")
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"memfd_create({name!r}) failed: {exc}", errno=exc.errno) from exc
        try:
            try:
                os.ftruncate(fd, layout.total_bytes)
            except OSError as exc:  # e.g. EFBIG under RLIMIT_FSIZE
                raise BackendError(
                    f"cannot size the memfd {name!r} to {layout.total_bytes} bytes: {exc} "
                    "(check the file size limit, ulimit -f)",
                    errno=exc.errno,
                ) from exc
            return cls(layout, fd, owner=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, layout: PageLayout, fd_path: str) -> HostBackend:
        """Open another process's memfd through ``fd_path`` (``/proc/<pid>/fd/<n>``).

        The attached backend starts with nothing mapped; map the pages the
        owner mapped to see their data.
        """
        check_granularity(layout, mmap.PAGESIZE, "host page size")
        try:
            fd = os.open(fd_path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise BackendError(
                f"cannot open {fd_path}: {exc.strerror}; is the owning process alive "
                "and run by the same user?",
                errno=exc.errno,
            ) from exc
        try:
            size = os.fstat(fd).st_size
            if size != layout.total_bytes:
                raise AllocatorConfigError(
                    f"{fd_path} holds {size} bytes but the layout needs {layout.total_bytes}; "
                    "attach with the owner's exact PageLayout"
                )
            return cls(layout, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def release(self) -> None:
        """Unmap everything, give back the range and the memory, close the fd. Idempotent."""
        if self._released:
            return
        self._released = True
        self._mapped = bytearray(self.layout.num_pages)
        self._num_mapped = 0
        self._stuck.clear()  # the whole range and its memory go back below
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ mapping
    def map(self, page: int) -> None:
        """Commit (owner) and map ``page`` in every region."""
        self._check_live()
        if not 0 <= page < self.layout.num_pages:
            raise AllocatorContractError(f"page {page} is outside 0..{self.layout.num_pages - 1}")
        if self._mapped[page]:
            raise AllocatorContractError(f"page {page} is already mapped")
        if self._stuck:
            self._finish_rollbacks([page])
        self._map_run(page, 1)
        self._mapped[page] = 1
        self._num_mapped += 1

    def unmap(self, page: int) -> None:
        """Unmap ``page`` in every region; the owner also returns its memory."""
        self._check_live()
        if not 0 <= page < self.layout.num_pages:
            raise AllocatorContractError(f"page {page} is outside 0..{self.layout.num_pages - 1}")
        if not self._mapped[page]:
            raise AllocatorContractError(f"page {page} is not mapped")
        self._unmap_run(page, 1)  # raises with the page still mapped (see unmap_many)
        self._mapped[page] = 0
        self._num_mapped -= 1

    def map_many(self, pages: Sequence[int]) -> None:
        """Map several pages; each run of consecutive pages is one commit + one mmap per region."""
        self._check_live()
        ordered = check_pages(pages, self.layout.num_pages, self._mapped, False)
        if self._stuck:
            self._finish_rollbacks(ordered)
        done: list[tuple[int, int]] = []
        try:
            for first, count in runs(ordered):
                self._map_run(first, count)
                done.append((first, count))
        except BackendError:
            for first, count in done:
                try:
                    self._unmap_run(first, count)
                except BackendError:  # the map's own error is the one to raise
                    self._stuck.update(range(first, first + count))
            raise
        for page in ordered:
            self._mapped[page] = 1
        self._num_mapped += len(ordered)

    def unmap_many(self, pages: Sequence[int]) -> None:
        """Unmap several pages; each run of consecutive pages is one call per region.

        Not all or nothing: every run is tried; a run whose ``mprotect`` or
        punch failed in any region stays mapped in the books (:meth:`is_mapped`
        says so, and unmapping it again retries every region), the others are
        unmapped; then the first error is raised.
        """
        self._check_live()
        ordered = check_pages(pages, self.layout.num_pages, self._mapped, True)
        first_error: BackendError | None = None
        for first, count in runs(ordered):
            try:
                self._unmap_run(first, count)
            except BackendError as exc:
                first_error = first_error or exc
                continue
            self._mapped[first : first + count] = bytes(count)
            self._num_mapped -= count
        if first_error is not None:
            raise first_error

    def is_mapped(self, page: int) -> bool:
        """Whether this process maps ``page``."""
        if not 0 <= page < self.layout.num_pages:
            raise AllocatorContractError(f"page {page} is outside 0..{self.layout.num_pages - 1}")
        return bool(self._mapped[page])

    @property
    def num_mapped_pages(self) -> int:
        """How many pages this process maps (O(1); the map/unmap calls that succeeded)."""
        return self._num_mapped

    def mapped_pages(self) -> list[int]:
        """Pages this process maps, ascending."""
        return [page for page, flag in enumerate(self._mapped) if flag]

    def mapped_bytes(self) -> int:
        """Memory committed in the memfd, from ``fstat`` (``st_blocks * 512``).

        Shared by every process attached to the same memfd; 0 after release.
        """
        if self._released:
            return 0
        return os.fstat(self.fd).st_blocks * 512

    def trim_spares(self, keep_pages: int = 0) -> None:
        """Drop what failed map rollbacks left open (the host backend keeps no spares).

        ``PageAllocator`` calls this after each unmap. Raises the first
        :class:`BackendError`; the pages that still fail stay stuck for the next try.
        """
        del keep_pages  # nothing is kept spare on the host
        if self._stuck and not self._released:
            self._finish_rollbacks(None)

    @property
    def num_stuck_pages(self) -> int:
        """Pages a failed map could not roll back (not mapped; some region may be open)."""
        return len(self._stuck)

    # ------------------------------------------------------------------ views
    def tensor(self, region: int | None = None) -> torch.Tensor:
        """A flat ``torch.uint8`` CPU tensor viewing the whole range or one region.

        Only bytes of mapped pages may be touched. The tensor keeps this backend
        alive, but an explicit :meth:`release` still unmaps everything: drop
        tensors before calling it.
        """
        import torch  # lazy: the allocator imports without torch

        self._check_live()
        offset, length = self.layout.span(region)
        start = self.base_address + offset
        buffer = (ctypes.c_uint8 * length).from_address(start)
        buffer.kvsidecar_backend = self  # type: ignore[attr-defined]  # keeps us alive
        return torch.frombuffer(buffer, dtype=torch.uint8)

    # ------------------------------------------------------------------ internals
    def _check_live(self) -> None:
        if self._released:
            raise AllocatorContractError("this HostBackend was released; reserve a new one")

    def _map_run(self, first: int, count: int) -> None:
        layout, fd, base = self.layout, self.fd, self.base_address
        length = count * layout.page_bytes
        offset = first * layout.page_bytes
        done: list[int] = []
        try:
            for _ in range(layout.num_regions):
                if self.owner:  # the owner committed before any view maps the page
                    _libc.commit(fd, offset, length)
                done.append(offset)
                _libc.open_range(base + offset, length)
                offset += layout.region_bytes
        except BackendError:
            rollback_failed = False
            for offset in done:  # every region is tried; the map's own error is raised
                try:
                    self._drop(offset, length)
                except BackendError:
                    rollback_failed = True
            if rollback_failed:
                self._stuck.update(range(first, first + count))
            raise

    def _finish_rollbacks(self, pages: Sequence[int] | None) -> None:
        """Drop every region of the stuck pages among ``pages`` (``None``: all of them)."""
        todo = sorted(self._stuck if pages is None else self._stuck.intersection(pages))
        first_error: BackendError | None = None
        for page in todo:
            try:
                self._unmap_run(page, 1)
            except BackendError as exc:
                first_error = first_error or exc
                continue
            self._stuck.discard(page)
        if first_error is not None:
            raise first_error

    def _unmap_run(self, first: int, count: int) -> None:
        """Drop the run in every region (each tried even after a failure); raise the first."""
        layout = self.layout
        length = count * layout.page_bytes
        offset = first * layout.page_bytes
        first_error: BackendError | None = None
        for _ in range(layout.num_regions):
            try:
                self._drop(offset, length)
            except BackendError as exc:
                first_error = first_error or exc
            offset += layout.region_bytes
        if first_error is not None:
            raise first_error

    def _drop(self, offset: int, length: int) -> None:
        _libc.close_range(self.base_address + offset, length)
        if self.owner:
            _libc.punch(self.fd, offset, length)


def _free_resources(base_address: int, length: int, fd: int, owner: bool) -> None:
    """Give back the reservation and (owner) the memory, close the fd."""
    try:
        _libc.unreserve(base_address, length)
        if owner:
            _libc.punch(fd, 0, length)
    finally:
        os.close(fd)
