"""Let SGLang's memory-cache modules import on a CPU-only machine.

``sglang.srt.configs`` (imported by ``memory_pool``, hence by every tree
cache and by the scheduler) imports ``torchvision.transforms`` at module
level for two vision configs. PyPI's torchvision wheels are built against
CUDA torch and fail to load next to the CPU torch build (``operator
torchvision::nms does not exist``), and no CPU wheel is reachable from these
machines. On such a machine only, :func:`prepare_cpu_imports` registers a
stand-in ``torchvision`` that provides the two names imported at module
level (``transforms``, ``InterpolationMode``) and raises a clear error on
any other use; nothing in the KV-cache path uses it. Where torchvision is
installed (every GPU machine) it does nothing.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["prepare_cpu_imports"]

_NAMES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def _missing(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def __getattr__(attr: str) -> object:
        raise AttributeError(
            f"{name}.{attr}: torchvision is not installed (kvsidecar's CPU stand-in only lets "
            "SGLang's config package import); install a torchvision that matches your torch"
        )

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def prepare_cpu_imports() -> bool:
    """Import ``sglang`` and, if torchvision is absent, register the stand-in.

    Returns True if the stand-in was registered. Idempotent.
    """
    import sglang  # noqa: F401 -- first: transformers decides torchvision is absent

    if "torchvision" in sys.modules:
        return getattr(sys.modules["torchvision"], "__file__", None) is None
    if importlib.util.find_spec("torchvision") is not None:
        return False
    modules = {name: _missing(name) for name in _NAMES}
    modules["torchvision.transforms.functional"].InterpolationMode = _InterpolationMode  # type: ignore[attr-defined]
    modules["torchvision.transforms"].InterpolationMode = _InterpolationMode  # type: ignore[attr-defined]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    modules["torchvision"].transforms = modules["torchvision.transforms"]  # type: ignore[attr-defined]
    sys.modules.update(modules)
    return True
