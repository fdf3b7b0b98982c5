"""Notice when the process that started this one is gone (an orphaned engine process).

vLLM 0.33's EngineCore has no check of its own for its API server: after a
``kill -9`` of the server (or the OOM killer choosing it) the EngineCore, and
the KV memory it maps, stay up for good, serving nobody, and a restart with
the same instance id is refused while it lives. :class:`ParentWatch` waits on
a pidfd of the parent in one thread that sleeps in ``poll`` (nothing runs
while the parent lives) and calls ``on_gone`` once when it exits.

Threads: :meth:`ParentWatch.start` / :meth:`ParentWatch.stop` from the owning
thread; ``on_gone`` runs on the watch thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

__all__ = ["ParentWatch"]

_log = logging.getLogger("engine_ext.parent")


class ParentWatch:
    """Calls ``on_gone(parent_pid)`` once when this process's parent exits."""

    def __init__(self, on_gone: Callable[[int], None]) -> None:
        self._on_gone = on_gone
        self._thread: threading.Thread | None = None
        self._stop_r = self._stop_w = -1
        self.parent_pid = 0

    def start(self) -> bool:
        """Start watching the current parent; False where that cannot be done (no pidfd on
        this kernel, or the parent is init: nothing to outlive)."""
        if self._thread is not None:
            return True
        parent = os.getppid()
        if parent <= 1:
            return False
        try:
            pidfd = os.pidfd_open(parent)
        except (AttributeError, OSError) as exc:  # an old kernel, or the parent just went
            if os.getppid() != parent:
                self._gone(parent)
                return True
            _log.warning("cannot watch the parent process %d (%s)", parent, exc)
            return False
        self.parent_pid = parent
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(
            target=self._watch, args=(pidfd, parent), name="kvsidecar-parent", daemon=True
        )
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop watching (idempotent); ``on_gone`` is not called after this returns."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if thread is not threading.current_thread():  # on_gone may end up here itself
            thread.join(timeout=5)
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._stop_r = self._stop_w = -1

    def _watch(self, pidfd: int, parent: int) -> None:
        try:
            if os.getppid() != parent:  # it went between getppid and pidfd_open
                self._gone(parent)
                return
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.register(self._stop_r, select.POLLIN)
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if self._stop_r in ready:
                    return
                if pidfd in ready:
                    self._gone(parent)
                    return
        finally:
            os.close(pidfd)

    def _gone(self, parent: int) -> None:
        try:
            self._on_gone(parent)
        except Exception:  # noqa: BLE001  (a watcher thread has nobody to raise to)
            _log.exception("kvsidecar: the handler for the parent's exit failed")
