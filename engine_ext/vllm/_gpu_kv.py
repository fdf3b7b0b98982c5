"""vLLM's GPU KV cache on a ``CudaBackend`` reservation (vLLM 0.33, world size 1).

vLLM's GPU worker makes one ``torch.zeros(size, int8)`` backing allocation for
every KV tensor and views it per layer (``vllm/v1/worker/utils.py``
``allocate_kv_cache``, docs/engine-hooks.md 1.10). With kvsidecar enabled on CUDA two
patches (``_patches.PATCHES``) replace that with a reservation whose pages the
``ElasticBlockPool`` maps on demand:

1. EngineCore, before the scheduler is built (``get_kv_cache_configs`` as
   imported by ``vllm.v1.engine.core``): refuse unsupported set-ups, then round
   vLLM's ``num_blocks`` *down* to whole pages (the pool requires
   ``num_gpu_blocks % blocks_per_page == 0``) and remember the plan;
2. the worker, same process and thread (``allocate_kv_cache`` as imported by
   ``vllm.v1.worker.gpu_model_runner`` and, for the default model runner V2,
   by ``vllm.v1.worker.gpu.attn_utils``): reserve a ``CudaBackend`` of one
   region per layer, map only the pages the warm-up writes (runner V2's
   warm-up writes KV into blocks 1..n with made-up requests,
   ``gpu/warmup.py``; :func:`warmup_block_bound` bounds n from the scheduler
   limits), build the per-layer views with vLLM's own
   ``create_kv_cache_views`` and publish a :class:`~._kv_memory.KVMemory`;
3. the scheduler's ``ElasticBlockPool`` claims it after the warm-up; its
   first map (page 0, the null block) keeps page 0 and unmaps every other
   page, which from then on is mapped on demand.

Overcommit (docs/overcommit.md). The planning hook sizes the KV cache for the
engine's *virtual* capacity (``KVSIDECAR_VIRTUAL_KV_BYTES``, else vLLM's
``--kv-cache-memory-bytes``, else the device's total memory) instead of what
vLLM's profiler measured free: the reservation is address space only, and
physical memory follows the limit. ``--gpu-memory-utilization`` then only has
to cover weights, activations and CUDA graphs (vLLM's start-up check wants
that much free), so two engines on one GPU each see more KV than half of it.

Geometry. vLLM 0.33 stores K and V of a layer together (``C`` = (head_size +
head_size_v) x dtype bytes of the logical ``[B, H, N, C]`` page), so a layer
is one region. With a layer-outermost, block-compact layout (``LBNHC``, the
default, or ``LBHNC``) block ``b`` of layer ``l`` starts at
``l * layer_stride + b * block_stride`` and ``block_stride`` is one block of
one layer (``block_bytes``). The reservation keeps ``block_stride`` and sets
``layer_stride`` to the region size (``num_pages * page_bytes``), where
``page_bytes = lcm(CUDA granularity, block_bytes)``: a page covers
``page_bytes // block_bytes`` consecutive blocks in every layer.

Unmapping. The scheduler frees blocks while GPU work of an earlier (or, with
async scheduling, the next) step may still read or write them, so
:class:`PrimedBackend` synchronizes the device (``torch.cuda.synchronize``:
every stream of this process) before it unmaps anything.

Threads: both hooks and every backend call run on the EngineCore main
thread (the busy-loop thread); the uni executor runs the worker there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine_ext._errors import EngineExtConfigError
from engine_ext.vllm._kv_memory import KVMemory, publish_kv_memory

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from allocator import CudaBackend, HostBackend, PageLayout, UnmapFence

    ReservedBackend = CudaBackend | HostBackend

__all__ = [
    "CUDA_GRANULARITY",
    "KvGeometry",
    "PrimedBackend",
    "UnsupportedKvCache",
    "allocate_on_reservation",
    "engine_refusal",
    "kv_geometry",
    "place_kv_cache",
    "plan_kv_cache",
    "virtual_kv_bytes",
    "warmup_block_bound",
    "whole_page_config",
]

_log = logging.getLogger("engine_ext.vllm.gpu_kv")

#: CUDA VMM minimum allocation granularity of NVIDIA GPUs (cuMemGetAllocationGranularity).
#: ``CudaBackend.reserve`` checks the device's real value and refuses a mismatch.
CUDA_GRANULARITY = 2 << 20


class UnsupportedKvCache(EngineExtConfigError):
    """The GPU path cannot place this engine's KV cache: fatal at start, nothing changed."""


def _refuse(what: str) -> UnsupportedKvCache:
    return UnsupportedKvCache(
        f"kvsidecar (GPU path) does not support {what}; run without it (unset "
        "KVSIDECAR_ENABLE) or change the setting named"
    )


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Where the KV cache of one engine lives in a reservation (one region per layer)."""

    layer_names: tuple[str, ...]  # regions, in vLLM's layer order
    block_bytes: int  # one block of one layer (vLLM's block_stride)
    num_blocks: int  # vLLM's block count (block 0 is the null block)
    page_bytes: int  # lcm(granularity, block_bytes)
    granularity: int = CUDA_GRANULARITY  # the device's CUDA VMM granularity, planned with

    @property
    def blocks_per_page(self) -> int:
        return self.page_bytes // self.block_bytes

    @property
    def num_pages(self) -> int:
        return -(-self.num_blocks // self.blocks_per_page)

    @property
    def layout(self) -> PageLayout:
        from allocator import PageLayout

        return PageLayout(self.page_bytes, self.num_pages, len(self.layer_names))

    def placement(self, tensor: KVCacheTensor) -> KVCacheTensor:
        """vLLM's placement of ``tensor`` moved onto the reservation (same block stride)."""
        layout = self.layout
        return replace(tensor, size=layout.total_bytes, layer_stride=layout.region_bytes, offset=0)


def kv_geometry(
    config: KVCacheConfig, layout: KVCacheLayout, granularity: int = CUDA_GRANULARITY
) -> KvGeometry:
    """Check that ``config`` is one standard full-attention cache and lay it out in pages."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = config.kv_cache_groups
    if len(groups) != 1:
        raise _refuse(
            f"{len(groups)} KV cache groups (hybrid, sliding-window or multi-spec "
            "models); only one full-attention group"
        )
    group = groups[0]
    spec = group.kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        raise _refuse(f"the KV cache spec {type(spec).__name__}; only FullAttentionSpec")
    if spec.page_size_padded is not None:
        raise _refuse(f"padded KV pages (page_size_padded={spec.page_size_padded})")
    if group.host_resident or config.hisparse_host_num_blocks is not None:
        raise _refuse("host-resident (HiSparse) KV cache groups")
    if not (layout.is_layer_compact and layout.is_block_compact):
        raise _refuse(
            f"the KV cache layout {layout.name} (a page must cover whole blocks of "
            "each layer); set VLLM_KV_CACHE_LAYOUT=LBNHC"
        )
    if len(config.kv_cache_tensors) != 1:
        raise _refuse(f"{len(config.kv_cache_tensors)} KV cache tensors; only one")
    tensor = config.kv_cache_tensors[0]
    block_bytes = tensor.block_stride
    if tensor.host_resident or tensor.offset != 0:
        raise _refuse(f"a KV tensor at offset {tensor.offset} or host-resident")
    if (
        block_bytes != spec.page_size_bytes
        or tensor.layer_stride != block_bytes * config.num_blocks
    ):
        raise _refuse(
            f"KV strides layer={tensor.layer_stride} block={block_bytes} (expected "
            f"block={spec.page_size_bytes}, layer=block x {config.num_blocks})"
        )
    if granularity <= 0 or block_bytes <= 0:
        raise _refuse(f"granularity {granularity} / block bytes {block_bytes}")
    return KvGeometry(
        layer_names=tuple(tensor.layers),
        block_bytes=block_bytes,
        num_blocks=config.num_blocks,
        page_bytes=math.lcm(granularity, block_bytes),
        granularity=granularity,
    )


def whole_page_config(
    config: KVCacheConfig, layout: KVCacheLayout, granularity: int = CUDA_GRANULARITY
) -> tuple[KVCacheConfig, KvGeometry]:
    """``config`` with ``num_blocks`` rounded down to whole pages, and its geometry.

    The tensor is re-planned the way vLLM's planner does for a layer-outermost
    layout (``size`` = bytes per block x blocks, ``layer_stride`` = block
    stride x blocks), so vLLM's own checks and views stay consistent.
    """
    before = kv_geometry(config, layout, granularity)
    bpp = before.blocks_per_page
    num_blocks = config.num_blocks // bpp * bpp
    if num_blocks < 2 * bpp:
        raise _refuse(
            f"a KV cache of {config.num_blocks} blocks: pages of {before.page_bytes} bytes hold "
            f"{bpp} blocks, which leaves {num_blocks} (at least 2 pages are needed); give vLLM "
            "more KV memory (--gpu-memory-utilization, --kv-cache-memory-bytes)"
        )
    tensor = config.kv_cache_tensors[0]
    if tensor.size % config.num_blocks:
        raise _refuse(f"a KV tensor of {tensor.size} bytes for {config.num_blocks} blocks")
    rounded = replace(
        tensor,
        size=tensor.size // config.num_blocks * num_blocks,
        layer_stride=tensor.block_stride * num_blocks,
    )
    planned = replace(config, num_blocks=num_blocks, kv_cache_tensors=[rounded])
    return planned, replace(before, num_blocks=num_blocks)


def engine_refusal(vllm_config: VllmConfig, executor_class: type) -> str | None:
    """What about this engine the GPU path does not support, or ``None``."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor

    parallel = vllm_config.parallel_config
    if parallel.world_size != 1:
        return (
            f"world size {parallel.world_size} (tensor/pipeline parallel); use "
            "--tensor-parallel-size 1 --pipeline-parallel-size 1"
        )
    if parallel.data_parallel_size != 1:
        return f"data parallel size {parallel.data_parallel_size}"
    if not issubclass(executor_class, UniProcExecutor) or issubclass(
        executor_class, ExecutorWithExternalLauncher
    ):
        return (
            f"the executor {executor_class.__name__} (the worker must run in the EngineCore "
            "process); use --distributed-executor-backend uni"
        )
    if vllm_config.model_config is not None and vllm_config.model_config.enable_sleep_mode:
        return "sleep mode (--enable-sleep-mode unmaps the KV cache itself)"
    if vllm_config.kv_transfer_config is not None:
        return "KV connectors (--kv-transfer-config)"
    if vllm_config.cache_config.num_gpu_blocks_override is not None:
        return "--num-gpu-blocks-override"
    return None


class PrimedBackend:
    """The block pool's view of the worker's reservation.

    Owns the reservation (``inner``) and the set of *primed* pages: mapped
    by the worker before the pool existed, for vLLM's warm-up. Primed pages
    report unmapped, so the pool's ``PageAllocator`` accepts the backend as
    fresh. The pool's first ``map_many`` adopts the primed pages it asks for
    (page 0, the null block) and unmaps the others: from then on the pool
    alone decides what is mapped. Every unmap (and the release) first runs
    ``synchronize`` so no queued kernel touches a page after it is gone.
    Thread: the EngineCore busy-loop thread only (the one that reserved it:
    its CUDA context is current there).
    """

    def __init__(self, inner: ReservedBackend, synchronize: Callable[[], None]) -> None:
        self.inner = inner
        self.layout = inner.layout
        self.base_address = inner.base_address
        self._synchronize = synchronize
        self._primed: set[int] = set()

    def prime(self, pages: Sequence[int], free_cache: Callable[[], None] | None = None) -> None:
        """Map ``pages`` now, before the pool exists (worker, at allocation).

        Out of device memory: ``free_cache`` (default: torch's ``empty_cache``)
        once, then :class:`allocator.DeviceOutOfMemory`, nothing mapped.
        """
        from allocator import map_or_free_cache, torch_empty_cache

        map_or_free_cache(self.inner, pages, free_cache or torch_empty_cache)
        self._primed.update(pages)

    def map(self, page: int) -> None:
        self.map_many([page])

    def unmap(self, page: int) -> None:
        self.unmap_many([page])

    def map_many(self, pages: Sequence[int]) -> None:
        wanted = set(pages)
        stale = sorted(self._primed - wanted)
        if stale:  # the pool's first call: the warm-up's pages go, except those it asks for
            self._synchronize()
            self.inner.unmap_many(stale)
            self._primed.difference_update(stale)
        rest = [page for page in pages if page not in self._primed]
        if rest:
            self.inner.map_many(rest)
        self._primed.difference_update(wanted)

    def unmap_many(self, pages: Sequence[int]) -> None:
        from allocator import AllocatorContractError

        primed = sorted(set(pages) & self._primed)
        if primed:
            raise AllocatorContractError(f"pages {primed} are not mapped by the pool; map first")
        self._synchronize()  # kernels queued on any stream may still use these pages
        self.inner.unmap_many(pages)

    def is_mapped(self, page: int) -> bool:
        return self.inner.is_mapped(page) and page not in self._primed

    def mapped_bytes(self) -> int:
        return self.inner.mapped_bytes()  # measured: includes primed pages

    def trim_spares(self, keep_pages: int = 0) -> None:
        trim = getattr(self.inner, "trim_spares", None)  # CudaBackend's spare handles
        if trim is not None:
            trim(keep_pages)

    def release(self) -> None:
        self._synchronize()
        self.inner.release()
        self._primed.clear()


def _reserve_cuda(layout: PageLayout, device: torch.device) -> ReservedBackend:
    import torch

    from allocator import CudaBackend

    index = device.index if device.index is not None else torch.cuda.current_device()
    return CudaBackend.reserve(layout, device=index)


def _prime_warmup(
    primed: PrimedBackend, pages: int, empty_cache: Callable[[], None] | None
) -> None:
    """Map the warm-up's ``pages``; a device still full after emptying torch's cache refuses."""
    from allocator import DeviceOutOfMemory

    try:
        primed.prime(range(pages), empty_cache)
    except DeviceOutOfMemory as exc:
        raise UnsupportedKvCache(
            f"kvsidecar: the device has no memory for the {pages} KV pages vLLM's warm-up "
            f"writes ({exc}); lower --max-num-seqs / --max-num-batched-tokens, or lower the "
            "limits of the other engines on this GPU (docs/overcommit.md)"
        ) from exc


def _cuda_fence(device: torch.device) -> UnmapFence:
    """The unmap fence (allocator.UnmapFence): a device sync until the runtime records
    after a forward pass (``Scheduler.update_from_output``), an event wait from then on."""
    from allocator import torch_unmap_fence

    return torch_unmap_fence(device)


def warmup_pages(geometry: KvGeometry, warmup_blocks: int | None) -> int:
    """Pages covering blocks ``0 .. warmup_blocks - 1`` (at least page 0; ``None``: all)."""
    if warmup_blocks is None:
        return geometry.num_pages
    return max(1, min(geometry.num_pages, -(-warmup_blocks // geometry.blocks_per_page)))


def warmup_block_bound(vllm_config: VllmConfig, block_size: int) -> int:
    """Blocks ``0 .. n - 1`` that vLLM's start-up may write, an upper bound on ``n``.

    vLLM 0.33's V2 warm-up (``vllm/v1/worker/gpu/warmup.py``) hands block ids
    out from 1 upwards: ``_warmup_kernels`` gives at most ``max_num_seqs``
    requests of ``decode_query_len + 1`` prompt tokens and up to 5 decode steps
    each, ``run_mixed_prefill_decode_warmup`` one prefill of up to
    ``max_num_batched_tokens`` tokens and one short decode request. Profiling
    and CUDA-graph capture write through the null block (block 0) or not at
    all. Both warm-ups are counted in full, one after the other.
    """
    scheduler = vllm_config.scheduler_config
    speculative = vllm_config.speculative_config
    spec_tokens = int(getattr(speculative, "num_speculative_tokens", 0) or 0)
    query = 1 + spec_tokens
    decode_len = query + 1 + (5 if spec_tokens else 3) * query
    per_request = -(-decode_len // block_size) + 1  # + 1: a page boundary inside a request
    kernels = int(scheduler.max_num_seqs) * per_request
    mixed = -(-int(scheduler.max_num_batched_tokens) // block_size) + 2 * per_request
    return 1 + kernels + mixed  # + 1: the null block


def _cuda_total_memory() -> int:
    import torch

    return int(torch.cuda.mem_get_info()[1])


def _cuda_granularity() -> int:
    """The current CUDA device's VMM allocation granularity (pages are multiples of it)."""
    import torch

    from allocator import CudaBackend

    return CudaBackend.device_granularity(torch.cuda.current_device())


def virtual_kv_bytes(
    vllm_config: VllmConfig, setting: int | None, device_total: Callable[[], int]
) -> int:
    """The KV capacity to plan for: the setting, ``--kv-cache-memory-bytes``, or the device."""
    if setting is not None:
        return setting
    explicit = vllm_config.cache_config.kv_cache_memory_bytes
    if explicit:
        return int(explicit)
    return device_total()


def allocate_on_reservation(
    config: KVCacheConfig,
    device: torch.device,
    layout: KVCacheLayout,
    kernel_block_sizes: list[int] | None,
    *,
    plan: KvGeometry,
    granularity: int | None = None,
    reserve: Callable[[PageLayout, torch.device], ReservedBackend] = _reserve_cuda,
    synchronize: Callable[[], None] | None = None,
    warmup_blocks: int | None = None,
    empty_cache: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """What vLLM's ``allocate_kv_cache`` returns, over a published reservation.

    Only the pages holding blocks ``0 .. warmup_blocks - 1`` are mapped before
    the block pool takes over (``None``: every page, as vLLM's own cache).
    ``granularity`` (``None``: the plan's) lays the worker's config out in pages.
    """
    import torch
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    from allocator import BackendError, DeviceOutOfMemory

    geometry = kv_geometry(config, layout, plan.granularity if granularity is None else granularity)
    if geometry != plan:
        raise _refuse(
            f"a worker KV cache ({geometry}) that differs from the EngineCore's plan ({plan})"
        )
    try:
        backend = reserve(geometry.layout, device)
    except BackendError as exc:
        if isinstance(exc, DeviceOutOfMemory):
            raise
        size = geometry.layout.total_bytes
        amount = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
        raise UnsupportedKvCache(
            f"kvsidecar: cannot reserve {amount} of address space for the KV cache on "
            f"{device} ({exc.__cause__ or exc}); lower KVSIDECAR_VIRTUAL_KV_BYTES or "
            "--kv-cache-memory-bytes (the virtual KV capacity, docs/overcommit.md)"
        ) from exc
    try:
        fence = None if synchronize is not None else _cuda_fence(device)
        wait = synchronize if fence is None else fence.wait
        assert wait is not None
        primed = PrimedBackend(backend, wait)
        _prime_warmup(primed, warmup_pages(geometry, warmup_blocks), empty_cache)
        raw = backend.tensor().view(torch.int8)
        tensor = config.kv_cache_tensors[0]
        spec = config.kv_cache_groups[0].kv_cache_spec
        kernel_block_size = kernel_block_sizes[0] if kernel_block_sizes else None
        views = create_kv_cache_views(
            raw, spec, config.num_blocks, layout, geometry.placement(tensor), kernel_block_size
        )
    except BaseException:
        backend.release()
        raise
    publish_kv_memory(
        KVMemory(primed, geometry.layout, geometry.block_bytes, config.num_blocks, fence=fence)
    )
    _log.info(
        "kvsidecar: KV cache of %d blocks x %d layers on a reservation of %d pages of %d "
        "bytes (%d blocks/page); %d pages mapped for the warm-up until the block pool "
        "takes over",
        config.num_blocks,
        len(geometry.layer_names),
        geometry.num_pages,
        geometry.page_bytes,
        geometry.blocks_per_page,
        warmup_pages(geometry, warmup_blocks),
    )
    return dict(zip(tensor.layers, views, strict=True))


# -- the two patches (EngineCore main thread) -------------------------------------------


@dataclass(slots=True)
class _State:
    plan: KvGeometry | None = None  # set by the planning hook, taken by the allocation
    warmup_blocks: int | None = None  # blocks the warm-up may write (planning hook)


_state = _State()


def _gpu_path_applies(vllm_config: VllmConfig) -> bool:
    from vllm.platforms import current_platform
    from vllm.v1.executor.abstract import Executor

    if not current_platform.is_cuda():
        return False  # CPU: the CPU harness (StubExecutor) publishes a HostBackend itself
    return not Executor.get_class(vllm_config).__module__.startswith("engine_ext.")


def _virtual_setting() -> int | None:
    from engine_ext import load_engine_settings

    return load_engine_settings().virtual_kv_bytes


def plan_kv_cache(
    original: Callable[..., Any],
    *,
    device_total: Callable[[], int] = _cuda_total_memory,
    setting: Callable[[], int | None] = _virtual_setting,
    granularity: Callable[[], int] | None = None,
) -> Callable[..., Any]:
    """Patch factory for ``vllm.v1.engine.core:get_kv_cache_configs``.

    vLLM plans for its *virtual* KV capacity (:func:`virtual_kv_bytes`), not
    for the free memory its profiler measured: nothing is mapped by the plan.
    Pages are multiples of the device's own allocation granularity
    (``granularity``, default: asked of the driver; the plan carries it to the
    worker's reservation).
    """

    def get_kv_cache_configs(
        vllm_config: VllmConfig,
        kv_cache_specs: list[Any],
        available_memory: list[int],
        global_kv_cache_groups: list[Any],
    ) -> list[KVCacheConfig]:
        if not _gpu_path_applies(vllm_config):
            native: list[KVCacheConfig] = original(
                vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups
            )
            return native
        from vllm.v1.executor.abstract import Executor

        reason = engine_refusal(vllm_config, Executor.get_class(vllm_config))
        if reason is not None:
            raise _refuse(reason)
        virtual = virtual_kv_bytes(vllm_config, setting(), device_total)
        _log.info(
            "kvsidecar: KV cache planned for %d virtual bytes (vLLM measured %s bytes "
            "free for KV); physical memory follows the limit",
            virtual,
            list(available_memory),
        )
        configs: list[KVCacheConfig] = original(
            vllm_config,
            kv_cache_specs,
            [virtual] * len(available_memory),
            global_kv_cache_groups,
        )
        if len(configs) != 1:
            raise _refuse(f"{len(configs)} workers")
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        device_granularity = (granularity or _cuda_granularity)()
        planned, geometry = whole_page_config(configs[0], layout, device_granularity)
        spec = planned.kv_cache_groups[0].kv_cache_spec
        max_len = vllm_config.model_config.max_model_len
        needed = spec.max_num_blocks_per_req(vllm_config, max_len)
        if needed > planned.num_blocks:
            raise _refuse(
                f"max_model_len {max_len} in {planned.num_blocks} whole-page blocks (needs "
                f"{needed}); lower --max-model-len or give vLLM more KV memory"
            )
        if planned.num_blocks != configs[0].num_blocks:
            _log.info(
                "kvsidecar: KV blocks %d -> %d (whole pages of %d blocks)",
                configs[0].num_blocks,
                planned.num_blocks,
                geometry.blocks_per_page,
            )
        _state.plan = geometry
        _state.warmup_blocks = warmup_block_bound(vllm_config, spec.block_size)
        return [planned]

    get_kv_cache_configs.__wrapped__ = original  # type: ignore[attr-defined]
    return get_kv_cache_configs


def place_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch factory for ``allocate_kv_cache`` as imported by the GPU model runners."""

    def allocate_kv_cache(
        kv_cache_config: KVCacheConfig,
        device: torch.device,
        layout: KVCacheLayout,
        kernel_block_sizes: list[int] | None = None,
    ) -> dict[str, torch.Tensor]:
        plan, _state.plan = _state.plan, None
        warmup_blocks, _state.warmup_blocks = _state.warmup_blocks, None
        if plan is None:
            # Before planning (the profiling run's minimal cache) or not the GPU path. The
            # supported set-ups never re-allocate after start-up (sleep mode, elastic EP
            # and data parallelism are refused by the planning hook).
            result: dict[str, torch.Tensor] = original(
                kv_cache_config, device, layout, kernel_block_sizes
            )
            return result
        if device.type != "cuda":
            raise _refuse(f"KV tensors on device {device}")
        return allocate_on_reservation(
            kv_cache_config,
            device,
            layout,
            kernel_block_sizes,
            plan=plan,
            warmup_blocks=warmup_blocks,
        )

    allocate_kv_cache.__wrapped__ = original  # type: ignore[attr-defined]
    return allocate_kv_cache
