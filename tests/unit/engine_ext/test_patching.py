"""The patch-table mechanism (engine_ext._patching) over a small stand-in engine module.

The adapters' own tables run against the real engines in
tests/integration/vllm/test_plugin.py and tests/integration/sglang/test_sglang_install.py.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet

from engine_ext import EngineExtConfigError
from engine_ext._patching import (
    Patch,
    Touch,
    UnsupportedEngineError,
    apply_patches,
    check_touches,
    is_patched,
    supported_range,
)

V1 = SpecifierSet(">=1.0,<2")
MOD = "kvs_fake_engine"


class Scheduler:
    def __init__(self) -> None:
        self._callbacks: list[Any] = []

    def step(self) -> str:
        return "step"

    @staticmethod
    def entry() -> str:
        return "entry"

    def _split(self) -> str:
        return "split"


@dataclasses.dataclass(frozen=True)
class Observer:
    total: int


def top_level() -> str:
    return "top"


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A fresh engine module per test (classes copied so patches never leak)."""
    module = types.ModuleType(MOD)
    module.Scheduler = type("Scheduler", (Scheduler,), dict(Scheduler.__dict__))  # type: ignore[attr-defined]
    module.Observer = Observer  # type: ignore[attr-defined]
    module.top_level = top_level  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MOD, module)
    yield module


def wrap(original: Any, context: Any) -> Any:
    def replacement(*args: Any) -> str:
        return f"{context}:{original(*args)}"

    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    return replacement


def snapshot(module: types.ModuleType) -> dict[str, Any]:
    return {**module.Scheduler.__dict__, "top_level": module.top_level}


ROWS = (
    Patch(f"{MOD}:Scheduler.step", V1, wrap, "per-step hook"),
    Patch(f"{MOD}:Scheduler.entry", V1, wrap, "a staticmethod"),
    Patch(f"{MOD}:top_level", V1, wrap, "a module-level name"),
)
TOUCHES = (
    Touch(f"{MOD}:Scheduler._split", V1, "a private method"),
    Touch(f"{MOD}:Scheduler._callbacks", V1, "an attribute set in __init__"),
    Touch(f"{MOD}:Observer.total", V1, "a dataclass field"),
)


def test_apply_replaces_every_row_and_undo_restores_them(engine: types.ModuleType) -> None:
    before = snapshot(engine)
    applied = apply_patches("Fake", "1.2", ROWS, TOUCHES, context="ctx")
    assert applied.targets == [row.target for row in ROWS]
    assert engine.Scheduler().step() == "ctx:step"
    assert engine.Scheduler.entry() == "ctx:entry"  # still a staticmethod
    assert engine.top_level() == "ctx:top"
    assert all(is_patched(row.target) for row in ROWS)
    assert apply_patches("Fake", "1.2", ROWS, TOUCHES).targets == []  # idempotent
    assert engine.Scheduler().step() == "ctx:step"  # not wrapped twice
    assert applied.undo() == [row.target for row in reversed(ROWS)]
    assert snapshot(engine) == before and not any(is_patched(r.target) for r in ROWS)
    assert applied.undo() == []


@pytest.mark.parametrize("missing", range(len(ROWS)))
def test_one_missing_target_changes_nothing(engine: types.ModuleType, missing: int) -> None:
    rows = list(ROWS)
    module, _, path = rows[missing].target.partition(":")
    rows[missing] = dataclasses.replace(rows[missing], target=f"{module}:{path}_renamed")
    before = snapshot(engine)
    with pytest.raises(UnsupportedEngineError, match=r"nothing was patched.*_renamed is gone"):
        apply_patches("Fake", "1.2", rows, TOUCHES)
    assert snapshot(engine) == before
    assert not any(is_patched(row.target) for row in ROWS)


@pytest.mark.parametrize(
    "touch",
    [
        Touch(f"{MOD}:Scheduler._merge", V1, "renamed method"),
        Touch(f"{MOD}:Scheduler._callback_list", V1, "renamed attribute"),
        Touch(f"{MOD}:Observer.capacity", V1, "renamed field"),
        Touch(f"{MOD}:Gone.attr", V1, "renamed class"),
        Touch("kvs_no_such_module:X.y", V1, "missing module"),
    ],
)
def test_a_missing_touch_refuses_and_changes_nothing(
    engine: types.ModuleType, touch: Touch
) -> None:
    before = snapshot(engine)
    with pytest.raises(UnsupportedEngineError, match=touch.why):
        apply_patches("Fake", "1.2", ROWS, (*TOUCHES, touch))
    assert snapshot(engine) == before
    with pytest.raises(EngineExtConfigError, match=touch.why):
        check_touches("Fake", (touch,))
    check_touches("Fake", TOUCHES)  # the present ones pass


@pytest.mark.parametrize("version", ["0.9", "2.0", "not-a-version"])
def test_a_version_outside_any_row_changes_nothing(engine: types.ModuleType, version: str) -> None:
    before = snapshot(engine)
    with pytest.raises(UnsupportedEngineError, match=r"Fake <2,>=1\.0"):
        apply_patches("Fake", version, ROWS, TOUCHES)
    assert snapshot(engine) == before
    assert str(supported_range(ROWS)) == "<2,>=1.0"


def test_a_refusing_factory_changes_nothing(engine: types.ModuleType) -> None:
    def refuse(original: Any, context: Any) -> Any:
        raise TypeError("this original is not what the adapter extends")

    rows = (*ROWS, Patch(f"{MOD}:Observer", V1, refuse, "refuses"))
    before = snapshot(engine)
    with pytest.raises(UnsupportedEngineError, match="not what the adapter extends"):
        apply_patches("Fake", "1.2", rows)
    assert snapshot(engine) == before


def test_an_inherited_attribute_is_not_a_patch_target(engine: types.ModuleType) -> None:
    child = type("Child", (engine.Scheduler,), {})
    engine.Child = child
    with pytest.raises(UnsupportedEngineError, match="Child.step is gone"):
        apply_patches("Fake", "1.2", (Patch(f"{MOD}:Child.step", V1, wrap, "inherited"),))
    assert "step" not in child.__dict__
