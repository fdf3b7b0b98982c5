"""Overcommit on the stand-in CUDA driver (tests/fakecuda): the GPU-path code of both adapters
over a real ``CudaBackend``, with CPU tensor views where a GPU would have CUDA views.

- vLLM: two engines' KV caches planned for virtual capacities that add up to more than
  the stand-in device; only the warm-up's pages are mapped; under vLLM's real
  ``KVCacheManager`` + ``ElasticBlockPool`` memory moves from one engine to the other as
  limits change, never above the device total (measured by the stand-in).
- SGLang: a bare ``"cuda"`` pool device is the current device, the reservation is made
  for the virtual capacity and nothing but address space is taken.
"""

from __future__ import annotations

from typing import Any

import fakecuda
import pytest
import torch

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from allocator import CudaBackend

PAGE = 2 << 20


class HostViewed:
    """A CudaBackend whose ``tensor()`` is a CPU view of the stand-in's memory."""

    def __init__(self, inner: CudaBackend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def tensor(self, region: int | None = None) -> torch.Tensor:
        offset, length = self.inner.layout.span(region)
        return fakecuda.host_view(self.inner.base_address + offset, length)


def test_sglang_reserves_on_the_current_device_address_space_only(
    fc: fakecuda.FakeCuda,
) -> None:
    from engine_ext.sglang._kv_memory import KVGeometry, reserve_kv

    geometry = KVGeometry(
        page_size=16, head_num=8, head_dim=128, layer_num=4, dtype_bytes=2, max_tokens=200_000
    )  # 2 x 4 x 200k x 2 KiB = 3 GiB virtual
    used = fc.used_bytes()
    fc.set_total_bytes(used + 256 * PAGE)  # a 512 MiB device
    reservation = reserve_kv(geometry, device="cuda", current_cuda=lambda: 0)
    try:
        backend = reservation.backend
        assert isinstance(backend, CudaBackend) and backend.device == 0
        assert backend.layout.total_bytes > 4 * (256 * PAGE)  # far above the device
        assert fc.used_bytes() == used and backend.mapped_bytes() == 0  # address space only
        backend.map(0)
        assert fc.used_bytes() - used == backend.layout.bundle_bytes
    finally:
        reservation.backend.release()


def test_two_vllm_engines_overcommit_the_device_and_memory_follows_the_limits(
    fc: fakecuda.FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from engine_ext import EngineSettings
    from engine_ext.vllm import _gpu_kv, _runtime
    from engine_ext.vllm._block_pool import ElasticBlockPool
    from engine_ext.vllm._kv_memory import claim_kv_memory, clear_kv_memory
    from engine_ext.vllm._settings import VllmSettings
    from tests.integration.vllm.test_gpu_kv import BLOCK_BYTES, BLOCK_TOKENS, LAYERS, planned

    base = fc.used_bytes()
    device = 48 * len(LAYERS) * PAGE  # room for 48 page bundles
    fc.set_total_bytes(base + device)
    monkeypatch.setattr(kv_cache_coordinator, "BlockPool", ElasticBlockPool)
    blocks_per_page = PAGE // BLOCK_BYTES  # 256
    engines = []
    for name in ("a", "b"):
        config = planned(32 * blocks_per_page)  # 32 page bundles each: 64 > 48 together
        plan = _gpu_kv.kv_geometry(config, KVCacheLayout.LBNHC)
        views = _gpu_kv.allocate_on_reservation(
            config,
            torch.device("cpu"),
            KVCacheLayout.LBNHC,
            None,
            plan=plan,
            reserve=lambda layout, dev: HostViewed(CudaBackend.reserve(layout, device=0)),  # type: ignore[arg-type,return-value]
            synchronize=lambda: None,
            warmup_blocks=3 * blocks_per_page,
        )
        memory = claim_kv_memory()
        assert memory is not None
        assert memory.backend.mapped_bytes() == 3 * memory.layout.bundle_bytes  # warm-up only
        monkeypatch.setattr(_runtime, "_configured", None)
        monkeypatch.setattr(_runtime, "_runtime", None)
        memory.claimed = False
        _runtime.configure(
            EngineSettings(enable=True, instance_id=f"oc-{name}", runtime_dir=tmp_path / name),
            VllmSettings(enable=True),
        )
        from engine_ext.vllm import _kv_memory

        _kv_memory.publish_kv_memory(memory)
        manager = KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=BLOCK_TOKENS,
            hash_block_size=BLOCK_TOKENS,
            enable_caching=False,
        )
        runtime = _runtime.current_runtime()
        assert runtime is not None
        engines.append((manager, runtime, memory, views))
        clear_kv_memory()

    def used() -> int:
        total = fc.used_bytes() - base
        assert total <= device
        return total

    (ma, ra, mem_a, _), (mb, rb, mem_b, _) = engines
    bundle = mem_a.layout.bundle_bytes
    assert mem_a.backend.mapped_bytes() == mem_b.backend.mapped_bytes() == bundle  # page 0
    held = mem_a.backend.inner.held_bytes() + mem_b.backend.inner.held_bytes()
    assert used() == held  # mapped pages + CudaBackend's few spare handles, nothing else
    # A takes 30 page bundles of blocks, then B cannot get more than the rest.
    got_a = ma.block_pool.get_new_blocks(30 * blocks_per_page)
    assert mem_a.backend.mapped_bytes() >= 30 * bundle
    assert mb.block_pool.get_num_free_blocks() > 20 * blocks_per_page  # virtual: 32 pages
    with pytest.raises(ValueError, match="device is out of memory"):
        mb.block_pool.get_new_blocks(20 * blocks_per_page)  # nothing cached to fall back on
    assert used() <= device and mem_b.backend.mapped_bytes() <= 18 * bundle
    # The operator moves memory: A down to 8 page bundles, B then gets 20.
    ma.block_pool.free_blocks(got_a[8 * blocks_per_page :])
    ra.instance.set_limit(8 * bundle)
    ra.safe_point()  # limits apply at safe points only (top of a scheduler step, idle)
    assert mem_a.backend.mapped_bytes() <= 9 * bundle
    rb.instance.set_limit(None)
    rb.safe_point()
    got_b = mb.block_pool.get_new_blocks(20 * blocks_per_page)
    assert len(got_b) == 20 * blocks_per_page and used() <= device
    for _, runtime, _, _ in engines:
        runtime.close()
