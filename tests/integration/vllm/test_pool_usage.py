"""``ElasticBlockPool.get_usage`` (vLLM's ``kv_cache_usage_perc``) is honest under a limit.

vLLM's own ``BlockPool.get_usage`` divides by the virtual capacity; under a small
limit one tiny request read as 0.97 and would trigger an autoscaler's scale-out
on an idle model. Real vLLM KVCacheManager, real host memory (see
``test_elastic_pool.py`` for the fixture).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from test_elastic_pool import (
    BLOCK_TOKENS,
    Elastic,
    make_elastic,  # noqa: F401 -- the fixture
    tokens,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import RequestStatus

from engine_ext.protocol import Status
from engine_ext.vllm import _runtime
from engine_ext.vllm._block_pool import ElasticBlockPool

pytestmark = pytest.mark.vllm


def test_usage_is_running_requests_over_what_the_limit_allows(
    make_elastic: Callable[..., Elastic],  # noqa: F811
) -> None:
    e = make_elastic(num_pages=64)
    assert e.pool.get_usage() == 0.0
    e.runtime.instance.set_limit(4 * e.bundle_bytes)  # type: ignore[union-attr]
    e.runtime.safe_point()  # the top of a scheduler step: takes the target
    one = e.make_request("tiny", tokens(1, BLOCK_TOKENS))  # one block
    assert e.admit(one)
    allowed = 4 * 4 - 1  # four pages of four blocks, less vLLM's null block
    assert e.pool.get_usage() == pytest.approx(1 / allowed)
    # vLLM's own figure for the same pool reads almost full
    assert BlockPool.get_usage(e.pool) > 0.7
    # finished: its block is cached (evictable), which counts as available, as in vLLM
    e.finish(one)
    assert e.pool.get_usage() == 0.0
    # every allowed block held by requests: 1.0 exactly
    held = [e.make_request(f"r{i}", tokens(10 + i, BLOCK_TOKENS)) for i in range(allowed)]
    assert all(e.admit(r) for r in held)
    assert e.pool.get_usage() == 1.0


def test_unlimited_usage_matches_vllms_figure(make_elastic: Callable[..., Elastic]) -> None:  # noqa: F811
    e = make_elastic(num_pages=8)
    running = [e.make_request(f"r{i}", tokens(i, 2 * BLOCK_TOKENS)) for i in range(3)]
    assert all(e.admit(r) for r in running)
    e.finish(running[0])
    assert e.pool.get_usage() == pytest.approx(BlockPool.get_usage(e.pool))
    assert e.pool.get_usage() == pytest.approx(4 / (8 * 4 - 1))


def test_inside_schedule_running_requests_go_over_the_limit_and_admissions_do_not(
    make_elastic: Callable[..., Elastic],  # noqa: F811
) -> None:
    """The overdraft flag is held for the whole of ``schedule()``: the patched
    ``allocate_slots`` lets a RUNNING request map above the target, an admission in
    the same ``schedule()`` still gets only the headroom under it, and the flag is
    up again after the admission and down after ``schedule()``."""
    e = make_elastic(num_pages=16)
    patched = _runtime.allocate_slots_patch(KVCacheManager.allocate_slots, ElasticBlockPool)
    runner = e.make_request("runner", tokens(1, 4 * BLOCK_TOKENS))  # 4 blocks: 2 pages
    assert e.admit(runner)
    runner.status = RequestStatus.RUNNING
    assert e.mapped_pages() == 2
    e.runtime.instance.set_limit(2 * e.bundle_bytes)  # type: ignore[union-attr]
    e.runtime.safe_point()  # takes the target; nothing evictable: nothing changes
    scheduler = SimpleNamespace(requests={"runner": runner}, running=[runner], waiting=[])
    e.runtime.begin_schedule(scheduler)
    assert e.pool.overdraft and e.pool.in_schedule
    newcomer = e.make_request("newcomer", tokens(2, 8 * BLOCK_TOKENS))  # would need 2 pages more
    hit, num_hit, _ = e.manager.get_computed_blocks(newcomer)
    assert patched(e.manager, newcomer, newcomer.num_tokens - num_hit, num_hit, hit) is None
    assert e.mapped_pages() == 2  # the admission mapped nothing above the limit
    assert e.pool.overdraft  # back up for the running requests after the admission
    grown = patched(e.manager, runner, 8 * BLOCK_TOKENS, num_lookahead_tokens=0)
    assert grown is not None and len(grown.blocks[0]) == 8  # never refused by the limit
    assert e.mapped_pages() == 4  # above the limit, as the kernel counts it
    e.runtime.end_schedule()
    assert not e.pool.overdraft and not e.pool.in_schedule
    state = e.runtime.instance.state()  # type: ignore[union-attr]
    assert state.status is Status.DEFERRED and state.reason == "running_requests"
