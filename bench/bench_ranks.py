"""Rank channel cost: map/unmap of a page on 2 rank processes vs the bare HostBackend.

    python bench/bench_ranks.py      # ~10 s

Reports, as ratios against the bare single-process ``HostBackend`` in the same
run: one page ``map`` (waits for every rank's ack) + ``unmap`` + one barrier
``settle`` per page; and the same with 8 pages per call (one message per
batch). Also one empty ``step`` round trip (what every engine step costs on
top of its own work). Not a pass/fail test.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator import HostBackend, PageLayout
from engine_ext.ranks import RankedBackend, RankGroup

LAYOUT = PageLayout(page_bytes=64 << 10, num_pages=64, num_regions=8)
ROUNDS = 300


def _cycle(backend: object, pages: list[int], ranked: bool) -> float:
    start = time.perf_counter()
    for _ in range(ROUNDS):
        backend.map_many(pages)  # type: ignore[attr-defined]
        backend.unmap_many(pages)  # type: ignore[attr-defined]
        if ranked:
            backend.settle(5.0)  # type: ignore[attr-defined]
    return (time.perf_counter() - start) / ROUNDS


def main() -> None:
    bare = HostBackend.reserve(LAYOUT, name="kvs-bench-bare")
    owner = HostBackend.reserve(LAYOUT, name="kvs-bench-ranked")
    with tempfile.TemporaryDirectory() as tmp:
        group = RankGroup.spawn(str(Path(tmp) / "r.sock"), 2)
    backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=4096, slot_bytes=256)
    try:
        rows = []
        for pages in ([5], list(range(8, 16))):
            base = _cycle(bare, pages, False)
            ranked = _cycle(backend, pages, True)
            rows.append((len(pages), base, ranked))
        start = time.perf_counter()
        for _ in range(ROUNDS):
            group.run_step({"blocks": [], "offsets": [], "values": []}, timeout_s=5)
        step = (time.perf_counter() - start) / ROUNDS
    finally:
        backend.release()
        bare.release()
    print("| pages per call | bare map+unmap (µs) | 2 ranks map+unmap+settle (µs) | × bare |")
    print("|---|---|---|---|")
    for count, base, ranked in rows:
        print(f"| {count} | {base * 1e6:.0f} | {ranked * 1e6:.0f} | {ranked / base:.1f} |")
    print(f"\nempty step round trip on 2 ranks: {step * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
