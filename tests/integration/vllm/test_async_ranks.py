"""vLLM's async-scheduling loop with TP/PP rank processes (a GPU server's default for TP > 1).

The storm of ``test_async_storm`` (limits from a foreign thread between steps and at
the executor's points inside one, aborts between ``step_fn`` calls and through
``core.aborts_queue``, preemption in small pools, ``max_tokens=1``, prefix hits on
blocks freed while the next step is in flight, ``reset_prefix_cache`` with a step in
flight) runs on an ``EngineCore`` with ``StubAsyncExecutor`` and ``KVSIDECAR_STUB_TP`` x
``KVSIDECAR_STUB_PP`` rank processes. Checked at every step and at every point inside
one, from outside the ranks: each rank's ``/proc/<pid>/maps`` holds every page the
scheduler maps and nothing the owner gave back, no rank died (a rank stops with an
error on a step that writes a page it does not map, or an ``unmap after_step E`` it
receives before finishing step E), ``applied`` only with every rank's view within the
effective limit, and every state passes the sidecar's checks. At the end: the tokens
of the synchronous single-rank engine without limits, and a limit of 0 leaves every
rank mapping only the floor.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from support import wait_until
from support.threads import in_foreign_thread
from test_async_scheduling import DEVICE, SimDeviceExecutor
from test_async_storm import Storm, _baseline, storm
from test_engine_core_limits import (
    Run,
    assert_same_outcomes,
    build_core,
    check_state,
    drain_to_zero,
    make_request,
    plugin_env,
)
from vllm.v1.engine.core import EngineCore

from engine_ext._barrier import BarrierOutcome
from engine_ext.cpu_harness.vllm._multirank import MultiRankStubWorker
from engine_ext.protocol import EngineState, Status
from engine_ext.ranks import RankChannelError, RankedBackend, RankGroup, memfd_view
from engine_ext.vllm import _runtime, plugin
from sidecar._reports import report_problem

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

__all__ = ["plugin_env"]  # the fixture, imported for this module's tests

KV_MEMFD = "kvsidecar-stub-kv"  # the stub worker's memfd (``HostBackend.reserve(name=...)``)


def rank_pages(pid: int, backend: RankedBackend) -> set[int]:
    """Pages ``pid`` maps in every region, from its ``/proc/<pid>/maps`` (the kernel's list);
    a page mapped in some regions only fails."""
    layout = backend.layout
    per_region: list[set[int]] = [set() for _ in range(layout.num_regions)]
    for offset, length in memfd_view(pid, KV_MEMFD):
        for byte in range(offset, offset + length, layout.page_bytes):
            region, rest = divmod(byte, layout.region_bytes)
            per_region[region].add(rest // layout.page_bytes)
    assert all(s == per_region[0] for s in per_region), f"rank pid {pid} maps a partial page"
    return per_region[0]


def check_ranks(backend: RankedBackend, state: EngineState) -> None:
    """Every rank alive, its view between the scheduler's pages and the owner's (all three
    the same when no unmap is in flight), within an applied limit."""
    group = backend.group
    assert not group.any_dead(), group.describe(BarrierOutcome.FAILED)
    assert all(r.alive for r in state.ranks) and len(state.ranks) == group.world_size
    layout = backend.layout
    scheduler = {p for p in range(layout.num_pages) if backend.is_mapped(p)}
    owner = set(backend.owner.mapped_pages())
    for pid in group.pids:
        pages = rank_pages(pid, backend)
        assert scheduler <= pages, f"rank pid {pid} lacks pages {sorted(scheduler - pages)}"
        assert pages <= owner, f"rank pid {pid} maps pages {sorted(pages - owner)} given back"
        if not backend.unmaps_in_flight:  # every unmap acked and punched out: one view
            assert pages == owner == scheduler, (pid, sorted(pages ^ owner), sorted(owner))
        if state.status is Status.APPLIED and state.effective_limit_bytes is not None:
            assert len(pages) * layout.bundle_bytes <= state.effective_limit_bytes, (pid, state)


class RankedStorm(Storm):
    """:class:`Storm` whose checks inside a step also read every rank's view."""

    def at_point(self, name: str) -> None:
        check_ranks(self.backend, self.instance.state())
        super().at_point(name)


def ranked_storm(core: EngineCore, seed: int, num_steps: int) -> tuple[Any, Storm]:
    """``storm`` with :class:`RankedStorm`'s chaos and the ranks checked after every step."""
    step_fn = core.step_fn
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and runtime.pool is not None
    backend = runtime.pool._blocks.pages.backend
    assert isinstance(backend, RankedBackend)
    instance = runtime.instance
    chaos_done = Counter[str]()
    runtime._pass()  # the busy loop's first pass (attach_engine), before its first step
    steps = [0]

    def checked_step() -> Any:
        result = step_fn()
        state = check_state(instance, backend)
        check_ranks(backend, state)
        steps[0] += 1
        if backend.unmaps_in_flight:
            chaos_done["steps_with_unmaps_in_flight"] += 1
        if state.reason is not None:
            chaos_done[f"reason_{state.reason}"] += 1
        return result

    core.step_fn = checked_step  # type: ignore[method-assign]
    try:
        run, chaos = storm(core, seed, num_steps=num_steps, device=DEVICE, chaos_class=RankedStorm)
    finally:
        core.step_fn = step_fn  # type: ignore[method-assign]
    assert chaos is not None and steps[0] > num_steps
    chaos.done.update(chaos_done)
    return run, chaos


def slow_rank(monkeypatch: pytest.MonkeyPatch, rank: int, delay_s: float) -> None:
    """``rank`` delays every unmap ack by ``delay_s`` (the rank process's own drill option),
    longer than the barrier's wait: passes end with unmaps in flight, pages freed then are
    mapped again before every rank acked (revived)."""
    spawn = RankGroup.spawn_private.__func__  # type: ignore[attr-defined]

    def spawn_private(cls: type[RankGroup], *args: Any, **kwargs: Any) -> RankGroup:
        kwargs["barrier_delay_s"] = {rank: delay_s}
        return spawn(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(RankGroup, "spawn_private", classmethod(spawn_private))


@pytest.mark.parametrize(
    ("tp", "pp", "num_pages", "seed", "slow", "settings"),
    [
        (2, 1, 64, 31, False, {}),
        (2, 1, 6, 32, False, {}),
        (2, 2, 8, 33, False, {}),
        (2, 1, 16, 34, True, {}),
        (2, 1, 12, 35, False, {"KVSIDECAR_RESERVE_PAGES": "3", "KVSIDECAR_RESERVE_OUTPUT": "1"}),
    ],
)
def test_the_async_loop_with_ranks_survives_the_storm(
    plugin_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    tp: int,
    pp: int,
    num_pages: int,
    seed: int,
    slow: bool,
    settings: dict[str, str],
) -> None:
    """``slow``: rank 1's unmap acks outlast the barrier's wait; ``settings``: kvsidecar
    settings (a page reserve refilled at safe points maps pages on every rank too)."""
    if settings:
        for key, value in settings.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(_runtime, "_configured", None)
        plugin.register()  # the settings again (vLLM loads plugins only once)
    num_steps = 200 if slow else 300
    baseline = _baseline(plugin_env, seed, num_steps)  # synchronous, one rank, no limits
    monkeypatch.setenv("KVSIDECAR_STUB_TP", str(tp))
    monkeypatch.setenv("KVSIDECAR_STUB_PP", str(pp))
    if slow:
        slow_rank(monkeypatch, 1, 0.06)
    DEVICE.__init__(random.Random(seed))  # type: ignore[misc]  # points only: no fence on CPU
    core = build_core(plugin_env, num_pages, max_model_len=256, executor=SimDeviceExecutor)
    try:
        worker = core.model_executor.worker  # type: ignore[attr-defined]
        assert isinstance(worker, MultiRankStubWorker) and worker.group is not None
        assert core.batch_queue is not None and worker.group.world_size == tp * pp
        configured = _runtime.current_runtime()
        assert configured is not None  # the settings reached the engine's runtime
        assert configured.engine_settings.reserve_pages == int(
            settings.get("KVSIDECAR_RESERVE_PAGES", 0)
        )
        stressed, chaos = ranked_storm(core, seed, num_steps)
        state, measured = drain_to_zero(core, chaos.idle_loop)
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.pool is not None
        backend = runtime.pool._blocks.pages.backend
        assert isinstance(backend, RankedBackend)
        check_ranks(backend, state)
        views = [rank_pages(pid, backend) for pid in worker.group.pids]
    finally:
        DEVICE.at_point = None
        core.shutdown()
    done = chaos.done
    assert done["queued_aborts"] > 5 and done["abort_in_flight"] and done["limits"] > 50
    assert done["resets_in_flight"] + done["resets_running"] and min(
        done[f"limits_at_{p}"] for p in ("execute", "sample", "result")
    )
    if num_pages < 10:
        assert done["preemptions"] > 3
    if slow:  # the barrier's passes ended with the slow rank's unmaps not acked yet
        assert done["reason_rank_timeout"] > 5 and done["steps_with_unmaps_in_flight"] > 5
    assert state.status is Status.APPLIED and state.effective_limit_bytes == state.floor_bytes
    assert measured == state.mapped_bytes == state.floor_bytes, (measured, state)
    floor_pages = state.floor_bytes // backend.layout.bundle_bytes
    assert all(len(view) == floor_pages for view in views), views
    assert_same_outcomes(baseline, stressed, min_compared=20)


def test_a_rank_that_dies_while_the_async_loop_idles_is_reported_at_once(
    plugin_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank killed while the engine has no work: its pidfd wakes the busy loop (a WAKEUP
    on the input queue, the idle callback armed), whose idle pass reports ``rank_failed``;
    a limit published after that is never ``applied``, and the next step fails naming the
    rank."""
    monkeypatch.setenv("KVSIDECAR_STUB_TP", "2")
    DEVICE.__init__(None)  # type: ignore[misc]
    core = build_core(plugin_env, 16, max_model_len=256, executor=SimDeviceExecutor)
    try:
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.instance is not None
        instance = runtime.instance
        chaos = Storm(core, 0, DEVICE, Run())  # only its idle loop, what EngineCoreProc runs
        chaos.calm = True
        runtime._pass()
        core.add_request(*core.preprocess_add_request(make_request("a", [7] * 60, 5)))
        while core.scheduler.has_requests() or core.batch_queue:
            core.step_fn()
        chaos.idle_loop()
        assert instance.state().status is Status.APPLIED
        worker = core.model_executor.worker  # type: ignore[attr-defined]
        victim = worker.group.pids[1]
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not core.input_queue.empty(), what="the dead rank woke the engine")
        chaos.idle_loop()
        state = instance.state()
        assert state.status is Status.DEFERRED and state.reason == "rank_failed", state
        assert [(r.rank, r.alive) for r in state.ranks] == [(0, True), (1, False)]
        assert report_problem(state, state.limit_bytes, state.revision) is None, state
        in_foreign_thread(lambda: instance.set_limit(0))
        chaos.idle_loop()
        state = instance.state()
        assert state.status is Status.DEFERRED and state.reason == "rank_failed", state
        core.add_request(*core.preprocess_add_request(make_request("b", [9] * 60, 5)))
        with pytest.raises(
            RankChannelError, match=f"rank 1 \\(pid {victim}\\).*restart the instance"
        ):
            for _ in range(5):
                core.step_fn()
    finally:
        DEVICE.at_point = None
        core.shutdown()
