"""The Backend contract, run on every backend: HostBackend, and CudaBackend on the stand-in
CUDA driver (``tests/fakecuda``, loaded by ``tests/conftest.py``) or on a real GPU.

Without the stand-in the CUDA cases are marked ``gpu`` and skipped with the
reason CudaBackend gives (no cuda-bindings, no driver, no device).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from typing import Any

import fakecuda
import pytest

from allocator import (
    AllocatorContractError,
    Backend,
    BlockAllocator,
    CudaBackend,
    HostBackend,
    PageAllocator,
    PageLayout,
)

CUDA_PAGE = 2 << 20  # the VMM granularity of current NVIDIA GPUs

MakeBackend = Callable[[int, int], Backend]
CUDA_MARKS = () if fakecuda.active() is not None else (pytest.mark.gpu,)


@pytest.fixture(params=["host", pytest.param("cuda", marks=CUDA_MARKS)])
def make_backend(request: pytest.FixtureRequest) -> Iterator[MakeBackend]:
    made: list[HostBackend | CudaBackend] = []
    kind = request.param
    if kind == "cuda":
        reason = CudaBackend.unavailable_reason()
        if reason is not None:
            pytest.skip(f"CudaBackend unavailable: {reason}")

    def make(num_pages: int, num_regions: int) -> Backend:
        backend: HostBackend | CudaBackend
        if kind == "host":
            backend = HostBackend.reserve(PageLayout(mmap.PAGESIZE, num_pages, num_regions))
        else:
            backend = CudaBackend.reserve(PageLayout(CUDA_PAGE, num_pages, num_regions))
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.release()


def test_map_and_unmap_move_mapped_bytes_by_whole_bundles(make_backend: MakeBackend) -> None:
    backend = make_backend(8, 3)
    bundle = backend.layout.bundle_bytes
    assert isinstance(backend, Backend)
    assert backend.mapped_bytes() == 0
    backend.map(5)
    backend.map_many([0, 1, 2, 7])
    assert backend.mapped_bytes() == 5 * bundle
    assert [p for p in range(8) if backend.is_mapped(p)] == [0, 1, 2, 5, 7]
    backend.unmap_many([1, 7])
    backend.unmap(5)
    assert backend.mapped_bytes() == 2 * bundle
    backend.unmap_many([0, 2])
    assert backend.mapped_bytes() == 0


def test_misuse_raises_and_changes_nothing(make_backend: MakeBackend) -> None:
    backend = make_backend(4, 2)
    backend.map(1)
    before = backend.mapped_bytes()
    bad_calls: list[Callable[[], None]] = [
        lambda: backend.map(1),
        lambda: backend.unmap(0),
        lambda: backend.map(4),
        lambda: backend.map_many([0, 0]),
        lambda: backend.map_many([0, 1]),
        lambda: backend.unmap_many([1, 2]),
    ]
    for call in bad_calls:
        with pytest.raises(AllocatorContractError):
            call()
        assert backend.mapped_bytes() == before
        assert [p for p in range(4) if backend.is_mapped(p)] == [1]


def test_tensor_view_reads_back_what_it_wrote(make_backend: MakeBackend) -> None:
    pytest.importorskip("torch")
    backend = make_backend(4, 2)
    assert isinstance(backend, HostBackend | CudaBackend)
    layout = backend.layout
    backend.map_many([2, 3])
    region, whole = _view(backend, 1), _view(backend, None)
    lo, hi = 2 * layout.page_bytes, 4 * layout.page_bytes
    region[lo:hi] = 9
    start = layout.page_offset(1, 2)
    assert int(whole[start : start + 2 * layout.page_bytes].sum()) == 9 * 2 * layout.page_bytes


def test_release_is_idempotent_and_final(make_backend: MakeBackend) -> None:
    backend = make_backend(4, 1)
    backend.map_many([0, 3])
    backend.release()
    backend.release()
    assert backend.mapped_bytes() == 0
    with pytest.raises(AllocatorContractError, match="released"):
        backend.map(1)


def test_allocators_drive_the_backend_down_to_zero(make_backend: MakeBackend) -> None:
    backend = make_backend(6, 2)
    bundle = backend.layout.bundle_bytes
    pages = PageAllocator(backend, reserve_pages=1)
    blocks = BlockAllocator(pages, 4)
    got = blocks.alloc(10)
    assert got is not None and backend.mapped_bytes() == 3 * bundle
    pages.set_target(0)
    assert pages.num_retired == 3 and backend.mapped_bytes() == 3 * bundle
    blocks.free(got)
    assert backend.mapped_bytes() == 0
    pages.set_target(None)
    assert backend.mapped_bytes() == bundle  # the reserve


def _view(backend: HostBackend | CudaBackend, region: int | None) -> Any:
    """The backend's own tensor view; on the stand-in driver a CPU view of the same bytes."""
    if isinstance(backend, CudaBackend) and fakecuda.active() is not None:
        offset, length = backend.layout.span(region)
        return fakecuda.host_view(backend.base_address + offset, length)
    return backend.tensor(region)
