"""The rank barrier hook: how TP/PP ranks confirm their unmaps (optional)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from .protocol import RankState

__all__ = ["BarrierOutcome", "BarrierResult", "RankBarrier"]


class BarrierOutcome(Enum):
    """How the barrier of one pass ended."""

    CONFIRMED = "confirmed"  # every rank finished the step and acknowledged its unmaps
    TIMEOUT = "rank_timeout"  # a rank did not answer in time; status stays deferred
    FAILED = "rank_failed"  # a rank is dead or reported an error; status stays deferred


@dataclass(frozen=True, slots=True)
class BarrierResult:
    """The barrier's answer: outcome plus what each rank measured it maps."""

    outcome: BarrierOutcome
    ranks: tuple[RankState, ...] = ()  # per-rank measured mapped bytes (empty: local only)


class RankBarrier(Protocol):
    """Implemented by the TP/PP layer; called by the coordinator on the engine thread.

    ``sync()`` runs after a pass that may have unmapped pages: it returns once
    every rank has finished the current step and applied the same unmaps (or
    when its own timeout expires), with each rank's measured mapped bytes.
    The coordinator reports ``applied`` only after a ``CONFIRMED`` result.
    """

    def sync(self) -> BarrierResult: ...

    @property
    def epoch(self) -> int:
        """Changes whenever a rank's liveness changes (a rank died). Cheap: read on every
        idle pass, so a rank that dies while nothing is pending is still reported."""
        ...

    @property
    def in_flight(self) -> bool:
        """Unmaps not every rank acknowledged yet (O(1); read on every pass). A free
        outside a pass unmaps a page in the scheduler's view at once; the ranks' views
        and the memory follow only after ``sync()``, so until then nothing is applied."""
        ...
