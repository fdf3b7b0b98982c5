"""A /metrics scrape at scale: the sidecar's direct text vs prometheus_client, and what a
scrape costs the PUTs that arrive meanwhile.

1. In one process: the per-instance gauges of N reporting instances written by
   ``sidecar._metrics.instance_text`` against the same families built and written by
   prometheus_client (``tests/support/metrics_reference.py``, the text the sidecar served
   until 2026-12-07); medians of alternating rounds, and their ratio.
2. A real ``kvsidecar serve`` holding ``--instances`` instances (PUTs; the cap is
   ``KVSIDECAR_MAX_INSTANCES``, 1,024 by default): PUT latency with nobody scraping and
   with a scraper every ``--scrape-interval`` seconds; the scrape's own latency.

    python bench/bench_metrics.py [--instances 1024] [--rounds 7] [--puts 600]

Timings never go in tests; ``tests/unit/test_sidecar_metrics_text.py`` checks the text.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _sidecar_process import SidecarProcess
from support.metrics_reference import reference_text

from engine_ext.protocol import EngineState, Status
from sidecar._metrics import instance_text
from sidecar._models import DesiredLimit, EngineInfo, InstanceView


def _views(n: int) -> list[InstanceView]:
    """``n`` registered instances that have reported (every family has a series each)."""
    return [
        InstanceView(
            id=f"engine-{i:05d}",
            status=Status.DEFERRED if i % 7 == 0 else Status.APPLIED,
            reason="running_requests" if i % 7 == 0 else None,
            desired=DesiredLimit(limit_bytes=(i + 1) << 24, revision=i + 1, updated_at=1.8e9),
            effective_limit_bytes=(i + 1) << 24,
            mapped_bytes=(i + 1) << 23,
            overage_bytes=0,
            last_seen_s_ago=0.5 + i % 5,
            engine=EngineInfo(
                engine="vllm",
                engine_version="0.33.0",
                socket_path=None,
                device_total_bytes=80 << 30,
                registered_at=1.8e9,
            ),
            observed=EngineState(
                status=Status.APPLIED,
                mapped_bytes=(i + 1) << 23,
                capacity_bytes=64 << 30,
                evictable_bytes=(i + 1) << 22,
                pinned_bytes=(i + 1) << 22,
            ),
        )
        for i in range(n)
    ]


def _text_rounds(n: int, rounds: int) -> None:
    views, now = _views(n), time.time()
    direct: list[float] = []
    reference: list[float] = []
    for r in range(rounds):
        order = [(direct, instance_text), (reference, reference_text)]
        for times, fn in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fn(views, now)
            times.append(time.perf_counter() - t0)
    d, p = statistics.median(direct), statistics.median(reference)
    lines = instance_text(views, now).count("\n")
    print(
        f"{n:>6} instances ({lines} lines): direct {d * 1e3:7.2f} ms   "
        f"prometheus_client {p * 1e3:7.2f} ms   direct / prometheus_client {d / p:.3f}x"
    )


def _percentiles(times: list[float]) -> str:
    times = sorted(times)
    p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
    return f"p50 {p50 * 1e3:6.1f} ms  p99 {p99 * 1e3:6.1f} ms  max {times[-1] * 1e3:6.1f} ms"


def _serve_rounds(args: argparse.Namespace) -> None:
    sidecar = SidecarProcess({"KVSIDECAR_MAX_INSTANCES": str(max(1024, args.instances))})
    url = sidecar.url
    try:
        client = httpx.Client(base_url=url, timeout=30)
        for i in range(args.instances):
            client.put(f"/instances/engine-{i:05d}/limit", json={"limit": f"{i + 1}MiB"})

        def puts() -> list[float]:
            times = []
            for i in range(args.puts):
                t0 = time.perf_counter()
                client.put(
                    f"/instances/engine-{i % args.instances:05d}/limit",
                    json={"limit": f"{i % 50 + 2}MiB"},
                )
                times.append(time.perf_counter() - t0)
            return times

        quiet = puts()
        stop = threading.Event()
        scrapes: list[float] = []

        def scrape() -> None:
            with httpx.Client(base_url=url, timeout=30) as s:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    s.get("/metrics")
                    scrapes.append(time.perf_counter() - t0)
                    stop.wait(args.scrape_interval)

        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            scraped = puts()
        finally:
            stop.set()
            scraper.join()
        q99 = sorted(quiet)[int(len(quiet) * 0.99)]
        s99 = sorted(scraped)[int(len(scraped) * 0.99)]
        print(f"kvsidecar serve, {args.instances} instances, {args.puts} PUTs each way:")
        print(f"  PUT, nobody scraping          {_percentiles(quiet)}")
        print(f"  PUT, a scrape every {args.scrape_interval:g} s    {_percentiles(scraped)}")
        print(f"  p99 scraping / quiet          {s99 / q99:.2f}x")
        print(f"  scrape ({len(scrapes)})                  {_percentiles(scrapes)}")
    finally:
        sidecar.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--puts", type=int, default=600)
    parser.add_argument("--scrape-interval", type=float, default=0.1)
    args = parser.parse_args()
    for n in sorted({128, args.instances}):
        _text_rounds(n, args.rounds)
    _serve_rounds(args)


if __name__ == "__main__":
    main()
