"""The one rule: a mutation from a thread other than the owner raises and changes nothing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.threads import caught_in_thread

import allocator
from allocator import (
    BlockAllocator,
    ForeignThreadError,
    HostBackend,
    PageAllocator,
    ThreadGuard,
)

MakeHost = Callable[..., HostBackend]


def in_thread(fn: Callable[[], object]) -> BaseException | None:
    """Run ``fn`` in a new thread and return what it raised (or None)."""
    return caught_in_thread(fn, name="controller")


def test_foreign_thread_mutations_raise_and_change_nothing(make_host: MakeHost) -> None:
    pages = PageAllocator(make_host(num_pages=4), reserve_pages=1)
    blocks = BlockAllocator(pages, 2)
    got = blocks.alloc(3)  # the test thread becomes the owner
    assert got is not None
    assert pages.reserve_wanted() == 1 and pages.num_mapped == 2  # the reserve page was taken
    calls: list[Callable[[], object]] = [
        lambda: blocks.alloc(1),
        lambda: blocks.free([got[0]]),
        lambda: pages.set_target(0),
        pages.acquire,
        lambda: pages.release(0),
        pages.refill_reserve,  # a safe point's work, never a controller's
    ]
    for call in calls:
        err = in_thread(call)
        assert isinstance(err, ForeignThreadError), err
        assert "controller" in str(err) and "LimitMailbox" in str(err)
    assert blocks.num_allocated_blocks == 3 and all(blocks.is_allocated(b) for b in got)
    assert pages.target_pages is None and pages.num_in_use == 2 and pages.num_mapped == 2


def test_bind_current_hands_ownership_to_the_engine_thread(make_host: MakeHost) -> None:
    guard = ThreadGuard("engine", enabled=True)
    pages = PageAllocator(make_host(num_pages=4), guard=guard)
    blocks = BlockAllocator(pages, 2)
    assert blocks.guard is guard
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine") as engine:
        engine.submit(guard.bind_current).result()
        with pytest.raises(ForeignThreadError, match="engine"):
            blocks.alloc(1)  # the test thread built it, but the engine thread owns it now
        assert engine.submit(blocks.alloc, 1).result() is not None
    assert blocks.num_allocated_blocks == 1


def test_disabled_guard_allows_any_thread(make_host: MakeHost) -> None:
    guard = ThreadGuard("engine", enabled=False)
    pages = PageAllocator(make_host(num_pages=4), guard=guard)
    blocks = BlockAllocator(pages, 2)
    assert blocks.alloc(1) is not None
    assert in_thread(lambda: blocks.alloc(1)) is None
    assert blocks.num_allocated_blocks == 2


def test_default_comes_from_the_flag() -> None:
    try:
        assert ThreadGuard("a").enabled  # conftest turned the default on
        ThreadGuard.set_default_enabled(False)
        assert not ThreadGuard("b").enabled
        assert ThreadGuard("c", enabled=True).enabled
        ThreadGuard.set_default_enabled(True)
        assert ThreadGuard("d").enabled
    finally:
        ThreadGuard.set_default_enabled(True)


def test_public_names_are_pinned_and_sorted() -> None:
    assert allocator.__all__ == sorted(allocator.__all__)
    assert set(allocator.__all__) == {
        "AllocatorConfigError",
        "AllocatorContractError",
        "AllocatorError",
        "Backend",
        "BackendError",
        "BlockAllocator",
        "CudaBackend",
        "ForeignThreadError",
        "HostBackend",
        "PageAllocator",
        "PageLayout",
        "PageObserver",
        "PageState",
        "ThreadGuard",
        "DeviceEvent",
        "DeviceOutOfMemory",
        "FencedBackend",
        "UnmapFence",
        "map_or_free_cache",
        "torch_empty_cache",
        "torch_unmap_fence",
    }
    for name in ("AllocatorConfigError", "BackendError", "AllocatorContractError"):
        assert issubclass(getattr(allocator, name), allocator.AllocatorError)
    assert issubclass(ForeignThreadError, allocator.AllocatorContractError)


def test_allocator_imports_without_torch_or_cuda() -> None:
    code = (
        "import sys, allocator; bad = [m for m in ('torch', 'cuda', 'engine_ext', 'sidecar')"
        " if m in sys.modules]; assert not bad, bad"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=str(Path(allocator.__file__).parents[1]),
    )
    assert done.returncode == 0, done.stderr
