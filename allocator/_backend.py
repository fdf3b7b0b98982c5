"""The seam between the allocator and physical memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ._layout import PageLayout


@runtime_checkable
class Backend(Protocol):
    """Pages of a reserved virtual range <-> physical memory.

    A backend owns one reservation of ``layout.total_bytes`` at
    ``base_address``. ``map(page)`` commits memory for that page in every
    region and makes it readable and writable; ``unmap(page)`` makes it
    inaccessible again and gives the memory back. Mapping a mapped page or
    unmapping an unmapped one raises
    :class:`~allocator.AllocatorContractError`. Backends are not thread-safe:
    the allocator that drives one calls it from its owning thread only.
    """

    layout: PageLayout
    base_address: int

    def map(self, page: int) -> None:
        """Commit and map ``page`` in every region."""
        ...

    def unmap(self, page: int) -> None:
        """Unmap ``page`` in every region and return its memory."""
        ...

    def map_many(self, pages: Sequence[int]) -> None:
        """Map several pages; runs of consecutive pages cost one call per region."""
        ...

    def unmap_many(self, pages: Sequence[int]) -> None:
        """Unmap several pages; runs of consecutive pages cost one call per region.

        Not all or nothing: on a failure every page is still tried, the pages
        that did not unmap stay mapped (:meth:`is_mapped`; unmapping again
        retries them), then the first error is raised.
        """
        ...

    def is_mapped(self, page: int) -> bool:
        """Whether ``page`` is mapped by this backend."""
        ...

    def mapped_bytes(self) -> int:
        """Physical bytes behind the reservation, measured where the OS/driver allows."""
        ...

    def release(self) -> None:
        """Unmap everything, free the reservation; idempotent."""
        ...
