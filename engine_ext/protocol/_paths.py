"""Limits on what the two sides exchange as paths and names."""

from __future__ import annotations

import os

__all__ = ["DEVICE_ID_PATTERN", "ID_PATTERN", "MAX_SOCKET_PATH_BYTES", "socket_path_fits"]

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
