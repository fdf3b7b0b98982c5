"""Helpers for the SGLang integration tests (imported by name; conftest holds the fixtures)."""

from __future__ import annotations

from engine_ext.cpu_harness import CpuHarness


def prompt(i: int, length: int = 40) -> list[int]:
    """A prompt unlikely to share a prefix with ``prompt(j)``; ids stay exact in fp16."""
    return [(i * 37 + j * 11 + 1) % 2000 for j in range(length)]


def fill(harness: CpuHarness, num: int, start: int = 0, new_tokens: int = 5) -> None:
    """Run ``num`` distinct requests to completion: their KV stays in the tree cache."""
    for i in range(start, start + num):
        harness.submit(prompt(i), max_new_tokens=new_tokens)
    harness.run_until_idle()
