"""The demand fields on SGLang's real memory classes (CPU harness), against token arithmetic.

``prefix_hit_rate``: the tree cache's matched tokens over the tokens looked
up, at each accepted admission. ``waiting_bytes``: the refused request's
admission budget plus every other waiting request's whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang_support import prompt

from engine_ext.cpu_harness import CpuHarness
from engine_ext.protocol import Status

Make = Callable[..., CpuHarness]


def test_prefix_hit_rate_is_matched_tokens_over_looked_up_tokens(
    make_harness: Make, cache_kind: str
) -> None:
    h = make_harness(cache_kind)
    page = h.config.page_size
    assert h.pool.state().prefix_hit_rate is None  # no admission yet
    doc = prompt(7, length=5 * page + 3)
    h.submit(doc, max_new_tokens=2)
    h.run_until_idle()
    h.pool.before_schedule()
    assert h.pool.state().prefix_hit_rate == 0.0
    looked_up, hit = len(doc), 0
    for i, tail in enumerate((1, 9, 2 * page)):
        tokens = doc + prompt(100 + i, length=tail)
        h.submit(tokens, max_new_tokens=2)
        h.run_until_idle()
        h.pool.before_schedule()
        looked_up += len(tokens)
        hit += len(doc) // page * page  # the document's whole pages are in the tree
        assert h.pool.state().prefix_hit_rate == hit / looked_up


def test_waiting_bytes_cover_every_waiting_request(make_harness: Make, cache_kind: str) -> None:
    h = make_harness(cache_kind)
    bundle, page = h.bundle_bytes, h.config.page_size
    block_bytes = bundle // h.blocks.blocks_per_page
    a = h.submit(prompt(50, length=120), max_new_tokens=120)
    h.iterate()
    assert a in h.running
    h.pool.set_limit(2 * bundle)
    b = h.submit(prompt(51, length=300), max_new_tokens=8)
    c = h.submit(prompt(52, length=100), max_new_tokens=8)
    while not a.done:
        h.iterate()
    h.idle_until(lambda: h.pool.state().status is Status.APPLIED)
    h.iterate()  # one more admission round, refused again
    state = h.pool.state()
    assert b in h.waiting and c in h.waiting and state.num_waiting_requests == 2
    assert state.waiting_reason == "waiting_for_memory"
    b_budget = -(-(-(-300 // page) * page + page + 8) // page)  # what B asked admission for
    c_pages = -(-100 // page)  # C's whole sequence (not looked up yet)
    assert state.waiting_bytes == (b_budget + c_pages) * block_bytes
    h.pool.set_limit(None)
    h.run_until_idle()
    h.pool.before_schedule()
    assert b.done and c.done
    state = h.pool.state()
    assert state.waiting_reason is None and state.waiting_bytes == 0
