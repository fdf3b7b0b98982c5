"""Revision rules for a desired limit (docs/design.md, "revision"): the contract's one rule
(``engine_ext.protocol.judge_revision``), in the sidecar's terms."""

from __future__ import annotations

from dataclasses import dataclass

from engine_ext.protocol import RevisionOutcome, judge_revision

from ._errors import RevisionRejectedError

__all__ = ["Decision", "decide"]

#: How an operator starts revisions again once they reach the bound.
_EXHAUSTED_FIX = (
    "forget the instance (kvctl forget ID, or DELETE /instances/ID) and restart "
    "its engine to start again"
)


@dataclass(frozen=True, slots=True)
class Decision:
    """What a limit request does to the stored desired state."""

    revision: int  # the revision that rules after the request
    changed: bool  # False: an idempotent repeat, nothing to write


def decide(
    current_limit: int | None, current_revision: int, limit: int | None, revision: int | None
) -> Decision:
    """Apply the revision rule; raise :class:`RevisionRejectedError` to change nothing.

    No revision: the next one is taken. A newer one is accepted. The current
    one with the same limit is an idempotent repeat; with another limit it is
    a ``conflict``. An older one is ``stale``.
    """
    verdict = judge_revision(
        current_limit, current_revision, limit, revision, exhausted_fix=_EXHAUSTED_FIX
    )
    if verdict.status is not None:
        raise RevisionRejectedError(
            verdict.status, verdict.message or verdict.status.value, current_revision, current_limit
        )
    return Decision(verdict.revision, verdict.outcome is RevisionOutcome.NEW)
