"""A simulated device queue for the CPU: the unmap fence checked against work in flight.

On a GPU, a forward pass (a vLLM step, an SGLang batch) runs after the scheduler
launched it and returned; unmapping a page that it still reads or writes is an
illegal-address fault. :class:`SimDevice` keeps every launched step "in flight"
until the engine waits for it (its output, or the fence's event), and
:class:`CheckedBackend` records every unmap of a page an in-flight step touches
as a violation. :func:`fenced` wraps a host backend as the GPU path wraps a
``CudaBackend`` (``FencedBackend`` over an ``UnmapFence``), with the fence's event
on this device (:func:`device_fence`). Used by the vLLM async-scheduling tests and the SGLang overlap-loop
tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from allocator import FencedBackend, UnmapFence

__all__ = ["CheckedBackend", "SimDevice", "SimEvent", "device_fence", "fenced"]


class SimDevice:
    """A device queue for the CPU: each launched step stays in flight until the engine
    waits for it, as on a GPU. An unmap of a page an in-flight step reads or writes is
    recorded as a violation: on a GPU it is an illegal-address fault.

    ``rng``: None, steps complete only when waited for (the worst case); else they
    also complete, in launch order, at random later points (each launch and each
    :meth:`point`). ``at_point``: called at the engine's points inside a step (named
    by the caller, e.g. ``"result"`` when it waits for a step's output).
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self.launched = 0
        self.in_flight: dict[int, set[int]] = {}  # step -> pages it reads or writes
        self.violations: list[tuple[int, set[int]]] = []
        self.unmaps = 0
        self.rng = rng
        self.at_point: Callable[[str], None] | None = None

    def launch(self, pages: set[int]) -> int:
        self.launched += 1
        self.in_flight[self.launched] = pages
        self._progress()
        return self.launched

    def point(self, name: str) -> None:
        self._progress()
        if self.at_point is not None:
            self.at_point(name)

    def _progress(self) -> None:
        rng = self.rng
        if rng is not None and self.in_flight and rng.random() < 0.4:
            self.complete_through(rng.choice(list(self.in_flight)))

    def complete_through(self, step: int) -> None:
        for k in [k for k in self.in_flight if k <= step]:
            del self.in_flight[k]

    def check_unmap(self, pages: Sequence[int]) -> None:
        self.unmaps += 1
        for step, touched in self.in_flight.items():
            hit = touched & set(pages)
            if hit:
                self.violations.append((step, hit))


class SimEvent:
    """The fence's device event on :class:`SimDevice`: recorded after the steps launched
    so far; synchronizing completes them."""

    def __init__(self, device: SimDevice) -> None:
        self.device = device
        self.mark = 0

    def record(self) -> None:
        self.mark = self.device.launched

    def synchronize(self) -> None:
        self.device.complete_through(self.mark)


class CheckedBackend:
    """A host backend whose unmaps are checked against the device's in-flight steps."""

    def __init__(self, inner: Any, device: SimDevice) -> None:
        self._inner = inner
        self._device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def unmap(self, page: int) -> None:
        self.unmap_many([page])

    def unmap_many(self, pages: Sequence[int]) -> None:
        if pages:
            self._device.check_unmap(pages)
        self._inner.unmap_many(pages)


def device_fence(device: SimDevice) -> UnmapFence:
    """An ``UnmapFence`` whose event lives on ``device`` (a device-wide sync completes every
    step launched)."""
    return UnmapFence(lambda: SimEvent(device), lambda: device.complete_through(device.launched))


def fenced(backend: Any, device: SimDevice, fence: UnmapFence) -> FencedBackend:
    """``backend`` with its unmaps checked against ``device``, behind ``fence`` (as the GPU
    path puts ``FencedBackend`` over a ``CudaBackend``)."""
    return FencedBackend(CheckedBackend(backend, device), fence)  # type: ignore[arg-type]
