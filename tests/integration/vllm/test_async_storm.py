"""The async-scheduling loop under an adversarial storm, on the simulated device.

``test_async_scheduling`` runs ``drive``'s storm on ``EngineCore.step_with_batch_queue``;
this one attacks the points that loop adds. Between calls of ``step_fn``: aborts (of a
request in the step still in flight, a preempted one, one waiting for memory),
``reset_prefix_cache()`` with a step in flight (also with ``reset_running_requests``),
limits (0, one page, just below what is mapped, random) from a foreign thread, and,
when the engine has no work, what ``EngineCoreProc``'s busy loop runs (the idle
callbacks the runtime arms). Inside a step, at the executor's points (after a
schedule, at sampling, and when the engine waits for a step's output, right before it
processes ``aborts_queue`` and the output): limits from a foreign thread and aborts put
on ``core.aborts_queue``. Pools small enough that vLLM preempts, many ``max_tokens=1``
requests (finished in step N while scheduled again in N+1) and shared prefixes (hits
on blocks freed while N+1 is in flight). The simulated device completes steps only
when waited for, or also at random later points.

Checked at every step (and at each point inside one: what a reader of the socket
sees): no page is unmapped under a step in flight, an applied limit holds in the
kernel's measure, the state's mapped bytes follow it, every state passes the
sidecar's checks. At the end: every request completed with the tokens of the
synchronous engine without limits (the stub computes them from the KV read back), or
was aborted, and a limit of 0 leaves only the floor mapped.
"""

from __future__ import annotations

import queue
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from support.threads import in_foreign_thread
from test_async_scheduling import SimDevice, SimDeviceExecutor, sim_fence
from test_engine_core_limits import (
    Run,
    assert_same_outcomes,
    build_core,
    check_state,
    collect_outputs,
    drain_to_zero,
    limited,
    make_request,
    plugin_env,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import RequestStatus

from engine_ext.protocol import Status
from engine_ext.vllm import _runtime, plugin

pytestmark = pytest.mark.vllm

__all__ = ["plugin_env"]  # the fixture, imported for this module's tests


class Storm:
    """The chaos of one stressed run, drawn from its own generator (the arrivals stay
    those of the baseline); ``done`` counts what it did."""

    def __init__(self, core: EngineCore, seed: int, device: SimDevice, run: Run) -> None:
        runtime = _runtime.current_runtime()
        assert runtime is not None and runtime.instance is not None and runtime.pool is not None
        self.core = core
        self.rng = random.Random(seed + 1000)
        self.device = device
        self.run = run
        self.instance = runtime.instance
        self.backend = runtime.pool._blocks.pages.backend
        self.bundle = self.instance.state().page_bundle_bytes
        self.capacity = self.instance.state().capacity_bytes
        self.live: dict[str, list[int]] = {}
        self.done = Counter[str]()
        self.calm = False  # the tail: no more chaos
        device.at_point = self.at_point
        # the busy loop's side of the idle hook, as in EngineCoreProc: a publish arms a
        # callback and puts a WAKEUP on the input queue; idle_loop() runs them
        core.input_queue = queue.Queue()  # type: ignore[attr-defined]
        runtime._engine_core = core

    def idle_loop(self) -> None:
        """What ``EngineCoreProc._process_input_queue`` runs when the engine has no work:
        the idle callbacks, then the input queue (here only our WAKEUPs)."""
        core: Any = self.core
        while not core.scheduler.has_requests() and not core.batch_queue:
            while core._idle_state_callbacks:  # EngineCoreProc._notify_idle_state_callbacks
                core._idle_state_callbacks.pop()(core)
            if core.input_queue.empty():
                return
            while not core.input_queue.empty():
                core.input_queue.get_nowait()
            self.done["idle_wakeups"] += 1

    def publish(self) -> None:
        choice = self.rng.random()
        if choice < 0.2:
            limit: int | None = 0
        elif choice < 0.35:
            limit = self.bundle
        elif choice < 0.5:
            limit = None
        elif choice < 0.8:  # just below what is mapped: cached pages must go
            limit = max(0, self.backend.mapped_bytes() - self.rng.randrange(1, 4) * self.bundle)
        else:
            limit = self.rng.randrange(0, self.capacity)
        in_foreign_thread(lambda: self.instance.set_limit(limit))
        self.done["limits"] += 1

    def victim(self) -> tuple[str, str] | None:
        """A live request to abort, and what it was: in the step in flight, preempted,
        waiting (for memory, under a limit), running, or any."""
        sched: Any = self.core.scheduler
        in_flight = [
            r for _, out, _ in self.core.batch_queue or () for r in out.num_scheduled_tokens
        ]
        kinds = {
            "in_flight": in_flight,
            "preempted": [
                r.request_id for r in sched.waiting if r.status is RequestStatus.PREEMPTED
            ],
            "waiting": [r.request_id for r in sched.waiting if r.status is RequestStatus.WAITING],
            "running": [r.request_id for r in sched.running],
        }
        for kind in self.rng.sample(list(kinds), len(kinds)):
            ids = [r for r in kinds[kind] if r in self.live]
            if ids:
                return self.rng.choice(ids), kind
        return None

    def abort(self, *, queued: bool) -> None:
        chosen = self.victim()
        if chosen is None:
            return
        request_id, kind = chosen
        del self.live[request_id]
        self.run.aborted.add(request_id)
        self.done[f"abort_{kind}"] += 1
        if queued:  # the API server's thread: processed inside step_with_batch_queue
            self.core.aborts_queue.put_nowait([request_id])
            self.done["queued_aborts"] += 1
        else:
            self.core.abort_requests([request_id])

    def at_point(self, name: str) -> None:
        """Inside a step (SimDevice's points): limits and queued aborts only (what other
        threads do while the busy loop steps)."""
        check_state(self.instance, self.backend)  # what a socket reader sees mid-step
        if self.calm:
            return
        if self.rng.random() < 0.2:
            self.publish()
            self.done[f"limits_at_{name}"] += 1
        if self.rng.random() < 0.04:
            self.abort(queued=True)

    def between_steps(self) -> None:
        """Between calls of ``step_fn`` (the busy loop's utility calls and idle pass)."""
        self.idle_loop()
        if self.calm:
            return
        if self.rng.random() < 0.25:
            self.publish()
        if self.rng.random() < 0.03:
            self.abort(queued=False)
        if self.rng.random() < 0.05:
            in_flight = bool(self.core.batch_queue)
            everything = self.rng.random() < 0.2  # running requests preempted first
            if self.core.reset_prefix_cache(reset_running_requests=everything):
                kind = "running" if everything else "in_flight" if in_flight else "idle"
                self.done[f"resets_{kind}"] += 1
        self.idle_loop()


def storm(
    core: EngineCore,
    seed: int,
    *,
    num_steps: int,
    device: SimDevice | None,
    chaos_class: type[Storm] = Storm,
) -> tuple[Run, Storm | None]:
    """Arrivals drawn from ``seed`` (the same in every run); with ``device``, the chaos of
    ``chaos_class`` and the checks of every step. Returns the run and what the chaos did."""
    rng = random.Random(seed)
    run = Run()
    runtime = _runtime.current_runtime()
    assert runtime is not None and runtime.instance is not None and runtime.pool is not None
    instance = runtime.instance
    backend = runtime.pool._blocks.pages.backend
    chaos = chaos_class(core, seed, device, run) if device is not None else None
    live = chaos.live if chaos is not None else {}
    docs = [[rng.randrange(10, 3000) for _ in range(rng.choice((40, 64, 100)))] for _ in range(6)]
    step = next_id = 0
    while step < num_steps or live or core.scheduler.has_requests() or core.batch_queue:
        if step < num_steps and rng.random() < (0.45 if (step // 30) % 2 else 0.05):
            request_id = f"r{next_id}"
            next_id += 1
            tokens = rng.choice(docs) + [
                rng.randrange(10, 3000) for _ in range(rng.randrange(0, 30))
            ]
            max_tokens = 1 if rng.random() < 0.35 else rng.randrange(2, 60)
            core.add_request(
                *core.preprocess_add_request(make_request(request_id, tokens, max_tokens))
            )
            live[request_id] = []
        if chaos is not None:
            if step == num_steps:
                chaos.calm = True
                in_foreign_thread(lambda: instance.set_limit(None))  # the tail drains
            chaos.between_steps()
        outputs, _ = core.step_fn()
        collect_outputs(outputs, live, run)
        if chaos is not None:
            state = check_state(instance, backend)
            run.applied_checks += limited(state)
            assert device is not None and not device.violations, device.violations[:5]
        step += 1
        assert step < num_steps * 20, f"requests never finished: {sorted(live)}"
    if chaos is not None:
        chaos.done["preemptions"] = runtime._num_preemptions
    return run, chaos


def _baseline(plugin_env: Path, seed: int, num_steps: int) -> Run:
    core = build_core(plugin_env)
    try:
        run, _ = storm(core, seed, num_steps=num_steps, device=None)
    finally:
        core.shutdown()
    _runtime._runtime = None  # the next EngineCore gets a runtime of its own
    return run


@pytest.mark.parametrize(
    ("completion", "num_pages", "seed", "settings"),
    [
        ("waited", 64, 21, {}),
        ("random", 64, 22, {}),
        ("waited", 6, 23, {}),
        ("random", 6, 24, {}),
        ("random", 64, 21, {"KVSIDECAR_RESERVE_OUTPUT": "1"}),
        ("waited", 6, 23, {"KVSIDECAR_RESERVE_PAGES": "3"}),
    ],
)
def test_the_async_loop_survives_aborts_resets_and_limits_at_every_point(
    plugin_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    completion: str,
    num_pages: int,
    seed: int,
    settings: dict[str, str],
) -> None:
    """``completion``: how the simulated device completes steps (``waited``: only when
    waited for); ``settings``: kvsidecar settings (the output reservation's figures and
    the page reserve's refills move at every step of this loop too)."""
    if settings:
        for key, value in settings.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(_runtime, "_configured", None)
        plugin.register()  # the settings again (vLLM loads plugins only once)
    num_steps = 500
    baseline = _baseline(plugin_env, seed, num_steps)
    device, fence = sim_fence(monkeypatch, random.Random(seed) if completion == "random" else None)
    core = build_core(plugin_env, num_pages, max_model_len=256, executor=SimDeviceExecutor)
    try:
        assert core.batch_queue is not None
        configured = _runtime.current_runtime()
        assert configured is not None  # the settings reached the engine's runtime
        assert configured.engine_settings.reserve_output == ("KVSIDECAR_RESERVE_OUTPUT" in settings)
        assert configured.engine_settings.reserve_pages == int(
            settings.get("KVSIDECAR_RESERVE_PAGES", 0)
        )
        stressed, chaos = storm(core, seed, num_steps=num_steps, device=device)
        assert chaos is not None
        state, measured = drain_to_zero(core, chaos.idle_loop)
    finally:
        device.at_point = None
        core.shutdown()
    done = chaos.done
    # the storm reached what it attacks (counts of this seed; a change that stops reaching
    # a point fails here rather than passing without it)
    assert done["queued_aborts"] > 20 and done["abort_in_flight"] > 5 and done["abort_waiting"] > 5
    assert done["resets_in_flight"] and done["resets_running"] and done["idle_wakeups"] > 10
    assert min(done[f"limits_at_{point}"] for point in ("execute", "sample", "result")) > 40
    if num_pages < 10:  # a pool that small: vLLM preempts (resets aside), and aborts those
        assert done["preemptions"] > 5 and done["abort_preempted"]
    assert not device.violations, device.violations[:5]
    assert fence.recording and device.unmaps > 20
    assert state.status is Status.APPLIED and state.effective_limit_bytes == state.floor_bytes
    assert measured == state.mapped_bytes == state.floor_bytes, (measured, state)
    assert_same_outcomes(baseline, stressed, min_compared=30)
