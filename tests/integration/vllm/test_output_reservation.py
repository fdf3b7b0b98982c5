"""Output reservation (``KVSIDECAR_RESERVE_OUTPUT=1``) on vLLM's real ``EngineCore.step()``.

Without it, a decode-heavy load admitted under a limit on its prompts grows
past the limit (running requests are never preempted because of a limit); on
a budgeted device that is memory above the budget. With it, an admission must
fit its whole output beside the running requests' remaining output, and
``applied`` means the running requests' growth fits under the limit too.
Memory is measured from the kernel (the memfd's committed blocks), at every step.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from test_engine_core_limits import (
    assert_same_outcomes,
    build_core,
    drive,
    in_foreign_thread,
    make_request,
    plugin_env,
)
from vllm.v1.engine.core import EngineCore

from engine_ext import load_engine_settings
from engine_ext.protocol import Status
from engine_ext.vllm import _runtime
from engine_ext.vllm._settings import load_vllm_settings
from sidecar._reports import report_problem

pytestmark = pytest.mark.vllm
__all__ = ["plugin_env"]

BLOCKS_PER_PAGE = 4  # test_engine_core_limits' PAGE_BYTES for the tiny model


def _core(plugin_env: Path, monkeypatch: pytest.MonkeyPatch, *, reserve: bool) -> EngineCore:
    monkeypatch.setenv("KVSIDECAR_RESERVE_OUTPUT", "1" if reserve else "0")
    _runtime.configure(load_engine_settings(), load_vllm_settings())  # as register() does
    return build_core(plugin_env)


def _decode_heavy(core: EngineCore, seed: int, count: int) -> None:
    rng = random.Random(seed)
    for i in range(count):  # 3 blocks of prompt, ~10 blocks of output each
        prompt = [rng.randrange(10, 3000) for _ in range(40)]
        core.add_request(*core.preprocess_add_request(make_request(f"d{i}", prompt, 150)))


def _run_to_end(core: EngineCore, max_steps: int = 5000) -> tuple[dict[str, int], list[int]]:
    """Steps until no request is left; (tokens per request, /proc-measured bytes per step)."""
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.pool is not None
    backend = runtime.pool._blocks.pages.backend
    tokens: dict[str, int] = {}
    mapped: list[int] = []
    for _ in range(max_steps):
        outputs, _ = core.step()
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
        mapped.append(backend.mapped_bytes())
        if not core.scheduler.has_requests():
            return tokens, mapped
    raise AssertionError(f"requests never finished: {tokens}")


@pytest.mark.parametrize("reserve", [False, True], ids=["prompt-only", "reserved"])
def test_a_decode_heavy_load_stays_under_the_limit_only_with_the_reservation(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch, reserve: bool
) -> None:
    core = _core(plugin_env, monkeypatch, reserve=reserve)
    try:
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.instance is not None
        instance = runtime.instance
        bundle = instance.state().page_bundle_bytes
        limit = 8 * bundle  # 32 blocks: every prompt fits at once, not every output
        instance.set_limit(limit)  # taken at the top of the first step
        _decode_heavy(core, seed=5, count=6)
        tokens, mapped = _run_to_end(core)
        state = instance.state()
    finally:
        core.shutdown()
    assert tokens == {f"d{i}": 150 for i in range(6)}  # every request completed
    if reserve:
        assert max(mapped) <= limit  # at every step, as the kernel counts it
        assert state.status is Status.APPLIED and state.reserved_bytes == 0
    else:  # admitted on their prompts, the outputs grew past the limit (the known gap)
        assert max(mapped) > limit


def test_applied_means_the_running_requests_growth_fits_under_the_limit(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = _core(plugin_env, monkeypatch, reserve=True)
    try:
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.instance is not None and runtime.pool is not None
        instance = runtime.instance
        backend = runtime.pool._blocks.pages.backend
        bundle = instance.state().page_bundle_bytes
        block_bytes = bundle // BLOCKS_PER_PAGE
        _decode_heavy(core, seed=9, count=4)  # no limit: all four start at once
        core.step()
        state = instance.state()
        assert state.num_running_requests == 4
        assert state.reserved_bytes > 0  # their outputs are still to come
        # a limit above what is mapped now but below where the outputs will end
        limit = backend.mapped_bytes() + 2 * bundle
        revision = 0

        def lower() -> None:
            nonlocal revision
            revision = instance.set_limit(limit).revision

        in_foreign_thread(lower)
        core.step()
        state = instance.state()
        assert state.revision == revision and backend.mapped_bytes() <= limit
        assert state.status is Status.DEFERRED and state.reason == "running_requests"
        assert state.overage_bytes > 0 and state.reserved_bytes >= 3 * bundle
        applied_at = None
        for step in range(3000):
            core.step()
            state = instance.state()
            if applied_at is None and state.status is Status.APPLIED:
                applied_at = step
                # applied: what the running requests may still add fits under the limit
                room = limit - state.mapped_bytes + state.evictable_bytes
                assert state.reserved_bytes <= room + bundle, state
            if applied_at is not None:  # from then on, never above the limit
                assert backend.mapped_bytes() <= limit, (step, state)
            if not core.scheduler.has_requests():
                break
        assert applied_at is not None and not core.scheduler.has_requests()
        assert instance.state().reserved_bytes == 0 and block_bytes > 0
    finally:
        core.shutdown()


def test_a_request_whose_output_cannot_fit_waits_and_names_its_whole_need(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = _core(plugin_env, monkeypatch, reserve=True)
    try:
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.instance is not None
        instance = runtime.instance
        bundle = instance.state().page_bundle_bytes
        block_bytes = bundle // BLOCKS_PER_PAGE
        instance.set_limit(4 * bundle)  # 16 blocks; the request's life needs 3 + 38
        prompt = list(range(10, 50))
        core.add_request(*core.preprocess_add_request(make_request("big", prompt, 600)))
        for _ in range(5):
            core.step()
        state = instance.state()
        assert state.num_waiting_requests == 1 and state.num_running_requests == 0
        assert state.waiting_reason == "waiting_for_memory"
        assert state.waiting_bytes >= -(-(40 + 600) // 16) * block_bytes  # prompt + output
        in_foreign_thread(lambda: instance.set_limit(None))
        tokens, _ = _run_to_end(core)
        assert tokens == {"big": 600}
    finally:
        core.shutdown()


def test_limits_from_a_foreign_thread_with_the_reservation_keep_tokens_and_the_engine(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The randomized run of test_engine_core_limits with the reservation on."""
    core = _core(plugin_env, monkeypatch, reserve=True)
    try:
        baseline = drive(core, 11, num_steps=500, limits=False, monkeypatch=monkeypatch)
        core.reset_prefix_cache()
        stressed = drive(core, 11, num_steps=500, limits=True, monkeypatch=monkeypatch)
    finally:
        core.shutdown()
    assert stressed.races > 10 and stressed.publishes > 80 and stressed.applied_checks > 30
    assert_same_outcomes(baseline, stressed, min_compared=50)


def test_every_state_under_a_zero_limit_passes_the_sidecars_report_checks(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limit of 0 while requests with their output still to come run: the overage counts
    that output, so it exceeds what is mapped; the sidecar must still take the report
    (it refused it with a 422 when it capped the overage at the mapped bytes)."""
    core = _core(plugin_env, monkeypatch, reserve=True)
    try:
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.instance is not None
        instance = runtime.instance
        _decode_heavy(core, seed=5, count=2)
        core.step()
        revision = 0

        def zero() -> None:
            nonlocal revision
            revision = instance.set_limit(0).revision

        in_foreign_thread(zero)
        beyond = 0
        for _ in range(3000):
            core.step()
            state = instance.state()
            assert report_problem(state, 0, revision) is None, state
            beyond += state.overage_bytes > state.mapped_bytes
            if not core.scheduler.has_requests():
                break
        assert beyond > 0  # the case the rule must allow did happen
        assert not core.scheduler.has_requests()
        assert report_problem(instance.state(), 0, revision) is None
    finally:
        core.shutdown()
