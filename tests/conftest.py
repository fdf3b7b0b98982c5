"""Shared test set-up: the thread guard is on for every test (docs/design.md, "the one rule")."""

from __future__ import annotations

import pytest

from allocator import ThreadGuard

pytest_plugins = ["support.fixtures"]  # sidecar_url, module_sidecar_url (see tests/support)


def pytest_configure(config: pytest.Config) -> None:
    ThreadGuard.set_default_enabled(True)
    # Before anything imports cuda.bindings: the stand-in CUDA driver where no real one is.
    import fakecuda

    fakecuda.preload()
