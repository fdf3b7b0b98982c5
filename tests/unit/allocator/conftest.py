"""Allocator tests run with the thread guard on (the one rule is checked everywhere)."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator

import pytest

from allocator import HostBackend, PageLayout, ThreadGuard

OS_PAGE = mmap.PAGESIZE


@pytest.fixture(autouse=True, scope="session")
def _thread_guard_on() -> Iterator[None]:
    ThreadGuard.set_default_enabled(True)
    yield


@pytest.fixture
def make_host() -> Iterator[Callable[..., HostBackend]]:
    """Factory for HostBackends that are released after the test."""
    made: list[HostBackend] = []

    def make(page_os_pages: int = 1, num_pages: int = 8, num_regions: int = 1) -> HostBackend:
        layout = PageLayout(page_os_pages * OS_PAGE, num_pages, num_regions)
        backend = HostBackend.reserve(layout, name="kvsidecar-test")
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.release()
