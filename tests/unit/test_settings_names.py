"""Every ``KVSIDECAR_*`` name a settings class reads is known, and a typo is named."""

from __future__ import annotations

import logging

import pytest
from pydantic_settings import BaseSettings

from engine_ext import EngineSettings, load_engine_settings
from engine_ext.protocol import KNOWN_SETTINGS, unknown_settings
from engine_ext.vllm._settings import VllmSettings
from sidecar import SidecarSettings
from sidecar._kvctl import CtlSettings

# read outside a settings class: scripts/dev.sh's cache, the test suite's knobs
_TOOLS = {"KVSIDECAR_CACHE", "KVSIDECAR_SOAK", "KVSIDECAR_FAKECUDA"}
# the CPU harness's rank processes (engine_ext.cpu_harness.vllm._multirank, which loads torch)
# and its async-scheduling plugin (engine_ext.cpu_harness.vllm._async_plugin)
_HARNESS_ASYNC = {"KVSIDECAR_HARNESS_ASYNC_SCHEDULING"}
_RANKS = {
    "KVSIDECAR_STUB_TP",
    "KVSIDECAR_STUB_PP",
    "KVSIDECAR_RANK_BARRIER_WAIT_S",
    "KVSIDECAR_RANK_TIMEOUT_S",
    "KVSIDECAR_RANK_SEND_TIMEOUT_S",
}


def _names(cls: type[BaseSettings]) -> set[str]:
    return {f"KVSIDECAR_{name.upper()}" for name in cls.model_fields}


def test_the_known_names_are_the_settings_classes_fields() -> None:
    read = set().union(*map(_names, (EngineSettings, VllmSettings, SidecarSettings, CtlSettings)))
    assert read | _TOOLS | _RANKS | _HARNESS_ASYNC == KNOWN_SETTINGS


def test_the_rank_settings_are_known() -> None:
    pytest.importorskip("torch")
    from engine_ext.cpu_harness.vllm._multirank import MultiRankSettings

    assert _names(MultiRankSettings) == _RANKS


def test_the_harness_async_scheduling_switch_is_known() -> None:
    from engine_ext.cpu_harness.vllm._async_plugin import ENV, AsyncSchedulingSettings

    assert _names(AsyncSchedulingSettings) == _HARNESS_ASYNC == {ENV}


def test_a_typo_is_named_with_the_closest_known_name() -> None:
    env = {
        "KVSIDECAR_HEARTBEAT_TIMEOUT": "3",
        "kvsidecar_limt": "1G",
        "KVSIDECAR_XYZZY": "1",
        "KVSIDECAR_ENABLE": "1",
        "kvsidecar_port": "1",
        "PATH": "/bin",
    }
    ignored = "is not a kvsidecar setting, so it is ignored"
    assert unknown_settings(env) == [
        f"KVSIDECAR_HEARTBEAT_TIMEOUT {ignored}; did you mean KVSIDECAR_HEARTBEAT_TIMEOUT_S?",
        f"KVSIDECAR_XYZZY {ignored}",
        f"kvsidecar_limt {ignored}; did you mean KVSIDECAR_LIMIT?",
    ]


def test_an_engine_names_a_misspelt_enable_switch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``KVSIDECAR_ENABLED=1`` left kvsidecar off without a word."""
    monkeypatch.delenv("KVSIDECAR_ENABLE", raising=False)
    monkeypatch.setenv("KVSIDECAR_ENABLED", "1")
    with caplog.at_level(logging.WARNING, logger="engine_ext.settings"):
        assert not load_engine_settings().enable
    assert "KVSIDECAR_ENABLED is not a kvsidecar setting" in caplog.text
    assert "did you mean KVSIDECAR_ENABLE?" in caplog.text


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVSIDECAR_RANK_SEND_TIMEOUT_S", "0"),
        ("KVSIDECAR_RANK_SEND_TIMEOUT_S", "-1"),
        ("KVSIDECAR_RANK_SEND_TIMEOUT_S", "soon"),
        ("KVSIDECAR_RANK_SEND_TIMEOUT_S", "7200"),
        ("KVSIDECAR_HARNESS_ASYNC_SCHEDULING", "maybe"),
    ],
)
def test_a_bad_harness_setting_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """The rank and async-loop knobs of the CPU harness refuse a value out of range or of the
    wrong kind, naming the setting, rather than running with it."""
    from pydantic import ValidationError

    from engine_ext.cpu_harness.vllm._async_plugin import AsyncSchedulingSettings
    from engine_ext.cpu_harness.vllm._multirank import MultiRankSettings

    monkeypatch.setenv(name, value)
    settings = MultiRankSettings if "RANK" in name else AsyncSchedulingSettings
    with pytest.raises(ValidationError, match=name.removeprefix("KVSIDECAR_").lower()):
        settings()
