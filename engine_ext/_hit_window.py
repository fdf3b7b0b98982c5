"""``prefix_hit_rate``: the share of looked-up prompt tokens the prefix cache served.

Definition (docs/limits.md, "Demand fields"): over the last
:data:`HIT_WINDOW_ADMISSIONS` admissions (a request the engine started, or
restarted after a preemption), the tokens its prefix cache already held
divided by the tokens that were looked up (the request's whole sequence at
admission). ``None`` until the first admission. Both adapters feed it at the
point where an admission is granted (vLLM: a successful ``allocate_slots``
for a non-running request; SGLang: an accepted ``check_prefill``).
"""

from __future__ import annotations

__all__ = ["HIT_WINDOW_ADMISSIONS", "PrefixHitWindow"]

HIT_WINDOW_ADMISSIONS = 128


class PrefixHitWindow:
    """Hit and looked-up token counts of the last ``size`` admissions, summed in O(1).

    Owns a ring of ``size`` slots per count (unused slots hold 0) and their running
    sums. Invariant: the sums equal the ring's sums; ``0 <= hit <= looked_up`` per
    slot. Thread: the engine's scheduler thread only (no lock). :meth:`record` runs
    at every admission, so it is a handful of int operations.
    """

    def __init__(self, size: int = HIT_WINDOW_ADMISSIONS) -> None:
        if size < 1:
            raise ValueError(f"the hit-rate window needs at least one admission, got {size}")
        self._hit_ring = [0] * size
        self._looked_up_ring = [0] * size
        self._size = size
        self._next = 0  # the slot the next admission overwrites (the oldest once full)
        self._hit = 0
        self._looked_up = 0
        self.changes = 0  # admissions recorded so far: a cheap "did the rate move" key

    def record(self, hit_tokens: int, looked_up_tokens: int) -> None:
        """One admission: ``hit_tokens`` of its ``looked_up_tokens`` came from the cache
        (ints; a hit count outside ``0..looked_up_tokens`` is clamped)."""
        if looked_up_tokens <= 0:
            return  # nothing was looked up: no information
        if not 0 <= hit_tokens <= looked_up_tokens:
            hit_tokens = 0 if hit_tokens < 0 else looked_up_tokens
        i = self._next
        hits, looked = self._hit_ring, self._looked_up_ring
        self._hit += hit_tokens - hits[i]
        self._looked_up += looked_up_tokens - looked[i]
        hits[i] = hit_tokens
        looked[i] = looked_up_tokens
        self._next = (i + 1) % self._size
        self.changes += 1

    @property
    def rate(self) -> float | None:
        """Hit tokens / looked-up tokens over the window; ``None`` before any admission."""
        if self._looked_up == 0:
            return None
        return self._hit / self._looked_up

    def __len__(self) -> int:
        """Admissions in the window (at most ``size``)."""
        return min(self.changes, self._size)
