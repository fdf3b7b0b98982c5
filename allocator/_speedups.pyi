"""Interface of the C module built from ``allocator/_speedups.c`` (BlockAllocator's hot paths)."""

from collections.abc import Iterable
from typing import Any

class BlockCore:
    """The C base of ``allocator.BlockAllocator``: its hot paths and the fields they use."""

    guard: Any
    pages: Any
    _allocated: bytearray
    _occupancy: list[int]
    _ev_on: list[int]
    _slots: list[list[int]]
    _retired: bytearray
    _buckets: list[list[int]]
    _rbuckets: list[list[int]]
    _pos: list[int]
    blocks_per_page: int
    num_blocks: int
    num_allocated_blocks: int
    num_retired_blocks: int
    _partial_free: int
    _top: int
    _rtop: int
    changes: int
    num_evictable_blocks: int
    num_reclaimable_pages: int
    tracks_evictable: bool
    refused_by_device: bool
    def alloc(self, n: int) -> list[int] | None: ...
    def free(self, blocks: Iterable[int]) -> None: ...
    def mark_evictable(self, blocks: Iterable[int]) -> None: ...
    def unmark_evictable(self, blocks: Iterable[int]) -> None: ...

def configure(contract_error: type[Exception], base_error: type[Exception]) -> None:
    """The exceptions the hot paths raise (``AllocatorContractError``, ``AllocatorError``)."""

def mprotect(addr: int, length: int, prot: int) -> int:
    """libc ``mprotect``: 0, or the errno of the failure."""

def fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    """libc ``fallocate``: 0, or the errno of the failure."""
