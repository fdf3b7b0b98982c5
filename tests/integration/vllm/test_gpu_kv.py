"""The GPU KV path's CPU-checkable parts, against vLLM's own planner and views.

Everything here runs without a GPU: the geometry and rounding are computed
from ``KVCacheConfig`` objects made by vLLM's planner
(``get_kv_cache_config_from_groups``); the views are compared with what
vLLM's ``allocate_kv_cache`` builds for the same config; the allocation path
runs end to end over a real ``HostBackend`` (a write to an unmapped page
would SIGSEGV) and under vLLM's real ``KVCacheManager`` + ``ElasticBlockPool``.
Only the ``CudaBackend`` reservation and ``torch.cuda.synchronize`` are
swapped for their host equivalents; tests/gpu/test_vllm_gpu_kv.py runs the real
ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

import torch
from packaging.specifiers import SpecifierSet
from vllm.config import CacheConfig, ParallelConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache

from allocator import AllocatorContractError, HostBackend, PageLayout
from engine_ext import EngineSettings
from engine_ext.vllm import _gpu_kv, _runtime
from engine_ext.vllm._block_pool import ElasticBlockPool
from engine_ext.vllm._gpu_kv import (
    CUDA_GRANULARITY,
    PrimedBackend,
    UnsupportedKvCache,
    allocate_on_reservation,
    engine_refusal,
    kv_geometry,
    place_kv_cache,
    whole_page_config,
)
from engine_ext.vllm._kv_memory import claim_kv_memory, clear_kv_memory
from engine_ext.vllm._patches import PATCHES
from engine_ext.vllm._settings import VllmSettings

pytestmark = pytest.mark.vllm

LAYERS = [
    "model.layers.0.self_attn.attn",
    "model.layers.1.self_attn.attn",
    "model.layers.2.self_attn.attn",
]
BLOCK_TOKENS = 16
SPEC = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=64, dtype=torch.float16)
BLOCK_BYTES = SPEC.page_size_bytes  # 16 tokens x 2 heads x (64 + 64) x 2 bytes = 8 KiB
HOST_GRANULARITY = 32 << 10  # host stand-in for the CUDA granularity: 4 blocks per page


def vllm_config(layout: str = "LBNHC") -> VllmConfig:
    config = VllmConfig(cache_config=CacheConfig(block_size=BLOCK_TOKENS))
    config.cache_config.kv_cache_layout = layout
    return config


def planned(num_blocks: int, layout: str = "LBNHC", spec: object = SPEC) -> KVCacheConfig:
    """vLLM's own planner: a config of exactly ``num_blocks`` blocks."""
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]  # type: ignore[arg-type]
    bytes_per_block = BLOCK_BYTES * len(LAYERS)
    return get_kv_cache_config_from_groups(
        vllm_config(layout), groups, bytes_per_block * num_blocks + 5
    )


# -- geometry and rounding ---------------------------------------------------------------


def test_geometry_follows_vllms_placement_and_cuda_granularity() -> None:
    config = planned(1000)
    geometry = kv_geometry(config, KVCacheLayout.LBNHC)
    tensor = config.kv_cache_tensors[0]
    assert geometry.block_bytes == tensor.block_stride == BLOCK_BYTES
    assert geometry.page_bytes == CUDA_GRANULARITY  # lcm(2 MiB, 8 KiB)
    assert geometry.blocks_per_page == 256
    assert geometry.num_pages == 4  # ceil(1000 / 256)
    assert geometry.layer_names == tuple(LAYERS)
    layout = geometry.layout
    assert (layout.num_regions, layout.page_bytes) == (3, CUDA_GRANULARITY)
    moved = geometry.placement(tensor)
    assert moved.layer_stride == layout.region_bytes and moved.block_stride == BLOCK_BYTES
    assert moved.size == layout.total_bytes and moved.offset == 0


def test_odd_block_bytes_give_pages_that_hold_whole_blocks() -> None:
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=3, head_size=64, dtype=torch.float16
    )  # 12 KiB blocks
    geometry = kv_geometry(planned(900, spec=spec), KVCacheLayout.LBNHC)
    assert geometry.page_bytes % CUDA_GRANULARITY == 0
    assert geometry.page_bytes % spec.page_size_bytes == 0
    assert geometry.page_bytes == 6 << 20  # lcm(2 MiB, 12 KiB)


def test_rounding_down_keeps_vllms_invariants() -> None:
    config = planned(1000)
    rounded, geometry = whole_page_config(config, KVCacheLayout.LBNHC)
    assert rounded.num_blocks == 768 == geometry.num_blocks  # 3 whole pages of 256 blocks
    assert rounded.num_blocks % geometry.blocks_per_page == 0
    assert config.num_blocks == 1000  # the input is not changed
    # What vLLM's planner would have produced for 768 blocks, field for field.
    assert rounded.kv_cache_tensors == planned(768).kv_cache_tensors
    again, _ = whole_page_config(rounded, KVCacheLayout.LBNHC)
    assert again.num_blocks == 768  # whole pages stay as they are


def test_too_few_blocks_for_two_pages_is_refused() -> None:
    with pytest.raises(UnsupportedKvCache, match=r"300 blocks.*256 blocks.*more KV memory"):
        whole_page_config(planned(300), KVCacheLayout.LBNHC)


@pytest.mark.parametrize(
    ("config", "layout", "match"),
    [
        pytest.param(
            planned(1000, "BLNHC"),
            KVCacheLayout.BLNHC,
            r"layout BLNHC.*LBNHC",
            id="block-outermost",
        ),
        pytest.param(
            planned(1000, "LHBNC"), KVCacheLayout.LHBNC, r"layout LHBNC", id="head-outside-block"
        ),
        pytest.param(
            planned(
                1000,
                spec=SlidingWindowSpec(
                    block_size=BLOCK_TOKENS,
                    num_kv_heads=2,
                    head_size=64,
                    dtype=torch.float16,
                    sliding_window=128,
                ),
            ),
            KVCacheLayout.LBNHC,
            r"SlidingWindowSpec",
            id="sliding",
        ),
        pytest.param(
            planned(
                1000,
                spec=MLAAttentionSpec(
                    block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=576, dtype=torch.float16
                ),
            ),
            KVCacheLayout.LBNHC,
            r"MLAAttentionSpec",
            id="mla",
        ),
    ],
)
def test_unsupported_caches_are_refused_by_name(
    config: KVCacheConfig, layout: KVCacheLayout, match: str
) -> None:
    with pytest.raises(UnsupportedKvCache, match=match):
        kv_geometry(config, layout)


def test_two_groups_are_refused() -> None:
    config = planned(1000)
    config.kv_cache_groups.append(KVCacheGroupSpec(["other"], SPEC))
    with pytest.raises(UnsupportedKvCache, match=r"2 KV cache groups"):
        kv_geometry(config, KVCacheLayout.LBNHC)


def test_engine_refusals_name_the_setting() -> None:
    config = vllm_config()
    assert engine_refusal(config, UniProcExecutor) is None
    assert "MultiprocExecutor" in str(engine_refusal(config, MultiprocExecutor))
    assert "--distributed-executor-backend uni" in str(
        engine_refusal(config, ExecutorWithExternalLauncher)
    )
    tp = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2))
    assert "world size 2" in str(engine_refusal(tp, UniProcExecutor))
    config.cache_config.num_gpu_blocks_override = 100
    assert "--num-gpu-blocks-override" in str(engine_refusal(config, UniProcExecutor))


def test_patch_rows_are_declared_for_033() -> None:
    rows = {p.target: p for p in PATCHES}
    for target in (
        "vllm.v1.engine.core:get_kv_cache_configs",
        "vllm.v1.worker.gpu_model_runner:allocate_kv_cache",
        "vllm.v1.worker.gpu.attn_utils:allocate_kv_cache",
    ):
        assert rows[target].versions == SpecifierSet(">=0.33.0,<0.34")
        assert "0.33.0" in rows[target].versions and "0.34.0" not in rows[target].versions


# -- views, over real host memory -------------------------------------------------------


@pytest.fixture
def reservations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[HostBackend]]:
    monkeypatch.setattr(_gpu_kv, "_state", _gpu_kv._State())  # a fresh plan slot per test
    made: list[HostBackend] = []
    yield made
    for backend in made:
        backend.release()
    clear_kv_memory()


def host_reserve(made: list[HostBackend]) -> Callable[[PageLayout, torch.device], HostBackend]:
    def reserve(layout: PageLayout, device: torch.device) -> HostBackend:
        assert device.type == "cpu"
        backend = HostBackend.reserve(layout, name="kvs-test-gpu-kv")
        made.append(backend)
        return backend

    return reserve


def test_views_match_vllms_own_allocation(reservations: list[HostBackend]) -> None:
    config = planned(64)
    layout = KVCacheLayout.LBNHC
    native = allocate_kv_cache(config, torch.device("cpu"), layout, None)
    plan = kv_geometry(config, layout, HOST_GRANULARITY)
    ours = allocate_on_reservation(
        config,
        torch.device("cpu"),
        layout,
        None,
        plan=plan,
        granularity=HOST_GRANULARITY,
        reserve=host_reserve(reservations),
        synchronize=lambda: None,
    )
    assert list(ours) == list(native) == LAYERS
    region_elems = plan.layout.region_bytes // SPEC.dtype.itemsize
    for index, name in enumerate(LAYERS):
        mine, theirs = ours[name], native[name]
        assert (mine.shape, mine.stride(), mine.dtype) == (
            theirs.shape,
            theirs.stride(),
            theirs.dtype,
        )
        assert mine.storage_offset() == index * region_elems
        assert mine.data_ptr() == reservations[0].base_address + index * plan.layout.region_bytes
    # 64 blocks = 16 whole pages of 4: regions are exactly vLLM's layer stride.
    assert plan.layout.region_bytes == config.kv_cache_tensors[0].layer_stride


def test_kernel_block_split_views_match(reservations: list[HostBackend]) -> None:
    config = planned(64)
    native = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBNHC, [8])
    plan = kv_geometry(config, KVCacheLayout.LBNHC, HOST_GRANULARITY)
    ours = allocate_on_reservation(
        config,
        torch.device("cpu"),
        KVCacheLayout.LBNHC,
        [8],
        plan=plan,
        granularity=HOST_GRANULARITY,
        reserve=host_reserve(reservations),
        synchronize=lambda: None,
    )
    for name in LAYERS:
        assert ours[name].shape == native[name].shape == (128, 2, 8, 128)
        assert ours[name].stride() == native[name].stride()


def test_a_worker_config_that_differs_from_the_plan_is_refused(
    reservations: list[HostBackend],
) -> None:
    plan = kv_geometry(planned(64), KVCacheLayout.LBNHC, HOST_GRANULARITY)
    with pytest.raises(UnsupportedKvCache, match=r"differs from the EngineCore's plan"):
        allocate_on_reservation(
            planned(60),
            torch.device("cpu"),
            KVCacheLayout.LBNHC,
            None,
            plan=plan,
            granularity=HOST_GRANULARITY,
            reserve=host_reserve(reservations),
        )
    assert reservations == [] and claim_kv_memory() is None  # nothing reserved or published


def test_without_a_plan_the_patch_is_vllms_allocation(reservations: list[HostBackend]) -> None:
    calls: list[int] = []

    def original(
        config: KVCacheConfig,
        device: torch.device,
        layout: KVCacheLayout,
        kernel_block_sizes: list[int] | None = None,
    ) -> dict[str, torch.Tensor]:
        calls.append(config.num_blocks)
        return allocate_kv_cache(config, device, layout, kernel_block_sizes)

    patched = place_kv_cache(original)
    views = patched(planned(8), torch.device("cpu"), KVCacheLayout.LBNHC, None)
    assert calls == [8] and views[LAYERS[0]].shape[0] == 8  # the profiling run's cache
    assert claim_kv_memory() is None


def test_a_plan_with_a_cpu_device_is_refused(
    reservations: list[HostBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = planned(64)
    monkeypatch.setattr(
        _gpu_kv, "_state", _gpu_kv._State(plan=kv_geometry(config, KVCacheLayout.LBNHC))
    )
    patched = place_kv_cache(allocate_kv_cache)
    with pytest.raises(UnsupportedKvCache, match=r"device cpu"):
        patched(config, torch.device("cpu"), KVCacheLayout.LBNHC, None)
    assert claim_kv_memory() is None


# -- the primed page and the synchronized unmap --------------------------------------------


def test_first_pool_map_adopts_its_pages_and_drops_the_warm_up_mapping(
    reservations: list[HostBackend],
) -> None:
    backend = host_reserve(reservations)(PageLayout(32 << 10, 4, 2), torch.device("cpu"))
    events: list[str] = []
    primed = PrimedBackend(backend, lambda: events.append(f"sync:{backend.mapped_pages()}"))
    primed.prime(range(4))  # the worker, for vLLM's warm-up
    assert backend.mapped_pages() == [0, 1, 2, 3]
    assert not any(primed.is_mapped(page) for page in range(4))  # the pool sees a fresh backend
    assert primed.mapped_bytes() == 4 * backend.layout.bundle_bytes  # measured, not declared
    primed.map_many([0])  # the pool's first call: the null block's page
    assert events == ["sync:[0, 1, 2, 3]"]  # synchronized before the warm-up pages went
    assert backend.mapped_pages() == [0] and primed.is_mapped(0)
    primed.map(2)
    assert backend.mapped_pages() == [0, 2]
    with pytest.raises(AllocatorContractError):
        primed.map(2)  # the inner backend's contract still holds
    primed.unmap(2)
    assert events == ["sync:[0, 1, 2, 3]", "sync:[0, 2]"]  # synchronized while still mapped
    assert backend.mapped_pages() == [0]


def test_unmapping_a_primed_page_is_refused(reservations: list[HostBackend]) -> None:
    backend = host_reserve(reservations)(PageLayout(32 << 10, 4, 2), torch.device("cpu"))
    primed = PrimedBackend(backend, lambda: None)
    primed.prime([0])
    with pytest.raises(AllocatorContractError, match=r"not mapped by the pool"):
        primed.unmap(0)
    assert backend.is_mapped(0)


# -- end to end on the CPU: reservation -> vLLM's KVCacheManager -> writes -> limit ------------


def test_pool_maps_before_handing_out_and_unmaps_after_sync(
    reservations: list[HostBackend], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = planned(64)  # 16 pages of 4 blocks
    layout = KVCacheLayout.LBNHC
    syncs: list[int] = []
    plan = kv_geometry(config, layout, HOST_GRANULARITY)
    views = allocate_on_reservation(
        config,
        torch.device("cpu"),
        layout,
        None,
        plan=plan,
        granularity=HOST_GRANULARITY,
        reserve=host_reserve(reservations),
        synchronize=lambda: syncs.append(1),
    )
    backend = reservations[0]
    assert backend.mapped_pages() == list(range(16))  # resident for vLLM's warm-up
    for name in LAYERS:
        views[name].fill_(1)  # the warm-up writes made-up requests' KV into any block

    manager, runtime = elastic_manager(config, monkeypatch, tmp_path)
    assert backend.mapped_pages() == [0]  # the pool kept page 0 (null block), dropped the rest
    assert syncs == [1]  # after a device synchronize

    request = request_maker()("r", 0, 10)
    blocks = manager.allocate_slots(request, request.num_tokens)
    assert blocks is not None
    block_ids = blocks.get_block_ids()[0]
    assert len(block_ids) == 10
    for name in LAYERS:  # a write to an unmapped page would kill the process (SIGSEGV)
        views[name][block_ids].fill_(7)
    assert len(backend.mapped_pages()) == 3  # 11 blocks incl. null in pages of 4
    request.num_computed_tokens = request.num_tokens
    manager.free(request)

    runtime.instance.set_limit(backend.layout.bundle_bytes)  # one page: the floor
    manager.block_pool.get_num_free_blocks()  # allocation only reads: nothing unmapped here
    assert len(backend.mapped_pages()) == 3
    runtime.safe_point()  # the top of a scheduler step: takes the target, evicts, unmaps
    assert backend.mapped_pages() == [0]
    assert len(syncs) >= 2  # these unmaps ran after a device synchronize too
    assert int(views[LAYERS[0]][0].flatten()[0]) != 0  # the null block's page kept its data
    runtime.close()


# -- the planning patch (EngineCore), with the platform check forced on --------------------


@pytest.fixture
def engine_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reservations: list[HostBackend]
) -> VllmConfig:
    """A real VllmConfig of the tiny model, as a uni-executor CUDA engine would have it."""
    from vllm.config import ModelConfig

    from engine_ext.cpu_harness import make_tiny_model_dir

    model = ModelConfig(model=str(make_tiny_model_dir(tmp_path / "model")), max_model_len=1024)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK_TOKENS))
    config.cache_config.kv_cache_layout = "LBNHC"
    config.parallel_config.distributed_executor_backend = "uni"  # CPU vLLM forces "mp"
    monkeypatch.setattr(_gpu_kv, "_gpu_path_applies", lambda vllm_config: True)
    monkeypatch.setattr(_gpu_kv, "_cuda_granularity", lambda: CUDA_GRANULARITY)  # no torch CUDA
    return config


def test_planning_rounds_down_before_the_scheduler_and_leaves_a_plan(
    engine_config: VllmConfig,
) -> None:
    calls: list[int] = []

    def original(*args: object) -> list[KVCacheConfig]:
        calls.append(len(args))
        return [planned(1000)]

    configs = _gpu_kv.plan_kv_cache(original, device_total=lambda: 1 << 30)(
        engine_config, [{}], [0], []
    )
    assert calls == [4] and [c.num_blocks for c in configs] == [768]
    plan = _gpu_kv._state.plan
    assert plan is not None and plan.num_blocks == 768 and plan.blocks_per_page == 256


def test_planning_refuses_what_the_gpu_path_cannot_serve(engine_config: VllmConfig) -> None:
    plan = _gpu_kv.plan_kv_cache(lambda *args: [planned(1000)], device_total=lambda: 1 << 30)
    engine_config.model_config.max_model_len = 16384  # 1024 blocks > 768 after rounding
    with pytest.raises(UnsupportedKvCache, match=r"max_model_len 16384 in 768.*needs 1024"):
        plan(engine_config, [{}], [0], [])
    engine_config.model_config.max_model_len = 1024
    engine_config.parallel_config.distributed_executor_backend = "mp"
    with pytest.raises(UnsupportedKvCache, match=r"MultiprocExecutor"):
        plan(engine_config, [{}], [0], [])
    assert _gpu_kv._state.plan is None  # nothing planned, nothing reserved


# -- overcommit: planned for virtual capacity, warm-up pages only ----------------------------

GIB = 1 << 30


def _real_planner(engine_config: VllmConfig) -> tuple[list[dict[str, object]], list[object]]:
    """The tiny model's KV specs and vLLM's global groups for them, as EngineCore builds them."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    specs: list[dict[str, object]] = [{name: SPEC for name in LAYERS}]
    return specs, get_global_kv_cache_groups(engine_config, specs)


@pytest.mark.parametrize(
    ("setting", "explicit", "expected"),
    [
        (6 * GIB, None, 6 * GIB),
        (None, 3 * GIB, 3 * GIB),
        (None, None, 8 * GIB),
        (5 * GIB, 3 * GIB, 5 * GIB),
    ],
    ids=["setting", "kv-cache-memory-bytes", "device-total", "setting-wins"],
)
def test_planning_uses_the_virtual_capacity_not_the_measured_free_memory(
    engine_config: VllmConfig, setting: int | None, explicit: int | None, expected: int
) -> None:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_configs

    engine_config.cache_config.kv_cache_memory_bytes = explicit
    seen: list[list[int]] = []

    def original(
        config: VllmConfig, specs: list[object], available: list[int], groups: list[object]
    ) -> list[KVCacheConfig]:
        seen.append(list(available))
        return get_kv_cache_configs(config, specs, available, groups)  # type: ignore[arg-type]

    specs, groups = _real_planner(engine_config)
    hook = _gpu_kv.plan_kv_cache(original, device_total=lambda: 8 * GIB, setting=lambda: setting)
    measured = 200 << 20  # what vLLM's profiler left for KV under a small utilization
    (config,) = hook(engine_config, specs, [measured], groups)
    assert seen == [[expected]]
    kv_bytes = config.num_blocks * BLOCK_BYTES * len(LAYERS)
    assert expected - (2 << 20) * len(LAYERS) <= kv_bytes <= expected  # whole pages, rounded down
    assert kv_bytes > 10 * measured  # far above what is physically free


def test_two_engines_each_plan_more_than_half_the_device(engine_config: VllmConfig) -> None:
    """Two engines on one 8 GiB device: the sum of their virtual capacities exceeds it."""
    from vllm.v1.core.kv_cache_planning import get_kv_cache_configs

    specs, groups = _real_planner(engine_config)
    device = 8 * GIB
    capacities = []
    for virtual in (6 * GIB, 5 * GIB):
        hook = _gpu_kv.plan_kv_cache(
            get_kv_cache_configs, device_total=lambda: device, setting=lambda v=virtual: v
        )  # type: ignore[misc]
        (config,) = hook(engine_config, specs, [100 << 20], groups)
        capacities.append(config.num_blocks * BLOCK_BYTES * len(LAYERS))
    assert all(c > device // 2 for c in capacities) and sum(capacities) > device


def test_warm_up_bound_covers_vllms_warm_up_requests(engine_config: VllmConfig) -> None:
    scheduler = engine_config.scheduler_config
    bound = _gpu_kv.warmup_block_bound(engine_config, BLOCK_TOKENS)
    # _warmup_kernels: max_num_seqs requests of 2 prompt + 3 decode tokens, ids from 1;
    # run_mixed_prefill_decode_warmup: one prefill of max_num_batched_tokens - 1 tokens.
    assert bound > scheduler.max_num_seqs * 1 + 1
    assert bound > -(-scheduler.max_num_batched_tokens // BLOCK_TOKENS) + 2
    scheduler.max_num_seqs *= 2
    assert _gpu_kv.warmup_block_bound(engine_config, BLOCK_TOKENS) > bound  # follows the limits


def test_only_the_warm_up_pages_are_mapped_before_the_pool(
    reservations: list[HostBackend],
) -> None:
    config = planned(64)  # 16 pages of 4 blocks
    layout = KVCacheLayout.LBNHC
    plan = kv_geometry(config, layout, HOST_GRANULARITY)
    views = allocate_on_reservation(
        config,
        torch.device("cpu"),
        layout,
        None,
        plan=plan,
        granularity=HOST_GRANULARITY,
        reserve=host_reserve(reservations),
        synchronize=lambda: None,
        warmup_blocks=10,
    )
    backend = reservations[0]
    assert backend.mapped_pages() == [0, 1, 2]  # blocks 0..9 in pages of 4
    assert backend.mapped_bytes() == 3 * backend.layout.bundle_bytes  # measured (/proc)
    for name in LAYERS:
        views[name][:10].fill_(3)  # the warm-up's blocks: mapped (else SIGSEGV)
    memory = claim_kv_memory()
    assert memory is not None
    memory.backend.map_many([0])  # the pool's first map keeps page 0 only
    assert backend.mapped_pages() == [0]


@pytest.mark.parametrize(
    ("blocks", "pages"), [(None, 16), (0, 1), (1, 1), (4, 1), (5, 2), (10**9, 16)]
)
def test_warm_up_pages_are_clamped_to_the_reservation(blocks: int | None, pages: int) -> None:
    plan = kv_geometry(planned(64), KVCacheLayout.LBNHC, HOST_GRANULARITY)
    assert _gpu_kv.warmup_pages(plan, blocks) == pages


def test_planning_hook_hands_the_warm_up_bound_to_the_allocation(
    engine_config: VllmConfig, reservations: list[HostBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = _gpu_kv.plan_kv_cache(lambda *args: [planned(1000)], device_total=lambda: GIB)
    hook(engine_config, [{}], [0], [])
    expected = _gpu_kv.warmup_block_bound(engine_config, BLOCK_TOKENS)
    assert _gpu_kv._state.warmup_blocks == expected
    seen: list[int | None] = []
    monkeypatch.setattr(
        _gpu_kv, "allocate_on_reservation", lambda *a, **kw: seen.append(kw["warmup_blocks"]) or {}
    )
    place_kv_cache(allocate_kv_cache)(planned(768), torch.device("cuda"), KVCacheLayout.LBNHC)
    assert seen == [expected] and _gpu_kv._state.warmup_blocks is None  # taken once


# -- a full device under vLLM's real KVCacheManager ----------------------------------------


class _SmallDevice:
    """A HostBackend that refuses maps beyond ``total_pages`` (the device is full)."""

    def __init__(self, inner: HostBackend, total_pages: int) -> None:
        self.inner = inner
        self.total_pages = total_pages
        self.refusals = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def map_many(self, pages: list[int]) -> None:
        from allocator import DeviceOutOfMemory

        if len(self.inner.mapped_pages()) + len(pages) > self.total_pages:  # measured
            self.refusals += 1
            raise DeviceOutOfMemory(f"no device memory for {len(pages)} page(s)")
        self.inner.map_many(pages)

    def map(self, page: int) -> None:
        self.map_many([page])


def small_device_views(
    config: KVCacheConfig, made: list[HostBackend], total_pages: int
) -> tuple[dict[str, torch.Tensor], _SmallDevice]:
    """KV views over a host reservation whose device holds ``total_pages`` pages at most.

    vLLM's warm-up maps 4 blocks; the device is the ``_SmallDevice`` the pool will
    map through (its ``total_pages`` may be changed later: another engine).
    """
    devices: list[_SmallDevice] = []

    def reserve(page_layout: PageLayout, device: torch.device) -> _SmallDevice:
        devices.append(_SmallDevice(host_reserve(made)(page_layout, device), total_pages))
        return devices[-1]

    layout = KVCacheLayout.LBNHC
    views = allocate_on_reservation(
        config,
        torch.device("cpu"),
        layout,
        None,
        plan=kv_geometry(config, layout, HOST_GRANULARITY),
        granularity=HOST_GRANULARITY,
        reserve=reserve,  # type: ignore[arg-type]
        synchronize=lambda: None,
        warmup_blocks=4,
    )
    (device,) = devices
    return views, device


def elastic_manager(
    config: KVCacheConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[KVCacheManager, _runtime.VllmRuntime]:
    """vLLM's real ``KVCacheManager`` over an ``ElasticBlockPool``, configured as the plugin does.

    The thread guard is on; the caller closes the runtime. Patch
    ``KVCacheManager.allocate_slots`` before calling this to test the plugin's wrapper.
    """
    monkeypatch.setattr(kv_cache_coordinator, "BlockPool", ElasticBlockPool)
    monkeypatch.setattr(_runtime, "_configured", None)
    monkeypatch.setattr(_runtime, "_runtime", None)
    _runtime.configure(
        EngineSettings(enable=True, thread_guard=True, runtime_dir=tmp_path),
        VllmSettings(enable=True),
    )
    manager = KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=BLOCK_TOKENS,
        hash_block_size=BLOCK_TOKENS,
        enable_caching=True,
    )
    assert isinstance(manager.block_pool, ElasticBlockPool)
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None
    return manager, runtime


def request_maker(seed_stride: int = 977) -> Callable[[str, int, int], Request]:
    """``make(name, seed, blocks)``: a request of ``blocks`` full blocks, hashed for caching."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)

    def make(name: str, seed: int, blocks: int) -> Request:
        prompt = [(i * 31 + seed * seed_stride) % 3000 + 10 for i in range(blocks * BLOCK_TOKENS)]
        return Request(name, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)

    return make


def test_a_full_device_reuses_cached_blocks_and_never_crashes_the_scheduler(
    reservations: list[HostBackend], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = planned(64)  # 16 pages of 4 blocks: virtual capacity 4x the device below
    views, device = small_device_views(config, reservations, total_pages=4)
    backend = reservations[0]
    manager, runtime = elastic_manager(config, monkeypatch, tmp_path)
    request = request_maker()

    first = request("a", 1, 10)  # null + 10 blocks: pages 0..2
    got = manager.allocate_slots(first, first.num_tokens)
    assert got is not None and len(backend.mapped_pages()) == 3
    first.num_computed_tokens = first.num_tokens
    manager.free(first)  # its 10 blocks stay cached (evictable)

    second = request("b", 2, 8)  # 1 free block in page 2, page 3 maps, page 4 cannot
    blocks = manager.allocate_slots(second, second.num_tokens)
    assert blocks is not None  # filled from cached blocks, not a crash
    assert device.refusals >= 1 and len(backend.mapped_pages()) == 4
    for name in LAYERS:  # every handed-out block is backed (else SIGSEGV)
        views[name][blocks.get_block_ids()[0]].fill_(5)

    third = request("c", 3, 40)  # more than the mapped pages can ever hold
    assert manager.allocate_slots(third, third.num_tokens) is None  # waits; no exception
    assert len(backend.mapped_pages()) <= device.total_pages
    runtime.close()


@pytest.mark.parametrize("freed_by_torch", [1, 0], ids=["empty-cache-helps", "still-full"])
def test_warm_up_pages_on_a_full_device_empty_torchs_cache_once_then_refuse(
    reservations: list[HostBackend], freed_by_torch: int
) -> None:
    config = planned(64)
    layout = KVCacheLayout.LBNHC
    devices: list[_SmallDevice] = []
    emptied: list[int] = []

    def reserve(page_layout: PageLayout, device: torch.device) -> _SmallDevice:
        devices.append(_SmallDevice(host_reserve(reservations)(page_layout, device), 2))
        return devices[-1]

    def empty_cache() -> None:  # torch's caching allocator gives memory back to the device
        emptied.append(1)
        devices[0].total_pages += freed_by_torch

    plan = kv_geometry(config, layout, HOST_GRANULARITY)
    allocate = lambda: allocate_on_reservation(
        config,
        torch.device("cpu"),
        layout,
        None,
        plan=plan,
        granularity=HOST_GRANULARITY,
        reserve=reserve,
        synchronize=lambda: None,
        warmup_blocks=12,  # type: ignore[arg-type]
        empty_cache=empty_cache,
    )
    if freed_by_torch:
        allocate()
        assert reservations[0].mapped_pages() == [0, 1, 2] and emptied == [1]
        assert claim_kv_memory() is not None
    else:
        with pytest.raises(UnsupportedKvCache, match=r"3 KV pages vLLM's warm-up.*max-num-seqs"):
            allocate()
        assert emptied == [1] and devices[0].refusals == 2
        assert reservations[0].mapped_pages() == [] and claim_kv_memory() is None
