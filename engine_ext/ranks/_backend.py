"""``RankedBackend``: the scheduler's backend when every TP/PP rank maps its own view.

The scheduler process owns the memfd (:class:`allocator.HostBackend`) and its
own view; each rank attached the same memfd into a reservation of its own.
The allocator above keeps calling ``map``/``unmap`` as with one process; this
backend makes that hold for every rank:

* ``map``: sent to the ranks first; the owner commits and maps while they
  map theirs, then it waits for every ack and returns -- a page is never
  handed to a request before every rank maps it.
  A rank that is dead or does not ack within ``map_timeout_s`` raises
  :class:`allocator.BackendError` (the engine cannot run a step without it).
* ``unmap``: tagged with the last step handed to the ranks; collected and
  sent as one message with the next op to the ranks (same ``send``) or at
  the barrier, never waited for. The page leaves the scheduler's view (``is_mapped`` is
  False, the allocator may reuse it) but its memory stays committed in the
  owner until *every* rank acked: only then is it punched out, so
  ``mapped_bytes`` counts it until then.
* :meth:`settle` (the barrier, one bounded wait per pass) completes the
  acknowledged unmaps and says whether everything is confirmed.

Re-mapping a page whose unmap is still in flight cancels the owner's side of
that unmap (its memory was never returned) and sends ``map`` after the
``unmap`` on the same ordered channel, so every rank ends up mapping it.

Thread: the engine thread only (like every backend).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from allocator import AllocatorContractError, BackendError, HostBackend, PageLayout
from engine_ext._barrier import BarrierOutcome, BarrierResult

from ._group import RankGroup
from ._wire import RankChannelError

__all__ = ["RankChannelBarrier", "RankedBackend"]


class RankedBackend:
    """Owner memfd + rank views kept in step. Owns the group and the owner backend."""

    layout: PageLayout
    base_address: int

    def __init__(
        self, owner: HostBackend, group: RankGroup, *, map_timeout_s: float = 60.0
    ) -> None:
        self.owner = owner
        self.group = group
        self.layout = owner.layout
        self.base_address = owner.base_address
        self.map_timeout_s = map_timeout_s
        self._pending: dict[int, list[int]] = {}  # unmap seq -> pages sent with it
        self._page_seq: dict[int, int] = {}  # page -> seq of its in-flight unmap
        self._outbox: list[int] = []  # unmapped by the allocator, not yet sent
        self._outbox_step = -1  # the step those pages were freed after
        memfd = os.stat(owner.fd_path)  # the ranks' views are checked against it by identity
        self._memfd = (memfd.st_dev, memfd.st_ino)
        group.set_flush(self.flush)

    @classmethod
    def start(
        cls,
        owner: HostBackend,
        group: RankGroup,
        *,
        tp: int,
        pp: int,
        block_bytes: int,
        slot_bytes: int,
        timeout_s: float = 60.0,
    ) -> RankedBackend:
        """Send every rank the set-up (attach ``owner``'s memfd, its TP/PP place) and wait."""
        if tp < 1 or pp < 1 or tp * pp != group.world_size:
            raise ValueError(f"tp={tp} x pp={pp} must equal the {group.world_size} ranks started")
        if owner.mapped_pages():
            raise AllocatorContractError("attach the ranks before mapping any page")
        layout = owner.layout
        try:
            group.call(
                "setup",
                timeout_s,
                fd_path=owner.fd_path,
                tp=tp,
                pp=pp,
                layout={
                    "page_bytes": layout.page_bytes,
                    "num_pages": layout.num_pages,
                    "num_regions": layout.num_regions,
                },
                geometry={"block_bytes": block_bytes, "slot_bytes": slot_bytes},
            )
        except RankChannelError as exc:
            raise BackendError(f"the ranks could not attach the KV memory: {exc}") from exc
        return cls(owner, group, map_timeout_s=timeout_s)

    # -- Backend ---------------------------------------------------------------------------
    def map(self, page: int) -> None:
        self.map_many([page])

    def unmap(self, page: int) -> None:
        self.unmap_many([page])

    def map_many(self, pages: Sequence[int]) -> None:
        pages = list(pages)
        for page in pages:
            if self.is_mapped(page) and page not in self._outbox:
                raise AllocatorContractError(f"page {page} is already mapped")
        if len(set(pages)) != len(pages):
            raise AllocatorContractError(f"map_many got a page twice: {sorted(pages)}")
        if self._outbox:
            unsent = set(pages).intersection(self._outbox)
            if unsent:  # unmapped and re-mapped before the unmap went out: nothing to tell
                self._outbox = [p for p in self._outbox if p not in unsent]
                pages = [p for p in pages if p not in unsent]
                if not pages:
                    return
        if self._page_seq:
            revived = [p for p in pages if p in self._page_seq]
            fresh = [p for p in pages if p not in self._page_seq]
        else:  # no unmap in flight (the usual case)
            revived, fresh = [], pages
        self.flush()  # the pass's unmaps leave in the same send, before the map
        seq = self.group.broadcast("map", pages=pages)
        try:  # the owner commits while the ranks map (nobody touches the pages before the acks)
            self.owner.map_many(fresh)
        except BackendError:
            self._undo(pages, owned=revived)  # the owner rolled its own commits back
            raise
        for page in revived:
            del self._page_seq[page]  # the owner never gave its memory back
        outcome = self.group.wait(seq, self.map_timeout_s)
        if outcome is not BarrierOutcome.CONFIRMED:
            self._undo(pages, owned=pages)
            raise BackendError(
                f"mapping pages {pages} on every rank failed: {self.group.describe(outcome)}",
                fatal=outcome is BarrierOutcome.FAILED,  # a dead rank: no retry can succeed
            )

    def _undo(self, pages: list[int], *, owned: list[int]) -> None:
        """Roll a broadcast ``map`` of ``pages`` back on every rank.

        The ranks that mapped unmap again (in order, after the map); the owner
        gives the memory of ``owned`` (the pages it maps now) back once every
        live rank acked (settle).
        """
        undo = self.group.broadcast("unmap", pages=pages, after_step=self.group.step)
        self._pending[undo] = owned
        for page in owned:
            self._page_seq[page] = undo
        self.group.watch(undo)

    def unmap_many(self, pages: Sequence[int]) -> None:
        pages = list(pages)
        for page in pages:
            if not self.is_mapped(page) or page in self._outbox:
                raise AllocatorContractError(f"page {page} is not mapped")
        if not pages:
            return
        if not self._outbox:
            self._outbox_step = self.group.step
        self._outbox.extend(pages)  # sent by flush(): one message per pass, not per page

    def flush(self) -> None:
        """Queue the unmaps collected since the last flush; they leave with the next op."""
        if not self._outbox:
            return
        pages, self._outbox = self._outbox, []
        seq = self.group.queue("unmap", pages=pages, after_step=self._outbox_step)
        self._pending[seq] = pages
        for page in pages:
            self._page_seq[page] = seq

    def is_mapped(self, page: int) -> bool:
        """The scheduler's view: mapped and no unmap in flight."""
        return (
            self.owner.is_mapped(page) and page not in self._page_seq and page not in self._outbox
        )

    def mapped_bytes(self) -> int:
        """Committed in the memfd (measured); includes pages whose unmap is not acked yet."""
        return self.owner.mapped_bytes()

    def release(self) -> None:
        """Stop the ranks, then release the owner (memfd, range). Idempotent."""
        self.group.close()
        self.owner.release()

    # -- the barrier -----------------------------------------------------------------------
    @property
    def unmaps_in_flight(self) -> int:
        """Pages unmapped by the allocator whose unmap not every rank acknowledged yet."""
        return len(self._page_seq) + len(self._outbox)

    def settle(self, wait_s: float) -> BarrierResult:
        """Wait at most ``wait_s`` for outstanding unmap acks; punch out what all ranks acked.

        ``CONFIRMED`` only when nothing is in flight and every rank is alive: the ranks'
        acks are taken at their word here (reading each rank's ``/proc/<pid>/maps`` costs
        ~0.5 ms a rank, per release; :meth:`probe` does it). With a dead rank, pages every *live* rank acked are still given back
        (the dead rank maps nothing any more), but the result stays ``FAILED``.
        """
        self.flush()
        if self._pending:
            self.group.wait(max(self._pending), wait_s)
        acked = self.group.acked_by_all()
        for seq in sorted(self._pending):
            if seq > acked:
                break  # acks arrive in order: later seqs are not acked either
            done = [p for p in self._pending.pop(seq) if self._page_seq.get(p) == seq]
            for page in done:
                del self._page_seq[page]
            self.owner.unmap_many(done)
        if self._pending:  # the watcher reads the late acks and wakes the engine
            self.group.watch(max(self._pending))
        if self.group.any_dead():
            outcome = BarrierOutcome.FAILED
        elif self._pending or self._outbox:
            outcome = BarrierOutcome.TIMEOUT
        else:
            outcome = BarrierOutcome.CONFIRMED
        return BarrierResult(outcome, self.group.states())

    def probe(self, timeout_s: float) -> None:
        """Check every rank's view twice: each rank re-measures it from its own
        ``/proc/self/maps``, then this process reads each idle rank's ``/proc/<pid>/maps``
        (the kernel's list, not the rank's word) and compares it with what the rank acked.
        Raises if a rank is dead, slow, or its view disagrees (that rank is then dead)."""
        try:
            self.group.call("probe", timeout_s)
        except RankChannelError as exc:
            raise BackendError(str(exc)) from exc
        self.group.check_views(*self._memfd)
        if self.group.any_dead():
            raise BackendError(self.group.describe(BarrierOutcome.FAILED))


class RankChannelBarrier:
    """The :class:`engine_ext.RankBarrier` of a :class:`RankedBackend` (engine thread).

    ``sync()`` waits at most ``wait_s`` per pass, so a slow rank never holds
    the engine thread longer than that; the group wakes the engine when the
    awaited acks arrive (``set_wake``), and the next pass completes them.
    """

    def __init__(self, backend: RankedBackend, *, wait_s: float = 0.05) -> None:
        self.backend = backend
        self.wait_s = wait_s

    def set_wake(self, wake: object) -> None:
        """Wake the engine when a watched ack arrives or a rank dies (a callable)."""
        self.backend.group.set_wake(wake if callable(wake) else None)

    def sync(self) -> BarrierResult:
        return self.backend.settle(self.wait_s)

    @property
    def epoch(self) -> int:
        """Number of ranks that died so far (read without a lock: an int read is atomic)."""
        return self.backend.group.deaths

    @property
    def in_flight(self) -> bool:
        """Unmaps queued or sent that not every rank acknowledged yet."""
        return self.backend.unmaps_in_flight > 0
