"""Revision rules for a desired limit (docs/design.md, "revision"): pure functions."""

from __future__ import annotations

from dataclasses import dataclass

from engine_ext.protocol import MAX_REVISION, Status

from ._errors import RevisionRejectedError

__all__ = ["Decision", "decide"]


@dataclass(frozen=True, slots=True)
class Decision:
    """What a limit request does to the stored desired state."""

    revision: int  # the revision that rules after the request
    changed: bool  # False: an idempotent repeat, nothing to write


def decide(current_limit: int | None, current_revision: int, limit: int | None,
           revision: int | None) -> Decision:
    """Apply the revision rules; raise :class:`RevisionRejectedError` to change nothing.

    No revision: the next one is taken. A newer one is accepted. The current
    one with the same limit is an idempotent repeat; with another limit it is
    a ``conflict``. An older one is ``stale``.
    """
    if revision is None:
        if current_revision >= MAX_REVISION:  # never store what no one can read back
            raise RevisionRejectedError(
                Status.CONFLICT,
                f"revision {current_revision} is the largest revision ({MAX_REVISION}); "
                "forget the instance (kvctl forget ID, or DELETE /instances/ID) and restart "
                "its engine to start again", current_revision, current_limit)
        return Decision(current_revision + 1, True)
    if revision > current_revision:
        return Decision(revision, True)
    if revision == current_revision and limit == current_limit:
        return Decision(revision, False)
    if revision == current_revision:
        raise RevisionRejectedError(
            Status.CONFLICT,
            f"revision {revision} already set limit {current_limit!r}; send a revision above "
            f"{current_revision}, or none to take the next one",
            current_revision, current_limit,
        )
    raise RevisionRejectedError(
        Status.STALE,
        f"revision {revision} is older than the current revision {current_revision}; send a "
        f"revision above {current_revision}, or none to take the next one",
        current_revision, current_limit,
    )
