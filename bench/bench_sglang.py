"""SGLang adapter: page-aware shrink vs SGLang's own LRU eviction, on SGLang's real tree caches.

    PYTHONPATH=. python bench/bench_sglang.py          # ~25 s, most of it importing SGLang

For each tree cache (UnifiedRadixCache with the Rust core, RadixCache) and
two workloads (30 distinct prompts; 30 prompts sharing a 32-token system
prompt), the CPU harness fills the cache, then the pool must drop to 10
mapped pages. Compared in the same run, on identical copies:

* kvsidecar: ``set_limit`` + one idle pass (page-aware, leaves first);
* native: SGLang's ``tree_cache.evict(num_tokens=...)`` asked for exactly
  the overage in tokens (LRU order, what SGLang does to make room), then
  however many pages that emptied.

Reported: pages freed, cache blocks evicted per page freed (minimum =
SGLang pages per mapping page), cached tokens kept, and the wall time of the
kvsidecar pass against the native eviction call.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ext import EngineSettings
from engine_ext.cpu_harness import CpuHarness, HarnessConfig

LIMIT_PAGES = 10


def build(kind: str, shared: bool, tmp: str, name: str) -> CpuHarness:
    h = CpuHarness(
        EngineSettings(enable=True, runtime_dir=Path(tmp), instance_id=name),
        HarnessConfig(cache=kind),
    )
    for i in range(30):
        body = [(i * 37 + j * 11 + 1) % 2000 for j in range(12 if shared else 40)]
        h.submit(([5] * 32 if shared else []) + body, max_new_tokens=5)
    h.run_until_idle()
    return h


def kvsidecar(h: CpuHarness) -> tuple[int, int, float]:
    before = h.pages.num_mapped
    h.pool.set_limit(LIMIT_PAGES * h.bundle_bytes)
    t0 = time.perf_counter()
    h.on_idle()
    dt = time.perf_counter() - t0
    return before - h.pages.num_mapped, h.pool.reclaimer.num_evicted_blocks, dt


def native(h: CpuHarness) -> tuple[int, int, float]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    before_pages, before_blocks = h.pages.num_mapped, h.blocks.num_allocated_blocks
    tokens = (before_pages - LIMIT_PAGES) * h.blocks.blocks_per_page * h.config.page_size
    t0 = time.perf_counter()
    h.tree_cache.evict(EvictParams(num_tokens=tokens))
    dt = time.perf_counter() - t0
    return before_pages - h.pages.num_mapped, before_blocks - h.blocks.num_allocated_blocks, dt


def main() -> None:
    print(
        f"{'cache':8} {'workload':9} {'method':10} {'pages freed':>11} {'blocks/page':>11} "
        f"{'kept tokens':>11} {'time ×native':>12}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("unified", "radix"):
            for shared in (False, True):
                rows = {}
                for method, run in (("native", native), ("kvsidecar", kvsidecar)):
                    h = build(kind, shared, tmp, f"b-{kind}-{shared}-{method}")
                    freed, evicted, dt = run(h)
                    rows[method] = (freed, evicted, h.tree_cache.evictable_size(), dt)
                    h.close()
                base = rows["native"][3]
                for method, (freed, evicted, kept, dt) in rows.items():
                    per = f"{evicted / freed:.2f}" if freed else "inf"
                    print(
                        f"{kind:8} {'shared' if shared else 'distinct':9} {method:10} "
                        f"{freed:>11} {per:>11} {kept:>11} {dt / base:>12.1f}"
                    )
    print("minimum blocks/page = SGLang pages per mapping page = 4")


if __name__ == "__main__":
    main()
