"""SGLang's KV placement on a GPU: which device, and how large (overcommit, docs/overcommit.md).

Runs on CPU: SGLang's real ``KVCacheConfigurator`` and ``MHATokenToKVPool``
classes with the adapter installed; the CUDA reservation call is replaced by
one that records the device it was asked for (tests/fakecuda covers the
reservation itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from allocator import CudaBackend, PageLayout
from engine_ext import EngineExtConfigError, EngineSettings
from engine_ext.sglang import install, uninstall
from engine_ext.sglang._kv_memory import KVGeometry, cuda_index, reserve_kv, virtual_kv_bytes

pytestmark = pytest.mark.sglang

GIB = 1 << 30
GEOMETRY = KVGeometry(
    page_size=16, head_num=2, head_dim=64, layer_num=3, dtype_bytes=2, max_tokens=40_000
)


class _Reserved(Exception):
    """Raised by the recording reserve once it has seen its arguments."""


@pytest.fixture
def reserve_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[PageLayout, int]]:
    calls: list[tuple[PageLayout, int]] = []

    def reserve(layout: PageLayout, *, device: int = 0, **_: Any) -> CudaBackend:
        calls.append((layout, device))
        raise _Reserved

    monkeypatch.setattr(CudaBackend, "reserve", staticmethod(reserve))
    return calls


@pytest.mark.parametrize("current", [0, 1, 3])
def test_bare_cuda_is_the_current_device_not_gpu_0(
    reserve_calls: list[tuple[PageLayout, int]], monkeypatch: pytest.MonkeyPatch, current: int
) -> None:
    """SGLang gives its pools device "cuda" after torch.cuda.set_device(gpu_id)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    with pytest.raises(_Reserved):
        reserve_kv(GEOMETRY, device="cuda")
    assert [device for _, device in reserve_calls] == [current]


def test_an_explicit_ordinal_wins(reserve_calls: list[tuple[PageLayout, int]]) -> None:
    with pytest.raises(_Reserved):
        reserve_kv(GEOMETRY, device="cuda:2", current_cuda=lambda: 5)
    assert [device for _, device in reserve_calls] == [2]


@pytest.mark.parametrize("device", ["cuda:x", "cuda:-1", "cuda:1.0"])
def test_a_garbled_ordinal_is_refused_by_name(device: str) -> None:
    with pytest.raises(EngineExtConfigError, match=r"cuda:N"):
        cuda_index(device, lambda: 0)


def test_virtual_capacity_setting_then_device_then_sglangs_own() -> None:
    totals: list[int] = []

    def total(gpu: int) -> int:
        totals.append(gpu)
        return 80 * GIB

    assert virtual_kv_bytes("cuda", 1, 50 * GIB, total) == 50 * GIB and totals == []
    assert virtual_kv_bytes("cuda", 1, None, total) == 80 * GIB and totals == [1]
    assert virtual_kv_bytes("cpu", 0, None, total) is None  # the CPU harness sizes as SGLang
    assert virtual_kv_bytes("cpu", 0, 3 * GIB, total) == 3 * GIB


@pytest.fixture
def installed_with(tmp_path: Path) -> Iterator[Any]:
    def install_with(**fields: Any) -> EngineSettings:
        settings = EngineSettings(enable=True, runtime_dir=tmp_path / "rt", **fields)
        assert install(settings)
        return settings

    yield install_with
    uninstall()


def test_the_pool_is_sized_for_the_virtual_capacity(installed_with: Any) -> None:
    """Two SGLang engines on one 8 GiB device each size their pool above half of it."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    installed_with(virtual_kv_bytes=6 * GIB)
    configurator = SimpleNamespace(device="cuda", gpu_id=1)
    measured = KVCacheConfigurator._profile_available_bytes(configurator, 70 * GIB)
    assert measured == 6 * GIB  # not SGLang's measured free memory, not mem_fraction_static's
    uninstall()
    installed_with(virtual_kv_bytes=5 * GIB)
    other = KVCacheConfigurator._profile_available_bytes(configurator, 70 * GIB)
    assert measured > 4 * GIB and other > 4 * GIB and measured + other > 8 * GIB


def test_without_a_setting_the_cpu_harness_keeps_sglangs_sizing() -> None:
    """No setting on CPU: the wrapper hands SGLang's own measurement through unchanged."""
    from engine_ext.sglang._patches import Session, _wrap_profile_bytes

    seen: list[int] = []

    def sglang_profile(self: Any, pre_model_load_memory: int) -> int:
        seen.append(pre_model_load_memory)
        return 123

    wrapped = _wrap_profile_bytes(
        sglang_profile, Session(EngineSettings(enable=True), "0.5.23", [])
    )
    assert wrapped(SimpleNamespace(device="cpu", gpu_id=0), 7) == 123 and seen == [7]
