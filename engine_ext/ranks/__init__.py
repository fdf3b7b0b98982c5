"""TP/PP ranks for the engine extension (docs/ranks.md).

The scheduler decides which pages are mapped; every rank maps its own view of
the same memory. :class:`RankGroup` is the rank channel (one unix socket per
rank, ordered ops, acks after applying), :class:`RankedBackend` keeps the
owner's memfd and every rank's view in step (map completes everywhere before
a page is handed out; an unmap is tagged with its step and counted only once
every rank acked), :class:`RankChannelBarrier` is the coordinator's
:class:`engine_ext.RankBarrier` over it, and :class:`RankWorker` is the rank
process (``python -m engine_ext.ranks``).
"""

from ._backend import RankChannelBarrier, RankedBackend
from ._group import RankGroup
from ._procmaps import mapped_ranges, memfd_view, view_mapped_bytes
from ._wire import RankChannelError
from ._worker import RankWorker, SlotGeometry

__all__ = [
    "RankChannelBarrier",
    "RankChannelError",
    "RankGroup",
    "RankWorker",
    "RankedBackend",
    "SlotGeometry",
    "mapped_ranges",
    "memfd_view",
    "view_mapped_bytes",
]
