"""SGLang's paged token-to-KV allocator, backed by a kvsidecar :class:`BlockAllocator`.

SGLang page *p* (``page_size`` token slots) is block *p* of the block
allocator; an allocator *page* (the unit that is mapped and unmapped) is a
run of ``blocks_per_page`` SGLang pages. The class keeps SGLang's interface
and kernels: each allocation takes exactly the blocks it needs from the
block allocator, hands them to the parent's code as its free list, and
leaves the free list empty again. Frees go back to the block allocator, so
a page whose last block is freed is unmapped (retired pages) or kept as
reserve at once.

Accounting stays consistent with the scheduler's checks:

* :meth:`available_size` is what an allocation could get *now*, under the
  current limit: blocks on free mapped pages, on mappable pages under the
  target and the free slots of partly used pages. Evictable cache blocks
  sitting on *retired* pages are subtracted, because evicting them unmaps
  their page instead of making room; admission (``available + evictable``)
  therefore never promises what allocation cannot deliver.
* :meth:`capacity_tokens` is the total the idle leak check must use in place
  of the configured ``max_total_num_tokens``: configured capacity minus what
  a limit took away (see :mod:`._accounting`).

Thread: the scheduler thread only (the block allocator's guard enforces it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.utils.common import get_num_new_pages

if TYPE_CHECKING:
    from allocator import BlockAllocator

__all__ = ["ElasticTokenAllocator"]

PADDING_BLOCK = 0  # SGLang page 0 absorbs padded writes; never handed out


class ElasticTokenAllocator(PagedTokenToKVPoolAllocator):  # type: ignore[misc]
    """A ``PagedTokenToKVPoolAllocator`` whose pages are blocks of a :class:`BlockAllocator`.

    Owns the padding block (held while work may run; given back when the
    scheduler is fully idle under a limit that needs its page) and the
    mapping between SGLang page ids and block ids (the identity). Does not
    own the block allocator's life cycle. Scheduler thread only.
    """

    def __init__(
        self,
        blocks: BlockAllocator,
        *,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
    ) -> None:
        self.blocks = blocks
        self._padding_held = False
        self._initialized = False  # clear() ran once (the constructor calls it)
        self._before_alloc: Callable[[], None] | None = None
        self._retired_evictable: Callable[[], int] | None = None
        self.num_failed_allocs = 0  # allocations that returned None (SGLang then waits/evicts)
        self.num_allocs = 0  # successful block allocations (change detection for reclaimers)
        self.num_frees = 0  # block frees (change detection for reclaimers)
        size = (blocks.num_blocks - 1) * page_size
        # need_sort (PD staging) is not used: freed pages go back to the block allocator at once.
        super().__init__(size, page_size, dtype, device, kvcache, need_sort=False)

    # -- wiring (before the scheduler runs) ------------------------------------------

    def set_before_alloc(self, hook: Callable[[], None] | None) -> None:
        """Called at the top of every allocation; it must never take a new target
        (see :mod:`._runtime`): the pool only makes sure its first pass ran."""
        self._before_alloc = hook

    def set_retired_evictable(self, count: Callable[[], int] | None) -> None:
        """Counts evictable cache blocks on retired pages (they cannot make room)."""
        self._retired_evictable = count

    # -- accounting --------------------------------------------------------------------

    def available_size(self) -> int:
        """Token slots an allocation could get now, under the current limit.

        0 while the padding page is given back (idle under a limit): nothing
        is admitted until :meth:`claim_padding` succeeded.
        """
        if not self._padding_held:
            return 0
        free = self.blocks.num_free_blocks
        if self._retired_evictable is not None and self.blocks.num_retired_blocks:
            free -= self._retired_evictable()
        return int(free * self.page_size)

    def capacity_tokens(self) -> int:
        """Token capacity under the current limit (what the leak check's total must be)."""
        if not self._padding_held:
            return 0  # released only with nothing else allocated: nothing to account for
        usable = self.blocks.num_free_blocks + self.blocks.num_allocated_blocks - 1
        if self._retired_evictable is not None and self.blocks.num_retired_blocks:
            usable -= self._retired_evictable()
        return int(usable * self.page_size)

    def get_all_free_pages(self) -> torch.Tensor:
        """Not enumerable (free pages are virtual until mapped); an empty census."""
        return self.free_pages

    # -- the padding page --------------------------------------------------------------

    @property
    def padding_held(self) -> bool:
        """Whether block 0 (SGLang's padding page) is held, i.e. forward passes may run."""
        return self._padding_held

    def release_padding(self) -> bool:
        """Give the padding page back when nothing else is allocated (fully idle, limit 0)."""
        if not self._padding_held or self.blocks.num_allocated_blocks != 1:
            return False
        self._free_blocks([PADDING_BLOCK])
        self._padding_held = False
        return True

    def claim_padding(self) -> bool:
        """Hold the padding page again before work is admitted; False if the limit forbids it."""
        if self._padding_held:
            return True
        try:
            claim_block(self.blocks, PADDING_BLOCK)
        except RuntimeError:
            return False
        self.num_allocs += 1
        self._padding_held = True
        return True

    # -- allocation --------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        self._step()
        pages = self._take(need_size // self.page_size)
        if pages is None:
            return None
        return self._run_with(pages, lambda: super(ElasticTokenAllocator, self).alloc(need_size))

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        self._step()
        needed = int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                       prefix_lens=prefix_lens_cpu))
        pages = self._take(needed)
        if pages is None:
            return None
        parent = super().alloc_extend
        return self._run_with(pages, lambda: parent(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
            num_new_pages=needed))

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        self._step()
        needed = int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                       decode=True))
        pages = self._take(needed)
        if pages is None:
            return None
        parent = super().alloc_decode
        return self._run_with(pages, lambda: parent(seq_lens, seq_lens_cpu, last_loc))

    # -- freeing -----------------------------------------------------------------------

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        ids: list[int] = []
        for chunk in page_ids:
            ids.extend(int(p) for p in chunk.tolist())
        if PADDING_BLOCK in ids:
            raise ValueError("SGLang freed the padding page 0; it is never allocated")
        self._free_blocks(ids)

    def clear(self) -> None:
        """First call (construction): hold the padding page. Later (``flush_cache``):
        free every block but the padding page."""
        if not self._initialized:
            if not self.blocks.is_allocated(PADDING_BLOCK):  # placed pools claim it earlier
                claim_block(self.blocks, PADDING_BLOCK)
            self._padding_held = self._initialized = True
        else:
            held = [b for b in range(1, self.blocks.num_blocks) if self.blocks.is_allocated(b)]
            if held:
                self._free_blocks(held)
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.free_group = None
        self.free_page_ids_group: list[torch.Tensor] = []
        self.staged_pages: list[torch.Tensor] = []
        self.num_staged_pages = 0

    # -- internals ---------------------------------------------------------------------

    def _step(self) -> None:
        if self._before_alloc is not None:
            self._before_alloc()
        self.claim_padding()

    def _free_blocks(self, ids: list[int]) -> None:
        if ids:
            self.blocks.free(ids)
            self.num_frees += 1

    def _take(self, num_pages: int) -> torch.Tensor | None:
        got = self.blocks.alloc(num_pages)
        if got is None:
            self.num_failed_allocs += 1
            return None
        self.num_allocs += 1
        return torch.tensor(got, dtype=torch.int64, device=self.device)

    def _run_with(self, pages: torch.Tensor, call: Callable[[], torch.Tensor | None]
                  ) -> torch.Tensor | None:
        """Run the parent's allocation with exactly ``pages`` as its free list."""
        self.free_pages = pages
        try:
            out = call()
        except BaseException:
            self.free_pages = self.free_pages[:0]
            self._free_blocks(pages.tolist())
            raise
        left = self.free_pages
        self.free_pages = pages[:0]
        if out is None or len(left):
            # Cannot happen (we computed the parent's exact page count); never leak a block.
            self._free_blocks(left.tolist() if out is not None else pages.tolist())
            if out is None:
                self.num_failed_allocs += 1
        return out


def claim_block(blocks: BlockAllocator, wanted: int) -> None:
    """Allocate exactly block ``wanted`` (at start-up; gives back what it took on the way)."""
    taken: list[int] = []
    try:
        while True:
            got = blocks.alloc(1)
            if got is None:
                raise RuntimeError(f"block {wanted} could not be allocated: the pool is full")
            if got[0] == wanted:
                return
            taken.append(got[0])
    finally:
        if taken:
            blocks.free(taken)


def blocks_of(slots: Iterable[int], page_size: int) -> set[int]:
    """The blocks (SGLang pages) that hold these token slots."""
    return {s // page_size for s in slots}
