"""EngineSettings: KVSIDECAR_* variables, read only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine_ext
from engine_ext import EngineExtConfigError, EngineSettings, load_engine_settings


def test_reads_prefixed_env_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")
    monkeypatch.setenv("KVSIDECAR_INSTANCE_ID", "llama-a")
    monkeypatch.setenv("KVSIDECAR_SIDECAR_URL", "http://127.0.0.1:8420/")
    monkeypatch.setenv("KVSIDECAR_TOKEN", "t0k")
    monkeypatch.setenv("KVSIDECAR_LIMIT", "1.5GiB")
    monkeypatch.setenv("KVSIDECAR_RECLAIM", "false")
    monkeypatch.setenv("KVSIDECAR_HEARTBEAT_S", "0.5")
    s = load_engine_settings()
    assert s.enable and s.instance_id == "llama-a" and not s.reclaim
    assert s.sidecar_url == "http://127.0.0.1:8420"
    assert s.token is not None and s.token.get_secret_value() == "t0k" and "t0k" not in repr(s)
    assert s.limit == 3 << 29 and s.heartbeat_s == 0.5


@pytest.mark.parametrize(
    ("value", "taken"),
    [
        ("http://sidecar.example:8570/kvs/", "http://sidecar.example:8570/kvs"),  # a prefix
        ("https://[::1]:8570", "https://[::1]:8570"),
        ("HTTP://127.0.0.1", "HTTP://127.0.0.1"),
        (" http://127.0.0.1:8570\n", "http://127.0.0.1:8570"),  # an env file's stray blank
    ],
)
def test_sidecar_urls_that_work_are_taken(value: str, taken: str) -> None:
    assert load_engine_settings(sidecar_url=value).sidecar_url == taken


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("XDG_RUNTIME_DIR", "KVSIDECAR_RUNTIME_DIR", "KVSIDECAR_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    s = load_engine_settings()
    assert not s.enable and s.sidecar_url is None and s.limit is None and s.reclaim
    assert str(s.resolved_runtime_dir()).startswith("/tmp/kvsidecar-")
    assert s.resolved_instance_id("vllm").startswith("vllm-")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert s.resolved_runtime_dir() == tmp_path / "kvsidecar"
    assert load_engine_settings(limit="none").limit is None


@pytest.mark.parametrize(
    ("env", "value", "needle"),
    [
        ("KVSIDECAR_LIMIT", "4 parsecs", "KVSIDECAR_LIMIT"),
        ("KVSIDECAR_INSTANCE_ID", "bad id!", "KVSIDECAR_INSTANCE_ID"),
        ("KVSIDECAR_SIDECAR_URL", "localhost:8420", "http"),
        # taken before, then either a traceback at engine start (httpx could not build the
        # client) or an engine that retried a sidecar it could never reach, unlimited
        ("KVSIDECAR_SIDECAR_URL", "http://host:notaport", "KVSIDECAR_SIDECAR_URL.*read"),
        ("KVSIDECAR_SIDECAR_URL", "https://[::1", "KVSIDECAR_SIDECAR_URL.*read"),
        ("KVSIDECAR_SIDECAR_URL", "http://", "KVSIDECAR_SIDECAR_URL.*no host"),
        ("KVSIDECAR_SIDECAR_URL", "http:///kvs", "KVSIDECAR_SIDECAR_URL.*no host"),
        ("KVSIDECAR_SIDECAR_URL", "http://127.0.0.1:99999", "KVSIDECAR_SIDECAR_URL.*range"),
        ("KVSIDECAR_SIDECAR_URL", "http://127.0.0.1:0", "KVSIDECAR_SIDECAR_URL.*port 0"),
        ("KVSIDECAR_SIDECAR_URL", "http://127.0.0.1:8570/?a=1", "KVSIDECAR_SIDECAR_URL.*query"),
        ("KVSIDECAR_SIDECAR_URL", "http://127.0.0.1:8570#x", "KVSIDECAR_SIDECAR_URL.*fragment"),
        ("KVSIDECAR_SIDECAR_URL", "http://side car:8570", "KVSIDECAR_SIDECAR_URL.*space"),
        ("KVSIDECAR_HEARTBEAT_S", "0", "KVSIDECAR_HEARTBEAT_S"),
        ("KVSIDECAR_HEARTBEAT_S", "0.001", "KVSIDECAR_HEARTBEAT_S"),  # POSTs in a tight loop
        ("KVSIDECAR_REPORT_INTERVAL_S", "-0.1", "KVSIDECAR_REPORT_INTERVAL_S"),
        ("KVSIDECAR_REPORT_INTERVAL_S", "soon", "KVSIDECAR_REPORT_INTERVAL_S"),
        ("KVSIDECAR_RESERVE_PAGES", "-1", "KVSIDECAR_RESERVE_PAGES"),
        ("KVSIDECAR_VIRTUAL_KV_BYTES", "0", "KVSIDECAR_VIRTUAL_KV_BYTES"),
        ("KVSIDECAR_VIRTUAL_KV_BYTES", "lots", "KVSIDECAR_VIRTUAL_KV_BYTES"),
        # httpx cannot put these in a header: SidecarClient's construction raised
        # UnicodeEncodeError (a traceback at engine start) instead of a config error
        ("KVSIDECAR_TOKEN", "s3cr\u00e9t", "KVSIDECAR_TOKEN: Value error, must be printable"),
        ("KVSIDECAR_TOKEN", "s3 cret", "KVSIDECAR_TOKEN: Value error, must be printable"),
    ],
)
def test_bad_values_are_config_errors(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(env, value)
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")
    with pytest.raises(EngineExtConfigError, match=needle):
        load_engine_settings()
    monkeypatch.setenv("KVSIDECAR_ENABLE", "0")  # off: nothing reads it; the default stands
    name = env.removeprefix("KVSIDECAR_").lower()
    off = load_engine_settings()
    assert not off.enable
    assert getattr(off, name) == EngineSettings.model_fields[name].get_default(
        call_default_factory=True
    )


def test_exports_are_pinned_and_sorted() -> None:
    assert engine_ext.__all__ == [
        "MAX_BODY_BYTES",
        "BarrierOutcome",
        "BarrierResult",
        "BlockView",
        "ControlServer",
        "CoordinatorConfig",
        "DeferReason",
        "Demand",
        "DemandProbe",
        "ElasticInstance",
        "EngineBinding",
        "EngineExtConfigError",
        "EngineExtContractError",
        "EngineExtError",
        "EngineSettings",
        "LimitMailbox",
        "PublishResult",
        "RankBarrier",
        "Reclaimer",
        "ShrinkCoordinator",
        "SidecarClient",
        "Target",
        "VictimPage",
        "WaitReason",
        "count_reclaimable_pages",
        "load_engine_settings",
        "select_victim_pages",
    ]
    assert all(hasattr(engine_ext, name) for name in engine_ext.__all__)
    assert EngineSettings.model_config["env_prefix"] == "KVSIDECAR_"


def test_thread_guard_setting_turns_the_adapters_guard_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from allocator import ThreadGuard

    monkeypatch.setattr(ThreadGuard, "_default_enabled", False)
    assert not load_engine_settings().new_thread_guard("x").enabled
    monkeypatch.setenv("KVSIDECAR_THREAD_GUARD", "1")
    assert load_engine_settings().new_thread_guard("y").enabled
    assert not ThreadGuard("z").enabled  # the process default is left alone
