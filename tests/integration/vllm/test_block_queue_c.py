"""The free block queue's loops in C (``BlockFields.append_n``, ``popleft_n``, ``touch``)
against vLLM 0.33's own ``FreeKVCacheBlockQueue`` and ``BlockPool.touch``.

Two copies of the same blocks and queue; random appends, pops and touches (prefix
hits on cached blocks, on blocks in use, on the null block) go through vLLM's
Python on one and the C on the other; after every operation the two must agree
on every block's links (by id), ``ref_cnt`` and the queue's order and count, and
the C must return what the Python returned. Broken input must fail as vLLM's
Python fails (the race of issue 11 ends in ``remove() called on an invalid block``)
and leave the same state behind.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from engine_ext.vllm import _block_pool

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 48


def _fields() -> Any:
    assert _block_pool.SPEEDUPS, "the C loops were not built (bash scripts/dev.sh builds them)"
    fields = _block_pool._block_fields(KVCacheBlock)
    assert fields is not None
    return fields


def _world() -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(NUM_BLOCKS)]
    blocks[0].is_null = True
    queue = FreeKVCacheBlockQueue(blocks[1:])  # every block but the null one, in id order
    return blocks, queue


def _id(block: KVCacheBlock | None) -> int | None:
    return None if block is None else block.block_id


def _state(blocks: list[KVCacheBlock], queue: FreeKVCacheBlockQueue) -> Any:
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    links = [
        (b.block_id, b.ref_cnt, _id(b.prev_free_block), _id(b.next_free_block))
        for b in (*blocks, head, tail)
    ]
    return links, [b.block_id for b in queue.get_all_free_blocks()], queue.num_free_blocks


def _python_touch(queue: FreeKVCacheBlockQueue, blocks: list[KVCacheBlock]) -> list[int]:
    """ElasticBlockPool.touch's Python loop (vLLM's touch, with the unlinked ids)."""
    hit = []
    for block in blocks:
        if block.is_null:
            continue
        if block.ref_cnt == 0:
            queue.remove(block)
            hit.append(block.block_id)
        block.ref_cnt += 1
    return hit


@pytest.mark.parametrize("seed", range(6))
def test_c_queue_loops_do_what_vllms_python_does(seed: int) -> None:
    rng = random.Random(seed)
    fields = _fields()
    py_blocks, py_queue = _world()
    c_blocks, c_queue = _world()
    held: list[int] = []  # ids taken out of the queue (ref_cnt > 0)
    for step in range(2000):
        roll = rng.random()
        queued = [b.block_id for b in py_queue.get_all_free_blocks()]
        if roll < 0.35 and queued:  # an allocation reuses the least recently used
            n = rng.randint(0, min(len(queued), 9))
            hold = rng.random() < 0.5  # ref_cnt 1 in C, or by the caller as vLLM does
            expected = py_queue.popleft_n(n)
            got, ids = fields.popleft_n(c_queue, n, hold) if hold else fields.popleft_n(c_queue, n)
            assert [b.block_id for b in got] == [b.block_id for b in expected] == ids
            assert all(g is c_blocks[i] for g, i in zip(got, ids))
            for block in expected if hold else (*expected, *got):
                assert block.ref_cnt == 0
                block.ref_cnt += 1
            held.extend(ids)
        elif roll < 0.7 and held:  # a request frees: its blocks go back (to the tail)
            rng.shuffle(held)
            back = list(dict.fromkeys(held[: rng.randint(1, 9)]))  # one reference each
            for i in back:
                held.remove(i)
            for blocks in (py_blocks, c_blocks):
                for i in back:
                    blocks[i].ref_cnt -= 1
            py_queue.append_n([py_blocks[i] for i in back if py_blocks[i].ref_cnt == 0])
            assert fields.append_n(c_queue, [c_blocks[i] for i in back if c_blocks[i].ref_cnt == 0])
        else:  # a prefix hit: cached blocks leave the queue, blocks in use gain a reference
            ids = rng.sample(range(NUM_BLOCKS), rng.randint(0, 6))
            ids = [i for i in ids if py_blocks[i].ref_cnt or i in queued or i == 0]
            expected_ids = _python_touch(py_queue, [py_blocks[i] for i in ids])
            assert fields.touch(c_queue, tuple(c_blocks[i] for i in ids)) == expected_ids
            held.extend(i for i in ids if i != 0)
        assert _state(c_blocks, c_queue) == _state(py_blocks, py_queue), f"step {step}"
    assert fields.append_n(c_queue, []) is True
    assert fields.popleft_n(c_queue, 0) == ([], [])
    assert fields.touch(c_queue, []) == []


def test_c_queue_loops_fail_as_vllm_does_and_change_what_it_changes() -> None:
    fields = _fields()
    py_blocks, py_queue = _world()
    c_blocks, c_queue = _world()
    # more than the queue holds: vLLM asserts before it changes anything
    with pytest.raises(AssertionError):
        py_queue.popleft_n(NUM_BLOCKS)
    with pytest.raises(AssertionError):
        fields.popleft_n(c_queue, NUM_BLOCKS)
    with pytest.raises(AssertionError):
        fields.popleft_n(c_queue, -1)
    c_blocks[3].ref_cnt = 1  # queued yet in use: popping it with hold is refused whole
    with pytest.raises(AssertionError, match="in use"):
        fields.popleft_n(c_queue, 4, True)
    c_blocks[3].ref_cnt = 0
    assert _state(c_blocks, c_queue) == _state(py_blocks, py_queue)
    # a prefix hit on a block evicted meanwhile (ref_cnt 0, not queued: the race of issue
    # 11): the blocks before it are touched, then remove() raises, in both
    for blocks, queue in ((py_blocks, py_queue), (c_blocks, c_queue)):
        evicted = queue.popleft_n(3)
        for block in evicted:
            block.ref_cnt = 0  # handed out and back to the allocator, unlinked
    with pytest.raises(RuntimeError, match="remove\\(\\) called on an invalid block"):
        _python_touch(py_queue, [py_blocks[5], py_blocks[2], py_blocks[6]])
    with pytest.raises(RuntimeError, match="remove\\(\\) called on an invalid block"):
        fields.touch(c_queue, [c_blocks[5], c_blocks[2], c_blocks[6]])
    assert _state(c_blocks, c_queue) == _state(py_blocks, py_queue)
    # a block of another class: the C changes nothing and hands the loop back
    other = KVCacheBlock.__new__(type("Other", (), {}))  # type: ignore[call-overload]
    before = _state(c_blocks, c_queue)
    assert fields.touch(c_queue, [c_blocks[7], other]) is None
    assert fields.append_n(c_queue, [c_blocks[1], other]) is False
    assert _state(c_blocks, c_queue) == before
    with pytest.raises(TypeError):
        fields.append_n(c_queue, (c_blocks[1],))  # a list only
    with pytest.raises(TypeError):
        fields.popleft_n(c_queue, "1")
