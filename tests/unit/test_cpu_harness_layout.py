"""The CPU harness is its own package: off the product path, cheap to import, found by vLLM.

* nothing of the product (allocator, engine core, adapters, sidecar except its
  demo) imports ``engine_ext.cpu_harness``;
* the harness and the demo import other packages only through public names;
* ``import engine_ext.cpu_harness`` loads no engine and no torch (the demo runs
  it in the sidecar's process);
* the dotted path handed to ``--distributed-executor-backend`` resolves, with
  vLLM's own resolver, to the stub executor.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.imports import REPO, loaded_after

HARNESS = REPO / "engine_ext" / "cpu_harness"
DEMO = REPO / "sidecar" / "demo"


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    if path.name == "__init__.py":
        package = ".".join(path.relative_to(REPO).parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield node.lineno, base
            for alias in node.names:  # ``from pkg import _private`` names a module too
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.lineno, f"{base}.{alias.name}"


def _product_files() -> Iterator[Path]:
    for root in ("allocator", "engine_ext", "sidecar"):
        for path in sorted((REPO / root).rglob("*.py")):
            if HARNESS in path.parents or DEMO in path.parents:
                continue
            yield path


def test_no_product_module_imports_the_harness() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in _product_files()
        for line, name in _imports(path)
        if name == "engine_ext.cpu_harness" or name.startswith("engine_ext.cpu_harness.")
    ]
    assert offenders == [], "\n".join(offenders)


@pytest.mark.parametrize("root", [HARNESS, DEMO], ids=["cpu_harness", "sidecar.demo"])
def test_harness_and_demo_use_only_public_names_of_other_packages(root: Path) -> None:
    own = ".".join(root.relative_to(REPO).parts)
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for line, name in _imports(path):
            if name.split(".")[0] not in ("allocator", "engine_ext", "sidecar"):
                continue
            if name == own or name.startswith(own + "."):
                continue  # its own private modules are its business
            if any(part.startswith("_") for part in name.split(".")):
                offenders.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert offenders == [], "\n".join(offenders)


def test_importing_the_harness_loads_no_engine() -> None:
    loaded = loaded_after(
        "engine_ext.cpu_harness",
        then="h = sys.modules['engine_ext.cpu_harness']; h.make_tiny_model_dir; h.launch_vllm_server",
    )
    assert [m for m in loaded if m.split(".")[0] in ("vllm", "sglang", "torch")] == []


def test_an_unknown_name_is_an_attribute_error() -> None:
    import engine_ext.cpu_harness as harness

    with pytest.raises(AttributeError, match="no attribute 'StubWorker'"):
        harness.StubWorker  # noqa: B018 -- private: not part of the API


@pytest.mark.vllm
def test_vllm_resolves_the_stub_executor_by_its_dotted_path() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm 0.33 is installed by scripts/dev.sh")
    from vllm.utils.import_utils import resolve_obj_by_qualname  # what Executor.get_class uses

    from engine_ext.cpu_harness import STUB_EXECUTOR, StubExecutor

    assert STUB_EXECUTOR == "engine_ext.cpu_harness.vllm.executor.StubExecutor"
    assert resolve_obj_by_qualname(STUB_EXECUTOR) is StubExecutor
