"""``allocate_slots``' plain admission in C (``_block_speedups.RunningAllocate``).

An admission (a waiting or preempted request) with no limit and no output
reservation, the common one, runs in C: the pool's flags for an admission
around vLLM's method, a device refusal as ``None`` (the prefix hits given back
when the request held nothing), the demand event and the prefix-hit window.
A refusal goes to the runtime's ``_refused_admission``; anything else (a
limit, a reservation, another pool, a running request) to the Python
replacement. Here the C replacement and the pure-Python one get the same
runtime over random combinations of every input the admission reads, and must
leave the same trace: the same calls of vLLM's method (with the flags it saw),
the same frees, flags, counters, hit window, refusal fields, result or
exception. vLLM's real manager runs through it in every vLLM test of the suite.
"""

from __future__ import annotations

import gc
import sys
import types
from collections import defaultdict
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from support.cases import each_moved_and_random
from test_running_allocate import CALLS as RUNNING_CALLS
from test_running_allocate import _original
from test_running_allocate import _replacements as replacements_of
from vllm.v1.request import RequestStatus

from engine_ext import EngineSettings
from engine_ext.vllm import _block_speedups, _runtime
from engine_ext.vllm._pool_backing import DeviceFullError
from engine_ext.vllm._settings import VllmSettings

RunningAllocate = _block_speedups.RunningAllocate

pytestmark = pytest.mark.vllm

SETTINGS = (EngineSettings(), VllmSettings())


class Pages:
    def __init__(self, target_pages: int | None) -> None:
        self.target_pages = target_pages


class Pool:  # stands for ElasticBlockPool: what allocating reads and writes
    hash_block_size = 16

    def __init__(self, pages: Pages, overdraft: bool, in_schedule: bool, full: bool) -> None:
        self.pages = pages
        self.overdraft = overdraft
        self.in_schedule = in_schedule
        self.full = full

    def device_full(self) -> bool:
        return self.full

    def blocks_target(self) -> int | None:
        return self.pages.target_pages


class Table:  # a mapping that is no dict: its own get()
    def __init__(self, entries: dict[str, list[Any]]) -> None:
        self.entries = entries

    def get(self, key: str, default: Any = None) -> Any:
        return self.entries.get(key, default)


class Single:
    def __init__(self, table: Any) -> None:
        self.req_to_blocks = table


class Coordinator:
    def __init__(self, singles: list[Single]) -> None:
        self.single_type_managers = singles


class Request:
    def __init__(self, status: Any, num_tokens: int) -> None:
        self.status = status
        self.request_id = "req"
        self.num_tokens = num_tokens
        self.num_computed_tokens = 0


class Manager:
    def __init__(self, pool: Pool, coordinator: Coordinator, outcome: Any) -> None:
        self.block_pool = pool
        self.coordinator = coordinator
        self._outcome = outcome
        self.log = self.calls = CallLog(pool)  # vLLM's calls and the frees, in order

    @property
    def outcome(self) -> Any:  # a new exception each call (a raised instance keeps
        if isinstance(self._outcome, BaseException):  # every traceback it had)
            return type(self._outcome)(*self._outcome.args)
        return self._outcome

    def free(self, request: Request) -> None:
        pool = self.block_pool
        list.append(self.log, ("free", request.request_id, pool.overdraft, pool.in_schedule))


class Scheduler:
    def __init__(self, waiting: list[Request]) -> None:
        self.waiting = waiting
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}


class CallLog(list[Any]):
    """``Manager.calls`` for vLLM's method of test_running_allocate (its signature is
    vLLM 0.33's, so the patch builds its fast Python form): each call's arguments
    with the pool's two flags as the call saw them."""

    def __init__(self, pool: Pool) -> None:
        super().__init__()
        self.pool = pool

    def append(self, call: Any) -> None:
        super().append(("vllm", call, self.pool.overdraft, self.pool.in_schedule))


class Runtime(_runtime.VllmRuntime):
    """The real runtime; ``allocating`` (the Python admission) counted."""

    def __init__(self) -> None:
        super().__init__(*SETTINGS)
        self.python_admissions = 0

    def allocating(self, *args: Any, **kwargs: Any) -> Any:
        self.python_admissions += 1
        return super().allocating(*args, **kwargs)


CALLS = [  # (args after the request, kwargs): test_running_allocate's, and hits passed
    *RUNNING_CALLS,  # every other way (a prefix hit and KV-connector tokens, positional)
    ((40, 16, "hits", 0, 8, False, 0, False, 0, True, ()), {}),
    ((40, 16), {"num_external_computed_tokens": 8}),
    ((), {"num_new_tokens": 4, "num_new_computed_tokens": 48}),
]
FIELDS = {
    "status": ["waiting", "preempted", "running"],
    "runtime": ["set", "none"],
    "manager_pool": ["runtime's", "other"],
    "target": [None, 3],
    "overdraft": [False, True],
    "in_schedule": [False, True],
    "table": ["defaultdict", "dict", "mapping"],
    "held": ["no entry", "empty", "blocks"],
    "groups": [1, 2],
    "outcome": ["blocks", None, "device full", "value error"],
    "device_full": [False, True],
    "call": list(range(len(CALLS))),
    "prior_hits": [0, 3],
}
PLAIN = {name: values[0] for name, values in FIELDS.items()}


def _build(case: dict[str, Any]) -> tuple[Runtime | None, Manager, Request, tuple, dict]:
    runtime = Runtime()
    pool = Pool(Pages(case["target"]), case["overdraft"], case["in_schedule"], case["device_full"])
    runtime.pool = pool  # type: ignore[assignment]
    runtime._pages = pool.pages
    waiting = [Request(RequestStatus.WAITING, 40), Request(RequestStatus.WAITING, 70)]
    runtime._scheduler = Scheduler(waiting)
    for _ in range(case["prior_hits"]):
        runtime._hits.record(10, 100)
    entries = {"no entry": {}, "empty": {"req": []}, "blocks": {"req": ["b0"]}}[case["held"]]
    singles = []
    for group in range(case["groups"]):
        mine = entries if group == case["groups"] - 1 else {}
        table: Any = {
            "defaultdict": lambda e: defaultdict(list, e),
            "dict": dict,
            "mapping": Table,
        }[case["table"]](dict(mine))
        singles.append(Single(table))
    outcome: Any = {
        "blocks": "new blocks",
        None: None,
        "device full": DeviceFullError("the device is out of memory"),
        "value error": ValueError("vLLM's own error"),
    }[case["outcome"]]
    manager_pool = (
        pool if case["manager_pool"] == "runtime's" else Pool(Pages(None), False, False, False)
    )
    manager = Manager(manager_pool, Coordinator(singles), outcome)
    status = {
        "waiting": RequestStatus.WAITING,
        "preempted": RequestStatus.PREEMPTED,
        "running": RequestStatus.RUNNING,
    }[case["status"]]
    request = Request(status, 90)
    args, kwargs = CALLS[case["call"]]
    return (runtime if case["runtime"] == "set" else None), manager, request, args, kwargs


def _observe(runtime: Runtime, manager: Manager) -> tuple[Any, ...]:
    pool = runtime.pool
    assert pool is not None
    return (
        manager.log,
        (pool.overdraft, pool.in_schedule),
        runtime._demand_events,
        runtime._refused_blocks,
        runtime._device_refused,
        runtime._hits.rate,
        runtime._hits.changes,
    )


def _run(replacement: Any, case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    runtime, manager, request, args, kwargs = _build(case)
    observed_runtime = runtime or Runtime()
    if runtime is None:  # the pool the observation reads: the manager's own
        observed_runtime.pool = manager.block_pool  # type: ignore[assignment]
    monkeypatch.setattr(_runtime, "_runtime", runtime)
    try:
        result: Any = ("returned", replacement(manager, request, *args, **kwargs))
    except Exception as exc:  # noqa: BLE001 -- compared below
        result = ("raised", type(exc), str(exc))
    python = observed_runtime.python_admissions
    return (result, _observe(observed_runtime, manager)), python


def _replacements(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    return replacements_of(_original, monkeypatch, Pool)


def _plain(case: dict[str, Any]) -> bool:
    """What the C admission runs for (everything else goes to Python)."""
    return (
        case["status"] != "running"
        and case["runtime"] == "set"
        and case["manager_pool"] == "runtime's"
        and case["target"] is None
    )


def test_c_and_python_admissions_do_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    c_version, python_version = _replacements(monkeypatch)
    cases = each_moved_and_random(FIELDS, 23, 3000)
    in_c = 0
    for case in cases:
        got_c, python_c = _run(c_version, case, monkeypatch)
        got_python, python_python = _run(python_version, case, monkeypatch)
        assert got_c == got_python, case
        running_fast = case["status"] == "running" and case["overdraft"]
        if _plain(case) and not running_fast:
            assert python_c == 0, case  # it ran in C
            in_c += 1
        elif case["runtime"] == "set" and case["manager_pool"] == "runtime's" and not running_fast:
            assert python_c == python_python == 1, case  # Python's allocating, as before
    assert in_c > 200  # (about one random case in twelve is a plain admission)


def test_a_plain_admission_records_what_python_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fields themselves (not only their equality): flags while vLLM ran, put back
    after; one demand event; the hit window fed the hit tokens of the call."""
    c_version, _ = _replacements(monkeypatch)
    runtime, manager, request, args, kwargs = _build({**PLAIN, "call": 1})  # vLLM's waiting loop
    assert runtime is not None
    monkeypatch.setattr(_runtime, "_runtime", runtime)
    events = runtime._demand_events
    assert c_version(manager, request, *args, **kwargs) == "new blocks"
    assert manager.log[0][-2:] == (False, True)  # an admission: no overdraft, in schedule
    assert (runtime.pool.overdraft, runtime.pool.in_schedule) == (False, False)  # type: ignore[union-attr]
    assert runtime._demand_events == events + 1
    assert runtime._hits.changes == 1 and runtime._hits.rate == pytest.approx(32 / 90)
    assert runtime.python_admissions == 0


def test_a_device_refusal_gives_the_hits_back_and_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c_version, _ = _replacements(monkeypatch)
    runtime, manager, request, args, kwargs = _build({**PLAIN, "outcome": "device full"})
    assert runtime is not None
    monkeypatch.setattr(_runtime, "_runtime", runtime)
    assert c_version(manager, request, *args, **kwargs) is None
    assert manager.log[-1] == ("free", "req", False, True)  # inside the call's flags
    assert runtime._device_refused is True
    assert runtime._refused_blocks > 0  # the refused request and the waiting queue
    assert runtime.python_admissions == 0


def test_it_leaks_no_references(monkeypatch: pytest.MonkeyPatch) -> None:
    c_version, _ = _replacements(monkeypatch)
    for outcome in ("blocks", None, "device full", "value error"):
        runtime, manager, request, args, kwargs = _build({**PLAIN, "outcome": outcome})
        monkeypatch.setattr(_runtime, "_runtime", runtime)
        watched = (runtime, manager, request, manager.block_pool)
        for _ in range(3):  # warm: caches and interned objects settle
            try:
                c_version(manager, request, *args, **kwargs)
            except ValueError:
                pass
        gc.collect()
        before = [sys.getrefcount(obj) for obj in watched]
        for _ in range(200):
            try:
                c_version(manager, request, *args, **kwargs)
            except ValueError:
                pass
        manager.log.clear()
        gc.collect()
        assert [sys.getrefcount(obj) for obj in watched] == before, outcome


class TokenRequest:
    """A request whose ``num_tokens`` is vLLM's shape, ``len(self.tokens)``, and counts
    its reads (the C admission reads the list's length instead, where it may)."""

    reads = 0

    def __init__(self, status: Any, tokens: Any) -> None:
        self.status = status
        self.request_id = "req"
        self.num_computed_tokens = 0
        self.tokens = tokens

    @property
    def num_tokens(self) -> int:
        type(self).reads += 1
        return len(self.tokens)


class TokenRequestChild(TokenRequest):
    """Another class: its property may say anything, so it is called."""


@pytest.mark.parametrize(
    ("request_class", "tokens", "property_reads"),
    [
        (TokenRequest, list(range(90)), 0),  # the list's length, no property call
        (TokenRequest, tuple(range(90)), 1),  # not a list: the property
        (TokenRequestChild, list(range(90)), 1),  # not exactly the class checked
    ],
)
def test_the_admission_reads_the_token_lists_length_only_where_checked(
    monkeypatch: pytest.MonkeyPatch, request_class: type, tokens: Any, property_reads: int
) -> None:
    monkeypatch.setattr(_runtime, "num_tokens_list", lambda: (TokenRequest, "tokens"))
    c_version, python_version = _replacements(monkeypatch)
    seen = []
    for version in (c_version, python_version):
        runtime, manager, _, args, kwargs = _build({**PLAIN, "call": 1})
        assert runtime is not None
        monkeypatch.setattr(_runtime, "_runtime", runtime)
        request = request_class(RequestStatus.WAITING, tokens)
        request_class.reads = 0  # type: ignore[attr-defined]
        assert version(manager, request, *args, **kwargs) == "new blocks"
        reads = request_class.reads  # type: ignore[attr-defined]
        assert reads == (property_reads if version is c_version else 1)
        assert runtime.python_admissions == (0 if version is c_version else 1)
        seen.append((runtime._hits.rate, runtime._hits.changes, runtime._demand_events))
        if version is c_version:  # no reference leaked on this path either
            gc.collect()
            before = [sys.getrefcount(obj) for obj in (request, request.tokens)]
            for _ in range(200):
                version(manager, request, *args, **kwargs)
            gc.collect()
            assert [sys.getrefcount(obj) for obj in (request, request.tokens)] == before
            assert runtime._hits.changes == 201
    assert seen[0] == seen[1] and seen[0][:2] == (pytest.approx(32 / 90), 1)


def test_num_tokens_list_accepts_only_the_length_of_one_attribute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.request import Request as VllmRequest

    assert _runtime.num_tokens_list() == (VllmRequest, "_all_token_ids")  # vLLM 0.33
    for other in [
        property(lambda self: len(self._all_token_ids) + 1),  # not only the length
        VllmRequest.__dict__["num_tokens_with_spec"],  # two lists
        property(lambda self: self.num_prompt_tokens),  # no len()
        42,  # no property at all
    ]:
        monkeypatch.setattr(VllmRequest, "num_tokens", other)
        assert _runtime.num_tokens_list() is None, other
    shape = property(lambda self: len(self.spec_token_ids))  # the shape: the list it reads
    monkeypatch.setattr(VllmRequest, "num_tokens", shape)
    assert _runtime.num_tokens_list() == (VllmRequest, "spec_token_ids")

    def same_code(self: Any) -> int:
        return len(self._all_token_ids)

    # the same code with len shadowed in the globals it runs in
    shadowed = types.FunctionType(same_code.__code__, {"len": lambda seq: 0})
    monkeypatch.setattr(VllmRequest, "num_tokens", property(shadowed))
    assert _runtime.num_tokens_list() is None
    with pytest.raises(TypeError, match="num_tokens_list"):
        RunningAllocate(_original, Pool, RequestStatus.RUNNING, _original, ValueError, {}, (1, 2))
