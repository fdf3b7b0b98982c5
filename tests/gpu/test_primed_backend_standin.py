"""vLLM's GPU path primes every KV page for the warm-up (``PrimedBackend.prime``): on the
stand-in driver, out of device memory empties torch's cache once, then fails clearly with
nothing left mapped, and unmaps go through the unmap fence."""

from __future__ import annotations

import fakecuda
import pytest

import allocator
from allocator import CudaBackend, DeviceOutOfMemory, PageLayout
from engine_ext.vllm._gpu_kv import PrimedBackend

PAGE = 2 << 20


def test_priming_empties_the_cache_then_maps(
    fc: fakecuda.FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        CudaBackend.reserve(PageLayout(PAGE, 8, 1), spare_handles=0) as cache,
        CudaBackend.reserve(PageLayout(PAGE, 8, 2), spare_handles=0) as kv,
    ):
        fc.set_total_bytes(fc.used_bytes() + 16 * PAGE)
        cache.map_many(range(6))  # what torch's caching allocator holds unused
        emptied: list[int] = []

        def empty_cache() -> None:
            emptied.append(1)
            cache.unmap_many(range(6))

        monkeypatch.setattr(allocator, "torch_empty_cache", empty_cache)
        log: list[str] = []
        primed = PrimedBackend(kv, lambda: log.append("fence"))
        primed.prime(range(8))
        assert emptied == [1] and kv.mapped_bytes() == 16 * PAGE
        primed.map_many([0])  # the pool's first map: the other primed pages go, after the fence
        assert log == ["fence"] and kv.mapped_bytes() == 2 * PAGE


def test_priming_without_memory_says_so_and_maps_nothing(fc: fakecuda.FakeCuda) -> None:
    with CudaBackend.reserve(PageLayout(PAGE, 8, 2)) as kv:
        fc.set_total_bytes(fc.used_bytes() + 10 * PAGE)
        primed = PrimedBackend(kv, lambda: None)
        with pytest.raises(
            DeviceOutOfMemory,
            match="even after freeing cached device memory.*needs 32 MiB and the device has 20 MiB",
        ):
            primed.prime(range(8))  # torch.cuda.empty_cache() on CPU torch frees nothing
        assert kv.mapped_bytes() == 0 and not any(kv.is_mapped(p) for p in range(8))
