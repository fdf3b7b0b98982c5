"""The one revision rule (docs/design.md, "revision"), used by the sidecar's store and
the engine's mailbox alike: a pure function, no I/O, no locks."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ._status import Status

__all__ = [
    "MAX_CLIENT_REVISION",
    "MAX_REVISION",
    "RevisionOutcome",
    "RevisionVerdict",
    "judge_revision",
]

#: Largest revision accepted anywhere (fits SQLite's signed 64-bit integers with room to grow).
MAX_REVISION = 1 << 62

#: Largest revision a client may name (PUT with ``revision``): 2^53, what every JSON
#: client reads exactly. The range above it is left to revisions the sidecar and the
#: engine take themselves (current + 1), so a client-named revision can never use up
#: the space: 2^62 - 2^53 increments remain after the largest one.
MAX_CLIENT_REVISION = 1 << 53


class RevisionOutcome(str, Enum):
    """What a limit request at some revision does to the held (limit, revision)."""

    NEW = "new"  # a newer revision: it rules from now on
    REPEAT = "repeat"  # the current revision with the same limit: an idempotent retry
    STALE = "stale"  # rejected: older than the current revision
    CONFLICT = "conflict"  # rejected: the current revision with another limit, or past the bound


@dataclass(frozen=True, slots=True)
class RevisionVerdict:
    """The answer of :func:`judge_revision`."""

    outcome: RevisionOutcome
    revision: int  # the revision that rules after the request (the current one if rejected)
    message: str | None = None  # why it was rejected, for a person (None when accepted)

    @property
    def accepted(self) -> bool:
        return self.outcome in (RevisionOutcome.NEW, RevisionOutcome.REPEAT)

    @property
    def status(self) -> Status | None:
        """``stale`` or ``conflict`` for a rejection (the status vocabulary); else None."""
        return None if self.accepted else Status(self.outcome.value)


def judge_revision(
    current_limit: int | None,
    current_revision: int,
    limit: int | None,
    revision: int | None,
    *,
    exhausted_fix: str,
) -> RevisionVerdict:
    """Judge a request for ``limit`` at ``revision`` against what is held.

    No revision takes the next one (``current + 1``). A revision above
    :data:`MAX_REVISION` is a ``conflict`` (``exhausted_fix`` says what to do:
    the way to start revisions again differs per side). A newer revision is
    accepted. The current one with the same limit is an idempotent repeat;
    with another limit it is a ``conflict``. An older one is ``stale``.
    """
    if revision is None:
        if current_revision >= MAX_REVISION:  # never hold what no one can read back
            return RevisionVerdict(
                RevisionOutcome.CONFLICT,
                current_revision,
                f"revision {current_revision} is the largest revision ({MAX_REVISION}); "
                f"{exhausted_fix}",
            )
        return RevisionVerdict(RevisionOutcome.NEW, current_revision + 1)
    if revision > MAX_REVISION:
        return RevisionVerdict(
            RevisionOutcome.CONFLICT,
            current_revision,
            f"revision {revision} is above the largest revision {MAX_REVISION}; {exhausted_fix}",
        )
    if revision > current_revision:
        return RevisionVerdict(RevisionOutcome.NEW, revision)
    if revision == current_revision and limit == current_limit:
        return RevisionVerdict(RevisionOutcome.REPEAT, revision)
    if revision == current_revision:
        return RevisionVerdict(
            RevisionOutcome.CONFLICT,
            current_revision,
            f"revision {revision} already set limit {current_limit!r}; send a revision above "
            f"{current_revision}, or none to take the next one",
        )
    return RevisionVerdict(
        RevisionOutcome.STALE,
        current_revision,
        f"revision {revision} is older than the current revision {current_revision}; send a "
        f"revision above {current_revision}, or none to take the next one",
    )
