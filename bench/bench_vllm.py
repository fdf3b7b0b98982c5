"""vLLM adapter overhead: elastic block pool and scheduler step vs native vLLM 0.33, in one run.

1. Block pool ops/s on one allocation trace (vLLM's own ``KVCacheManager``:
   prefix lookup, ``allocate_slots``, ``free``), native ``BlockPool`` vs
   ``ElasticBlockPool`` over a host reservation, the elastic pool both cold (it
   maps its pages during the trace) and pre-mapped (as native allocates its KV
   tensor before). Goal: ratio >= 0.95 (issue 17).
2. Scheduler step time: an in-process ``EngineCore`` with the CPU harness's stub
   executor, same requests, ``scheduler.schedule()`` + ``update_from_output``
   timed per engine step, without vs with the plugin. Goal: ratio <= 1.03 (issue 17).

Both run their sides in lockstep: the pool trace in pairs (native and one
elastic side, or native twice as an A/A control), ``--pool-chunk`` operations
of one, then of the other; the step one engine step of each in turn. Times
are this thread's CPU time (other processes on a shared machine do not count)
summed per side, with the garbage collector paused. The pool's headline is
the median of per-round ratios, the step's the best round over the best
round with the median next to it. Run:
``python bench/bench_vllm.py [--rounds N] [--pool-rounds N] [--pool-chunk N] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from allocator import HostBackend, PageLayout
from engine_ext import EngineSettings
from engine_ext.vllm import _runtime
from engine_ext.vllm._block_pool import ElasticBlockPool
from engine_ext.vllm._kv_memory import KVMemory, clear_kv_memory, publish_kv_memory
from engine_ext.vllm._settings import VllmSettings

BLOCK_TOKENS = 16
BLOCKS_PER_PAGE = 16
NUM_PAGES = 64  # 1024 blocks


_leave_off: set[str] = set()
_churn = False  # --churn: output lengths 1..48, so requests finish and start at most steps


def _patch_rows() -> list[tuple[Any, str, Callable[[Any, Any], Any]]]:
    """The plugin's per-step patches (docs/vllm.md) as (class, name, factory): safe
    points around schedule() and update_from_output(), the running/admission split,
    the preemption count."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from engine_ext.vllm._patches import (
        _allocate_slots,
        _preempt_request,
        _schedule,
        _update_from_output,
    )

    return [
        (Scheduler, "schedule", _schedule),
        (Scheduler, "update_from_output", _update_from_output),
        (Scheduler, "_preempt_request", _preempt_request),
        (KVCacheManager, "allocate_slots", _allocate_slots),
    ]


def _installed() -> list[tuple[Any, str, Any]]:
    """The patched attributes as the classes have them now (patched or not)."""
    return [(owner, name, owner.__dict__[name]) for owner, name, _ in _patch_rows()]


@contextmanager
def pool_class(elastic: bool, reserve_pages: int = 0) -> Iterator[None]:
    """Rebind the name KVCacheCoordinator builds its pool by (what the plugin does)."""
    rows = _patch_rows()
    original = kv_cache_coordinator.BlockPool
    saved = _installed()
    kv_cache_coordinator.BlockPool = ElasticBlockPool if elastic else BlockPool
    if elastic:
        for owner, name, factory in rows:
            if name in _leave_off:  # --leave-off (an experiment: what one patch costs)
                continue
            setattr(owner, name, factory(owner.__dict__[name], None))
    settings = EngineSettings(enable=True, reserve_pages=reserve_pages)
    _runtime.configure(settings, VllmSettings(enable=True))
    try:
        yield
    finally:
        kv_cache_coordinator.BlockPool = original
        for owner, name, method in saved:
            setattr(owner, name, method)
        clear_kv_memory()


def _scratch_dir() -> Path:
    """A temporary directory for this run (the tiny model), removed when the bench exits."""
    path = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
    atexit.register(shutil.rmtree, path, True)
    return path


# -- 1. block pool trace --------------------------------------------------------------
def _trace(num_requests: int) -> list[list[int]]:
    """Prompts: 8 shared documents (prefix hits) with distinct tails, 3-40 blocks each."""
    prompts = []
    for i in range(num_requests):
        doc = [(i % 8) * 100_000 + t for t in range(BLOCK_TOKENS * (2 + i % 8))]
        tail = [5_000_000 + i * 1000 + t for t in range(BLOCK_TOKENS * (1 + i % 32) + 5)]
        prompts.append(doc + tail)
    return prompts


def _manager(elastic: bool) -> tuple[KVCacheManager, HostBackend | None]:
    num_blocks = NUM_PAGES * BLOCKS_PER_PAGE
    backend = None
    if elastic:
        block_bytes = 4096
        layout = PageLayout(
            page_bytes=block_bytes * BLOCKS_PER_PAGE, num_pages=NUM_PAGES, num_regions=2
        )
        backend = HostBackend.reserve(layout, name="kvs-bench-vllm")
        publish_kv_memory(KVMemory(backend, layout, block_bytes, num_blocks))
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(
        config,
        max_model_len=8192,
        scheduler_block_size=BLOCK_TOKENS,
        hash_block_size=BLOCK_TOKENS,
        enable_caching=True,
    )
    return manager, backend


@dataclass(frozen=True)
class PoolTrace:
    """One pool trace: ops per CPU second, and the share of that time spent in page maps
    (0 unless measured)."""

    ops_per_s: float
    map_share: float


def _requests(prompts: list[list[int]]) -> list[Request]:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
    return [
        Request(f"r{i}", p, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        for i, p in enumerate(prompts)
    ]


def _trace_ops(manager: KVCacheManager, requests: list[Request], chunk: int) -> Iterator[int]:
    """The trace's operations; yields the number done after every ``chunk`` or more (and
    at the end). One op = prefix lookup + allocate_slots, or free (window of 24 live
    requests)."""
    live: list[Request] = []
    ops = 0
    for request in requests:
        hit, num_hit, _ = manager.get_computed_blocks(request)
        while manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit) is None:
            manager.free(live.pop(0))
            ops += 1
        ops += 1
        live.append(request)
        if len(live) > 24:
            manager.free(live.pop(0))
            ops += 1
        if ops >= chunk:
            yield ops
            ops = 0
    for request in live:
        manager.free(request)
        ops += 1
    yield ops


def _timed_maps(backend: HostBackend) -> list[float]:
    """Wrap ``backend.map`` to add this thread's CPU seconds inside it to the returned cell."""
    in_maps = [0.0]
    real_map = backend.map

    def timed_map(page: int) -> None:
        t0 = time.thread_time()
        try:
            real_map(page)
        finally:
            in_maps[0] += time.thread_time() - t0

    backend.map = timed_map  # type: ignore[method-assign]
    return in_maps


def run_pool_trace(
    elastic: bool,
    prompts: list[list[int]],
    *,
    premapped: bool = False,
    time_maps: bool = False,
) -> PoolTrace:
    """One trace on its own (see :func:`_trace_ops`).

    ``premapped``: the elastic pool maps every page before the clock starts
    (``KVSIDECAR_RESERVE_PAGES`` at the capacity), as native vLLM allocates its whole
    KV tensor at start-up; otherwise it maps (commits) its 64 pages during the trace.
    ``time_maps``: also measure this thread's CPU seconds inside the backend's page
    maps during the trace (the kernel committing memory, plus the call).
    """
    with pool_class(elastic, NUM_PAGES if premapped else 0):
        manager, backend = _manager(elastic)
        in_maps = _timed_maps(backend) if backend is not None and time_maps else [0.0]
        requests = _requests(prompts)
        gc.collect()
        gc.disable()  # collector pauses land on whichever side happens to trigger them
        start = time.thread_time()
        ops = sum(_trace_ops(manager, requests, sys.maxsize))
        elapsed = time.thread_time() - start
        gc.enable()
        if backend is not None:
            backend.release()
        return PoolTrace(ops / elapsed, in_maps[0] / elapsed)


@dataclass
class _PoolSide:
    """One side of a lockstep round: its trace in progress, and what must be in place
    while it runs (the classes' methods as the plugin patches them, or not; the runtime)."""

    kind: str
    ops_left: Iterator[int]
    methods: list[tuple[Any, str, Any]]
    runtime: Any
    backend: HostBackend | None
    in_maps: list[float]
    seconds: float = 0.0
    ops: int = 0
    done: bool = False


def _pool_side(kind: str, prompts: list[list[int]], chunk: int) -> _PoolSide:
    elastic = kind in ("cold", "premapped")
    with pool_class(elastic, NUM_PAGES if kind == "premapped" else 0):
        manager, backend = _manager(elastic)
        methods = _installed()
        in_maps = _timed_maps(backend) if backend is not None and kind == "cold" else [0.0]
        return _PoolSide(
            kind,
            _trace_ops(manager, _requests(prompts), chunk),
            methods,
            _runtime._runtime if elastic else None,
            backend,
            in_maps,
        )


def lockstep_pool_round(prompts: list[list[int]], kinds: list[str], chunk: int) -> PoolRound:
    """One round: the sides' traces run interleaved, ``chunk`` ops of one side, then of
    the next (the order turned by one every cycle), each side's CPU time summed over its
    chunks. Slow phases of a shared machine (another tenant, a frequency change) then
    fall on every side alike instead of on whichever trace ran at the time."""
    sides = [_pool_side(kind, prompts, chunk) for kind in kinds]
    cycle = 0
    gc.collect()
    gc.disable()  # collector pauses land on whichever side happens to trigger them
    try:
        while not all(side.done for side in sides):
            shift = cycle % len(sides)
            for side in sides[shift:] + sides[:shift]:
                if side.done:
                    continue
                for owner, name, method in side.methods:
                    setattr(owner, name, method)
                _runtime._runtime = side.runtime
                start = time.thread_time()
                ops = next(side.ops_left, None)
                side.seconds += time.thread_time() - start
                if ops is None:
                    side.done = True
                else:
                    side.ops += ops
            cycle += 1
    finally:
        gc.enable()
        for side in sides:
            if side.kind == "native":
                for owner, name, method in side.methods:
                    setattr(owner, name, method)
        _runtime._runtime = None
        for side in sides:
            if side.backend is not None:
                side.backend.release()
    return PoolRound(
        {side.kind: side.ops / side.seconds for side in sides},
        next((s.in_maps[0] / s.seconds for s in sides if s.kind == "cold"), 0.0),
    )


@dataclass(frozen=True)
class PoolRound:
    """One lockstep round: ops per CPU second of each side; the cold side's share in maps."""

    ops_per_s: dict[str, float]
    map_share: float


@dataclass
class PoolRounds:
    """Ops/s per round of each side, the native side each was compared with (its own
    lockstep partner, or the round's one native trace), and the share of the cold
    elastic trace's CPU time spent in page maps."""

    control: list[float] = field(default_factory=list)  # native again: the A/A noise floor
    cold: list[float] = field(default_factory=list)
    premapped: list[float] = field(default_factory=list)
    native: dict[str, list[float]] = field(
        default_factory=lambda: {"control": [], "cold": [], "premapped": []}
    )
    map_share: list[float] = field(default_factory=list)
    paired: bool = False  # lockstep rounds, built in turned order: two make a measurement

    def ratio(self, kind: str) -> tuple[float, float]:
        """(best round over best round, median of the per-pair ratios) of ``kind``
        against its native side."""
        elastic, native = getattr(self, kind), self.native[kind]
        return max(elastic) / max(native), statistics.median(self.per_pair(kind))

    def per_round(self, kind: str) -> list[float]:
        return [e / n for e, n in zip(getattr(self, kind), self.native[kind])]

    def per_pair(self, kind: str) -> list[float]:
        """The mean ratio of each two consecutive rounds (a lockstep pair is built in
        one order, then in the other: the order moves a ratio by up to 4 points on this
        machine, so one round of each makes a measurement); per round if only one."""
        rounds = self.per_round(kind)
        if not self.paired or len(rounds) < 2:
            return rounds
        return [(rounds[i] + rounds[i + 1]) / 2 for i in range(0, len(rounds) - 1, 2)]


def pool_rounds(prompts: list[list[int]], rounds: int, chunk: int = 0) -> PoolRounds:
    """``rounds`` rounds of the trace on native, native again as an A/A control, the
    cold elastic pool and the pre-mapped one. The control's ratio to native is what
    identical code measures on this machine: the noise floor of the other ratios.

    ``chunk`` > 0: each of the three runs in lockstep with a native trace of its own,
    ``chunk`` ops at a time (:func:`lockstep_pool_round`). In pairs, because vLLM's
    call sites specialise on the pool's class: a side that runs after a side of the
    other class pays for re-specialising, so with more than two sides in turn the
    order would favour some. 0: one whole trace after the other, one native trace per
    round, the order turned by one each round so that no side always runs first.
    """
    out = PoolRounds(paired=chunk > 0)
    kinds = ["control", "cold", "premapped"]
    for round_no in range(rounds):
        if chunk > 0:
            shift = round_no % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                pair = ["native", kind] if round_no % 2 == 0 else [kind, "native"]
                one = lockstep_pool_round(prompts, pair, chunk)  # (built in turned order)
                getattr(out, kind).append(one.ops_per_s[kind])
                out.native[kind].append(one.ops_per_s["native"])
                if kind == "cold":
                    out.map_share.append(one.map_share)
            continue
        shift = round_no % (len(kinds) + 1)
        order = ["native", *kinds]
        for kind in order[shift:] + order[:shift]:
            if kind == "native":
                native = run_pool_trace(False, prompts).ops_per_s
                for each in kinds:
                    out.native[each].append(native)
            elif kind == "control":
                out.control.append(run_pool_trace(False, prompts).ops_per_s)
            elif kind == "premapped":
                out.premapped.append(run_pool_trace(True, prompts, premapped=True).ops_per_s)
            else:
                trace = run_pool_trace(True, prompts, time_maps=True)
                out.cold.append(trace.ops_per_s)
                out.map_share.append(trace.map_share)
    return out


# -- 2. scheduler step -----------------------------------------------------------------
def _engine(elastic: bool, model_dir: Path, kv_bytes: int = 64 << 20) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCore

    from engine_ext.cpu_harness import STUB_EXECUTOR, StubExecutor

    args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        dtype="float16",
        block_size=16,
        max_model_len=4096,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=kv_bytes,
        distributed_executor_backend=STUB_EXECUTOR,
        max_num_seqs=16,
    )
    del elastic  # run_scheduler's pool_class() chose the pool and the patches
    config = args.create_engine_config()
    return EngineCore(config, StubExecutor, log_stats=False)


def run_scheduler(elastic: bool, model_dir: Path, num_requests: int) -> float:
    """Median seconds of scheduler work (schedule + update_from_output) per engine step."""
    with pool_class(elastic):  # the patches stay on while the engine steps
        return _run_scheduler(elastic, model_dir, num_requests)


def idle_safe_point_s() -> float:
    """Seconds of one safe point with nothing waiting (the per-step state refresh)."""
    runtime = _runtime.current_runtime()
    assert runtime is not None
    runtime.safe_point()
    calls = 20000
    t0 = time.thread_time()
    for _ in range(calls):
        runtime.safe_point()
    return (time.thread_time() - t0) / calls


def _run_scheduler(elastic: bool, model_dir: Path, num_requests: int) -> float:
    from vllm.v1.engine import EngineCoreRequest

    engine = _engine(elastic, model_dir)
    scheduler = engine.scheduler
    timings: list[float] = []
    for name in ("schedule", "update_from_output"):
        real = getattr(scheduler, name)

        def wrapper(*a: Any, _real: Callable[..., Any] = real, **k: Any) -> Any:
            if _step_collect is not None:
                _step_collect()
            t0 = time.thread_time()
            try:
                return _real(*a, **k)
            finally:
                timings.append(time.thread_time() - t0)
                if _step_collect is not None:
                    _step_collect()

        setattr(scheduler, name, wrapper)
    doc = list(range(10, 10 + 600))
    for i in range(num_requests):
        tail = [3000 + (i * 37 + t) % 900 for t in range(40 + i % 50)]
        request = EngineCoreRequest(
            f"s{i}",
            doc + tail,
            None,
            SamplingParams(max_tokens=32, ignore_eos=True),
            None,
            time.time(),
            None,
            None,
            None,
        )
        engine.add_request(*engine.preprocess_add_request(request))
    gc.collect()
    gc.disable()
    if _step_tracer is not None:
        sys.settrace(_step_tracer)
    try:
        while engine.scheduler.has_requests():
            engine.step()
    finally:
        sys.settrace(None)
    gc.enable()
    if elastic:
        _idle_safe_point.append(idle_safe_point_s())
    engine.shutdown()
    clear_kv_memory()
    per_step = [timings[i] + timings[i + 1] for i in range(0, len(timings) - 1, 2)]
    return statistics.median(per_step)


_idle_safe_point: list[float] = []
_step_tracer: Any = None  # count_step_bytecodes' tracer while it runs
_step_collect: Callable[[], None] | None = None  # callgrind_steps' collect toggle


def _step_requests(round_no: int, num_requests: int) -> list[Any]:
    """The scheduler trace of one round: a 600-token document shared by every request
    (a new one each round), distinct tails, 32 output tokens (with ``--churn`` 1 to 48,
    spread, so that at most steps a request finishes and another is admitted: an
    engine serving a steady stream of short requests)."""
    from vllm.v1.engine import EngineCoreRequest

    doc = [10 + (round_no * 7919 + t) % 29_000 for t in range(600)]
    return [
        EngineCoreRequest(
            f"r{round_no}s{i}",
            doc + [30_000 + (i * 37 + t) % 900 for t in range(40 + i % 50)],
            None,
            SamplingParams(max_tokens=1 + (i * 29) % 48 if _churn else 32, ignore_eos=True),
            None,
            time.time(),
            None,
            None,
            None,
        )
        for i in range(num_requests)
    ]


def _timed(
    scheduler: Any, timings: list[float], windows: list[tuple[int, int]] | None = None
) -> None:
    """Time ``schedule`` and ``update_from_output`` of this scheduler (this thread's CPU),
    as the class has them at each call (patched or not). ``windows``: each call's
    ``CLOCK_MONOTONIC`` start and end in ns too (read outside the CPU-time bracket), for
    ``bench/attribute_samples.py`` to put a sampling profiler's samples in them."""
    owner = type(scheduler)
    for name in ("schedule", "update_from_output"):

        def wrapper(*a: Any, _name: str = name, **k: Any) -> Any:
            real = getattr(owner, _name)
            m0 = 0 if windows is None else time.monotonic_ns()
            t0 = time.thread_time()
            try:
                return real(scheduler, *a, **k)
            finally:
                timings.append(time.thread_time() - t0)
                if windows is not None:
                    windows.append((m0, time.monotonic_ns()))

        setattr(scheduler, name, wrapper)


WARM_KV_BYTES = 8 << 20  # --warm: 512 blocks, full after the warm-up round


@dataclass
class StepRounds:
    """Per-round figures of the scheduler step, side A against side B (B over A).

    Three estimates of the same ratio per round: the per-side median step over
    each other (the headline of earlier runs), the total over the total (every
    step counts, safe points included), and the median of the per-step ratios
    (step j of B over step j of A: both run the same trace, so their steps pair
    up, and each pair ran at nearly the same moment; the steadiest of the three
    on a shared machine). ``None`` where the sides took different step counts.
    """

    a: list[float] = field(default_factory=list)  # per-round median step, side A
    b: list[float] = field(default_factory=list)
    sums: list[float] = field(default_factory=list)
    paired: list[float | None] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # side B's steps per round

    def add(self, steps_a: list[float], steps_b: list[float]) -> None:
        self.steps.append(len(steps_b))
        self.a.append(statistics.median(steps_a))
        self.b.append(statistics.median(steps_b))
        self.sums.append(sum(steps_b) / sum(steps_a))
        same = len(steps_a) == len(steps_b)
        self.paired.append(
            statistics.median(y / x for x, y in zip(steps_a, steps_b)) if same else None
        )

    def by_first_stepper(self) -> dict[str, float]:
        """The median over rounds of the of-medians ratio, split by which side stepped
        first (the step-round loops alternate: A in the 1st, 3rd, ... kept round)."""
        ratios = [y / x for x, y in zip(self.a, self.b)]
        return {
            "a_first": statistics.median(ratios[0::2]),
            "b_first": statistics.median(ratios[1::2]) if len(ratios) > 1 else float("nan"),
        }

    def medians(self) -> dict[str, float | None]:
        """The median over rounds of each per-round ratio."""
        paired = [p for p in self.paired if p is not None]
        return {
            "of_medians": statistics.median(y / x for x, y in zip(self.a, self.b)),
            "of_sums": statistics.median(self.sums),
            "paired": statistics.median(paired) if len(paired) == len(self.paired) else None,
        }


def scheduler_rounds(
    model_dir: Path,
    rounds: int,
    num_requests: int,
    warm: bool = False,
    kinds: tuple[str, str] = ("native", "elastic"),
    windows: dict[str, list[tuple[int, int]]] | None = None,
) -> StepRounds:
    """Per-round seconds of scheduler work per step of the two ``kinds``
    ("native" or "elastic"; built in that order; ("native", "native") is an A/A
    control).

    Both engines are built once and stay up and step in lockstep, one step each in
    turn (the plugin's per-step patches are installed only around the elastic
    side's steps; which side steps first alternates by round), so both see the
    same moments of a shared machine; each round
    is the same fresh trace on both, with the prefix caches reset before it
    (``warm``: 8 MiB of KV cache each and no reset, so after the warm-up round
    the cache is full and the elastic side maps no page). ``windows``: filled with
    each side's timed calls as ``CLOCK_MONOTONIC`` ns (start, end), by kind, all
    rounds (the warm-up one too); the kinds must differ.
    """
    plain = _installed()
    patched = _patched(plain)
    engines = []
    for kind in kinds:
        with pool_class(kind == "elastic"):
            engines.append(
                _engine(kind == "elastic", model_dir, WARM_KV_BYTES if warm else 64 << 20)
            )
    sides = [
        (i, engine, patched if kind == "elastic" else plain)
        for i, (kind, engine) in enumerate(zip(kinds, engines))
    ]
    timings: list[list[float]] = [[], []]
    if windows is not None and kinds[0] == kinds[1]:
        raise ValueError("windows are kept by kind: an A/A control has none")
    for i, engine, _methods in sides:
        side_windows = None if windows is None else windows.setdefault(kinds[i], [])
        _timed(engine.scheduler, timings[i], side_windows)
    result = StepRounds()
    try:
        for round_no in range(rounds + 1):  # round 0 warms both up and is not kept
            for i, engine, methods in sides:
                for owner, name, method in methods:
                    setattr(owner, name, method)
                if not warm:
                    engine.reset_prefix_cache()
                for request in _step_requests(round_no, num_requests):
                    engine.add_request(*engine.preprocess_add_request(request))
                timings[i].clear()
            # lockstep: one step of each in turn, so both see the same moments; the side
            # that steps first alternates by round (the A/A control showed the second
            # stepper 1-2 % faster in some runs: a position effect, cancelled this way)
            order = sides if round_no % 2 else sides[::-1]
            _lockstep([(engine, methods) for _i, engine, methods in order])
            if round_no:
                result.add(*(_per_step(times) for times in timings))
        if "elastic" in kinds:
            for owner, name, method in patched:
                setattr(owner, name, method)
            _idle_safe_point.append(idle_safe_point_s())
    finally:
        for owner, name, method in plain:
            setattr(owner, name, method)
        for engine in engines:
            engine.shutdown()
        clear_kv_memory()
    return result


def _per_step(timings: list[float]) -> list[float]:
    """schedule() + update_from_output() of each engine step (timed in that order)."""
    return [timings[j] + timings[j + 1] for j in range(0, len(timings) - 1, 2)]


def _patched(plain: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
    """The plugin's per-step patches built over ``plain`` (what :func:`_installed` read);
    a row in ``--leave-off`` keeps vLLM's own method."""
    return [
        (owner, name, method if name in _leave_off else factory(method, None))
        for (owner, name, factory), (_, _, method) in zip(_patch_rows(), plain)
    ]


def _lockstep(sides: list[tuple[Any, list[tuple[Any, str, Any]]]]) -> None:
    """Step the engines one step each in turn until none has requests, each with its
    methods installed for its step, the garbage collector paused."""
    gc.collect()
    gc.disable()
    try:
        busy = True
        while busy:
            busy = False
            for engine, methods in sides:
                if engine.scheduler.has_requests():
                    for owner, name, method in methods:
                        setattr(owner, name, method)
                    engine.step()
                    busy = True
    finally:
        gc.enable()


def _step_worker(
    kind: str,
    model_dir: Path,
    warm: bool,
    num_requests: int,
    conn: Any,
    leave_off: frozenset[str] = frozenset(),
    cpu: int | None = None,
    churn: bool = False,
) -> None:
    """One side of :func:`process_step_rounds`, in its own process: builds its engine
    (with the plugin's patches installed once, as in a served engine) and runs one
    command at a time from the parent: a round's requests, one engine step, the
    round's median step time."""
    global _churn
    _churn = churn
    _leave_off.update(leave_off)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with pool_class(kind == "elastic"):
        engine = _engine(kind == "elastic", model_dir, WARM_KV_BYTES if warm else 64 << 20)
        timings: list[float] = []
        _timed(engine.scheduler, timings)
        try:
            while True:
                command, arg = conn.recv()
                if command == "round":
                    if not warm:
                        engine.reset_prefix_cache()
                    for request in _step_requests(arg, num_requests):
                        engine.add_request(*engine.preprocess_add_request(request))
                    timings.clear()
                    gc.collect()
                    gc.disable()
                    conn.send(None)
                elif command == "step":
                    busy = engine.scheduler.has_requests()
                    if busy:
                        engine.step()
                    conn.send(busy)
                elif command == "steps":
                    gc.enable()
                    conn.send(_per_step(timings))
                elif command == "idle":
                    conn.send(idle_safe_point_s() if kind == "elastic" else None)
                else:
                    break
        finally:
            engine.shutdown()


def process_step_rounds(
    model_dir: Path,
    rounds: int,
    num_requests: int,
    warm: bool = False,
    kinds: tuple[str, str] = ("native", "elastic"),
    cpus: tuple[int | None, int | None] = (None, None),
) -> StepRounds:
    """:func:`scheduler_rounds` with each engine in its own process, as served engines
    are: the patches are installed once and no call site of the other engine's
    classes shares this one's specialisations. The parent still steps them in
    lockstep (one engine step of each in turn, the other waiting), so both see the
    same moments of a shared machine."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    sides = []
    for kind, cpu in zip(kinds, cpus):
        parent, child = context.Pipe()
        process = context.Process(
            target=_step_worker,
            args=(kind, model_dir, warm, num_requests, child, frozenset(_leave_off), cpu, _churn),
            daemon=True,
        )
        process.start()
        sides.append((parent, process))
    result = StepRounds()
    try:
        for round_no in range(rounds + 1):  # round 0 warms both up and is not kept
            for conn, _ in sides:
                conn.send(("round", round_no))
            for conn, _ in sides:
                conn.recv()
            busy = True
            order = sides if round_no % 2 else sides[::-1]  # first stepper alternates by round
            while busy:
                busy = False
                for conn, _ in order:
                    conn.send(("step", None))
                    busy = conn.recv() or busy
            steps = []
            for conn, _ in sides:
                conn.send(("steps", None))
                steps.append(conn.recv())
            if round_no:
                result.add(*steps)
        for conn, _ in sides:
            conn.send(("idle", None))
            idle = conn.recv()
            if idle is not None:
                _idle_safe_point.append(idle)
    finally:
        for conn, process in sides:
            conn.send(("stop", None))
            process.join(timeout=30)
    return result


def _safe_point_kind(runtime: Any, caller: str) -> str:
    """What let a safe point through (the first that holds, in the gate's order)."""
    if caller not in ("begin_schedule", "end_schedule"):
        return caller.lstrip("_")  # _settle (a free outside schedule()), _on_idle, ...
    pages = runtime._blocks.pages
    if runtime._woken or not runtime._steady:
        return "target or deferred"
    if pages.num_mapped != runtime._seen_mapped or pages.device_full != runtime._seen_device_full:
        return "pages mapped or unmapped"
    if runtime.pool is not None and runtime.pool.cleanup_due:
        return "deferred evictions"
    if runtime._refused_blocks or runtime._device_refused:
        return "refusal"
    if _runtime._monotonic() >= runtime._refresh_due:
        return "age (DEMAND_MAX_AGE_S)"
    return "other"


def safe_point_costs(
    model_dir: Path, rounds: int, num_requests: int, warm: bool
) -> tuple[dict[str, tuple[int, float]], float, int]:
    """The elastic side's safe points inside the step rounds, as they run there: how
    many, and the thread CPU time of each, by what let them through (the kinds of
    :func:`_safe_point_kind`). Between two of them the engines' steps run, so each
    runs with the caches as the rest of the step left them, not as a loop of calls
    would (``idle_safe_point_s``). Returns ({kind: (calls, seconds)}, the native
    side's median step, the elastic side's steps in the kept rounds)."""
    real = _runtime.VllmRuntime.safe_point
    costs: dict[str, list[float]] = {}

    def timed(self: Any, scheduler: Any = None) -> Any:
        kind = _safe_point_kind(self, sys._getframe(1).f_code.co_name)
        t0 = time.thread_time()
        try:
            return real(self, scheduler)
        finally:
            costs.setdefault(kind, []).append(time.thread_time() - t0)

    def requests(round_no: int, count: int) -> list[Any]:
        if round_no == 1 and not kept[0]:  # the warm-up round is over: count from here
            kept[0] = True
            costs.clear()
        return make_requests(round_no, count)

    kept = [False]
    idle, make_requests = idle_safe_point_s, _step_requests
    module = globals()
    module["idle_safe_point_s"] = lambda: 0.0  # its 20000 calls are not in a step
    module["_step_requests"] = requests
    _runtime.VllmRuntime.safe_point = timed  # type: ignore[method-assign]
    try:
        step = scheduler_rounds(model_dir, rounds, num_requests, warm)
    finally:
        _runtime.VllmRuntime.safe_point = real  # type: ignore[method-assign]
        module["idle_safe_point_s"], module["_step_requests"] = idle, make_requests
        _idle_safe_point.pop()
    per_kind = {kind: (len(times), sum(times)) for kind, times in costs.items()}
    return per_kind, statistics.median(step.a), sum(step.steps)


# -- 3. bytecodes executed (load-independent) ------------------------------------------
def count_pool_bytecodes(elastic: bool, prompts: list[list[int]]) -> Counter[str]:
    """Python bytecodes executed per function during one pool trace (``sys.settrace``).

    Deterministic: on a shared machine wall and CPU times move with other people's
    load, opcode counts do not. C work (hashing, syscalls of map/unmap) is not counted.
    """
    counts: Counter[str] = Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            code = frame.f_code
            counts[code.co_name] += 1  # by name: the pool's overrides meet vLLM's methods
        return tracer

    real_clock = time.thread_time
    calls = 0

    def clock() -> float:  # run_pool_trace reads the clock right before and after the trace
        nonlocal calls
        calls += 1
        sys.settrace(tracer if calls == 1 else None)
        return real_clock()

    run_pool_trace(elastic, prompts)  # warm-up (imports, caches)
    time.thread_time = clock  # type: ignore[assignment]
    try:
        run_pool_trace(elastic, prompts)
    finally:
        time.thread_time = real_clock  # type: ignore[assignment]
        sys.settrace(None)
    return counts


_CALLGRIND_C = """#include <valgrind/callgrind.h>
void kvs_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void kvs_cg_stop(void) { CALLGRIND_DUMP_STATS_AT("pool-trace"); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _client_requests(source: str) -> Any:
    """Build and load a tiny C helper issuing callgrind client requests (``cc`` and
    valgrind's headers needed); outside valgrind its calls are no-ops."""
    import ctypes
    import subprocess

    workdir = Path(tempfile.mkdtemp(prefix="kvs-cg-"))
    (workdir / "cg.c").write_text(source)
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", "-o", str(workdir / "cg.so"), str(workdir / "cg.c")],
        check=True,
    )
    return ctypes.CDLL(str(workdir / "cg.so"))


def callgrind_pool_trace(elastic: bool, prompts: list[list[int]]) -> None:
    """One pool trace with callgrind's instrumentation on only around it (load-independent).

    Run under ``valgrind --tool=callgrind --instr-atstart=no``: the trace's
    instruction count is the ``Collected`` line (and the ``pool-trace`` dump).
    The client requests come from a three-line C helper built here with ``cc``
    (valgrind's headers needed); outside valgrind they are no-ops.
    """
    lib = _client_requests(_CALLGRIND_C)
    run_pool_trace(elastic, prompts)  # warm-up (imports, caches), not counted
    real_clock = time.thread_time
    calls = 0

    def clock() -> float:  # run_pool_trace reads the clock right before and after the trace
        nonlocal calls
        calls += 1
        (lib.kvs_cg_start if calls == 1 else lib.kvs_cg_stop)()
        return real_clock()

    time.thread_time = clock  # type: ignore[assignment]
    try:
        run_pool_trace(elastic, prompts)
    finally:
        time.thread_time = real_clock  # type: ignore[assignment]


_CALLGRIND_STEP_C = """#include <valgrind/callgrind.h>
void kvs_cg_instr(void) { CALLGRIND_START_INSTRUMENTATION; }
void kvs_cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void kvs_cg_dump(void) { CALLGRIND_DUMP_STATS_AT("scheduler-steps"); }
"""


def callgrind_steps(elastic: bool, model_dir: Path, num_requests: int = 64) -> None:
    """Instructions of ``schedule()`` + ``update_from_output()`` over the 64-request run
    (the stub model's step and the engine loop between them not counted).

    Run under ``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no``:
    a warm-up run first, then instrumentation on and collection toggled around each
    scheduler call; the ``scheduler-steps`` dump's total is the figure (load-independent).
    """
    global _step_collect
    lib = _client_requests(_CALLGRIND_STEP_C)
    run_scheduler(elastic, model_dir, num_requests)  # warm-up (imports, caches)
    max_age = _runtime.DEMAND_MAX_AGE_S
    _runtime.DEMAND_MAX_AGE_S = float("inf")  # as in count_step_bytecodes: no periodic re-read
    lib.kvs_cg_instr()
    _step_collect = lib.kvs_cg_toggle
    try:
        run_scheduler(elastic, model_dir, num_requests)
    finally:
        _step_collect = None
        _runtime.DEMAND_MAX_AGE_S = max_age
    lib.kvs_cg_dump()


def callgrind_lockstep(side: str, model_dir: Path, num_requests: int = 64) -> None:
    """Both engines step in lockstep (as :func:`scheduler_rounds`, ``--warm``) under
    callgrind with its cache and branch simulation; only ``side``'s ``schedule()`` +
    ``update_from_output()`` are collected, so its figures include the misses that
    the other engine's step causes in between (the machine's shared caches, modelled).

    Run under ``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no
    --cache-sim=yes --branch-sim=yes``, once per side: two warm-up rounds, then one
    round instrumented; the ``scheduler-steps`` dump holds the figures.
    """
    lib = _client_requests(_CALLGRIND_STEP_C)
    max_age = _runtime.DEMAND_MAX_AGE_S
    _runtime.DEMAND_MAX_AGE_S = float("inf")  # the simulation's slow clock: no age refreshes
    plain = _installed()
    patched = _patched(plain)
    kinds = ("native", "elastic")
    engines = []
    for kind in kinds:
        with pool_class(kind == "elastic"):
            engines.append(_engine(kind == "elastic", model_dir, WARM_KV_BYTES))
    sides = [
        (engine, patched if kind == "elastic" else plain) for kind, engine in zip(kinds, engines)
    ]
    collecting = [False, False]
    for i, (engine, _methods) in enumerate(sides):
        scheduler = engine.scheduler
        for name in ("schedule", "update_from_output"):

            def wrapper(
                *a: Any, _name: str = name, _i: int = i, _s: Any = scheduler, **k: Any
            ) -> Any:
                real = getattr(type(_s), _name)
                if not collecting[_i]:
                    return real(_s, *a, **k)
                lib.kvs_cg_toggle()
                try:
                    return real(_s, *a, **k)
                finally:
                    lib.kvs_cg_toggle()

            setattr(scheduler, name, wrapper)
    try:
        for round_no in range(3):
            if round_no == 2:
                lib.kvs_cg_instr()
                collecting[kinds.index(side)] = True
            for engine, methods in sides:
                for owner, name, method in methods:
                    setattr(owner, name, method)
                for request in _step_requests(round_no, num_requests):
                    engine.add_request(*engine.preprocess_add_request(request))
            _lockstep(sides)
        lib.kvs_cg_dump()
    finally:
        _runtime.DEMAND_MAX_AGE_S = max_age
        for owner, name, method in plain:
            setattr(owner, name, method)
        for engine in engines:
            engine.shutdown()
        clear_kv_memory()


# The model behind --callgrind-cost: an instruction costs 1, a first-level cache miss
# (instruction or data) 10, a mispredicted branch (conditional or indirect) 15; callgrind
# reports no misses beyond the last level here. A relative figure, for comparing two
# builds or two sides of the same trace, not a cycle count of any machine.
_COST_WEIGHTS = {"Ir": 1, "I1mr": 10, "D1mr": 10, "D1mw": 10, "Bcm": 15, "Bim": 15}


def callgrind_cost(path: Path) -> dict[str, int]:
    """The event totals of a callgrind output file, and their modelled cost ("cost")."""
    events: list[str] = []
    totals: list[int] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            totals = [int(x) for x in line.split()[1:]]
    figures = dict(zip(events, totals))
    if not all(name in figures for name in _COST_WEIGHTS):
        raise SystemExit(f"{path}: run callgrind with --cache-sim=yes --branch-sim=yes")
    figures["cost"] = sum(weight * figures[name] for name, weight in _COST_WEIGHTS.items())
    return figures


def count_step_bytecodes(elastic: bool, model_dir: Path, num_requests: int = 64) -> Counter[str]:
    """Python bytecodes per function of the engine steps (schedule, model stub,
    update_from_output) for ``num_requests`` requests (``sys.settrace``, load-independent)."""
    global _step_tracer
    counts: Counter[str] = Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            counts[frame.f_code.co_name] += 1
        return tracer

    run_scheduler(elastic, model_dir, num_requests)  # warm-up (imports, caches)
    # Under the tracer a step takes longer than the demand probe's 100 ms re-read period,
    # so it would re-read at every safe point; at real speed it does so once per 100 ms
    # (about 140 steps here): leave that periodic re-read out of the count.
    max_age = _runtime.DEMAND_MAX_AGE_S
    _runtime.DEMAND_MAX_AGE_S = float("inf")
    _step_tracer = tracer
    try:
        run_scheduler(elastic, model_dir, num_requests)
    finally:
        _step_tracer = None
        _runtime.DEMAND_MAX_AGE_S = max_age
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument(
        "--pool-rounds",
        type=int,
        default=10,
        help="rounds of the block pool trace (each: native with an A/A control, with the cold "
        "elastic pool and with the pre-mapped one; in lockstep, two rounds make one "
        "measurement, one built in each order)",
    )
    parser.add_argument(
        "--pool-chunk",
        type=int,
        default=16,
        help="the pool trace's sides run in lockstep, this many ops at a time (0: one whole "
        "trace after the other)",
    )
    parser.add_argument(
        "--no-step-control",
        dest="step_control",
        action="store_false",
        help="skip the scheduler step's A/A control (two native engines in lockstep)",
    )
    parser.add_argument(
        "--step-procs",
        action="store_true",
        help="each engine of the scheduler step in its own process (still in lockstep)",
    )
    parser.add_argument(
        "--step-cpus",
        default=",",
        help="with --step-procs: the CPU each engine process is pinned to, 'A,B' (empty: not pinned)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--windows",
        type=Path,
        help="write each side's timed scheduler calls (CLOCK_MONOTONIC ns, start and end) of "
        "the step rounds to this JSON file, for bench/attribute_samples.py (engines in one "
        "process only)",
    )
    parser.add_argument(
        "--bytecodes",
        action="store_true",
        help="only count the bytecodes of one pool trace per side (300 requests)",
    )
    parser.add_argument(
        "--step-bytecodes",
        action="store_true",
        help="only count the bytecodes of the engine steps for 64 requests, per side",
    )
    parser.add_argument(
        "--callgrind",
        choices=("native", "elastic"),
        help="one pool trace (300 requests) of this side with callgrind's instrumentation on "
        "only around it; run under valgrind --tool=callgrind --instr-atstart=no",
    )
    parser.add_argument(
        "--step-only",
        action="store_true",
        help="only the scheduler-step rounds (skip the block pool trace)",
    )
    parser.add_argument(
        "--callgrind-step",
        choices=("native", "elastic"),
        help="schedule() + update_from_output() of the 64-request step run of this side, "
        "instructions counted only inside them; run under valgrind --tool=callgrind "
        "--instr-atstart=no --collect-atstart=no",
    )
    parser.add_argument(
        "--callgrind-lockstep",
        choices=("native", "elastic"),
        help="both engines in lockstep (--warm trace), this side's scheduler calls collected; "
        "run under valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no "
        "--cache-sim=yes --branch-sim=yes (bench/README.md: a modelled cycle count)",
    )
    parser.add_argument(
        "--callgrind-cost",
        nargs=2,
        type=Path,
        metavar=("NATIVE_OUT", "ELASTIC_OUT"),
        help="the ratios (elastic over native) of two --callgrind-lockstep outputs: "
        "instructions, cache misses, mispredictions and their modelled cost",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="scheduler step in the steady state: 8 MiB of KV cache on both sides, the prefix "
        "cache kept between rounds (full after the warm-up round), so the elastic side's "
        "pages stay mapped; the default resets both caches before every round (the elastic "
        "side maps its pages again in each)",
    )
    parser.add_argument(
        "--churn",
        action="store_true",
        help="scheduler step trace with output lengths 1-48 instead of 32 for all: requests "
        "finish and start at most steps (a steady stream of short requests), where the "
        "state's counts move at every step",
    )
    parser.add_argument(
        "--safe-point-costs",
        action="store_true",
        help="only the step rounds, with the elastic side's safe points timed where they run "
        "(thread CPU time, by what let each through): the cost a loop of calls does not show",
    )
    parser.add_argument(
        "--leave-off",
        default="",
        help="comma-separated per-step patches to leave off the elastic side "
        "(schedule, update_from_output, _preempt_request, allocate_slots): what each "
        "costs; every step measurement honours it",
    )
    args = parser.parse_args()
    if args.windows is not None and args.step_procs:
        parser.error("--windows needs the engines in one process (leave out --step-procs)")
    _leave_off.update(name for name in args.leave_off.split(",") if name)
    global _churn
    _churn = args.churn
    if args.callgrind_cost:
        native_cg, elastic_cg = (callgrind_cost(path) for path in args.callgrind_cost)
        for name in (*_COST_WEIGHTS, "cost"):
            print(
                f"{name:5s} native {native_cg[name]:>13,}  elastic {elastic_cg[name]:>13,}  "
                f"ratio {elastic_cg[name] / max(1, native_cg[name]):.4f}"
            )
        return
    if args.safe_point_costs:
        from engine_ext.cpu_harness import make_tiny_model_dir

        model_dir = make_tiny_model_dir(_scratch_dir() / "model")
        kinds, native_step, steps = safe_point_costs(model_dir, args.rounds, 64, args.warm)
        trace = "--warm" if args.warm else "--churn" if _churn else "default"
        print(
            f"safe points of the elastic side, {args.rounds} rounds, {trace} trace, {steps} steps "
            f"(native median step {1e6 * native_step:.1f} us):"
        )
        for kind, (calls, total) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            print(
                f"  {kind:26s} {calls:5d} calls  {1e6 * total / calls:7.1f} us each  "
                f"{100 * calls / steps:5.1f} % of steps  "
                f"{100 * total / steps / native_step:5.2f} % of a native step, averaged"
            )
        return
    if args.callgrind_lockstep:
        from engine_ext.cpu_harness import make_tiny_model_dir

        model_dir = make_tiny_model_dir(_scratch_dir() / "model")
        callgrind_lockstep(args.callgrind_lockstep, model_dir)
        return
    if args.callgrind_step:
        from engine_ext.cpu_harness import make_tiny_model_dir

        model_dir = make_tiny_model_dir(_scratch_dir() / "model")
        callgrind_steps(args.callgrind_step == "elastic", model_dir)
        return
    if args.callgrind:
        callgrind_pool_trace(args.callgrind == "elastic", _trace(300))
        return
    if args.step_bytecodes:
        from engine_ext.cpu_harness import make_tiny_model_dir

        model_dir = make_tiny_model_dir(_scratch_dir() / "model")
        native = count_step_bytecodes(False, model_dir)
        elastic = count_step_bytecodes(True, model_dir)
        n, e = sum(native.values()), sum(elastic.values())
        print(f"engine step bytecodes  native {n}  elastic {e}  ratio elastic/native {e / n:.3f}")
        extra = {k: elastic[k] - native.get(k, 0) for k in elastic}
        for name, diff in sorted(extra.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {diff:>9}  {name}")
        return
    if args.bytecodes:
        prompts = _trace(300)
        native, elastic = count_pool_bytecodes(False, prompts), count_pool_bytecodes(True, prompts)
        n, e = sum(native.values()), sum(elastic.values())
        print(f"pool trace bytecodes  native {n}  elastic {e}  ratio native/elastic {n / e:.3f}")
        extra = {k: elastic[k] - native.get(k, 0) for k in elastic}  # extra per function
        for name, diff in sorted(extra.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {diff:>9}  {name}")
        return
    pool = (
        None
        if args.step_only
        else pool_rounds(_trace(args.requests), args.pool_rounds, args.pool_chunk)
    )
    from engine_ext.cpu_harness import make_tiny_model_dir

    model_dir = make_tiny_model_dir(_scratch_dir() / "model")
    cpus = tuple(int(c) if c else None for c in args.step_cpus.split(","))
    step_rounds = (
        functools.partial(process_step_rounds, cpus=cpus) if args.step_procs else scheduler_rounds
    )
    windows: dict[str, list[tuple[int, int]]] | None = None if args.windows is None else {}
    if windows is not None:
        step = scheduler_rounds(model_dir, args.rounds, 64, args.warm, windows=windows)
        args.windows.write_text(json.dumps(windows))
    else:
        step = step_rounds(model_dir, args.rounds, 64, args.warm)
    native_step, elastic_step = step.a, step.b
    control_step: StepRounds | None = None
    if args.step_control:  # two native engines: what identical code measures here
        control_step = step_rounds(model_dir, args.rounds, 64, args.warm, ("native",) * 2)
    # Best of the rounds (the least disturbed run, as timeit advises) is the headline;
    # the median of per-round ratios is kept to show the spread on a busy machine.
    result: dict[str, Any] = {}
    if pool is not None:
        result["pool_ops_per_s"] = {
            "native": max(max(each) for each in pool.native.values()),
            "elastic": max(pool.cold),
            "elastic_premapped": max(pool.premapped),
        }
        result["pool_ratio"], result["pool_ratio_median"] = pool.ratio("cold")
        result["pool_premapped_ratio"], result["pool_premapped_ratio_median"] = pool.ratio(
            "premapped"
        )
        result["pool_map_share_median"] = statistics.median(pool.map_share)
        result["pool_control_ratio"], result["pool_control_ratio_median"] = pool.ratio("control")
        per_round = sorted(pool.per_round("control"))
        result["pool_control_ratio_range"] = [per_round[0], per_round[-1]]
        result["pool_premapped_ratio_rounds"] = pool.per_round("premapped")
        result["pool_lockstep_chunk"] = args.pool_chunk
    result |= {
        "step_s": {"native": min(native_step), "elastic": min(elastic_step)},
        "step_ratio": min(elastic_step) / min(native_step),
        "step_ratio_median": step.medians()["of_medians"],
        "step_ratios": step.medians(),
        "step_control_ratios": None if control_step is None else control_step.medians(),
        "step_by_first_stepper": step.by_first_stepper(),
        "step_control_by_first_stepper": None
        if control_step is None
        else control_step.by_first_stepper(),
        "idle_safe_point_s": min(_idle_safe_point),
        "step_control_ratio_median": None
        if control_step is None
        else control_step.medians()["of_medians"],
        # two safe points per step (top and end of schedule()) against native step time
        "state_refresh_ratio": 1 + 2 * min(_idle_safe_point) / min(native_step),
    }
    if pool is not None:
        ops = result["pool_ops_per_s"]
        how = (
            f"lockstep pairs, {args.pool_chunk} ops at a time"
            if args.pool_chunk > 0
            else "one trace after the other"
        )
        pairs = (
            "per-pair (two rounds, built in turned order)" if args.pool_chunk > 0 else "per-round"
        )
        print(f"block pool ops/s, {args.pool_rounds} rounds ({how}); median of {pairs} ratios:")
        print(
            f"  cold elastic (maps during the trace)  ratio {result['pool_ratio_median']:.3f} "
            f"(goal >= 0.95; best round over best round {result['pool_ratio']:.3f}); "
            f"page maps: {100 * result['pool_map_share_median']:.1f}% of the trace"
        )
        rounds = ", ".join(f"{r:.3f}" for r in result["pool_premapped_ratio_rounds"])
        print(
            f"  pre-mapped elastic                    ratio "
            f"{result['pool_premapped_ratio_median']:.3f} (best over best "
            f"{result['pool_premapped_ratio']:.3f}; rounds {rounds})"
        )
        low, high = result["pool_control_ratio_range"]
        print(
            f"  A/A control (native again)            ratio "
            f"{result['pool_control_ratio_median']:.3f} (best over best "
            f"{result['pool_control_ratio']:.3f}; rounds {low:.3f} .. {high:.3f}): the noise "
            f"floor"
        )
        print(
            f"  best ops/s: native {ops['native']:.0f}, cold {ops['elastic']:.0f}, "
            f"pre-mapped {ops['elastic_premapped']:.0f}"
        )
    print(
        f"scheduler step ms  native {1e3 * result['step_s']['native']:10.3f}   "
        f"elastic {1e3 * result['step_s']['elastic']:10.3f}   "
        f"ratio {result['step_ratio']:.3f} (goal <= 1.05 issue 11, <= 1.03 issue 17; median of rounds "
        f"{result['step_ratio_median']:.3f})"
    )
    where = "engines in their own processes" if args.step_procs else "engines in one process"
    print(f"  medians over rounds ({where}):")
    rows = [("elastic / native", result["step_ratios"])]
    if result["step_control_ratios"] is not None:
        rows.append(("A/A control (native twice)", result["step_control_ratios"]))
    for label, ratios in rows:
        paired = "n/a" if ratios["paired"] is None else f"{ratios['paired']:.3f}"
        print(
            f"    {label:28s} of medians {ratios['of_medians']:.3f}  of totals "
            f"{ratios['of_sums']:.3f}  paired steps {paired}"
        )
    orders = [("elastic / native", result["step_by_first_stepper"])]
    if result["step_control_by_first_stepper"] is not None:
        orders.append(("A/A control (native twice)", result["step_control_by_first_stepper"]))
    print("  of medians by the side that stepped first (the loops alternate it by round):")
    for label, split in orders:
        print(
            f"    {label:28s} native (A) first {split['a_first']:.3f}  "
            f"second side first {split['b_first']:.3f}"
        )
    print(
        f"idle safe point us {1e6 * result['idle_safe_point_s']:10.2f}   "
        f"2 per step / native step: {result['state_refresh_ratio']:.4f}x"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
