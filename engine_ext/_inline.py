"""A copy of an engine function with a guard compiled into its own frame.

A wrapper around a hot engine method costs a call: from C (a method
descriptor) the interpreter is entered again for the original; from Python,
one more frame. Where the wrapper's whole job on the common call is a check
and then the original, :func:`guarded_copy` compiles that check into a copy
of the original instead: the engine's own source, with the guard's
statements before its body and, optionally, the body inside a
``try``/``except`` (zero-cost in CPython 3.11 until something is raised).

It fails closed. The copy is built only when the source on disk is the code
that runs: the unmodified source is compiled first and must give a code
object equal to the original's (instructions, constants, names, line table);
otherwise, or without source, it returns ``None`` and the caller keeps its
wrapper. The guard's names come in as closure cells (nothing is added to the
engine module's globals) and must not be names the original uses.

Imports neither vLLM nor SGLang. Thread: the one that applies the patches.
"""

from __future__ import annotations
import __future__

import ast
import functools
import inspect
import operator
import textwrap
import types
from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import Any

__all__ = ["guarded_copy"]

_FACTORY = "_kvsidecar_guarded_copy"  # the generated factory's name (never in a namespace)
_FUTURE_FLAGS = functools.reduce(  # the compiler flags a module's future imports set
    operator.or_, (getattr(__future__, name).compiler_flag for name in __future__.all_feature_names)
)


def guarded_copy(
    original: Callable[..., Any],
    guard: str,
    cells: Mapping[str, object],
    catch: tuple[str, str] | None = None,
) -> Callable[..., Any] | None:
    """``original`` compiled again with ``guard`` (statements) at the top of its body.

    ``cells``: the names the guard (and the handler) read, with their values; they,
    and the names the guard assigns, must be names the original does not use.
    ``catch``: ``(name, handler)``: the original body runs inside ``try``, and an
    exception of the class ``cells[name]`` runs ``handler`` (statements).
    Returns ``None`` when the copy cannot be proved to be of the running code (no
    source, a decorator, a nested function, a closure or ``super()``, the source
    differs from the code);
    raises :class:`ValueError` when a cell's name is one the original uses.
    """
    code = getattr(original, "__code__", None)
    if not isinstance(original, types.FunctionType) or code is None:
        return None
    owner, _, name = original.__qualname__.rpartition(".")
    if "<" in original.__qualname__ or "." in owner or name != code.co_name:
        return None  # a nested function or a nested class: not rebuilt here
    if code.co_freevars:  # a closure, or super()'s __class__ cell: the copy would lose it
        return None
    ours = {*cells, *_stored(guard), _FACTORY}
    clash = ours & {*code.co_names, *code.co_varnames, *code.co_freevars, *code.co_cellvars}
    if clash or _FACTORY in cells:
        raise ValueError(f"guard names {sorted(clash or {_FACTORY})} clash with {original!r}")
    function = _parsed_def(original)
    if function is None or _compiled(original, _module(function, owner, None)) != code:
        return None
    guarded = _with_guard(function, guard, catch)
    factory = _compiled(original, _module(guarded, owner, tuple(cells)), _FACTORY)
    if factory is None:
        return None
    copy: types.FunctionType = types.FunctionType(factory, original.__globals__)(**cells)
    copy.__qualname__ = original.__qualname__
    copy.__doc__ = original.__doc__
    copy.__defaults__ = original.__defaults__  # the same objects, not evaluated again
    copy.__kwdefaults__ = original.__kwdefaults__
    copy.__annotations__ = original.__annotations__
    copy.__dict__.update(original.__dict__)
    copy.__wrapped__ = original  # type: ignore[attr-defined]
    return copy


def _parsed_def(original: types.FunctionType) -> ast.FunctionDef | None:
    """The original's ``def`` as parsed from its file, at its line numbers."""
    try:
        lines, first = inspect.getsourcelines(original)
    except (OSError, TypeError):
        return None
    source = "".join(lines)
    nested = source[:1].isspace()  # a method: parsed in place, columns and docstring as they are
    try:
        tree = ast.parse("if 1:\n" + source if nested else source)
    except SyntaxError:
        return None
    body = tree.body[0].body if nested and isinstance(tree.body[0], ast.If) else tree.body
    if len(body) != 1 or not isinstance(body[0], ast.FunctionDef):
        return None
    function = body[0]
    if function.decorator_list:
        return None
    ast.increment_lineno(function, first - 1 - nested)
    return function


def _module(function: ast.FunctionDef, owner: str, cells: tuple[str, ...] | None) -> ast.Module:
    """``function`` inside ``class owner`` (so private names mangle as in the original),
    inside a factory taking ``cells`` that returns it (none when ``cells`` is None)."""
    line = function.lineno
    body: list[ast.stmt] = [function]
    if owner:
        body = [ast.ClassDef(owner, [], [], body, [], lineno=line, col_offset=0)]
    if cells is not None:
        found: ast.expr = ast.Name(owner or function.name, ast.Load())
        if owner:
            found = ast.Attribute(found, function.name, ast.Load())
        args = ast.arguments([], [ast.arg(cell) for cell in cells], None, [], [], None, [])
        body = [ast.FunctionDef(_FACTORY, args, [*body, ast.Return(found)], [], None)]
    module = ast.Module(body, [])
    own = {id(node) for node in ast.walk(function)}
    for node in ast.walk(module):  # the wrapping nodes stand on the def's line
        if id(node) not in own:
            _place(node, line)
    return module


def _with_guard(
    function: ast.FunctionDef, guard: str, catch: tuple[str, str] | None
) -> ast.FunctionDef:
    """A copy of ``function`` with ``guard`` before its body (after its docstring)."""
    line = function.lineno
    copy = deepcopy(function)  # the original's nodes, at their line numbers
    body = copy.body
    doc = body[:1] if ast.get_docstring(copy, clean=False) is not None else []
    rest = body[len(doc) :]
    if catch is not None:
        error, handler = catch
        rest = [
            ast.Try(
                rest,
                [ast.ExceptHandler(ast.Name(error, ast.Load()), None, _at(handler, line))],
                [],
                [],
            )
        ]
    copy.body = [*doc, *_at(guard, line), *rest]
    return copy


def _at(statements: str, line: int) -> list[ast.stmt]:
    """``statements`` parsed, every node on ``line`` (they are not in the engine's file)."""
    parsed = ast.parse(textwrap.dedent(statements)).body
    for node in parsed:
        for each in ast.walk(node):
            _place(each, line)
    return parsed


def _stored(statements: str) -> set[str]:
    """The names ``statements`` assign (locals of the copy)."""
    tree = ast.parse(textwrap.dedent(statements))
    return {
        node.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }


def _place(node: ast.AST, line: int) -> None:
    """Put ``node`` (not of the engine's file) on ``line``, column 0."""
    if "lineno" in node._attributes:
        node.lineno = node.end_lineno = line  # type: ignore[attr-defined]
        node.col_offset = node.end_col_offset = 0  # type: ignore[attr-defined]


def _compiled(
    original: types.FunctionType, module: ast.Module, name: str | None = None
) -> types.CodeType | None:
    """The code object named ``name`` (default: the original's) compiled from ``module``
    with the original's file name and future flags; ``None`` if it does not compile."""
    ast.fix_missing_locations(module)
    try:
        top = compile(
            module,
            original.__code__.co_filename,
            "exec",
            flags=original.__code__.co_flags & _FUTURE_FLAGS,
            dont_inherit=True,
        )
    except (SyntaxError, ValueError):
        return None
    want = name or original.__code__.co_name
    stack: list[types.CodeType] = [top]
    while stack:
        code = stack.pop()
        if code.co_name == want and code is not top:
            return code
        stack += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return None
