"""ElasticBlockPool under vLLM's real KVCacheManager, over real host memory.

``make_elastic`` builds vLLM's own ``KVCacheManager`` (coordinator,
single-type manager, prefix caching) with ``kv_cache_coordinator.BlockPool``
rebound to ``ElasticBlockPool`` for the test only, over a published host
reservation: what the plugin does in an EngineCore, minus the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request

from allocator import ForeignThreadError, HostBackend, PageLayout
from engine_ext import EngineSettings, Reclaimer, count_reclaimable_pages
from engine_ext.protocol import Status
from engine_ext.vllm import _runtime
from engine_ext.vllm._block_pool import ElasticBlockPool
from engine_ext.vllm._kv_memory import KVMemory, clear_kv_memory, publish_kv_memory
from engine_ext.vllm._settings import VllmSettings

pytestmark = pytest.mark.vllm

BLOCK_TOKENS = 16
BLOCKS_PER_PAGE = 4
PAGE_BYTES = 16 << 10  # one region: 4 blocks of 4 KiB
NUM_REGIONS = 2


@dataclass
class Elastic:
    """One elastic pool under vLLM's KVCacheManager, plus its runtime."""

    manager: KVCacheManager
    pool: ElasticBlockPool
    runtime: _runtime.VllmRuntime
    backend: HostBackend
    make_request: Callable[[str, list[int]], Request]

    @property
    def bundle_bytes(self) -> int:
        return self.backend.layout.bundle_bytes

    def mapped_pages(self) -> int:
        return self.backend.mapped_bytes() // self.bundle_bytes

    def admit(self, request: Request) -> bool:
        """Prefix lookup + allocation for a whole prompt, as the scheduler does."""
        hit, num_hit, _ = self.manager.get_computed_blocks(request)
        blocks = self.manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        if blocks is None:
            return False
        request.num_computed_tokens = request.num_tokens
        return True

    def finish(self, request: Request) -> None:
        self.manager.free(request)


@pytest.fixture
def make_elastic(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Callable[..., Elastic]]:
    made: list[Elastic] = []

    def build(
        num_pages: int = 16,
        *,
        reclaim: bool = True,
        max_cached_tokens: int = -1,
        reserve_pages: int = 0,
    ) -> Elastic:
        layout = PageLayout(page_bytes=PAGE_BYTES, num_pages=num_pages, num_regions=NUM_REGIONS)
        backend = HostBackend.reserve(layout, name="kvs-test-vllm")
        num_blocks = num_pages * BLOCKS_PER_PAGE
        publish_kv_memory(KVMemory(backend, layout, PAGE_BYTES // BLOCKS_PER_PAGE, num_blocks))
        monkeypatch.setattr(kv_cache_coordinator, "BlockPool", ElasticBlockPool)
        _runtime.configure(
            EngineSettings(
                enable=True,
                thread_guard=True,
                reclaim=reclaim,
                runtime_dir=tmp_path,
                reserve_pages=reserve_pages,
            ),
            VllmSettings(enable=True, max_cached_tokens=max_cached_tokens),
        )
        spec = FullAttentionSpec(
            block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        manager = KVCacheManager(
            config,
            max_model_len=4096,
            scheduler_block_size=BLOCK_TOKENS,
            hash_block_size=BLOCK_TOKENS,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        pool = manager.block_pool
        assert isinstance(pool, ElasticBlockPool)
        runtime = _runtime.current_runtime()
        assert runtime is not None
        init_none_hash(sha256)
        hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)

        def make_request(request_id: str, tokens: list[int]) -> Request:
            return Request(
                request_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher
            )

        elastic = Elastic(manager, pool, runtime, backend, make_request)
        made.append(elastic)
        return elastic

    yield build
    for elastic in made:
        backend = elastic.backend
        backend.release()
    clear_kv_memory()
    monkeypatch.setattr(_runtime, "_configured", None)
    monkeypatch.setattr(_runtime, "_runtime", None)


def tokens(seed: int, num_tokens: int) -> list[int]:
    """Distinct deterministic token ids for a prompt."""
    return [(seed * 7919 + i * 31) % 30000 + 10 for i in range(num_tokens)]


PAGE_TOKENS = BLOCK_TOKENS * BLOCKS_PER_PAGE


def test_pages_are_mapped_on_demand_and_prefix_hits_survive(
    make_elastic: Callable[..., Elastic],
) -> None:
    e = make_elastic()
    assert e.mapped_pages() == 1  # the null block's page only
    doc = tokens(1, 3 * PAGE_TOKENS)
    first = e.make_request("a", doc + tokens(2, BLOCK_TOKENS))
    assert e.admit(first)
    assert e.mapped_pages() == 4  # 13 blocks + the null block: best fit packs 4 pages
    e.finish(first)
    assert e.mapped_pages() == 4  # cached, evictable: still mapped
    assert e.pool.num_evictable_blocks == 13
    second = e.make_request("b", doc + tokens(3, BLOCK_TOKENS))
    _, num_hit, _ = e.manager.get_computed_blocks(second)
    assert num_hit == len(doc)  # vLLM's own prefix cache finds the document


@pytest.mark.parametrize("reserve", [2, 3])
def test_a_premapped_reserve_still_gives_vllm_block_0_first(
    make_elastic: Callable[..., Elastic],
    reserve: int,
) -> None:
    e = make_elastic(reserve_pages=reserve)  # used to raise: block 16 came out first
    assert e.pool.null_block.block_id == 0 and e.pool.null_block.is_null
    assert e.mapped_pages() == reserve  # page 0 (null block) + the rest of the reserve
    doc = e.make_request("a", tokens(1, 2 * PAGE_TOKENS))
    assert e.admit(doc)
    assert e.mapped_pages() <= 3 + reserve  # 8 blocks + null on 3 pages, plus the reserve
    e.finish(doc)
    assert e.pool.num_evictable_blocks == 2 * BLOCKS_PER_PAGE


@pytest.mark.parametrize("seed", range(4))
def test_figures_after_traffic_match_a_recount_once_idle(
    make_elastic: Callable[..., Elastic],
    seed: int,
) -> None:
    """Evictable/pinned are kept per block event: right after the last free, no rescan."""
    import random

    rng = random.Random(seed)
    e = make_elastic()
    core = _IdleCore()
    e.runtime._engine_core = core  # attach without starting sockets
    assert isinstance(e.pool, Reclaimer)  # the pool is the core's reclaimer itself
    live: list[Request] = []
    for i in range(40):
        if live and rng.random() < 0.45:
            e.finish(live.pop(rng.randrange(len(live))))
            continue
        shared = tokens(rng.randrange(3), rng.randint(1, 2) * BLOCK_TOKENS)
        request = e.make_request(f"r{i}", shared + tokens(100 + i, rng.randint(1, 30)))
        if e.admit(request):
            live.append(request)
        if rng.random() < 0.2:
            e.runtime.safe_point()
    for request in live:  # aborts handled by the busy loop: no scheduler step follows
        e.finish(request)
        # mapped memory is settled at once, at every free (/proc is the reference)
        assert e.runtime.instance.state().mapped_bytes == e.backend.mapped_bytes()  # type: ignore[union-attr]
    # The figures are refreshed by the idle hook each free arms (once), which vLLM's
    # busy loop runs as soon as it has handled the message and finds no work.
    assert len(core._idle_state_callbacks) <= 1
    core.go_idle()
    blocks = e.runtime.instance.binding.blocks  # type: ignore[union-attr]
    reclaimable = count_reclaimable_pages(e.pool.evictable_block_ids(), blocks)
    state = e.runtime.instance.state()  # type: ignore[union-attr]
    bundle = e.bundle_bytes
    assert state.evictable_bytes == reclaimable * bundle
    assert state.pinned_bytes == (blocks.pages.num_in_use - reclaimable) * bundle
    assert state.mapped_bytes == e.backend.mapped_bytes()
    assert blocks.num_evictable_blocks == e.pool.num_evictable_blocks


def test_lower_limit_evicts_whole_pages(
    make_elastic: Callable[..., Elastic],
) -> None:
    e = make_elastic()
    for i in range(6):
        request = e.make_request(f"r{i}", tokens(10 + i, PAGE_TOKENS))
        assert e.admit(request)
        e.finish(request)
    assert e.mapped_pages() == 7  # 24 blocks + the null block
    limit = 4 * e.bundle_bytes
    e.runtime.instance.set_limit(limit)  # type: ignore[union-attr]
    assert e.pool.get_num_free_blocks() == 64 - 25 + 24  # allocation only reads: no target taken
    assert e.mapped_pages() == 7
    e.runtime.safe_point()  # the top of a scheduler step: takes the target, evicts
    free_seen = e.pool.get_num_free_blocks()
    state = e.runtime.instance.state()  # type: ignore[union-attr]
    assert state.status is Status.APPLIED
    assert e.backend.mapped_bytes() <= limit
    assert e.mapped_pages() == 4
    # Whole pages went: the 4 pages left are full (null block + 15 cached blocks), and
    # the scheduler now sees exactly those cached blocks as capacity.
    assert e.pool.num_evictable_blocks == 4 * BLOCKS_PER_PAGE - 1
    removed = [ev for ev in e.pool.take_events() if type(ev).__name__ == "BlockRemoved"]
    assert sum(len(ev.block_hashes) for ev in removed) == 24 - 15  # KV events still flow
    assert free_seen == e.pool.get_num_free_blocks() == e.pool.num_evictable_blocks
    # A request that cannot be backed under the limit waits (None), never raises.
    big = e.make_request("big", tokens(99, 8 * PAGE_TOKENS))
    assert not e.admit(big)


def test_reclaim_disabled_keeps_memory_and_still_serves(
    make_elastic: Callable[..., Elastic],
) -> None:
    e = make_elastic(reclaim=False)
    for i in range(6):
        request = e.make_request(f"r{i}", tokens(10 + i, PAGE_TOKENS))
        assert e.admit(request)
        e.finish(request)
    e.runtime.instance.set_limit(4 * e.bundle_bytes)  # type: ignore[union-attr]
    e.runtime.safe_point()
    state = e.runtime.instance.state()  # type: ignore[union-attr]
    assert state.status is Status.DEFERRED and state.reason == "reclaim_disabled"
    assert e.mapped_pages() == 7  # only the free reserve went; cached pages stay mapped
    again = e.make_request("again", tokens(50, PAGE_TOKENS))
    assert e.admit(again)  # reuses evictable blocks in LRU order, as vLLM does


def test_cache_bound_zero_evicts_on_free(make_elastic: Callable[..., Elastic]) -> None:
    e = make_elastic(max_cached_tokens=0)
    request = e.make_request("a", tokens(1, 2 * PAGE_TOKENS))
    assert e.admit(request)
    assert e.mapped_pages() == 3
    e.finish(request)
    assert e.pool.num_evictable_blocks == 0
    assert e.mapped_pages() == 1
    again = e.make_request("b", tokens(1, 2 * PAGE_TOKENS))
    assert e.manager.get_computed_blocks(again)[1] == 0


def test_cache_bound_tokens_evicts_page_aware(make_elastic: Callable[..., Elastic]) -> None:
    e = make_elastic(max_cached_tokens=2 * PAGE_TOKENS)
    for i in range(4):
        request = e.make_request(f"r{i}", tokens(20 + i, PAGE_TOKENS))
        assert e.admit(request)
        e.finish(request)
    assert e.pool.num_evictable_blocks * BLOCK_TOKENS <= 2 * PAGE_TOKENS
    assert e.mapped_pages() == 1 + 2  # whole pages went back, not scattered blocks


def test_reset_prefix_cache_releases_memory(make_elastic: Callable[..., Elastic]) -> None:
    e = make_elastic()
    running = e.make_request("run", tokens(5, PAGE_TOKENS))
    assert e.admit(running)
    done = e.make_request("done", tokens(6, 2 * PAGE_TOKENS))
    assert e.admit(done)
    e.finish(done)
    assert not e.pool.reset_prefix_cache()  # a request still runs: refused, as vLLM does
    e.finish(running)
    assert e.mapped_pages() == 4
    assert e.pool.reset_prefix_cache()
    assert e.mapped_pages() == 1
    events = e.pool.take_events()
    assert type(events[-1]).__name__ == "AllBlocksCleared"


def test_limit_zero_drains_then_serves_after_raise(make_elastic: Callable[..., Elastic]) -> None:
    e = make_elastic()
    request = e.make_request("a", tokens(1, 2 * PAGE_TOKENS))
    assert e.admit(request)
    e.finish(request)
    e.runtime.instance.set_limit(0)  # type: ignore[union-attr]
    e.runtime.safe_point()
    assert e.pool.num_evictable_blocks == 0
    assert e.mapped_pages() == 1  # vLLM's null block pins one page for good
    waiting = e.make_request("w", tokens(2, PAGE_TOKENS))
    assert not e.admit(waiting)
    e.runtime.instance.set_limit(None)  # type: ignore[union-attr]
    e.runtime.safe_point()
    assert e.admit(waiting)


def test_pool_mutation_off_the_busy_loop_thread_raises(
    make_elastic: Callable[..., Elastic],
) -> None:
    e = make_elastic()
    caught: list[BaseException] = []

    def foreign() -> None:
        try:
            e.pool.get_new_blocks(1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            caught.append(exc)

    thread = threading.Thread(target=foreign)
    thread.start()
    thread.join()
    assert len(caught) == 1 and isinstance(caught[0], ForeignThreadError)
    assert e.mapped_pages() == 1  # nothing changed


class _FakeQueue:
    def __init__(self) -> None:
        self.items: list[object] = []

    def put_nowait(self, item: object) -> None:
        self.items.append(item)


class _IdleCore:
    """The two EngineCoreProc attributes the runtime touches, and its idle notification."""

    def __init__(self) -> None:
        self._idle_state_callbacks: list[Callable[[object], None]] = []
        self.input_queue = _FakeQueue()

    def go_idle(self) -> None:
        """What EngineCore._notify_idle_state_callbacks does when the loop finds no work."""
        while self._idle_state_callbacks:
            self._idle_state_callbacks.pop()(self)


def test_published_limit_wakes_idle_engine_once(make_elastic: Callable[..., Elastic]) -> None:
    e = make_elastic()
    core = _IdleCore()
    e.runtime._engine_core = core  # attach without starting sockets
    for i in range(3):
        request = e.make_request(f"r{i}", tokens(30 + i, PAGE_TOKENS))
        assert e.admit(request)
        e.finish(request)
    e.runtime.instance.set_limit(2 * e.bundle_bytes)  # type: ignore[union-attr]
    e.runtime.instance.set_limit(2 * e.bundle_bytes)  # type: ignore[union-attr]
    assert len(core._idle_state_callbacks) == 1  # one-shot, armed once
    assert len(core.input_queue.items) == 2  # every publish wakes the loop
    core._idle_state_callbacks.pop()(core)  # what _notify_idle_state_callbacks does
    state = e.runtime.instance.state()  # type: ignore[union-attr]
    assert state.status is Status.APPLIED and state.passes == 1
    assert e.backend.mapped_bytes() <= 2 * e.bundle_bytes


def _pool_trace(e: Elastic, seed: int, limits: bool) -> list[object]:
    """Random shared-prefix traffic with frees in any order (and limits): what is seen."""
    import random

    rng = random.Random(seed)
    pool, blocks = e.pool, e.runtime.instance.binding.blocks  # type: ignore[union-attr]
    seen: list[object] = []
    live: list[Request] = []
    for i in range(300):
        roll = rng.random()
        if live and roll < 0.4:
            e.finish(live.pop(rng.randrange(len(live))))
        elif limits and roll < 0.47:
            pages = rng.choice([None, 0, 1, 3, 6, 12])
            e.runtime.instance.set_limit(  # type: ignore[union-attr]
                None if pages is None else pages * e.bundle_bytes
            )
            e.runtime.safe_point()
        else:
            shared = tokens(rng.randrange(4), rng.randint(0, 3) * BLOCK_TOKENS)
            request = e.make_request(f"r{i}", shared + tokens(1000 + i, rng.randint(1, 70)))
            if e.admit(request):
                live.append(request)
            seen.append(request.request_id in {r.request_id for r in live})
        seen.append(
            (
                [(b.ref_cnt, b.block_hash) for b in pool.blocks],
                pool.evictable_block_ids(),
                blocks.num_allocated_blocks,
                blocks.num_evictable_blocks,
                blocks.num_reclaimable_pages,
                e.backend.mapped_bytes(),
                pool.take_events(),
            )
        )
    return seen


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("limits", [False, True])
def test_c_block_loops_do_what_the_python_loops_do(
    make_elastic: Callable[..., Elastic], monkeypatch: pytest.MonkeyPatch, seed: int, limits: bool
) -> None:
    """get_new_blocks/free_blocks with their per-block loops in C (engine_ext/vllm/
    _block_speedups.c) against the Python loops, on the same traffic: every block's
    ref_cnt and hash, the LRU order, the allocator's counts, /proc and vLLM's KV events."""
    from engine_ext.vllm import _block_pool

    assert _block_pool.SPEEDUPS, "the C loops were not built (bash scripts/dev.sh builds them)"
    runs = []
    for use_c in (True, False):
        monkeypatch.setattr(ElasticBlockPool, "_use_c", use_c)
        e = make_elastic(num_pages=24)
        assert (e.pool._fields is not None) is use_c
        runs.append(_pool_trace(e, seed, limits))
        e.backend.release()
        clear_kv_memory()
    assert len(runs[0]) == len(runs[1])
    for step, (c, py) in enumerate(zip(*runs)):
        assert c == py, f"step {step}: C and Python loops differ"
