"""Output reservation at admission (``KVSIDECAR_RESERVE_OUTPUT=1``; docs/limits.md).

vLLM admits a request on its prompt alone; its output then grows block by
block, and a limit never preempts a running request (the liveness rule). So
with a decode-heavy load an engine ends above its limit, and on a budgeted
device (the autopilot) the sum of the engines' memory above the budget.

With the reservation on, an admission under a limit must fit its whole life
(prompt + ``max_tokens`` of output, capped by ``max_model_len``) *and* what
the running requests may still add, in the headroom under the target.
Running requests then never need memory above the limit, and the status says
``applied`` only once the running requests' remaining growth fits under the
limit too (:meth:`VllmRuntime._demand` reports the shortfall).

Costs: one pass over the running requests per scheduler step that tries an
admission under a limit, and per safe point while a limit is set (O(running),
only with the reservation on).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["OutputReservation"]


class OutputReservation:
    """Counts the blocks requests may still allocate over their lives. Busy-loop thread only.

    Keeps no per-request state: what a running request may still add is
    recomputed from its token counts and the blocks it holds, so aborts,
    preemptions and finished requests need no bookkeeping here.
    """

    def __init__(self, block_tokens: int, max_model_len: int) -> None:
        self.block_tokens = block_tokens
        self.max_model_len = max_model_len
        self._outstanding = -1  # blocks the running requests may still add (-1: not counted)

    def final_blocks(self, request: Any) -> int:
        """Blocks ``request`` holds at the end of its life (prompt + all of its output)."""
        tokens = min(int(request.num_prompt_tokens) + int(request.max_tokens), self.max_model_len)
        return -(-max(tokens, int(request.num_tokens)) // self.block_tokens)

    def remaining(self, requests: Iterable[Any], held: dict[str, Any]) -> int:
        """Blocks ``requests`` may still allocate; ``held`` maps request id -> its blocks."""
        total = 0
        for request in requests:
            more = self.final_blocks(request) - len(held.get(request.request_id, ()))
            if more > 0:
                total += more
        return total

    # -- one scheduler step -------------------------------------------------------------
    def begin_step(self) -> None:
        """Top of ``schedule()``: the running requests' growth is counted again when needed."""
        self._outstanding = -1

    def outstanding(self, running: Iterable[Any], held: dict[str, Any]) -> int:
        """The running requests' growth, counted once per step (then kept up to date)."""
        if self._outstanding < 0:
            self._outstanding = self.remaining(running, held)
        return self._outstanding

    def admitted(self, request: Any, held_now: int) -> None:
        """An admission succeeded in this step: its growth joins the running requests'."""
        if self._outstanding >= 0:
            self._outstanding += max(0, self.final_blocks(request) - held_now)

    def admission_blocks(self, request: Any, computed_tokens: int) -> int:
        """New blocks an admission needs over its life, beyond ``computed_tokens`` already
        backed (its prefix hits and what it computed before)."""
        return max(0, self.final_blocks(request) - computed_tokens // self.block_tokens)
