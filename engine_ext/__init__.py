"""Engine-agnostic core of the engine extension (docs/design.md; where things live: docs/architecture.md).

Any thread *publishes* a limit into the :class:`LimitMailbox`; only the engine
thread *applies* it, in :meth:`ShrinkCoordinator.step`, by evicting whole
prefix-cache pages through :class:`Reclaimer` s until the pool fits.
:class:`ControlServer` (unix socket) and :class:`SidecarClient` (HTTP) feed
the mailbox; :class:`ElasticInstance` wires them for an engine adapter.
Imports :mod:`allocator` for typing only, and no engine.

The names below load on first use (PEP 562), so ``import engine_ext.protocol`` (the
wire contract, which the sidecar imports) loads no core module and no allocator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._barrier import BarrierOutcome, BarrierResult, RankBarrier
    from ._control import MAX_BODY_BYTES, ControlServer
    from ._coordinator import CoordinatorConfig, Demand, DemandProbe, ShrinkCoordinator
    from ._errors import EngineExtConfigError, EngineExtContractError, EngineExtError
    from ._instance import ElasticInstance, EngineBinding
    from ._mailbox import LimitMailbox, PublishResult, Target
    from ._reclaim import (
        BlockView,
        Reclaimer,
        VictimPage,
        count_reclaimable_pages,
        select_victim_pages,
    )
    from ._settings import EngineSettings, load_engine_settings
    from ._sidecar_client import SidecarClient
    from .protocol import DeferReason, WaitReason

#: Where each exported name lives (relative module).
_EXPORTS: dict[str, str] = {
    "MAX_BODY_BYTES": "._control",
    "BarrierOutcome": "._barrier",
    "BarrierResult": "._barrier",
    "BlockView": "._reclaim",
    "ControlServer": "._control",
    "CoordinatorConfig": "._coordinator",
    "DeferReason": ".protocol",
    "Demand": "._coordinator",
    "DemandProbe": "._coordinator",
    "ElasticInstance": "._instance",
    "EngineBinding": "._instance",
    "EngineExtConfigError": "._errors",
    "EngineExtContractError": "._errors",
    "EngineExtError": "._errors",
    "EngineSettings": "._settings",
    "LimitMailbox": "._mailbox",
    "PublishResult": "._mailbox",
    "RankBarrier": "._barrier",
    "Reclaimer": "._reclaim",
    "ShrinkCoordinator": "._coordinator",
    "SidecarClient": "._sidecar_client",
    "Target": "._mailbox",
    "VictimPage": "._reclaim",
    "WaitReason": ".protocol",
    "count_reclaimable_pages": "._reclaim",
    "load_engine_settings": "._settings",
    "select_victim_pages": "._reclaim",
}

__all__ = [
    "MAX_BODY_BYTES",
    "BarrierOutcome",
    "BarrierResult",
    "BlockView",
    "ControlServer",
    "CoordinatorConfig",
    "DeferReason",
    "Demand",
    "DemandProbe",
    "ElasticInstance",
    "EngineBinding",
    "EngineExtConfigError",
    "EngineExtContractError",
    "EngineExtError",
    "EngineSettings",
    "LimitMailbox",
    "PublishResult",
    "RankBarrier",
    "Reclaimer",
    "ShrinkCoordinator",
    "SidecarClient",
    "Target",
    "VictimPage",
    "WaitReason",
    "count_reclaimable_pages",
    "load_engine_settings",
    "select_victim_pages",
]


def __getattr__(name: str) -> Any:
    """Load an exported name from its module on first use, then keep it here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
