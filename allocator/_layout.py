"""Geometry of a reservation: pages, regions and where each lives."""

from __future__ import annotations

from dataclasses import dataclass

from ._errors import AllocatorConfigError, AllocatorContractError


@dataclass(frozen=True, slots=True)
class PageLayout:
    """How a reservation is cut into pages.

    The reservation holds ``num_regions`` regions back to back (one per layer
    and K/V buffer); each region holds ``num_pages`` pages of ``page_bytes``.
    Mapping page *i* maps it in every region, so one page costs
    :attr:`bundle_bytes`. Backends check ``page_bytes`` against their own
    granularity (host page size, CUDA allocation granularity).
    """

    page_bytes: int  # bytes of one page in ONE region
    num_pages: int  # pages per region (the virtual capacity)
    num_regions: int = 1  # layers x K/V buffers

    def __post_init__(self) -> None:
        for name in ("page_bytes", "num_pages", "num_regions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise AllocatorConfigError(f"PageLayout.{name} must be an int; got {value!r}")
            if value <= 0:
                raise AllocatorConfigError(
                    f"PageLayout.{name} must be at least 1; got {value}"
                    + (
                        " (a capacity of zero pages cannot hold a KV cache)"
                        if name == "num_pages"
                        else ""
                    )
                )

    @property
    def region_bytes(self) -> int:
        """Bytes of one region: ``page_bytes * num_pages``."""
        return self.page_bytes * self.num_pages

    @property
    def bundle_bytes(self) -> int:
        """What mapping one page costs: ``page_bytes * num_regions``."""
        return self.page_bytes * self.num_regions

    @property
    def total_bytes(self) -> int:
        """Size of the whole reservation: ``region_bytes * num_regions``."""
        return self.region_bytes * self.num_regions

    def page_offset(self, region: int, page: int) -> int:
        """Byte offset of ``page`` of ``region`` from the start of the reservation."""
        if not 0 <= region < self.num_regions:
            raise IndexError(f"region {region} is outside 0..{self.num_regions - 1}")
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} is outside 0..{self.num_pages - 1}")
        return region * self.region_bytes + page * self.page_bytes

    def span(self, region: int | None = None) -> tuple[int, int]:
        """``(offset, length)`` of one region, or of the whole reservation for ``None``."""
        if region is None:
            return 0, self.total_bytes
        if not 0 <= region < self.num_regions:
            raise AllocatorContractError(f"region {region} is outside 0..{self.num_regions - 1}")
        return region * self.region_bytes, self.region_bytes

    def blocks_per_page(self, block_bytes: int) -> int:
        """How many engine blocks of ``block_bytes`` fit in one page (per region).

        Blocks never straddle pages; a block larger than a page is a
        configuration error whose message names a page size that would work.
        """
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise AllocatorConfigError(f"block_bytes must be a positive int; got {block_bytes!r}")
        if block_bytes > self.page_bytes:
            raise AllocatorConfigError(
                f"a block of {block_bytes} bytes does not fit in a page of {self.page_bytes} "
                f"bytes; use page_bytes >= {block_bytes} (rounded up to the backend's "
                "granularity), or make blocks smaller"
            )
        return self.page_bytes // block_bytes


def check_granularity(layout: PageLayout, granularity: int, what: str) -> None:
    """Raise :class:`AllocatorConfigError` unless ``page_bytes`` is a multiple of ``granularity``."""
    if layout.page_bytes % granularity:
        lower = layout.page_bytes // granularity * granularity
        upper = lower + granularity
        options = f"{lower} or {upper}" if lower else f"{upper}"
        raise AllocatorConfigError(
            f"page_bytes={layout.page_bytes} is not a multiple of the {what} ({granularity} "
            f"bytes); use a multiple of {granularity}, e.g. {options}"
        )
