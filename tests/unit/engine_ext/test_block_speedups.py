"""ElasticBlockPool's per-block loops in C (engine_ext/vllm/_block_speedups.c), alone.

``BlockFields`` works on any class whose seven fields are plain slots, so these
tests use a slotted dataclass shaped like vLLM's ``KVCacheBlock`` (no vLLM
import). The pool-level comparison with the Python loops, under vLLM's real
KVCacheManager, is ``test_c_block_loops_do_what_the_python_loops_do`` in
tests/integration/vllm/test_elastic_pool.py.
"""

from __future__ import annotations

import gc
import random
import sys
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_ext.vllm import _block_pool

BlockFields: Any = getattr(
    pytest.importorskip("engine_ext.vllm._block_speedups", reason="checked below"),
    "BlockFields",
    None,
)


@dataclass(slots=True)
class Blk:
    block_id: int
    ref_cnt: int = 0
    pool: object = field(default=None, kw_only=True)
    _block_hash: object = None
    prev_free_block: Any = None
    next_free_block: Any = None
    is_null: bool = False


@dataclass(slots=True)
class Other:  # same fields, another class
    block_id: int
    ref_cnt: int = 0
    pool: object = field(default=None, kw_only=True)
    _block_hash: object = None
    prev_free_block: Any = None
    next_free_block: Any = None
    is_null: bool = False


def test_block_loops_are_built() -> None:
    assert _block_pool.SPEEDUPS, (
        "engine_ext/vllm/_block_speedups.c did not build: run `bash scripts/dev.sh` (it "
        "compiles it with cc) or `pip install -e .` with a C compiler"
    )


def test_block_fields_refuse_a_class_without_plain_slots() -> None:
    class Plain:
        block_id = ref_cnt = pool = _block_hash = is_null = 0
        prev_free_block = next_free_block = None

    @dataclass(slots=True)
    class Missing:
        block_id: int

    for cls in (Plain, Missing, int):
        with pytest.raises(TypeError, match="KVCacheBlock changed"):
            BlockFields(cls)
    assert BlockFields(Blk).cls is Blk


def _state(blocks: list[Any]) -> list[tuple[Any, ...]]:
    return [(b.block_id, b.ref_cnt, b.pool, b._block_hash, b.is_null) for b in blocks]


def test_take_checks_every_block_before_it_changes_one() -> None:
    fields = BlockFields(Blk)
    blocks = [Blk(i) for i in range(8)]
    taken = fields.take(blocks, [3, 1, 5])
    assert taken == [blocks[3], blocks[1], blocks[5]] and taken[0] is blocks[3]
    assert [b.ref_cnt for b in blocks] == [0, 1, 0, 1, 0, 1, 0, 0]
    before = _state(blocks)
    blocks[6]._block_hash = "h"
    for ids, error in (
        ([0, 1], AssertionError),  # 1 is in use
        ([0, 2, 0], AssertionError),  # a repeated id: its second check fails
        ([0, 6], AssertionError),  # 6 is cached
        ([0, 8], IndexError),
        ([0, -1], IndexError),
        ([0, 2**70], IndexError),
        ([0, "2"], IndexError),
    ):
        with pytest.raises(error):
            fields.take(blocks, ids)
        assert _state(blocks)[:6] == before[:6]  # blocks 0 and 2 put back: nothing changed
    mixed = [*blocks[:2], Other(2)]
    with pytest.raises(TypeError, match="not a Blk"):
        fields.take(mixed, [0, 2])
    assert blocks[0].ref_cnt == 0
    with pytest.raises(TypeError):
        fields.take(tuple(blocks), [0])
    assert fields.take(blocks, []) == []


def _python_split(blocks: list[Any], pool: object) -> tuple[list[Any], ...]:
    """What ElasticBlockPool.free_blocks' Python loop does (no eviction decisions)."""
    to_free, to_cache, cache_ids, others = [], [], [], []
    for block in blocks:
        if block.is_null:
            continue
        if block.pool is not None and block.pool is not pool:
            others.append(block)
            continue
        block.ref_cnt -= 1
        if block.ref_cnt:
            continue
        if block._block_hash is None:
            to_free.append(block.block_id)
        else:
            to_cache.append(block)
            cache_ids.append(block.block_id)
    return to_free, to_cache, cache_ids, others


def _random_blocks(rng: random.Random, pool: object, other_pool: object) -> list[Blk]:
    out = []
    for i in range(rng.randint(0, 40)):
        out.append(
            Blk(
                i,
                rng.choice([1, 1, 1, 2, 3, 0]),
                pool=rng.choice([None, None, pool, other_pool]),
                _block_hash=rng.choice([None, f"h{i}"]),
                is_null=rng.random() < 0.05,
            )
        )
    return out


@pytest.mark.parametrize("seed", range(5))
def test_split_freed_equals_the_python_loop(seed: int) -> None:
    rng = random.Random(seed)
    fields = BlockFields(Blk)
    pool, other_pool = object(), object()
    for _ in range(300):
        blocks = _random_blocks(rng, pool, other_pool)
        order = rng.sample(range(len(blocks)), len(blocks))
        c_blocks = [Blk(b.block_id, b.ref_cnt, pool=b.pool, _block_hash=b._block_hash,
                        is_null=b.is_null) for b in blocks]  # fmt: skip
        expected = _python_split([blocks[i] for i in order], pool)
        arg: Any = iter([c_blocks[i] for i in order]) if rng.random() < 0.5 else None
        got = fields.split_freed(arg or [c_blocks[i] for i in order], pool)
        assert type(got) is tuple
        assert got[0] == expected[0] and got[2] == expected[2]
        assert [b.block_id for b in got[1]] == [b.block_id for b in expected[1]]
        assert [b.block_id for b in got[3]] == [b.block_id for b in expected[3]]
        assert _state(c_blocks) == _state(blocks)  # the same ref counts afterwards


def test_split_freed_leaves_a_foreign_class_to_the_python_loop() -> None:
    fields = BlockFields(Blk)
    pool = object()
    blocks: list[Any] = [Blk(0, 1), Blk(1, 2), Other(2, 1)]
    before = _state(blocks)
    got = fields.split_freed(reversed(blocks), pool)
    assert got == list(reversed(blocks)) and _state(blocks) == before  # nothing changed


def test_split_freed_raises_as_python_would_on_unset_slots() -> None:
    fields = BlockFields(Blk)
    block = Blk(0, 1)
    del block.ref_cnt
    with pytest.raises(AttributeError, match="ref_cnt"):
        fields.split_freed([block], object())
    with pytest.raises(TypeError, match="iterable"):
        fields.split_freed(5, object())


def test_block_loops_leak_no_references() -> None:
    fields = BlockFields(Blk)
    pool = object()
    blocks = [Blk(i) for i in range(64)]
    refs = [sys.getrefcount(b) for b in blocks]
    gc.collect()
    tracemalloc.start()
    try:
        for round_no in range(1000):
            ids = list(range(round_no % 64))
            fields.take(blocks, ids)
            for i in ids[::3]:
                blocks[i]._block_hash = ("h", i)
            fields.split_freed(reversed([blocks[i] for i in ids]), pool)
            for i in ids[::3]:
                blocks[i]._block_hash = None
            with pytest.raises(AssertionError):
                fields.take(blocks, [0, 0])
            blocks[0].ref_cnt = 0
        gc.collect()
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(1000):
            fields.take(blocks, [1, 2, 3])
            fields.split_freed([blocks[3], blocks[2], blocks[1]], pool)
        gc.collect()
        second, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert second - first < 4096
    assert [sys.getrefcount(b) for b in blocks] == refs


class _Queue:  # FreeKVCacheBlockQueue's three fields, over Blk (the links are the blocks')
    def __init__(self) -> None:
        self.num_free_blocks = 0
        self.fake_free_list_head, self.fake_free_list_tail = Blk(-1), Blk(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head


def test_queue_loops_leak_no_references() -> None:
    fields = BlockFields(Blk)
    queue = _Queue()
    blocks = [Blk(i) for i in range(64)]
    ends = (queue.fake_free_list_head, queue.fake_free_list_tail)
    refs = [sys.getrefcount(b) for b in (*blocks, *ends)]

    def one_round(n: int) -> None:
        assert fields.append_n(queue, blocks[:n])
        assert fields.touch(queue, blocks[: n // 2]) == list(range(n // 2))
        got, ids = fields.popleft_n(queue, n - n // 2)
        assert ids == list(range(n // 2, n)) and got == blocks[n // 2 : n]
        for block in blocks[: n // 2]:
            block.ref_cnt = 0
        assert queue.num_free_blocks == 0

    gc.collect()
    tracemalloc.start()
    try:
        for round_no in range(1000):
            one_round(round_no % 64)
        gc.collect()
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(1000):
            one_round(40)
        gc.collect()
        second, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert second - first < 4096
    assert [sys.getrefcount(b) for b in (*blocks, *ends)] == refs
