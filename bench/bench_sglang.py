"""SGLang adapter: page-aware shrink vs SGLang's own LRU eviction, on SGLang's real tree caches.

    PYTHONPATH=. python bench/bench_sglang.py          # ~25 s, most of it importing SGLang

For each tree cache (UnifiedRadixCache with the Rust core, RadixCache) and
four workloads, the CPU harness fills the cache, then the pool must drop to
a limit:

* ``distinct``: 30 distinct 40-token prompts, limit 10 mapped pages;
* ``shared``: 30 prompts sharing a 32-token system prompt, limit 10 pages;
* ``doc-half``: the real-server e2e fill (a 601-token document and eight
  151-token prompts, each prompt checkpointed after prefill as SGLang
  0.5.23 does), limit half the mapped pages;
* ``doc-1``: the same fill, limit one page below what is mapped.

Compared in the same run, on identical copies:

* kvsidecar: ``set_limit`` + one idle pass (page-aware: leaf tails cheapest
  page first; whole leaves on the Rust core);
* native: SGLang's ``tree_cache.evict(num_tokens=...)`` asked for exactly
  the overage in tokens (LRU order, what SGLang does to make room), then
  however many pages that emptied.

Reported: pages freed, cache blocks evicted per page freed (minimum =
SGLang pages per mapping page), cached tokens kept, and the wall time of the
kvsidecar pass against the native eviction call.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ext import EngineSettings
from engine_ext.cpu_harness import CpuHarness, HarnessConfig

WORKLOADS = ("distinct", "shared", "doc-half", "doc-1")


def build(kind: str, workload: str, tmp: str, name: str) -> CpuHarness:
    doc = workload.startswith("doc")
    h = CpuHarness(
        EngineSettings(enable=True, runtime_dir=Path(tmp), instance_id=name),
        HarnessConfig(cache=kind, max_tokens=4092 if doc else 1020, max_context=2048),
    )
    if doc:
        rng = random.Random(3)
        for length in [601] + [151] * 8:
            h.submit([rng.randrange(1, 2000) for _ in range(length)], max_new_tokens=4)
            h.run_until_idle()
        return h
    shared = workload == "shared"
    for i in range(30):
        body = [(i * 37 + j * 11 + 1) % 2000 for j in range(12 if shared else 40)]
        h.submit(([5] * 32 if shared else []) + body, max_new_tokens=5)
    h.run_until_idle()
    return h


def limit_pages(h: CpuHarness, workload: str) -> int:
    mapped = h.pages.num_mapped
    return {"doc-half": mapped // 2, "doc-1": mapped - 1}.get(workload, 10)


def kvsidecar(h: CpuHarness, limit: int) -> tuple[int, int, float]:
    before = h.pages.num_mapped
    h.pool.set_limit(limit * h.bundle_bytes)
    t0 = time.perf_counter()
    h.on_idle()
    dt = time.perf_counter() - t0
    return before - h.pages.num_mapped, h.pool.reclaimer.num_evicted_blocks, dt


def native(h: CpuHarness, limit: int) -> tuple[int, int, float]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    before_pages, before_blocks = h.pages.num_mapped, h.blocks.num_allocated_blocks
    tokens = (before_pages - limit) * h.blocks.blocks_per_page * h.config.page_size
    t0 = time.perf_counter()
    h.tree_cache.evict(EvictParams(num_tokens=tokens))
    dt = time.perf_counter() - t0
    return before_pages - h.pages.num_mapped, before_blocks - h.blocks.num_allocated_blocks, dt


def main() -> None:
    print(
        f"{'cache':8} {'workload':9} {'method':10} {'freed (needed)':>14} {'blocks/page':>11} "
        f"{'kept tokens':>11} {'time ×native':>12} {'ms':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("unified", "radix"):
            for workload in WORKLOADS:
                rows = {}
                for method, run in (("native", native), ("kvsidecar", kvsidecar)):
                    h = build(kind, workload, tmp, f"b-{kind}-{workload}-{method}")
                    limit = limit_pages(h, workload)
                    needed = h.pages.num_mapped - limit
                    freed, evicted, dt = run(h, limit)
                    rows[method] = (freed, needed, evicted, h.tree_cache.evictable_size(), dt)
                    h.close()
                base = rows["native"][4]
                for method, (freed, needed, evicted, kept, dt) in rows.items():
                    per = f"{evicted / freed:.2f}" if freed else "inf"
                    print(
                        f"{kind:8} {workload:9} {method:10} {f'{freed} ({needed})':>14} "
                        f"{per:>11} {kept:>11} {dt / base:>12.1f} {dt * 1e3:>6.1f}"
                    )
    print("minimum blocks/page = SGLang pages per mapping page = 4")


if __name__ == "__main__":
    main()
