"""SGLang's overlap loop (``event_loop_overlap``) under limits, on a simulated device.

The loop launches batch N+1 before it processes the result of batch N
(``HarnessConfig(overlap=True)``, see ``CpuHarness.iterate``): a request that
finishes in N is already in N+1, with one slot more, which its release frees
while N+1 runs; a retraction (at the top of an iteration) and an abort free KV
that the batch in flight reads. The harness's KV lives on a simulated device
(``support.simdevice``): a launched batch stays in flight until the loop waits
for its result (``copy_done.synchronize()``) or the unmap fence's event is
synchronized, and every physical unmap is checked against the pages of the
batches in flight (on a GPU such an unmap is an illegal-address fault).

The storm: aborts of waiting, running (in the batch in flight), retracted and
just-admitted requests; ``flush_cache`` at random moments (SGLang flushes only
when fully idle, which in this loop includes no result left to process: it is
refused while a batch is in flight); ``/pause_generation`` in place for a few
iterations, with the batch in flight left unprocessed (SGLang's loops then run
only the paused-engine hook: the idle pass); limits 0, one page, just below what is
mapped and random, published from a foreign thread between iterations, between
admission and the prefill allocation, before the decode check and while a batch
runs before the previous result is processed; pools small enough that SGLang
retracts; many ``max_new_tokens=1`` requests; chunked prefill; shared prefixes
(hits on pages that a request finishing in N gave back while N+1 runs).

Checked at every iteration: no unmap under a batch in flight; the state against
the memfd (``sglang_support.check_state``: mapped bytes, ``applied`` only at or
under the effective limit, the sidecar's report checks); no exception out of the
loop (a failed prefill allocation is SGLang's ``RuntimeError: Prefill out of
memory``). At the end: every request completed with the tokens of the normal
loop without limits (the harness computes them from the KV it reads back), or
was aborted, and limit 0 leaves nothing mapped.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sglang_support import CappedDevice, LimitThread, check_state, on_sim_device, prompt
from support.simdevice import SimDevice
from support.threads import in_foreign_thread

from allocator import UnmapFence
from engine_ext.cpu_harness import CpuHarness, HarnessRequest
from engine_ext.protocol import Status

pytestmark = pytest.mark.sglang

Make = Callable[..., CpuHarness]
STEPS = 800
PREFIXES = 3


def _overlap_harness(
    make_harness: Make,
    monkeypatch: pytest.MonkeyPatch,
    device: SimDevice,
    *args: Any,
    total_pages: int | None = None,
    **kw: Any,
) -> tuple[CpuHarness, UnmapFence, CappedDevice | None]:
    made = on_sim_device(monkeypatch, device, total_pages=total_pages)
    h = make_harness(*args, overlap=True, **kw)
    h.device = device
    fence, capped = made[-1]
    assert h.pool.fence is fence
    return h, fence, capped


def _prompt(rng: random.Random) -> list[int]:
    prefix_id = rng.randrange(PREFIXES)
    prefix = [(prefix_id * 53 + j * 7 + 3) % 1900 + 1 for j in range(rng.choice((16, 32, 48)))]
    return prefix + [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 20))]


def _arrivals(seed: int) -> list[list[tuple[list[int], int]]]:
    """Per step, the requests submitted then (the same in every run of a seed)."""
    rng = random.Random(seed)
    steps: list[list[tuple[list[int], int]]] = []
    for step in range(STEPS):
        busy = (step // 40) % 2 == 0
        batch = []
        while rng.random() < (0.45 if busy else 0.08):
            new = 1 if rng.random() < 0.35 else rng.randrange(2, 12)
            batch.append((_prompt(rng), new))
        steps.append(batch)
    return steps


def _reference(make_harness: Make, cache: str, seed: int, **kw: Any) -> dict[int, list[int]]:
    """The normal loop, no limits, no aborts: prompt index -> tokens."""
    h = make_harness(cache, **kw)
    reqs = [h.submit(tokens, new) for batch in _arrivals(seed) for tokens, new in batch]
    h.run_until_idle()
    assert all(r.done for r in reqs)
    return {i: list(r.generated) for i, r in enumerate(reqs)}


class Storm:
    """The chaos of one run, from its own generator; ``done`` counts what it reached."""

    def __init__(
        self, h: CpuHarness, device: SimDevice, seed: int, capped: CappedDevice | None
    ) -> None:
        self.h = h
        self.device = device
        self.capped = capped  # a device another engine fills (SGLang then retracts)
        self.rng = random.Random(seed + 1000)
        self.controller = LimitThread(h)
        self.done = Counter[str]()
        self.calm = False
        h.at_point = self.at_point

    def publish(self, where: str) -> None:
        h, rng = self.h, self.rng
        bundle = h.bundle_bytes
        kind = rng.random()
        if kind < 0.2:
            limit: int | None = 0
        elif kind < 0.35:
            limit = bundle
        elif kind < 0.5:
            limit = None
        elif kind < 0.7:
            limit = max(0, h.mapped_bytes() - bundle)  # just below what is mapped
        else:
            limit = rng.randrange(0, h.blocks.pages.num_pages + 1) * bundle + rng.choice((0, 1))
        self.controller.publish(limit)
        self.done[f"limits_{where}"] += 1

    def at_point(self, name: str) -> None:
        """Inside an iteration: only a foreign thread's limit (SGLang reads aborts and
        flushes at the top of an iteration)."""
        if not self.calm and self.rng.random() < 0.12:
            self.publish(name)

    def between(self, live: list[HarnessRequest]) -> None:
        h, rng, done = self.h, self.rng, self.done
        if self.calm:
            h.paused = False
            return
        if h.paused:
            h.paused = rng.random() < 0.7  # a few paused iterations, then resumed
        elif rng.random() < 0.02:
            h.paused = True  # /pause_generation in_place: the batch in flight stays pending
            done["paused_in_flight" if h.last_batch is not None else "paused"] += 1
        if self.capped is not None and rng.random() < 0.1:
            self.capped.total_pages = rng.choice((6, 8, 10, 12, 10_000))
        if rng.random() < 0.1:
            self.publish("between")
        if rng.random() < 0.03:
            in_flight = bool(self.device.in_flight) or h.last_batch is not None
            if h.flush_cache():
                done["flushes"] += 1
                assert h.last_batch is None
            elif in_flight:
                done["flushes_refused_in_flight"] += 1
        retracted = [r for r in h.waiting if r.epoch > 0]  # queued again by a retraction
        if retracted and rng.random() < 0.5:
            assert h.abort(rng.choice(retracted))
            done["abort_retracted"] += 1
        if rng.random() < 0.12 and live:
            last = h.last_batch
            launched = {id(r) for r, _, _ in last.entries} if last is not None else set()
            in_flight = [r for r in h.running if id(r) in launched]
            pick = rng.random()
            pool, what = (
                (in_flight, "abort_in_flight")
                if pick < 0.55
                else (h.waiting, "abort_waiting")
                if pick < 0.85
                else (h.running, "abort_running")
            )
            if pool:
                assert h.abort(rng.choice(pool))
                done[what] += 1

    def stop(self) -> None:
        self.h.at_point = None
        self.controller.stop()
        assert not self.controller.errors, self.controller.errors


def _storm(
    h: CpuHarness, device: SimDevice, seed: int, capped: CappedDevice | None
) -> tuple[dict[int, list[int]], set[int], Counter[str]]:
    storm = Storm(h, device, seed, capped)
    reqs: list[HarnessRequest] = []
    try:
        for step, batch in enumerate(_arrivals(seed)):
            reqs.extend(h.submit(tokens, new) for tokens, new in batch)
            storm.between([r for r in reqs if not r.done and not r.aborted])
            h.iterate()
            storm.done["applied"] += check_state(h)
            assert not device.violations, device.violations[:5]
            if step % 150 == 149:
                storm.controller.publish(None)  # let the backlog drain now and then
        storm.calm = True
        h.paused = False
        if capped is not None:
            capped.total_pages = 10_000
        storm.controller.publish(None)
        h.run_until_idle()
        check_state(h)
        storm.controller.publish(0)
        h.idle_until(lambda: h.mapped_bytes() == 0)
        state = h.pool.state()
        assert state.status is Status.APPLIED and state.mapped_bytes == 0, state
    finally:
        storm.stop()
    assert not device.violations, device.violations[:5]
    outputs = {i: list(r.generated) for i, r in enumerate(reqs) if r.done}
    aborted = {i for i, r in enumerate(reqs) if r.aborted}
    assert len(outputs) + len(aborted) == len(reqs), h.describe()
    storm.done["retracted"] = h.num_retracted
    storm.done["prefix_hits"] = h.num_prefix_hits
    storm.done["overshoot_frees"] = h.num_overshoot_frees
    storm.done["unmaps"] = device.unmaps
    return outputs, aborted, storm.done


#: (completion, full_device, seed, settings and harness options) of each storm
CASES: list[tuple[str, bool, int, dict[str, Any]]] = [
    ("waited", False, 31, {}),
    ("random", False, 32, {}),
    ("waited", True, 33, {}),
    ("random", True, 34, {"max_evict_pages_per_step": 1}),
    ("waited", True, 35, {"chunked_prefill_size": 32}),
    ("waited", True, 36, {"reserve_pages": 2, "reserve_output": True}),
]
CASE_IDS = ["waited", "random", "full-device", "full-device-evict1", "chunked", "reserve"]


def run_storm(
    make_harness: Make,
    cache_kind: str,
    monkeypatch: pytest.MonkeyPatch,
    completion: str,
    full_device: bool,
    seed: int,
    extra: dict[str, Any],
) -> Counter[str]:
    """One storm, its outcome checked against the normal loop without limits; returns
    what the chaos reached. ``completion``: how the simulated device completes batches
    (``waited``: only when waited for; ``random``: also at random later launches);
    ``full_device``: another engine fills the device at random moments (6 to 12 of the
    pool's 64 pages left, or all), so SGLang retracts running requests."""
    chunked = {k: v for k, v in extra.items() if k == "chunked_prefill_size"}
    reference = _reference(make_harness, cache_kind, seed, **chunked)
    device = SimDevice(random.Random(seed) if completion == "random" else None)
    h, fence, capped = _overlap_harness(
        make_harness,
        monkeypatch,
        device,
        cache_kind,
        total_pages=10_000 if full_device else None,
        **extra,
    )
    outputs, aborted, done = _storm(h, device, seed, capped)
    assert fence.recording and fence.waits_on_event > 0
    assert outputs == {i: reference[i] for i in outputs}
    assert len(outputs) > 100 and len(aborted) > 5
    return done


@pytest.mark.parametrize(("completion", "full_device", "seed", "extra"), CASES, ids=CASE_IDS)
def test_the_overlap_loop_survives_aborts_flushes_and_limits_at_every_point(
    make_harness: Make,
    any_cache_kind: str,
    monkeypatch: pytest.MonkeyPatch,
    completion: str,
    full_device: bool,
    seed: int,
    extra: dict[str, Any],
) -> None:
    done = run_storm(
        make_harness, any_cache_kind, monkeypatch, completion, full_device, seed, extra
    )
    # the storm reached what it attacks (counts of these seeds: a change that stops
    # reaching a point fails here rather than passing without it)
    assert done["abort_in_flight"] > 10 and done["abort_waiting"] > 5, done
    assert done["flushes_refused_in_flight"] > 3 and done["paused_in_flight"] > 3, done
    assert min(done[f"limits_{p}"] for p in ("between", "admitted", "decode", "launched")) > 5
    assert done["overshoot_frees"] > 20, done
    assert done["prefix_hits"] > 20 or any_cache_kind == "disabled", done
    assert done["applied"] > 20 and done["unmaps"] > 20, done
    if full_device:
        assert done["retracted"] >= 2 and done["abort_retracted"], done


def test_overlap_loop_tokens_match_the_normal_loop(
    make_harness: Make, cache_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No limit, no chaos: the overlap loop generates the normal loop's tokens, the slots
    the next batch wrote past a finished request's output are given back, and its idle
    leak check holds."""
    reference = _reference(make_harness, cache_kind, 7)
    device = SimDevice()
    h, _, _ = _overlap_harness(make_harness, monkeypatch, device, cache_kind)
    reqs = [h.submit(tokens, new) for batch in _arrivals(7) for tokens, new in batch]
    h.run_until_idle()
    assert {i: list(r.generated) for i, r in enumerate(reqs)} == reference
    # (a request whose last token came from a batch followed by a prefill had no slot over)
    assert len(reqs) // 2 < h.num_overshoot_frees <= len(reqs) and not device.violations
    assert h.token_to_kv_pool_allocator.blocks.num_allocated_blocks == (
        1 + h.tree_cache.evictable_size() // h.config.page_size
    )


def test_a_request_released_while_the_next_batch_runs_waits_for_it(
    make_harness: Make, cache_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request finishing in batch N is in batch N+1, which writes one more slot; the
    release frees that slot while N+1 runs. Under a limit of 0 its page is retired, so
    the free unmaps it: that unmap must wait for N+1 (the fence records again on the
    forward stream before it waits: no record followed N+1's launch)."""
    device = SimDevice()
    h, fence, _ = _overlap_harness(make_harness, monkeypatch, device, cache_kind)
    ps = h.config.page_size
    slots_per_page = h.reservation.blocks_per_page * ps
    # prompt + first token end exactly on an allocator page: the overshoot slot opens a page
    req = h.submit(prompt(1, slots_per_page - 1 + slots_per_page), max_new_tokens=1)
    h.iterate()  # the prefill is launched
    h.iterate()  # the decode (token 1) is launched; the prefill's result processed
    h.pool.set_limit(0)  # from now on every page in use is above the target
    h.iterate()  # N+1 launched (one slot over, on a new page); N's result: req finishes
    assert req.done and h.last_batch is not None and device.in_flight
    assert h.num_overshoot_frees == 1
    assert not device.violations, device.violations
    h.run_until_idle()
    h.idle_until(lambda: h.mapped_bytes() == 0)
    assert device.unmaps > 0 and fence.waits_on_event > 0 and not device.violations


def test_an_abort_right_after_the_first_batch_from_idle_waits_for_that_batch(
    make_harness: Make, cache_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From idle, the overlap loop launches a batch and processes no result in that
    iteration, so no fence record follows the launch. An abort of its request and a
    limit of 0 right then evict and unmap the request's pages at the next pass, while
    the batch runs: the unmap must wait for it."""
    device = SimDevice()
    h, fence, _ = _overlap_harness(make_harness, monkeypatch, device, cache_kind)
    h.submit(prompt(1, 60), max_new_tokens=3)
    h.run_until_idle()
    in_foreign_thread(lambda: h.pool.set_limit(0))
    h.idle_until(lambda: h.mapped_bytes() == 0)  # the last record was consumed here
    unmaps = device.unmaps
    assert unmaps > 0 and not device.in_flight and fence.recording
    in_foreign_thread(lambda: h.pool.set_limit(None))
    req = h.submit(prompt(2, 200), max_new_tokens=8)
    h.iterate()  # from idle: the prefill is launched, no result processed
    assert h.last_batch is not None and h.last_batch.kind == "extend" and device.in_flight
    in_foreign_thread(lambda: h.pool.set_limit(0))
    assert h.abort(req)  # SGLang reads aborts at the top of the next iteration
    h.iterate()  # the pass evicts the request's cached prompt and unmaps its pages
    assert device.unmaps > unmaps
    assert not device.violations, device.violations
    h.idle_until(lambda: h.mapped_bytes() == 0)
    state = h.pool.state()
    assert state.status is Status.APPLIED and state.mapped_bytes == 0 and not device.violations


def test_the_normal_loop_waits_for_each_batch_before_its_result(
    make_harness: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``event_loop_normal`` on the same device: a batch's result is processed after
    waiting for it, so nothing stays in flight between iterations."""
    device = SimDevice()
    on_sim_device(monkeypatch, device)
    h = make_harness()
    h.device = device
    for i in range(6):
        h.submit(prompt(i), max_new_tokens=3)
    while not h.is_fully_idle():
        h.iterate()
        assert not device.in_flight and h.last_batch is None
    assert device.launched == 4 and not device.violations  # one prefill, three decodes
