"""Allocator cost at scale: a shrink pass and an idle ``step()`` at 1k .. 1M blocks.

For each pool size (16 blocks per 4 KiB page, host memory):

1. *Shrink pass*: fill every block, free a random quarter (pages end up
   unevenly full), then halve the target (``set_target``: the emptiest half
   of the in-use pages retires) and drain every block in random order, one
   ``free`` per block, as requests finishing would. Reported: the
   ``set_target`` time, the drain time, and the whole pass per freed page;
   beside it the raw cost of unmapping the same number of pages one by one
   (``HostBackend.unmap``), the floor, and the pass net of the harness (the
   same loop over the same shuffled ids calling a no-op: at 1M blocks the
   ids alone are 32 MB of int objects read in random order). Goal: the cost per freed page at 100k
   blocks within 1.5x of that at 1k (a linear pass).
   Times are CPU time of this process (``time.process_time``: user + system,
   so the unmap syscalls count) because the shared machine's wall clock
   mostly measures other people's load.
2. *Idle step()*: ``ShrinkCoordinator.step()`` with nothing pending over a
   half-full pool of that size (should not grow with the pool).
3. *Deferred retry*: ``step()`` while a limit waits on running requests (a
   full pool, 15 of 16 blocks per page evictable, one pinned on every page)
   and no block event happened since the last pass. Goal: <= 1 ms at 100k
   blocks (it is O(1): the evictable counts are kept per block event).
4. *Admission bound*: ``BlockAllocator.free_after_eviction``, what SGLang's
   admission may count while pages are retired (``obtainable_blocks``,
   recomputed when a block event happened), on a full pool with ~90 % of the
   blocks evictable and a cap of half the pages; beside it the Python loop over
   pages it replaced. O(pages) both, the new one in C.

``--max-blocks`` caps the sizes (to run the old quadratic code at all, e.g.
``PYTHONPATH=<old checkout> python bench/bench_scale.py --max-blocks 100000``).
"""

from __future__ import annotations

import argparse
import mmap
import random
import sys
import time
import timeit
from pathlib import Path

if not any(Path(p, "allocator").is_dir() for p in sys.path if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout
from engine_ext import CoordinatorConfig, LimitMailbox, ShrinkCoordinator
from engine_ext.cpu_harness import ToyPrefixCache

BPP = 16
SIZES = (1_000, 10_000, 100_000, 1_000_000)


def build(num_blocks: int) -> tuple[HostBackend, PageAllocator, BlockAllocator]:
    num_pages = -(-num_blocks // BPP)
    backend = HostBackend.reserve(PageLayout(mmap.PAGESIZE, num_pages, 1), name="bench-scale")
    pages = PageAllocator(backend)
    return backend, pages, BlockAllocator(pages, BPP)


def shrink_pass(num_blocks: int, seed: int) -> dict[str, float]:
    backend, pages, blocks = build(num_blocks)
    try:
        got = blocks.alloc(blocks.num_blocks)
        assert got is not None
        rng = random.Random(seed)
        rng.shuffle(got)
        blocks.free(got[: len(got) // 4])
        live = got[len(got) // 4 :]
        in_use = pages.num_in_use
        h0 = time.process_time()
        for block in live:  # the harness alone: the same shuffled ids, the same calls
            _noop([block])
        harness = time.process_time() - h0
        t0 = time.process_time()
        pages.set_target(in_use // 2)
        t1 = time.process_time()
        free = blocks.free
        for block in live:
            free([block])
        t2 = time.process_time()
        assert pages.num_mapped == 0 and backend.mapped_bytes() == 0
    finally:
        backend.release()
    raw = raw_unmap_ns(in_use)
    return {
        "pages": in_use,
        "target_ms": (t1 - t0) * 1e3,
        "drain_ms": (t2 - t1) * 1e3,
        "per_page_us": (t2 - t0) * 1e6 / in_use,
        "raw_per_page_us": raw / 1e3,
        "net_per_page_us": (t2 - t0 - harness) * 1e6 / in_use,
    }


def _noop(blocks: list[int]) -> None:
    pass


def raw_unmap_ns(num_pages: int) -> float:
    """Map ``num_pages`` pages at once, unmap them one by one: ns per page unmapped."""
    backend = HostBackend.reserve(PageLayout(mmap.PAGESIZE, num_pages, 1), name="bench-raw")
    try:
        backend.map_many(range(num_pages))
        t0 = time.process_time()
        for page in range(num_pages):
            backend.unmap(page)
        return (time.process_time() - t0) * 1e9 / num_pages
    finally:
        backend.release()


def idle_step_ns(num_blocks: int) -> float:
    backend, _, blocks = build(num_blocks)
    try:
        got = blocks.alloc(blocks.num_blocks // 2)
        assert got is not None
        mailbox = LimitMailbox()
        coord = ShrinkCoordinator(mailbox, blocks, CoordinatorConfig())
        coord.add_reclaimer(ToyPrefixCache(blocks, name="bench-none"))  # nothing cached
        mailbox.publish_next(None)
        coord.step()  # take it; nothing is pending from now on
        n = 50_000
        return min(timeit.repeat(coord.step, number=n, repeat=5)) / n * 1e9
    finally:
        backend.release()


class PinnedCache:
    """15 of every 16 blocks cached and evictable, one per page held by a request."""

    name = "bench-pinned"

    def __init__(self, blocks: BlockAllocator) -> None:
        self.evictable = [b for b in range(blocks.num_blocks) if b % BPP]
        blocks.track_evictable()
        blocks.mark_evictable(self.evictable)

    def evictable_blocks(self) -> list[int]:
        return self.evictable

    def is_evictable(self, block: int) -> bool:
        return bool(block % BPP)

    def evict(self, blocks: list[int]) -> int:
        return 0  # never asked: no page is all evictable


def deferred_retry_ns(num_blocks: int) -> float:
    """``step()`` while deferred on running requests and no block event happened."""
    backend, _, blocks = build(num_blocks)
    try:
        assert blocks.alloc(blocks.num_blocks) is not None
        mailbox = LimitMailbox()
        # retry_s 0: only "no block event since the last pass" may hold a retry back
        coord = ShrinkCoordinator(mailbox, blocks, CoordinatorConfig(deferred_retry_s=0.0))
        coord.add_reclaimer(PinnedCache(blocks))
        mailbox.publish_next(blocks.pages.num_pages // 2 * backend.layout.bundle_bytes)
        state = coord.step()
        assert state.reason == "running_requests", state.reason
        n = 20_000
        return min(timeit.repeat(coord.step, number=n, repeat=5)) / n * 1e9
    finally:
        backend.release()


def free_after_eviction_us(num_blocks: int) -> tuple[float, float]:
    """SGLang's admission bound while pages are retired (``obtainable_blocks``):
    ``BlockAllocator.free_after_eviction`` on a full, tracked pool with ~90 % of its
    blocks marked evictable and a cap of half the pages, and the Python loop over
    pages it replaced (two method calls per page, then a sort). µs per call."""
    backend, _, blocks = build(num_blocks)
    try:
        blocks.track_evictable()
        ids = blocks.alloc(blocks.num_blocks)
        assert ids is not None
        rng = random.Random(1)
        blocks.mark_evictable([b for b in ids if rng.random() < 0.9])
        num_pages = blocks.pages.num_pages
        cap = num_pages // 2

        def python_loop() -> int:
            per_page = (blocks.occupancy(p) - blocks.evictable_on(p) for p in range(num_pages))
            held = [n for n in per_page if n > 0]
            if len(held) <= cap:
                return cap * BPP - sum(held)
            return sum(BPP - n for n in sorted(held, reverse=True)[:cap])

        assert python_loop() == blocks.free_after_eviction(cap)
        n = max(1, 200_000 // num_blocks)
        now = min(timeit.repeat(lambda: blocks.free_after_eviction(cap), number=n, repeat=5))
        before = min(timeit.repeat(python_loop, number=n, repeat=3))
        return now / n * 1e6, before / n * 1e6
    finally:
        backend.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-blocks", type=int, default=SIZES[-1])
    parser.add_argument("--rounds", type=int, default=3, help="shrink passes per size (median)")
    args = parser.parse_args()
    sizes = [n for n in SIZES if n <= args.max_blocks]
    print(
        f"{BPP} blocks per 4 KiB page; shrink pass = halve the target, drain to 0 "
        f"(median of {args.rounds})\n"
    )
    print(
        "| blocks | pages freed | set_target ms | drain ms | µs / freed page | × 1k "
        "| net of harness µs/page | × 1k | raw unmap µs/page | idle step() ns "
        "| deferred retry ns | admission bound µs (Python loop before) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = net_base = 0.0
    for size in sizes:
        runs = sorted(
            (shrink_pass(size, seed) for seed in range(args.rounds)), key=lambda r: r["per_page_us"]
        )
        mid = runs[len(runs) // 2]
        base = base or mid["per_page_us"]
        net_base = net_base or mid["net_per_page_us"]
        idle = idle_step_ns(size)
        retry = deferred_retry_ns(size)
        bound, bound_before = free_after_eviction_us(size)
        print(
            f"| {size:,} | {int(mid['pages']):,} | {mid['target_ms']:.1f} | "
            f"{mid['drain_ms']:.1f} | {mid['per_page_us']:.1f} | {mid['per_page_us'] / base:.2f} "
            f"| {mid['net_per_page_us']:.1f} | {mid['net_per_page_us'] / net_base:.2f} "
            f"| {mid['raw_per_page_us']:.1f} | {idle:.0f} | {retry:.0f} "
            f"| {bound:.0f} ({bound_before:.0f}) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
