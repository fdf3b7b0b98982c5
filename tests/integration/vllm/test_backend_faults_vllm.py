"""An OS failure of the host backend inside vLLM's ``allocate_slots`` and
``KVCacheManager.free``: a refusal or a logged, retried page, never an exception into
vLLM's scheduler (it would end the EngineCore). Faults are injected at the backend's
syscall wrappers (``allocator._libc``); the measure is the memfd in /proc."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

from test_elastic_pool import (
    PAGE_TOKENS,
    Elastic,
    make_elastic,  # noqa: F401 -- the fixture
    tokens,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager

from allocator import BackendError
from allocator import _libc as libc
from engine_ext.vllm import _patches

pytestmark = pytest.mark.vllm


def test_a_failed_map_in_allocate_slots_is_a_refusal_and_the_device_is_tried_again(
    make_elastic: Callable[..., Elastic],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = KVCacheManager.allocate_slots
    monkeypatch.setattr(
        KVCacheManager, "allocate_slots", _patches._allocate_slots(original, None)
    )  # the plugin's wrapper, as in a served engine
    e = make_elastic()
    base_pages, base_blocks = e.mapped_pages(), e.pool._blocks.num_allocated_blocks  # null block
    real_open = libc.open_range

    def refuse(addr: int, length: int) -> None:  # mprotect refused (ENOMEM: the VMA limit)
        raise BackendError("injected: mprotect failed (errno 12)", errno=12)

    monkeypatch.setattr(libc, "open_range", refuse)
    request = e.make_request("a", tokens(1, 2 * PAGE_TOKENS))
    assert e.admit(request) is False  # a refusal the scheduler handles: the request waits
    assert e.mapped_pages() == base_pages and e.pool._blocks.num_allocated_blocks == base_blocks
    monkeypatch.setattr(libc, "open_range", real_open)  # the OS heals
    time.sleep(1.1)  # the cap held at what was mapped for DEVICE_RETRY_S
    assert e.admit(request) is True
    assert e.pool._blocks.num_allocated_blocks == base_blocks + 2 * 4  # two pages of 4 blocks
    assert e.mapped_pages() > base_pages


def test_a_failed_unmap_when_a_request_ends_is_logged_and_retried(
    make_elastic: Callable[..., Elastic],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    e = make_elastic(max_cached_tokens=0)  # finished requests' blocks are freed at once
    base_pages, base_blocks = e.mapped_pages(), e.pool._blocks.num_allocated_blocks  # null block
    request = e.make_request("a", tokens(1, 2 * PAGE_TOKENS))
    assert e.admit(request)
    pages = e.pool._blocks.pages
    e.runtime.instance.set_limit(0)  # emptied pages are unmapped, not kept as reserve
    e.runtime.instance.step()
    real_punch = libc.punch

    def refuse(fd: int, offset: int, length: int) -> None:
        raise BackendError("injected: fallocate punch failed (errno 5)", errno=5)

    monkeypatch.setattr(libc, "punch", refuse)
    e.finish(request)  # KVCacheManager.free: must not raise into vLLM's scheduler
    assert e.pool._blocks.num_allocated_blocks == base_blocks  # the blocks are free
    assert pages.num_unmap_failed > 0 and e.mapped_pages() > base_pages  # /proc: still there
    state = e.runtime.instance.step()
    assert state.status.value == "deferred" and state.reason == "backend_error"
    monkeypatch.setattr(libc, "punch", real_punch)  # the OS heals: the next pass retries
    deadline = time.monotonic() + 5
    while e.runtime.instance.step().status.value != "applied":
        assert time.monotonic() < deadline, e.runtime.instance.state()
        time.sleep(0.05)
    assert pages.num_unmap_failed == 0 and e.mapped_pages() == base_pages
