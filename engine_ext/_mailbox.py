"""The limit mailbox: where any thread publishes a target and the engine takes it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ._errors import EngineExtContractError
from .protocol import (
    MAX_LIMIT_BYTES,
    DeferReason,
    EngineState,
    RevisionOutcome,
    Status,
    judge_revision,
)

__all__ = ["LimitMailbox", "PublishResult", "Target"]

_log = logging.getLogger("engine_ext.mailbox")


@dataclass(frozen=True, slots=True)
class Target:
    """A desired limit and the revision that set it."""

    limit_bytes: int | None  # None = unlimited
    revision: int  # 0 = nothing published yet


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What :meth:`LimitMailbox.publish` did, in the status vocabulary."""

    accepted: bool  # False for stale/conflict: nothing changed
    status: Status  # deferred / applied for accepted, stale / conflict otherwise
    revision: int  # the revision that now rules (the rejected one is in ``message``)
    state: EngineState  # the state to show the caller (status and message filled in)
    message: str | None = None  # why a publish was rejected, for a person


class LimitMailbox:
    """Hands limit targets from any thread to the engine thread.

    Owns the desired :class:`Target` (newest accepted revision), the one target
    the engine has not taken yet, and the latest :class:`EngineState` snapshot
    written by the engine thread. Every method is O(1).

    Threads: :meth:`publish`, :meth:`publish_next`, :attr:`desired`,
    :attr:`revision` and :attr:`latest_state` from any thread;
    :meth:`take` and :meth:`set_state` from the engine thread only (one
    consumer). Publishing never touches the allocator: it stores the target,
    calls the wake callback and returns.

    Invariants: ``desired.revision`` only grows; a target is returned by
    :meth:`take` at most once, and a take never returns a target older than
    one it returned before.
    """

    def __init__(self, wake: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._wake = wake
        self._desired = Target(None, 0)
        self._untaken: Target | None = None  # newest accepted target the engine has not taken
        self._state = EngineState(status=Status.APPLIED)

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Set the callback that wakes the engine thread after a publish."""
        self._wake = wake

    @property
    def desired(self) -> Target:
        """The newest accepted target (``revision`` 0: none yet)."""
        return self._desired

    @property
    def revision(self) -> int:
        """The newest accepted revision (0: none yet)."""
        return self._desired.revision

    @property
    def latest_state(self) -> EngineState:
        """The engine's latest state snapshot (read-only; replaced, never mutated)."""
        return self._state

    @property
    def has_untaken(self) -> bool:
        """Whether a published target waits for the engine (lock-free read)."""
        return self._untaken is not None

    def set_state(self, state: EngineState) -> None:
        """Engine thread: publish a new snapshot (an atomic reference swap)."""
        self._state = state

    def publish(self, limit_bytes: int | None, revision: int) -> PublishResult:
        """Offer ``limit_bytes`` at ``revision``; returns at once, never evicts.

        An older revision is ``stale`` and the same revision with another
        limit is a ``conflict``: both are rejected and change nothing. The same
        revision with the same limit is accepted again (idempotent retry).
        """
        _check_limit(limit_bytes)
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise EngineExtContractError(f"revision must be an integer >= 1; got {revision!r}")
        with self._lock:
            result = self._publish_locked(limit_bytes, revision)
        if result.accepted and result.status is Status.DEFERRED:
            self._call_wake()
        return result

    def publish_next(self, limit_bytes: int | None) -> PublishResult:
        """Publish at the next revision, taken atomically (in-process callers)."""
        _check_limit(limit_bytes)
        with self._lock:
            result = self._publish_locked(limit_bytes, None)
        self._call_wake()
        return result

    def take(self) -> Target | None:
        """Engine thread: the newest target not taken yet, once; else None."""
        if self._untaken is None:  # fast path: a plain reference read, no lock
            return None
        with self._lock:
            target, self._untaken = self._untaken, None
        return target

    def _publish_locked(self, limit_bytes: int | None, revision: int | None) -> PublishResult:
        """The revision rule of the contract (``judge_revision``); None: the next revision."""
        current = self._desired
        verdict = judge_revision(
            current.limit_bytes,
            current.revision,
            limit_bytes,
            revision,
            exhausted_fix="restart the engine to start its revisions again",
        )
        if verdict.status is not None:
            return self._rejected(verdict.status, verdict.message or verdict.status.value)
        if verdict.outcome is RevisionOutcome.REPEAT:
            return self._repeat()
        self._desired = self._untaken = Target(limit_bytes, verdict.revision)
        return PublishResult(True, Status.DEFERRED, verdict.revision, self._pending_state())

    def _rejected(self, status: Status, message: str) -> PublishResult:
        state = self._state.model_copy(update={"status": status, "message": message})
        return PublishResult(False, status, self._desired.revision, state, message)

    def _repeat(self) -> PublishResult:
        """The same revision and limit again: report where it stands."""
        if self._untaken is None and self._state.revision == self._desired.revision:
            state = self._state
        else:
            state = self._pending_state()
        return PublishResult(True, state.status, self._desired.revision, state)

    def _pending_state(self) -> EngineState:
        """The snapshot, re-labelled for a target the engine has not taken yet."""
        target = self._desired
        mapped = self._state.mapped_bytes
        # what the engine will work towards: the limit, or the floor it can never give back
        effective = (
            None if target.limit_bytes is None else max(target.limit_bytes, self._state.floor_bytes)
        )
        over = 0 if effective is None else max(0, mapped - effective)
        return self._state.model_copy(
            update={
                "status": Status.DEFERRED,
                "revision": target.revision,
                "limit_bytes": target.limit_bytes,
                "effective_limit_bytes": effective,
                "overage_bytes": over,
                "reason": DeferReason.ENGINE_PASS.value,
                "message": None,
            }
        )

    def _call_wake(self) -> None:
        wake = self._wake
        if wake is None:
            return
        try:
            wake()
        except Exception:  # noqa: BLE001 -- last resort: a broken wake must not fail the publish
            _log.exception("the engine wake callback failed; the limit waits for the next pass")


def _check_limit(limit_bytes: int | None) -> None:
    if limit_bytes is None:
        return
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int):
        raise EngineExtContractError(f"limit must be a byte count or None; got {limit_bytes!r}")
    if not 0 <= limit_bytes <= MAX_LIMIT_BYTES:
        raise EngineExtContractError(
            f"limit must be between 0 and {MAX_LIMIT_BYTES} bytes; got {limit_bytes}"
        )
