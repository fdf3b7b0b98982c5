"""The KV-cache reservation of this process, shared by the worker and the block pool.

With world size 1 vLLM runs the worker inside the EngineCore process
(``UniProcExecutor`` or the CPU harness's ``StubExecutor``), so the KV tensors
and the ``BlockPool`` live in the same process. The worker reserves the
memory (``HostBackend`` on CPU, ``CudaBackend`` on GPU) and *publishes* it
here before the scheduler is built (EngineCore builds the executor, sizes and
allocates the KV cache, then builds the scheduler); the elastic block pool
*claims* it when it is constructed and from then on decides which pages are
mapped. An unclaimed reservation is the native behaviour: the worker maps
every page itself.

Thread: publish and claim happen on the EngineCore main thread (which is also
the busy-loop thread); nothing here is touched afterwards by another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from allocator import Backend, PageLayout

__all__ = ["KVMemory", "claim_kv_memory", "clear_kv_memory", "publish_kv_memory"]


@dataclass(slots=True)
class KVMemory:
    """One KV reservation: ``layout.num_regions`` regions (layers x K/V).

    Block ``b`` of region ``r`` starts at ``layout.page_offset(r, b // blocks_per_page)
    + (b % blocks_per_page) * block_bytes``; a block never straddles a page.
    """

    backend: Backend  # maps/unmaps pages; mapped_bytes() is measured
    layout: PageLayout  # page_bytes per region, num_pages, num_regions
    block_bytes: int  # bytes of one block in ONE region
    num_blocks: int  # vLLM's block count (block 0 is vLLM's null block)
    claimed: bool = field(default=False)  # True once an elastic block pool owns mapping
    rank_barrier: Any = field(
        default=None
    )  # TP/PP ranks (CPU harness): the coordinator's RankBarrier
    # GPU: the fence the backend's unmaps wait on (allocator.UnmapFence); the runtime
    # records it after each forward pass (Scheduler.update_from_output)
    fence: Any = field(default=None)

    @property
    def blocks_per_page(self) -> int:
        return self.layout.page_bytes // self.block_bytes

    def page_of(self, block_id: int) -> int:
        return block_id // self.blocks_per_page


_current: KVMemory | None = None


def publish_kv_memory(memory: KVMemory) -> None:
    """The worker announces its reservation (replaces an older, released one)."""
    global _current
    _current = memory


def claim_kv_memory() -> KVMemory | None:
    """The block pool takes ownership of mapping; None if no worker published one."""
    if _current is None:
        return None
    _current.claimed = True
    return _current


def clear_kv_memory() -> None:
    """Forget the reservation (worker shutdown)."""
    global _current
    _current = None
