"""The one revision rule: the sidecar's store and the engine's mailbox judge every request
alike (fuzzed), because both call ``engine_ext.protocol.judge_revision``."""

from __future__ import annotations

import random

import pytest

from engine_ext import LimitMailbox
from engine_ext.protocol import MAX_REVISION, RevisionOutcome, Status, judge_revision
from sidecar._errors import RevisionRejectedError
from sidecar._revisions import decide

_LIMITS = [None, 0, 1 << 20, 2 << 20]


def _revisions(rng: random.Random, current: int) -> int | None:
    return rng.choice(
        [
            None,
            current,
            current + 1,
            max(1, current - 1),
            current + 7,
            rng.randint(1, 50),
            MAX_REVISION,
            MAX_REVISION + 1,
        ]
    )


def test_sidecar_and_mailbox_agree_on_every_request() -> None:
    rng = random.Random(15)
    for _ in range(3000):
        box = LimitMailbox(lambda: None)
        held_limit = rng.choice(_LIMITS)
        held = rng.choice([rng.randint(1, 40), MAX_REVISION - 1, MAX_REVISION])
        assert box.publish(held_limit, held).accepted
        limit, revision = rng.choice(_LIMITS), _revisions(rng, held)

        verdict = judge_revision(held_limit, held, limit, revision, exhausted_fix="fix")
        result = box.publish_next(limit) if revision is None else box.publish(limit, revision)
        try:
            decision = decide(held_limit, held, limit, revision)
        except RevisionRejectedError as exc:
            sidecar_status: Status | None = exc.status
            assert exc.current_revision == held and exc.current_limit == held_limit
        else:
            sidecar_status = None
            assert decision.revision == verdict.revision == result.revision
            assert decision.changed == (verdict.outcome is RevisionOutcome.NEW)

        assert result.accepted == verdict.accepted == (sidecar_status is None)
        assert sidecar_status == verdict.status
        if not result.accepted:
            assert result.status is verdict.status and result.message
            assert box.desired.revision == held and box.desired.limit_bytes == held_limit
        else:
            assert box.desired.revision == verdict.revision


@pytest.mark.parametrize(
    ("held", "revision", "outcome"),
    [
        (5, None, RevisionOutcome.NEW),
        (5, 6, RevisionOutcome.NEW),
        (5, 5, RevisionOutcome.REPEAT),
        (5, 4, RevisionOutcome.STALE),
        (MAX_REVISION, None, RevisionOutcome.CONFLICT),
        (0, MAX_REVISION + 1, RevisionOutcome.CONFLICT),
    ],
)
def test_the_rule_by_case(held: int, revision: int | None, outcome: RevisionOutcome) -> None:
    verdict = judge_revision(1 << 20, held, 1 << 20, revision, exhausted_fix="restart it")
    assert verdict.outcome is outcome
    assert (verdict.message is None) == verdict.accepted
    if outcome is RevisionOutcome.CONFLICT:
        assert "largest revision" in (verdict.message or "") and "restart it" in (
            verdict.message or ""
        )
    assert (
        judge_revision(1 << 20, 5, 2 << 20, 5, exhausted_fix="x").outcome
        is RevisionOutcome.CONFLICT
    )
