"""The scheduler step's brackets in C (``_block_speedups.StepHook``).

The plugin replaces ``Scheduler.schedule`` and ``Scheduler.update_from_output``
with vLLM's method between the runtime's hooks (``begin_schedule`` /
``end_schedule``, ``begin_update`` / ``end_update``). In C, a hook whose gate
holds (nothing to do but set a flag) is not called: the flag is set there.
Here the C replacement and the pure-Python one get the same runtime, field for
field, over random combinations of every input of both gates, vLLM's method
returning or raising and a safe point raising, and must leave the same trace:
the same hook effects in the same order, the same flags while vLLM's method
runs and after, the same result or exception (with the same ``__context__``).
vLLM's real scheduler runs through the C brackets in every vLLM test of the suite.
"""

from __future__ import annotations

import gc
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from support.cases import each_moved_and_random
from test_engine_core_limits import build_core, make_request, plugin_env

from engine_ext import EngineSettings
from engine_ext.vllm import _block_speedups, _runtime
from engine_ext.vllm._settings import VllmSettings

StepHook = _block_speedups.StepHook
__all__ = ["plugin_env"]  # the fixture, re-exported for pytest

pytestmark = pytest.mark.vllm


class Pool:  # what the brackets read and write on ElasticBlockPool
    def __init__(self, log: list[Any], cleanup_due: bool) -> None:
        self.log = log
        self.cleanup_due = cleanup_due
        self.in_schedule = False
        self.overdraft = False

    def cleanup(self) -> None:
        self.log.append("cleanup")
        self.cleanup_due = False


class Pages:  # PageAllocator's figures the gate compares
    def __init__(self, num_mapped: int, full_at: float | None, reserve: int, wanted: int) -> None:
        self.num_mapped = num_mapped
        self._device_full_at = full_at
        self.reserve_pages = reserve
        self.wanted = wanted

    @property
    def device_full(self) -> bool:
        return self._device_full_at is not None

    def reserve_wanted(self) -> int:
        return self.wanted


class Blocks:
    def __init__(self, pages: Pages, reclaimable: int) -> None:
        self.pages = pages
        self.num_reclaimable_pages = reclaimable


class Scheduler:
    def __init__(self, num_requests: int) -> None:
        self.requests = {f"r{i}": None for i in range(num_requests)}


class Logged:  # the fence and the output reservation: their calls are logged
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("fence.record")

    def begin_step(self) -> None:
        self.log.append("reservation.begin_step")


SETTINGS = (EngineSettings(), VllmSettings())  # read once: the hooks never read them


class Runtime(_runtime.VllmRuntime):
    """The real runtime's hooks; the safe point (a pass, a state refresh) only logged."""

    def __init__(self, log: list[Any], safe_point_fails: bool) -> None:
        super().__init__(*SETTINGS)
        self.log = log
        self.safe_point_fails = safe_point_fails

    def safe_point(self, scheduler: Any = None) -> None:  # type: ignore[override]
        self.log.append("safe_point")
        if self.safe_point_fails:
            raise RuntimeError("the safe point failed")

    def begin_schedule(self, scheduler: Any) -> None:
        self.log.append("begin_schedule")
        super().begin_schedule(scheduler)

    def end_schedule(self) -> None:
        self.log.append("end_schedule")
        super().end_schedule()

    def begin_update(self) -> None:
        self.log.append("begin_update")
        super().begin_update()

    def end_update(self) -> None:
        self.log.append("end_update")
        super().end_update()


FIELDS = {  # every input of both gates, with values on both sides of each test
    "pool": ["quiet", "none", "cleanup_due"],
    "scheduler": ["same", "other", "none"],
    "woken": [False, True],
    "steady": [True, False],
    "refused_blocks": [0, 3],
    "device_refused": [False, True],
    "seen_refused": [False, True],
    "seen_device_refused": [False, True],
    "reservation": [False, True],
    "fence": [False, True],
    "events_moved": [False, True],
    "mapped_moved": [False, True],
    "reclaimable_moved": [False, True],
    "device_full": [None, "now"],
    "seen_device_full": [False, True],
    "reserve": [0, 2],
    "reserve_wanted": [0, 1],
    "requests_moved": [False, True],
    "refresh_due": ["later", "past"],
    "freed_in_update": [False, True],
    "outcome": ["returns", "raises"],
    "safe_point_fails": [False, True],
}
QUIET = {name: values[0] for name, values in FIELDS.items()}  # every gate holds
HOOKS = ("begin_schedule", "end_schedule", "begin_update", "end_update")


def _build(case: dict[str, Any], scheduler: Scheduler) -> Runtime:
    log: list[Any] = []
    runtime = Runtime(log, case["safe_point_fails"])
    now = time.monotonic()
    pages = Pages(40, None if case["device_full"] is None else now, case["reserve"], 0)
    pages.wanted = case["reserve_wanted"]
    blocks = Blocks(pages, 7)
    runtime._blocks, runtime._pages = blocks, pages
    if case["pool"] != "none":
        runtime.pool = Pool(log, case["pool"] == "cleanup_due")  # type: ignore[assignment]
    runtime._scheduler = {"same": scheduler, "other": Scheduler(0), "none": None}[case["scheduler"]]
    runtime._woken = case["woken"]
    runtime._steady = case["steady"]
    runtime._refused_blocks = case["refused_blocks"]
    runtime._device_refused = case["device_refused"]
    runtime._reservation = Logged(log) if case["reservation"] else None  # type: ignore[assignment]
    runtime._fence = Logged(log) if case["fence"] else None
    # the counts below move with nearly every step; neither gate reads them (the
    # periodic refresh and the idle hook do): moving them must change nothing here
    runtime._demand_events = 5 + case["events_moved"]
    blocks.num_reclaimable_pages += case["reclaimable_moved"]
    if case["requests_moved"]:
        scheduler.requests["arrived"] = None
    runtime._seen_mapped = 40 + case["mapped_moved"]
    runtime._seen_device_full = case["seen_device_full"]
    runtime._seen_refused = case["seen_refused"]
    runtime._seen_device_refused = case["seen_device_refused"]
    runtime._refresh_due = now + 3600 if case["refresh_due"] == "later" else now - 1
    runtime._freed_in_update = case["freed_in_update"]
    return runtime


def _observe(runtime: Runtime, scheduler: Scheduler) -> tuple[Any, ...]:
    pool = runtime.pool
    flags = None if pool is None else (pool.in_schedule, pool.overdraft, pool.cleanup_due)
    return (
        tuple(e for e in runtime.log if e not in HOOKS),  # effects, not which code ran them
        flags,
        runtime._scheduler is scheduler,
        runtime._refused_blocks,
        runtime._device_refused,
        runtime._demand_events,
        runtime._in_update,
        runtime._freed_in_update,
    )


def _original(runtime_cell: list[Runtime], outcome: str) -> Any:
    def method(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        runtime = runtime_cell[0]
        pool = runtime.pool
        flags = None if pool is None else (pool.in_schedule, pool.overdraft)
        runtime.log.append(("vllm", args, tuple(sorted(kwargs.items())), flags, runtime._in_update))
        if outcome == "raises":
            raise ValueError("vLLM's method failed")
        return ("output", args)

    return method


def _run(replacement_of: Any, kind: str, case: dict[str, Any], args: tuple[Any, ...]) -> Any:
    scheduler = Scheduler(3)
    runtime = _build(case, scheduler)
    cell = [runtime]
    replacement = replacement_of(_original(cell, case["outcome"]))
    _runtime._runtime = runtime  # type: ignore[misc]
    try:
        result: Any = ("returned", replacement(scheduler, *args))
    except Exception as exc:  # noqa: BLE001 -- compared below
        context = exc.__context__
        result = (
            "raised",
            type(exc),
            str(exc),
            None if context is None else (type(context), str(context)),
        )
    finally:
        _runtime._runtime = None  # type: ignore[misc]
    return result, _observe(runtime, scheduler)


def _patches(kind: str) -> tuple[Any, Any]:
    patch = _runtime.schedule_patch if kind == "schedule" else _runtime.update_from_output_patch
    return patch, lambda original: patch(original, in_c=False)


@pytest.fixture(autouse=True)
def _no_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "_runtime", None)


@pytest.mark.parametrize("kind", ["schedule", "update_from_output"])
def test_c_and_python_brackets_do_the_same(kind: str) -> None:
    c_patch, python_patch = _patches(kind)
    assert type(c_patch(_original([], "returns"))) is StepHook
    assert type(python_patch(_original([], "returns"))) is not StepHook
    cases = each_moved_and_random(FIELDS, 17, 3000)
    argument_sets: list[tuple[Any, ...]] = [(), (True,), ("output", "runner output")]
    for i, case in enumerate(cases):
        args = argument_sets[i % len(argument_sets)]
        got_c = _run(c_patch, kind, case, args)
        got_python = _run(python_patch, kind, case, args)
        assert got_c == got_python, case


def test_a_quiet_step_calls_no_python_hook() -> None:
    """The point of it: with every gate holding, neither hook's Python method runs."""
    for kind in ("schedule", "update_from_output"):
        c_patch, python_patch = _patches(kind)
        calls: dict[str, list[Any]] = {}
        for name, patch in (("c", c_patch), ("python", python_patch)):
            scheduler = Scheduler(3)
            runtime = _build(QUIET, scheduler)
            _runtime._runtime = runtime  # type: ignore[misc]
            assert patch(_original([runtime], "returns"))(scheduler)[0] == "output"
            _runtime._runtime = None  # type: ignore[misc]
            calls[name] = list(runtime.log)
            flags = (runtime.pool.in_schedule, runtime.pool.overdraft)  # type: ignore[union-attr]
            assert flags == (False, False)  # lowered again after vLLM's method
        assert [e for e in calls["c"] if isinstance(e, str)] == []
        assert [e for e in calls["python"] if isinstance(e, str)] == [
            *(["begin_schedule", "end_schedule"] if kind == "schedule" else []),
            *(["begin_update", "end_update"] if kind == "update_from_output" else []),
        ]
        flags_in_vllm = calls["c"][0][3]
        assert flags_in_vllm == ((True, True) if kind == "schedule" else (False, False))
        assert calls["c"][0][4] is (kind == "update_from_output")  # _in_update while it runs


@pytest.mark.parametrize("moved", ["events_moved", "reclaimable_moved", "requests_moved"])
def test_counts_that_move_alone_wait_for_the_periodic_refresh(moved: str) -> None:
    """Admissions, finishes and arrivals move the demand counts and the evictable
    figures at nearly every step: the end of schedule() refreshes them only when
    the last refresh is DEMAND_MAX_AGE_S old (or something exact moved), in C and in
    Python alike; once it is, the safe point runs."""
    for patch in _patches("schedule"):
        for due, expected in (("later", []), ("past", ["safe_point"])):
            scheduler = Scheduler(3)
            runtime = _build({**QUIET, moved: True, "refresh_due": due}, scheduler)
            _runtime._runtime = runtime  # type: ignore[misc]
            try:
                patch(_original([runtime], "returns"))(scheduler)
            finally:
                _runtime._runtime = None  # type: ignore[misc]
            assert [e for e in runtime.log if e == "safe_point"] == expected, (patch, due)


@pytest.mark.parametrize(
    "case, during",
    [
        ({}, {"_refused_blocks": 3}),  # an admission refused: waiting_reason appears at once
        ({"seen_refused": True}, {}),  # no refusal this step: it goes at once
        ({}, {"_refused_blocks": 3, "_device_refused": True}),  # the device refused
        ({"mapped_moved": True}, {}),  # mapped bytes follow /proc at every step
    ],
)
def test_what_must_be_exact_refreshes_at_the_end_of_that_step(
    case: dict[str, Any], during: dict[str, Any]
) -> None:
    for patch in _patches("schedule"):
        scheduler = Scheduler(3)
        runtime = _build({**QUIET, **case}, scheduler)
        original = _original([runtime], "returns")

        def schedule(
            self: Scheduler, *args: Any, _runtime_: Runtime = runtime, _original: Any = original
        ) -> Any:
            for name, value in during.items():  # what allocate_slots records in the step
                setattr(_runtime_, name, value)
            return _original(self, *args)

        _runtime._runtime = runtime  # type: ignore[misc]
        try:
            patch(schedule)(scheduler)
        finally:
            _runtime._runtime = None  # type: ignore[misc]
        assert "safe_point" in runtime.log, (patch, case, during)


def test_without_a_runtime_vllms_method_is_called_as_given() -> None:
    calls: list[Any] = []

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((self, args, kwargs))
        return "out"

    for kind in ("schedule", "update_from_output"):
        hook = StepHook(method, vars(_runtime), kind)
        assert hook("sched", 1, k=2) == "out"
        with pytest.raises(TypeError):
            hook()  # no scheduler: vLLM's own error
    assert calls == [("sched", (1,), {"k": 2})] * 2


def test_a_runtime_of_another_class_has_its_methods_called() -> None:
    """A runtime that is no StepState (a test double, another adapter's) gets the Python
    protocol: each hook called, in order, around vLLM's method."""
    log: list[str] = []

    class Plain:
        def begin_schedule(self, scheduler: Any) -> None:
            log.append(f"begin_schedule {scheduler}")

        def end_schedule(self) -> None:
            log.append("end_schedule")

        def begin_update(self) -> None:
            log.append("begin_update")

        def end_update(self) -> None:
            log.append("end_update")

    def method(self: Any) -> str:
        log.append("vllm")
        return "out"

    _runtime._runtime = Plain()  # type: ignore[misc,assignment]
    assert StepHook(method, vars(_runtime), "schedule")("s") == "out"
    assert StepHook(method, vars(_runtime), "update_from_output")("s") == "out"
    assert log == ["begin_schedule s", "vllm", "end_schedule", "begin_update", "vllm", "end_update"]


def test_it_binds_as_vllms_method_did() -> None:
    def schedule(self: Any, throttle_prefills: bool = False) -> Any:
        return (self, throttle_prefills)

    hook = _runtime.schedule_patch(schedule)

    class Sched:
        pass

    Sched.schedule = hook  # type: ignore[attr-defined]
    sched = Sched()
    assert sched.schedule(True) == (sched, True)  # type: ignore[attr-defined]
    assert sched.schedule.__self__ is sched  # type: ignore[attr-defined]
    assert Sched.schedule is hook  # type: ignore[attr-defined]
    assert hook.__wrapped__ is schedule and hook.__name__ == "schedule"
    hook.__kvsidecar_patch__ = True
    assert hook.__dict__ == {"__kvsidecar_patch__": True}


def test_it_refuses_what_it_cannot_call() -> None:
    with pytest.raises(TypeError, match="callable"):
        StepHook(None, vars(_runtime), "schedule")
    with pytest.raises(ValueError, match="'schedule' or 'update_from_output'"):
        StepHook(print, vars(_runtime), "step")
    with pytest.raises(TypeError):
        StepHook(print, "not a dict", "schedule")
    with pytest.raises(TypeError, match="keyword"):
        StepHook(print, vars(_runtime), "schedule", extra=1)


def test_it_leaks_no_references() -> None:
    scheduler = Scheduler(3)
    runtimes = {
        name: _build({**QUIET, **change}, scheduler)
        for name, change in (
            ("quiet", {}),
            ("safe point", {"steady": False, "freed_in_update": True}),
            ("fails", {"steady": False, "outcome": "raises", "safe_point_fails": True}),
        )
    }
    hooks = {
        (name, kind): patch(_original([runtime], "returns" if name != "fails" else "raises"))
        for name, runtime in runtimes.items()
        for kind, patch in (
            ("schedule", _runtime.schedule_patch),
            ("update", _runtime.update_from_output_patch),
        )
    }
    objects = [scheduler, *runtimes.values(), *hooks.values()]

    def calls() -> None:
        for (name, _), hook in hooks.items():
            runtime = runtimes[name]
            _runtime._runtime = runtime  # type: ignore[misc]
            runtime._steady = name == "quiet"
            runtime._freed_in_update = name != "quiet"
            try:
                hook(scheduler, True)
            except (ValueError, RuntimeError):
                pass
            runtime.log.clear()
        _runtime._runtime = None  # type: ignore[misc]

    calls()
    gc.collect()
    refs = [sys.getrefcount(o) for o in objects]
    tracemalloc.start()
    try:
        for _ in range(500):
            calls()
        gc.collect()
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(5000):
            calls()
        gc.collect()
        second, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(o) for o in objects] == refs
    assert second - first < 64 << 10, (first, second)


def test_a_real_engines_decode_steps_take_the_c_path(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On vLLM's real scheduler, pool, allocators and runtime, most steps of a decode run
    call no Python bracket: the gate in C reads the real objects' fields. (A field
    renamed on either side would send every step to the Python hooks: still correct,
    silently slower; this test is what notices.)"""
    from vllm.v1.core.sched.scheduler import Scheduler

    calls: Counter[str] = Counter()
    for name in HOOKS:
        original = getattr(_runtime.VllmRuntime, name)

        def counted(self: Any, *args: Any, _name: str = name, _original: Any = original) -> Any:
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(_runtime.VllmRuntime, name, counted)
    core = build_core(plugin_env)
    try:
        assert type(Scheduler.__dict__["schedule"]) is StepHook
        assert type(Scheduler.__dict__["update_from_output"]) is StepHook
        for i in range(4):  # four requests decoding side by side for 48 steps
            prompt = [100 + 7 * i + t for t in range(40)]
            core.add_request(*core.preprocess_add_request(make_request(f"d{i}", prompt, 48)))
        steps = 0
        while core.scheduler.has_requests():
            core.step()
            steps += 1
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.instance is not None
        assert runtime.instance.state().status.value == "applied"
    finally:
        core.shutdown()
    assert steps >= 48
    # the steps that admit, map a page or finish run the Python hooks; the rest do not
    for name in HOOKS:
        assert calls[name] <= steps // 3, (name, calls, steps)
