"""compose/*.yml: valid for Debian's docker-compose, and everything they use exists.

``docker-compose config`` needs no Docker engine. The second half checks the
files against the package: every ``KVSIDECAR_*`` variable is a field of one
of the settings classes, and every command the services run is a real
subcommand or module of this project.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine_ext._settings import EngineSettings
from sidecar._settings import SidecarSettings

REPO = Path(__file__).resolve().parents[2]
FILES = sorted((REPO / "compose").glob("*.yml"))


def _settings_env_names() -> set[str]:
    names = {f"KVSIDECAR_{n.upper()}" for cls in (EngineSettings, SidecarSettings)
             for n in cls.model_fields}  # fmt: skip
    try:  # the vLLM adapter's own settings (same prefix)
        from engine_ext.vllm._settings import VllmSettings

        names |= {f"KVSIDECAR_{n.upper()}" for n in VllmSettings.model_fields}
    except ImportError:
        pass
    return names


def _services(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    services: dict[str, Any] = doc["services"]
    return services


def test_there_are_the_three_demos() -> None:
    assert {p.name for p in FILES} == {"colocate-vllm.yml", "colocate-sglang.yml", "cpu-demo.yml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_docker_compose_config_accepts_it(path: Path) -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing on CI; scripts/dev.sh installs it (apt)")
        pytest.skip("docker-compose not installed (bash scripts/dev.sh test installs it)")
    proc = subprocess.run([exe, "-f", str(path), "config", "-q"], capture_output=True, text=True,
                          cwd=path.parent, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_kvsidecar_variable_is_a_setting(path: Path) -> None:
    known = _settings_env_names()
    used = set(re.findall(r"\bKVSIDECAR_[A-Z0-9_]+\b", path.read_text()))
    # KVSIDECAR_CACHE is read by scripts/dev.sh, not by a settings class
    unknown = used - known - {"KVSIDECAR_CACHE"}
    assert not unknown, f"{path.name} uses variables no settings class reads: {sorted(unknown)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_command_exists(path: Path) -> None:
    for name, service in _services(path).items():
        command = service.get("command")
        text = " ".join(command) if isinstance(command, list) else str(command or "")
        for module in re.findall(r"python -m ([\w.]+)", text):
            assert importlib.util.find_spec(module.split(".")[0]) is not None
            assert (REPO / (module.replace(".", "/") + ".py")).exists(), f"{name}: {module}"
        for sub in re.findall(r"kvsidecar (\w+)", text):
            proc = subprocess.run([sys.executable, "-m", "sidecar.cli", sub, "--help"], cwd=REPO,
                                  capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
            assert proc.returncode == 0, f"{name}: 'kvsidecar {sub}' is not a command"
        for script in re.findall(r"(scripts/[\w.-]+)", text):
            assert (REPO / script).exists(), f"{name}: {script} is missing"
