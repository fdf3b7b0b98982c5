"""CUDA backend: driver VMM through ``cuda.bindings.driver`` (cuda-python).

One ``cuMemCreate`` handle per page and region (its own physical
allocation of ``page_bytes``), mapped into one ``cuMemAddressReserve``
range. ``cuda`` and ``torch`` are imported only when a backend is reserved
or a tensor built, so this module imports on machines without either.

``mapped_bytes`` counts the handles this backend holds: the driver has no
query for the physical memory behind one virtual range, and ``cuMemGetInfo``
sees the whole device (every process). Each handle is exactly ``page_bytes``
of device memory, so the count is exact for this backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

from ._errors import AllocatorContractError, BackendError
from ._layout import PageLayout, check_granularity
from ._pageset import check_pages, runs

if TYPE_CHECKING:
    import torch

__all__ = ["CudaBackend"]


def load_driver() -> Any:
    """Import ``cuda.bindings.driver`` or explain how to get it."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as exc:
        raise BackendError(
            "CudaBackend needs cuda-python (cuda.bindings.driver); install it with "
            "`pip install 'kvsidecar[cuda]'` on a machine with an NVIDIA driver") from exc


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
            "shape": (length,), "typestr": "|u1", "data": (address, False), "version": 3,
        }


class CudaBackend:
    """Pages of one CUDA device mapped on demand into a reserved virtual range.

    Owns the reservation, one allocation handle per mapped (page, region)
    and a retained primary context of ``device``. Not thread-safe: call from
    the thread that owns the allocator. Unmapping memory that queued kernels
    still use is the caller's bug: unmap after the step that used it ended.
    """

    layout: PageLayout
    base_address: int

    def __init__(self, layout: PageLayout, device: int, driver: Any) -> None:
        """Use :meth:`reserve`."""
        self.layout = layout
        self.device = device
        self._drv = driver
        self._released = False
        self._handles: list[list[Any] | None] = [None] * layout.num_pages
        self._mapped = bytearray(layout.num_pages)  # 1 where _handles[page] is set
        self._num_handles = 0
        init_driver(driver)
        self._dev = _call(driver.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = _call(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        _call(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device
        self._access = driver.CUmemAccessDesc()
        self._access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = device
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.granularity = int(_call(driver.cuMemGetAllocationGranularity(
            self._prop,
            driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        ), "cuMemGetAllocationGranularity"))
        check_granularity(layout, self.granularity, f"CUDA allocation granularity of device "
                                                    f"{device}")
        self.base_address = int(_call(driver.cuMemAddressReserve(
            layout.total_bytes, self.granularity, 0, 0), "cuMemAddressReserve"))

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
    def reserve(cls, layout: PageLayout, *, device: int = 0) -> CudaBackend:
        """Reserve ``layout.total_bytes`` of virtual address space on ``device``."""
        return cls(layout, device, load_driver())

    def release(self) -> None:
        """Unmap and release every page, free the range, drop the context. Idempotent."""
        if self._released:
            return
        self._released = True
        drv = self._drv
        for page, handles in enumerate(self._handles):
            if handles is not None:
                self._drop(page, handles)
        self._handles = [None] * self.layout.num_pages
        self._mapped = bytearray(self.layout.num_pages)
        self._num_handles = 0
        _call(drv.cuMemAddressFree(self.base_address, self.layout.total_bytes), "cuMemAddressFree")
        _call(drv.cuDevicePrimaryCtxRelease(self._dev), "cuDevicePrimaryCtxRelease")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ mapping
    def map(self, page: int) -> None:
        """Create and map one allocation of ``page_bytes`` per region for ``page``."""
        self.map_many([page])

    def unmap(self, page: int) -> None:
        """Unmap and release ``page``'s allocations (the memory goes back to the driver)."""
        self.unmap_many([page])

    def map_many(self, pages: Sequence[int]) -> None:
        """Map several pages; access rights are set once per run of consecutive pages."""
        self._check_live()
        ordered = check_pages(pages, self.layout.num_pages, self._mapped, False)
        done: list[int] = []
        try:
            for first, count in runs(ordered):
                for page in range(first, first + count):
                    self._handles[page] = self._create_and_map(page)
                    self._mapped[page] = 1
                    self._num_handles += self.layout.num_regions
                    done.append(page)
                length = count * self.layout.page_bytes
                for region in range(self.layout.num_regions):
                    address = self.base_address + self.layout.page_offset(region, first)
                    _call(self._drv.cuMemSetAccess(address, length, [self._access], 1),
                          "cuMemSetAccess")
        except BackendError:
            for page in done:
                self._unmap_one(page)
            raise

    def unmap_many(self, pages: Sequence[int]) -> None:
        """Unmap several pages."""
        self._check_live()
        for page in check_pages(pages, self.layout.num_pages, self._mapped, True):
            self._unmap_one(page)

    def is_mapped(self, page: int) -> bool:
        """Whether ``page`` has allocations mapped."""
        if not 0 <= page < self.layout.num_pages:
            raise AllocatorContractError(
                f"page {page} is outside 0..{self.layout.num_pages - 1}")
        return bool(self._mapped[page])

    def mapped_bytes(self) -> int:
        """Device bytes held by this backend's handles (see the module docstring)."""
        return self._num_handles * self.layout.page_bytes

    def device_free_bytes(self) -> int:
        """Free memory on the whole device now (``cuMemGetInfo``), for checks and tests."""
        free, _total = _call(self._drv.cuMemGetInfo(), "cuMemGetInfo")
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

    def _create_and_map(self, page: int) -> list[Any]:
        drv, size = self._drv, self.layout.page_bytes
        handles: list[Any] = []
        try:
            for region in range(self.layout.num_regions):
                handle = _call(drv.cuMemCreate(size, self._prop, 0), "cuMemCreate")
                address = self.base_address + self.layout.page_offset(region, page)
                try:
                    _call(drv.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
                except BackendError:
                    drv.cuMemRelease(handle)
                    raise
                handles.append(handle)
        except BackendError:
            self._drop(page, handles)
            raise
        return handles

    def _unmap_one(self, page: int) -> None:
        handles = self._handles[page]
        if handles is None:
            return
        self._handles[page] = None
        self._mapped[page] = 0
        self._num_handles -= len(handles)
        self._drop(page, handles)

    def _drop(self, page: int, handles: list[Any]) -> None:
        drv, size = self._drv, self.layout.page_bytes
        for region, handle in enumerate(handles):
            address = self.base_address + self.layout.page_offset(region, page)
            _call(drv.cuMemUnmap(address, size), "cuMemUnmap")
            _call(drv.cuMemRelease(handle), "cuMemRelease")


def _call(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising BackendError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = f"CUresult {int(err)}"
        try:
            drv = importlib.import_module("cuda.bindings.driver")
            got = drv.cuGetErrorName(err)
            if int(got[0]) == 0:
                name = got[1].decode()
        except (ImportError, AttributeError, UnicodeDecodeError):  # only decorates a message
            name = f"CUresult {int(err)}"
        raise BackendError(f"{what} failed: {name}; check the device, the driver and free "
                           "device memory")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
