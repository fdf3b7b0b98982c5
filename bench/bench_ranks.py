"""Rank channel cost: map/unmap of pages on 2 rank processes vs the bare HostBackend.

    python bench/bench_ranks.py [--rounds 5] [--ops 200] [--no-strace]     # ~1 min quiet, 3 loaded

One *op* is ``map_many(pages)`` + ``unmap_many(pages)`` (+ one barrier
``settle`` on the ranked side, which waits for every rank's unmap ack and
gives the memory back), with 1 and with 8 pages per call, on 64 KiB pages x
8 regions. The bare side is the single-process ``HostBackend`` that
``RankedBackend`` wraps; the ranked side runs 2 real rank processes
(``python -m engine_ext.ranks``), each acking over its unix socket. Also one
empty ``step`` round trip (what every engine step costs on top of its work).

Three figures per op, each the median over ``--rounds`` alternating rounds:

* **wall** µs: what the engine thread waits. On a shared machine this mostly
  measures other people's load, so the 1-minute load average is printed with
  every round.
* **CPU** µs: on-CPU time of *every* thread of the engine process and of both
  rank processes (``/proc/<pid>/task/<tid>/schedstat``, nanoseconds), so
  other people's load hardly moves it; and context switches per op
  (voluntary + involuntary, same tasks).
* **syscalls** per op (``strace -f -c``, every process): the same loop run
  twice in a child process with ``N`` and ``3N`` ops; the difference over
  ``2N`` cancels start-up and shutdown. Skipped with ``--no-strace`` or when
  ``strace`` is missing.

Not a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if not any(Path(p, "engine_ext").is_dir() for p in sys.path if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator import HostBackend, PageLayout
from engine_ext.ranks import RankedBackend, RankGroup

LAYOUT = PageLayout(page_bytes=64 << 10, num_pages=64, num_regions=8)
PAGE_SETS = {1: [5], 8: list(range(8, 16))}


@dataclass(frozen=True, slots=True)
class Sample:
    wall_us: float
    cpu_us: float
    switches: float
    load: float


def _tasks(pid: int) -> list[str]:
    try:
        return [f"/proc/{pid}/task/{tid}" for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _cpu_and_switches(pids: list[int]) -> tuple[int, int]:
    """Summed on-CPU nanoseconds and context switches of every thread of ``pids``."""
    cpu = switches = 0
    for pid in pids:
        for task in _tasks(pid):
            try:
                with open(f"{task}/schedstat", encoding="ascii") as f:
                    cpu += int(f.read().split()[0])
                with open(f"{task}/status", encoding="ascii") as f:
                    for line in f:
                        if "ctxt_switches:" in line:  # voluntary_ and nonvoluntary_
                            switches += int(line.split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    return cpu, switches


@contextmanager
def _meter(pids: list[int], ops: int, out: list[Sample]) -> Iterator[None]:
    cpu0, sw0 = _cpu_and_switches(pids)
    start = time.perf_counter()
    yield
    wall = time.perf_counter() - start
    cpu1, sw1 = _cpu_and_switches(pids)
    out.append(
        Sample(
            wall_us=wall / ops * 1e6,
            cpu_us=(cpu1 - cpu0) / ops / 1e3,
            switches=(sw1 - sw0) / ops,
            load=os.getloadavg()[0],
        )
    )


def _ops(backend: HostBackend | RankedBackend, pages: list[int], ops: int) -> None:
    if isinstance(backend, RankedBackend):
        for _ in range(ops):
            backend.map_many(pages)
            backend.unmap_many(pages)
            backend.settle(5.0)
    else:
        for _ in range(ops):
            backend.map_many(pages)
            backend.unmap_many(pages)


@contextmanager
def _setup() -> Iterator[tuple[HostBackend, RankedBackend, RankGroup]]:
    bare = HostBackend.reserve(LAYOUT, name="kvs-bench-bare")
    owner = HostBackend.reserve(LAYOUT, name="kvs-bench-ranked")
    with tempfile.TemporaryDirectory() as tmp:
        group = RankGroup.spawn(str(Path(tmp) / "r.sock"), 2)
    try:
        backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=4096, slot_bytes=256)
    except BaseException:
        group.close()
        owner.release()
        bare.release()
        raise
    try:
        yield bare, backend, group
    finally:
        backend.release()
        bare.release()


def _cycle_only(side: str, count: int, ops: int) -> None:
    """The loop alone (the child that ``strace`` counts)."""
    with _setup() as (bare, backend, group):
        if side == "step":
            for _ in range(ops):
                group.run_step({"blocks": [], "offsets": [], "values": []}, timeout_s=5)
        else:
            _ops(bare if side == "bare" else backend, PAGE_SETS[count], ops)


def _syscalls(side: str, count: int, ops: int) -> tuple[float, dict[str, float]]:
    """Syscalls per op of every process (``strace -f -c``), start-up cancelled out."""
    totals: list[dict[str, int]] = []
    for n in (ops, 3 * ops):
        with tempfile.NamedTemporaryFile(suffix=".strace") as out:
            cmd = ["strace", "-f", "-c", "-o", out.name, sys.executable, __file__]
            cmd += ["--cycle", side, str(count), str(n)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            totals.append(_parse_strace(Path(out.name).read_text()))
    per = {
        name: (totals[1].get(name, 0) - totals[0].get(name, 0)) / (2 * ops)
        for name in set(totals[0]) | set(totals[1])
    }
    per = {name: value for name, value in per.items() if value >= 0.5}
    return sum(per.values()), per


def _parse_strace(text: str) -> dict[str, int]:
    calls: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 5 or not parts[0][0].isdigit() or parts[-1] == "total":
            continue
        calls[parts[-1]] = int(parts[3])
    return calls


def _median(samples: list[Sample]) -> Sample:
    return Sample(
        wall_us=statistics.median(s.wall_us for s in samples),
        cpu_us=statistics.median(s.cpu_us for s in samples),
        switches=statistics.median(s.switches for s in samples),
        load=statistics.median(s.load for s in samples),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median)")
    parser.add_argument("--ops", type=int, default=200, help="ops per side per round")
    parser.add_argument("--no-strace", action="store_true", help="skip the syscall counts")
    parser.add_argument("--cycle", nargs=3, metavar=("SIDE", "PAGES", "OPS"), help="(internal)")
    args = parser.parse_args()
    if args.cycle:
        side, count, ops = args.cycle
        _cycle_only(side, int(count), int(ops))
        return
    samples: dict[tuple[str, int], list[Sample]] = {}
    with _setup() as (bare, backend, group):
        pids = [os.getpid(), *group.pids]
        _ops(bare, PAGE_SETS[1], 20)  # warm both paths
        _ops(backend, PAGE_SETS[1], 20)
        for round_no in range(args.rounds):
            for count, pages in PAGE_SETS.items():
                for side, target in (("bare", bare), ("ranked", backend)):
                    with _meter(pids, args.ops, samples.setdefault((side, count), [])):
                        _ops(target, pages, args.ops)
            with _meter(pids, args.ops, samples.setdefault(("step", 0), [])):
                for _ in range(args.ops):
                    group.run_step({"blocks": [], "offsets": [], "values": []}, timeout_s=5)
            print(
                f"round {round_no + 1}: load {os.getloadavg()[0]:.1f}; 1 page "
                + " / ".join(
                    f"{side} {samples[(side, 1)][-1].wall_us:.0f} µs wall, "
                    f"{samples[(side, 1)][-1].cpu_us:.0f} µs CPU"
                    for side in ("bare", "ranked")
                ),
                flush=True,
            )
    counted = not args.no_strace and shutil.which("strace") is not None
    syscalls: dict[tuple[str, int], tuple[float, dict[str, float]]] = {}
    if counted:
        for count in PAGE_SETS:
            for side in ("bare", "ranked"):
                syscalls[(side, count)] = _syscalls(side, count, 100)
        syscalls[("step", 0)] = _syscalls("step", 0, 100)

    def calls(key: tuple[str, int]) -> str:
        return f"{syscalls[key][0]:.0f}" if key in syscalls else "n/a"

    print(
        f"\nmedians of {args.rounds} alternating rounds x {args.ops} ops; "
        "CPU = engine process (all threads) + both rank processes\n"
    )
    print(
        "| pages per call | side | wall µs | × bare | CPU µs | × bare | switches | syscalls "
        "| load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for count in PAGE_SETS:
        base = _median(samples[("bare", count)])
        for side in ("bare", "ranked"):
            m = _median(samples[(side, count)])
            print(
                f"| {count} | {side} | {m.wall_us:.0f} | {m.wall_us / base.wall_us:.2f} "
                f"| {m.cpu_us:.0f} | {m.cpu_us / base.cpu_us:.2f} | {m.switches:.1f} "
                f"| {calls((side, count))} | {m.load:.1f} |"
            )
    step = _median(samples[("step", 0)])
    print(
        f"\nempty step round trip on 2 ranks: {step.wall_us:.0f} µs wall, {step.cpu_us:.0f} µs CPU, "
        f"{step.switches:.1f} switches, {calls(('step', 0))} syscalls (load {step.load:.1f})"
    )
    if counted:
        print("\nsyscalls per op by name (every process):")
        for key, (_, per) in syscalls.items():
            names = ", ".join(f"{n} {v:.1f}" for n, v in sorted(per.items(), key=lambda x: -x[1]))
            print(f"  {key[0]} {key[1]}: {names}")


if __name__ == "__main__":
    main()
