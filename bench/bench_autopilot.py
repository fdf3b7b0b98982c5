"""Autopilot: time for a busy engine to hold its share; completion time vs a static split.

Run: ``python bench/bench_autopilot.py [--rounds 3] [--jobs 10]`` (CPU; about a minute).

Three real engine extensions (``ElasticInstance`` on the host backend, each
with a real prefix cache and its own engine thread; the toy engines of
tests/unit/engine_ext/autopilot_engines.py) register with a real sidecar on
one host device whose budget is 24 pages (each engine could map 32). The load
moves A -> B -> C: each engine gets ``--jobs`` requests of 4 pages running 40
iterations, and the next burst starts when the previous one is answered. Measured, per round:

* **share time**: from a burst's start to the busy engine's desired limit
  reaching 60 % of the budget (device view polled every 10 ms);
* **completion** of the whole load and **p99** request latency, with the
  autopilot (budget on the device, no limits) and with a static equal split
  (three operator limits of budget/3, no budget).

Goal (issue 13): the autopilot clearly better than the static split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit" / "engine_ext")]

import httpx
from autopilot_engines import BUNDLE, ToyEngine
from support import ThreadedSidecar

from sidecar import SidecarSettings

DEVICE = "host0"
BUDGET = 24 * BUNDLE
MOST = 0.6


def _load(engines: list[ToyEngine], jobs: int, c: httpx.Client | None) -> dict[str, object]:
    shares: list[float] = []
    stop = threading.Event()
    starts: dict[str, float] = {}
    reached: dict[str, float] = {}

    def poll() -> None:  # share time: the busy engine's limit >= MOST of the budget
        while c is not None and not stop.wait(0.01):
            view = c.get(f"/devices/{DEVICE}").json()
            now = time.monotonic()
            for m in view["instances"]:
                iid = m["id"]
                if (
                    iid in starts
                    and iid not in reached
                    and (m["limit_bytes"] or 0) >= MOST * BUDGET
                ):
                    reached[iid] = now - starts[iid]

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.monotonic()
    all_jobs = []
    for e in engines:
        starts[e.iid] = time.monotonic()
        mine = [e.submit(pages=4, iterations=40) for _ in range(jobs)]
        for j in mine:  # the load moves on when this burst is answered
            assert j.done.wait(300), "a request never finished"
        all_jobs += mine
    for j in all_jobs:
        assert j.done.wait(300), "a request never finished"
    total = time.monotonic() - t0
    stop.set()
    poller.join(5)
    shares = [reached[e.iid] for e in engines if e.iid in reached]
    lat = sorted(j.latency_s for j in all_jobs)
    return {
        "completion_s": total,
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "share_s": shares,
        "share_missed": len(engines) - len(shares),
    }


def _round(jobs: int, autopilot: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = SidecarSettings(
            db_path=Path(tmp) / "s.db",
            push_backoff_initial_s=0.02,
            push_backoff_max_s=0.2,
            autopilot_interval_s=0.05,
            autopilot_busy_hold_s=0.3,
        )
        with (
            ThreadedSidecar(settings) as server,
            httpx.Client(base_url=server.url, timeout=30) as c,
        ):
            engines = [ToyEngine(i, server.url, Path(tmp) / "rt", DEVICE) for i in "abc"]
            try:
                for e in engines:
                    e.start()
                while len(c.get(f"/devices/{DEVICE}").json()["instances"]) < 3:
                    time.sleep(0.02)
                if autopilot:
                    c.put(f"/devices/{DEVICE}/budget", json={"budget": BUDGET}).raise_for_status()
                else:
                    for e in engines:
                        c.put(
                            f"/instances/{e.iid}/limit",
                            params={"wait": 10},
                            json={"limit": BUDGET // 3},
                        ).raise_for_status()
                time.sleep(0.5)
                return _load(engines, jobs, c if autopilot else None)
            finally:
                for e in engines:
                    e.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=10)
    args = parser.parse_args()
    from allocator import ThreadGuard

    ThreadGuard.set_default_enabled(True)
    runs: dict[str, list[dict[str, object]]] = {"autopilot": [], "static": []}
    for _ in range(args.rounds):  # interleaved
        runs["static"].append(_round(args.jobs, autopilot=False))
        runs["autopilot"].append(_round(args.jobs, autopilot=True))
    out: dict[str, object] = {
        "rounds": args.rounds,
        "jobs_per_engine": args.jobs,
        "budget_pages": BUDGET // BUNDLE,
    }
    for name, rs in runs.items():
        out[name] = {
            "completion_s_median": round(
                statistics.median(float(r["completion_s"]) for r in rs), 3
            ),
            "p99_s_median": round(statistics.median(float(r["p99_s"]) for r in rs), 3),
        }
    shares = [s for r in runs["autopilot"] for s in r["share_s"]]  # type: ignore[attr-defined]
    out["share_s_median"] = round(statistics.median(shares), 3) if shares else None
    out["share_s_max"] = round(max(shares), 3) if shares else None
    out["share_missed"] = sum(int(r["share_missed"]) for r in runs["autopilot"])  # type: ignore[call-overload]
    a, s = out["autopilot"], out["static"]
    out["completion_speedup"] = round(s["completion_s_median"] / a["completion_s_median"], 2)  # type: ignore[index]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
