"""The real sidecar app under uvicorn in a thread, for any test that needs a live sidecar.

Tests import it as ``from support import ThreadedSidecar`` (or use the fixtures in
:mod:`support.fixtures`).
"""

from __future__ import annotations

import threading
import time
from typing import Self

import uvicorn

from sidecar import SidecarSettings, create_app
from sidecar._server import server_config

__all__ = ["ThreadedSidecar"]


class ThreadedSidecar:
    """The real app under uvicorn, in a daemon thread, on 127.0.0.1 and a free port."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.app = create_app(settings)  # its state, for tests that count inside the app
        config = server_config(self.app, settings, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the sidecar did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
