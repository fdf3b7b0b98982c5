"""The running kvsidecar's version and build facts (``--version``, ``/healthz``, metrics)."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys

__all__ = ["BuildInfo", "build_info", "version", "version_line"]

_FALLBACK = "0.0.0+unknown"  # a checkout that was never installed (pip install -e .)


@functools.cache
def version() -> str:
    """The installed distribution's version (``pyproject.toml``'s ``version``)."""
    try:
        return importlib.metadata.version("kvsidecar")
    except importlib.metadata.PackageNotFoundError:
        return _FALLBACK


BuildInfo = dict[str, str]


@functools.cache
def build_info() -> BuildInfo:
    """What a bug report needs: version, Python, the HTTP stack and the platform."""
    return {
        "version": version(),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "fastapi": _dist_version("fastapi"),
        "pydantic": _dist_version("pydantic"),
        "platform": f"{platform.system().lower()}-{platform.machine()}",
    }


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def version_line(program: str) -> str:
    """``kvsidecar 0.1.0 (python 3.11.7, linux-x86_64)``: what ``--version`` prints."""
    info = build_info()
    return f"{program} {info['version']} (python {info['python']}, {info['platform']})"
