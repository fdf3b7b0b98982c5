"""Engine-extension core: eviction efficiency and the cost of an idle ``step()``.

Run: ``python bench/bench_core.py`` (CPU, host memory; about ten seconds).

1. *Evicted blocks per page freed* on a fragmented prefix cache: a seeded
   trace of requests of random length runs on a real host-memory pool; when
   the pool is full the cache evicts in LRU order (what an engine does to
   make room), which scatters cached and running blocks over pages. Then the
   limit is lowered to free half of the reclaimable pages, and we compare
   the page-aware coordinator with LRU-order eviction (the native
   alternative) on an identical copy of the cache, against the minimum (the
   occupancies of the emptiest reclaimable pages).
2. *Idle step() cost*: ``ShrinkCoordinator.step()`` with nothing pending,
   against vLLM 0.33's real ``Scheduler.schedule()`` with no requests (the
   cheapest scheduler step there is; skipped with a note if vLLM is not
   importable) and an empty scheduler-like pass, in ns per call.

Run with ``VLLM_TARGET_DEVICE=cpu`` on a CPU machine (``scripts/dev.sh run``
sets it).
"""

from __future__ import annotations

import atexit
import random
import sys
import time
import timeit
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout
from engine_ext import CoordinatorConfig, LimitMailbox, ShrinkCoordinator
from engine_ext.cpu_harness import ToyPrefixCache
from engine_ext.protocol import Status

PAGE_BYTES = 64 * 1024
NUM_PAGES = 512
BLOCKS_PER_PAGE = 16
SEED = 7


class LruPrefixCache(ToyPrefixCache):
    """The shared toy prefix cache: a finished request's blocks stay cached in LRU order."""

    def __init__(self, blocks: BlockAllocator) -> None:
        super().__init__(blocks, name="bench-lru")

    def admit(self, n: int) -> list[int] | None:
        return self.allocate(n, make_room=True)  # the engine's way: oldest cached first

    def finish(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        for block in blocks:
            self.insert(block, block)  # distinct contents: the block id is the key
        self.release(blocks)


@dataclass
class Pool:
    backend: HostBackend
    pages: PageAllocator
    blocks: BlockAllocator
    cache: LruPrefixCache
    running: list[list[int]] = field(default_factory=list)

    @classmethod
    def fragmented(cls) -> Pool:
        backend = HostBackend.reserve(PageLayout(page_bytes=PAGE_BYTES, num_pages=NUM_PAGES))
        pages = PageAllocator(backend)
        blocks = BlockAllocator(pages, BLOCKS_PER_PAGE)
        pool = cls(backend, pages, blocks, LruPrefixCache(blocks))
        rng = random.Random(SEED)
        for _ in range(6000):  # a trace: admit, and finish a random running request
            got = pool.cache.admit(rng.randint(1, 40))
            if got is not None:
                pool.running.append(got)
            if len(pool.running) > 60 or (pool.running and rng.random() < 0.5):
                pool.cache.finish(pool.running.pop(rng.randrange(len(pool.running))))
        return pool


def reclaimable_occupancies(pool: Pool) -> list[int]:
    per_page: dict[int, int] = {}
    for block in pool.cache.evictable_blocks():
        page = pool.blocks.page_of(block)
        per_page[page] = per_page.get(page, 0) + 1
    return sorted(n for p, n in per_page.items() if n == pool.blocks.occupancy(p))


def lru_evict_until(pool: Pool, num_pages: int) -> tuple[int, int]:
    """Native order: evict oldest cached blocks until ``num_pages`` pages emptied."""
    start = pool.pages.num_mapped
    evicted = 0
    while start - pool.pages.num_mapped < num_pages and pool.cache.evict_oldest():
        evicted += 1
    return evicted, start - pool.pages.num_mapped


def bench_eviction() -> None:
    aware = Pool.fragmented()
    native = Pool.fragmented()  # same seed: an identical cache
    occ = reclaimable_occupancies(aware)
    mapped = aware.pages.num_mapped
    pinned_pages = mapped - len(occ)
    want = len(occ) // 2
    minimum = sum(occ[:want])
    print(
        f"fragmented cache: {mapped} pages mapped, {aware.blocks.num_allocated_blocks} blocks, "
        f"{sum(len(r) for r in aware.running)} running blocks pinning {pinned_pages} pages, "
        f"{len(occ)} reclaimable pages; target: free {want} pages"
    )

    aware.cache.num_evicted = native.cache.num_evicted = 0  # count the shrink only, not the trace
    mailbox = LimitMailbox()
    coord = ShrinkCoordinator(mailbox, aware.blocks, CoordinatorConfig())
    coord.add_reclaimer(aware.cache)
    mailbox.publish_next((mapped - want) * aware.backend.layout.bundle_bytes)
    t0 = time.perf_counter()
    state = coord.step()
    step_ms = (time.perf_counter() - t0) * 1e3
    freed = mapped - aware.pages.num_mapped
    assert state.status is Status.APPLIED, state

    lru_evicted, lru_freed = lru_evict_until(native, want)
    per = BLOCKS_PER_PAGE
    rows = [
        ("page-aware (core)", aware.cache.num_evicted, freed),
        ("LRU order (native)", lru_evicted, lru_freed),
        ("minimum", minimum, want),
    ]
    print(
        f"\n{'eviction':<20}{'blocks':>8}{'pages':>7}{'blocks/page':>13}{'x minimum':>11}"
        f"{'x blocks/page':>15}"
    )
    for name, blocks, pages in rows:
        bpp = blocks / max(pages, 1)
        print(
            f"{name:<20}{blocks:>8}{pages:>7}{bpp:>13.2f}{bpp / (minimum / want):>11.2f}"
            f"{bpp / per:>15.2f}"
        )
    print(
        f"page-aware shrink pass: {step_ms:.2f} ms, 1 pass to applied "
        f"(goal: <= 1.1 x {per} blocks per page: "
        f"{'met' if aware.cache.num_evicted / freed <= 1.1 * per else 'NOT met'})"
    )
    for pool in (aware, native):
        pool.backend.release()


@dataclass
class _SchedOut:
    scheduled: list[int]
    num_tokens: int
    finished: set[int]


class _EmptyScheduler:
    """The bare minimum of a scheduler pass with no work: the reference cost."""

    def __init__(self) -> None:
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        self.finished: set[int] = set()

    def schedule(self) -> _SchedOut:
        scheduled: list[int] = []
        budget = 8192
        for req in self.running:
            scheduled.append(req)
            budget -= 1
        while self.waiting and budget > 0:
            scheduled.append(self.waiting.popleft())
        out = _SchedOut(scheduled, 8192 - budget, self.finished)
        self.finished = set()
        return out


def vllm_idle_schedule() -> Callable[[], object] | str:
    """A real vLLM v1 Scheduler over the tiny model config, or why there is none."""
    try:
        import tempfile

        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from engine_ext.cpu_harness import make_tiny_model_dir
    except ImportError as exc:
        return f"vLLM not importable ({exc})"
    scratch = tempfile.TemporaryDirectory(prefix="bench-core-")  # goes when the bench exits
    atexit.register(scratch.cleanup)
    model_dir = make_tiny_model_dir(scratch.name)
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), dtype="float32", max_model_len=512, skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=64,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
    )
    config.cache_config.num_gpu_blocks = 1024
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
    )
    scheduler = Scheduler(config, kv, StructuredOutputManager(config), block_size=16)
    return scheduler.schedule


def bench_idle_step() -> None:
    pool = Pool.fragmented()
    mailbox = LimitMailbox()
    coord = ShrinkCoordinator(mailbox, pool.blocks, CoordinatorConfig())
    coord.add_reclaimer(pool.cache)
    mailbox.publish_next(None)
    coord.step()  # take it; from now on nothing is pending
    sched = _EmptyScheduler()
    n = 200_000
    step_ns = min(timeit.repeat(coord.step, number=n, repeat=5)) / n * 1e9
    sched_ns = min(timeit.repeat(sched.schedule, number=n, repeat=5)) / n * 1e9
    noop_ns = min(timeit.repeat(lambda: None, number=n, repeat=5)) / n * 1e9
    rows = [
        ("ShrinkCoordinator.step() idle", step_ns),
        ("empty scheduler-like pass", sched_ns),
        ("no-op call", noop_ns),
    ]
    vllm = vllm_idle_schedule()
    if isinstance(vllm, str):
        print(f"\n(no vLLM reference: {vllm})")
        ref_name, ref_ns = rows[1]
    else:
        m = 20_000
        ref_name, ref_ns = (
            "vLLM Scheduler.schedule() idle",
            min(timeit.repeat(vllm, number=m, repeat=3)) / m * 1e9,
        )
        rows.insert(1, (ref_name, ref_ns))
    print(f"\n{'idle pass':<34}{'ns/call':>9}{'x ' + ref_name.split()[0] + ' ref':>14}")
    for name, ns in rows:
        print(f"{name:<34}{ns:>9.0f}{ns / ref_ns:>14.3f}")
    pool.backend.release()


if __name__ == "__main__":
    bench_eviction()
    bench_idle_step()
