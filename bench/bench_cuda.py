"""CudaBackend map/unmap vs direct cuda-bindings calls, per page, with driver-call counts.

Run: ``python bench/bench_cuda.py [--pages N] [--regions R] [--repeats K]``. Uses
the real driver where one loads, else builds and loads the stand-in driver
(``tests/fakecuda``; its physical memory is host memory committed with
``fallocate``, so absolute times are the stand-in's, not a GPU's: the ratio
is the figure). Best of K repeats each, so background load hurts both sides.

1. *cold*: ``CudaBackend(spare_handles=0)`` map+unmap one page at a time vs
   the bare sequence through ``cuda.bindings.driver``: per region
   ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``, then ``cuMemUnmap`` +
   ``cuMemRelease``. The ratio is the price of the backend's checks and
   bookkeeping. Goal: >= 0.8x.
2. *spares*: the default backend (one bundle of spare handles, so a map after
   an unmap reuses them) vs the bare sequence that also keeps its handles:
   ``cuMemMap`` + ``cuMemSetAccess`` / ``cuMemUnmap``. Goal: >= 0.8x.
3. Driver calls per page map and per page unmap, counted by the stand-in
   (``fakecuda_calls``); only where the stand-in is loaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import fakecuda

from allocator import CudaBackend, PageLayout

PAGE = 2 << 20


def best_s(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Direct:
    """The bare driver sequence over one reservation (what CudaBackend wraps)."""

    def __init__(self, drv: Any, pages: int, regions: int) -> None:
        self.drv, self.pages, self.regions = drv, pages, regions
        dev = drv.cuDeviceGet(0)[1]
        self.dev = dev
        self.ctx = drv.cuDevicePrimaryCtxRetain(dev)[1]
        drv.cuCtxSetCurrent(self.ctx)
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = 0
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.prop, self.access = prop, access
        self.size = pages * regions * PAGE
        err, self.base = drv.cuMemAddressReserve(self.size, PAGE, 0, 0)
        assert int(err) == 0
        self.base = int(self.base)

    def address(self, region: int, page: int) -> int:
        return self.base + (region * self.pages + page) * PAGE

    def cold(self) -> None:
        drv = self.drv
        for page in range(self.pages):
            handles = []
            for region in range(self.regions):
                _err, handle = drv.cuMemCreate(PAGE, self.prop, 0)
                drv.cuMemMap(self.address(region, page), PAGE, 0, handle, 0)
                drv.cuMemSetAccess(self.address(region, page), PAGE, [self.access], 1)
                handles.append(handle)
            for region, handle in enumerate(handles):
                drv.cuMemUnmap(self.address(region, page), PAGE)
                drv.cuMemRelease(handle)

    def warm(self, handles: list[Any]) -> Callable[[], None]:
        drv = self.drv

        def run() -> None:
            for page in range(self.pages):
                for region, handle in enumerate(handles):
                    drv.cuMemMap(self.address(region, page), PAGE, 0, handle, 0)
                    drv.cuMemSetAccess(self.address(region, page), PAGE, [self.access], 1)
                for region in range(self.regions):
                    drv.cuMemUnmap(self.address(region, page), PAGE)

        return run

    def close(self) -> None:
        self.drv.cuMemAddressFree(self.base, self.size)
        self.drv.cuDevicePrimaryCtxRelease(self.dev)


def per_page(backend: CudaBackend, pages: int) -> Callable[[], None]:
    def run() -> None:
        for page in range(pages):
            backend.map(page)
            backend.unmap(page)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--regions", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    standin = fakecuda.preload()
    where = f"stand-in driver ({standin.path})" if standin else "real CUDA driver"
    from cuda.bindings import driver as drv

    drv.cuInit(0)
    pages, regions, k = args.pages, args.regions, args.repeats
    layout = PageLayout(PAGE, pages, regions)
    direct = Direct(drv, pages, regions)
    handles = [drv.cuMemCreate(PAGE, direct.prop, 0)[1] for _ in range(regions)]
    print(f"# bench_cuda: {pages} pages x {regions} region(s) of 2 MiB, best of {k}; {where}")
    print("| case | CudaBackend µs/page (map+unmap) | direct µs/page | ratio (direct/backend) |")
    print("|---|---|---|---|")
    with CudaBackend.reserve(layout, spare_handles=0) as cold:
        t_backend = best_s(per_page(cold, pages), k)
    t_direct = best_s(direct.cold, k)
    print(
        f"| cold (cuMemCreate each map) | {t_backend / pages * 1e6:.1f} | "
        f"{t_direct / pages * 1e6:.1f} | **{t_direct / t_backend:.2f}x** |"
    )
    with CudaBackend.reserve(layout) as warm:
        warm.map(0)
        warm.unmap(0)  # the spares exist from now on
        t_backend = best_s(per_page(warm, pages), k)
    t_direct = best_s(direct.warm(handles), k)
    print(
        f"| spares (handle reused) | {t_backend / pages * 1e6:.1f} | "
        f"{t_direct / pages * 1e6:.1f} | **{t_direct / t_backend:.2f}x** |"
    )
    for handle in handles:
        drv.cuMemRelease(handle)
    direct.close()
    if standin is None:
        return
    print("\n| driver calls | map (1 page) | unmap (1 page) |")
    print("|---|---|---|")
    names = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease")
    for label, spares in (("cold", 0), ("spares", None)):
        with CudaBackend.reserve(layout, spare_handles=spares) as backend:
            backend.map(0)
            backend.unmap(0)
            standin.reset_calls()
            backend.map(1)
            mapped = {n: standin.calls(n) for n in names}
            standin.reset_calls()
            backend.unmap(1)
            unmapped = {n: standin.calls(n) for n in names}

        def show(counts: dict[str, int]) -> str:
            return ", ".join(f"{n} {c}" for n, c in counts.items() if c) or "none"

        print(f"| CudaBackend {label} ({regions} region(s)) | {show(mapped)} | {show(unmapped)} |")


if __name__ == "__main__":
    main()
