"""What reporting to a live sidecar costs a busy engine, in one run.

An in-process vLLM ``EngineCore`` (the CPU harness's stub executor, the elastic
pool and the plugin's patches) steps the same rounds of requests three ways,
in turn by round:

* ``none``: no sidecar (the coordinator has no reporter): the baseline;
* ``every``: a ``SidecarClient`` of a real sidecar (``kvsidecar serve`` in a
  subprocess, SQLite in a temporary directory) with ``report_interval_s=0``:
  every change of mapped bytes is a POST, as before the pacing;
* ``paced``: the same client with the default ``KVSIDECAR_REPORT_INTERVAL_S``:
  a change of figures alone at most once per interval, status changes at once.

Per mode: the wall-clock time of the engine steps (the client thread takes the
GIL from the busy loop; thread CPU time would not show it), this process's CPU
time, and the POSTs sent. Ratios are against ``none`` in the same run. Run:
``python bench/bench_reports.py [--rounds N] [--requests N] [--warm]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_vllm as steps  # first: it sets the CPU environment vLLM reads at import
import httpx
from _sidecar_process import SidecarProcess

from engine_ext import LimitMailbox, load_engine_settings
from engine_ext._sidecar_client import SidecarClient
from engine_ext.cpu_harness import make_tiny_model_dir
from engine_ext.protocol import RegisterBody
from engine_ext.vllm import _runtime

MODES = ("none", "every", "paced")


@dataclass
class Mode:
    """One way of reporting, and what its rounds measured."""

    name: str
    client: SidecarClient | None = None
    posts: int = 0
    wall_per_step: list[float] = field(default_factory=list)
    cpu_per_step: list[float] = field(default_factory=list)
    posts_per_s: list[float] = field(default_factory=list)


def _client(mode: Mode, url: str, interval: float | None, state: Any) -> SidecarClient:
    extra = {} if interval is None else {"report_interval_s": interval}
    settings = load_engine_settings(sidecar_url=url, **extra)
    client = SidecarClient(
        settings,
        LimitMailbox(),
        lambda: RegisterBody(engine="vllm", engine_version="0.33.0", state=state),
        instance_id=f"bench-{mode.name}",
    )
    if not client.register_blocking(10):
        raise RuntimeError("the sidecar did not take the registration")
    post = client._post

    def counted(path: str, content: str) -> httpx.Response | None:
        mode.posts += 1
        return post(path, content)

    client._post = counted  # type: ignore[method-assign]
    client.start()
    return client


def run(
    rounds: int, num_requests: int, warm: bool, interval: float | None = None
) -> dict[str, Mode]:
    modes = {name: Mode(name) for name in MODES}
    with tempfile.TemporaryDirectory(prefix="kvs-reports-") as scratch:
        model_dir = make_tiny_model_dir(Path(scratch) / "model")
        sidecar = SidecarProcess(keep_log=False)
        url = sidecar.url
        try:
            with steps.pool_class(True):
                kv = steps.WARM_KV_BYTES if warm else 64 << 20
                engine = steps._engine(True, model_dir, kv)
                runtime = _runtime.current_runtime()
                assert runtime is not None and runtime.instance is not None
                coordinator = runtime.instance.coordinator
                state = coordinator.state()
                modes["every"].client = _client(modes["every"], url, 0.0, state)
                modes["paced"].client = _client(modes["paced"], url, interval, state)
                try:
                    for round_no in range(rounds + 1):  # round 0 warms up, not kept
                        order = MODES[round_no % 3 :] + MODES[: round_no % 3]
                        for name in order:
                            mode = modes[name]
                            client = mode.client
                            coordinator.set_reporter(None if client is None else client.report)
                            _round(engine, mode, round_no, num_requests, warm, keep=round_no > 0)
                finally:
                    coordinator.set_reporter(None)
                    for mode in modes.values():
                        if mode.client is not None:
                            mode.client.stop()
                    engine.shutdown()
        finally:
            sidecar.stop()
    return modes


def _round(
    engine: Any, mode: Mode, round_no: int, num_requests: int, warm: bool, keep: bool
) -> None:
    if not warm:
        engine.reset_prefix_cache()
    for request in steps._step_requests(round_no, num_requests):
        engine.add_request(*engine.preprocess_add_request(request))
    posts = mode.posts
    count = 0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while engine.scheduler.has_requests():
        engine.step()
        count += 1
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    time.sleep(0.15)  # a paced client sends its last figures before the next mode's round
    if keep:
        mode.wall_per_step.append(wall / count)
        mode.cpu_per_step.append(cpu / count)
        mode.posts_per_s.append((mode.posts - posts) / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds per mode (default 9)")
    parser.add_argument("--requests", type=int, default=64, help="requests per round")
    parser.add_argument("--warm", action="store_true", help="bench_vllm's --warm trace")
    parser.add_argument(
        "--interval",
        type=float,
        default=None,
        help="the paced mode's report_interval_s (default: the setting's default)",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    modes = run(args.rounds, args.requests, args.warm, args.interval)
    base = modes["none"]
    wall0 = statistics.median(base.wall_per_step)
    cpu0 = statistics.median(base.cpu_per_step)
    print(f"engine step, medians over {args.rounds} rounds per mode (in turn by round)")
    print("mode    step ms  x none   CPU ms/step  x none   POSTs/s")
    for mode in modes.values():
        wall = statistics.median(mode.wall_per_step)
        cpu = statistics.median(mode.cpu_per_step)
        print(
            f"{mode.name:6s} {1000 * wall:8.3f} {wall / wall0:7.3f} {1000 * cpu:12.3f} "
            f"{cpu / cpu0:7.3f} {statistics.median(mode.posts_per_s):9.1f}"
        )


if __name__ == "__main__":
    main()
