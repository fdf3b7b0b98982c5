"""Inside SGLang's pool construction: K/V tensors on a reservation, then the elastic allocator.

``KVCacheConfigurator`` builds the KV pool (``MHATokenToKVPool``, whose
``_create_buffers_normal`` allocates the tensors) and then the token-to-KV
allocator. :func:`place_kv_buffers` replaces the tensor allocation with views
on a reservation, builds the page/block allocators over it, maps the padding
page at once (SGLang's KV-copy warm-up writes slot 0 right after) and
remembers them on the pool; :func:`build_elastic_allocator` finds it there and builds the
:class:`ElasticTokenAllocator` over it. Pools the adapter does not
understand (quantized, vectorized, MLA with different K/V widths) refuse to
start with the reason, rather than run without limits.

Thread: the scheduler process's main thread, during ``Scheduler.__init__``.
"""

from __future__ import annotations

from typing import Any

from allocator import (
    Backend,
    BlockAllocator,
    CudaBackend,
    FencedBackend,
    PageAllocator,
    torch_unmap_fence,
)

from .. import EngineSettings
from .._errors import EngineExtConfigError
from ._allocator import PADDING_BLOCK, ElasticTokenAllocator, claim_block
from ._kv_memory import KVGeometry, KVReservation, reserve_kv

__all__ = ["build_elastic_allocator", "place_kv_buffers"]

ATTR = "_kvsidecar_reservation"


def place_kv_buffers(pool: Any, settings: EngineSettings) -> KVReservation:
    """``MHATokenToKVPool._create_buffers_normal``: K/V views on a fresh reservation."""
    problems = []
    if pool.page_size < 2:
        problems.append("page size 1 (pass --page-size 16 or larger)")
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd" or getattr(pool, "use_hnd", False):
        problems.append(f"KV layout {getattr(pool, 'kv_cache_layout', '?')!r} (only 'nhd')")
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        problems.append("K and V of different widths")
    if getattr(pool, "enable_custom_mem_pool", False):
        problems.append("a custom memory pool (PD transfer backends)")
    if problems:
        raise EngineExtConfigError(
            "kvsidecar cannot place this SGLang KV cache: "
            + "; ".join(problems)
            + ". Start SGLang without kvsidecar (KVSIDECAR_ENABLE=0) or with the default layout"
        )
    geometry = KVGeometry(
        page_size=pool.page_size,
        head_num=pool.head_num,
        head_dim=pool.head_dim,
        layer_num=pool.layer_num,
        dtype_bytes=pool.store_dtype.itemsize,
        max_tokens=pool.size,
    )
    reservation = reserve_kv(geometry, device=str(pool.device))
    guard = settings.new_thread_guard("sglang-kv-pool")
    backend: Backend = reservation.backend
    if isinstance(backend, CudaBackend):  # unmaps wait for the device work (allocator.UnmapFence)
        backend = FencedBackend(backend, torch_unmap_fence(f"cuda:{backend.device}"))
    pages = PageAllocator(backend, reserve_pages=settings.reserve_pages, guard=guard)
    blocks = BlockAllocator(pages, reservation.blocks_per_page)
    claim_block(blocks, PADDING_BLOCK)  # mapped now: SGLang's warm-ups write slot 0 at once
    pool.size = reservation.size_tokens  # rounded down to whole mapping pages
    pool.k_buffer, pool.v_buffer = reservation.buffers(pool.store_dtype)
    setattr(pool, ATTR, (reservation, blocks))
    return reservation


def build_elastic_allocator(
    configurator: Any, kv_pool: Any, settings: EngineSettings
) -> ElasticTokenAllocator:
    """``_build_token_to_kv_pool_allocator``: the elastic allocator over the pool's reservation."""
    placed: tuple[KVReservation, BlockAllocator] | None = getattr(kv_pool, ATTR, None)
    if placed is None:
        raise EngineExtConfigError(
            f"kvsidecar supports SGLang's MHATokenToKVPool, not {type(kv_pool).__name__} "
            "(hybrid SWA/Mamba and MLA pools are not elastic yet); start without kvsidecar "
            "(KVSIDECAR_ENABLE=0)"
        )
    _reservation, blocks = placed
    return ElasticTokenAllocator(
        blocks,
        page_size=kv_pool.page_size,
        dtype=configurator.kv_cache_dtype,
        device=configurator.device,
        kvcache=kv_pool,
    )
