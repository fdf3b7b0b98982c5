"""Device ordering for unmaps: a page goes only after the device work that may read it.

Kernels run asynchronously: when the scheduler frees a block, the forward
pass that read it may still be queued on the device, and unmapping its page
then is an illegal-address fault. One mechanism for every adapter:

* the adapter calls :meth:`UnmapFence.record` after it launched a forward
  pass (a device event on the stream its forwards run on: the current one, or
  the one :attr:`UnmapFence.stream` makes current);
* :class:`FencedBackend` calls :meth:`UnmapFence.wait` before every unmap
  and the release: it records the event again, on that stream, and waits for
  it. So an unmap waits for every forward launched so far, also one that no
  record followed: vLLM's batch queue (async scheduling) and SGLang's overlap
  loop launch a step and return before processing any output when they were
  idle, and an abort then frees that step's blocks before the next record.

Until the first :meth:`~UnmapFence.record`, :meth:`~UnmapFence.wait` falls back
to a device-wide synchronize: correct for an adapter that never records (and
for work on other streams before the first forward, such as a warm-up), only
slower.

Failures. A :meth:`~UnmapFence.record` that fails (making or recording the
event raised) never raises into the engine, which calls it at every step: the
work launched so far is behind no event, so the next wait synchronizes the
whole device instead, and the failure is logged (the first one, then at most
one line per :data:`RECORD_FAILURE_LOG_S`, with the count since). The same holds
for the record inside :meth:`~UnmapFence.wait`. A wait that fails (torch raises
``RuntimeError`` after a kernel fault) raises :class:`~allocator.BackendError`
with nothing unmapped, so the allocators book the pages as still mapped; the
next unmap waits again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from ._errors import BackendError

if TYPE_CHECKING:
    from ._backend import Backend
    from ._layout import PageLayout

__all__ = [
    "RECORD_FAILURE_LOG_S",
    "DeviceEvent",
    "FencedBackend",
    "UnmapFence",
    "torch_unmap_fence",
]

_log = logging.getLogger(__name__)

RECORD_FAILURE_LOG_S = 60.0  # at most one log line per this many seconds for failed records


class DeviceEvent(Protocol):
    """What the fence needs of an event (``torch.cuda.Event`` has both)."""

    def record(self) -> None:
        """Mark the point after the work queued so far on the current stream."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until that work has finished."""
        ...


class UnmapFence:
    """A device event on the forward stream, recorded and waited for before an unmap.

    Owns one reusable event. ``record`` and ``wait`` are called from the
    thread that owns the allocator (the engine's scheduler thread), never
    concurrently. ``stream``: None (the current stream), or a callable returning a
    context manager that makes the forward stream current (``torch.cuda.stream(s)``),
    set by an adapter whose forwards run on a stream of their own. Counters
    (``waits_on_event``, ``device_syncs``) are for tests and benchmarks;
    ``record_failures`` counts the records that failed.
    """

    stream: Callable[[], AbstractContextManager[Any]] | None = None

    def __init__(
        self, make_event: Callable[[], DeviceEvent], synchronize_device: Callable[[], None]
    ) -> None:
        self._make_event = make_event
        self._synchronize_device = synchronize_device
        self._event: DeviceEvent | None = None
        self._unrecorded = False  # a record failed: the next wait syncs the whole device
        self.waits_on_event = 0
        self.device_syncs = 0
        self.record_failures = 0
        self._logged_failures = 0  # record_failures when the last log line was written
        self._log_due = 0.0  # monotonic time from which the next failure is logged

    @property
    def recording(self) -> bool:
        """Whether the adapter has recorded at least once (no device-wide fallback any more)."""
        return self._event is not None

    def record(self) -> None:
        """After a forward pass was launched: later unmaps wait for it to finish.

        Never raises an ``Exception`` (see the module): a failure makes the next
        wait a whole-device synchronize, and is logged.
        """
        try:
            if self._event is None:
                self._event = self._make_event()
            self._record(self._event)
        except BaseException as exc:
            self._unrecorded = True  # the event may not cover the work launched so far
            if not isinstance(exc, Exception):
                raise
            self._record_failed(exc)

    def _record(self, event: DeviceEvent) -> None:
        if self.stream is None:
            event.record()
        else:
            with self.stream():
                event.record()

    def _record_failed(self, exc: Exception) -> None:
        self.record_failures += 1
        now = time.monotonic()
        if now < self._log_due:
            return
        failed = self.record_failures - self._logged_failures
        self._logged_failures, self._log_due = self.record_failures, now + RECORD_FAILURE_LOG_S
        _log.warning(
            "kvsidecar: recording the unmap fence's device event failed (%s; %d failure(s) "
            "since the last report): the next unmap waits for the whole device instead "
            "(slower, still safe). If it repeats, the device is in error (often a kernel "
            "fault): check the engine's log and restart the engine",
            exc,
            failed,
        )

    def wait(self) -> None:
        """Before an unmap: block until every forward launched so far finished (the event
        recorded again now, see the module; a device-wide sync before the first record
        or after a failed one).

        Raises :class:`BackendError` if the device reports a failure; nothing is
        considered waited for then (the next call waits again).
        """
        event = self._event
        if event is not None and not self._unrecorded:
            self.record()  # now: covers a launch that no record of the adapter followed
        try:
            if event is None or self._unrecorded:
                self.device_syncs += 1
                self._synchronize_device()
                self._unrecorded = False
            else:
                self.waits_on_event += 1
                event.synchronize()
        except RuntimeError as exc:  # torch: a CUDA error (sticky after a kernel fault)
            raise BackendError(
                f"waiting for the device before an unmap failed ({exc}); nothing was "
                "unmapped. The device reported an error (often a kernel fault, which "
                "poisons the process's CUDA context): restart the engine"
            ) from exc


class FencedBackend:
    """A backend whose unmaps (and release) wait on an :class:`UnmapFence` first.

    Owns nothing but the reference to ``inner`` and the fence; every other
    call passes through. Same thread rules as ``inner``.
    """

    layout: PageLayout
    base_address: int

    def __init__(self, inner: Backend, fence: UnmapFence) -> None:
        self.inner = inner
        self.fence = fence
        self.layout = inner.layout
        self.base_address = inner.base_address

    def map(self, page: int) -> None:
        self.inner.map(page)

    def map_many(self, pages: Sequence[int]) -> None:
        self.inner.map_many(pages)

    def unmap(self, page: int) -> None:
        self.unmap_many([page])

    def unmap_many(self, pages: Sequence[int]) -> None:
        if pages:
            self.fence.wait()
        self.inner.unmap_many(pages)

    def is_mapped(self, page: int) -> bool:
        return self.inner.is_mapped(page)

    def mapped_bytes(self) -> int:
        return self.inner.mapped_bytes()

    def trim_spares(self, keep_pages: int = 0) -> None:
        """Pass-through to a backend that keeps spare handles (CudaBackend)."""
        trim = getattr(self.inner, "trim_spares", None)
        if trim is not None:
            trim(keep_pages)

    def release(self) -> None:
        self.fence.wait()
        self.inner.release()


def torch_unmap_fence(device: object) -> UnmapFence:
    """A fence over ``torch.cuda.Event`` (current stream), falling back to a device sync."""
    import torch  # lazy: the allocator imports without torch

    def synchronize() -> None:
        torch.cuda.synchronize(device)

    def make_event() -> DeviceEvent:
        event: DeviceEvent = torch.cuda.Event()
        return event

    return UnmapFence(make_event, synchronize)
