"""The autopilot scenario (``kvsidecar demo --autopilot``): three engines, one budgeted device.

Three CPU-harness engines (vLLM, SGLang, vLLM) register on one host device. The same load,
moving from A to B to C (each engine's burst starts while the last quarter
of the previous one still runs), is run twice: once under a static equal
split of the budget (three operator limits of budget/3), once under the
autopilot (a budget on the device, no limits). A 50 ms thread samples the KV memory of the three
engines from /proc (the memfds' allocated blocks) and the device view.

Checks: every request succeeds (both runs); the /proc sum stays within the
budget at every sample of the autopilot run; the busy engine holds most of
the budget within ``SHARE_WITHIN_S`` of its burst starting. Figures:
completion time of the whole load and p99 request latency, both runs.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine_ext.cpu_harness import make_document

from ._cluster import Cluster

__all__ = ["DEVICE", "SHARE_WITHIN_S", "autopilot_vs_static"]

DEVICE = "host0"
MiB = 1 << 20
SHARE_WITHIN_S = 10.0  # the busy engine holds most of the budget this soon after its load
MOST = 0.6  # "most of the budget"


class _Watch:
    """Samples the engines' /proc KV bytes and the device every 50 ms (its own thread).

    Each engine is read twice per sample, in opposite orders (see :meth:`_run`), so
    memory moving from one engine to another during a sample is not counted twice.
    """

    def __init__(self, cluster: Cluster, ids: list[str], budget: int) -> None:
        self.cluster = cluster
        self.ids = ids
        self.budget = budget
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-autopilot-watch", daemon=True)
        self.t0 = time.monotonic()
        self._fds: dict[str, list[str]] = {}  # instance -> /proc/<pid>/fd/<n> of its KV memfd

    def _proc_bytes(self, instance_id: str) -> int:
        """The engine's KV memfd blocks from /proc (fd paths found once, then one stat)."""
        paths = self._fds.get(instance_id)
        if not paths:
            server = self.cluster.engines[instance_id]
            paths = self._fds[instance_id] = _memfd_paths(server.proc.pid, server.kv_memfd_name)
        total = 0
        for path in paths:
            try:
                total += os.stat(path).st_blocks * 512
            except OSError:
                self._fds.pop(instance_id, None)
        return total

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        url = f"{self.cluster.sidecar_url}/devices/{DEVICE}"
        while not self._stop.wait(0.05):
            t = round(time.monotonic() - self.t0, 3)
            # Each engine read twice, in opposite orders, keeping the smaller read: memory
            # moving from one engine to another between two reads (A gives back, then B
            # maps) is then never counted on both sides, which one pass in a fixed order
            # does whenever the giver is read before it gives and the taker after it takes.
            first = {i: self._proc_bytes(i) for i in self.ids}
            again = {i: self._proc_bytes(i) for i in reversed(self.ids)}
            proc = {i: min(first[i], again[i]) for i in self.ids}
            try:
                view = self.cluster.http.get(url).json()
                limits = {m["id"]: m["limit_bytes"] for m in view["instances"]}
            except Exception:  # noqa: BLE001 -- a missed device read is a gap, not a failure
                limits = {}
            self.samples.append({"t_s": t, "proc_bytes": proc, "limit_bytes": limits})

    def over_budget(self) -> list[dict[str, Any]]:
        return [s for s in self.samples if sum(s["proc_bytes"].values()) > self.budget]

    def share_reached_s(self, instance_id: str, since_s: float) -> float | None:
        """Seconds from ``since_s`` until the instance's limit was >= MOST of the budget."""
        for s in self.samples:
            limit = s["limit_bytes"].get(instance_id)
            if s["t_s"] >= since_s and limit is not None and limit >= MOST * self.budget:
                return round(float(s["t_s"]) - since_s, 3)
        return None


def _memfd_paths(pid: int, name: str) -> list[str]:
    """``/proc/<pid>/fd/<n>`` of the KV memfds open in the process tree of ``pid``, one
    descriptor per memfd (a memfd open twice is counted once)."""
    import psutil  # type: ignore[import-untyped]

    out = []
    seen: set[tuple[int, int]] = set()
    root = psutil.Process(pid)
    for proc in [root, *root.children(True)]:
        fd_dir = Path(f"/proc/{proc.pid}/fd")
        try:
            entries = list(fd_dir.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                if not os.readlink(entry).startswith(f"/memfd:{name}"):
                    continue
                st = os.stat(entry)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                out.append(str(entry))
    return out


def _load(
    cluster: Cluster,
    ids: list[str],
    per_engine: int,
    words: int,
    seed: int,
    watch: _Watch | None,
    output_tokens: int = 48,
) -> dict[str, Any]:
    """A->B->C: each engine's burst starts when 3/4 of the previous one is answered."""
    latencies: list[float] = []
    failures: list[str] = []
    started: dict[str, float] = {}
    lock = threading.Lock()
    answered = dict.fromkeys(ids, 0)
    half_done = {i: threading.Event() for i in ids}

    def one(instance_id: str, prompt: str) -> None:
        t = time.monotonic()
        try:
            cluster.complete(instance_id, prompt, max_tokens=output_tokens)
        except Exception as exc:  # noqa: BLE001 -- counted: the check fails
            with lock:
                failures.append(f"{instance_id}: {exc}"[:200])
        with lock:
            latencies.append(time.monotonic() - t)
            answered[instance_id] += 1
            if 4 * answered[instance_id] >= 3 * per_engine:
                half_done[instance_id].set()

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=per_engine * 2) as pool:
        futures = []
        for n, instance_id in enumerate(ids):
            started[instance_id] = round(time.monotonic() - (watch.t0 if watch else t0), 3)
            prompts = [
                f"{instance_id} {make_document(words, seed=seed + 100 * n + k)}"
                for k in range(per_engine)
            ]
            futures += [pool.submit(one, instance_id, p) for p in prompts]
            half_done[instance_id].wait(300)
        for f in futures:
            f.result()
    total = time.monotonic() - t0
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
    return {
        "completion_s": round(total, 2),
        "p99_latency_s": round(p99, 3),
        "requests": len(latencies),
        "failures": failures,
        "load_started_s": started,
    }


def autopilot_vs_static(
    cluster: Cluster,
    ids: list[str],
    budget: int,
    *,
    per_engine: int,
    words: int,
    output_tokens: int = 48,
) -> dict[str, Any]:
    """Both runs on the same engines; returns figures and checks."""
    http = cluster.http
    base = cluster.sidecar_url
    # 1. the static equal split: three operator limits (no budget yet)
    for i in ids:
        cluster.put_limit(i, budget // len(ids) // MiB * MiB, wait_s=20)
    static_watch = _Watch(cluster, ids, budget)
    static_watch.start()
    try:
        static = _load(
            cluster,
            ids,
            per_engine,
            words,
            seed=7000,
            watch=static_watch,
            output_tokens=output_tokens,
        )
    finally:
        static_watch.stop()
    for i in ids:  # the same starting point for the second run: empty caches
        cluster.reset_prefix_cache(i)
    # 2. the autopilot: a budget on the device, the pins handed back
    r = http.put(f"{base}/devices/{DEVICE}/budget", json={"budget": budget})
    if r.status_code != 200:
        raise RuntimeError(f"PUT budget: {r.status_code} {r.text}")
    for i in ids:
        r = http.delete(f"{base}/instances/{i}/limit")
        if r.status_code != 200:
            raise RuntimeError(f"DELETE limit {i}: {r.status_code} {r.text}")
    time.sleep(2.0)  # the idle split settles
    watch = _Watch(cluster, ids, budget)
    watch.start()
    try:
        auto = _load(
            cluster, ids, per_engine, words, seed=7000, watch=watch, output_tokens=output_tokens
        )
    finally:
        watch.stop()
    reached = {i: watch.share_reached_s(i, auto["load_started_s"][i]) for i in ids}
    over = watch.over_budget()
    peak = max((sum(s["proc_bytes"].values()) for s in watch.samples), default=0)
    device = http.get(f"{base}/devices/{DEVICE}").json()
    checks = [
        _check(
            "every request succeeded (static split and autopilot)",
            not static["failures"] and not auto["failures"],
            f"static {static['requests']} requests, {len(static['failures'])} failed; "
            f"autopilot {auto['requests']}, {len(auto['failures'])} failed",
        ),
        _check(
            "autopilot: /proc sum of the three engines <= budget at every 50 ms sample",
            not over and len(watch.samples) > 0,
            f"{len(watch.samples)} samples, peak {peak / MiB:.2f} MiB of "
            f"{budget / MiB:.2f} MiB, {len(over)} over",
        ),
        _check(
            f"the busy engine holds >= {MOST:.0%} of the budget within {SHARE_WITHIN_S:g}s "
            "of its load starting",
            all(v is not None and v <= SHARE_WITHIN_S for v in reached.values()),
            f"seconds: {reached}",
        ),
    ]
    return {
        "budget_mib": round(budget / MiB, 3),
        "engines": {i: cluster.kinds[i] for i in ids},
        "per_engine_requests": per_engine,
        "static_split": {k: v for k, v in static.items() if k != "failures"},
        "autopilot": {k: v for k, v in auto.items() if k != "failures"},
        "share_reached_s": reached,
        "share_within_s": SHARE_WITHIN_S,
        "peak_proc_mib": round(peak / MiB, 3),
        "speedup_completion": round(static["completion_s"] / max(auto["completion_s"], 1e-9), 2),
        "device_at_end": device,
        "proc_samples": watch.samples,
        "checks": checks,
    }


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}
