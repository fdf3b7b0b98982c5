"""The plugin entry point and the patch table, against the installed vLLM 0.33."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm 0.33 is installed by scripts/dev.sh")

import vllm
from vllm.v1.core import block_pool, kv_cache_coordinator
from vllm.v1.engine import core

from engine_ext import EngineExtConfigError
from engine_ext.vllm import _runtime, plugin
from engine_ext.vllm._block_pool import ElasticBlockPool
from engine_ext.vllm._instance_id import (
    default_instance_id,
    export_default_instance_id,
    host_part,
)
from engine_ext.vllm._patches import (
    PATCHES,
    UnsupportedVllmVersion,
    apply_patches,
    is_patched,
    remove_patches,
    supported_range,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def restore_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo every patch the test applied, and check that vLLM is unpatched afterwards."""
    assert not any(is_patched(p.target) for p in PATCHES), "an earlier test left vLLM patched"
    monkeypatch.setattr(_runtime, "_configured", None)
    yield
    remove_patches()
    assert not any(is_patched(p.target) for p in PATCHES)
    assert kv_cache_coordinator.BlockPool is block_pool.BlockPool


def test_installed_vllm_is_in_the_supported_range() -> None:
    assert vllm.__version__ in supported_range()
    assert str(supported_range()) == "<0.34,>=0.33.0"


@pytest.mark.usefixtures("restore_vllm")
def test_unsupported_version_refuses_and_patches_nothing() -> None:
    with pytest.raises(
        UnsupportedVllmVersion, match=r"supports vLLM <0.34,>=0.33.0 but vLLM 0.34.1"
    ):
        apply_patches("0.34.1")
    assert kv_cache_coordinator.BlockPool is block_pool.BlockPool
    assert not any(is_patched(p.target) for p in PATCHES)


@pytest.mark.usefixtures("restore_vllm")
def test_patching_is_explicit_and_idempotent() -> None:
    original_loop = core.EngineCoreProc.run_busy_loop
    assert apply_patches(vllm.__version__).targets == [p.target for p in PATCHES]
    assert kv_cache_coordinator.BlockPool is ElasticBlockPool
    assert core.EngineCoreProc.run_busy_loop.__wrapped__ is original_loop  # type: ignore[attr-defined]
    assert apply_patches(vllm.__version__).targets == []  # second time: nothing changes
    assert core.EngineCoreProc.run_busy_loop.__wrapped__ is original_loop  # type: ignore[attr-defined]


@pytest.mark.usefixtures("restore_vllm")
def test_register_is_a_no_op_unless_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSIDECAR_ENABLE", raising=False)
    plugin.register()
    assert kv_cache_coordinator.BlockPool is block_pool.BlockPool
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")
    monkeypatch.setenv("KVSIDECAR_INSTANCE_ID", "plugin-test")
    plugin.register()
    assert kv_cache_coordinator.BlockPool is ElasticBlockPool


@pytest.mark.usefixtures("restore_vllm")
def test_register_gives_the_engine_core_a_shutdown_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 SIGKILLs the EngineCore right after SIGTERM unless this is set: its
    control socket and runtime dir were left behind (tests/e2e/test_ranks_vllm.py)."""
    from vllm.v1.engine.utils import get_engine_process_shutdown_timeout

    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "0")  # restored after the test
    monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS")
    assert get_engine_process_shutdown_timeout(0, 0) == 0  # vLLM's own: no window
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")
    monkeypatch.setenv("KVSIDECAR_INSTANCE_ID", "plugin-test")
    plugin.register()
    assert get_engine_process_shutdown_timeout(0, 0) == float(plugin.SHUTDOWN_WINDOW_S)
    remove_patches()
    monkeypatch.setenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "12")  # an operator's value
    plugin.register()
    assert get_engine_process_shutdown_timeout(0, 0) == 12.0


@pytest.mark.usefixtures("restore_vllm")
def test_bad_setting_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")
    monkeypatch.setenv("KVSIDECAR_INSTANCE_ID", "not valid!")
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_INSTANCE_ID"):
        plugin.register()


@pytest.mark.usefixtures("restore_vllm")
def test_bad_vllm_setting_refuses_before_patching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")
    monkeypatch.setenv("KVSIDECAR_INSTANCE_ID", "plugin-test")
    monkeypatch.setenv("KVSIDECAR_MAX_CACHED_TOKENS", "-2")
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_MAX_CACHED_TOKENS"):
        plugin.register()
    assert kv_cache_coordinator.BlockPool is block_pool.BlockPool


_BAD_SETTINGS = {"KVSIDECAR_LIMIT": "4 gigs", "KVSIDECAR_INSTANCE_ID": "not valid!"}


@pytest.mark.usefixtures("restore_vllm")
@pytest.mark.parametrize("enable", [None, "0", "false", ""])
def test_bad_settings_do_not_stop_vllm_while_the_extension_is_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, enable: str | None
) -> None:
    """vLLM calls the plugin in every process of every ``vllm serve`` on a host where
    kvsidecar is installed: a bad KVSIDECAR_LIMIT with the extension off refused to start
    vLLM (and an empty KVSIDECAR_ENABLE was a bad boolean). Off, they are only warned about."""
    if enable is None:
        monkeypatch.delenv("KVSIDECAR_ENABLE", raising=False)
    else:
        monkeypatch.setenv("KVSIDECAR_ENABLE", enable)
    for name, value in _BAD_SETTINGS.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("WARNING", logger="engine_ext.settings"):
        plugin.register()
    assert kv_cache_coordinator.BlockPool is block_pool.BlockPool
    assert "KVSIDECAR_LIMIT" in caplog.text and "KVSIDECAR_INSTANCE_ID" in caplog.text
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")  # on: the same values refuse, naming both
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_INSTANCE_ID.*KVSIDECAR_LIMIT"):
        plugin.register()
    assert kv_cache_coordinator.BlockPool is block_pool.BlockPool


def test_vllms_own_plugin_loading_survives_bad_settings_while_off(tmp_path: Path) -> None:
    """The same through vLLM's ``load_general_plugins`` and our entry point, in a child."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "from vllm.v1.core import block_pool, kv_cache_coordinator; "
        "assert kv_cache_coordinator.BlockPool is block_pool.BlockPool; print('started')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **_BAD_SETTINGS, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["vllm", "serve", "/models/Qwen3-4B", "--port", "8001"], "Qwen3-4B-8001-node1"),
        (["vllm", "serve", "m", "--served-model-name", "llama a", "--port=9"], "llama-a-9-node1"),
        (["vllm", "serve", "org/model"], "model-8000-node1"),
        (["vllm", "serve", "x" * 80], "x" * 52 + "-8000-node1"),
        (["python", "-m", "something"], None),
    ],
)
def test_default_instance_id_from_the_command_line(argv: list[str], expected: str | None) -> None:
    assert default_instance_id(argv, "node1") == expected


def test_default_instance_id_differs_per_host_and_pod() -> None:
    """Replicas of one deployment (same model, same port) get different ids (issue 14.5)."""
    argv = ["vllm", "serve", "org/model", "--port", "8000"]
    env_a: dict[str, str] = {"POD_NAME": "vllm-7d9f-abcde"}
    env_b: dict[str, str] = {"POD_NAME": "vllm-7d9f-fghij"}
    export_default_instance_id(argv, env_a)
    export_default_instance_id(argv, env_b)
    assert env_a["KVSIDECAR_INSTANCE_ID"] == "model-8000-vllm-7d9f-abcde"
    assert env_a["KVSIDECAR_INSTANCE_ID"] != env_b["KVSIDECAR_INSTANCE_ID"]
    bare: dict[str, str] = {}
    export_default_instance_id(argv, bare)  # no pod: the host name
    assert bare["KVSIDECAR_INSTANCE_ID"].startswith("model-8000-")
    assert host_part({}) in bare["KVSIDECAR_INSTANCE_ID"]
    set_by_operator = {"KVSIDECAR_INSTANCE_ID": "mine", "POD_NAME": "p"}
    export_default_instance_id(argv, set_by_operator)
    assert set_by_operator["KVSIDECAR_INSTANCE_ID"] == "mine"


@pytest.mark.usefixtures("restore_vllm")
def test_undo_restores_every_original() -> None:
    originals = {p.target: _raw(p.target) for p in PATCHES}
    applied = apply_patches(vllm.__version__)
    assert all(is_patched(p.target) for p in PATCHES)
    assert sorted(applied.undo()) == sorted(originals)
    assert {p.target: _raw(p.target) for p in PATCHES} == originals
    assert applied.undo() == []  # idempotent


def _raw(target: str) -> object:
    import importlib

    module, _, path = target.partition(":")
    owner: object = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
