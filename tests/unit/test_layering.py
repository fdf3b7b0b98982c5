"""Layering: what importing a package loads (docs/architecture.md, "Packages and what they
may import"). Each check runs in a fresh interpreter, so ``sys.modules`` is clean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_OURS = ("allocator", "engine_ext", "sidecar")
#: Third-party distributions the contract may use besides the standard library.
_CONTRACT_DEPS = {"pydantic", "pydantic_core", "typing_extensions", "annotated_types",
                  "typing_inspection"}


def _loaded_after(*modules: str) -> list[str]:
    """Module names in ``sys.modules`` of a fresh interpreter after importing ``modules``."""
    code = ("import json, sys\n"
            f"for name in {list(modules)!r}:\n"
            "    __import__(name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded: list[str] = json.loads(proc.stdout.splitlines()[-1])
    return loaded


def _ours(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m.split(".")[0] in _OURS]


@pytest.mark.parametrize("entry", ["sidecar", "sidecar.cli", "sidecar.kvctl"])
def test_the_sidecar_loads_the_contract_and_no_engine_core(entry: str) -> None:
    loaded = _loaded_after(entry)
    engine_side = [m for m in _ours(loaded) if not m.startswith("sidecar")]
    stray = [m for m in engine_side
             if m != "engine_ext" and not m.startswith("engine_ext.protocol")]
    assert "engine_ext.protocol" in engine_side  # the check sees the contract load
    assert stray == [], f"importing {entry} loads {stray}"
    assert not [m for m in loaded if m.split(".")[0] in {"torch", "vllm", "sglang"}]


def test_the_contract_loads_pydantic_and_the_standard_library_only() -> None:
    baseline = set(_loaded_after())
    loaded = _loaded_after("engine_ext.protocol")
    new_tops = {m.split(".")[0] for m in loaded
                if m not in baseline and not m.startswith("_sysconfigdata")}  # stdlib data
    foreign = new_tops - set(sys.stdlib_module_names) - _CONTRACT_DEPS - {"engine_ext"}
    assert foreign == set(), f"engine_ext.protocol loads {sorted(foreign)}"
    assert [m for m in _ours(loaded) if not m.startswith("engine_ext.protocol")] == [
        "engine_ext"]


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
