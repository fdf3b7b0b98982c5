"""The shared toy prefix cache (engine_ext.cpu_harness.ToyPrefixCache) keeps the Reclaimer contract.

It stands in for an engine's prefix cache in the core tests, the rank tests and
the benchmarks, so a bug in it would hide bugs in the core: random traffic is
checked against an independent model of what must be cached, referenced and
allocated, on a real host-memory pool.
"""

from __future__ import annotations

import random
import threading

import pytest
from engine_pool import Pool

from allocator import ForeignThreadError
from engine_ext.cpu_harness import ToyPrefixCache


def test_referenced_blocks_are_never_evicted(pool: Pool) -> None:
    cache = ToyPrefixCache(pool.blocks)
    got = cache.allocate(2)
    assert got is not None
    assert cache.insert(got[0], "a") and cache.insert(got[1], "b")
    assert not cache.insert(got[0], "c") and not cache.insert(got[1], "a")  # both cached already
    assert list(cache.evictable_blocks()) == []
    with pytest.raises(AssertionError, match="referenced"):
        cache.evict([got[0]])
    assert cache.lookup("a") == got[0] and pool.blocks.num_allocated_blocks == 2  # unchanged
    cache.release([got[1], got[0]])
    assert list(cache.evictable_blocks()) == [got[1], got[0]]  # in release order
    cache.acquire(got[1])  # a hit takes it off the evictable list
    assert list(cache.evictable_blocks()) == [got[0]]
    assert cache.evict_oldest() == 1 and cache.lookup("a") is None
    assert cache.evict_oldest() == 0  # got[1] is referenced again
    with pytest.raises(AssertionError, match="not cached"):
        cache.evict([got[0]])


def test_uncached_blocks_go_back_to_the_allocator_on_release(pool: Pool) -> None:
    cache = ToyPrefixCache(pool.blocks)
    got = cache.allocate(3)
    assert got is not None
    cache.acquire(got[2])
    cache.release(got)
    assert pool.blocks.num_allocated_blocks == 1  # got[2] still has a reference
    cache.release([got[2]])
    assert pool.blocks.num_allocated_blocks == 0 and cache.refs == {}


def test_make_room_evicts_oldest_first(pool: Pool) -> None:
    cache = ToyPrefixCache(pool.blocks)
    everything = cache.allocate(pool.blocks.num_blocks)
    assert everything is not None
    for block in everything:
        cache.insert(block, block)
    cache.release(everything)
    assert cache.allocate(1) is None  # no room without eviction: the pool is full
    got = cache.allocate(3, make_room=True)
    assert got is not None and cache.num_evicted == 3
    assert [cache.lookup(b) for b in everything[:3]] == [None] * 3  # the three oldest went


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_matches_a_model(pool: Pool, seed: int) -> None:
    rng = random.Random(seed)
    cache = ToyPrefixCache(pool.blocks)
    refs: dict[int, int] = {}
    cached: dict[int, int] = {}  # block -> key
    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            got = cache.allocate(rng.randint(1, 5), make_room=rng.random() < 0.5)
            for block in got or []:
                refs[block] = 1
                if rng.random() < 0.7 and cache.insert(block, rng.randrange(40)):
                    cached[block] = cache.key_of[block]  # type: ignore[assignment]
        elif op < 0.55 and cached:
            block = rng.choice(list(cached))
            cache.acquire(block)
            refs[block] = refs.get(block, 0) + 1
        elif op < 0.85 and refs:
            block = rng.choice(list(refs))
            cache.release([block])
            refs[block] -= 1
            if not refs[block]:
                del refs[block]
        elif cache.evictable_blocks():
            victims = rng.sample(list(cache.evictable_blocks()), 1)
            assert cache.evict(victims) == 1
        # evictions (including make_room's) remove blocks from the model
        for block in [b for b in cached if b not in cache.key_of]:
            del cached[block]
        assert cache.refs == refs
        assert set(cache.evictable_blocks()) == set(cached) - set(refs)
        assert all(cache.is_evictable(b) == (b in cached and b not in refs) for b in range(64))
        assert pool.blocks.num_allocated_blocks == len(set(refs) | set(cached))
        assert len(set(cache.by_key.values())) == len(cache.by_key) == len(cache.key_of)


def test_a_foreign_thread_is_refused(pool: Pool) -> None:
    cache = ToyPrefixCache(pool.blocks)
    got = cache.allocate(1)  # binds the engine thread
    assert got is not None
    errors: list[BaseException] = []

    def foreign() -> None:
        try:
            cache.release(got)
        except BaseException as exc:  # noqa: BLE001 -- recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=foreign)
    thread.start()
    thread.join()
    assert [type(e) for e in errors] == [ForeignThreadError] and cache.refs == {got[0]: 1}
