"""The per-process runtime of one elastic instance: what an adapter builds and starts."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from allocator import BackendError

from ._control import ControlServer
from ._coordinator import CoordinatorConfig, ShrinkCoordinator
from ._device_id import derive_device_id
from ._mailbox import LimitMailbox, PublishResult
from ._reclaim import Reclaimer
from ._runtime_dir import SOCKET_FILE, RuntimeDir
from ._settings import EngineSettings
from ._sidecar_client import SidecarClient
from .protocol import EngineState, RegisterBody, registration_mark

if TYPE_CHECKING:
    from allocator import BlockAllocator

__all__ = ["ElasticInstance", "EngineBinding"]

_log = logging.getLogger("engine_ext.instance")


@dataclass(frozen=True, slots=True)
class EngineBinding:
    """What an engine adapter hands the core."""

    engine: str  # "vllm" or "sglang"
    engine_version: str
    blocks: BlockAllocator  # the pool's block allocator (its PageAllocator and backend behind it)
    reclaimers: tuple[Reclaimer, ...] = ()  # the prefix caches of the pool
    wake: Callable[[], None] | None = None  # wakes the engine thread after a publish
    device_total_bytes: int | None = None  # device memory of one rank (limit-percent)
    floor_pages: int = 0  # pages the engine keeps mapped whatever the limit (vLLM: null block)
    device_id: str | None = None  # the device of the ranks; the setting wins, None: derived


class ElasticInstance:
    """Wires mailbox, coordinator, control socket and sidecar client for one instance.

    Owns the per-instance runtime directory (a :class:`RuntimeDir`, mode 0700) and the
    control socket in it, the sidecar client and the mailbox. The adapter calls
    :meth:`start` on the engine thread before the first allocation, then
    ``coordinator.step()`` (or :meth:`step`) at the top of each allocation
    and when idle, and :meth:`close` on shutdown. :meth:`set_limit` may be
    called from any thread. ``close()`` also runs at interpreter exit, and on
    SIGINT/SIGTERM once :meth:`install_signal_cleanup` was called.
    """

    def __init__(
        self,
        settings: EngineSettings,
        binding: EngineBinding,
        *,
        sidecar_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.binding = binding
        self.instance_id = settings.resolved_instance_id(binding.engine)
        #: sent at registration: the setting, else the adapter's, else the pool's backend's
        self.device_id = (
            settings.device_id
            or binding.device_id
            or derive_device_id(binding.blocks.pages.backend)
        )
        self.mailbox = LimitMailbox(binding.wake)
        config = CoordinatorConfig(
            reclaim=settings.reclaim,
            max_evict_pages_per_step=settings.max_evict_pages_per_step,
            floor_pages=binding.floor_pages,
        )
        self.coordinator = ShrinkCoordinator(self.mailbox, binding.blocks, config)
        for reclaimer in binding.reclaimers:
            self.coordinator.add_reclaimer(reclaimer)
        self.runtime = RuntimeDir(settings.resolved_runtime_dir() / self.instance_id)
        self.runtime_dir = self.runtime.path
        self.socket_path = str(self.runtime.file(SOCKET_FILE))
        self.control = ControlServer(self.socket_path, self.mailbox)
        self.sidecar: SidecarClient | None = None
        if settings.sidecar_url is not None:
            self.sidecar = SidecarClient(
                settings,
                self.mailbox,
                self._register_body,
                instance_id=self.instance_id,
                transport=sidecar_transport,
            )
            self.coordinator.set_reporter(self.sidecar.report)
            # the socket says which process serves it, so a restart after a kill -9 can take
            # the id over at once (the sidecar asks it before refusing a second holder)
            self.control.registration_mark = registration_mark(self.sidecar.registration_token)
        self._started = False
        self._closed = False
        self._close_lock = threading.Lock()
        # the process that owns the socket, the dir and the registration: a process forked
        # from it inherits the atexit hook and must not close them (close() checks)
        self._pid = os.getpid()

    def start(self) -> None:
        """Create the runtime dir, serve the socket, register, publish the start-up limit.

        Blocks for at most ``register_timeout_s`` while the sidecar is
        unreachable. The retained (or configured) limit is in the mailbox when
        this returns, so the first ``step()`` applies it before any allocation.
        """
        if self._started:
            return
        self._started = True
        self.runtime.create()
        self.runtime.sweep_siblings()
        atexit.register(self.close)
        try:
            self.control.start()
            if self.sidecar is not None:
                self.sidecar.register_blocking(self.settings.register_timeout_s)
                self.sidecar.start()
        except BaseException:
            self.close()  # leave no socket, dir or thread behind
            raise
        if self.settings.limit is not None and self.mailbox.revision == 0:
            self.mailbox.publish_next(self.settings.limit)  # no retained limit: use the setting

    def set_limit(self, limit_bytes: int | None) -> PublishResult:
        """Any thread: publish ``limit_bytes`` at the next revision; never evicts here."""
        return self.mailbox.publish_next(limit_bytes)

    def step(self) -> EngineState:
        """Engine thread: one coordinator pass (see :meth:`ShrinkCoordinator.step`).

        A failed map/unmap (driver, OS) during the pass is logged, never fatal: the
        pass runs inside the engine's idle callbacks and allocation path, where an
        exception would end the engine. The limit stays deferred and the next pass
        retries.
        """
        try:
            return self.coordinator.step()
        except BackendError:
            _log.exception("kvsidecar: a map/unmap failed during a limit pass; retrying later")
            return self.state()

    def state(self) -> EngineState:
        """The latest state snapshot (any thread)."""
        return self.mailbox.latest_state

    def close(self) -> None:
        """Stop the threads, remove the socket and the runtime dir. Idempotent.

        A no-op in a process forked from the one that built the instance (a helper, a
        library's worker, ending through the inherited atexit hook): they are the
        parent's. Checked before the lock, which the fork may have copied held."""
        if os.getpid() != self._pid:
            return
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self.sidecar is not None:
            self.sidecar.stop()
        self.control.stop()
        self.runtime.remove()

    def install_signal_cleanup(self) -> None:
        """Main thread: on SIGINT/SIGTERM remove the runtime dir at once, close, then do
        what the old handler did (:meth:`RuntimeDir.remove_on_signals`)."""
        self.runtime.remove_on_signals(then=self.close)

    def _register_body(self) -> RegisterBody:
        return RegisterBody(
            engine=self.binding.engine,
            engine_version=self.binding.engine_version,
            socket_path=self.socket_path,
            device_total_bytes=self.binding.device_total_bytes,
            state=self.mailbox.latest_state,
            device_id=self.device_id,
        )
