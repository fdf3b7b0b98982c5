"""Wake a sleeping SGLang scheduler when a limit is published.

With ``--sleep-on-idle`` the scheduler parks in ``IdleSleeper.maybe_sleep``
(``zmq.Poller.poll(1000)`` on its IPC sockets), so a limit published from the
control socket would wait up to a second. :class:`PipeWaker` adds the read end
of a pipe to that poller: :meth:`wake` (any thread) writes a byte, the poll
returns, the loop's next ``on_idle`` runs the pass and :meth:`drain` empties
the pipe. Without a sleeper (the default busy loop) the pass runs on the next
iteration anyway and the pipe is unused.

Threads: ``wake`` from any thread; ``attach``/``drain``/``close`` from the scheduler thread.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PipeWaker"]


class PipeWaker:
    """Owns one non-blocking pipe; registered with the scheduler's idle poller."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.attached = False  # registered with an IdleSleeper's poller

    @property
    def fileno(self) -> int:
        return self._read_fd

    def attach(self, scheduler: Any) -> bool:
        """Register with ``scheduler.idle_sleeper`` if it polls zmq sockets (IdleSleeper)."""
        poller = getattr(getattr(scheduler, "idle_sleeper", None), "poller", None)
        if poller is None:
            return False
        import zmq

        poller.register(self._read_fd, zmq.POLLIN)
        self.attached = True
        return True

    def wake(self) -> None:
        """Any thread: make the idle poll return now (a full pipe is already a wake-up)."""
        if not self.attached:
            return  # nobody sleeps on it: the busy loop runs the pass on its next iteration
        try:
            os.write(self._write_fd, b"\0")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> None:
        """Scheduler thread: consume pending wake-ups."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
