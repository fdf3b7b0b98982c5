"""The instance service: every rule about desired limits, registrations and reports.

Raises domain errors only (``_errors``); the HTTP layer maps them to problem+json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx

from engine_ext.protocol import (
    MAX_SOCKET_PATH_BYTES,
    EngineState,
    RegisterBody,
    RegisterReply,
    Status,
    registration_mark,
    socket_path_fits,
)

from ._errors import (
    DuplicateInstanceError,
    InvalidInputError,
    RequestError,
    TooManyInstancesError,
    UnknownInstanceError,
)
from ._instances import InstanceRecord, derive_status
from ._logging import audit_deregister, audit_forget, audit_limit_change
from ._metrics import Metrics
from ._models import InstanceView
from ._pusher import PushManager, PushOutcome
from ._reports import report_problem
from ._revisions import Decision
from ._settings import SidecarSettings
from ._store import InstanceRow, Registration, Store
from ._transport import ReplyTooLarge, UnixSocketRouter, bounded_exchange, unix_transport

__all__ = ["InstanceService"]

_log = logging.getLogger("kvsidecar.service")


class InstanceService:
    """Owns the instance table, the store and the push workers.

    Event-loop thread only. The store is the truth for desired limits; the
    table mirrors it plus what engines report. Every change notifies the
    instance's waiters.
    """

    def __init__(
        self,
        store: Store,
        client: httpx.AsyncClient,
        settings: SidecarSettings,
        metrics: Metrics,
        *,
        router: UnixSocketRouter | None = None,
    ) -> None:
        self._store = store
        self._router = router  # the client's transports: closed when an engine is forgotten
        self._settings = settings
        self._records: dict[str, InstanceRecord] = {}
        self._creating: set[str] = set()  # new ids whose first write is in flight (the cap)
        self._metrics = metrics
        self._pusher = PushManager(client, settings, metrics, self._records.get, self._on_reply)
        # adds the autopilot's part to every view (set by the Autopilot; docs/autopilot.md)
        self.decorate: Callable[[InstanceView], InstanceView] = lambda view: view
        # told of every observed engine state, before and after (the Autopilot: a report
        # that frees memory or changes demand runs its pass at once; docs/autopilot.md)
        self.on_observed: Callable[[str, EngineState | None, EngineState], None] = (
            lambda instance_id, before, after: None
        )
        metrics.add_instances(self._undecorated)

    @property
    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def start(self) -> None:
        """Load the durable rows; push to every registered engine that may have missed one."""
        now, wall_now = self._now, time.time()
        for row in await self._store.load_all():
            rec = self._records[row.id] = InstanceRecord(row)
            if row.registered_at is not None:
                rec.last_seen = now  # the heartbeat clock starts at start-up
            if row.stopped_at is not None:  # the wall clock counts up to start-up only
                rec.stopped_since = now - max(0.0, wall_now - row.stopped_at)
            if rec.needs_push():
                self._pusher.wake(row.id)

    async def close(self) -> None:
        await self._pusher.close()

    async def check_ready(self) -> None:
        await self._store.check_writable()

    # --- reads ---------------------------------------------------------------------------

    def _undecorated(self) -> list[InstanceView]:
        """The views without the autopilot's policy fields, for ``/metrics`` (which shows
        none of them): decorating was two thirds of a scrape's loop time."""
        now = self._now
        timeout = self._settings.heartbeat_timeout_s
        return [self._records[iid].view(now, timeout) for iid in sorted(self._records)]

    def list(self) -> list[InstanceView]:
        return [self.decorate(view) for view in self._undecorated()]

    def get(self, instance_id: str) -> InstanceView:
        return self.decorate(
            self._record(instance_id).view(self._now, self._settings.heartbeat_timeout_s)
        )

    def records(self) -> dict[str, InstanceRecord]:
        """The instance table, for the autopilot's snapshot (read it, never change it)."""
        return self._records

    def status_of(self, rec: InstanceRecord) -> Status:
        """The instance's status now (``derive_status``)."""
        return derive_status(rec, self._now, self._settings.heartbeat_timeout_s)[0]

    async def wait(
        self, instance_id: str, until: Callable[[InstanceView], bool], timeout_s: float
    ) -> InstanceView:
        """Wait (at most ``timeout_s``, capped) until ``until(view)``; return the view then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(timeout_s, self._settings.max_wait_s)
        while True:
            rec = self._record(instance_id)
            view = self.decorate(rec.view(loop.time(), self._settings.heartbeat_timeout_s))
            remaining = deadline - loop.time()
            if until(view) or remaining <= 0:
                return view
            try:
                await asyncio.wait_for(rec.changed.wait(), remaining)
            except TimeoutError:
                pass

    # --- operator writes -----------------------------------------------------------------

    async def set_limit(
        self, instance_id: str, limit: int | None, revision: int | None, *, source: str = "api"
    ) -> InstanceView:
        """Store a desired limit (durably, before returning) and start pushing it.

        ``source`` says who asked (for the audit line), e.g. ``PUT from 10.0.0.7``."""
        async with self._admit(instance_id):
            row, decision = await self._store.set_desired(instance_id, limit, revision)
        self._took_limit(row, decision, source)
        return self.get(instance_id)

    async def set_limits(
        self, writes: Sequence[tuple[str, int | None, int | None, str]]
    ) -> tuple[InstanceRow, ...]:
        """:meth:`set_limit` for several known instances, ``(instance_id, limit, revision,
        source)`` each, in one durable write (one commit: all or none, in order); a
        ``revision`` an engine's report overtook meanwhile becomes the next one. Returns
        each instance's row as stored. An id neither known nor being admitted
        (:meth:`admission`): :class:`UnknownInstanceError`, nothing written."""
        for instance_id, *_ in writes:
            if instance_id not in self._creating:
                self._record(instance_id)
        results = await self._store.set_desired_many([w[:3] for w in writes])
        for (_, _, _, source), (row, decision) in zip(writes, results, strict=True):
            self._took_limit(row, decision, source)
        return tuple(row for row, _ in results)

    def _took_limit(self, row: InstanceRow, decision: Decision, source: str) -> None:
        """A desired limit was stored: the audit line, the metric, the push."""
        if not decision.changed:
            return
        old = self._records.get(row.id)
        audit_limit_change(
            row.id,
            source=source,
            old_limit=None if old is None else old.row.limit_bytes,
            new_limit=row.limit_bytes,
            old_revision=0 if old is None else old.row.revision,
            revision=row.revision,
        )
        self._metrics.limit_set(row.id, row.revision)
        self._take_row(row)

    async def clear_limit(self, instance_id: str, *, source: str = "api") -> InstanceView:
        """Back to unlimited, as a new revision. Unknown ids are a 404 (nothing to clear)."""
        self._record(instance_id)
        return await self.set_limit(instance_id, None, None, source=source)

    async def forget(self, instance_id: str, *, source: str = "api") -> None:
        """Drop the instance (desired limit, registration, observed state, metrics) for good.

        A live engine that still holds the id gets a 404 on its next report and
        registers again, with the limit it holds.
        """
        old = self._record(instance_id)
        await self._store.forget(instance_id)
        rec = self._records.pop(instance_id, None)
        self._pusher.forget(instance_id)
        if self._router is not None and old.row.socket_path is not None:
            await self._router.forget(old.row.socket_path)  # its connection to the engine
        self._metrics.forget(instance_id)
        audit_forget(
            instance_id, source=source, old_limit=old.row.limit_bytes, old_revision=old.row.revision
        )
        if rec is not None:
            rec.notify()
        _log.info("instance %s: forgotten (%s)", instance_id, source)

    # --- engine-facing -------------------------------------------------------------------

    async def vet_register(self, instance_id: str, body: RegisterBody) -> None:
        """Raise every refusal :meth:`register` can give (a bad socket path, an inconsistent
        state, a second live engine process, the instance cap), writing nothing: a caller
        that stores something of its own for the registration (the autopilot: the device,
        a fitted limit) calls this first, and stores under :meth:`admission`, so that a
        refused registration leaves nothing behind."""
        _check_socket_path(body.socket_path)
        self._check_report(instance_id, body.state)
        held = self._records.get(instance_id)
        if held is None:
            self._check_room(instance_id)
        elif self._second_holder(
            held, body.registration_token, "register"
        ) and not await self._took_over_the_socket(held, body):
            self._refuse_holder(held, "register")

    def admission(self, instance_id: str) -> AbstractAsyncContextManager[None]:
        """Hold a place for ``instance_id`` under ``max_instances`` (if it is new) for the
        whole block: a registration vetted inside it cannot then meet a full sidecar."""
        return self._admit(instance_id)

    async def register(
        self, instance_id: str, body: RegisterBody, *, vetted: bool = False
    ) -> RegisterReply:
        """Record the engine; adopt its revision if newer; answer with the desired limit.

        ``vetted``: :meth:`vet_register` already passed for this body (the checks are not
        run again; the holder check may ask the engine's socket)."""
        if not vetted:
            await self.vet_register(instance_id, body)
        reg = Registration(
            body.engine, body.engine_version, body.socket_path, body.device_total_bytes
        )
        async with self._admit(instance_id):
            row = await self._store.register(instance_id, reg)
        rec = self._take_row(row, wake=False)
        rec.reg_token = body.registration_token
        rec.stopped_since = None  # running again
        rec.take_report(body.state, restarted=True)  # a (re)started engine: a new state
        rec.last_seen = self._now
        await self._adopt_if_newer(rec, body.state)
        if _other_limit_same_revision(rec, body.state):
            await self._reissue_desired(rec)
        rec.notify()
        self._metrics.observed(rec.view(self._now, self._settings.heartbeat_timeout_s))
        self.on_observed(instance_id, None, body.state)
        if rec.needs_push():
            # The reply carries the limit, but it may never arrive (an engine that gave up
            # waiting for a slow answer): the push worker delivers it too (a repeat of the
            # same revision is idempotent on the engine), and a backoff from pushes to a
            # dead predecessor ends here.
            self._pusher.wake(instance_id)
        return RegisterReply(limit=rec.row.limit_bytes, revision=rec.row.revision)

    async def report(
        self, instance_id: str, state: EngineState, token: str | None = None
    ) -> RegisterReply:
        """A status report (and heartbeat); answers with the desired limit."""
        if state.status in (Status.STALE, Status.CONFLICT, Status.STOPPED):
            raise InvalidInputError(
                "status",
                "a report carries pending, deferred, applied "
                "or unreachable; stale/conflict are replies only, and "
                "stopped is sent as POST .../deregister",
            )
        rec = self._records.get(instance_id)
        if rec is None or rec.row.registered_at is None or rec.stopped:
            # e.g. the sidecar's database was replaced, or the id was forgotten or stopped:
            # a 404 makes the engine register again
            raise UnknownInstanceError(instance_id)
        if self._second_holder(rec, token, "report"):
            self._refuse_holder(rec, "report")
        self._check_report(instance_id, state)
        if rec.reg_token is None:
            rec.reg_token = token  # the sidecar restarted: the first process to report holds it
        await self._observe(rec, state)
        return RegisterReply(limit=rec.row.limit_bytes, revision=rec.row.revision)

    async def deregister(self, instance_id: str, token: str | None) -> InstanceView:
        """A clean engine shutdown: status ``stopped``; the desired limit is kept."""
        rec = self._records.get(instance_id)
        if rec is None or rec.row.registered_at is None:
            raise UnknownInstanceError(instance_id)
        if token is not None and rec.reg_token is not None and token != rec.reg_token:
            raise DuplicateInstanceError(
                f"instance {instance_id!r} is held by another engine process; this "
                "deregistration is ignored (give each engine its own KVSIDECAR_INSTANCE_ID)"
            )
        if not rec.stopped:
            row = await self._store.set_stopped(instance_id, time.time())
            if row is not None:
                rec.set_row(row)
            rec.stopped_since = self._now
            rec.reg_token = None
            rec.notify()
            _log.info("instance %s: the engine stopped cleanly (deregistered)", instance_id)
            audit_deregister(instance_id, limit=rec.row.limit_bytes, revision=rec.row.revision)
        return self.get(instance_id)

    # --- internals -----------------------------------------------------------------------

    @asynccontextmanager
    async def _admit(self, instance_id: str) -> AsyncIterator[None]:
        """Hold a place for a new id under ``max_instances`` while its first write runs."""
        if instance_id in self._records or instance_id in self._creating:
            yield
            return
        self._check_room(instance_id)
        self._creating.add(instance_id)
        try:
            yield
        finally:
            self._creating.discard(instance_id)

    def _check_room(self, instance_id: str) -> None:
        """Refuse a new id when ``max_instances`` are held (or being created)."""
        if instance_id in self._records or instance_id in self._creating:
            return
        cap = self._settings.max_instances
        if len(self._records) + len(self._creating) >= cap:
            raise TooManyInstancesError(
                f"the sidecar already holds {cap} instances (KVSIDECAR_MAX_INSTANCES); forget "
                "unused ones (kvctl forget ID) or raise the cap"
            )

    def _second_holder(self, rec: InstanceRecord, token: str | None, what: str) -> bool:
        """Whether another live engine process holds the id (tokens differ, it lives)."""
        if token is None or rec.reg_token is None or token == rec.reg_token:
            return False
        # a holder that stopped or went silent does not hold a registration: a restart takes
        # the id over (reports are refused until the holder registers again)
        return what != "register" or rec.live(self._now, self._settings.heartbeat_timeout_s)

    async def _took_over_the_socket(self, rec: InstanceRecord, body: RegisterBody) -> bool:
        """Whether the registering process now serves the holder's own control socket: then
        the holder is gone (an engine binds its socket only when nobody answers on it), e.g.
        an engine killed with kill -9 and started again at once, before its heartbeat timed
        out. Its socket's ``/healthz`` shows the mark of the token of the process serving it."""
        path, token = body.socket_path, body.registration_token
        if path is None or token is None or path != rec.row.socket_path:
            return False
        try:  # a connection of its own: a pooled one may still lead to the dead process
            async with httpx.AsyncClient(transport=unix_transport(path)) as probe:
                _code, content = await bounded_exchange(
                    probe,
                    "GET",
                    "http://engine/healthz",
                    timeout_s=min(self._settings.push_timeout_s, 2.0),
                )
            mark = json.loads(content).get("registration")
        except (httpx.HTTPError, TimeoutError, ReplyTooLarge, ValueError, AttributeError):
            return False  # no (whole, sane) answer: another host's path, a stopped process
        if mark != registration_mark(token):
            return False
        _log.info(
            "instance %s: a new engine process serves its control socket %s; the previous "
            "one is gone (killed?) and the new one takes the id over",
            rec.row.id,
            path,
        )
        return True

    def _refuse_holder(self, rec: InstanceRecord, what: str) -> None:
        """Refuse a second live engine process on one id."""
        timeout = self._settings.heartbeat_timeout_s
        socket = rec.row.socket_path or "no socket"
        _log.warning(
            "instance %s: refused a %s from a second engine process (the id is held "
            "by the engine at %s)",
            rec.row.id,
            what,
            socket,
        )
        raise DuplicateInstanceError(
            f"instance id {rec.row.id!r} is held by another live engine process (control "
            f"socket {socket}); give each engine its own KVSIDECAR_INSTANCE_ID, or stop the "
            f"other one (a crashed one is released {timeout:g}s after its last report)"
        )

    def _check_report(self, instance_id: str, state: EngineState) -> None:
        rec = self._records.get(instance_id)
        limit = None if rec is None else rec.row.limit_bytes
        revision = 0 if rec is None else rec.row.revision
        problem = report_problem(state, limit, revision)
        if problem is not None:
            _log.warning("instance %s: rejected an inconsistent report: %s", instance_id, problem)
            raise InvalidInputError("state", f"inconsistent report: {problem}")

    def _record(self, instance_id: str) -> InstanceRecord:
        rec = self._records.get(instance_id)
        if rec is None:
            raise UnknownInstanceError(instance_id)
        return rec

    def _take_row(self, row: InstanceRow, *, wake: bool = True) -> InstanceRecord:
        rec = self._records.get(row.id)
        if rec is None:
            rec = self._records[row.id] = InstanceRecord(row)
        else:
            rec.set_row(row)
        rec.notify()
        if wake and rec.needs_push():
            self._pusher.wake(row.id)
        return rec

    async def _adopt_if_newer(self, rec: InstanceRecord, state: EngineState) -> None:
        """The newest revision wins whatever its source (e.g. ``kvctl --socket``)."""
        if state.revision > rec.row.revision:
            old = rec.row
            row = await self._store.adopt(rec.row.id, state.limit_bytes, state.revision)
            if row is not None:
                audit_limit_change(
                    rec.row.id,
                    source="engine (adopted its newer revision)",
                    old_limit=old.limit_bytes,
                    new_limit=row.limit_bytes,
                    old_revision=old.revision,
                    revision=row.revision,
                )
                rec.set_row(row)

    async def _reissue_desired(self, rec: InstanceRecord) -> None:
        """The engine took the desired revision number with another limit (set on its socket
        directly, or from ``KVSIDECAR_LIMIT`` while the sidecar was down). The sidecar's
        intent wins the tie: re-issue it as the next revision, which gets pushed."""
        _log.warning(
            "instance %s: the engine holds revision %d with another limit; "
            "re-issuing the desired limit as the next revision",
            rec.row.id,
            rec.row.revision,
        )
        try:
            await self.set_limit(
                rec.row.id,
                rec.row.limit_bytes,
                None,
                source="sidecar (re-issued over the engine's conflicting limit)",
            )
        except RequestError as exc:  # e.g. the revision space is used up: say so, go on
            _log.error("instance %s: cannot re-issue the desired limit: %s", rec.row.id, exc.detail)

    async def _observe(self, rec: InstanceRecord, state: EngineState) -> bool:
        """Take an engine's report or push answer; returns whether it re-issued the desired
        limit (a tie). It wakes the pusher when a push is due, but does not end a backoff:
        an engine answering fast without taking the limit must not speed the pushes up."""
        adopted = state.revision > rec.row.revision  # a limit set on the engine's socket
        await self._adopt_if_newer(rec, state)
        reissued = _other_limit_same_revision(rec, state)
        if reissued:
            await self._reissue_desired(rec)
        # A push reply can arrive after a newer report for the same revision (the engine
        # made more passes meanwhile): order by (revision, passes), never by arrival.
        before = rec.observed
        # silent past the heartbeat timeout (its memory reassigned) and heard from again (a
        # frozen engine, not a dead one), or holding a limit the sidecar did not set:
        # observed as new, so the autopilot fits it to a budget at once
        as_new = adopted or (
            rec.row.registered_at is not None
            and not rec.live(self._now, self._settings.heartbeat_timeout_s)
        )
        if before is None or (state.revision, state.passes) >= (before.revision, before.passes):
            rec.take_report(state)
        rec.last_seen = self._now
        rec.notify()
        self._metrics.observed(rec.view(self._now, self._settings.heartbeat_timeout_s))
        if rec.needs_push():
            self._pusher.wake(rec.row.id, urgent=False)
        if rec.observed is not None and (as_new or rec.observed is not before):
            self.on_observed(rec.row.id, None if as_new else before, rec.observed)
        return reissued

    async def _on_reply(
        self, instance_id: str, state: EngineState, rejected: bool, pushed: int
    ) -> PushOutcome:
        """A push answer for revision ``pushed``: what the push came to. The engine holds
        that revision or a newer one (taken); a newer desired (a PUT that came while the
        push was on the wire, or the engine's own newer revision adopted) supersedes it;
        the engine held it with another limit and the desired was re-issued; or nothing
        was taken (failed: the worker backs off)."""
        rec = self._records.get(instance_id)
        if rec is None:
            return PushOutcome.TAKEN  # forgotten: nothing more to push
        problem = report_problem(state, rec.row.limit_bytes, rec.row.revision)
        if problem is not None:
            _log.warning(
                "instance %s: ignored an inconsistent push reply: %s", instance_id, problem
            )
            return PushOutcome.FAILED
        if not rejected:
            if await self._observe(rec, state):
                return PushOutcome.REISSUED
            if state.revision >= pushed:
                return PushOutcome.TAKEN
            return PushOutcome.SUPERSEDED if rec.row.revision > pushed else PushOutcome.FAILED
        rec.last_seen = self._now
        if state.status is Status.CONFLICT and state.revision <= pushed:
            await self._reissue_desired(rec)
            return PushOutcome.REISSUED
        await self._adopt_if_newer(rec, state)
        return PushOutcome.SUPERSEDED if rec.row.revision != pushed else PushOutcome.FAILED


def _other_limit_same_revision(rec: InstanceRecord, state: EngineState) -> bool:
    """The engine holds the desired revision number, but with another limit."""
    return state.revision == rec.row.revision != 0 and state.limit_bytes != rec.row.limit_bytes


def _check_socket_path(path: str | None) -> None:
    if path is None:
        return
    if not path.startswith("/") or "\x00" in path:
        raise InvalidInputError("socket_path", "must be an absolute path to a unix socket")
    if not socket_path_fits(path):
        raise InvalidInputError(
            "socket_path",
            f"is longer than {MAX_SOCKET_PATH_BYTES} bytes, the unix socket "
            "limit; use a shorter KVSIDECAR_RUNTIME_DIR",
        )
