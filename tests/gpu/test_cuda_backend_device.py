"""CudaBackend against the driver: device memory really moves.

On a GPU machine against the real driver; elsewhere the memory tests run on
the stand-in driver (``tests/fakecuda``, default suite) and the torch/kernel
test, marked ``gpu``, is skipped with the reason. The backend's own
``mapped_bytes`` is a handle count; here the whole device's free memory
(``cuMemGetInfo``) is the independent measure.
"""

from __future__ import annotations

from collections.abc import Iterator

import fakecuda
import pytest

from allocator import BlockAllocator, CudaBackend, PageAllocator, PageLayout

#: The memory tests are marked ``gpu`` only where they cannot run on the stand-in driver.
pytestmark = [] if fakecuda.active() is not None else [pytest.mark.gpu]

PAGE = 2 << 20
PAGES = 64  # 64 pages x 2 regions x 2 MiB = 256 MiB: far above other processes' noise


@pytest.fixture
def backend() -> Iterator[CudaBackend]:
    reason = CudaBackend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"CudaBackend unavailable: {reason}")
    made = CudaBackend.reserve(PageLayout(PAGE, PAGES, 2))
    yield made
    made.release()


def test_device_free_memory_follows_map_and_unmap(backend: CudaBackend) -> None:
    bundle = backend.layout.bundle_bytes
    before = backend.device_free_bytes()
    backend.map_many(list(range(PAGES)))
    used = before - backend.device_free_bytes()
    assert used >= PAGES * bundle * 0.95
    backend.unmap_many(list(range(PAGES)))
    assert before - backend.device_free_bytes() <= PAGES * bundle * 0.05


@pytest.mark.gpu
def test_torch_view_sees_writes_and_kernels_run_on_mapped_pages(backend: CudaBackend) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA support here")
    backend.map_many([0, 1])
    view = backend.tensor(0)[: 2 * PAGE]
    assert view.device.type == "cuda"
    view.fill_(3)
    torch.cuda.synchronize()
    assert int(view.sum().item()) == 3 * 2 * PAGE
    floats = view.view(torch.float32)
    floats.copy_(torch.arange(floats.numel(), device=view.device, dtype=torch.float32))
    torch.cuda.synchronize()
    assert float(floats[-1].item()) == floats.numel() - 1


def test_allocator_shrinks_device_memory_under_a_target(backend: CudaBackend) -> None:
    pages = PageAllocator(backend)
    blocks = BlockAllocator(pages, 8)
    before = backend.device_free_bytes()
    got = blocks.alloc(8 * 32)
    assert got is not None
    assert before - backend.device_free_bytes() >= 32 * backend.layout.bundle_bytes * 0.95
    pages.set_target(4)
    blocks.free(got[: 8 * 28])  # the 28 emptied pages were retired: unmapped at once
    assert backend.mapped_bytes() == 4 * backend.layout.bundle_bytes
    assert before - backend.device_free_bytes() <= 6 * backend.layout.bundle_bytes
