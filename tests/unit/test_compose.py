"""compose/*.yml and compose/docker/*.Dockerfile: valid, and everything they use exists.

``docker-compose config`` needs no Docker engine. The rest checks the files
against the package: every ``KVSIDECAR_*`` variable is a field of one of the
settings classes, every command the services run is a real subcommand or
module of this project, every path a Dockerfile copies exists in the build
context, and the GPU files overcommit (docs/overcommit.md) rather than split
the device statically.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
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
DOCKERFILES = sorted((REPO / "compose" / "docker").glob("*.Dockerfile"))
GPU_FILES = [p for p in FILES if p.name.startswith("colocate-")]
GIB = 1 << 30
DEVICE_BYTES = 80 * GIB  # the GPU the colocate files are written for (an 80 GiB A100/H100)


def _settings_env_names() -> set[str]:
    names = {
        f"KVSIDECAR_{n.upper()}"
        for cls in (EngineSettings, SidecarSettings)
        for n in cls.model_fields
    }
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
    proc = subprocess.run(
        [exe, "-f", str(path), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=path.parent,
        timeout=60,
        check=False,
    )
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
            proc = subprocess.run(
                [sys.executable, "-m", "sidecar.cli", sub, "--help"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert proc.returncode == 0, f"{name}: 'kvsidecar {sub}' is not a command"
        for script in re.findall(r"(scripts/[\w.-]+)", text):
            assert (REPO / script).exists(), f"{name}: {script} is missing"


# -- images -----------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name}: a continuation line runs off the end"
    return out


def _sources(args: str) -> list[str]:
    """The source paths of a COPY/ADD (JSON or shell form), without flags and destination."""
    words = yaml.safe_load(args) if args.startswith("[") else shlex.split(args)
    words = [w for w in words if not w.startswith("--")]
    assert len(words) >= 2, f"COPY/ADD needs a source and a destination: {args!r}"
    return list(words[:-1])


def test_there_are_the_three_images() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "sidecar.Dockerfile",
        "vllm.Dockerfile",
        "sglang.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_dockerfile_path_exists_in_the_build_context(path: Path) -> None:
    """Built from the repository root (compose: ``context: ..``), as each file says."""
    instructions = _instructions(path)
    assert instructions and instructions[0][0] == "FROM"
    copied = 0
    for word, args in instructions:
        if word in ("COPY", "ADD"):
            assert "--from" not in args, "no multi-stage sources here"
            for source in _sources(args):
                assert not source.startswith(("/", "..")), (
                    f"{path.name}: {source} leaves the context"
                )
                assert (REPO / source).exists(), f"{path.name}: {word} {source}: not in the repo"
                copied += 1
        elif word == "WORKDIR":
            assert args.startswith("/"), f"{path.name}: WORKDIR {args} must be absolute"
    assert copied >= 4  # pyproject, README and the three packages
    for package in ("allocator", "engine_ext", "sidecar", "pyproject.toml", "README.md"):
        assert any(package in _sources(a) for w, a in instructions if w == "COPY"), package


@pytest.mark.parametrize(
    ("name", "base"),
    [
        ("vllm.Dockerfile", "vllm/vllm-openai:v0.33.0"),
        ("sglang.Dockerfile", "lmsysorg/sglang:v0.5.23"),
    ],
)
def test_engine_images_extend_the_official_ones_with_the_cuda_extra(name: str, base: str) -> None:
    instructions = _instructions(REPO / "compose" / "docker" / name)
    assert instructions[0] == ("FROM", base)
    runs = " ".join(a for w, a in instructions if w == "RUN")
    assert re.search(r"pip install [^&]*\"\.\[cuda\]\"", runs), "kvsidecar[cuda] at build time"
    assert "-c /tmp/image-pins.txt" in runs  # the image's engine and torch stay as they are
    assert "cuda.bindings.driver" in runs  # the build fails if the CUDA extra is unusable


def _build(service: dict[str, Any]) -> dict[str, Any] | None:
    build = service.get("build")
    return build if isinstance(build, dict) else None


@pytest.mark.parametrize("path", GPU_FILES, ids=lambda p: p.name)
def test_gpu_files_build_their_images_and_install_nothing_at_start(path: Path) -> None:
    assert "pip install" not in path.read_text()
    for name, service in _services(path).items():
        build = _build(service)
        assert build is not None, f"{name}: no build section"
        assert (path.parent / build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']}"
        assert "volumes" not in service or not any(
            str(v).startswith("..") for v in service["volumes"]
        ), f"{name}: mounts the source"


def _args(service: dict[str, Any]) -> dict[str, str]:
    """``--flag value`` / ``--flag=value`` arguments of a service's command."""
    command = service.get("command") or []
    words = shlex.split(command) if isinstance(command, str) else [str(w) for w in command]
    out: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            key, eq, value = word.partition("=")
            if not eq:
                value = (
                    words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
                )
            out[key] = value
    return out


def _engines(path: Path) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _services(path).items() if n != "sidecar"}


@pytest.mark.parametrize("path", GPU_FILES, ids=lambda p: p.name)
def test_gpu_files_overcommit_instead_of_a_static_split(path: Path) -> None:
    from engine_ext.protocol import parse_size

    engines = _engines(path)
    assert len(engines) == 2
    virtual = []
    for name, service in engines.items():
        env = service["environment"]
        assert env["KVSIDECAR_ENABLE"] == "1"
        size = parse_size(env["KVSIDECAR_VIRTUAL_KV_BYTES"])
        assert size > DEVICE_BYTES // 2, f"{name}: virtual KV must exceed half the device"
        virtual.append(size)
        args = _args(service)
        if "vllm" in service["image"]:
            util = float(args["--gpu-memory-utilization"])
            assert util <= 0.3, f"{name}: utilization covers weights/activations only"
            assert int(args["--kv-cache-memory-bytes"]) == size  # skips vLLM's profiler
            assert args["--distributed-executor-backend"] == "uni"  # the GPU path needs it
    assert sum(virtual) > DEVICE_BYTES


def test_sglang_is_started_with_a_page_size_the_adapter_accepts() -> None:
    """SGLang 0.5.23 defaults --page-size to 1 on CUDA, which the adapter refuses at start."""
    engines = _engines(REPO / "compose" / "colocate-sglang.yml")
    for name, service in engines.items():
        assert int(_args(service).get("--page-size") or 1) >= 2, name
    docs = (REPO / "docs" / "sglang.md").read_text()
    launches = re.findall(r"launch_server[^`]*?(?:\n\n|```)", docs)
    assert launches and all(re.search(r"--page-size[ =](\d+)", cmd) for cmd in launches)


@pytest.mark.parametrize("path", GPU_FILES, ids=lambda p: p.name)
def test_the_second_engine_waits_for_the_first(path: Path) -> None:
    first, second = list(_engines(path))
    assert _services(path)[first]["depends_on"] == {"sidecar": {"condition": "service_healthy"}}
    assert _services(path)[second]["depends_on"][first] == {"condition": "service_healthy"}
    assert _services(path)[second]["depends_on"]["sidecar"] == {"condition": "service_healthy"}


def test_cpu_demo_runs_the_demo_and_a_live_vllm_and_sglang_engine() -> None:
    """The CPU file: the scripted demo, and the sidecar with one engine of each kind."""
    services = _services(REPO / "compose" / "cpu-demo.yml")
    assert services["demo"]["command"] == ["bash", "scripts/dev.sh", "demo", "--out", "/out"]
    assert "profiles" not in services["demo"]  # a plain `up demo` runs the main job
    sidecar_volumes = {str(v).split(":")[0] for v in services["sidecar"]["volumes"]}
    kinds: dict[str, str] = {}
    for name in ("vllm", "sglang"):
        service = services[name]
        command = [str(w) for w in service["command"]]
        kind = command[command.index("engine_ext.cpu_harness.run_engine") + 1]
        kinds[kind] = name
        env = service["environment"]
        assert env["KVSIDECAR_ENABLE"] == "1"
        assert env["KVSIDECAR_SIDECAR_URL"] == "http://sidecar:8570"
        # the control socket's directory is on a volume the sidecar mounts at the same path
        run_volume = next(v for v in service["volumes"] if str(v).endswith(":/run/kvsidecar"))
        assert str(run_volume).split(":")[0] in sidecar_volumes
        assert env["KVSIDECAR_RUNTIME_DIR"].startswith("/run/kvsidecar/")
        assert service["depends_on"]["sidecar"] == {"condition": "service_healthy"}
        assert _args(service)["--host"] == "0.0.0.0"
    assert set(kinds) == {"vllm", "sglang"}
    ids = [services[n]["environment"]["KVSIDECAR_INSTANCE_ID"] for n in kinds.values()]
    ports = [services[n]["ports"][0] for n in kinds.values()]
    assert len(set(ids)) == 2 and len(set(ports)) == 2
    for name, service in services.items():
        if name != "env":  # everything reuses the environment `env` builds, once
            assert service["depends_on"]["env"] == {"condition": "service_completed_successfully"}
