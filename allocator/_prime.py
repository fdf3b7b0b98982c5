"""Mapping many pages at start-up (an engine's warm-up) with one out-of-memory retry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ._errors import DeviceOutOfMemory

if TYPE_CHECKING:
    from ._backend import Backend

__all__ = ["map_or_free_cache", "torch_empty_cache"]


def map_or_free_cache(
    backend: Backend, pages: Sequence[int], free_cache: Callable[[], None]
) -> None:
    """``backend.map_many(pages)``; out of device memory: ``free_cache()`` and try once more.

    ``free_cache`` gives back memory a framework holds without using it
    (``torch.cuda.empty_cache()``: torch's caching allocator keeps what the
    model's profiling run freed). A map fails whole, so the retry starts from
    nothing mapped. Still out of memory: :class:`DeviceOutOfMemory` saying so.
    """
    pages = list(pages)
    try:
        backend.map_many(pages)
        return
    except DeviceOutOfMemory:
        free_cache()
    try:
        backend.map_many(pages)
    except DeviceOutOfMemory as exc:
        raise DeviceOutOfMemory(
            f"mapping {len(pages)} KV page(s) failed even after freeing cached device memory: {exc}"
        ) from exc


def torch_empty_cache() -> None:
    """``torch.cuda.empty_cache()``: what torch's caching allocator holds unused goes back."""
    import torch  # lazy: the allocator imports without torch

    torch.cuda.empty_cache()
