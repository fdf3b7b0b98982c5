"""kvsidecar's control plane: the HTTP service that holds desired KV limits.

Public surface: the app factory, its settings and its error hierarchy. The
CLIs live in :mod:`sidecar.cli` (``kvsidecar``) and :mod:`sidecar.kvctl`.
"""

from ._app import create_app
from ._errors import (
    InvalidInputError,
    RequestError,
    RevisionRejectedError,
    SidecarConfigError,
    SidecarError,
    StoreError,
    UnauthorizedError,
    UnknownInstanceError,
)
from ._models import DesiredLimit, EngineInfo, InstanceList, InstanceView, Problem
from ._settings import SidecarSettings, default_db_path

__all__ = [
    "DesiredLimit",
    "EngineInfo",
    "InstanceList",
    "InstanceView",
    "InvalidInputError",
    "Problem",
    "RequestError",
    "RevisionRejectedError",
    "SidecarConfigError",
    "SidecarError",
    "SidecarSettings",
    "StoreError",
    "UnauthorizedError",
    "UnknownInstanceError",
    "create_app",
    "default_db_path",
]
