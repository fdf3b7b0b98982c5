"""Fixtures shared by test files (registered in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fakecuda
import pytest

from sidecar import SidecarSettings

from .sidecar import ThreadedSidecar

__all__ = ["fc", "module_sidecar_url", "sidecar_url"]


@pytest.fixture
def sidecar_url(tmp_path: Path) -> Iterator[str]:
    """A real sidecar for one test, retrying pushes quickly (engines in the test process)."""
    settings = SidecarSettings(
        db_path=tmp_path / "sidecar.db", push_backoff_initial_s=0.02, push_backoff_max_s=0.2
    )
    with ThreadedSidecar(settings) as server:
        yield server.url


@pytest.fixture(scope="module")
def module_sidecar_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real sidecar, default settings, shared by a module's engines."""
    settings = SidecarSettings(db_path=tmp_path_factory.mktemp("sidecar") / "sidecar.db")
    with ThreadedSidecar(settings) as server:
        yield server.url


@pytest.fixture
def fc() -> Iterator[fakecuda.FakeCuda]:
    """The stand-in CUDA driver (tests/fakecuda), healed and at its default size after the test.

    Skips with the reason when it could not be built or loaded.
    """
    loaded = fakecuda.active()
    if loaded is None:
        pytest.skip(f"needs the stand-in CUDA driver: {fakecuda.why_not()}")
    loaded.heal()
    granularity = loaded.granularity()
    strict = loaded.set_strict_ctx(False)  # (reads the setting; put back at once)
    loaded.set_strict_ctx(strict)
    yield loaded
    loaded.heal()
    loaded.set_total_bytes(fakecuda.DEFAULT_TOTAL_BYTES)
    loaded.set_granularity(granularity)
    loaded.set_strict_ctx(strict)
