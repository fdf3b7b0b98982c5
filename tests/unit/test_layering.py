"""Layering: what importing a package loads (docs/architecture.md, "Packages and what they
may import"). Each check runs in a fresh interpreter, so ``sys.modules`` is clean."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.imports import REPO, loaded_after

_OURS = ("allocator", "engine_ext", "sidecar")
#: Third-party distributions the contract may use besides the standard library.
_CONTRACT_DEPS = {
    "pydantic",
    "pydantic_core",
    "typing_extensions",
    "annotated_types",
    "typing_inspection",
}


def _ours(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m.split(".")[0] in _OURS]


@pytest.mark.parametrize("entry", ["sidecar", "sidecar.cli", "sidecar.kvctl"])
def test_the_sidecar_loads_the_contract_and_no_engine_core(entry: str) -> None:
    loaded = loaded_after(entry)
    engine_side = [m for m in _ours(loaded) if not m.startswith("sidecar")]
    stray = [
        m for m in engine_side if m != "engine_ext" and not m.startswith("engine_ext.protocol")
    ]
    assert "engine_ext.protocol" in engine_side  # the check sees the contract load
    assert stray == [], f"importing {entry} loads {stray}"
    assert not [m for m in loaded if m.split(".")[0] in {"torch", "vllm", "sglang"}]


def test_the_contract_loads_pydantic_and_the_standard_library_only() -> None:
    baseline = set(loaded_after())
    loaded = loaded_after("engine_ext.protocol")
    new_tops = {
        m.split(".")[0] for m in loaded if m not in baseline and not m.startswith("_sysconfigdata")
    }  # stdlib data
    foreign = new_tops - set(sys.stdlib_module_names) - _CONTRACT_DEPS - {"engine_ext"}
    assert foreign == set(), f"engine_ext.protocol loads {sorted(foreign)}"
    assert [m for m in _ours(loaded) if not m.startswith("engine_ext.protocol")] == ["engine_ext"]


def test_the_core_names_still_load_from_engine_ext() -> None:
    """``engine_ext`` is lazy (PEP 562): every exported name resolves on use, and a name it
    does not export is an AttributeError, not an import of something else."""
    import engine_ext
    from engine_ext import protocol

    for name in engine_ext.__all__:
        assert getattr(engine_ext, name) is not None, name
    assert engine_ext.DeferReason is protocol.DeferReason
    assert engine_ext.WaitReason is protocol.WaitReason
    assert set(engine_ext.__all__) <= set(dir(engine_ext))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        engine_ext.nope  # noqa: B018


# --- the import graph of the product, read from the source (no import needed) -----------

_PRODUCT = ("allocator", "engine_ext", "sidecar")


@dataclass(frozen=True)
class _Import:
    target: str  # the module named by the statement (``from X import a``: X, or X.a if a module)
    resolved: tuple[str, ...]  # the modules it loads for this name (re-exports followed)
    runtime: bool  # False: under ``if TYPE_CHECKING:`` (never runs)
    line: int


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every product module: dotted name -> (file, is a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for top in _PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
        # a compiled module (allocator/_speedups.c) is known by its interface stub
        for path in sorted((REPO / top).rglob("*.pyi")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found.setdefault(name, (path, False))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement (module level and in functions), and whether it runs."""

    def walk(node: ast.AST, runtime: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk_one(stmt, False)
                for stmt in child.orelse:
                    yield from walk_one(stmt, runtime)
            else:
                yield from walk_one(child, runtime)

    def walk_one(
        node: ast.AST, runtime: bool
    ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, runtime
        else:
            yield from walk(node, runtime)

    yield from walk(tree, True)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _graph() -> dict[str, list[_Import]]:
    """module -> its imports of product modules."""
    mods = _modules()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in mods.items()}
    # what each package re-exports, and from where (``from .x import a`` in its __init__,
    # TYPE_CHECKING blocks included: a lazy package loads them on first use)
    exports: dict[str, dict[str, str]] = {}
    for name, (_, is_package) in mods.items():
        if is_package:
            for node, _runtime in _statements(trees[name]):
                if isinstance(node, ast.ImportFrom):
                    base = _base(name, True, node)
                    for alias in node.names:
                        exports.setdefault(name, {})[alias.asname or alias.name] = base

    def defining(package: str, attr: str, seen: int = 0) -> tuple[str, ...]:
        source = exports.get(package, {}).get(attr)
        if source is None or source not in mods or seen > 10:
            return ()
        if f"{source}.{attr}" in mods:
            return (f"{source}.{attr}",)
        return (source, *defining(source, attr, seen + 1))

    graph: dict[str, list[_Import]] = {}
    for name, (_, is_package) in mods.items():
        edges = graph.setdefault(name, [])
        for node, runtime in _statements(trees[name]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in _PRODUCT:
                        edges.append(_Import(alias.name, (alias.name,), runtime, node.lineno))
                continue
            base = _base(name, is_package, node)
            if base.split(".")[0] not in _PRODUCT:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in mods:
                    edges.append(_Import(sub, (sub,), runtime, node.lineno))
                else:
                    edges.append(
                        _Import(base, (base, *defining(base, alias.name)), runtime, node.lineno)
                    )
    return graph


def _private_owner(module: str) -> str | None:
    """The package whose private part ``module`` is (``a.b._c.d`` -> ``a.b``); None: public."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


#: Known cycles, to be fixed (none today: the vLLM pool/runtime cycle of issue 15 item 4 is
#: gone, its backing types live in the vLLM-free ``engine_ext.vllm._pool_backing``).
_KNOWN_CYCLES: set[frozenset[str]] = set()


def _may_import(module: str, is_package: bool, target: str) -> bool:
    """docs/conventions.md, "Imports": a private module (a ``_x`` in its path) is used by
    the package it belongs to and the packages under it; a package's ``__init__`` may also
    re-export from private modules below it (how a package builds its public API). Sibling
    packages and other top-level packages use public names only."""
    owner = _private_owner(target)
    if owner is None or module == owner or module.startswith(owner + "."):
        return True
    return is_package and owner.startswith(module + ".")


def test_no_product_module_imports_a_private_module_of_another_package() -> None:
    mods = _modules()
    bad = sorted(
        {
            f"{module}:{imp.line} imports {imp.target}"
            for module, imports in _graph().items()
            for imp in imports
            if not _may_import(module, mods[module][1], imp.target)
        }
    )
    assert bad == []


def _cycles(graph: dict[str, list[_Import]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), runtime imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for imp in graph.get(node, ()):
            if not imp.runtime:
                continue
            for target in imp.resolved:
                if target == node or target not in graph:
                    continue
                if target not in index:
                    visit(target)
                    low[node] = min(low[node], low[target])
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_between_product_modules() -> None:
    """Function-level imports count (a lazy import hides a cycle, it does not remove the
    dependency); ``TYPE_CHECKING`` imports do not (they never run)."""
    cycles = {frozenset(c) for c in _cycles(_graph())}
    assert sorted(map(sorted, cycles - _KNOWN_CYCLES)) == []
    fixed = _KNOWN_CYCLES - cycles
    assert not fixed, f"fixed, remove from _KNOWN_CYCLES: {sorted(map(sorted, fixed))}"


def test_the_import_graph_sees_what_it_checks() -> None:
    """The checks above can fail: the graph finds known edges, the lazy package's
    re-exports, a function-level import, and the rule flags a made-up private import."""
    graph = _graph()
    targets = {m: {t for i in imps for t in i.resolved} for m, imps in graph.items()}
    assert "engine_ext.protocol._wire" in targets["engine_ext.protocol"]
    assert "engine_ext._settings" in targets["engine_ext.sglang._install"]  # via `from ..`
    assert "engine_ext._mailbox" in targets["engine_ext._instance"]
    assert "engine_ext._control" in targets["engine_ext"]  # lazy: its TYPE_CHECKING names
    assert not any(i.runtime for i in graph["engine_ext"])  # ... load nothing at import
    assert "sidecar._app" in targets["sidecar.cli"]  # imported in a function
    assert _private_owner("engine_ext.vllm._runtime") == "engine_ext.vllm"
    assert _private_owner("engine_ext.protocol") is None
    assert _may_import("engine_ext.vllm._runtime", False, "engine_ext._settings")  # parent's
    assert not _may_import("sidecar._service", False, "engine_ext._mailbox")
    assert not _may_import("engine_ext.sglang._runtime", False, "engine_ext.vllm._runtime")
    assert not _may_import("engine_ext._instance", False, "engine_ext.vllm._runtime")
    assert _may_import("engine_ext.cpu_harness", True, "engine_ext.cpu_harness.vllm._launcher")
    assert _cycles({"a": [_Import("b", ("b",), True, 1)], "b": [_Import("a", ("a",), True, 1)]})
    assert not _cycles(
        {"a": [_Import("b", ("b",), False, 1)], "b": [_Import("a", ("a",), True, 1)]}
    )
