"""SGLang adapter: evictable/pinned figures by full scan vs kept per tree event (issue 17, item 3).

    PYTHONPATH=. python bench/bench_sglang_counts.py      # ~40 s, most of it filling trees

For each tree cache (UnifiedRadixCache with the Rust core, RadixCache), the
CPU harness's tree is filled with 10k and 100k cached tokens (48-token
prompts, 8 per group sharing a 16-token prefix, inserted through SGLang's
``insert``), then:

* **scan**: what the idle refresh cost before: the reclaimer's full listing
  of unlocked blocks (``scan_unlocked``) plus ``count_reclaimable_pages``;
* **event + refresh**: one request's worth of tree events (``lock`` and
  ``unlock`` of a cached 48-token path: the counting hooks run) followed by
  the coordinator ``step()`` that republishes evictable/pinned;
* **refresh, nothing moved**: ``step()`` alone.

Medians of repeated runs (wall time, noisy on the shared 2-core machine) and
the counting hooks' tree-node visits and node slot tensors read per event
(operation counts, as the tests assert: independent of the tree size; a read
is a device-to-host copy on GPU, avoided for locks by the hooks' host mirror).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_ext import EngineSettings, count_reclaimable_pages
from engine_ext.cpu_harness import CpuHarness, HarnessConfig

SIZES = (10_000, 100_000)
PROMPT = 48
SHARED = 16
GROUP = 8


def build(kind: str, tokens: int, tmp: str) -> tuple[CpuHarness, list[Any]]:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    h = CpuHarness(
        EngineSettings(enable=True, runtime_dir=Path(tmp), instance_id=f"{kind}-{tokens}"),
        HarnessConfig(
            cache=kind, head_num=1, layer_num=1, max_tokens=tokens + 4096, max_context=2048
        ),
    )
    h.pool.before_schedule()
    rng = random.Random(5)
    keys = []
    allocator = h.token_to_kv_pool_allocator
    for _ in range(tokens // (SHARED + GROUP * (PROMPT - SHARED))):  # ``tokens`` cached
        shared = [rng.randrange(1, 2000) for _ in range(SHARED)]
        for _ in range(GROUP):
            ids = shared + [rng.randrange(1, 2000) for _ in range(PROMPT - SHARED)]
            key = h._key(ids)
            value = allocator.alloc(PROMPT)
            result = h.tree_cache.insert(InsertParams(key=key, value=value.clone()))
            if kind == "radix" and result.prefix_len:  # (the Rust core frees duplicates)
                allocator.free(value[: result.prefix_len])  # the shared prefix was cached
            keys.append(key)
    return h, keys


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(kind: str, tokens: int) -> dict[str, float]:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    with tempfile.TemporaryDirectory() as tmp:
        h, keys = build(kind, tokens, tmp)
        try:
            reclaimer: Any = h.pool.reclaimer
            coordinator = h.pool.instance.coordinator
            counts = h.pool.counts
            assert counts is not None
            node = h.tree_cache.match_prefix(MatchPrefixParams(key=keys[-1])).last_device_node

            def scan() -> int:
                return count_reclaimable_pages(reclaimer.scan_unlocked(), h.blocks)

            def event_and_refresh() -> None:
                lock = h.tree_cache.lock(node)
                coordinator.step()
                h.tree_cache.unlock(lock)
                coordinator.step()

            repeat = 7 if tokens >= 100_000 else 21
            nodes_before, calls_before = counts.num_path_nodes, counts.num_hook_calls
            reads_before = counts.num_device_reads
            row = {
                "cached_tokens": float(h.tree_cache.evictable_size()),
                "scan_ms": median_ms(scan, repeat),
                "event_ms": median_ms(event_and_refresh, 201) / 2,
                "refresh_ms": median_ms(coordinator.step, 201),
            }
            calls = counts.num_hook_calls - calls_before
            row["nodes_per_event"] = (counts.num_path_nodes - nodes_before) / max(1, calls)
            row["reads_per_event"] = (counts.num_device_reads - reads_before) / max(1, calls)
            assert scan() == h.blocks.num_reclaimable_pages  # the counts are the scan's
            assert counts.num_resyncs == 0
            return row
        finally:
            h.close()


def main() -> None:
    from engine_ext.sglang import prepare_cpu_imports

    prepare_cpu_imports()  # SGLang's memory modules on a CPU-only machine
    print(
        "| cache | cached tokens | full scan | tree event + refresh | refresh, nothing moved "
        "| × (scan / event+refresh) | nodes visited per event | slot tensors read per event |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("unified", "radix"):
        for tokens in SIZES:
            r = measure(kind, tokens)
            print(
                f"| {kind} | {int(r['cached_tokens'])} | {r['scan_ms']:.2f} ms | "
                f"{r['event_ms'] * 1e3:.1f} µs | {r['refresh_ms'] * 1e3:.2f} µs | "
                f"{r['scan_ms'] / r['event_ms']:.0f}× | {r['nodes_per_event']:.1f} | "
                f"{r['reads_per_event']:.2f} |"
            )


if __name__ == "__main__":
    main()
