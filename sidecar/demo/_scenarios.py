"""The demo's two scenarios, as plain functions over a :class:`Cluster`.

1. *Limit table*: the reference A10 tables (vLLM, and SGLang's seed row)
   reproduced on CPU, once per engine. Two engines of the same kind get the
   same workload; one has reclamation disabled (what a user of the old tool
   saw), one enabled. Each row lowers the limit over REST, waits idle, reads
   the mapped bytes (engine report and ``/proc``), runs a burst of traffic,
   reads them again.
2. *Elastic colocation*: a vLLM engine (A) and an SGLang engine (B) share one
   budget. A fills, A's prefix cache is reset and its memory released, B
   grows past what was free at A's peak, then both run contended loads;
   every request succeeds and probe prompts give the same tokens before and
   after.

Every figure lands in the returned dict; checks are ``{"name", "ok", "detail"}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine_ext.cpu_harness import make_document

from ._cluster import Cluster
from ._sampler import Sampler

__all__ = ["DemoConfig", "elastic_colocation", "limit_table"]

MiB = 1 << 20


class DemoConfig:
    """Sizes and pacing of the demo (defaults fit 2 cores in a few minutes)."""

    def __init__(self, *, idle_s: float = 10.0, quick: bool = False) -> None:
        self.idle_s = idle_s
        self.doc_words = 1300  # the shared long document
        self.num_questions = 4
        self.num_distinct = 6 if not quick else 3
        self.distinct_words = 400
        self.traffic_requests = 24 if not quick else 12
        self.traffic_words = 60
        self.row_fractions = (0.5, 0.25)  # limits as fractions of the filled mapped bytes
        self.budget_bytes = 6 * MiB  # scenario 2: the one "GPU" both engines share


def _prompts(prefix: str, num: int, words: int, seed: int) -> list[str]:
    return [f"{prefix} {make_document(words, seed=seed + i)}" for i in range(num)]


def _run_all(cluster: Cluster, instance_id: str, prompts: list[str], workers: int = 8) -> list[Any]:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: cluster.complete(instance_id, p), prompts))


def _fill(cluster: Cluster, instance_id: str, cfg: DemoConfig, seed: int) -> None:
    doc = make_document(cfg.doc_words, seed=1)
    questions = [
        f"{doc} question {i} {make_document(12, seed=100 + i)}" for i in range(cfg.num_questions)
    ]
    for q in questions[:1]:  # first alone: the others then hit its cached prefix
        cluster.complete(instance_id, q)
    _run_all(cluster, instance_id, questions[1:])
    _run_all(cluster, instance_id, _prompts("distinct", cfg.num_distinct, cfg.distinct_words, seed))


def _wait_until(pred: Callable[[], bool], timeout_s: float, period_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(period_s)
    return pred()


def _reported_mapped(cluster: Cluster, instance_id: str) -> int:
    """The engine's mapped bytes through the sidecar once its reports show ``/proc``'s
    figure (within a page bundle). Reports of figures alone are paced
    (``KVSIDECAR_REPORT_INTERVAL_S``): right after traffic the sidecar may still show a
    figure from before the engine's last page maps."""
    view = cluster.instance(instance_id)
    bundle = max(int(view["observed"]["page_bundle_bytes"]), 1)
    _wait_until(
        lambda: (
            abs(cluster.instance(instance_id)["mapped_bytes"] - cluster.proc_bytes(instance_id))
            <= bundle
        ),
        timeout_s=30,
    )
    return int(cluster.instance(instance_id)["mapped_bytes"])


def _mib(num_bytes: int) -> float:
    return round(num_bytes / MiB, 3)


def limit_table(
    cluster: Cluster, sampler: Sampler, without: str, with_: str, cfg: DemoConfig, t0: float
) -> dict[str, Any]:
    """Scenario 1 for one engine kind. ``without``/``with_`` are the instance ids (reclaim
    off/on, same engine). Mapped bytes are read twice: the engine's report through the
    sidecar and ``/proc`` (the KV memfd's allocated blocks); the checks use ``/proc``."""
    ids = (without, with_)
    engine = cluster.kinds[with_]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda i: _fill(cluster, i, cfg, seed=1000), ids))
    bundle = max(int(cluster.instance(with_)["observed"]["page_bundle_bytes"]), 1)
    # The limits are fractions of what the fill mapped: read it once the engines' reports
    # through the sidecar show it. Read at once, a report still in flight gave the
    # pre-fill figure, a one-bundle limit, and traffic that then waited for memory until
    # the client timed out.
    filled = {i: _reported_mapped(cluster, i) for i in ids}
    base = min(filled.values())
    rows: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    for n, frac in enumerate(cfg.row_fractions):
        limit = max(bundle, int(base * frac) // bundle * bundle)
        put = {i: cluster.put_limit(i, limit) for i in ids}
        # after both PUTs returned: an earlier sample still shows the previous limit's status
        since = time.monotonic() - t0
        time.sleep(cfg.idle_s)
        idle = {i: cluster.instance(i) for i in ids}
        idle_proc = {i: cluster.proc_bytes(i) for i in ids}
        traffic = _prompts(
            f"burst{n}", cfg.traffic_requests, cfg.traffic_words, seed=5000 + 100 * n
        )
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda i, t=traffic: _run_all(cluster, i, t), ids))
        _wait_until(lambda: cluster.instance(with_)["status"] == "applied", timeout_s=10)
        time.sleep(1.0)
        after = {i: cluster.instance(i) for i in ids}
        after_proc = {i: cluster.proc_bytes(i) for i in ids}
        # the PUT's own answer is the first step (the engine may apply within one sample)
        timelines[f"{engine}-row{n}"] = {
            i: _dedupe(
                [
                    {
                        "t_s": 0.0,
                        "status": put[i]["status"],
                        "reason": put[i].get("reason"),
                        "mapped_mib": _mib(put[i]["mapped_bytes"]),
                    },
                    *sampler.transitions(i, since),
                ]
            )
            for i in ids
        }
        rows.append(
            {
                "engine": engine,
                "without_id": without,
                "with_id": with_,
                "limit_bytes": limit,
                "limit_mib": _mib(limit),
                "put_status": {i: put[i]["status"] for i in ids},
                # the engines' reports (through the sidecar)
                "without_idle_mib": _mib(idle[without]["mapped_bytes"]),
                "with_idle_mib": _mib(idle[with_]["mapped_bytes"]),
                "without_after_traffic_mib": _mib(after[without]["mapped_bytes"]),
                "with_after_traffic_mib": _mib(after[with_]["mapped_bytes"]),
                # measured: the KV memfd's allocated blocks in /proc
                "without_idle_proc_mib": _mib(idle_proc[without]),
                "with_idle_proc_mib": _mib(idle_proc[with_]),
                "without_after_traffic_proc_mib": _mib(after_proc[without]),
                "with_after_traffic_proc_mib": _mib(after_proc[with_]),
                "with_idle_status": idle[with_]["status"],
                "with_after_traffic_status": after[with_]["status"],
                "without_idle_status": idle[without]["status"],
                "without_after_traffic_status": after[without]["status"],
            }
        )
    checks = []
    for r in rows:
        lim = r["limit_mib"]
        checks += [
            _check(
                f"{engine} with reclaim, idle, limit {lim} MiB: /proc <= limit and applied",
                r["with_idle_proc_mib"] <= lim and r["with_idle_status"] == "applied",
                f"{r['with_idle_proc_mib']} MiB, {r['with_idle_status']}",
            ),
            _check(
                f"{engine} with reclaim, after traffic, limit {lim} MiB: /proc <= limit",
                r["with_after_traffic_proc_mib"] <= lim,
                f"{r['with_after_traffic_proc_mib']} MiB",
            ),
            _check(
                f"{engine} without reclaim, idle, limit {lim} MiB: /proc stays > limit",
                r["without_idle_proc_mib"] > lim,
                f"{r['without_idle_proc_mib']} MiB",
            ),
        ]
    return {
        "engine": engine,
        "filled_mib": {i: _mib(b) for i, b in filled.items()},
        "page_bundle_bytes": bundle,
        "rows": rows,
        "status_timelines": timelines,
        "checks": checks,
    }


def elastic_colocation(cluster: Cluster, a: str, b: str, cfg: DemoConfig) -> dict[str, Any]:
    """Scenario 2 on two reclaiming engines sharing ``cfg.budget_bytes``; ``a`` must be one
    whose prefix cache can be reset while idle (either engine kind can)."""
    budget = cfg.budget_bytes
    probes = _prompts("probe", 2, 40, seed=9000)
    before = {i: [cluster.complete(i, p)["choices"][0]["text"] for p in probes] for i in (a, b)}
    for i in (a, b):  # raise both to the budget and wait until the engines hold it
        cluster.put_limit(i, budget, wait_s=10)
    _run_all(cluster, a, _prompts("a-fill", 10, 300, seed=2000))
    peak_a = _reported_mapped(cluster, a)
    free_at_peak = budget - peak_a
    cluster.reset_prefix_cache(a)
    released = _wait_until(lambda: cluster.instance(a)["mapped_bytes"] < peak_a // 4, 10)
    a_after_reset = int(cluster.instance(a)["mapped_bytes"])
    cluster.put_limit(b, budget - a_after_reset, wait_s=10)
    _run_all(cluster, b, _prompts("b-fill", 14, 300, seed=3000))
    peak_b = _reported_mapped(cluster, b)
    half = budget // 2
    for i in (a, b):
        cluster.put_limit(i, half)
    failures: list[str] = []

    def load(i: str) -> int:
        done = 0
        for reply in _run_all(cluster, i, _prompts(f"{i}-load", 16, 60, seed=4000), workers=4):
            done += 1 if reply["choices"][0]["text"] is not None else 0
        return done

    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            completed = dict(zip((a, b), pool.map(load, (a, b)), strict=True))
        except RuntimeError as exc:  # a failed request: record it, the check fails
            failures.append(str(exc))
            completed = {a: 0, b: 0}
    settled = _wait_until(
        lambda: all(cluster.instance(i)["status"] == "applied" for i in (a, b)), 20
    )
    end_mapped = {i: int(cluster.instance(i)["mapped_bytes"]) for i in (a, b)}
    end_proc = {i: cluster.proc_bytes(i) for i in (a, b)}
    after = {i: [cluster.complete(i, p)["choices"][0]["text"] for p in probes] for i in (a, b)}
    checks = [
        _check(
            "A's memory released after its prefix cache was reset",
            released,
            f"peak {_mib(peak_a)} MiB -> {_mib(a_after_reset)} MiB",
        ),
        _check(
            "B grew past what was free at A's peak",
            peak_b > free_at_peak,
            f"B peak {_mib(peak_b)} MiB > {_mib(free_at_peak)} MiB free at A's peak",
        ),
        _check(
            "every contended request succeeded",
            not failures and min(completed.values()) == 16,
            f"completed {completed}; failures {failures[:1]}",
        ),
        _check(
            "both engines applied, together within the budget (/proc)",
            settled and sum(end_proc.values()) <= budget,
            f"{ {i: _mib(v) for i, v in end_proc.items()} } of {_mib(budget)} MiB",
        ),
        _check(
            "probe prompts give identical tokens before and after",
            before == after,
            "identical" if before == after else f"before {before} after {after}",
        ),
    ]
    return {
        "budget_mib": _mib(budget),
        "peak_a_mib": _mib(peak_a),
        "free_at_a_peak_mib": _mib(free_at_peak),
        "a_after_reset_mib": _mib(a_after_reset),
        "peak_b_mib": _mib(peak_b),
        "engines": {i: cluster.kinds[i] for i in (a, b)},
        "end_mapped_mib": {i: _mib(v) for i, v in end_mapped.items()},
        "end_proc_mib": {i: _mib(v) for i, v in end_proc.items()},
        "completed": completed,
        "probes_identical": before == after,
        "checks": checks,
    }


def _dedupe(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop a step whose status repeats the previous one."""
    out: list[dict[str, Any]] = []
    for step in steps:
        if not out or out[-1]["status"] != step["status"]:
            out.append(step)
    return out


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}
