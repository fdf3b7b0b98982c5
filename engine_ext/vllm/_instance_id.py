"""The default instance id of a ``vllm serve`` process: ``<served model name>-<port>-<host>``.

Only the API server knows the port, and it starts the EngineCore (which
builds the pool and registers). So ``register()`` derives the id from the
server's command line in the API server process and hands it down through
``KVSIDECAR_INSTANCE_ID`` (inherited by the EngineCore at fork/spawn). An id
set by the operator is never overridden.

The host part (``POD_NAME`` when set, else the host name, first label) keeps
replicas of one deployment apart: ``<model>-<port>`` alone is the same in
every replica, and two engines on one id take over each other's limit.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, MutableMapping, Sequence

__all__ = ["default_instance_id", "export_default_instance_id", "host_part"]

ENV_VAR = "KVSIDECAR_INSTANCE_ID"
_DEFAULT_PORT = 8000
_MAX_ID = 63
_MAX_HOST = 24  # of the 63 characters of an id, at most this many name the host
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def host_part(environ: Mapping[str, str]) -> str:
    """``POD_NAME`` (Kubernetes downward API) or the host name's first label, made id-safe."""
    raw = environ.get("POD_NAME") or socket.gethostname().split(".", 1)[0]
    cleaned = _BAD.sub("-", raw).strip("-._")[:_MAX_HOST].strip("-._")
    return cleaned or "host"


def default_instance_id(argv: Sequence[str], host: str | None = None) -> str | None:
    """``name-port-host`` from a ``vllm serve MODEL [--served-model-name N] [--port P]`` argv."""
    if "serve" not in argv:
        return None
    rest = list(argv[argv.index("serve") + 1 :])
    model = rest[0] if rest and not rest[0].startswith("-") else _option(rest, "--model")
    name = _option(rest, "--served-model-name") or model
    if not name:
        return None
    port = _option(rest, "--port") or str(_DEFAULT_PORT)
    host = host if host is not None else host_part({})
    base = _BAD.sub("-", name.rstrip("/").rsplit("/", 1)[-1]).strip("-._") or "vllm"
    tail = f"-{port}-{host}"
    return f"{base[: _MAX_ID - len(tail)]}{tail}"


def export_default_instance_id(argv: Sequence[str], environ: MutableMapping[str, str]) -> None:
    """Set ``KVSIDECAR_INSTANCE_ID`` for child processes unless the operator set it."""
    if environ.get(ENV_VAR):
        return
    derived = default_instance_id(argv, host_part(environ))
    if derived is not None:
        environ[ENV_VAR] = derived


def _option(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
