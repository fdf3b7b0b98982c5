"""One way to change an engine: patch tables checked whole, applied whole, undone whole.

An adapter declares two kinds of rows, both pinned to the engine versions
they were written against (``packaging.specifiers``):

* :class:`Patch` -- an attribute we *replace*: ``target``, ``versions``, a
  ``replacement`` factory ``(original, context) -> replacement`` and ``why``.
* :class:`Touch` -- a private engine member we *use* without replacing it
  (an attribute our code reads, calls or rebinds): ``target``, ``versions``,
  ``why``. An engine upgrade that renames one fails at start-up, here, with
  the row in the message, instead of deep inside a running engine.

A target is ``"package.module:Name"`` or ``"package.module:Class.attr"``. For a
touch, ``attr`` may also be an instance attribute: a dataclass field, an
annotation, or a ``self.attr =`` assignment in the class's (or a base's) source.

:func:`apply_patches` checks the version against every row, resolves every
target and builds every replacement *before* it changes anything; any
problem raises :class:`UnsupportedEngineError` naming all of them and leaves
the engine untouched. It returns an :class:`AppliedPatches` handle whose
:meth:`~AppliedPatches.undo` puts every original back. A target that already
holds one of our replacements (they carry a marker) is left alone, so
applying twice changes nothing.

Imports neither vLLM nor SGLang: the engine modules are imported by name when
a table is applied. Thread: the process's main thread, before the engine is
built.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ._errors import EngineExtConfigError

__all__ = [
    "AppliedPatches",
    "Patch",
    "Touch",
    "UnsupportedEngineError",
    "apply_patches",
    "check_touches",
    "is_patched",
    "supported_range",
]

MARK = "__kvsidecar_patch__"
#: ``(original, context) -> replacement``; ``context`` is what the adapter passed to apply.
Factory = Callable[[Any, Any], Any]


class UnsupportedEngineError(EngineExtConfigError):
    """The installed engine does not match a patch or touch row; nothing was patched.

    Fix: install an engine version in the table's range, or start the engine
    without kvsidecar (``KVSIDECAR_ENABLE=0``).
    """


@dataclass(frozen=True, slots=True)
class Patch:
    """One replaced engine attribute."""

    target: str  # "package.module:Name" or "package.module:Class.attr"
    versions: SpecifierSet  # engine versions this row was written and tested against
    replacement: Factory  # (original, context) -> replacement
    why: str  # one line for the docs and the log


@dataclass(frozen=True, slots=True)
class Touch:
    """One private engine member our code relies on without replacing it."""

    target: str  # "package.module:Class.attr" (class or instance attribute)
    versions: SpecifierSet
    why: str  # which of our modules uses it, and for what


@dataclass(slots=True)
class _Change:
    owner: Any
    name: str
    original: Any  # the raw attribute (staticmethod object, function, class, ...)
    target: str


@dataclass(slots=True)
class AppliedPatches:
    """What one :func:`apply_patches` call changed; :meth:`undo` restores it.

    Owns the list of originals. Any thread may call :meth:`undo`, once the
    engine no longer runs patched code (tests, shutdown); it is idempotent.
    """

    engine: str
    _changes: list[_Change] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def targets(self) -> list[str]:
        """Targets this call replaced, in table order (empty if all were patched already)."""
        return [change.target for change in self._changes]

    def undo(self) -> list[str]:
        """Put every original back (last patched first); return the targets restored."""
        with self._lock:
            restored: list[str] = []
            while self._changes:
                change = self._changes.pop()
                setattr(change.owner, change.name, change.original)
                restored.append(change.target)
            return restored


def supported_range(rows: Iterable[Patch | Touch]) -> SpecifierSet:
    """The engine versions every row supports."""
    combined = SpecifierSet()
    for row in rows:
        combined &= row.versions
    return combined


def apply_patches(
    engine: str,
    version: str,
    patches: Sequence[Patch],
    touches: Sequence[Touch] = (),
    *,
    context: Any = None,
) -> AppliedPatches:
    """Check everything, then replace every target not replaced yet; return the undo handle.

    ``engine`` names the engine in messages ("vLLM", "SGLang"). Raises
    :class:`UnsupportedEngineError` (and changes nothing) when ``version`` is
    outside a row's range, a target is missing, or a replacement factory refuses.
    """
    rows: list[Patch | Touch] = [*patches, *touches]
    _check_version(engine, version, rows)
    problems = _touch_problems(touches)
    planned: list[tuple[Patch, Any, str, Any]] = []  # (row, owner, name, raw original)
    for patch in patches:
        try:
            owner, name = _resolve(patch.target)
        except LookupError as exc:
            problems.append(str(exc))
            continue
        raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        planned.append((patch, owner, name, raw))
    _raise_if(engine, rows, problems)
    built: list[tuple[_Change, Any]] = []
    for patch, owner, name, raw in planned:
        if _is_ours(raw):
            continue
        try:
            new = patch.replacement(_unwrap(raw), context)
            _mark(new)
        except EngineExtConfigError:
            raise
        except (TypeError, ValueError, AttributeError, ImportError) as exc:
            problems.append(f"{patch.target}: {exc}")
            continue
        built.append((_Change(owner, name, raw, patch.target), _rewrap(raw, new)))
    _raise_if(engine, rows, problems)
    applied = AppliedPatches(engine)
    for change, new in built:  # nothing above changed the engine; from here nothing can fail
        setattr(change.owner, change.name, new)
        applied._changes.append(change)
    return applied


def check_touches(engine: str, touches: Sequence[Touch]) -> None:
    """Raise :class:`UnsupportedEngineError` if any touched member is missing."""
    _raise_if(engine, touches, _touch_problems(touches))


def is_patched(target: str) -> bool:
    """Whether ``target`` currently holds one of our replacements."""
    owner, name = _resolve(target)
    raw = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
    return _is_ours(raw)


# -- helpers ------------------------------------------------------------------------------


def _check_version(engine: str, version: str, rows: Sequence[Patch | Touch]) -> None:
    supported = supported_range(rows)
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise UnsupportedEngineError(
            f"cannot read {engine} version {version!r}; kvsidecar supports {engine} {supported}"
        ) from None
    for row in rows:
        if not row.versions.contains(parsed, prereleases=True):
            raise UnsupportedEngineError(
                f"kvsidecar supports {engine} {supported} but {engine} {version} is installed "
                f"({row.target} is pinned to {row.versions}); install a supported {engine} or "
                "start it without kvsidecar (unset KVSIDECAR_ENABLE)"
            )


def _raise_if(engine: str, rows: Sequence[Patch | Touch], problems: list[str]) -> None:
    if problems:
        raise UnsupportedEngineError(
            f"this {engine} does not match kvsidecar's patch table ({engine} "
            f"{supported_range(rows)}); nothing was patched: "
            + "; ".join(problems)
            + f". Install a supported {engine} or unset KVSIDECAR_ENABLE"
        )


def _touch_problems(touches: Sequence[Touch]) -> list[str]:
    problems: list[str] = []
    for touch in touches:
        try:
            owner, name = _resolve(touch.target, member=True)
        except LookupError as exc:
            problems.append(f"{exc} (used: {touch.why})")
            continue
        if not _has_member(owner, name):
            problems.append(f"{touch.target} is gone (used: {touch.why})")
    return problems


def _has_member(owner: Any, name: str) -> bool:
    """A class/module attribute, a dataclass field, an annotation or a ``self.name =``."""
    if hasattr(owner, name):
        return True
    if not isinstance(owner, type):
        return False
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]")
    for klass in owner.__mro__:
        if name in inspect.get_annotations(klass):  # never creates one (getattr would)
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if assigned.search(source):
            return True
    return False


def _resolve(target: str, *, member: bool = False) -> tuple[Any, str]:
    """``(owner, attribute name)`` for a target; LookupError naming what is missing.

    A patch target must be the owner's own attribute (a class's ``__dict__``);
    with ``member`` (touches) only the owner is resolved and the name is not checked.
    """
    module_name, sep, path = target.partition(":")
    if not sep or not path:
        raise LookupError(f"{target!r} is not 'package.module:Name' or 'package.module:Class.attr'")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"{target}: cannot import {module_name} ({exc})") from None
    *parents, name = path.split(".")
    for parent in parents:
        if not hasattr(owner, parent):
            raise LookupError(f"{target} is gone ({module_name} has no {parent})")
        owner = getattr(owner, parent)
    if member:
        return owner, name
    present = name in owner.__dict__ if isinstance(owner, type) else hasattr(owner, name)
    if not present:
        raise LookupError(f"{target} is gone")
    return owner, name


def _unwrap(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw


def _rewrap(raw: Any, new: Any) -> Any:
    if isinstance(raw, staticmethod):
        return staticmethod(new)
    if isinstance(raw, classmethod):
        return classmethod(new)
    return new


def _is_ours(raw: Any) -> bool:
    return bool(getattr(_unwrap(raw), MARK, False))


def _mark(new: Any) -> None:
    try:
        setattr(new, MARK, True)
    except (AttributeError, TypeError) as exc:
        raise TypeError(f"cannot mark the replacement {new!r}: {exc}") from exc
