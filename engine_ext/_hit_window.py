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

from collections import deque

__all__ = ["HIT_WINDOW_ADMISSIONS", "PrefixHitWindow"]

HIT_WINDOW_ADMISSIONS = 128


class PrefixHitWindow:
    """Hit and looked-up token counts of the last ``size`` admissions, summed in O(1).

    Owns a bounded deque of ``(hit, looked_up)`` pairs and their running sums.
    Invariant: the sums equal the deque's sums; ``0 <= hit <= looked_up`` per
    entry. Thread: the engine's scheduler thread only (no lock).
    """

    def __init__(self, size: int = HIT_WINDOW_ADMISSIONS) -> None:
        if size < 1:
            raise ValueError(f"the hit-rate window needs at least one admission, got {size}")
        self._entries: deque[tuple[int, int]] = deque()
        self._size = size
        self._hit = 0
        self._looked_up = 0
        self.changes = 0  # admissions recorded so far: a cheap "did the rate move" key

    def record(self, hit_tokens: int, looked_up_tokens: int) -> None:
        """One admission: ``hit_tokens`` of its ``looked_up_tokens`` came from the cache."""
        looked_up = max(0, int(looked_up_tokens))
        hit = min(max(0, int(hit_tokens)), looked_up)
        if looked_up == 0:
            return  # nothing was looked up: no information
        if len(self._entries) == self._size:
            old_hit, old_looked_up = self._entries.popleft()
            self._hit -= old_hit
            self._looked_up -= old_looked_up
        self._entries.append((hit, looked_up))
        self._hit += hit
        self._looked_up += looked_up
        self.changes += 1

    @property
    def rate(self) -> float | None:
        """Hit tokens / looked-up tokens over the window; ``None`` before any admission."""
        if self._looked_up == 0:
            return None
        return self._hit / self._looked_up

    def __len__(self) -> int:
        return len(self._entries)
