"""SGLang integration fixtures: the real SGLang memory classes on CPU (see docs/sglang.md)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:  # pragma: no cover - scripts/dev.sh installs it
    pytest.skip(
        "sglang 0.5.23 is not installed (bash scripts/dev.sh env installs it)",
        allow_module_level=True,
    )

from engine_ext import EngineSettings
from engine_ext.sglang import prepare_cpu_imports

prepare_cpu_imports()

from engine_ext.cpu_harness import CpuHarness, HarnessConfig


@pytest.fixture(autouse=True)
def _restore_kvsidecar_env() -> Iterator[None]:
    """install(settings) exports KVSIDECAR_* for spawned schedulers; undo it per test."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVSIDECAR_")}
    yield
    for key in [k for k in os.environ if k.startswith("KVSIDECAR_")]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(params=["unified", "radix"])
def cache_kind(request: pytest.FixtureRequest) -> str:
    """SGLang's default tree cache (Rust core) and the Python RadixCache."""
    return str(request.param)


@pytest.fixture(params=["unified", "radix", "disabled"])
def any_cache_kind(request: pytest.FixtureRequest) -> str:
    """Both tree caches, and the tree ``--disable-radix-cache`` builds (it caches nothing,
    so a limit can only take free pages): for the tests whose promises hold without a
    prefix cache (no crash, no lost KV, ``applied`` true to the memfd)."""
    return str(request.param)


@pytest.fixture
def make_harness(tmp_path: Path) -> Iterator[Callable[..., CpuHarness]]:
    made: list[CpuHarness] = []

    def make(
        cache: str = "unified",
        *,
        sleep_on_idle: bool = False,
        chunked_prefill_size: int | None = None,
        overlap: bool = False,
        **settings: Any,
    ) -> CpuHarness:
        config = HarnessConfig(
            cache=cache,
            sleep_on_idle=sleep_on_idle,
            chunked_prefill_size=chunked_prefill_size,
            overlap=overlap,
        )
        full = EngineSettings(
            enable=True, runtime_dir=tmp_path / "run", instance_id=f"sgl-{len(made)}", **settings
        )
        harness = CpuHarness(full, config)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
