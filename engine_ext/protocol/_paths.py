"""Limits on what the two sides exchange as paths and names."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

__all__ = [
    "DEVICE_ID_PATTERN",
    "ID_PATTERN",
    "MAX_SOCKET_PATH_BYTES",
    "sidecar_url_problem",
    "socket_path_fits",
]

#: Instance ids: what fits in a URL path segment, a file name and a metric label.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"

#: Device ids (a GPU UUID such as ``GPU-8f3c...``, ``node1-gpu0``, or a named host device
#: such as ``host0`` on CPU; docs/autopilot.md): what fits in a URL path segment and a
#: metric label.
DEVICE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"

#: A unix socket path: ``sockaddr_un.sun_path`` is 108 bytes on Linux, including the
#: terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


def socket_path_fits(path: str) -> bool:
    """Whether ``path`` fits in ``sockaddr_un.sun_path``, encoded as the OS will (a path
    the OS cannot encode fits nowhere)."""
    try:
        return len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES
    except UnicodeEncodeError:
        return False


def sidecar_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be the sidecar's address, in words to put after "it"; None when
    it can. An http(s) URL with a host, a port in 1..65535 if one is given, an optional
    path (a prefix the sidecar is served under), and nothing else: a query or fragment
    would end up inside every request path built on it."""
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        return "contains a space or a control character"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a port that is not a number in 0..65535
    except ValueError as exc:
        return f"cannot be read as a URL ({exc})"
    if parts.scheme.lower() not in ("http", "https"):
        return "is not an http(s) URL"
    if not parts.hostname:
        return "names no host"
    if port == 0:
        return "names port 0"
    if "?" in url or "#" in url:
        return "carries a query (?) or fragment (#); give the address only"
    return None
