"""Consistency rules for what an engine reports (pure functions).

A report is taken as the engine's truth only if it agrees with itself and
with the desired limit it claims to hold; anything else is a bug or a forgery,
and is rejected (422) without changing the instance.
"""

from __future__ import annotations

from engine_ext.protocol import EngineState, Status

__all__ = ["report_problem"]


def report_problem(
    state: EngineState, desired_limit: int | None, desired_revision: int
) -> str | None:
    """Why ``state`` cannot be true (one sentence), or None when it is consistent."""
    limit, effective = state.limit_bytes, state.effective_limit_bytes
    numbers = [r.rank for r in state.ranks]
    if len(set(numbers)) != len(numbers):
        return "ranks lists a rank number twice"
    if len(numbers) > state.num_ranks:
        return f"ranks lists {len(numbers)} ranks but num_ranks is {state.num_ranks}"
    if state.capacity_bytes and state.floor_bytes > state.capacity_bytes:
        # the floor is pages of the pool (vLLM's null block): a floor above the pool would
        # take the whole budget of its device from the others (docs/autopilot.md)
        return (
            f"floor_bytes {state.floor_bytes} exceeds capacity_bytes {state.capacity_bytes} "
            "(the floor is part of the pool)"
        )
    top = max((r.mapped_bytes for r in state.ranks), default=0)
    if state.mapped_bytes < top:
        return (
            f"mapped_bytes {state.mapped_bytes} is below a rank's mapped bytes {top} "
            "(it is the largest rank's)"
        )
    # With the output reservation the overage also counts what the running requests' output
    # will add beyond the limit (reserved_bytes, rounded up to whole page bundles): a request
    # holding one page with its output still to come may be over by more than it maps.
    grows = state.reserved_bytes + state.page_bundle_bytes if state.reserved_bytes else 0
    if state.overage_bytes > state.mapped_bytes + grows:
        if not grows:
            return f"overage_bytes {state.overage_bytes} exceeds mapped_bytes {state.mapped_bytes}"
        return (
            f"overage_bytes {state.overage_bytes} exceeds mapped_bytes + reserved_bytes + "
            f"one page bundle ({state.mapped_bytes + grows})"
        )
    if state.status is not Status.APPLIED:
        return None  # a deferred reply may carry the previous pass's effective limit
    if limit is not None and effective is not None and effective < limit:
        return (
            f"status applied with effective_limit_bytes {effective} below limit_bytes "
            f"{limit} (the effective limit is max(limit, floor))"
        )
    if limit is None and effective is not None:
        return "status applied with effective_limit_bytes set but limit_bytes null (unlimited)"
    target = effective if effective is not None else limit
    if target is not None and state.mapped_bytes > target:
        return (
            f"status applied with mapped_bytes {state.mapped_bytes} above the effective "
            f"limit {target}"
        )
    if state.overage_bytes:
        return f"status applied with overage_bytes {state.overage_bytes}"
    dead = [r.rank for r in state.ranks if not r.alive]
    if dead:
        return f"status applied while rank(s) {dead} are dead (applied needs every rank)"
    if (
        state.revision == desired_revision != 0
        and state.limit_bytes == desired_limit
        and desired_limit is not None
        and state.mapped_bytes > max(desired_limit, state.floor_bytes)
    ):
        return (
            f"status applied with mapped_bytes {state.mapped_bytes} above the desired "
            f"limit {desired_limit} (floor {state.floor_bytes})"
        )
    return None
