"""Where the scheduler step's wall clock goes: a sampling profile inside the timed calls.

Callgrind counts instructions; the wall clock also pays for cache misses, kernel
time (page commits) and whatever else runs slower on one side. This puts the
samples of a ``perf record`` taken with ``--clockid monotonic`` into the windows
``bench_vllm.py --windows`` wrote (each side's ``schedule()`` and
``update_from_output()`` calls), and prints, per shared object and per symbol,
how many more samples the elastic side's windows got than native's, as a share
of native's. Run (perf needs no hardware counters here: ``cpu-clock`` is a
software event)::

    perf record -e cpu-clock -F 1000 --clockid monotonic -o steps.data -- \\
        python bench/bench_vllm.py --step-only --no-step-control --rounds 40 \\
        --windows windows.json
    python bench/attribute_samples.py windows.json steps.data

Both sides run in one process, one step each in turn, so a sample belongs to
the side whose window holds its timestamp. The figures are sums over all the
windows, like the bench's "of totals", not medians: picking the steps a median
is made of by their duration would be biased, since a sample's own interrupt
lengthens the step it lands in. The window-time ratio is printed next to the
sample ratio as a check that the two clocks agree.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

SIDES = ("native", "elastic")


@dataclass
class Windows:
    """Both sides' timed calls, sorted by start, with the side of each."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    sides: list[str] = field(default_factory=list)
    window_ns: dict[str, int] = field(default_factory=dict)  # window time per side
    calls: int = 0  # timed calls per side

    def side_at(self, t_ns: int) -> str | None:
        i = bisect.bisect_right(self.starts, t_ns) - 1
        if i >= 0 and t_ns <= self.ends[i]:
            return self.sides[i]
        return None


def load_windows(path: Path) -> Windows:
    """Both sides' timed calls in ``path`` (``bench_vllm.py --windows``)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(
            f"{path}: not a windows file ({exc}); write one with bench_vllm.py --windows"
        )
    missing = [side for side in SIDES if side not in raw]
    if missing:
        raise SystemExit(
            f"{path}: no windows for {missing}; write them with bench_vllm.py --windows"
        )
    calls = {side: [(int(a), int(b)) for a, b in raw[side]] for side in SIDES}
    if len(calls["native"]) != len(calls["elastic"]):
        raise SystemExit(
            f"{path}: {len(calls['native'])} native and {len(calls['elastic'])} elastic calls: "
            "both sides must run the same steps"
        )
    rows = sorted((a, b, side) for side in SIDES for a, b in calls[side])
    for (_, end, _), (start, _, _) in itertools.pairwise(rows):
        if start < end:
            raise SystemExit(f"{path}: windows overlap at {start} ns: not one thread's lockstep")
    return Windows(
        starts=[a for a, _, _ in rows],
        ends=[b for _, b, _ in rows],
        sides=[side for _, _, side in rows],
        window_ns={side: sum(b - a for a, b in calls[side]) for side in SIDES},
        calls=len(calls["native"]),
    )


def perf_samples(data: Path) -> Iterator[tuple[int, str, str]]:
    """(time in ns, symbol, shared object) of each sample of a ``perf record`` file."""
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("perf is not installed: install linux-perf (or linux-tools) first")
    with subprocess.Popen(
        [perf, "script", "-i", str(data), "-F", "time,ip,sym,dso"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        yield from parse_perf_script(proc.stdout)
    if proc.returncode:
        raise SystemExit(f"perf script -i {data} failed (exit {proc.returncode})")


def parse_perf_script(lines: Iterable[str]) -> Iterator[tuple[int, str, str]]:
    """Lines of ``perf script -F time,ip,sym,dso``: ``SECONDS: IP SYMBOL (DSO)``."""
    for line in lines:
        head, sep, rest = line.strip().partition(": ")
        if not sep:
            continue
        try:
            t_ns = round(float(head) * 1e9)
        except ValueError:
            continue
        fields = rest.strip().split(None, 1)  # the ip, then "SYMBOL (DSO)"
        sym, _, dso = (fields[1] if len(fields) > 1 else "").rpartition(" (")
        yield t_ns, sym.strip() or "[unknown]", dso.rstrip(")").rsplit("/", 1)[-1]


@dataclass
class Attribution:
    by_dso: dict[str, Counter[str]]
    by_symbol: dict[str, Counter[str]]

    def total(self, side: str) -> int:
        return sum(self.by_dso[side].values())


def attribute(windows: Windows, samples: Iterable[tuple[int, str, str]]) -> Attribution:
    by_dso: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    by_symbol: dict[str, Counter[str]] = {side: Counter() for side in SIDES}
    for t_ns, sym, dso in samples:
        side = windows.side_at(t_ns)
        if side is None:
            continue
        by_dso[side][dso] += 1
        by_symbol[side][f"{sym}  ({dso})"] += 1
    return Attribution(by_dso, by_symbol)


def _table(counts: dict[str, Counter[str]], base: int, top: int) -> list[str]:
    keys = set(counts["native"]) | set(counts["elastic"])
    rows = sorted(keys, key=lambda k: counts["native"][k] - counts["elastic"][k])
    picked = rows[:top] + [k for k in rows[-max(1, top // 4) :] if k not in rows[:top]]
    out = [f"  {'native':>8} {'elastic':>8} {'diff':>8}  (diff: share of native's samples)"]
    for key in picked:
        n, e = counts["native"][key], counts["elastic"][key]
        out.append(f"  {n:8d} {e:8d} {100 * (e - n) / base:+7.2f}%  {key}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("windows", type=Path, help="bench_vllm.py --windows output")
    parser.add_argument("perf_data", type=Path, help="perf record -F N --clockid monotonic output")
    parser.add_argument("--top", type=int, default=25, help="symbols to list")
    args = parser.parse_args()
    windows = load_windows(args.windows)
    result = attribute(windows, perf_samples(args.perf_data))
    native, elastic = result.total("native"), result.total("elastic")
    if not native or not elastic:
        raise SystemExit(
            "no samples fell in the windows: record with --clockid monotonic, the same run"
        )
    print(
        f"timed calls {windows.calls} per side; window time elastic/native "
        f"{windows.window_ns['elastic'] / windows.window_ns['native']:.3f}; "
        f"samples native {native}, elastic {elastic} ({elastic / native:.3f})"
    )
    print("by shared object:")
    print("\n".join(_table(result.by_dso, native, 8)))
    print("by symbol:")
    print("\n".join(_table(result.by_symbol, native, args.top)))


if __name__ == "__main__":
    sys.exit(main())
