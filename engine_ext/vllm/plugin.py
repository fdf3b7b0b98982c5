"""The ``vllm.general_plugins`` entry point (declared in pyproject.toml)."""

from __future__ import annotations


def register() -> None:
    """Placeholder: filled in below."""
    return None
