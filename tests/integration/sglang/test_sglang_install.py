"""Activation: version guard, the patch table on SGLang's real classes, KV placement, launcher."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine_ext import EngineExtConfigError, EngineSettings
from engine_ext._patching import check_touches
from engine_ext.cpu_harness import single_rank_runtime
from engine_ext.sglang import (
    SUPPORTED,
    ElasticTokenAllocator,
    check_version,
    install,
    installed_patches,
    uninstall,
)
from engine_ext.sglang._install import run_scheduler_process
from engine_ext.sglang._patches import (
    PATCHES,
    TOUCHES,
    Session,
    _wrap_next_batch,
    _wrap_on_idle,
)

pytestmark = pytest.mark.sglang


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[EngineSettings]:
    settings = EngineSettings(enable=True, runtime_dir=tmp_path / "rt")
    assert install(settings)
    try:
        yield settings
    finally:
        uninstall()


def originals() -> dict[str, Any]:
    import importlib

    out = {}
    for patch in PATCHES:
        module, _, path = patch.target.partition(":")
        owner_name, attr = path.split(".")
        owner = getattr(importlib.import_module(module), owner_name)
        out[patch.target] = owner.__dict__[attr]
    return out


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "not-a-version"])
def test_unsupported_versions_are_refused_and_nothing_is_patched(version: str) -> None:
    before = originals()
    with pytest.raises(EngineExtConfigError, match=r"sglang==0\.5\.23"):
        install(EngineSettings(enable=True), version=version)
    assert installed_patches() == [] and originals() == before
    assert str(check_version("0.5.23")) == "0.5.23" and "0.5.23" in SUPPORTED


def test_every_touched_private_member_exists_in_this_sglang() -> None:
    check_touches("SGLang", TOUCHES)  # an SGLang upgrade that renames one fails here


def test_install_exports_its_settings_for_spawned_schedulers(installed: EngineSettings) -> None:
    from engine_ext import load_engine_settings

    assert load_engine_settings() == installed  # what _install.run_scheduler_process reads


def test_disabled_install_patches_nothing() -> None:
    before = originals()
    assert install(EngineSettings(enable=False)) is False
    assert installed_patches() == [] and originals() == before


def test_install_wraps_each_target_once_and_uninstall_restores(installed: EngineSettings) -> None:
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.scheduler import Scheduler

    patched = originals()
    assert installed_patches() == [p.target for p in PATCHES]
    assert install(installed) is True  # idempotent: nothing wrapped twice
    assert originals() == patched
    for name in ("on_idle", "get_next_batch_to_run", "__init__"):
        wrapper = getattr(Scheduler, name)
        assert inspect.signature(wrapper) == inspect.signature(wrapper.__wrapped__)
    # Spawned scheduler processes enter through the adapter, which installs there.
    assert Engine.run_scheduler_process_func is run_scheduler_process
    uninstall()
    restored = originals()
    for patch in PATCHES[1:]:  # plain methods: each wrapper wraps exactly the restored one
        assert patched[patch.target].__wrapped__ is restored[patch.target]
    assert Engine.run_scheduler_process_func is not run_scheduler_process


def test_kv_buffers_live_on_the_reservation(installed: EngineSettings) -> None:
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    single_rank_runtime()
    pool = MHATokenToKVPool(
        size=1000,
        page_size=16,
        dtype=torch.float16,
        head_num=2,
        head_dim=64,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )
    res, blocks = pool._kvsidecar_reservation
    backend = res.backend
    region = backend.layout.region_bytes
    assert pool.size == res.size_tokens <= 1000  # rounded down to whole pages
    assert pool.k_buffer[0].data_ptr() == backend.base_address
    assert pool.v_buffer[0].data_ptr() - pool.k_buffer[0].data_ptr() == region  # K|V pairs
    assert pool.k_buffer[2].shape == (pool.size + 16, 2, 64)
    # reserved; only the padding page is mapped (SGLang's warm-ups write slot 0 at once)
    assert backend.mapped_bytes() == backend.layout.bundle_bytes and blocks.is_allocated(0)

    conf = SimpleNamespace(kv_cache_dtype=torch.float16, device="cpu")
    allocator = KVCacheConfigurator._build_token_to_kv_pool_allocator(
        conf,
        sizes=None,
        token_to_kv_pool=pool,
        is_dsv4_model=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
    )
    assert isinstance(allocator, ElasticTokenAllocator) and allocator.size == pool.size
    assert allocator.blocks is blocks and allocator.padding_held
    assert backend.mapped_bytes() == backend.layout.bundle_bytes  # the padding page only
    pool.k_buffer[1][:16] = 1.0  # page 0 is writable (padded writes land there)
    out = allocator.alloc(32)  # two SGLang pages; here one SGLang page per mapping page
    assert res.blocks_per_page == 1
    assert out is not None and backend.mapped_bytes() == 3 * backend.layout.bundle_bytes
    pool.k_buffer[1][out] = 2.0
    assert float(pool.k_buffer[1][out].sum()) == 2.0 * 32 * 2 * 64
    allocator.free(out)
    assert backend.mapped_bytes() == backend.layout.bundle_bytes
    backend.release()


def test_unsupported_pool_is_refused(installed: EngineSettings) -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    single_rank_runtime()
    with pytest.raises(EngineExtConfigError, match="different widths"):
        MHATokenToKVPool(
            size=1000,
            page_size=16,
            dtype=torch.float16,
            head_num=2,
            head_dim=64,
            v_head_dim=32,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )


def test_scheduler_init_refuses_multi_rank_before_building_anything(
    installed: EngineSettings,
) -> None:
    from sglang.srt.managers.scheduler import Scheduler

    args = SimpleNamespace(
        tp_size=2, pp_size=1, dp_size=1, enable_hierarchical_cache=True, page_size=1
    )
    with pytest.raises(EngineExtConfigError, match="tp-size.*hierarchical.*page-size 1"):
        Scheduler(args, None)


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("enable_pdmux", True, "--enable-pdmux"),
        ("enable_pd_role_switch", True, "--enable-pd-role-switch"),
        ("pp_size", 2, "--pp-size"),
        ("disaggregation_mode", "prefill", "--disaggregation-mode"),
    ],
)
def test_loops_without_the_hooks_refuse_to_start(
    installed: EngineSettings, option: str, value: object, named: str
) -> None:
    """Issue 11: a loop where no pass runs would accept limits and never apply them."""
    from sglang.srt.managers.scheduler import Scheduler

    args = SimpleNamespace(
        tp_size=1,
        pp_size=1,
        dp_size=1,
        page_size=16,
        enable_hierarchical_cache=False,
        disaggregation_mode="null",
        enable_pdmux=False,
        enable_pd_role_switch=False,
    )
    setattr(args, option, value)
    with pytest.raises(EngineExtConfigError) as info:
        Scheduler(args, None)  # refused before SGLang builds anything
    message = str(info.value)
    assert named in message and "KVSIDECAR_ENABLE=0" in message


def test_loop_chosen_by_sglang_is_checked_after_its_init() -> None:
    """SGLang derives its loop flags in __init__ (e.g. pdmux from its disagg config)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from engine_ext.sglang._patches import _refuse_unsupported_loop

    normal = SimpleNamespace(
        enable_pdmux=False,
        disaggregation_mode=DisaggregationMode.NULL,
        server_args=SimpleNamespace(enable_pd_role_switch=False),
    )
    _refuse_unsupported_loop(normal)  # event_loop_normal / _overlap: supported
    pdmux = SimpleNamespace(
        enable_pdmux=True,
        disaggregation_mode=DisaggregationMode.NULL,
        server_args=SimpleNamespace(enable_pd_role_switch=False),
    )
    with pytest.raises(EngineExtConfigError, match="--enable-pdmux.*get_next_batch_to_run"):
        _refuse_unsupported_loop(pdmux)
    decode = SimpleNamespace(
        enable_pdmux=False,
        disaggregation_mode=DisaggregationMode.DECODE,
        server_args=SimpleNamespace(enable_pd_role_switch=False),
    )
    with pytest.raises(EngineExtConfigError, match="--disaggregation-mode"):
        _refuse_unsupported_loop(decode)


def test_idle_and_schedule_wrappers_run_the_pool_before_sglang(make_harness: Any) -> None:
    h = make_harness()
    calls: list[str] = []

    def sglang_on_idle(self: Any) -> str:
        calls.append(f"sglang:{self.pool.instance.coordinator.pending}")
        return "idle-done"

    def sglang_next_batch(self: Any) -> str:
        calls.append("sglang-next")
        return "batch"

    session = Session(EngineSettings(enable=True), "0.5.23", run_scheduler_process)
    on_idle = _wrap_on_idle(sglang_on_idle, session)
    next_batch = _wrap_next_batch(sglang_next_batch, session)
    h.pool.set_limit(0)
    assert h.pool.instance.coordinator.pending
    assert on_idle(h) == "idle-done"  # the pass ran first: SGLang's check sees the result
    assert calls == ["sglang:False"] and h.pages.target_pages == 0
    h.pool.set_limit(None)
    assert next_batch(h) == "batch" and h.pages.target_pages is None


def test_launcher_installs_then_parses_sglang_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_ext.sglang.launch_server import prepare

    monkeypatch.delenv("KVSIDECAR_ENABLE", raising=False)
    monkeypatch.setenv("KVSIDECAR_RUNTIME_DIR", str(tmp_path / "rt"))
    try:
        server_args, entry = prepare(["--model-path", str(tmp_path / "model"), "--page-size", "16"])
        assert entry is run_scheduler_process
        assert server_args.page_size == 16
        assert installed_patches() == [p.target for p in PATCHES]
        import os

        assert os.environ["KVSIDECAR_ENABLE"] == "1"  # inherited by spawned schedulers
    finally:
        uninstall()


def test_launcher_refuses_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_ext.sglang.launch_server import main

    monkeypatch.setenv("KVSIDECAR_ENABLE", "0")
    assert main(["--model-path", "x"]) == 2
    assert installed_patches() == []
