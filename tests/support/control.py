"""One client for an engine's unix control socket (``<runtime dir>/<id>/control.sock``).

The e2e tests that run a real engine (``vllm serve``, SGLang's server, the
multi-rank vLLM) steer it through this socket the way the sidecar does:
``GET /state``, ``PUT /limit``. One copy here, used by every such test.
"""

from __future__ import annotations

import random
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import httpx

__all__ = ["ControlSocket", "limit_storm", "unchanged_by_a_storm"]

_T = TypeVar("_T")


@cache
def _ssl_context() -> ssl.SSLContext:
    """One context for every call (a unix socket never speaks TLS): a transport built
    without one loads the CA bundle, ~30 ms of CPU per call, which a loop polling
    ``GET /state`` every 20 ms would pay each time, beside the engines under test."""
    return ssl.create_default_context()


class ControlSocket:
    """Requests to the control socket at ``self.socket_path``; a fresh connection per request.

    A mixin: the test's engine class provides ``socket_path`` (a field or a
    property). A new ``httpx.Client`` per call keeps no connection open between
    calls (an engine restarted under the same path is reached again), and the
    ``with`` closes it also when the request fails.
    """

    socket_path: Path
    #: How long :meth:`wait_state` waits by default.
    state_timeout_s: float = 15.0

    def control(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer; a 200 or a 409 (a stale revision) is expected, anything else fails."""
        transport = httpx.HTTPTransport(uds=str(self.socket_path), verify=_ssl_context())
        with httpx.Client(transport=transport, base_url="http://engine", timeout=10) as client:
            response = client.request(method, path, json=body)
        assert response.status_code in (200, 409), response.text
        return response.json()

    def state(self) -> dict[str, Any]:
        return self.control("GET", "/state")  # type: ignore[no-any-return]

    def set_limit(self, limit: int | None) -> int:
        """Publish ``limit`` (bytes, or ``None`` for unlimited); returns the revision."""
        return int(self.control("PUT", "/limit", {"limit": limit})["revision"])

    def wait_state(
        self, revision: int, *, status: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """The first state at ``revision`` or later with ``status``; fails after the timeout."""
        deadline = time.monotonic() + (self.state_timeout_s if timeout_s is None else timeout_s)
        state = self.state()
        while time.monotonic() < deadline:
            if state["revision"] >= revision and state["status"] == status:
                return state
            time.sleep(0.02)
            state = self.state()
        raise AssertionError(f"no {status!r} state for revision {revision}: {state}")


@contextmanager
def limit_storm(engine: ControlSocket, limits: Sequence[int | None], seed: int) -> Iterator[None]:
    """While the block runs, a foreign thread publishes limits drawn from ``limits`` every
    0-30 ms; afterwards the engine is left unlimited. An error in the thread fails the
    block's exit."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                engine.set_limit(rng.choice(limits))
                stop.wait(rng.random() * 0.03)
        except BaseException as exc:  # noqa: BLE001 -- reported by the block's exit
            errors.append(exc)

    thread = threading.Thread(target=run, name="limit-storm", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)
        engine.set_limit(None)
    assert not errors, errors


def unchanged_by_a_storm(
    engine: ControlSocket, run: Callable[[], _T], limits: Sequence[int | None], seed: int
) -> _T:
    """``run()`` without limits, then again under :func:`limit_storm`; the two results
    (the tokens the engine generated) must be equal. Returns them."""
    reference = run()
    with limit_storm(engine, limits, seed):
        stormed = run()
    assert stormed == reference
    return stormed
