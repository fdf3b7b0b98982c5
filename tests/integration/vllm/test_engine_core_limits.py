"""Limits published from a foreign thread at any point of vLLM's real ``EngineCore.step()``.

The engine is vLLM's own ``EngineCore`` (scheduler, ``KVCacheManager``, prefix
caching) with the plugin's patches and the CPU stub executor, whose tokens are
computed from the KV memory read back (a block evicted or reused under a live
request changes them). Limits (0, one page, unlimited, random) are published
from a separate thread at the top of steps and, through a wrapper around
``KVCacheManager.get_computed_blocks``, between a request's prefix lookup and
its ``allocate_slots`` (the race that killed the EngineCore, docs/engine-hooks.md 1.6).
Memory is measured from the kernel (the memfd's ``fstat`` blocks, what
``/proc`` shows).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.threads import in_foreign_thread

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore

from engine_ext import EngineExtConfigError
from engine_ext.cpu_harness import StubExecutor, make_tiny_model_dir
from engine_ext.protocol import EngineState, Status
from engine_ext.vllm import _patches, _runtime, plugin
from engine_ext.vllm._kv_memory import clear_kv_memory
from sidecar._reports import report_problem

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 16
PAGE_BYTES = 16 << 10  # per region: 4 blocks of the tiny model (2 layers x K/V regions)
NUM_PAGES = 64


@pytest.fixture
def plugin_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The plugin on (patches applied for this test only), settings from the environment."""
    for key, value in {
        "KVSIDECAR_ENABLE": "1",
        "KVSIDECAR_THREAD_GUARD": "1",
        "KVSIDECAR_RUNTIME_DIR": str(tmp_path / "run"),
        "KVSIDECAR_PAGE_BYTES": str(PAGE_BYTES),
        "KVSIDECAR_INSTANCE_ID": "core-test",
        "VLLM_TARGET_DEVICE": "cpu",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KVSIDECAR_SIDECAR_URL", raising=False)
    monkeypatch.setattr(_runtime, "_configured", None)
    monkeypatch.setattr(_runtime, "_runtime", None)
    plugin.register()
    try:
        yield make_tiny_model_dir(tmp_path / "tiny")
    finally:
        clear_kv_memory()
        _patches.remove_patches()  # every patch undone: vLLM as it was for the next test
        assert not any(_patches.is_patched(p.target) for p in _patches.PATCHES)


def build_core(
    model_dir: Path,
    num_pages: int = NUM_PAGES,
    *,
    page_bytes: int = PAGE_BYTES,
    max_model_len: int = 2048,
    max_num_batched_tokens: int = 512,
    enable_prefix_caching: bool = True,
    executor: type[StubExecutor] = StubExecutor,
) -> EngineCore:
    bundle = page_bytes * 4  # 2 layers x (K, V) regions
    args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        dtype="float16",
        block_size=BLOCK_TOKENS,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        kv_cache_memory_bytes=num_pages * bundle,
        distributed_executor_backend=executor,
        max_num_seqs=6,
        max_num_batched_tokens=max_num_batched_tokens,
        disable_log_stats=True,
        enforce_eager=True,
    )
    config = args.create_engine_config()
    if executor.supports_async_scheduling():
        # vLLM's CPU platform turns async scheduling off; a GPU server with the uni
        # executor has it on by default: the loop under test is that one
        config.scheduler_config.async_scheduling = True
    return EngineCore(config, executor_class=executor, log_stats=False)


def make_request(request_id: str, tokens: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


@dataclass
class Run:
    """What one randomized run produced."""

    outputs: dict[str, list[int]] = field(default_factory=dict)  # finished, not aborted
    aborted: set[str] = field(default_factory=set)
    applied_checks: int = 0
    publishes: int = 0
    races: int = 0  # publishes between get_computed_blocks and allocate_slots
    tail: bool = False  # no more arrivals or limit changes: the limit is lifted, all drain


def drive(
    core: EngineCore,
    seed: int,
    *,
    num_steps: int,
    limits: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> Run:
    rng = random.Random(seed)
    limit_rng = random.Random(seed + 1)
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and runtime.pool is not None
    instance = runtime.instance
    backend = runtime.pool._blocks.pages.backend
    bundle = instance.state().page_bundle_bytes
    run = Run()

    def publish() -> None:
        choice = limit_rng.random()
        if choice < 0.15:
            limit: int | None = 0
        elif choice < 0.3:
            limit = bundle
        elif choice < 0.45:
            limit = None
        elif choice < 0.75:  # just below what is mapped: a few cached pages must go
            limit = max(0, backend.mapped_bytes() - limit_rng.randrange(1, 4) * bundle)
        else:
            limit = limit_rng.randrange(0, NUM_PAGES * bundle)
        in_foreign_thread(lambda: instance.set_limit(limit))
        run.publishes += 1

    lookup = KVCacheManager.get_computed_blocks

    def get_computed_blocks(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        result = lookup(self, *args, **kwargs)
        if limits and not run.tail and result[1] > 0 and limit_rng.random() < 0.5:
            publish()  # the hit blocks have ref_cnt 0 until allocate_slots touches them
            run.races += 1
        return result

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", get_computed_blocks)
    docs = [[rng.randrange(10, 3000) for _ in range(rng.choice((48, 80, 130)))] for _ in range(8)]
    live: dict[str, list[int]] = {}
    abort_at: dict[int, str] = {}  # drawn at arrival: the same in every run
    step = 0
    next_id = 0
    while step < num_steps or live:
        # bursts then quiet spells: cached documents sit unreferenced between their hits
        if step < num_steps and rng.random() < (0.5 if (step // 40) % 2 else 0.04):
            request_id = f"r{next_id}"
            next_id += 1
            tokens = rng.choice(docs) + [
                rng.randrange(10, 3000) for _ in range(rng.randrange(1, 40))
            ]
            core.add_request(
                *core.preprocess_add_request(make_request(request_id, tokens, rng.randrange(1, 40)))
            )
            live[request_id] = []
            if rng.random() < 0.1:
                abort_at[step + rng.randrange(0, 30)] = request_id
        victim = abort_at.pop(step, None)
        if victim is not None and victim in live:
            core.abort_requests([victim])
            run.aborted.add(victim)
            del live[victim]
        if limits and step < num_steps and limit_rng.random() < 0.3:
            publish()
        if limits and step == num_steps:
            run.tail = True
            in_foreign_thread(lambda: instance.set_limit(None))  # let the tail drain
        outputs, _ = core.step_fn()  # step, or step_with_batch_queue (async scheduling)
        collect_outputs(outputs, live, run)
        state = check_state(instance, backend)
        run.applied_checks += limited(state)
        step += 1
        assert step < num_steps * 20, f"requests never finished: {sorted(live)} {state}"
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", lookup)
    return run


def collect_outputs(outputs: Any, live: dict[str, list[int]], run: Run) -> None:
    """Add one step's new tokens to ``live``; a finished request's tokens move to ``run``
    (aborted requests, no longer in ``live``, are skipped)."""
    for client_outputs in (outputs or {}).values():
        for out in client_outputs.outputs:
            if out.request_id not in live:
                continue
            live[out.request_id].extend(out.new_token_ids)
            if out.finished:
                run.outputs[out.request_id] = live.pop(out.request_id)


def drain_to_zero(core: Any, idle: Callable[[], object]) -> tuple[EngineState, int]:
    """Set limit 0 from a foreign thread, run ``idle`` (the engine's idle steps), and return
    the state with the bytes the backend measures: everything but the floor goes back."""
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and runtime.pool is not None
    instance = runtime.instance
    backend = runtime.pool._blocks.pages.backend
    in_foreign_thread(lambda: instance.set_limit(0))
    idle()
    return instance.state(), backend.mapped_bytes()


def check_state(instance: Any, backend: Any) -> EngineState:
    """The checks of every step: an applied limit holds in the kernel's measure, the
    state's mapped bytes follow it (within one page bundle), and the state passes the
    sidecar's checks (a refused report leaves the sidecar, and the autopilot, with a
    stale state). Returns the state."""
    state: EngineState = instance.state()
    measured = backend.mapped_bytes()
    if state.status is Status.APPLIED and state.effective_limit_bytes is not None:
        assert measured <= state.effective_limit_bytes, (measured, state)
    assert abs(state.mapped_bytes - measured) <= state.page_bundle_bytes, (measured, state)
    assert report_problem(state, state.limit_bytes, state.revision) is None, state
    return state


def limited(state: EngineState) -> bool:
    """Whether ``state`` applies a limit (what :func:`check_state` checked against /proc)."""
    return state.status is Status.APPLIED and state.effective_limit_bytes is not None


def test_limits_from_a_foreign_thread_never_break_the_engine_core(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = build_core(plugin_env)
    try:
        baseline = drive(core, 7, num_steps=1500, limits=False, monkeypatch=monkeypatch)
        core.reset_prefix_cache()
        stressed = drive(core, 7, num_steps=1500, limits=True, monkeypatch=monkeypatch)
    finally:
        core.shutdown()
    assert stressed.races > 50 and stressed.publishes > 300 and stressed.applied_checks > 100
    assert_same_outcomes(baseline, stressed, min_compared=200)


def test_limits_without_prefix_caching_never_break_the_engine_core(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same storm with vLLM's prefix caching off (``--no-enable-prefix-caching``):
    nothing is ever evictable, so a limit frees memory only as requests end, and every
    freed block must go back to the device when its page empties."""
    core = build_core(plugin_env, enable_prefix_caching=False)
    try:
        baseline = drive(core, 11, num_steps=800, limits=False, monkeypatch=monkeypatch)
        stressed = drive(core, 11, num_steps=800, limits=True, monkeypatch=monkeypatch)
        state, measured = drain_to_zero(core, lambda: [core.step() for _ in range(3)])
    finally:
        core.shutdown()
    # only the floor stays: the page of vLLM's null block
    assert state.status is Status.APPLIED and state.effective_limit_bytes == state.floor_bytes
    assert measured == state.mapped_bytes == state.floor_bytes, (measured, state)
    assert stressed.publishes > 100 and stressed.applied_checks > 50
    assert_same_outcomes(baseline, stressed, min_compared=100)


def assert_same_outcomes(baseline: Run, stressed: Run, *, min_compared: int) -> None:
    """Every request completed or was aborted in both runs (drive() asserts none is left
    running), and each one that completed in both has the same tokens."""
    assert set(stressed.outputs) | stressed.aborted == set(baseline.outputs) | baseline.aborted
    both = set(stressed.outputs) & set(baseline.outputs)
    assert len(both) > min_compared
    for request_id in both:  # the same tokens as without limit changes
        assert stressed.outputs[request_id] == baseline.outputs[request_id], request_id


def test_small_limit_never_hangs_a_request_silently(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11's hang: a 2-page limit, A (700 + 3000 tokens) running, B (1500) waiting."""
    page_bytes = 64 << 10  # 16 blocks of 16 tokens per page (the default)
    monkeypatch.setenv("KVSIDECAR_PAGE_BYTES", str(page_bytes))
    core = build_core(plugin_env, 64, page_bytes=page_bytes, max_model_len=4096)
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and runtime.pool is not None
    instance = runtime.instance
    backend = runtime.pool._blocks.pages.backend
    bundle = instance.state().page_bundle_bytes
    rng = random.Random(3)
    finished: dict[str, int] = {}
    seen_waiting: list[int] = []

    def step() -> None:
        outputs, _ = core.step()
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                finished[out.request_id] = finished.get(out.request_id, 0) + len(out.new_token_ids)
        state = instance.state()
        assert abs(state.mapped_bytes - backend.mapped_bytes()) <= bundle, state

    try:
        prompt_a = [rng.randrange(10, 3000) for _ in range(700)]
        core.add_request(*core.preprocess_add_request(make_request("A", prompt_a, 3000)))
        step()  # A is running
        in_foreign_thread(lambda: instance.set_limit(2 * bundle))
        prompt_b = [rng.randrange(10, 3000) for _ in range(1500)]
        core.add_request(*core.preprocess_add_request(make_request("B", prompt_b, 16)))
        for _ in range(4000):
            step()
            state = instance.state()
            if state.waiting_reason == "waiting_for_memory":
                seen_waiting.append(state.waiting_bytes)
            if "A" in finished and finished["A"] >= 3000:
                break
        assert finished.get("A") == 3000  # A was never preempted by the limit: it finished
        assert finished.get("B", 0) == 0
        step()  # B still waits: the engine keeps stepping, the counts follow
        state = instance.state()
        block_bytes = bundle // 16
        needed = -(-1500 // BLOCK_TOKENS) * block_bytes
        assert state.num_waiting_requests == 1 and state.num_running_requests == 0
        assert state.waiting_reason == "waiting_for_memory" and state.waiting_bytes >= needed
        assert seen_waiting and state.status is Status.APPLIED  # A's overage is gone
        assert backend.mapped_bytes() <= 2 * bundle
        in_foreign_thread(lambda: instance.set_limit(None))  # raising the limit lets B run
        for _ in range(200):
            step()
            if finished.get("B", 0) >= 16:
                break
        assert finished.get("B") == 16
        assert instance.state().waiting_reason is None
    finally:
        core.shutdown()


def test_in_process_engine_core_is_refused(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(EngineExtConfigError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        build_core(plugin_env)


def test_data_parallel_busy_loop_is_refused(plugin_env: Path) -> None:
    from vllm.v1.engine.core import DPEngineCoreProc

    class Probe:  # run_busy_loop refuses before touching the engine
        pass

    _runtime._runtime = _runtime.VllmRuntime(*_runtime._configured)  # type: ignore[misc]
    with pytest.raises(EngineExtConfigError, match="data parallel"):
        DPEngineCoreProc.run_busy_loop(Probe())  # type: ignore[arg-type]


def test_a_page_reserve_is_refilled_at_safe_points_under_foreign_limits(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVSIDECAR_RESERVE_PAGES: admissions take pages out of the reserve, the safe point at
    the end of ``schedule()`` maps them again; under limits published from a foreign
    thread at any point the reserve never lifts mapped memory above an applied limit
    (``drive`` checks /proc at every step), and the tokens are those of a run without
    limit changes."""
    monkeypatch.setenv("KVSIDECAR_RESERVE_PAGES", "3")
    monkeypatch.setattr(_runtime, "_configured", None)
    plugin.register()  # the settings again, with the reserve (vLLM loads plugins only once)
    core = build_core(plugin_env)
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.pool is not None
    pages = runtime.pool._blocks.pages
    assert pages.reserve_pages == 3
    refills: list[int] = []
    refill = pages.refill_reserve

    def counted() -> int:
        mapped = refill()
        refills.append(mapped)
        return mapped

    pages.refill_reserve = counted  # type: ignore[method-assign]
    try:
        baseline = drive(core, 11, num_steps=500, limits=False, monkeypatch=monkeypatch)
        grown = sum(refills)
        core.reset_prefix_cache()
        stressed = drive(core, 11, num_steps=500, limits=True, monkeypatch=monkeypatch)
        core.step()  # drained, unlimited again: the last safe point tops the reserve up
        # one long decode alone: its new pages come out of the reserve in steps where
        # nothing else moves (no admission, no free, the same mapped count); the end of
        # each such step still refills the reserve
        core.add_request(*core.preprocess_add_request(make_request("long", [7] * 20, 400)))
        for _ in range(600):
            core.step()
            assert pages.reserve_wanted() == 0, "a step left the page reserve short"
            if not core.scheduler.has_requests():
                break
        state = _runtime.current_runtime().instance.state()  # type: ignore[union-attr]
    finally:
        core.shutdown()
    assert grown > 3  # traffic took reserve pages more than once, and they came back
    assert pages.reserve_wanted() == 0  # the reserve is full (or the capacity is mapped)
    assert pages.num_free_mapped == min(3, pages.num_pages - pages.num_in_use)
    assert state.mapped_bytes == pages.num_mapped * state.page_bundle_bytes
    assert_same_outcomes(baseline, stressed, min_compared=40)
