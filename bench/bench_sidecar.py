"""Sidecar: ``PUT /instances/{id}/limit`` throughput and p99 vs a bare FastAPI endpoint.

Run: ``python bench/bench_sidecar.py [--requests 3000] [--concurrency 16]`` (CPU;
about half a minute).

Both servers run as their own process under uvicorn with the same options:

* **sidecar**: ``kvsidecar serve`` on a fresh SQLite file (WAL, ``synchronous=FULL``:
  every 200 has been committed to disk), the full app (body cap, validation,
  revisions, problem handlers);
* **bare**: a FastAPI app with one ``PUT`` route that validates the same
  :class:`LimitBody` and returns a small dict: no database, no middleware.

The load comes from a third process (``--load``): an ``httpx.AsyncClient`` with
``--concurrency`` keep-alive connections, spreading the PUTs over 8 instance
ids. Each target is measured twice, interleaved; the better run counts.
Goals: sidecar throughput >= 0.7x bare, sidecar p99 <= 2x bare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Module level: FastAPI resolves the bare route's annotations from these globals.
from engine_ext.cpu_harness import free_port
from engine_ext.protocol import LimitBody

NUM_IDS = 8


def _bare_app() -> object:
    from fastapi import FastAPI

    app = FastAPI()

    @app.put("/instances/{instance_id}/limit")
    async def put_limit(instance_id: str, body: LimitBody) -> dict[str, object]:
        return {"id": instance_id, "limit_bytes": body.limit, "revision": body.revision or 1}

    return app


def _serve_bare(port: int) -> None:
    import uvicorn

    uvicorn.run(
        _bare_app(),
        host="127.0.0.1",
        port=port,
        log_level="warning",  # type: ignore[arg-type]
        access_log=False,
    )


async def _load(url: str, num_requests: int, concurrency: int) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    counter = iter(range(num_requests))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in counter:
            body = {"limit": f"{(i % 64) + 1}G"}
            start = time.perf_counter()
            r = await client.put(f"/instances/bench-{i % NUM_IDS}/limit", json=body)
            latencies.append(time.perf_counter() - start)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:200]}")

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        for _ in range(50):  # warm-up: connections, first-request imports
            await client.put("/instances/warm/limit", json={"limit": "1G"})
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "rps": num_requests / elapsed,
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[int(len(latencies) * 0.99) - 1],
    }


def _wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server for {url} exited with {proc.returncode}")
        try:
            httpx.get(f"{url}/openapi.json", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit(f"server for {url} did not start")


def _run_load(url: str, args: argparse.Namespace) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--load",
            url,
            "--requests",
            str(args.requests),
            "--concurrency",
            str(args.concurrency),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--load", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        _serve_bare(args.serve_bare)
        return
    if args.load:
        print(json.dumps(asyncio.run(_load(args.load, args.requests, args.concurrency))))
        return

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        ports = {"sidecar": free_port(), "bare": free_port()}
        cmds = {
            "sidecar": [
                sys.executable,
                "-m",
                "sidecar.cli",
                "serve",
                "--port",
                str(ports["sidecar"]),
                "--db",
                f"{tmp}/bench.db",
            ],
            "bare": [sys.executable, __file__, "--serve-bare", str(ports["bare"])],
        }
        procs = {
            name: subprocess.Popen(cmd, env={**env, "KVSIDECAR_LOG_LEVEL": "warning"}, cwd=ROOT)
            for name, cmd in cmds.items()
        }
        try:
            for name, proc in procs.items():
                _wait_up(f"http://127.0.0.1:{ports[name]}", proc)
            best: dict[str, dict[str, float]] = {}
            for _ in range(2):
                for name in ("bare", "sidecar"):
                    res = _run_load(f"http://127.0.0.1:{ports[name]}", args)
                    if name not in best or res["rps"] > best[name]["rps"]:
                        best[name] = res
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.wait(timeout=10)
    print(
        f"PUT /instances/{{id}}/limit, {args.requests} requests, "
        f"{args.concurrency} connections, load from a separate process"
    )
    for name, res in best.items():
        print(
            f"  {name:8s} {res['rps']:8.0f} req/s   p50 {res['p50_ms']:6.2f} ms   "
            f"p99 {res['p99_ms']:6.2f} ms"
        )
    rps = best["sidecar"]["rps"] / best["bare"]["rps"]
    p99 = best["sidecar"]["p99_ms"] / best["bare"]["p99_ms"]
    print(f"  ratio    throughput {rps:.2f}x (goal >= 0.7)   p99 {p99:.2f}x (goal <= 2)")


if __name__ == "__main__":
    main()
