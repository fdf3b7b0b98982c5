"""The sidecar at its instance cap: CPU and PUT latency with the autopilot on and off.

A real ``kvsidecar serve`` with ``--instances`` registered engines (stand-ins speaking
the engine API over HTTP) spread over ``--devices`` devices. Two runs, each its own
sidecar: ``off`` (no device budget: the autopilot has nothing to do) and ``on`` (every
device budgeted: the autopilot passes over every device at least every
``KVSIDECAR_AUTOPILOT_INTERVAL_S``). In each: ``--puts`` operator PUTs ~10 ms apart with
no engine reporting, then again while the engines report at ``--report-rate`` a second
(1,024 engines at the default 5 s heartbeat make 205); first, ``--idle-s`` with neither,
and 30 ``GET /instances`` in a row.
Measured: PUT p50/p99 and the sidecar's CPU (``/proc/<pid>/stat``) over each phase;
ratios on/off.

    python bench/bench_autopilot_scale.py [--instances 1024] [--devices 8] [--puts 300]

Timings never go in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _sidecar_process import SidecarProcess


def _state(i: int, passes: int = 1) -> dict[str, Any]:
    return {
        "status": "applied",
        "revision": 0,
        "mapped_bytes": (i % 64) << 24,
        "capacity_bytes": 16 << 30,
        "passes": passes,
        "num_running_requests": i % 3,
        "num_waiting_requests": i % 2,
        "waiting_bytes": (i % 2) << 22,
    }


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p(times: list[float], q: float) -> float:
    times = sorted(times)
    return times[min(len(times) - 1, int(len(times) * q))]


class _Run:
    """One sidecar, its engines registered (and its devices budgeted when ``on``)."""

    def __init__(self, args: argparse.Namespace, on: bool) -> None:
        self.args, self.on = args, on
        self.sidecar = SidecarProcess(
            {
                "KVSIDECAR_MAX_INSTANCES": str(max(1024, args.instances)),
                # the stand-ins report in the last phase only: none turns unreachable before it
                "KVSIDECAR_HEARTBEAT_TIMEOUT_S": "600",
            }
        )
        self.url, self.pid = self.sidecar.url, self.sidecar.pid
        self.client = httpx.Client(base_url=self.url, timeout=60)
        for i in range(args.instances):
            body = {
                "engine": "vllm",
                "engine_version": "0.33.0",
                "state": _state(i),
                "device_id": f"gpu{i % args.devices}",
                "device_total_bytes": 80 << 30,
            }
            r = self.client.post(f"/instances/e{i:05d}/register", json=body)
            r.raise_for_status()
        if on:
            for d in range(args.devices):
                r = self.client.put(f"/devices/gpu{d}/budget", json={"budget": "60G"})
                r.raise_for_status()
        time.sleep(1)

    def idle(self, seconds: float) -> tuple[list[float], float]:
        """The sidecar's CPU (cores) while nothing happens: no PUT, no report (no PUT
        latencies: the list is empty)."""
        cpu0, t0 = _cpu_s(self.pid), time.monotonic()
        time.sleep(seconds)
        return [], (_cpu_s(self.pid) - cpu0) / (time.monotonic() - t0)

    def listing(self, count: int = 30) -> tuple[list[float], float]:
        """``GET /instances`` latencies (every view, with the autopilot's policy fields) and
        the sidecar's CPU over them."""
        times = []
        cpu0, t0 = _cpu_s(self.pid), time.monotonic()
        for _ in range(count):
            started = time.perf_counter()
            self.client.get("/instances").raise_for_status()
            times.append(time.perf_counter() - started)
        return times, (_cpu_s(self.pid) - cpu0) / (time.monotonic() - t0)

    def puts(self) -> tuple[list[float], float]:
        """PUT latencies and the sidecar's CPU (cores) over them."""
        times = []
        cpu0, t0 = _cpu_s(self.pid), time.monotonic()
        for i in range(self.args.puts):
            started = time.perf_counter()
            self.client.put(
                f"/instances/e{i * 7 % self.args.instances:05d}/limit",
                json={"limit": f"{i % 40 + 2}GiB"},
            )
            times.append(time.perf_counter() - started)
            time.sleep(0.01)
        return times, (_cpu_s(self.pid) - cpu0) / (time.monotonic() - t0)

    def reporting(self) -> tuple[list[float], float]:
        """:meth:`puts` while the engines report at ``--report-rate`` a second."""
        stop = threading.Event()
        rate, n = self.args.report_rate, self.args.instances

        async def report() -> None:
            async with httpx.AsyncClient(
                base_url=self.url, timeout=60, limits=httpx.Limits(max_connections=32)
            ) as ac:
                sent, start, tasks = 0, time.monotonic(), set()
                while not stop.is_set():
                    wait = start + sent / rate - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    i = sent % n
                    task = asyncio.ensure_future(
                        ac.post(f"/instances/e{i:05d}/report", json=_state(i, 2 + sent // n))
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    sent += 1
                await asyncio.gather(*tasks, return_exceptions=True)

        reporter = threading.Thread(target=lambda: asyncio.run(report()))
        reporter.start()
        try:
            time.sleep(1)
            return self.puts()
        finally:
            stop.set()
            reporter.join()

    def close(self) -> None:
        self.client.close()
        self.sidecar.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1024)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--puts", type=int, default=300)
    parser.add_argument("--report-rate", type=float, default=205.0)
    parser.add_argument("--idle-s", type=float, default=5.0, help="length of the idle phase")
    args = parser.parse_args()
    results: dict[tuple[str, str], tuple[list[float], float]] = {}
    for on in (False, True):
        run = _Run(args, on)
        try:
            results["on" if on else "off", "idle"] = run.idle(args.idle_s)
            results["on" if on else "off", "list"] = run.listing()
            results["on" if on else "off", "quiet"] = run.puts()
            results["on" if on else "off", "reporting"] = run.reporting()
        finally:
            run.close()
    print(
        f"{args.instances} instances on {args.devices} devices, {args.puts} PUTs per phase, "
        f"reports at {args.report_rate:g}/s in the last phase; idle: {args.idle_s:g} s with "
        "neither"
    )
    print(f"{'phase':<10} {'autopilot':<9} {'PUT p50':>9} {'PUT p99':>9} {'CPU':>6}")
    for mode in ("off", "on"):
        times, _ = results[mode, "list"]
        print(
            f"GET /instances, autopilot {mode}: p50 {_p(times, 0.5) * 1e3:.1f} ms, "
            f"p99 {_p(times, 0.99) * 1e3:.1f} ms ({len(times)} in a row)"
        )
    for phase in ("idle", "quiet", "reporting"):
        if phase == "idle":
            (_, c_off), (_, c_on) = results["off", phase], results["on", phase]
            print(f"{'idle':<10} {'off':<9} {'':>9} {'':>9} {c_off:6.2f}")
            print(f"{'idle':<10} {'on':<9} {'':>9} {'':>9} {c_on:6.2f}")
            print(f"{'idle':<10} on / off  {'':>9} {'':>9} {c_on / max(c_off, 1e-3):5.2f}x")
            continue
        for mode in ("off", "on"):
            times, cpu = results[mode, phase]
            print(
                f"{phase:<10} {mode:<9} {_p(times, 0.5) * 1e3:7.1f}ms {_p(times, 0.99) * 1e3:7.1f}ms"
                f" {cpu:6.2f}"
            )
        (t_off, c_off), (t_on, c_on) = results["off", phase], results["on", phase]
        print(
            f"{phase:<10} on / off  {_p(t_on, 0.5) / _p(t_off, 0.5):8.2f}x "
            f"{_p(t_on, 0.99) / _p(t_off, 0.99):8.2f}x {c_on / c_off:5.2f}x"
        )


if __name__ == "__main__":
    main()
