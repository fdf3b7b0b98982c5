"""Issue 11 acceptance (SGLang): random limits from a foreign thread never break the scheduler.

On the CPU harness (SGLang's real tree caches, ``PrefillBudget``,
``alloc_paged_token_slots_extend`` and idle leak check), for both tree caches
and ``max_evict_pages_per_step`` in {1, whole overage}: limits (0, one page,
unlimited, random) are published by a controller thread at random points of
the scheduler iteration -- between iterations, between admission and the
prefill allocation, before the decode capacity check -- interleaved with
shared-prefix requests and aborts. Checked at every step: no exception (a
failed prefill allocation is SGLang's ``RuntimeError``), ``available_size() >=
0``, and whenever the state says ``applied``, the memory measured from the
memfd is at or under the effective limit. At the end every request completed
or was aborted, and every completed request generated exactly the tokens of
a run without limit changes (the harness computes tokens from the KV it
reads back, so a page lost or reused under a request changes them).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from sglang_support import LimitThread, check_state

from engine_ext.cpu_harness import CpuHarness, HarnessRequest

pytestmark = pytest.mark.sglang

Make = Callable[..., CpuHarness]
SEED = 11
STEPS = 1500
PREFIXES = 4


@dataclass
class Trace:
    """What one run produced, for comparison with the reference run."""

    tokens: dict[int, list[int]] = field(default_factory=dict)  # completed rid -> generated
    aborted: set[int] = field(default_factory=set)
    limits_published: int = 0
    applied_samples: int = 0
    min_available: int = 1 << 62


def _prompt(rng: random.Random) -> list[int]:
    prefix_id = rng.randrange(PREFIXES)
    prefix = [(prefix_id * 53 + j * 7 + 3) % 1900 + 1 for j in range(rng.choice((16, 32, 48)))]
    tail = [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 24))]
    return prefix + tail


def _run(h: CpuHarness, *, with_limits: bool) -> Trace:
    """Drive ``STEPS`` iterations of one seeded scenario; limits only if ``with_limits``."""
    rng = random.Random(SEED)  # the same requests, aborts and points in both runs
    limit_rng = random.Random(SEED + 1)
    bundle = h.bundle_bytes
    num_bundles = h.blocks.pages.num_pages
    trace = Trace()
    reqs: list[HarnessRequest] = []
    controller = LimitThread(h) if with_limits else None

    def maybe_publish(point: str) -> None:
        if controller is None or limit_rng.random() > 0.08:
            return
        kind = limit_rng.random()
        if kind < 0.2:
            limit: int | None = 0
        elif kind < 0.35:
            limit = bundle
        elif kind < 0.55:
            limit = None
        else:
            limit = limit_rng.randrange(0, num_bundles + 1) * bundle + limit_rng.choice(
                (0, 1, 4096)
            )
        controller.publish(limit)
        trace.limits_published += 1

    def check() -> None:
        available = h.token_to_kv_pool_allocator.available_size()
        trace.min_available = min(trace.min_available, available)
        trace.applied_samples += check_state(h)

    h.at_point = maybe_publish
    try:
        for step in range(STEPS):
            if rng.random() < 0.35:
                reqs.append(h.submit(_prompt(rng), max_new_tokens=rng.randrange(1, 12)))
            if reqs and rng.random() < 0.03:
                h.abort(rng.choice(reqs))
            maybe_publish("between")
            h.iterate()
            check()
            if with_limits and step % 300 == 299:  # let the backlog drain now and then
                controller.publish(None)  # type: ignore[union-attr]
        h.at_point = None  # no more limits: the drain below runs unlimited to the end
        if controller is not None:
            controller.publish(None)  # unlimited: every waiting request must now complete
        h.run_until_idle()
        check()
    finally:
        h.at_point = None
        if controller is not None:
            controller.stop()
            assert not controller.errors, controller.errors
    for req in reqs:
        assert req.done or req.aborted, f"request {req.rid} neither completed nor was aborted"
        if req.done:
            trace.tokens[req.rid] = list(req.generated)
        else:
            trace.aborted.add(req.rid)
    return trace


@pytest.mark.parametrize(
    ("max_evict", "reserve"),
    [(1, 0), (None, 0), (1, 3)],
    ids=["evict1", "evict-all", "evict1-reserve3"],
)
def test_random_limits_from_a_foreign_thread(
    make_harness: Make, any_cache_kind: str, max_evict: int | None, reserve: int
) -> None:
    reference = _run(make_harness(any_cache_kind), with_limits=False)
    h = make_harness(any_cache_kind, max_evict_pages_per_step=max_evict, reserve_pages=reserve)
    pages = h.token_to_kv_pool_allocator.blocks.pages
    assert pages.reserve_pages == reserve
    refilled: list[int] = []
    refill = pages.refill_reserve
    pages.refill_reserve = lambda: refilled.append(refill()) or refilled[-1]  # type: ignore[method-assign]
    limited = _run(h, with_limits=True)
    if reserve:  # the passes refilled what admissions took (within the limit)
        h.iterate()  # idle and unlimited: the pass at the top tops it up
        assert sum(refilled) > reserve and pages.reserve_wanted() == 0
        assert pages.num_free_mapped == min(reserve, pages.num_pages - pages.num_in_use)

    assert limited.limits_published > 50 and limited.applied_samples > 0
    assert limited.min_available >= 0
    both = reference.tokens.keys() & limited.tokens.keys()
    assert len(both) > 100
    assert {rid: limited.tokens[rid] for rid in both} == {
        rid: reference.tokens[rid] for rid in both
    }
    # aborts are placed by step: a request aborted in one run may have finished in the other
    assert set(limited.tokens) | limited.aborted == set(reference.tokens) | reference.aborted
    if h.config.chunked_prefill_size is None:  # (a chunked continuation may be served above
        # the limit, as a running request is: docs/sglang.md, "Liveness")
        assert h.token_to_kv_pool_allocator.num_prefill_overdrafts == 0  # admission held
