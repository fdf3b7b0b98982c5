"""Pushes desired limits to engine control sockets, one worker task per instance.

Ordering: each instance has one worker and the worker always sends the
*current* desired revision, read right before each attempt; a newer desired
therefore supersedes a failing older one, and revisions reach the engine in
increasing order. Failures back off exponentially (initial → max), and an
urgent wake (a new desired, a re-registration) cuts the wait short; a report
or a push answer (which may show the push is due again) does not, so an engine
that keeps answering without taking the limit is pushed at the backoff's pace,
not as fast as it answers. A tie the sidecar settles by re-issuing its limit as
the next revision is pushed at once; the same tie again, on the revision just
re-issued, means another limit source keeps setting the engine's limit (a
second sidecar, ``kvctl --socket`` in a loop): from then on each re-issue waits
out the backoff. A failing instance is logged at its 1st, 2nd, 4th, 8th...
consecutive failure (every failure is counted in the metric), and once when
pushes work again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
from pydantic import ValidationError

from engine_ext.protocol import MAX_REPLY_BYTES, EngineState, LimitBody

from ._errors import SidecarError
from ._instances import InstanceRecord
from ._metrics import Metrics
from ._settings import SidecarSettings
from ._transport import SOCKET_EXTENSION, ReplyTooLarge, bounded_exchange

__all__ = ["PushManager", "PushOutcome", "ReplyHandler"]

_log = logging.getLogger("kvsidecar.push")


class PushOutcome(enum.Enum):
    """What one push came to."""

    TAKEN = "taken"  # the engine holds the pushed revision or a newer one
    SUPERSEDED = "superseded"  # a newer desired came meanwhile: push that one now
    REISSUED = "reissued"  # the engine held the revision with another limit: re-issued
    FAILED = "failed"  # no answer, a bad one, or one that took nothing: back off


#: Called with (instance id, engine state, rejected: 409 stale/conflict, the revision the
#: push carried); says what the push came to.
ReplyHandler = Callable[[str, EngineState, bool, int], Awaitable[PushOutcome]]


class _Worker:
    """One instance's push loop state."""

    __slots__ = ("failures", "task", "urgent", "wake")

    def __init__(self) -> None:
        self.wake = asyncio.Event()  # something may be due: check
        self.urgent = asyncio.Event()  # a new desired or registration: end a backoff now
        self.task: asyncio.Task[None] | None = None
        self.failures = 0  # consecutive failed attempts (for the falling log rate)


class PushManager:
    """Owns the per-instance push workers. Event-loop thread only."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        settings: SidecarSettings,
        metrics: Metrics,
        lookup: Callable[[str], InstanceRecord | None],
        on_reply: ReplyHandler,
    ) -> None:
        self._client = client
        self._settings = settings
        self._metrics = metrics
        self._lookup = lookup
        self._on_reply = on_reply
        self._workers: dict[str, _Worker] = {}
        self._closed = False

    def wake(self, instance_id: str, *, urgent: bool = True) -> None:
        """Make the instance's worker (started on first use) check for work now; ``urgent``
        (a new desired, a registration) also ends a backoff, a report's wake does not."""
        if self._closed:
            return
        worker = self._workers.get(instance_id)
        if worker is None:
            worker = self._workers[instance_id] = _Worker()
            worker.task = asyncio.get_running_loop().create_task(
                self._run(instance_id, worker), name=f"kvsidecar-push-{instance_id}"
            )
        worker.wake.set()
        if urgent:
            worker.urgent.set()

    def forget(self, instance_id: str) -> None:
        """Stop the instance's worker (the instance was forgotten)."""
        worker = self._workers.pop(instance_id, None)
        if worker is not None and worker.task is not None:
            worker.task.cancel()

    async def close(self) -> None:
        self._closed = True
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers.clear()

    async def _run(self, instance_id: str, worker: _Worker) -> None:
        delay = self._settings.push_backoff_initial_s
        reissues = 0  # ties settled by a re-issue since the engine last took a push
        while True:
            await worker.wake.wait()
            worker.wake.clear()
            worker.urgent.clear()
            while (rec := self._lookup(instance_id)) is not None and self._due(rec):
                outcome = await self._attempt(instance_id, rec)
                if outcome is PushOutcome.REISSUED:
                    reissues += 1
                    if reissues == 1:
                        continue  # push the re-issued revision at once: one round trip
                    self._fail(
                        instance_id,
                        "conflict_again",
                        "the engine held the revision just re-issued with another limit "
                        f"(re-issued again, as revision {rec.row.revision}): another limit "
                        "source keeps setting it (a second sidecar on this engine, or kvctl "
                        "--socket); re-issuing at the backoff's pace",
                    )
                    worker.urgent.clear()  # its own re-issue is no reason to skip the wait
                elif outcome is not PushOutcome.FAILED:
                    if worker.failures:
                        _log.info(
                            "push to %s works again after %d failed attempts",
                            instance_id,
                            worker.failures,
                        )
                        worker.failures = 0
                    if outcome is PushOutcome.TAKEN:
                        reissues = 0
                    delay = self._settings.push_backoff_initial_s
                    continue
                try:  # back off, unless a newer desired or a re-registration wakes us
                    await asyncio.wait_for(worker.urgent.wait(), delay)
                except TimeoutError:
                    pass
                worker.urgent.clear()
                worker.wake.clear()
                delay = min(delay * 2, self._settings.push_backoff_max_s)

    def _due(self, rec: InstanceRecord) -> bool:
        """A push is owed and someone may answer it. Not to an instance past its heartbeat
        timeout (``unreachable``): its process is gone, and a new engine that binds the same
        socket path must get its limit from its registration (which the autopilot fits
        into what the device has left), not the dead one's from a push; a report or a
        registration wakes the worker again."""
        now = asyncio.get_running_loop().time()
        return rec.needs_push() and rec.live(now, self._settings.heartbeat_timeout_s)

    async def _attempt(self, instance_id: str, rec: InstanceRecord) -> PushOutcome:
        try:
            return await self._push_once(instance_id, rec)
        except asyncio.CancelledError:
            raise
        except SidecarError as exc:  # e.g. the store refused an adoption: retry later
            self._fail(instance_id, type(exc).__name__, exc.detail)
        except Exception:  # noqa: BLE001  (last resort: a bug must not end the pushes)
            _log.exception("push to %s failed unexpectedly; retrying with backoff", instance_id)
            self._metrics.push_failed(instance_id, "internal")
        return PushOutcome.FAILED

    async def _push_once(self, instance_id: str, rec: InstanceRecord) -> PushOutcome:
        row = rec.row
        assert row.socket_path is not None
        body = LimitBody(limit=row.limit_bytes, revision=row.revision)
        start = time.perf_counter()
        timeout_s = self._settings.push_timeout_s
        try:
            code, content = await self._exchange(row.socket_path, body.model_dump_json())
        except TimeoutError:
            self._fail(
                instance_id,
                "timeout",
                f"{row.socket_path}: no whole answer within {timeout_s:g} s "
                "(KVSIDECAR_PUSH_TIMEOUT_S)",
            )
            return PushOutcome.FAILED
        except ReplyTooLarge:
            self._fail(
                instance_id,
                "reply_too_large",
                f"{row.socket_path}: the answer passed {MAX_REPLY_BYTES} bytes; is that "
                "socket a kvsidecar engine's control socket?",
            )
            return PushOutcome.FAILED
        except httpx.HTTPError as exc:
            self._fail(instance_id, type(exc).__name__, f"{row.socket_path}: {exc!r}")
            return PushOutcome.FAILED
        self._metrics.push_seconds.observe(time.perf_counter() - start)
        if code not in (200, 202, 409):
            self._fail(instance_id, f"http_{code}", content[:200].decode(errors="replace"))
            return PushOutcome.FAILED
        try:
            state = EngineState.model_validate_json(content)
        except ValidationError as exc:
            self._fail(instance_id, "bad_reply", str(exc)[:200])
            return PushOutcome.FAILED
        outcome = await self._on_reply(instance_id, state, code == 409, row.revision)
        if outcome is PushOutcome.FAILED:
            self._fail(instance_id, "rejected", state.message or state.status.value)
        return outcome

    async def _exchange(self, socket_path: str, body: str) -> tuple[int, bytes]:
        """One ``PUT /limit`` on ``socket_path``, bounded (:func:`bounded_exchange`)."""
        return await bounded_exchange(
            self._client,
            "PUT",
            "http://engine/limit",
            timeout_s=self._settings.push_timeout_s,
            content=body,
            headers={"content-type": "application/json"},
            extensions={SOCKET_EXTENSION: socket_path},
        )

    def _fail(self, instance_id: str, reason: str, detail: str) -> None:
        self._metrics.push_failed(instance_id, reason)
        worker = self._workers.get(instance_id)
        count = 1
        if worker is not None:
            worker.failures += 1
            count = worker.failures
        if count & (count - 1) == 0:  # 1, 2, 4, 8, ...: a dead socket does not flood the log
            _log.warning(
                "push to %s failed (%s): %s; retrying with backoff (%d consecutive "
                "failures; next logged at %d)",
                instance_id,
                reason,
                detail,
                count,
                2 * count,
            )
