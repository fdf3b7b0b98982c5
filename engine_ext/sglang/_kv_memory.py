"""SGLang's K/V buffers placed on a kvsidecar reservation.

``MHATokenToKVPool`` keeps one K and one V tensor per layer, shape
``[rows, heads, head_dim]``, where token slot *s* is row *s* in every one of
them. A run of ``page_size`` rows (one SGLang page) is therefore a contiguous
byte range in each of the ``2 x layers`` tensors: exactly a *block* of the
allocator, with one region per tensor. :func:`reserve_kv` cuts the
reservation so that SGLang page *p* is block *p* and returns the tensors as
views on it; only mapped pages may be touched, which is what the elastic
allocator guarantees for every slot it hands out.

SGLang page 0 is the padding page (CUDA-graph padding writes land in slot 0),
so block 0 is held by the allocator for the life of the pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from allocator import CudaBackend, HostBackend, PageLayout

from .._errors import EngineExtConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["KVGeometry", "KVReservation", "cuda_index", "reserve_kv", "virtual_kv_bytes"]

#: Host mapping granularity (one OS page).
HOST_GRANULARITY = 4096
#: CUDA VMM granularity on current GPUs (cuMemGetAllocationGranularity, minimum).
CUDA_GRANULARITY = 2 << 20


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one SGLang MHA KV pool looks like."""

    page_size: int  # tokens per SGLang page (one allocator block)
    head_num: int  # KV heads on this rank
    head_dim: int
    layer_num: int
    dtype_bytes: int  # bytes per element (2 for fp16/bf16)
    max_tokens: int  # SGLang's sizing: the pool may hold at most this many tokens

    @property
    def row_bytes(self) -> int:
        """Bytes of one token slot in one K or V tensor."""
        return self.head_num * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one SGLang page in one K or V tensor."""
        return self.page_size * self.row_bytes


@dataclass(frozen=True, slots=True)
class KVReservation:
    """A reservation cut for one KV pool; SGLang page *p* is block *p*."""

    backend: HostBackend | CudaBackend  # maps/unmaps pages in all 2 x layers regions at once
    geometry: KVGeometry
    blocks_per_page: int  # SGLang pages per allocator page
    num_blocks: int  # SGLang pages incl. the padding page 0

    @property
    def size_tokens(self) -> int:
        """Token capacity SGLang sees (padding page excluded)."""
        return (self.num_blocks - 1) * self.geometry.page_size

    def buffers(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V tensors ``[rows, heads, head_dim]`` viewing the reservation.

        Regions alternate K, V per layer, and each tensor spans its whole region,
        so V of a layer starts exactly one tensor after its K -- the layout
        SGLang 0.5.23 gives K/V pairs (one allocation, two block-aligned halves)
        for kernels that reach V by a block offset from K.
        """
        geo = self.geometry
        rows = self.num_blocks * geo.page_size
        views = []
        for region in range(2 * geo.layer_num):
            raw = self.backend.tensor(region)
            views.append(raw.view(dtype).view(rows, geo.head_num, geo.head_dim))
        return views[0::2], views[1::2]


def plan_layout(geometry: KVGeometry, granularity: int) -> tuple[PageLayout, int]:
    """The page layout for ``geometry`` and how many blocks fit in one page.

    A page is the smallest multiple of ``granularity`` that holds whole
    blocks; the page count is rounded *down* so the pool never maps more than
    SGLang sized it for (the padding page included).
    """
    if geometry.page_size <= 0 or geometry.max_tokens < geometry.page_size:
        raise EngineExtConfigError(
            f"a KV pool of {geometry.max_tokens} tokens cannot hold one page of "
            f"{geometry.page_size} tokens; give SGLang more memory (--mem-fraction-static)"
        )
    block = geometry.block_bytes
    page_bytes = block * granularity // math.gcd(block, granularity)
    blocks_per_page = page_bytes // block
    wanted_blocks = geometry.max_tokens // geometry.page_size + 1  # + padding page
    num_pages = wanted_blocks // blocks_per_page
    if num_pages < 1:
        raise EngineExtConfigError(
            f"the KV pool ({wanted_blocks} pages of {block} bytes per layer) is smaller than "
            f"one mapping page ({page_bytes} bytes); give SGLang more memory or use a "
            "larger --page-size"
        )
    return PageLayout(page_bytes, num_pages, 2 * geometry.layer_num), blocks_per_page


def _current_cuda_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def cuda_index(device: str, current: Callable[[], int] = _current_cuda_device) -> int:
    """The CUDA ordinal ``device`` means, as torch reads it.

    SGLang 0.5.23 gives its pools the bare string ``"cuda"`` and keeps the
    ordinal in ``gpu_id``, after ``torch.cuda.set_device(gpu_id)``: a bare
    ``"cuda"`` is the *current* device, never GPU 0.
    """
    _, _, index = device.partition(":")
    if not index:
        return current()
    if not index.isdigit():
        raise EngineExtConfigError(f"cannot read the CUDA device {device!r}; expected cuda:N")
    return int(index)


def virtual_kv_bytes(
    device: str, gpu_id: int, setting: int | None, device_total: Callable[[int], int] | None = None
) -> int | None:
    """The KV budget SGLang should size its pool for, or ``None`` for SGLang's own sizing.

    ``setting`` (``KVSIDECAR_VIRTUAL_KV_BYTES``) wins; on CUDA the default is the
    device's total memory (docs/overcommit.md); on CPU SGLang's own sizing stays.
    """
    if setting is not None:
        return setting
    if not device.startswith("cuda"):
        return None
    if device_total is None:
        import torch

        return int(torch.cuda.get_device_properties(gpu_id).total_memory)
    return device_total(gpu_id)


def reserve_kv(
    geometry: KVGeometry,
    *,
    device: str,
    name: str = "kvsidecar-sglang",
    current_cuda: Callable[[], int] = _current_cuda_device,
) -> KVReservation:
    """Reserve (not map) the KV memory for ``geometry`` on ``device`` ("cpu" or "cuda[:n]")."""
    backend: HostBackend | CudaBackend
    if device == "cpu":
        layout, bpp = plan_layout(geometry, HOST_GRANULARITY)
        backend = HostBackend.reserve(layout, name=name)
    elif device.startswith("cuda"):
        index = cuda_index(device, current_cuda)
        layout, bpp = plan_layout(geometry, CUDA_GRANULARITY)
        backend = CudaBackend.reserve(layout, device=index)
    else:
        raise EngineExtConfigError(
            f"kvsidecar cannot place SGLang's KV cache on {device!r}; "
            "supported devices are cpu and cuda"
        )
    return KVReservation(backend, geometry, bpp, layout.num_pages * bpp)
