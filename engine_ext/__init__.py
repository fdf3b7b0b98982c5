"""Engine-agnostic core of the engine extension (docs/design.md; where things live: docs/architecture.md).

Any thread *publishes* a limit into the :class:`LimitMailbox`; only the engine
thread *applies* it, in :meth:`ShrinkCoordinator.step`, by evicting whole
prefix-cache pages through :class:`Reclaimer` s until the pool fits.
:class:`ControlServer` (unix socket) and :class:`SidecarClient` (HTTP) feed
the mailbox; :class:`ElasticInstance` wires them for an engine adapter.
Imports :mod:`allocator` for typing only, and no engine.
"""

from ._barrier import BarrierOutcome, BarrierResult, RankBarrier
from ._control import MAX_BODY_BYTES, ControlServer
from ._coordinator import CoordinatorConfig, Demand, DemandProbe, ShrinkCoordinator
from ._errors import EngineExtConfigError, EngineExtContractError, EngineExtError
from ._instance import ElasticInstance, EngineBinding
from ._mailbox import LimitMailbox, PublishResult, Target
from ._reasons import DeferReason, WaitReason
from ._reclaim import (
    BlockView,
    Reclaimer,
    VictimPage,
    count_reclaimable_pages,
    select_victim_pages,
)
from ._settings import EngineSettings, load_engine_settings
from ._sidecar_client import SidecarClient

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
