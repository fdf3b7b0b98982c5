"""Bookkeeping bytes per block: native vLLM ``BlockPool`` vs ``ElasticBlockPool`` + allocator.

    python bench/bench_bookkeeping.py      # ~20 s, most of it importing vLLM

Builds vLLM's own ``KVCacheManager`` over each pool (``bench_vllm``'s set-up,
16 blocks per page, 16k blocks) and measures with ``tracemalloc`` the Python
heap it holds: after construction, and with every block allocated (every
page in use, the allocator's per-page state at its largest), after one
unmeasured build of each (modules imported on first use are not per-block
state). Reported: bytes
per block and the ratio elastic / native. Goal: within +10% of native. The KV
memory itself (the host reservation) is not Python heap and is not counted.
"""

from __future__ import annotations

import gc
import tracemalloc

import bench_vllm as bv

NUM_PAGES = 1024  # 16k blocks


def measure(elastic: bool) -> tuple[float, float]:
    bv.NUM_PAGES = NUM_PAGES
    num_blocks = NUM_PAGES * bv.BLOCKS_PER_PAGE
    with bv.pool_class(elastic):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        manager, backend = bv._manager(elastic)
        gc.collect()
        built = tracemalloc.get_traced_memory()[0] - base
        pool = manager.block_pool
        got = pool.get_new_blocks(pool.get_num_free_blocks())
        gc.collect()
        full = tracemalloc.get_traced_memory()[0] - base - 8 * len(got) - 56  # minus `got`
        tracemalloc.stop()
        if backend is not None:
            backend.release()
        del manager, pool, got
        return built / num_blocks, full / num_blocks


def main() -> None:
    (
        measure(False),
        measure(True),
    )  # warm-up: modules the pools import on first use are not per block
    rows = [("native BlockPool", *measure(False)), ("ElasticBlockPool", *measure(True))]
    native_built, native_full = rows[0][1], rows[0][2]
    print(f"{NUM_PAGES * bv.BLOCKS_PER_PAGE} blocks, {bv.BLOCKS_PER_PAGE} per page\n")
    print("| pool | bytes/block built | bytes/block all allocated | × native (built / full) |")
    print("|---|---|---|---|")
    for name, built, full in rows:
        print(
            f"| {name} | {built:.1f} | {full:.1f} | {built / native_built:.3f} / "
            f"{full / native_full:.3f} |"
        )


if __name__ == "__main__":
    main()
