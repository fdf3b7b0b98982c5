"""vLLM's GPU path (``engine_ext/vllm/_gpu_kv.py``) planning and reserving on the stand-in
CUDA driver (tests/fakecuda): what an operator's set-up or a device can make the driver
answer, and the one-line refusal or the working plan that follows."""

from __future__ import annotations

from pathlib import Path

import fakecuda
import pytest
import torch

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.kv_cache_layout import KVCacheLayout

from allocator import CudaBackend
from engine_ext.cpu_harness import make_tiny_model_dir
from engine_ext.vllm import _gpu_kv
from engine_ext.vllm._gpu_kv import UnsupportedKvCache, allocate_on_reservation, kv_geometry
from engine_ext.vllm._kv_memory import claim_kv_memory, clear_kv_memory
from tests.gpu.test_overcommit_standin import HostViewed
from tests.integration.vllm.test_gpu_kv import BLOCK_BYTES, BLOCK_TOKENS, planned

MiB = 1 << 20


@pytest.fixture
def fresh_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gpu_kv, "_state", _gpu_kv._State())
    clear_kv_memory()


def test_planning_asks_the_device_for_its_granularity(
    fc: fakecuda.FakeCuda, fresh_plan: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A device whose VMM granularity is 4 MiB: the plan's pages are 4 MiB (the device's
    answer, asked through the driver), and the worker's reservation accepts them; with the
    2 MiB constant it refused to start, telling the operator to change a page size that is
    no setting of theirs."""
    fc.set_granularity(4 * MiB)
    model = ModelConfig(model=str(make_tiny_model_dir(tmp_path / "model")), max_model_len=1024)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK_TOKENS))
    config.cache_config.kv_cache_layout = "LBNHC"
    config.parallel_config.distributed_executor_backend = "uni"  # CPU vLLM forces "mp"
    monkeypatch.setattr(_gpu_kv, "_gpu_path_applies", lambda vllm_config: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # CPU torch has no device
    refs = fc.primary_refs(0)
    hook = _gpu_kv.plan_kv_cache(lambda *args: [planned(2100)], device_total=lambda: 1 << 30)
    (kv_config,) = hook(config, [{}], [0], [])
    plan = _gpu_kv._state.plan
    assert plan is not None and fc.primary_refs(0) == refs  # the query kept no context
    assert plan.page_bytes == 4 * MiB and plan.granularity == 4 * MiB
    assert plan.blocks_per_page == 4 * MiB // BLOCK_BYTES == 512
    assert kv_config.num_blocks == plan.num_blocks == 2048  # whole 4 MiB pages
    views = allocate_on_reservation(
        kv_config,
        torch.device("cpu"),
        KVCacheLayout.LBNHC,
        None,
        plan=plan,  # the worker lays its config out with the plan's granularity
        reserve=lambda layout, dev: HostViewed(CudaBackend.reserve(layout, device=0)),  # type: ignore[arg-type,return-value]
        synchronize=lambda: None,
        warmup_blocks=1,
    )
    memory = claim_kv_memory()
    assert memory is not None and len(views) == memory.layout.num_regions
    try:
        assert memory.layout.page_bytes == 4 * MiB
        assert memory.backend.mapped_bytes() == memory.layout.bundle_bytes  # page 0 only
    finally:
        memory.backend.inner.inner.release()


def test_a_virtual_capacity_the_address_space_cannot_hold_is_a_one_line_refusal(
    fc: fakecuda.FakeCuda, fresh_plan: None
) -> None:
    """``cuMemAddressReserve`` refuses the range (say KVSIDECAR_VIRTUAL_KV_BYTES=800T): the
    worker refuses to start naming the two settings that size it, with nothing kept."""
    config = planned(1000)
    plan = kv_geometry(config, KVCacheLayout.LBNHC)
    refs, ranges = fc.primary_refs(0), fc.num_reservations()
    fc.fail("cuMemAddressReserve", count=1, err=fakecuda.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(UnsupportedKvCache) as info:
        allocate_on_reservation(
            config, torch.device("cuda", 0), KVCacheLayout.LBNHC, None, plan=plan
        )
    message = str(info.value)
    assert "cannot reserve 24 MiB of address space for the KV cache on cuda:0" in message
    assert "CUDA_ERROR_OUT_OF_MEMORY" in message
    assert "KVSIDECAR_VIRTUAL_KV_BYTES" in message and "--kv-cache-memory-bytes" in message
    assert fc.primary_refs(0) == refs and fc.num_reservations() == ranges
    assert claim_kv_memory() is None
