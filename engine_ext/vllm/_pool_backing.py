"""What ``ElasticBlockPool`` is built over, in a module that imports no vLLM.

The runtime (:mod:`._runtime`) builds a :class:`PoolBacking` and the pool
(:mod:`._block_pool`) uses it; both import this module, neither imports the
other at module level, so there is no import circle between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from allocator import BlockAllocator, ThreadGuard
    from engine_ext import LimitMailbox

__all__ = ["DeviceFullError", "PoolBacking", "PoolHooks"]


class DeviceFullError(ValueError):
    """``get_new_blocks``: the device could not back a page (a ``ValueError``, as vLLM's
    own "cannot get free blocks"); the ``allocate_slots`` wrapper turns it into a refusal."""


class PoolHooks(Protocol):
    """What the pool tells the adapter runtime (busy-loop thread)."""

    def after_change(self) -> None:
        """Blocks were freed or evicted: the runtime may need an idle pass."""


@dataclass(frozen=True, slots=True)
class PoolBacking:
    """Everything the pool needs besides vLLM's constructor arguments."""

    blocks: BlockAllocator  # block ids <-> pages (its PageAllocator maps the KV memory)
    guard: ThreadGuard  # bound to the busy-loop thread
    hooks: PoolHooks
    mailbox: LimitMailbox  # kept for the adapter; allocation never takes a target from it
    reclaim: bool  # False: never evict on our own (the "without reclaim" baseline)
    max_cached_tokens: int  # -1 unlimited, 0 evict on free, N keep at most N tokens
