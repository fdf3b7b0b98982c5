"""SGLang's chunked prefill (``scheduler.chunked_req``) under aborts, limits, flushes and pauses.

A prompt longer than ``--chunked-prefill-size`` is prefilled one chunk per round;
between rounds SGLang stashes the chunk (``checkpoint_kv_cache``: inserted into the
tree, locked) and keeps the request in ``chunked_req``, in no queue. An abort of it
is marked (``_pending_chunked_abort_req``) and released at the top of the next
``get_next_batch_to_run`` (``release_kv_cache(checkpoint=False)``), while in the
overlap loop the chunk launched last may still run.

On the CPU harness (both loops, both tree caches, the KV on a simulated device
whose unmaps are checked against the batches in flight), checked after every
iteration: the state against the memfd (``check_state``: mapped bytes,
``applied`` only at or under the limit as measured, the sidecar's report
checks, ``available_size() >= 0``), the evictable marks against a full rescan
of the tree, no unmap under a batch in flight, the chunked request's KV (the
locked prefix and the chunk after it) reading back its prompt's tokens; no
exception out of the loop (a failed prefill allocation is SGLang's
``RuntimeError``). Completed requests generate the tokens of a run without
aborts or limits (the harness computes them from the KV it reads back).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sglang_support import LimitThread, check_counts, check_state, on_sim_device, prompt
from support.simdevice import SimDevice

from engine_ext.cpu_harness import CpuHarness, HarnessRequest
from engine_ext.protocol import DeferReason, Status

pytestmark = pytest.mark.sglang

Make = Callable[..., CpuHarness]
CHUNK = 16  # tokens per round: 4 SGLang pages, one allocator page
LONG = 150  # 10 chunks (the last one 6 tokens)
VARIANTS = {"plain": {}, "reserves": {"reserve_pages": 3, "reserve_output": True}}


@pytest.fixture(params=[False, True], ids=["normal", "overlap"])
def overlap(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _harness(
    make_harness: Make,
    monkeypatch: pytest.MonkeyPatch,
    cache: str,
    overlap: bool,
    **settings: Any,
) -> tuple[CpuHarness, SimDevice]:
    device = SimDevice()
    on_sim_device(monkeypatch, device)
    h = make_harness(cache, chunked_prefill_size=CHUNK, overlap=overlap, **settings)
    h.device = device
    return h, device


def _reference(make_harness: Make, cache: str, prompts: list[tuple[list[int], int]]) -> list:
    """The tokens each prompt generates without chunks, aborts or limits."""
    h = make_harness(cache)
    reqs = [h.submit(tokens, n) for tokens, n in prompts]
    h.run_until_idle()
    return [r.generated for r in reqs]


def _kv_reads_back(h: CpuHarness, req: HarnessRequest, where: str) -> None:
    """The request's KV (the tree-owned, locked prefix and its own chunk) holds its
    prompt's tokens: a page evicted, reused or unmapped under it would not."""
    import torch

    assert req.row is not None, where
    prompt_len = min(req.kv_len, len(req.tokens))  # (a running request's output: its own)
    slots = h.req_to_token_pool.req_to_token[req.row, :prompt_len].long()
    got = h.k_buffer[-1][slots, 0, 0].float().tolist()
    want = torch.tensor(req.tokens[:prompt_len], dtype=torch.float16).float().tolist()
    assert got == want, f"{where}: request {req.rid}'s KV does not read back its prompt"
    if req.owned_len:
        path = h.tree_cache.path_device_indices(req.lock.node)
        assert path.tolist() == slots[: req.owned_len].tolist(), where
        assert int(h.tree_cache.protected_size()) >= req.owned_len, where


def _cached_len(h: CpuHarness, tokens: list[int]) -> int:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    match = h.tree_cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    return int(match.device_prefix_len)


def _check(h: CpuHarness, device: SimDevice, where: str) -> bool:
    applied = check_state(h)
    check_counts(h, where)
    assert not device.violations, f"{where}: unmapped under a batch in flight"
    for req in [h.chunked, *h.running]:
        if req is not None and req.row is not None:
            _kv_reads_back(h, req, where)
    return applied


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_abort_between_chunks_at_every_chunk(
    make_harness: Make,
    monkeypatch: pytest.MonkeyPatch,
    cache_kind: str,
    overlap: bool,
    variant: str,
) -> None:
    """The k-th long prompt is aborted after its (k+1)-th chunk was launched, for every
    k, while a short request runs beside it. The abort is taken (it was refused); the
    next round releases the request and launches no chunk of it; its stashed prefix
    stays in the tree, unlocked, and a later request over the same prompt reads it
    back. Nothing leaks (SGLang's strict idle check)."""
    h, device = _harness(make_harness, monkeypatch, cache_kind, overlap, **VARIANTS[variant])
    num_chunks = -(-LONG // CHUNK)
    longs: list[HarnessRequest] = []
    shorts: list[HarnessRequest] = []
    for k in range(num_chunks - 1):  # the last chunk completes the prompt: not chunked then
        long = h.submit(prompt(100 + k, LONG), max_new_tokens=3)
        shorts.append(h.submit(prompt(200 + k, 9), max_new_tokens=4))
        longs.append(long)
        launched = 0
        while launched <= k:
            before = long.kv_len
            h.iterate()
            _check(h, device, f"k={k}, chunk {launched}")
            launched += long.kv_len > before
            assert h.chunked is long, h.describe()
        assert long.kv_len == (k + 1) * CHUNK
        assert h.abort(long)  # was False: the chunked request was in no queue
        assert not h.abort(long)  # once
        kv_before = h.blocks.num_allocated_blocks
        h.iterate()
        _check(h, device, f"k={k}, aborted")
        assert h.chunked is not long and long.row is None and long.lock is None
        assert long not in h.running and long not in h.waiting and not long.done
        assert h.blocks.num_allocated_blocks <= kv_before + 2  # no chunk of it was allocated
        # what was stashed before the abort stays in the tree (the chunk launched last was
        # not stashed: the release does not checkpoint), unlocked
        assert _cached_len(h, long.tokens) == k * CHUNK
    h.run_until_idle()
    _check(h, device, "idle")
    assert int(h.tree_cache.protected_size()) == 0
    # the aborted prompts' stashed prefixes are in the tree: each is matched, read back
    # (the harness checks a hit's KV) and completes with the tokens of an unaborted run
    again = []
    for r in longs:
        hits, cached = h.num_prefix_hits, _cached_len(h, r.tokens)
        again.append(h.submit(list(r.tokens), 3))
        h.run_until_idle()
        _check(h, device, "again")
        assert h.num_prefix_hits - hits == (cached > 0)
    want = _reference(
        make_harness,
        cache_kind,
        [(r.tokens, r.max_new_tokens) for r in shorts] + [(r.tokens, 3) for r in again],
    )
    assert [r.generated for r in shorts + again] == want


def _limits(h: CpuHarness) -> list[int]:
    """0, one page, just below what is mapped, and a random page count."""
    bundle = h.bundle_bytes
    mapped = h.mapped_bytes()
    return [0, bundle, max(mapped - bundle - 1, 0), random.Random(5).randrange(2, 12) * bundle]


def test_limits_from_a_foreign_thread_while_a_long_prompt_is_mid_chunk(
    make_harness: Make, monkeypatch: pytest.MonkeyPatch, cache_kind: str, overlap: bool
) -> None:
    """Each limit arrives (from a foreign thread) between admission and the chunk's
    allocation, mid-prompt, over a tree full of other prompts' cache. The prompt's
    locked prefix is never evicted or unmapped (its KV reads back at every iteration);
    while it holds more than the limit the state says deferred, with a reason that is
    true (``evicting`` only while there is something to evict, else
    ``running_requests``); once it ended and the cache was evicted, applied, with the
    memory measured under the limit."""
    h, device = _harness(make_harness, monkeypatch, cache_kind, overlap)
    for i in range(12):  # other prompts' cache, evictable
        h.submit(prompt(300 + i, 30), max_new_tokens=2)
    h.run_until_idle()
    controller = LimitThread(h)
    bundle = h.bundle_bytes
    try:
        for round_, limit in enumerate(_limits(h)):
            controller.publish(None)
            long = h.submit(prompt(400 + round_, 200), max_new_tokens=3)
            while long.kv_len < 3 * CHUNK:
                h.iterate()
                _check(h, device, f"limit {limit}: before")
            assert h.chunked is long
            pending = [limit]

            def publish(point: str, pending: list[int] = pending) -> None:
                if point == "admitted" and pending:
                    controller.publish(pending.pop())

            h.at_point = publish
            deferred = after_done = 0
            for step in range(400):
                h.iterate()
                _check(h, device, f"limit {limit}: step {step}")
                state = h.pool.state()
                held = h.pages.num_in_use * bundle
                taken = not pending and state.limit_bytes == limit  # at the pass after it
                if taken and long.row is not None and held > (state.effective_limit_bytes or 0):
                    assert state.status is Status.DEFERRED, (state, h.describe())
                    deferred += 1
                if state.status is Status.DEFERRED:  # the reason agrees with the figures
                    if state.reason == DeferReason.EVICTING.value:  # (of the same state)
                        assert state.evictable_bytes > 0, state
                    else:
                        assert state.reason == DeferReason.RUNNING_REQUESTS.value, state
                        assert state.evictable_bytes == 0, state
                        assert state.pinned_bytes > (state.effective_limit_bytes or 0), state
                        # something runs, or (overlap) the pass ran while the last batch was
                        # in flight: the padding page it held is drained at the idle pass
                        padding = h.is_fully_idle() and h.blocks.num_allocated_blocks == 1
                        assert state.num_running_requests > 0 or padding, (step, state)
                if long.done:
                    after_done += 1
                    if state.status is Status.APPLIED:
                        break
                    # its KV is the tree's now: the next pass evicts it (capped passes)
                    assert after_done <= 3, (state, h.describe())
            h.at_point = None
            assert long.done, h.describe()
            assert deferred > 0 or limit >= h.pages.num_in_use * bundle
            state = h.pool.state()
            assert state.status is Status.APPLIED, (state, h.describe())
            assert h.mapped_bytes() <= max(limit, state.effective_limit_bytes or 0)
    finally:
        h.at_point = None
        controller.stop()
    assert not controller.errors, controller.errors
    h.pool.set_limit(None)
    h.run_until_idle()
    _check(h, device, "idle")


def test_flush_and_in_place_pause_while_a_chunked_request_is_pending(
    make_harness: Make, monkeypatch: pytest.MonkeyPatch, cache_kind: str, overlap: bool
) -> None:
    """``flush_cache`` is refused while a chunked request is pending (SGLang flushes only
    when fully idle), also while its abort is marked; an in-place pause leaves it (and
    the mark) as they are, only the idle pass runs, a limit 0 published then defers on
    its pages and unmaps nothing it holds; on resume the abort is taken first, then the
    flush is accepted and limit 0 leaves nothing mapped."""
    h, device = _harness(make_harness, monkeypatch, cache_kind, overlap)
    fill_reqs = [h.submit(prompt(500 + i, 20), max_new_tokens=2) for i in range(4)]
    h.run_until_idle()
    assert all(r.done for r in fill_reqs)
    long = h.submit(prompt(600, LONG), max_new_tokens=3)
    for _ in range(3):
        h.iterate()
        _check(h, device, "chunks")
    assert h.chunked is long and not h.is_fully_idle()
    assert not h.flush_cache()
    h.paused = True
    kv_len = long.kv_len
    h.pool.set_limit(0)
    for step in range(5):
        h.iterate()
        _check(h, device, f"paused {step}")
        state = h.pool.state()
        assert state.status is Status.DEFERRED and state.reason in {
            DeferReason.RUNNING_REQUESTS.value,
            DeferReason.EVICTING.value,
        }
    assert long.kv_len == kv_len and h.chunked is long  # no chunk while paused
    assert h.abort(long)
    assert not h.flush_cache()  # the abort is only marked
    h.iterate()  # still paused: the mark waits
    _check(h, device, "paused, abort marked")
    assert h.chunked is long and long.row is not None
    h.paused = False
    h.iterate()
    _check(h, device, "resumed")
    assert h.chunked is None and long.row is None
    h.run_until_idle()
    assert h.flush_cache()
    h.iterate()
    _check(h, device, "flushed")
    assert h.pool.state().status is Status.APPLIED
    assert h.mapped_bytes() == 0
    h.pool.set_limit(None)
    again = h.submit(prompt(600, LONG), max_new_tokens=3)
    h.run_until_idle()
    _check(h, device, "again")
    assert again.generated == _reference(make_harness, cache_kind, [(again.tokens, 3)])[0]


def test_a_request_in_chunked_prefill_counts_as_running(
    make_harness: Make, monkeypatch: pytest.MonkeyPatch, cache_kind: str, overlap: bool
) -> None:
    """SGLang keeps the request in the middle of its chunks in ``chunked_req``, neither
    queued nor in the running batch. The state counted it nowhere: an engine prefilling a
    long prompt above a limit said ``deferred``, ``running_requests``, with
    ``num_running_requests: 0`` and nothing waiting."""
    h, device = _harness(make_harness, monkeypatch, cache_kind, overlap)
    long = h.submit(prompt(700, LONG), max_new_tokens=3)
    h.iterate()
    h.iterate()
    assert h.chunked is long and not h.running and not h.waiting
    h.pool.set_limit(0)
    h.iterate()  # the pass takes the limit; the chunk is served above it
    _check(h, device, "mid-chunk")
    state = h.pool.state()
    assert state.status is Status.DEFERRED
    assert state.reason == DeferReason.RUNNING_REQUESTS.value
    assert state.num_running_requests == 1 and state.num_waiting_requests == 0
    h.pool.set_limit(None)
    h.run_until_idle()
    assert long.done and h.pool.state().num_running_requests == 0


STORM_STEPS = 500


def _storm_prompt(rng: random.Random) -> list[int]:
    """Long prompts over a few shared starts (hits on stashed chunks), some short ones."""
    if rng.random() < 0.3:
        return [rng.randrange(1, 2000) for _ in range(rng.randrange(2, 12))]
    base = rng.randrange(3)
    start = [(base * 53 + j * 7 + 3) % 1900 + 1 for j in range(rng.choice((16, 40, 64)))]
    return start + [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 140))]


def _storm(
    h: CpuHarness, device: SimDevice, seed: int, *, limits: bool, stats: Counter[str]
) -> dict[int, Any]:
    """Seeded traffic of long prompts; with ``limits``, also aborts (mostly of the chunked
    request), limits from a foreign thread at every point of the iteration, flushes,
    in-place and retracting pauses. Returns the generated tokens per completed request."""
    rng = random.Random(seed)  # the same prompts in every run of a seed
    chaos = random.Random(seed + 1)
    controller = LimitThread(h) if limits else None
    bundle, num_pages = h.bundle_bytes, h.pages.num_pages
    reqs: list[HarnessRequest] = []

    def maybe_publish(point: str) -> None:
        if controller is None or chaos.random() > 0.1:
            return
        roll = chaos.random()
        mapped = h.mapped_bytes()
        if roll < 0.2:
            limit: int | None = 0
        elif roll < 0.35:
            limit = bundle
        elif roll < 0.5:
            limit = max(mapped - bundle - 1, 0)
        elif roll < 0.65:
            limit = None
        else:
            limit = chaos.randrange(0, num_pages + 1) * bundle
        controller.publish(limit)

    h.at_point = maybe_publish
    paused_for = 0
    try:
        for step in range(STORM_STEPS):
            if rng.random() < 0.3:
                reqs.append(h.submit(_storm_prompt(rng), max_new_tokens=rng.randrange(1, 8)))
            if limits:
                roll = chaos.random()
                if roll < 0.06 and h.chunked is not None:
                    stats["chunked_aborts"] += h.abort(h.chunked)
                elif roll < 0.08 and reqs:
                    h.abort(chaos.choice(reqs))
                elif roll < 0.1:
                    fully_idle = h.is_fully_idle()
                    assert h.flush_cache() == fully_idle
                elif roll < 0.12 and not h.paused:
                    if chaos.random() < (0.3 if h.chunked is not None else 0.7):
                        h.paused, paused_for = True, chaos.randrange(1, 4)
                    else:
                        stats["chunked_retracts"] += h.chunked is not None
                        h.pause_retract()
                        paused_for = chaos.randrange(0, 3)
                if h.paused:
                    if paused_for <= 0:
                        h.paused = False
                    paused_for -= 1
            maybe_publish("between")
            h.iterate()
            stats["deferred"] += not _check(h, device, f"step {step}")
            if limits and step % 125 == 124:
                controller.publish(None)  # type: ignore[union-attr]
        h.at_point = None
        h.paused = False
        if controller is not None:
            controller.publish(None)
        h.run_until_idle()
        _check(h, device, "idle")
    finally:
        h.at_point = None
        if controller is not None:
            controller.stop()
    assert controller is None or not controller.errors, controller.errors
    for req in reqs:
        assert req.done or req.aborted, f"request {req.rid}: {h.describe()}"
    return {req.rid: req.generated for req in reqs if req.done}


@pytest.mark.parametrize("seed", [3])
def test_chunked_prefill_storm(
    make_harness: Make,
    monkeypatch: pytest.MonkeyPatch,
    cache_kind: str,
    overlap: bool,
    seed: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Aborts between chunks, limits from a foreign thread at every point, flushes, in-place
    and retracting pauses (the chunked request retracted with the running ones), the page
    reserve and the output reservation, over long prompts in 16-token chunks; every
    iteration checked (module doc). Every completed request generated the tokens of the
    run without any of it, in the normal loop."""
    reference_h, ref_device = _harness(make_harness, monkeypatch, cache_kind, False)
    reference = _storm(reference_h, ref_device, seed, limits=False, stats=Counter())
    h, device = _harness(
        make_harness, monkeypatch, cache_kind, overlap, reserve_pages=2, reserve_output=True
    )
    stats: Counter[str] = Counter()
    got = _storm(h, device, seed, limits=True, stats=stats)
    assert len(got) > 60
    print(dict(stats), h.num_parked_chunks, h.token_to_kv_pool_allocator.num_prefill_overdrafts)
    assert stats["chunked_aborts"] >= 5 and stats["chunked_retracts"] >= 2, stats
    assert {rid: got[rid] for rid in got.keys() & reference.keys()} == {
        rid: reference[rid] for rid in got.keys() & reference.keys()
    }
    assert "out of memory" not in caplog.text.lower()


def test_output_reservation_counts_the_rest_of_a_chunked_prompt(
    make_harness: Make, monkeypatch: pytest.MonkeyPatch, cache_kind: str, overlap: bool
) -> None:
    """With ``reserve_output``, ``applied`` promises the engine stays under the limit while
    it holds (docs/limits.md). A limit that fits what a prompt in the middle of its chunks
    holds now said ``applied`` (``reserved_bytes`` 0: the chunked request was not among
    the running ones), then every continuation went above it (4 pages to 11)."""
    h, device = _harness(make_harness, monkeypatch, cache_kind, overlap, reserve_output=True)
    long = h.submit(prompt(800, LONG), max_new_tokens=40)
    h.iterate()
    h.iterate()
    assert h.chunked is long
    bundle = h.bundle_bytes
    limit = h.mapped_bytes() + bundle
    h.pool.set_limit(limit)
    ps, per_page = h.config.page_size, h.blocks.blocks_per_page
    applied_at: int | None = None
    for step in range(200):
        h.iterate()
        applied = _check(h, device, f"step {step}")
        state = h.pool.state()
        if h.chunked is long:  # what it may still add: the rest of its prompt, its output
            held = -(-long.kv_len // ps)
            more = -(-(LONG + 40) // ps) - held
            assert state.reserved_bytes >= more // per_page * bundle, (state, long.kv_len)
            assert state.status is Status.DEFERRED, state
            assert state.reason == DeferReason.RUNNING_REQUESTS.value, state
        if applied and applied_at is None:
            applied_at = step
        if applied_at is not None:  # applied holds: the memory stays under the limit
            assert h.mapped_bytes() <= limit, (step, applied_at, state)
        if long.done and applied:
            break
    assert long.done and applied_at is not None
    assert long.generated == _reference(make_harness, cache_kind, [(long.tokens, 40)])[0]


def test_an_aborted_chunk_that_waited_for_the_device_leaves_no_wait_behind(
    make_harness: Make, monkeypatch: pytest.MonkeyPatch, cache_kind: str, overlap: bool
) -> None:
    """A continuation the full device parks reads ``device_out_of_memory`` with its chunk
    in ``waiting_bytes``. Aborted, with nothing else queued, SGLang builds no admission
    budget again (``get_new_batch_prefill`` returns first), so the parked chunk stayed in
    the state of an idle engine until the next request came."""
    device = SimDevice()
    made = on_sim_device(monkeypatch, device, total_pages=10_000)
    h = make_harness(cache_kind, chunked_prefill_size=CHUNK, overlap=overlap)
    h.device = device
    capped = made[-1][1]
    assert capped is not None
    long = h.submit(prompt(900, LONG), max_new_tokens=3)
    h.iterate()
    h.pool.before_schedule()  # unused promises go back: only the chunk's pages stay mapped
    capped.total_pages = len(capped.inner.mapped_pages())  # another engine fills the device
    for step in range(12):
        h.iterate()
        _check(h, device, f"step {step}")
        if h.pool.state().waiting_reason == "device_out_of_memory":
            break
    state = h.pool.state()
    assert h.chunked is long and state.waiting_reason == "device_out_of_memory", state
    assert state.waiting_bytes > 0 and state.num_running_requests == 1
    assert h.abort(long)
    for step in range(3):
        h.iterate()
        _check(h, device, f"aborted {step}")
    assert h.is_fully_idle() and long.row is None
    state = h.pool.state()
    assert state.waiting_reason is None and state.waiting_bytes == 0, state
    assert state.num_running_requests == 0 and state.num_waiting_requests == 0
    capped.total_pages = 10_000
    again = h.submit(prompt(900, LONG), max_new_tokens=3)
    h.run_until_idle()
    assert again.generated == _reference(make_harness, cache_kind, [(again.tokens, 3)])[0]
