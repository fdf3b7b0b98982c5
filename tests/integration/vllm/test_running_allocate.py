"""``allocate_slots``' running-request path: inlined, in C (``_block_speedups.RunningAllocate``).

The plugin replaces vLLM's ``KVCacheManager.allocate_slots``; the common call (a
RUNNING request extending while the pool's overdraft flag is up) runs in a copy
of vLLM's method with the check compiled in (engine_ext._inline), or, where no
copy can be made, in C. Here the inlined copy, the C replacement and the
pure-Python one (what runs without the C module) get the same calls, every
combination of the checks, positional and keyword arguments, bound and
unbound, and must do the same: call the same function with the same
arguments, return the same value, raise the same error. vLLM's real
manager and scheduler run through it in every vLLM test of the suite.
"""

from __future__ import annotations

import gc
import itertools
import sys
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from vllm.v1.request import RequestStatus

from engine_ext.vllm import _block_speedups, _runtime
from engine_ext.vllm._pool_backing import DeviceFullError

RunningAllocate = _block_speedups.RunningAllocate

pytestmark = pytest.mark.vllm


class Pool:  # stands for ElasticBlockPool: the type is what the check compares
    def __init__(self, overdraft: Any) -> None:
        self.overdraft = overdraft


class OtherPool(Pool):  # a subclass is another pool class (the check is `type(pool) is`)
    pass


@dataclass
class Request:
    status: Any
    request_id: str = "r"


@dataclass
class Manager:
    block_pool: Any
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    outcome: Any = "blocks"  # returned, or raised when an exception


def _original(
    self: Manager,
    request: Any,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Any = None,
    num_lookahead_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
    full_sequence_must_fit: bool = False,
    reserved_blocks: int = 0,
    has_scheduled_reqs: bool = True,
    skip_zeroing_group_ids: tuple[int, ...] = (),
) -> Any:
    """vLLM 0.33's signature (the patch's fast Python form is built for it)."""
    self.calls.append(
        (
            request.request_id,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )
    )
    if isinstance(self.outcome, BaseException):
        raise self.outcome
    return self.outcome


def _original_any(self: Manager, request: Any, *args: Any, **kwargs: Any) -> Any:
    """Another signature (a patch release): the patch's generic Python form."""
    return _original(self, request, *args, **kwargs)


def _replacements(
    original: Any, monkeypatch: pytest.MonkeyPatch, pool_class: type = Pool
) -> tuple[Any, Any]:
    """The patch in C and in pure Python (what runs without the C module), both as
    wrappers (``inline=False``: what runs when the source cannot be inlined)."""
    c_version = _runtime.allocate_slots_patch(original, pool_class, inline=False)
    with monkeypatch.context() as m:
        m.setattr(_runtime, "RunningAllocate", None)
        python_version = _runtime.allocate_slots_patch(original, pool_class, inline=False)
    assert type(c_version) is RunningAllocate
    assert type(python_version) is not RunningAllocate
    return c_version, python_version


def _outcome(call: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "returned", call(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- compared below
        return "raised", (type(exc), str(exc))


CALLS = [  # (args after the request, kwargs): as vLLM's two call sites pass them, and others
    ((5,), {"num_lookahead_tokens": 2}),  # the running loop
    (
        (7,),
        {
            "num_new_computed_tokens": 32,
            "new_computed_blocks": "hits",
            "num_lookahead_tokens": 0,
            "num_external_computed_tokens": 0,
            "delay_cache_blocks": False,
            "num_encoder_tokens": 0,
            "full_sequence_must_fit": False,
            "reserved_blocks": 3,
        },
    ),  # the waiting loop
    ((1, 2, None, 0, 0, False, 0, False, 0, True, ()), {}),  # every parameter positional
    ((), {"num_new_tokens": 4}),
]


def _inlined(original: Any, pool_class: type = Pool) -> Any:
    """The patch as the plugin installs it: the running path compiled into a copy of
    ``original`` (engine_ext._inline) where its signature is vLLM 0.33's, else the C one."""
    patched = _runtime.allocate_slots_patch(original, pool_class)
    if original is _original:
        assert type(patched) is type(original) and patched is not original
        assert patched.__code__ is not original.__code__ and patched.__wrapped__ is original
    else:  # another signature: the guard names 0.33's parameters, so no copy
        assert type(patched) is RunningAllocate
    return patched


@pytest.mark.parametrize("original", [_original, _original_any])
def test_c_python_and_inlined_replacements_do_the_same(
    original: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_runtime, "_runtime", None)  # no engine: admissions call the original
    c_version, python_version = _replacements(original, monkeypatch)
    inlined = _inlined(original)
    statuses = [RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED]
    pools = [Pool, OtherPool]
    overdrafts = [True, False, 1, 0]
    outcomes: list[Any] = ["blocks", None, DeviceFullError("device full"), ValueError("bad")]
    checked = 0
    for status, pool_cls, overdraft, outcome, (args, kwargs) in itertools.product(
        statuses, pools, overdrafts, outcomes, CALLS
    ):
        results = []
        for replacement in (c_version, python_version, inlined):
            manager = Manager(pool_cls(overdraft), outcome=outcome)
            request = Request(status)
            got = _outcome(replacement, manager, request, *args, **kwargs)
            results.append((got, manager.calls))
        case = (status, pool_cls, overdraft, outcome, args, kwargs)
        assert results[0] == results[1] == results[2], case
        checked += 1
    # the fast path's refusal: a full device is None (vLLM waits or preempts), and only there
    for replacement in (c_version, inlined):
        manager = Manager(Pool(True), outcome=DeviceFullError("full"))
        assert replacement(manager, Request(RequestStatus.RUNNING), 3) is None
        manager = Manager(Pool(False), outcome=DeviceFullError("full"))
        with pytest.raises(DeviceFullError):
            replacement(manager, Request(RequestStatus.RUNNING), 3)
    assert checked == len(statuses) * len(pools) * len(overdrafts) * len(outcomes) * len(CALLS)


def test_a_broken_call_fails_as_the_python_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "_runtime", None)
    c_version, python_version = _replacements(_original, monkeypatch)
    inlined = _inlined(_original)
    broken = [
        lambda f: f(Manager(Pool(True)), object(), 3),  # a request without a status
        lambda f: f(object(), Request(RequestStatus.RUNNING), 3),  # a manager without a pool
        lambda f: f(Manager(Pool(True)), Request(RequestStatus.RUNNING)),  # tokens missing
        lambda f: f(Manager(Pool(True)), Request(RequestStatus.RUNNING), 3, bogus=1),
        lambda f: f(Manager(Pool(True))),  # too few arguments for the check
    ]
    for call in broken:
        got_c, got_python = _outcome(call, c_version), _outcome(call, python_version)
        got_inlined = _outcome(call, inlined)
        assert got_c[0] == got_python[0] == got_inlined[0] == "raised"
        assert got_c[1][0] is got_python[1][0] is got_inlined[1][0]


def test_it_binds_as_vllms_method_did(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "_runtime", None)
    c_version, _ = _replacements(_original, monkeypatch)

    class KVCacheManager(Manager):
        allocate_slots = c_version

    manager = KVCacheManager(Pool(True))
    running = Request(RequestStatus.RUNNING, "a")
    assert manager.allocate_slots(running, 5, num_lookahead_tokens=1) == "blocks"  # method call
    bound = manager.allocate_slots  # looked up on the instance: bound to it
    assert bound.__self__ is manager and bound(running, 6) == "blocks"
    assert KVCacheManager.allocate_slots is c_version  # on the class: itself
    assert KVCacheManager.allocate_slots(manager, running, 7) == "blocks"
    assert [call[:2] for call in manager.calls] == [("a", 5), ("a", 6), ("a", 7)]
    assert manager.calls[0][4] == 1  # the keyword reached the original
    assert c_version.__wrapped__ is _original
    assert c_version.__name__ == "_original"
    c_version.__kvsidecar_patch__ = True  # the patch table marks its replacements so
    assert c_version.__dict__ == {"__kvsidecar_patch__": True}


def test_vllms_own_method_is_inlined() -> None:
    """On vLLM 0.33 the installed patch is the copy (not the C wrapper): a vLLM whose
    source no longer matches its code, or a change here that breaks the copy, fails
    this test instead of slowing every step unseen."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from engine_ext.vllm._block_pool import ElasticBlockPool

    original = KVCacheManager.__dict__["allocate_slots"]
    original = getattr(original, "__wrapped__", original)  # as vLLM has it
    patched = _runtime.allocate_slots_patch(original, ElasticBlockPool)
    assert type(patched) is type(original) and patched.__wrapped__ is original
    code, vllms = patched.__code__, original.__code__
    assert (code.co_filename, code.co_firstlineno) == (vllms.co_filename, vllms.co_firstlineno)
    assert set(code.co_freevars) == {
        "_kvs_running",
        "_kvs_pool_class",
        "_kvs_other",
        "_kvs_device_full",
    }
    assert type(patched.__closure__[code.co_freevars.index("_kvs_other")].cell_contents) is (
        RunningAllocate
    )  # everything but the running path: the C wrapper, as before
    assert patched.__qualname__ == original.__qualname__ == "KVCacheManager.allocate_slots"


def test_it_refuses_what_it_cannot_call() -> None:
    with pytest.raises(TypeError, match="callable"):
        RunningAllocate(None, Pool, RequestStatus.RUNNING, _original, DeviceFullError)
    with pytest.raises(TypeError, match="exception class"):
        RunningAllocate(_original, Pool, RequestStatus.RUNNING, _original, ValueError("x"))
    with pytest.raises(TypeError):
        RunningAllocate(_original, "not a type", RequestStatus.RUNNING, _original, DeviceFullError)
    with pytest.raises(TypeError, match="keyword"):
        RunningAllocate(_original, Pool, RequestStatus.RUNNING, _original, DeviceFullError, extra=1)


def test_it_leaks_no_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "_runtime", None)
    c_version, _ = _replacements(_original, monkeypatch)
    running = Manager(Pool(True)), Request(RequestStatus.RUNNING)
    waiting = Manager(Pool(True)), Request(RequestStatus.WAITING)
    refused = Manager(Pool(True), outcome=DeviceFullError("full")), Request(RequestStatus.RUNNING)
    objects = [*running, *waiting, *refused, c_version]

    def calls() -> None:
        for manager, request in (running, waiting, refused):
            c_version(manager, request, 3, num_lookahead_tokens=1)
            manager.calls.clear()

    calls()
    gc.collect()
    refs = [sys.getrefcount(o) for o in objects]
    tracemalloc.start()
    try:
        for _ in range(2000):
            calls()
        gc.collect()
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(20000):
            calls()
        gc.collect()
        second, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert second - first < 4096
    assert [sys.getrefcount(o) for o in objects] == refs
