"""Toy engines for the autopilot tests: the real engine extension on the host backend.

Each :class:`ToyEngine` owns a real host-memory pool (``HostBackend``), a real
prefix cache and a real :class:`ElasticInstance` registered with a real
sidecar on a named host device. Its engine thread admits queued requests
while the pool (under its limit) has room, runs each for a few iterations,
then finishes it (its blocks stay cached, evictable). Mapped bytes are
measured from /proc (``st_blocks`` of the backend's memfd).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine_pool import BLOCKS_PER_PAGE, NUM_REGIONS, PAGE_BYTES, PrefixCache

from allocator import BlockAllocator, HostBackend, PageAllocator, PageLayout, ThreadGuard
from engine_ext import ElasticInstance, EngineBinding, load_engine_settings
from engine_ext._coordinator import Demand

NUM_PAGES = 32
BUNDLE = PAGE_BYTES * NUM_REGIONS


@dataclass
class Job:
    pages: int
    iterations: int
    done: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    latency_s: float = 0.0


class ToyEngine:
    """One engine: its thread owns the pool; :meth:`submit` may be called from any thread."""

    def __init__(self, iid: str, url: str, runtime_dir: Path, device: str) -> None:
        self.iid = iid
        self._url = url
        self._runtime_dir = runtime_dir
        self._device = device
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._woken = threading.Event()
        self.backend: HostBackend | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"engine-{iid}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30), f"{self.iid} did not start"
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._stop.set()
        self._woken.set()
        self._thread.join(30)

    def submit(self, pages: int, iterations: int) -> Job:
        job = Job(pages, iterations)
        self._jobs.put(job)
        self._woken.set()
        return job

    def measured_bytes(self) -> int:
        """What the OS has mapped for this engine's pool (/proc, not our bookkeeping)."""
        backend = self.backend
        if backend is None:
            return 0
        try:
            return os.stat(f"/proc/self/fd/{backend.fd}").st_blocks * 512
        except FileNotFoundError:
            return 0

    def _main(self) -> None:
        layout = PageLayout(page_bytes=PAGE_BYTES, num_pages=NUM_PAGES, num_regions=NUM_REGIONS)
        backend = HostBackend.reserve(layout, name=f"autopilot-{self.iid}")
        guard = ThreadGuard(f"pool-{self.iid}")
        guard.bind_current()
        blocks = BlockAllocator(PageAllocator(backend, guard=guard), BLOCKS_PER_PAGE)
        cache = PrefixCache(blocks)
        settings = load_engine_settings(
            instance_id=self.iid,
            sidecar_url=self._url,
            runtime_dir=self._runtime_dir,
            heartbeat_s=0.2,
            device_id=self._device,
        )
        inst = ElasticInstance(
            settings, EngineBinding("vllm", "0.33.0", blocks, (cache,), wake=self._woken.set)
        )
        waiting: list[Job] = []
        running: list[tuple[Job, object, int]] = []
        inst.coordinator.set_demand_probe(
            lambda: Demand(
                num_running_requests=len(running),
                num_waiting_requests=len(waiting),
                waiting_blocks=sum(j.pages for j in waiting) * BLOCKS_PER_PAGE,
                waiting_for_memory=bool(waiting),
            )
        )
        self.backend = backend
        try:
            inst.start()
        except BaseException as exc:  # noqa: BLE001  (reported to the test thread)
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        hashes = iter(range(1, 1 << 40))
        try:
            while not self._stop.is_set():
                inst.step()  # the safe point: takes a new target, evicts, reports
                while True:
                    try:
                        waiting.append(self._jobs.get_nowait())
                    except queue.Empty:
                        break
                while waiting:
                    job = waiting[0]
                    keys = [next(hashes) for _ in range(job.pages * BLOCKS_PER_PAGE)]
                    req = cache.start(keys)
                    if req is None and (old := list(cache.evictable_blocks())):
                        cache.evict(old)  # like an engine's LRU: cached blocks make room
                        req = cache.start(keys)
                    if req is None:
                        break  # waits for memory (the limit)
                    waiting.pop(0)
                    running.append((job, req, job.iterations))
                still = []
                for job, req, left in running:
                    if left <= 1:
                        cache.finish(req)  # type: ignore[arg-type]
                        job.latency_s = time.monotonic() - job.submitted
                        job.done.set()
                    else:
                        still.append((job, req, left - 1))
                running[:] = still
                self._woken.wait(0.01)
                self._woken.clear()
        finally:
            inst.close()
            self.backend = None
            backend.release()
