"""Allocator benchmark: host map/unmap vs raw libc, and block alloc/free throughput.

Run: ``python bench/bench_allocator.py [--pages N] [--repeats R] [--quick]``.
Every figure is a ratio against a bare alternative measured in the same run
(best of R repeats each, so background load hurts both sides alike).

1. Map + unmap one page at a time, HostBackend vs *raw libc*: the baseline
   owns its own memfd and, per page, calls ``fallocate(fd, 0, off, len)``
   (commit) then ``mmap(NULL, len, PROT_READ|PROT_WRITE, MAP_SHARED, fd,
   off)``; to unmap, ``munmap(addr, len)`` then ``fallocate(fd,
   PUNCH_HOLE|KEEP_SIZE, off, len)``. Same libc functions through ctypes,
   same sizes, same memory returned: the ratio is the price of HostBackend's
   checks, bookkeeping and fixed placement. Goal: >= 0.8x.
2. The same with the Python ``mmap`` module as baseline (``mmap.mmap(fd, len,
   offset=off)`` + ``close()``, with the same fallocate calls).
3. ``map_many``/``unmap_many`` of all pages (coalesced into one call per
   region) vs the raw per-page loop.
4. BlockAllocator ``alloc(k)``/``free(blocks)`` (half-full pool of 1024
   pages x 64 blocks, guard off) vs vLLM's own free-block queue
   (``FreeKVCacheBlockQueue.popleft_n``/``append_n``, when vLLM imports) and
   vs a bare Python list (``del l[-k:]``/``extend``), the same k per call.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.fallocate64.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
RW, SHARED = 0x1 | 0x2, 0x01


def best_s(fn: Callable[[], None], repeats: int) -> float:
    """Fastest of ``repeats`` runs of ``fn`` in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def host_per_page(backend: HostBackend, pages: int) -> Callable[[], None]:
    def run() -> None:
        for page in range(pages):
            backend.map(page)
        for page in range(pages):
            backend.unmap(page)

    return run


def host_batched(backend: HostBackend, pages: int) -> Callable[[], None]:
    everything = list(range(pages))

    def run() -> None:
        backend.map_many(everything)
        backend.unmap_many(everything)

    return run


def raw_libc(fd: int, page_bytes: int, pages: int) -> Callable[[], None]:
    mmap_, munmap, fallocate = _libc.mmap, _libc.munmap, _libc.fallocate64

    def run() -> None:
        addrs = []
        for page in range(pages):
            off = page * page_bytes
            if fallocate(fd, 0, off, page_bytes) != 0:
                raise OSError(ctypes.get_errno(), "fallocate")
            addr = mmap_(None, page_bytes, RW, SHARED, fd, off)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap")
            addrs.append(addr)
        for page, addr in enumerate(addrs):
            munmap(addr, page_bytes)
            fallocate(fd, PUNCH, page * page_bytes, page_bytes)

    return run


def python_mmap(fd: int, page_bytes: int, pages: int) -> Callable[[], None]:
    fallocate = _libc.fallocate64

    def run() -> None:
        maps = []
        for page in range(pages):
            fallocate(fd, 0, page * page_bytes, page_bytes)
            maps.append(mmap.mmap(fd, page_bytes, offset=page * page_bytes))
        for page, region in enumerate(maps):
            region.close()
            fallocate(fd, PUNCH, page * page_bytes, page_bytes)

    return run


def bench_mapping(page_bytes: int, pages: int, repeats: int) -> None:
    layout = PageLayout(page_bytes, pages)
    backend = HostBackend.reserve(layout, name="kvsidecar-bench")
    fd = os.memfd_create("kvsidecar-bench-raw", os.MFD_CLOEXEC)
    os.ftruncate(fd, layout.total_bytes)
    try:
        ours = best_s(host_per_page(backend, pages), repeats)
        batched = best_s(host_batched(backend, pages), repeats)
        raw = best_s(raw_libc(fd, page_bytes, pages), repeats)
        pym = best_s(python_mmap(fd, page_bytes, pages), repeats)
        assert backend.mapped_bytes() == 0 and os.fstat(fd).st_blocks == 0
    finally:
        backend.release()
        os.close(fd)
    us = 1e6 / pages
    print(
        f"page {page_bytes // 1024:>5} KiB x {pages}: map+unmap per page "
        f"HostBackend {ours * us:7.1f} us | raw libc {raw * us:7.1f} us "
        f"-> {raw / ours:4.2f}x | python mmap {pym * us:7.1f} us -> {pym / ours:4.2f}x | "
        f"map_many+unmap_many {batched * us:6.1f} us/page -> {raw / batched:5.2f}x raw"
    )


def bench_blocks(batch: int, rounds: int, repeats: int) -> None:
    pages, bpp = 1024, 64
    backend = HostBackend.reserve(PageLayout(mmap.PAGESIZE, pages), name="kvsidecar-bench")
    try:
        blocks = BlockAllocator(PageAllocator(backend, reserve_pages=pages), bpp)
        free_list = list(range(pages * bpp))
        held = blocks.alloc(pages * bpp // 2)  # half full: partly used pages exist
        assert held is not None

        def ours() -> None:
            alloc, free = blocks.alloc, blocks.free
            for _ in range(rounds):
                got = alloc(batch)
                assert got is not None
                free(got)

        def bare() -> None:
            for _ in range(rounds):
                got = free_list[-batch:]
                del free_list[-batch:]
                free_list.extend(got)

        t_ours, t_bare = best_s(ours, repeats), best_s(bare, repeats)
        t_vllm = vllm_queue_s(pages * bpp, batch, rounds, repeats)
    finally:
        backend.release()
    ops = 2 * rounds
    vllm = (
        "vLLM queue n/a"
        if t_vllm is None
        else (f"vLLM queue {ops / t_vllm / 1e3:7.1f} k calls/s -> {t_vllm / t_ours:4.2f}x")
    )
    print(
        f"blocks x{batch:<3}: BlockAllocator {ops / t_ours / 1e3:7.1f} k calls/s "
        f"({ops * batch / t_ours / 1e6:5.2f} M blocks/s) | {vllm} | bare list "
        f"{ops / t_bare / 1e3:7.1f} k calls/s -> {t_bare / t_ours:4.2f}x"
    )


def vllm_queue_s(num_blocks: int, batch: int, rounds: int, repeats: int) -> float | None:
    """Best time of vLLM's FreeKVCacheBlockQueue doing the same calls, or None without vLLM."""
    try:
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
    except Exception:  # noqa: BLE001 - any import failure just means "no baseline"
        return None
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(num_blocks)])

    def run() -> None:
        for _ in range(rounds):
            queue.append_n(queue.popleft_n(batch))

    return best_s(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256, help="pages per mapping run")
    parser.add_argument("--repeats", type=int, default=7, help="best of this many runs")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    pages = 32 if args.quick else args.pages
    repeats = 2 if args.quick else args.repeats
    print(f"host page size {mmap.PAGESIZE} B; best of {repeats}; ratios > 1 mean ours is faster")
    for page_bytes in (4 << 10, 64 << 10, 2 << 20):
        bench_mapping(page_bytes, pages if page_bytes < (2 << 20) else max(8, pages // 8), repeats)
    rounds = 200 if args.quick else 5000
    for batch in (1, 16):
        bench_blocks(batch, rounds, repeats)


if __name__ == "__main__":
    main()
