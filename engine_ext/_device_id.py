"""Which device an engine's KV memory is on, derived from its backend (docs/autopilot.md).

An engine registers with a device id so the sidecar's autopilot can share one budget
among the engines on one device. ``KVSIDECAR_DEVICE_ID`` (or the adapter's own
``EngineBinding.device_id``) wins; without either, :func:`derive_device_id` names the
device from the backend the pool maps its pages with:

- ``CudaBackend`` (GPU path only): the CUDA device's UUID, ``GPU-8f3c…`` as
  ``nvidia-smi -L`` prints it, so every engine on one GPU lands on one device
  whatever its ``CUDA_VISIBLE_DEVICES`` ordinal;
- ``HostBackend`` (CPU): the host, ``host-<hostname>``.

Backends that wrap another (``FencedBackend``, vLLM's ``PrimedBackend``: ``inner``;
the rank group's ``RankedBackend``: ``owner``) are unwrapped first. Any other backend,
or a driver that cannot answer, gives ``None``: the engine is on no device.
"""

from __future__ import annotations

import logging
import re
import socket

from allocator import BackendError, CudaBackend, HostBackend

from .protocol import DEVICE_ID_PATTERN

__all__ = ["derive_device_id", "host_device_id"]

_log = logging.getLogger("engine_ext.device")
_WRAPPED = ("inner", "owner")  # attributes of wrapping backends that hold the wrapped one
_MAX_UNWRAP = 8


def host_device_id(hostname: str | None = None) -> str:
    """``host-<hostname>``, with characters a device id cannot hold replaced by ``-``."""
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", hostname or socket.gethostname()) or "localhost"
    device = f"host-{name}"[:128]
    assert re.match(DEVICE_ID_PATTERN, device), device
    return device


def derive_device_id(backend: object) -> str | None:
    """The device id of ``backend`` (see the module docstring); ``None`` if unknown.

    Any thread: it only reads the driver (``cuDeviceGetUuid``) or the host name.
    """
    for _ in range(_MAX_UNWRAP):
        if isinstance(backend, CudaBackend):
            try:
                return backend.device_uuid()
            except BackendError as exc:
                _log.warning(
                    "kvsidecar: cannot read the CUDA device's UUID (%s); the engine "
                    "registers on no device: set KVSIDECAR_DEVICE_ID",
                    exc,
                )
                return None
        if isinstance(backend, HostBackend):
            return host_device_id()
        wrapped = next(
            (getattr(backend, a) for a in _WRAPPED if getattr(backend, a, None) is not None), None
        )
        if wrapped is None:
            return None
        backend = wrapped
    return None
