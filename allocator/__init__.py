"""Physical pages mapped on demand and really returned when unmapped.

``PageLayout`` describes a reservation; a :class:`Backend` (``HostBackend``:
memfd, ``CudaBackend``: CUDA VMM) maps its pages to memory;
``PageAllocator`` decides which pages are mapped under a target;
``BlockAllocator`` hands out engine blocks inside them. Both allocators are
mutated by one thread only, enforced by a ``ThreadGuard``. Imports nothing of
ours, no engine and no torch (tensors are built lazily).
"""

from ._backend import Backend
from ._blocks import BlockAllocator
from ._cuda import CudaBackend
from ._errors import (
    AllocatorConfigError,
    AllocatorContractError,
    AllocatorError,
    BackendError,
    DeviceOutOfMemory,
    ForeignThreadError,
)
from ._fence import DeviceEvent, FencedBackend, UnmapFence, torch_unmap_fence
from ._guard import ThreadGuard
from ._host import HostBackend
from ._layout import PageLayout
from ._pages import PageAllocator, PageObserver, PageState
from ._prime import map_or_free_cache, torch_empty_cache

__all__ = [
    "AllocatorConfigError",
    "AllocatorContractError",
    "AllocatorError",
    "Backend",
    "BackendError",
    "BlockAllocator",
    "CudaBackend",
    "DeviceEvent",
    "DeviceOutOfMemory",
    "FencedBackend",
    "ForeignThreadError",
    "HostBackend",
    "PageAllocator",
    "PageLayout",
    "PageObserver",
    "PageState",
    "ThreadGuard",
    "UnmapFence",
    "map_or_free_cache",
    "torch_empty_cache",
    "torch_unmap_fence",
]
