"""The C hot paths of BlockAllocator (allocator/_speedups.c) against their Python reference.

Two allocators, each over its own PageAllocator and memfd-backed HostBackend,
are driven by the same seeded random operations: allocations of every size
(also more than fits, and malformed sizes), frees of random sets (also bad ids,
double frees, repeats), evictable marks and unmarks (also bad ids), targets up
and down (retiring pages and taking them back), and maps the device refuses.
After every operation the two must agree on the result (or the exception and
its message) and on every field of both allocators, and the memory each
backend has committed (``fstat`` of its memfd) must be the same.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import random
import tracemalloc
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import allocator._blocks as blocks_module
import allocator._pages as pages_module
from allocator import (
    AllocatorContractError,
    BackendError,
    BlockAllocator,
    DeviceOutOfMemory,
    HostBackend,
    PageAllocator,
    PageLayout,
    ThreadGuard,
)
from allocator._blocks import PyBlockAllocator


def test_speedups_are_built() -> None:
    # scripts/dev.sh compiles allocator/_speedups.c into the checkout; pip builds it too.
    assert blocks_module.SPEEDUPS, (
        "allocator._speedups is not importable: BlockAllocator runs its pure-Python hot "
        "paths. Build it with `bash scripts/dev.sh env` (needs a C compiler, cc) or "
        "`pip install -e .`"
    )
    assert BlockAllocator.alloc is not PyBlockAllocator.alloc


class RefusingBackend:
    """A HostBackend whose maps the test can make the device refuse (``full``)."""

    def __init__(self, inner: HostBackend) -> None:
        self.inner = inner
        self.full = False

    def map(self, page: int) -> None:
        if self.full:
            raise DeviceOutOfMemory(f"page {page}: the test says the device is full")
        self.inner.map(page)

    def map_many(self, pages: Any) -> None:
        if self.full:
            raise DeviceOutOfMemory("the test says the device is full")
        self.inner.map_many(pages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Side:
    def __init__(self, cls: type[Any], num_pages: int, bpp: int, reserve: int) -> None:
        layout = PageLayout(mmap.PAGESIZE, num_pages, 1)
        self.host = HostBackend.reserve(layout, name=f"kvs-speedups-{cls.__name__}")
        self.backend = RefusingBackend(self.host)
        self.pages = PageAllocator(self.backend, reserve_pages=reserve)  # type: ignore[arg-type]
        self.blocks = cls(self.pages, bpp)

    def committed(self) -> int:
        return os.fstat(self.host.fd).st_blocks * 512

    def snapshot(self) -> dict[str, Any]:
        b, p = self.blocks, self.pages
        in_buckets = [pg for bucket in b._buckets + b._rbuckets for pg in bucket]
        return {
            "allocated": bytes(b._allocated),
            "occupancy": list(b._occupancy),
            "ev_on": list(b._ev_on) if b.tracks_evictable else None,
            "slots": [list(s) for s in b._slots],
            "retired_flags": bytes(b._retired),
            "buckets": [list(x) for x in b._buckets],
            "rbuckets": [list(x) for x in b._rbuckets],
            "pos": {pg: b._pos[pg] for pg in in_buckets},
            "top": b._top,
            "rtop": b._rtop,
            "counts": (
                b.num_allocated_blocks,
                b.num_retired_blocks,
                b._partial_free,
                b.changes,
                b.num_evictable_blocks,
                b.num_reclaimable_pages,
                b.num_free_blocks,
                b.refused_by_device,
            ),
            "pages": (p.num_mapped, p.target_pages, [p.is_retired(i) for i in range(p.num_pages)]),
            "committed": self.committed(),
        }

    def close(self) -> None:
        self.host.release()


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:  # noqa: BLE001 - the exception and its message must match too
        return type(exc).__name__, str(exc)


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The PageAllocator's device-full hold is timed: both sides read one test clock."""
    now = [1000.0]
    monkeypatch.setattr(pages_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    yield now


def random_ids(rng: random.Random, live: list[int], num_blocks: int) -> list[Any]:
    kind = rng.random()
    if kind < 0.8 and live:
        return rng.sample(live, rng.randint(1, min(len(live), 12)))
    if kind < 0.85 and live:
        block = rng.choice(live)
        return [block, block]  # the same block twice
    return [rng.choice([-1, num_blocks, num_blocks + 7, 1.0, True, "3", None, 2**70])]


@pytest.mark.parametrize(
    ("seed", "num_pages", "bpp", "reserve"),
    [(1, 6, 4, 0), (2, 12, 3, 2), (3, 4, 1, 0), (4, 9, 8, 1), (5, 20, 5, 0)],
)
def test_c_and_python_hot_paths_agree_on_every_operation(
    fixed_clock: list[float], seed: int, num_pages: int, bpp: int, reserve: int
) -> None:
    rng = random.Random(seed)
    sides = [
        Side(PyBlockAllocator, num_pages, bpp, reserve),
        Side(BlockAllocator, num_pages, bpp, reserve),
    ]
    try:
        for side in sides:
            side.blocks.track_evictable()
        num_blocks = num_pages * bpp
        for step in range(2500):
            fixed_clock[0] += rng.choice([0.0, 0.01, 1.0, 30.0])
            ref = sides[0].blocks
            allocated = [b for b in range(num_blocks) if ref._allocated[b]]
            held = [b for b in allocated if ref._allocated[b] == 1]
            marked = [b for b in allocated if ref._allocated[b] == 2]
            op = rng.random()
            if op < 0.3:
                n: Any = rng.choice([0, 1, 1, 1, 2, 3, bpp, bpp + 1, 2 * bpp + 1, num_blocks])
                if rng.random() < 0.03:
                    n = rng.choice([-1, 1.5, True, "2", None])
                args: tuple[Any, ...] = ("alloc", n)
            elif op < 0.5:
                args = ("free", random_ids(rng, allocated, num_blocks))
            elif op < 0.65:
                args = ("mark_evictable", random_ids(rng, held, num_blocks))
            elif op < 0.75:
                ids = random_ids(rng, marked, num_blocks)
                args = ("unmark_evictable", iter(ids) if rng.random() < 0.3 else ids)
            elif op < 0.85:
                target = rng.choice([None, 0, 1, 2, num_pages // 2, num_pages])
                args = ("set_target", target)
            elif op < 0.9:
                args = ("full", rng.random() < 0.5)
            else:
                args = ("free_marked", rng.sample(marked, min(len(marked), rng.randint(1, 6))))
            results = []
            for side in sides:
                name, value = args
                if isinstance(value, Iterator):
                    value = iter(list(ids))  # a fresh iterator per side
                if name == "set_target":
                    results.append(outcome(lambda s=side, v=value: s.pages.set_target(v)))
                elif name == "full":
                    side.backend.full = value
                    results.append(("ok", None))
                elif name == "free_marked":  # what a cache's eviction does: unmark, then free
                    results.append(
                        outcome(
                            lambda s=side, v=value: (
                                s.blocks.unmark_evictable(v),
                                s.blocks.free(v),
                            )
                        )
                    )
                else:
                    results.append(outcome(lambda s=side, n=name, v=value: getattr(s.blocks, n)(v)))
            assert results[0] == results[1], f"step {step} {args}: {results}"
            snaps = [side.snapshot() for side in sides]
            for key in snaps[0]:
                assert snaps[0][key] == snaps[1][key], f"step {step} {args}: {key} differs"
            b = sides[1].blocks
            assert b.num_allocated_blocks == sum(b._occupancy)
            assert b._partial_free >= 0 and b.num_evictable_blocks >= 0
    finally:
        for side in sides:
            side.close()


def test_c_hot_paths_leak_no_references() -> None:
    # Page ids and block ids above 256 are fresh int objects: a missing DECREF in the C
    # code keeps each of them alive, which tracemalloc sees as memory that only grows.
    side = Side(BlockAllocator, 400, 4, 0)
    try:
        b = side.blocks
        b.track_evictable()

        def churn() -> None:
            for _ in range(200):
                got = b.alloc(37)
                assert got is not None
                b.mark_evictable(got[:20])
                b.unmark_evictable(got[:10])
                b.free(got[:1])
                b.free(got[20:])
                b.unmark_evictable(got[10:20])
                b.free(got[1:20])
                assert b.alloc(b.num_free_blocks + 1) is None
                for bad in ([-1], [got[0]], [got[1], got[1]]):
                    with pytest.raises(AllocatorContractError):
                        b.free(bad)

        churn()  # warm: every list reaches its size
        gc.collect()
        # Only what the churn allocates (its frames here and in allocator/): the
        # process-wide total also counts other threads' allocations (66 KB in one CI
        # run, where the churn alone leaves 308 bytes).
        ours = [
            tracemalloc.Filter(True, __file__),
            tracemalloc.Filter(True, "*/allocator/*"),
        ]
        tracemalloc.start()
        before = tracemalloc.take_snapshot().filter_traces(ours)
        for _ in range(5):
            churn()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(ours)
        tracemalloc.stop()
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        assert grown < 64 * 1024, f"{grown} bytes still allocated after 1000 churn rounds"
        assert b.num_allocated_blocks == 0 and side.pages.num_mapped == 0
    finally:
        side.close()


def test_c_hot_paths_check_the_thread_guard() -> None:
    # The guard is read from the object at every call: the C paths honour it as Python does.
    import threading

    side = Side(BlockAllocator, 4, 2, 0)
    try:
        guard = ThreadGuard("speedups-test", enabled=True)
        side.blocks.guard = guard
        guard.bind_current()
        got = side.blocks.alloc(1)
        assert got is not None
        errors: list[BaseException] = []

        def foreign() -> None:
            for call in (
                lambda: side.blocks.alloc(1),
                lambda: side.blocks.free(got),
                lambda: side.blocks.mark_evictable(got),
            ):
                try:
                    call()
                except BaseException as exc:  # noqa: BLE001 - recorded and checked below
                    errors.append(exc)

        side.blocks.track_evictable()
        thread = threading.Thread(target=foreign)
        thread.start()
        thread.join()
        assert [type(e).__name__ for e in errors] == ["ForeignThreadError"] * 3
        assert side.blocks.num_allocated_blocks == 1 and side.blocks.is_allocated(got[0])
    finally:
        side.close()


def test_c_libc_calls_commit_punch_and_report_errno_as_ctypes_does() -> None:
    from allocator import _libc, _speedups

    fd = os.memfd_create("kvs-speedups-libc")
    try:
        os.ftruncate(fd, 4 * mmap.PAGESIZE)
        assert _speedups.fallocate(fd, 0, mmap.PAGESIZE, 2 * mmap.PAGESIZE) == 0
        assert os.fstat(fd).st_blocks * 512 == 2 * mmap.PAGESIZE  # what the kernel committed
        mode = _libc.FALLOC_FL_PUNCH_HOLE | _libc.FALLOC_FL_KEEP_SIZE
        assert _speedups.fallocate(fd, mode, mmap.PAGESIZE, mmap.PAGESIZE) == 0
        assert os.fstat(fd).st_blocks * 512 == mmap.PAGESIZE
        base = _libc.reserve_file(fd, 4 * mmap.PAGESIZE)
        try:
            assert _speedups.mprotect(base, mmap.PAGESIZE, _libc.PROT_READ) == 0
            assert _speedups.mprotect(base + 1, mmap.PAGESIZE, _libc.PROT_NONE) == errno.EINVAL
        finally:
            _libc.unreserve(base, 4 * mmap.PAGESIZE)
    finally:
        os.close(fd)
    assert _speedups.fallocate(-1, 0, 0, mmap.PAGESIZE) == errno.EBADF
    # the ctypes path says the same
    assert _libc._fallocate(-1, 0, 0, mmap.PAGESIZE) != 0
    assert ctypes.get_errno() == errno.EBADF
    with pytest.raises(TypeError):
        _speedups.fallocate(1, 2, 3)
    # a failure reaches the caller as a BackendError with its errno
    with pytest.raises(BackendError) as caught:
        _libc.commit(-1, 0, mmap.PAGESIZE)
    assert caught.value.errno == errno.EBADF and "Bad file descriptor" in str(caught.value)


def test_everything_works_without_the_c_module() -> None:
    # Where no C compiler was found the package must still work: pure-Python hot paths,
    # ctypes for the libc calls. A fresh interpreter with the C module's import blocked.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import errno, mmap, os, sys
        sys.modules["allocator._speedups"] = None  # import allocator._speedups -> ImportError
        import allocator
        from allocator import _blocks, _libc, BackendError
        assert not _blocks.SPEEDUPS
        assert allocator.BlockAllocator.alloc is _blocks.PyBlockAllocator.alloc
        layout = allocator.PageLayout(mmap.PAGESIZE, 8, 1)
        backend = allocator.HostBackend.reserve(layout, name="kvs-no-c")
        blocks = allocator.BlockAllocator(allocator.PageAllocator(backend), 2)
        blocks.track_evictable()
        got = blocks.alloc(5)
        blocks.mark_evictable(got[:2])
        assert os.fstat(backend.fd).st_blocks * 512 == 3 * mmap.PAGESIZE
        blocks.unmark_evictable(got[:2])
        blocks.free(got)
        assert os.fstat(backend.fd).st_blocks == 0
        try:
            _libc.commit(-1, 0, mmap.PAGESIZE)
        except BackendError as exc:
            assert exc.errno == errno.EBADF, exc
        else:
            raise AssertionError("commit on fd -1 did not fail")
        backend.release()
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("cls", [BlockAllocator, PyBlockAllocator], ids=["c", "python"])
def test_a_refused_alloc_gives_the_evictable_accounting_back(cls: type[Any]) -> None:
    """alloc() takes the free slots of a page whose live blocks are all evictable, then
    the device refuses a fresh page: the rollback must leave that page reclaimable again
    (the count stayed one lower, and the coordinator then saw nothing to evict)."""
    backend = HostBackend.reserve(PageLayout(mmap.PAGESIZE, 8), name="kvs-test-rollback")
    pages = PageAllocator(backend)
    blocks = cls(pages, 4)
    blocks.track_evictable()
    held = blocks.alloc(2)
    blocks.mark_evictable(held)  # page 0: half full, every live block evictable
    assert blocks.num_reclaimable_pages == 1

    def refuse(page: int) -> None:
        raise DeviceOutOfMemory("injected: the device is full")

    backend.map = refuse  # type: ignore[method-assign]
    for _ in range(3):  # each refusal used to lower the count once more
        assert blocks.alloc(3) is None and blocks.refused_by_device
        pages.set_target(None)  # try the device again at once
    truth = sum(1 for p in range(8) if 0 < blocks.occupancy(p) == blocks.evictable_on(p))
    assert blocks.num_reclaimable_pages == truth == 1
    assert blocks.num_allocated_blocks == 2 and blocks.occupancy(0) == 2


@pytest.mark.parametrize("cls", [BlockAllocator, PyBlockAllocator], ids=["c", "python"])
def test_huge_or_very_negative_counts_read_as_in_python(cls: type[Any]) -> None:
    """alloc(n) past a machine word: more than any pool holds is None, a negative one a
    contract error (the C path raised OverflowError for both)."""
    blocks = cls(PageAllocator(HostBackend.reserve(PageLayout(mmap.PAGESIZE, 4))), 4)
    assert blocks.alloc(2**63) is None and blocks.alloc(10**30) is None
    for n in (-1, -(2**63) - 1, -(2**70)):
        with pytest.raises(AllocatorContractError):
            blocks.alloc(n)
    assert blocks.num_allocated_blocks == 0


@pytest.mark.parametrize("mark", [True, False], ids=["mark", "unmark"])
def test_an_iterator_that_raises_part_way_changes_the_same_blocks_in_c_and_python(
    mark: bool,
) -> None:
    """mark/unmark_evictable with a generator that yields two good ids, then raises: the
    C path materialised the whole iterable first and changed nothing, Python changes the two
    before the error. Both must leave the same flags and counts (the documented contract:
    the blocks before the failure stay changed, the counts agree)."""

    def ids(good: list[int]) -> Iterator[int]:
        yield from good
        raise KeyError("the caller's generator failed")

    results = []
    for cls in (BlockAllocator, PyBlockAllocator):
        blocks = cls(PageAllocator(HostBackend.reserve(PageLayout(mmap.PAGESIZE, 4))), 2)
        blocks.track_evictable()
        held = blocks.alloc(4)  # pages 0 and 1, full
        assert held is not None
        if not mark:
            blocks.mark_evictable(held)
        change = blocks.mark_evictable if mark else blocks.unmark_evictable
        with pytest.raises(KeyError):
            change(ids(held[:2]))
        with pytest.raises(AllocatorContractError):  # a bad id after a good one, as a tuple
            change((held[2], 10**6))
        results.append(
            (
                [blocks.is_marked_evictable(b) for b in held],
                blocks.num_evictable_blocks,
                blocks.num_reclaimable_pages,
                [blocks.evictable_on(p) for p in range(2)],
            )
        )
    assert results[0] == results[1]
    flags = results[1][0]
    assert flags == ([True, True, True, False] if mark else [False, False, False, True])
