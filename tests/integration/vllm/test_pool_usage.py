"""``ElasticBlockPool.get_usage`` (vLLM's ``kv_cache_usage_perc``) is honest under a limit.

vLLM's own ``BlockPool.get_usage`` divides by the virtual capacity; under a small
limit one tiny request read as 0.97 and would trigger an autoscaler's scale-out
on an idle model. Real vLLM KVCacheManager, real host memory (see
``test_elastic_pool.py`` for the fixture).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from test_elastic_pool import (
    BLOCK_TOKENS,
    Elastic,
    make_elastic,  # noqa: F401 -- the fixture
    tokens,
)
from vllm.v1.core.block_pool import BlockPool

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
