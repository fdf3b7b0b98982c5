"""A failed unmap of an emptied page: the limit pass retries it and says so
(``backend_error``), and converges once the OS heals, without a new revision.
Faults are injected at the host backend's syscall wrappers; the measure is the memfd."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from engine_pool import Pool

from allocator import BackendError
from allocator import _libc as libc
from engine_ext import ElasticInstance, EngineBinding, load_engine_settings
from engine_ext.protocol import Status


def _instance(pool: Pool, tmp_path: Path) -> ElasticInstance:
    settings = load_engine_settings(instance_id="inst-1", runtime_dir=tmp_path / "rt")
    return ElasticInstance(settings, EngineBinding("vllm", "0.33.0", pool.blocks, (pool.cache,)))


def test_a_transient_unmap_failure_of_the_last_page_is_retried_until_applied(
    pool: Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool.fill(1)  # one full page of cached (evictable) blocks
    inst = _instance(pool, tmp_path)

    def refuse(fd: int, offset: int, length: int) -> None:
        raise BackendError("injected: fallocate(PUNCH_HOLE) failed (errno 5)", errno=5)

    monkeypatch.setattr(libc, "punch", refuse)
    inst.set_limit(0)
    state = inst.step()  # evicts the page; its unmap fails
    assert pool.pages.num_unmap_failed == 1 and pool.backend.mapped_bytes() > 0
    for _ in range(3):  # while it fails: deferred, and the reason says why
        assert (state.status, state.reason) == (Status.DEFERRED, "backend_error"), state
        state = inst.step()
    monkeypatch.undo()  # the OS heals
    deadline = time.monotonic() + 5
    while state.status is not Status.APPLIED:
        assert time.monotonic() < deadline, (state.status, state.reason)
        time.sleep(0.02)
        state = inst.step()
    assert pool.pages.num_unmap_failed == 0 and pool.backend.mapped_bytes() == 0
    assert state.mapped_bytes == 0 and state.revision == 1
