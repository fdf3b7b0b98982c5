"""The device fills between vLLM's free-block count and the map, with nothing cached to
reuse: ``allocate_slots`` refuses (returns None) instead of raising.

vLLM's real ``KVCacheManager`` over the ``ElasticBlockPool`` on a host
reservation whose "device" (``_SmallDevice``) refuses maps beyond a page count
that a foreign thread (the other engine) moves at random moments. Every block
handed out is written through the KV views (an unbacked one is a SIGSEGV);
the allocator's count must equal the blocks requests hold plus the cached ones.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from test_gpu_kv import (
    BLOCK_TOKENS,
    LAYERS,
    elastic_manager,
    planned,
    reservations,
    small_device_views,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request, RequestStatus

from allocator import HostBackend
from engine_ext.vllm import _patches

pytestmark = pytest.mark.vllm
__all__ = ["reservations"]


def test_device_filling_under_the_allocation_is_a_refusal_never_an_error(
    reservations: list[HostBackend], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = planned(64)  # 16 pages of 4 blocks
    views, device = small_device_views(config, reservations, total_pages=16)
    original = KVCacheManager.allocate_slots
    monkeypatch.setattr(
        KVCacheManager, "allocate_slots", _patches._allocate_slots(original, None)
    )  # the plugin's wrapper
    manager, runtime = elastic_manager(config, monkeypatch, tmp_path)
    assert runtime is not None and runtime.pool is not None
    pool = runtime.pool
    blocks = pool._blocks
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
    rng = random.Random(21)
    stop = threading.Event()

    def other_engine() -> None:  # takes and gives back device memory at random moments
        other = random.Random(22)
        while not stop.is_set():
            device.total_pages = other.choice((1, 2, 3, 4, 6, 9, 16))
            time.sleep(other.uniform(0, 0.002))

    live: dict[str, Request] = {}
    refusals = {"admission": 0, "running": 0, "device": 0}
    thread = threading.Thread(target=other_engine, name="other-engine")
    thread.start()
    try:
        docs = [
            [rng.randrange(10, 3000) for _ in range(rng.randrange(2, 9) * BLOCK_TOKENS)]
            for _ in range(5)
        ]
        for i in range(3000):
            roll = rng.random()
            if roll < 0.35 or not live:  # an admission (often sharing a cached document)
                prompt = rng.choice(docs) + [rng.randrange(10, 3000) for _ in range(5)]
                request = Request(
                    f"r{i}", prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher
                )
                hits, num_hit, _ = manager.get_computed_blocks(request)
                got = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
                if got is None:
                    refusals["admission"] += 1
                    assert not any(
                        s.req_to_blocks.get(request.request_id)
                        for s in manager.coordinator.single_type_managers
                    )
                    if runtime._device_refused:  # the device, not a limit (there is none)
                        refusals["device"] += 1
                        runtime._scheduler = SimpleNamespace(waiting=[request], running=[])
                        demand = runtime._demand()
                        assert demand.device_out_of_memory and not demand.waiting_for_memory
                        assert demand.waiting_blocks > 0
                    continue
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = request.num_tokens
                live[request.request_id] = request
                _touch(views, got.get_block_ids()[0])
            elif roll < 0.75:  # a running request extends (lookahead slots: new blocks)
                request = live[rng.choice(sorted(live))]
                got = manager.allocate_slots(request, 1, num_lookahead_tokens=rng.randrange(1, 80))
                if got is None:
                    refusals["running"] += 1  # vLLM would preempt: here, finish it
                    manager.free(live.pop(request.request_id))
                    continue
                _touch(views, got.get_block_ids()[0])
            else:
                manager.free(live.pop(rng.choice(sorted(live))))
            held = {
                b.block_id
                for r in live.values()
                for b in manager.coordinator.single_type_managers[0].req_to_blocks[r.request_id]
                if not b.is_null
            }
            cached = pool.num_evictable_blocks
            assert blocks.num_allocated_blocks == 1 + len(held) + cached  # + the null block
            assert len(reservations[0].mapped_pages()) <= 16
    finally:
        stop.set()
        thread.join()
        runtime.close()
    assert refusals["device"] > 10 and refusals["running"] > 10, refusals
    assert device.refusals > 10


def _touch(views: dict[str, Any], block_ids: list[int]) -> None:
    for name in LAYERS:  # every handed-out block is backed (else SIGSEGV)
        for block_id in block_ids:
            views[name][block_id].fill_(3)
