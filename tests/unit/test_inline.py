"""``engine_ext._inline.guarded_copy``: a function compiled again with a guard in front.

The copy must run the original's own body (same results, same errors, the
original's file and line numbers in a traceback), take the guard's branch
when it says so, turn only the named exception into the handler's result,
and refuse (``None``) whenever it cannot prove its source is the running code.
"""

from __future__ import annotations

import importlib
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import pytest

from engine_ext._inline import guarded_copy


class Refused(Exception):
    pass


class Box:
    """A class with a private attribute (name mangling) and a method to copy."""

    def __init__(self, size: int) -> None:
        self.__size = size
        self.log: list[int] = []

    def take(self, n: int, *, twice: bool = False, fail: BaseException | None = None) -> int:
        """Take n (a docstring: it stays the copy's)."""
        self.log.append(n)
        if fail is not None:
            raise fail
        if n > self.__size:
            return -1
        return 2 * n if twice else n


_GUARD = """
if n < 0:
    return _other(self, n)
"""


def _other(box: Box, n: int) -> str:
    return f"other {n}"


def _copy(catch: tuple[str, str] | None = ("_refused", "return 'refused'")) -> Any:
    copy = guarded_copy(Box.take, _GUARD, {"_other": _other, "_refused": Refused}, catch)
    assert copy is not None
    return copy


def test_the_copy_runs_the_original_body_and_the_guard() -> None:
    copy = _copy()
    box = Box(10)
    assert copy(box, 3) == Box.take(Box(10), 3) == 3
    assert copy(box, 4, twice=True) == 8
    assert copy(box, 11) == -1  # the mangled private attribute read as in the original
    assert copy(box, -2) == "other -2"  # the guard's branch: the body did not run
    assert box.log == [3, 4, 11]
    assert copy(box, 1, fail=Refused()) == "refused"  # only the named class is handled
    with pytest.raises(ValueError, match="x"):
        copy(box, 1, fail=ValueError("x"))
    with pytest.raises(Refused):
        _copy(catch=None)(box, 1, fail=Refused())
    assert copy.__doc__ == Box.take.__doc__ and copy.__qualname__ == "Box.take"
    assert copy.__wrapped__ is Box.take and copy.__kwdefaults__ is Box.take.__kwdefaults__
    box.take = copy.__get__(box)  # binds as a method
    assert box.take(2) == 2


def test_a_traceback_points_at_the_originals_lines() -> None:
    copy = _copy()
    try:
        copy(Box(1), 1, fail=KeyError("k"))
    except KeyError as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
    assert frame.filename == __file__
    assert frame.name == "take" and frame.line == "raise fail"
    assert copy.__code__.co_firstlineno == Box.take.__code__.co_firstlineno


def test_names_the_original_uses_are_refused() -> None:
    with pytest.raises(ValueError, match="clash"):
        guarded_copy(Box.take, _GUARD, {"twice": 1})  # a parameter of the original
    with pytest.raises(ValueError, match="clash"):
        guarded_copy(Box.take, "fail = None", {})  # the guard assigns one of its locals


class Base:
    def size(self) -> int:
        return 1


class Child(Base):
    def size(self) -> int:
        return super().size() + 1  # its __class__ cell is Child: a copy could not keep it


def _decorated(f: Any) -> Any:
    return f


@_decorated
def decorated(n: int) -> int:
    return n


def test_what_cannot_be_proved_is_not_copied(tmp_path: Path) -> None:
    made = compile("def made(n):\n    return n\n", "<made>", "exec").co_consts[0]
    assert guarded_copy(types.FunctionType(made, {}), "pass", {}) is None  # no file behind it
    assert guarded_copy(decorated, "pass", {}) is None
    assert guarded_copy(len, "pass", {}) is None  # not a Python function

    def nested(n: int) -> int:
        return n

    assert guarded_copy(nested, "pass", {}) is None
    assert guarded_copy(Child.size, "pass", {}) is None  # super(): a __class__ cell
    assert Child().size() == 2

    # the file changed after import: the source on disk is not the running code
    module = tmp_path / "kvs_inline_sample.py"
    module.write_text("def f(n):\n    return n + 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        sample = importlib.import_module("kvs_inline_sample")
        assert guarded_copy(sample.f, "pass", {}) is not None  # as imported: copied
        module.write_text("def f(n):\n    return n + 2\n")
        import linecache

        linecache.checkcache(str(module))
        assert guarded_copy(sample.f, "pass", {}) is None
        assert sample.f(1) == 2
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kvs_inline_sample", None)


def test_the_copy_adds_nothing_to_the_originals_module() -> None:
    before = set(globals())
    _copy()
    assert set(globals()) == before
    assert Box.take.__code__.co_freevars == ()  # the original is untouched
