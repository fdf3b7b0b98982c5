"""The default instance id of a ``vllm serve`` process: ``<served model name>-<port>``.

Only the API server knows the port, and it starts the EngineCore (which
builds the pool and registers). So ``register()`` derives the id from the
server's command line in the API server process and hands it down through
``KVSIDECAR_INSTANCE_ID`` (inherited by the EngineCore at fork/spawn). An id
set by the operator is never overridden.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping, Sequence

__all__ = ["default_instance_id", "export_default_instance_id"]

ENV_VAR = "KVSIDECAR_INSTANCE_ID"
_DEFAULT_PORT = 8000
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def default_instance_id(argv: Sequence[str]) -> str | None:
    """``name-port`` from a ``vllm serve MODEL [--served-model-name N] [--port P]`` argv."""
    if "serve" not in argv:
        return None
    rest = list(argv[argv.index("serve") + 1 :])
    model = rest[0] if rest and not rest[0].startswith("-") else _option(rest, "--model")
    name = _option(rest, "--served-model-name") or model
    if not name:
        return None
    port = _option(rest, "--port") or str(_DEFAULT_PORT)
    base = _BAD.sub("-", name.rstrip("/").rsplit("/", 1)[-1]).strip("-._") or "vllm"
    return f"{base[: 62 - len(port)]}-{port}"


def export_default_instance_id(argv: Sequence[str], environ: MutableMapping[str, str]) -> None:
    """Set ``KVSIDECAR_INSTANCE_ID`` for child processes unless the operator set it."""
    if environ.get(ENV_VAR):
        return
    derived = default_instance_id(argv)
    if derived is not None:
        environ[ENV_VAR] = derived


def _option(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
