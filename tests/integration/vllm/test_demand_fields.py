"""The demand fields the autopilot reads, on vLLM's real ``EngineCore`` (CPU stub executor).

Each figure is checked against an oracle the adapter does not compute:
``prefix_hit_rate`` against the hit tokens vLLM's own block hashing implies
(whole cached blocks of a shared document), ``num_preemptions`` against
vLLM's per-request ``Request.num_preemptions`` counters, ``waiting_bytes``
against the blocks every waiting request's tokens span.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from test_engine_core_limits import (
    BLOCK_TOKENS,
    build_core,
    in_foreign_thread,
    make_request,
    plugin_env,
)

from engine_ext import EngineSettings
from engine_ext._hit_window import HIT_WINDOW_ADMISSIONS, PrefixHitWindow
from engine_ext.vllm import _block_speedups, _runtime
from engine_ext.vllm._settings import VllmSettings

pytestmark = pytest.mark.vllm
__all__ = ["plugin_env"]  # the fixture, re-exported for pytest


def _runtime_parts() -> tuple[Any, Any]:
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and runtime.pool is not None
    return runtime, runtime.instance


def _drain(core: Any, limit: int = 2000) -> dict[str, int]:
    done: dict[str, int] = {}
    for _ in range(limit):
        outputs, _ = core.step()
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                done[out.request_id] = done.get(out.request_id, 0) + len(out.new_token_ids)
        if not core.scheduler.has_requests():
            return done
    raise AssertionError(f"requests still running after {limit} steps")


def test_prefix_hit_rate_is_hit_tokens_over_looked_up_tokens(plugin_env: Path) -> None:
    core = build_core(plugin_env)
    _runtime_parts()
    rng = random.Random(11)
    try:
        assert core.scheduler is not None
        _, instance = _runtime_parts()
        assert instance.state().prefix_hit_rate is None  # no admission yet
        doc = [rng.randrange(10, 3000) for _ in range(100)]  # 6 whole blocks + 4 tokens
        core.add_request(*core.preprocess_add_request(make_request("cold", doc + [7], 2)))
        _drain(core)
        assert instance.state().prefix_hit_rate == 0.0  # the first lookup hits nothing
        looked_up, hit = len(doc) + 1, 0
        for i, tail in enumerate((5, 40, 1)):
            prompt = doc + [rng.randrange(10, 3000) for _ in range(tail)]
            core.add_request(*core.preprocess_add_request(make_request(f"warm{i}", prompt, 2)))
            _drain(core)
            looked_up += len(prompt)
            hit += len(doc) // BLOCK_TOKENS * BLOCK_TOKENS  # the document's whole blocks
            assert instance.state().prefix_hit_rate == pytest.approx(hit / looked_up)
    finally:
        core.shutdown()


# the Python reference and the C window the vLLM runtime builds (its plain admission
# records into it without a Python frame): each test runs on both
WINDOWS = [PrefixHitWindow, _block_speedups.HitWindow]


@pytest.mark.parametrize("window_class", WINDOWS)
def test_prefix_hit_window_keeps_the_last_admissions_only(window_class: Any) -> None:
    window = window_class(4)
    assert window.rate is None
    for _ in range(10):
        window.record(0, 100)  # cold admissions, then pushed out
    for _ in range(4):
        window.record(90, 100)
    assert window.rate == pytest.approx(0.9) and len(window) == 4
    window.record(500, 100)  # more hits than looked up: clamped
    window.record(5, 0)  # nothing looked up: ignored
    assert window.rate == pytest.approx((3 * 90 + 100) / 400)
    with pytest.raises(ValueError, match="at least one admission"):
        window_class(0)
    assert HIT_WINDOW_ADMISSIONS >= 1
    assert len(window_class()) == 0 and window_class().rate is None  # default size


@pytest.mark.parametrize("window_class", WINDOWS)
@pytest.mark.parametrize("size", [1, 3, 128])
def test_prefix_hit_window_equals_a_recount_of_the_last_admissions(
    size: int, window_class: Any
) -> None:
    """The ring's running sums against a recount of the last ``size`` recorded pairs."""
    rng = random.Random(size)
    window = window_class(size)
    kept: list[tuple[int, int]] = []
    for _ in range(1000):
        looked_up = rng.choice([0, -3, rng.randint(1, 5000)])
        hit = rng.choice([-7, 0, rng.randint(0, 6000)])
        window.record(hit, looked_up)
        if looked_up > 0:
            kept.append((min(max(hit, 0), looked_up), looked_up))
        last = kept[-size:]
        assert len(window) == len(last) and window.changes == len(kept)
        if not last:
            assert window.rate is None
            continue
        assert window.rate == sum(h for h, _ in last) / sum(n for _, n in last)


def test_num_preemptions_equals_vllms_own_per_request_counts(plugin_env: Path) -> None:
    """A reservation too small for the batch: vLLM preempts; every preemption is counted."""
    # 8 pages of 4 blocks: 31 usable blocks of 16 tokens, for 5 requests of up to 13 blocks
    core = build_core(plugin_env, 8, max_model_len=256)
    rng = random.Random(5)
    try:
        _, instance = _runtime_parts()
        requests: dict[str, Any] = {}
        for i in range(5):
            prompt = [rng.randrange(10, 3000) for _ in range(rng.randrange(40, 90))]
            core.add_request(*core.preprocess_add_request(make_request(f"p{i}", prompt, 120)))
            requests[f"p{i}"] = core.scheduler.requests[f"p{i}"]
        done = _drain(core, 5000)
        assert all(done[r] == 120 for r in requests)
        vllm_count = sum(r.num_preemptions for r in requests.values())
        assert vllm_count > 0  # the scenario really preempts
        assert instance.state().num_preemptions == vllm_count
    finally:
        core.shutdown()


def test_waiting_bytes_cover_every_waiting_request(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-page limit, A running: B and C wait; waiting_bytes is what B and C need."""
    page_bytes = 64 << 10  # 16 blocks per page
    monkeypatch.setenv("KVSIDECAR_PAGE_BYTES", str(page_bytes))
    core = build_core(plugin_env, 64, page_bytes=page_bytes, max_model_len=4096)
    rng = random.Random(8)
    try:
        _, instance = _runtime_parts()
        bundle = instance.state().page_bundle_bytes
        block_bytes = bundle // 16
        a = [rng.randrange(10, 3000) for _ in range(300)]
        core.add_request(*core.preprocess_add_request(make_request("A", a, 400)))
        core.step()
        in_foreign_thread(lambda: instance.set_limit(2 * bundle))
        b = [rng.randrange(10, 3000) for _ in range(700)]
        c = [rng.randrange(10, 3000) for _ in range(333)]
        core.add_request(*core.preprocess_add_request(make_request("B", b, 4)))
        core.add_request(*core.preprocess_add_request(make_request("C", c, 4)))
        for _ in range(3):
            core.step()
        state = instance.state()
        assert state.num_running_requests == 1 and state.num_waiting_requests == 2
        assert state.waiting_reason == "waiting_for_memory"
        expected = (-(-len(b) // BLOCK_TOKENS) + -(-len(c) // BLOCK_TOKENS)) * block_bytes
        assert state.waiting_bytes == expected
        assert state.pinned_bytes >= bundle  # A's blocks are held by a running request
        in_foreign_thread(lambda: instance.set_limit(None))
        done = _drain(core, 3000)
        assert done["B"] == 4 and done["C"] == 4
        state = instance.state()
        assert state.waiting_reason is None and state.waiting_bytes == 0
    finally:
        core.shutdown()


def _figures(runtime: Any, core: Any) -> tuple[int, int, int, int]:
    """The counts and figures as vLLM's queues and the allocator hold them now."""
    sched = core.scheduler
    blocks = runtime.pool._blocks
    bundle = runtime.instance.state().page_bundle_bytes
    reclaimable = blocks.num_reclaimable_pages
    return (
        len(sched.running),
        len(sched.waiting),
        reclaimable * bundle,
        (blocks.pages.num_in_use - reclaimable) * bundle,
    )


def _reported(state: Any) -> tuple[int, int, int, int]:
    return (
        state.num_running_requests,
        state.num_waiting_requests,
        state.evictable_bytes,
        state.pinned_bytes,
    )


@pytest.mark.parametrize("age", [0.0, None])
def test_counts_are_refreshed_at_the_max_age_while_busy(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch, age: float | None
) -> None:
    """The counts and evictable/pinned figures are not refreshed at every admission
    and finish (that cost 1.5-5 % of the scheduler step) but at most DEMAND_MAX_AGE_S
    apart while busy, at the end of schedule(): with the age at 0 every schedule()
    refreshes them, so as it returns they equal vLLM's queues and the allocator.
    With the age at its default (100 ms; this trace runs in less) they lag at some
    step: the point of it."""
    if age is not None:
        monkeypatch.setattr(_runtime, "DEMAND_MAX_AGE_S", age)
    core = build_core(plugin_env)
    rng = random.Random(5)
    try:
        runtime, instance = _runtime_parts()
        seen: list[tuple[Any, Any]] = []
        schedule = core.scheduler.schedule  # the patched method, bound

        def recording_schedule(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)  # the end-of-schedule refresh ran in there
            seen.append((_reported(instance.state()), _figures(runtime, core)))
            return output

        core.scheduler.schedule = recording_schedule
        doc = [rng.randrange(10, 3000) for _ in range(64)]
        for i in range(8):
            tail = [rng.randrange(10, 3000) for _ in range(rng.randrange(1, 40))]
            request = make_request(f"r{i}", doc + tail, rng.randrange(1, 30))
            core.add_request(*core.preprocess_add_request(request))
        while core.scheduler.has_requests():
            core.step()
        assert len(seen) > 10
        lagged = [i for i, (reported, actual) in enumerate(seen) if reported != actual]
        if age == 0.0:
            assert lagged == []
        else:
            assert lagged
    finally:
        core.shutdown()


def test_a_busy_loop_refreshes_the_counts_in_its_idle_hook(plugin_env: Path) -> None:
    """Served by a busy loop, the frees of finishing requests arm the idle hook instead
    of running a safe point each: while requests still run the counts may lag (at
    most DEMAND_MAX_AGE_S), and once the loop has no work the callbacks it runs then
    (``EngineCoreProc._notify_idle_state_callbacks``) bring them to what the queues and
    the allocator hold. Mapped bytes never lag: they follow the memory at every step."""
    core = build_core(plugin_env)
    rng = random.Random(6)
    try:
        runtime, instance = _runtime_parts()
        runtime._engine_core = core  # what attach_engine records (no socket needed here)
        doc = [rng.randrange(10, 3000) for _ in range(64)]
        for i in range(6):
            tail = [rng.randrange(10, 3000) for _ in range(rng.randrange(1, 40))]
            request = make_request(f"r{i}", doc + tail, 2 + 5 * i)
            core.add_request(*core.preprocess_add_request(request))
        backend = runtime.pool._blocks.pages.backend
        while core.scheduler.has_requests():
            core.step()
            assert instance.state().mapped_bytes == backend.mapped_bytes()
        assert core._idle_state_callbacks, "the frees armed the idle hook"
        while core._idle_state_callbacks:  # EngineCoreProc._notify_idle_state_callbacks,
            core._idle_state_callbacks.pop()(core)  # run by the busy loop with no work
        state = instance.state()
        assert _reported(state) == _figures(runtime, core)
        assert state.num_running_requests == 0 and state.evictable_bytes > 0
        assert state.mapped_bytes == backend.mapped_bytes()
    finally:
        core.shutdown()


def test_the_c_hit_window_is_the_runtimes_and_matches_python_on_every_record() -> None:
    """The runtime's window is the C one where built; the C and Python windows stay equal
    (rate, length, changes) record by record, and the C one refuses what it cannot hold
    (a count past a C long long, a non-int, a wrong arity) with nothing recorded."""
    runtime = _runtime.VllmRuntime(EngineSettings(), VllmSettings())
    assert type(runtime._hits) is _block_speedups.HitWindow
    assert HIT_WINDOW_ADMISSIONS == 128  # the C window's default size is written as 128
    rng = random.Random(17)
    c_window, python_window = _block_speedups.HitWindow(), PrefixHitWindow()
    for _ in range(3000):
        looked_up = rng.choice([0, -1, 1, rng.randint(1, 1 << 40)])
        hit = rng.choice([-1, 0, looked_up, looked_up + 1, rng.randint(0, 1 << 41)])
        c_window.record(hit, looked_up)
        python_window.record(hit, looked_up)
        got = (c_window.rate, len(c_window), c_window.changes)
        assert got == (python_window.rate, len(python_window), python_window.changes)
    before = (c_window.rate, len(c_window), c_window.changes)
    for bad_args, error in [
        ((1, 1 << 63), OverflowError),
        ((1 << 64, 5), OverflowError),
        ((1.5, 5), TypeError),
        ((1,), TypeError),
    ]:
        with pytest.raises(error):
            c_window.record(*bad_args)
    assert (c_window.rate, len(c_window), c_window.changes) == before
