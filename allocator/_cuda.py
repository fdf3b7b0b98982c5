"""CUDA backend: driver VMM through ``cuda.bindings.driver`` (cuda-python).

One ``cuMemCreate`` handle per page and region (its own physical
allocation of ``page_bytes``), mapped into one ``cuMemAddressReserve``
range (spares reused across unmap/map: see the class). ``cuda`` and ``torch`` are imported only when a backend is reserved
or a tensor built, so this module imports on machines without either.

``mapped_bytes`` counts the handles this backend holds: the driver has no
query for the physical memory behind one virtual range, and ``cuMemGetInfo``
sees the whole device (every process). Each handle is exactly ``page_bytes``
of device memory, so the count is exact for this backend.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Self, TypeVar

from ._errors import AllocatorContractError, BackendError, DeviceOutOfMemory
from ._layout import PageLayout, check_granularity
from ._pageset import check_pages, runs

if TYPE_CHECKING:
    import torch

__all__ = ["CudaBackend"]

_log = logging.getLogger(__name__)
_P = ParamSpec("_P")
_R = TypeVar("_R")

_CUDA_ERROR_OUT_OF_MEMORY = 2


def load_driver() -> Any:
    """Import ``cuda.bindings.driver`` or explain how to get it."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as exc:
        raise BackendError(
            "CudaBackend needs cuda-python (cuda.bindings.driver); install it with "
            "`pip install 'kvsidecar[cuda]'` on a machine with an NVIDIA driver"
        ) from exc


def init_driver(driver: Any) -> None:
    """``cuInit``; a missing libcuda (cuda-python raises RuntimeError) becomes BackendError."""
    try:
        result = driver.cuInit(0)
    except (RuntimeError, OSError) as exc:
        raise BackendError(f"cannot load the NVIDIA driver library: {exc}") from exc
    _call(result, "cuInit")


def _device_view(torch: Any, address: int, length: int, device: int, owner: object) -> Any:
    """A uint8 CUDA tensor over ``[address, address + length)`` on ``device``.

    Preferred: a non-owning storage built with the device given explicitly
    (``torch._C._construct_storage_from_data_pointer``, what torch's CUDA-graph
    trees use), because the public path (``__cuda_array_interface__`` ->
    ``from_blob``) asks the driver which device owns the first byte, and
    ``cudaPointerGetAttributes`` cannot answer that for a reserved but
    unmapped page. The public path is the fallback for torch builds without it.
    """
    target = torch.device("cuda", device)
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is not None:
        storage = construct(address, target, length)
        view = torch.empty(0, dtype=torch.uint8, device=target)
        return view.set_(storage, 0, (length,), (1,))
    return torch.as_tensor(_CudaArray(address, length, owner), device=target)


class _CudaArray:
    """Exposes a device range through ``__cuda_array_interface__`` (for torch.as_tensor)."""

    def __init__(self, address: int, length: int, owner: object) -> None:
        self.owner = owner  # torch holds this object, so the backend outlives its tensors
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def _in_context(
    method: Callable[Concatenate[CudaBackend, _P], _R],
) -> Callable[Concatenate[CudaBackend, _P], _R]:
    """Run a driver-calling method with the backend's context current on the calling thread
    (``CudaBackend._current_context``): whatever the thread had current before, it has after."""

    @functools.wraps(method)
    def in_context(self: CudaBackend, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._current_context():
            return method(self, *args, **kwargs)

    return in_context


class CudaBackend:
    """Pages of one CUDA device mapped on demand into a reserved virtual range.

    Owns the reservation, one allocation handle per mapped (page, region), a
    few *spare* handles (created, not mapped: see below) and a retained
    primary context of ``device``, made current on the calling thread for each call
    that needs the driver and the thread's own put back after (the constructor
    too: the thread that built it has the context it had). Not thread-safe: call from the thread that
    owns the allocator, except :meth:`device_free_bytes` (any thread).
    Unmapping memory that queued kernels still use is the caller's bug: wrap
    the backend in a :class:`~allocator.FencedBackend` to order unmaps after
    the device work.

    Spare handles. An unmap keeps up to ``spare_handles`` of the handles it
    unmapped (default: one page bundle, ``layout.num_regions``) and the next
    map reuses them, so a map after an unmap costs ``cuMemMap`` and
    ``cuMemSetAccess`` only, never ``cuMemCreate``. Spares are device memory
    this backend holds beyond :meth:`mapped_bytes`: :meth:`held_bytes`
    counts both, :meth:`trim_spares` gives them back (``PageAllocator`` keeps
    mapped + spare pages within its target that way).

    Invariants: a page is in ``_handles`` exactly while at least one of its
    regions is mapped (the books change only after the driver call
    succeeded, so a failed unmap leaves the page mapped and retryable);
    ``_num_handles`` counts the mapped handles; a handle is in exactly one
    of ``_handles``, ``_spares`` or ``_stray`` (unmapped, its release failed:
    retried by :meth:`trim_spares` and :meth:`release`).
    """

    layout: PageLayout
    base_address: int

    def __init__(
        self, layout: PageLayout, device: int, driver: Any, spare_handles: int | None = None
    ) -> None:
        """Use :meth:`reserve`."""
        if spare_handles is not None and spare_handles < 0:
            raise AllocatorContractError(f"spare_handles must be >= 0, not {spare_handles}")
        self.layout = layout
        self.device = device
        self._drv = driver
        self._released = False
        self._closing = False  # release() started and did not finish: only release() again
        self._range_freed = False
        self._handles: list[list[Any | None] | None] = [None] * layout.num_pages
        self._mapped = bytearray(layout.num_pages)  # 1 where _handles[page] is set
        # Pages whose map failed and whose rollback unmap failed too: some regions are still
        # mapped (counted in _num_handles, as the driver holds them) but the page is *not*
        # mapped for the caller (a failed map maps nothing). The next map of the page, or
        # trim_spares()/release(), retries their unmap first.
        self._stuck: set[int] = set()
        self._num_handles = 0
        self._spares: list[Any] = []
        self._stray: list[Any] = []
        self._spare_cap = layout.num_regions if spare_handles is None else spare_handles
        init_driver(driver)
        self._dev = _call(driver.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = _call(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        try:
            with self._current_context():
                self._setup(layout, device)
        except BaseException:
            self._release_context_after_failure()
            raise

    def _setup(self, layout: PageLayout, device: int) -> None:
        """The constructor's driver work, with the context current."""
        driver = self._drv
        self._prop = _allocation_prop(driver, device)
        self._access = driver.CUmemAccessDesc()
        self._access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = device
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access_list = [self._access]
        self.granularity = _granularity(driver, self._prop)
        check_granularity(
            layout, self.granularity, f"CUDA allocation granularity of device {device}"
        )
        self.base_address = self._reserve_range()
        self._bases = [
            self.base_address + region * layout.region_bytes for region in range(layout.num_regions)
        ]

    def _release_context_after_failure(self) -> None:
        """The constructor failed: give the retained primary context back. A refusal here
        must not replace the error being raised: it is logged (the context stays retained)."""
        try:
            _call(self._drv.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")
        except Exception as exc:  # noqa: BLE001 -- the constructor's own error is raised
            _log.warning(
                "kvsidecar: CudaBackend on CUDA device %d failed to start, and giving back the "
                "device's primary context failed too (%s): it stays retained (one reference "
                "leaked until the process exits; harmless unless the device is reset). The "
                "start-up error follows",
                self.device,
                exc,
            )

    @contextmanager
    def _current_context(self) -> Iterator[None]:
        """This backend's context current on the calling thread for the block, the thread's
        own put back after it (nothing switched where it is current already)."""
        if self._released:  # (release() again: nothing to do, the context is given back)
            yield
            return
        drv = self._drv
        previous = _call(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if int(previous) == int(self._ctx):
            yield
            return
        _call(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        try:
            yield
        finally:
            drv.cuCtxSetCurrent(previous)

    def _reserve_range(self) -> int:
        """``cuMemAddressReserve`` of the whole layout (virtual address space only).

        The driver answers CUDA_ERROR_OUT_OF_MEMORY when the *address space* is
        short: no device memory is involved, so it is a plain BackendError (not
        DeviceOutOfMemory, whose remedy is freeing device memory).
        """
        total = self.layout.total_bytes
        try:
            return int(
                _call(
                    self._drv.cuMemAddressReserve(total, self.granularity, 0, 0),
                    "cuMemAddressReserve",
                )
            )
        except BackendError as exc:
            raise BackendError(
                f"cannot reserve {total / 2**20:.0f} MiB of virtual address space on CUDA "
                f"device {self.device} ({exc}); nothing was reserved. Reserve a smaller "
                "layout (fewer pages or regions)"
            ) from exc

    @staticmethod
    def device_granularity(device: int = 0) -> int:
        """The CUDA VMM allocation granularity of ``device``: ``page_bytes`` must be a multiple.

        For planning before anything is reserved. The device's primary context is
        retained and made current for the query where the thread has none, then
        the thread's previous one restored and the context released.
        """
        drv = load_driver()
        init_driver(drv)
        dev = _call(drv.cuDeviceGet(device), "cuDeviceGet")
        ctx = _call(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        try:
            previous = _call(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
            switch = int(previous) == 0
            if switch:
                _call(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            try:
                return _granularity(drv, _allocation_prop(drv, device))
            finally:
                if switch:
                    drv.cuCtxSetCurrent(previous)
        finally:
            drv.cuDevicePrimaryCtxRelease(dev)

    @staticmethod
    def unavailable_reason(device: int = 0) -> str | None:
        """Why a CudaBackend cannot be reserved on ``device`` here, or ``None`` if it can."""
        try:
            drv = load_driver()
        except BackendError as exc:
            return str(exc)
        try:
            init_driver(drv)
            count = int(_call(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
        except BackendError as exc:
            return f"no usable CUDA driver: {exc}"
        if device >= count:
            return f"CUDA device {device} does not exist ({count} device(s) visible)"
        return None

    @classmethod
    def reserve(
        cls, layout: PageLayout, *, device: int = 0, spare_handles: int | None = None
    ) -> CudaBackend:
        """Reserve ``layout.total_bytes`` of virtual address space on ``device``.

        ``spare_handles``: unmapped handles kept for the next map (default one
        page bundle, ``layout.num_regions``; 0 gives every unmap back at once).
        """
        return cls(layout, device, load_driver(), spare_handles)

    @_in_context
    def release(self) -> None:
        """Unmap and release every page, free the range, drop the context. Idempotent.

        Every step is tried even when one fails; a failure raises
        :class:`BackendError` after the others ran, and calling ``release()``
        again retries what is left (nothing else may be called meanwhile).
        """
        if self._released:
            return
        self._closing = True
        self._spare_cap = 0
        errors: list[BackendError] = []
        for page, handles in enumerate(self._handles):
            if handles is not None:
                try:
                    self._unmap_one(page)
                except BackendError as exc:
                    errors.append(exc)
        try:
            self.trim_spares()
        except BackendError as exc:
            errors.append(exc)
        if not self._range_freed and self._num_handles == 0:
            try:
                _call(
                    self._drv.cuMemAddressFree(self.base_address, self.layout.total_bytes),
                    "cuMemAddressFree",
                )
                self._range_freed = True
            except BackendError as exc:
                errors.append(exc)
        if errors:
            raise BackendError(
                f"CudaBackend.release() did not finish ({len(errors)} failure(s), first: "
                f"{errors[0]}); {self._num_handles} handle(s) still mapped, "
                f"{len(self._stray)} unreleased; call release() again"
            ) from errors[0]
        try:  # last: the calls above need the context
            _call(self._drv.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")
        except BackendError as exc:
            raise BackendError(
                f"CudaBackend.release() did not finish: every page and the range were given "
                f"back, but {exc}; call release() again"
            ) from exc
        self._released = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ mapping
    @_in_context
    def map(self, page: int) -> None:
        """Map one allocation of ``page_bytes`` per region for ``page`` (a spare, or a new one)."""
        self._check_live()
        if not 0 <= page < self.layout.num_pages or self._mapped[page]:
            check_pages([page], self.layout.num_pages, self._mapped, False)  # raises why
        if self._stuck:
            self._finish_rollbacks([page])
        self._map_runs([(page, 1)], 1)

    @_in_context
    def unmap(self, page: int) -> None:
        """Unmap ``page``'s allocations (kept as spares up to the cap, else released)."""
        self._check_live()
        if not 0 <= page < self.layout.num_pages or not self._mapped[page]:
            check_pages([page], self.layout.num_pages, self._mapped, True)  # raises why
        self._unmap_one(page)

    @_in_context
    def map_many(self, pages: Sequence[int]) -> None:
        """Map several pages; access rights are set once per run of consecutive pages.

        All or nothing: on failure the pages mapped so far are unmapped again.
        Out of device memory raises :class:`DeviceOutOfMemory`.
        """
        self._check_live()
        ordered = check_pages(pages, self.layout.num_pages, self._mapped, False)
        if self._stuck:
            self._finish_rollbacks(ordered)
        self._map_runs(runs(ordered), len(ordered))

    def _map_runs(self, page_runs: list[tuple[int, int]], total: int) -> None:
        regions, size, drv = self.layout.num_regions, self.layout.page_bytes, self._drv
        done: list[int] = []
        try:
            for first, count in page_runs:
                for page in range(first, first + count):
                    self._handles[page] = self._create_and_map(page)
                    self._mapped[page] = 1
                    self._num_handles += regions
                    done.append(page)
                length, offset = count * size, first * size
                for base in self._bases:
                    _call(
                        drv.cuMemSetAccess(base + offset, length, self._access_list, 1),
                        "cuMemSetAccess",
                    )
        except Exception as exc:  # cuda-bindings may raise its own (ValueError, TypeError)
            for page in done:
                try:
                    self._unmap_one(page)
                except BackendError:
                    self._stuck_page(page)  # not mapped for the caller; unmapped later
            if isinstance(exc, DeviceOutOfMemory):
                try:
                    self.trim_spares()  # memory is short: the rolled-back handles go back too
                except BackendError:
                    pass  # kept in _stray, retried later
                raise self._out_of_memory(total, exc) from exc
            if isinstance(exc, BackendError):
                raise
            raise _foreign(exc, f"mapping {total} page(s)", "nothing was mapped") from exc

    @_in_context
    def unmap_many(self, pages: Sequence[int]) -> None:
        """Unmap several pages; a failure leaves that page mapped (retry) and raises."""
        self._check_live()
        errors: list[BackendError] = []
        for page in check_pages(pages, self.layout.num_pages, self._mapped, True):
            try:
                self._unmap_one(page)
            except BackendError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def is_mapped(self, page: int) -> bool:
        """Whether ``page`` has allocations mapped (in any region)."""
        if not 0 <= page < self.layout.num_pages:
            raise AllocatorContractError(f"page {page} is outside 0..{self.layout.num_pages - 1}")
        return bool(self._mapped[page])

    def mapped_bytes(self) -> int:
        """Device bytes of this backend's mapped handles (see the module docstring)."""
        return self._num_handles * self.layout.page_bytes

    def held_bytes(self) -> int:
        """Device bytes this backend holds: mapped, spare and not-yet-released handles."""
        return (self._num_handles + len(self._spares) + len(self._stray)) * self.layout.page_bytes

    @_in_context
    def trim_spares(self, keep_pages: int = 0) -> None:
        """Release spare handles beyond ``keep_pages`` bundles (and retry unreleased ones).

        :class:`~allocator.PageAllocator` calls this after each unmap with the
        pages its cap still allows, so mapped + spare never exceeds a target.
        """
        stuck_error: BackendError | None = None
        if self._stuck:
            try:
                self._finish_rollbacks()
            except BackendError as exc:
                stuck_error = exc
        keep = min(self._spare_cap, max(0, keep_pages) * self.layout.num_regions)
        extra = self._spares[keep:] + self._stray
        if not extra:
            if stuck_error is not None:
                raise stuck_error
            return
        self._spares, self._stray = self._spares[:keep], []
        first: BackendError | None = None
        for handle in extra:
            try:
                _call(self._drv.cuMemRelease(handle), "cuMemRelease")
            except Exception as exc:  # noqa: BLE001 -- cuda-bindings' own too: the handle is kept
                self._stray.append(handle)
                first = first or _foreign(exc, "cuMemRelease", "the handle is kept, retried")
        first = stuck_error or first
        if first is not None:
            raise first

    def device_uuid(self) -> str:
        """The device's UUID as ``nvidia-smi -L`` prints it (``GPU-8f3c…``); any thread.

        ``cuDeviceGetUuid`` names the physical device whatever
        ``CUDA_VISIBLE_DEVICES`` calls it, so every process on one GPU gets the
        same answer (in MIG mode the MIG instance's UUID, still written ``GPU-…``).
        """
        raw = bytes(_call(self._drv.cuDeviceGetUuid(self._dev), "cuDeviceGetUuid").bytes)
        h = raw[:16].hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    def device_free_bytes(self) -> int:
        """Free memory on the whole device now (``cuMemGetInfo``); any thread may call it.

        The driver answers only with a current context: on a thread without
        one, this backend's context is made current for the call and the
        thread's previous (none) restored.
        """
        drv = self._drv
        previous = _call(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        switch = int(previous) != int(self._ctx)
        if switch:
            _call(drv.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        try:
            free, _total = _call(drv.cuMemGetInfo(), "cuMemGetInfo")
        finally:
            if switch:
                drv.cuCtxSetCurrent(previous)
        return int(free)

    def tensor(self, region: int | None = None) -> torch.Tensor:
        """A flat ``torch.uint8`` CUDA tensor viewing the whole range or one region.

        Touch only mapped pages, and drop the tensor before :meth:`release`.
        """
        import torch  # lazy: the allocator imports without torch

        self._check_live()
        offset, length = self.layout.span(region)
        start = self.base_address + offset
        view: torch.Tensor = _device_view(torch, start, length, self.device, self)
        return view

    # ------------------------------------------------------------------ internals
    def _check_live(self) -> None:
        if self._released:
            raise AllocatorContractError("this CudaBackend was released; reserve a new one")
        if self._closing:
            raise AllocatorContractError(
                "this CudaBackend's release() failed part-way; call release() again (nothing else)"
            )

    def _out_of_memory(self, pages: int, exc: BackendError) -> DeviceOutOfMemory:
        try:
            free = f"{self.device_free_bytes() / 2**20:.0f} MiB"
        except BackendError:
            free = "an unknown amount"
        need = pages * self.layout.bundle_bytes
        return DeviceOutOfMemory(
            f"CUDA device {self.device} is out of memory: mapping {pages} page(s) needs "
            f"{need / 2**20:.0f} MiB and the device has {free} free ({exc}); nothing was "
            "mapped. Lower this engine's limit, or free memory elsewhere on the device "
            "(another engine's limit, torch.cuda.empty_cache()) and retry"
        )

    def _take_handle(self) -> Any:
        if self._spares:
            return self._spares.pop()
        return _call(self._drv.cuMemCreate(self.layout.page_bytes, self._prop, 0), "cuMemCreate")

    def _give_back(self, handle: Any) -> None:
        """An unmapped handle: kept as a spare below the cap, else released."""
        if len(self._spares) < self._spare_cap:
            self._spares.append(handle)
            return
        try:
            _call(self._drv.cuMemRelease(handle), "cuMemRelease")
        except Exception:  # noqa: BLE001 -- the unmap itself succeeded: do not fail it
            self._stray.append(handle)  # held_bytes() shows it; trim_spares()/release() retry

    def _create_and_map(self, page: int) -> list[Any | None]:
        """One handle mapped per region of ``page``; on failure the regions mapped so far are
        unmapped again, and any that would not unmap are put in the books (page mapped)."""
        drv, size, offset = self._drv, self.layout.page_bytes, page * self.layout.page_bytes
        handles: list[Any | None] = [None] * self.layout.num_regions
        try:
            for region, base in enumerate(self._bases):
                handle = self._take_handle()
                try:
                    _call(drv.cuMemMap(base + offset, size, 0, handle, 0), "cuMemMap")
                except Exception:
                    self._give_back(handle)  # never mapped: a spare within the cap, else freed
                    raise
                handles[region] = handle
        except Exception as exc:
            try:
                self._unmap_regions(page, handles)
            except BackendError:
                left = len(handles) - handles.count(None)
                self._handles[page] = handles  # still mapped there: the next map retries
                self._num_handles += left
                self._stuck_page(page)
            if isinstance(exc, BackendError):
                raise
            raise _foreign(exc, f"mapping page {page}", "nothing was mapped") from exc
        return handles

    def _unmap_one(self, page: int) -> None:
        handles = self._handles[page]
        if handles is None:
            return
        before = len(handles) - handles.count(None)
        try:
            self._unmap_regions(page, handles)
        finally:
            left = len(handles) - handles.count(None)
            self._num_handles -= before - left
            if left == 0:
                self._handles[page] = None
                self._mapped[page] = 0
                self._stuck.discard(page)

    def _stuck_page(self, page: int) -> None:
        """A failed map could not be rolled back: the page is not mapped for the caller
        (so a PageAllocator's books, which saw the map fail, agree), its handles stay
        counted until :meth:`_finish_rollbacks` unmaps them."""
        self._mapped[page] = 0
        self._stuck.add(page)

    def _finish_rollbacks(self, pages: Sequence[int] | None = None) -> None:
        """Unmap what failed rollbacks left behind (``pages`` among them; ``None``: all).

        Raises the first :class:`BackendError`; the pages that still fail stay stuck.
        """
        todo = sorted(self._stuck if pages is None else self._stuck.intersection(pages))
        first: BackendError | None = None
        for page in todo:
            try:
                self._unmap_one(page)
            except BackendError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _unmap_regions(self, page: int, handles: list[Any | None]) -> None:
        """Unmap every region still in ``handles``; each success clears its slot.

        Tries every region even after a failure, then raises the first error:
        the slots left set are exactly the regions still mapped.
        """
        drv, size, offset = self._drv, self.layout.page_bytes, page * self.layout.page_bytes
        first: BackendError | None = None
        for region, handle in enumerate(handles):
            if handle is None:
                continue
            try:
                _call(drv.cuMemUnmap(self._bases[region] + offset, size), "cuMemUnmap")
            except Exception as exc:  # noqa: BLE001 -- cuda-bindings' own too: the slot stays set
                first = first or _foreign(exc, "cuMemUnmap", "the page stays mapped, retried")
                continue
            handles[region] = None
            self._give_back(handle)
        if first is not None:
            raise first


def _allocation_prop(driver: Any, device: int) -> Any:
    """``CUmemAllocationProp`` of pinned memory on ``device`` (what every handle is)."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def _granularity(driver: Any, prop: Any) -> int:
    minimum = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(
        _call(driver.cuMemGetAllocationGranularity(prop, minimum), "cuMemGetAllocationGranularity")
    )


def _foreign(exc: Exception, what: str, outcome: str) -> BackendError:
    """``exc`` as a :class:`BackendError`: itself if it is one, else what cuda-bindings raised
    (a ``ValueError`` for a result code it does not know, a ``TypeError``...) explained."""
    if isinstance(exc, BackendError):
        return exc
    error = BackendError(
        f"{what} failed: cuda-bindings raised {type(exc).__name__} ({exc}); {outcome}. The "
        "installed cuda-python may not match the NVIDIA driver: install the one for this "
        "driver's CUDA version (`pip install 'kvsidecar[cuda]'`, docs/allocator.md)"
    )
    error.__cause__ = exc
    return error


def _call(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising BackendError on failure."""
    if type(result) is tuple:
        if result[0] == 0:  # the hot path: success (CUresult is an int enum)
            size = len(result)
            return None if size == 1 else result[1] if size == 2 else result[1:]
        err, *values = result
    else:
        err, values = result, []
    if int(err) != 0:
        name = f"CUresult {int(err)}"
        try:
            drv = importlib.import_module("cuda.bindings.driver")
            got = drv.cuGetErrorName(err)
            if int(got[0]) == 0:
                name = got[1].decode()
        except (ImportError, AttributeError, UnicodeDecodeError):  # only decorates a message
            name = f"CUresult {int(err)}"
        error = DeviceOutOfMemory if int(err) == _CUDA_ERROR_OUT_OF_MEMORY else BackendError
        raise error(f"{what} failed: {name}; check the device, the driver and free device memory")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
