"""Durable desired state: one SQLite database, one writer thread.

Every statement runs on a single dedicated thread (a one-worker executor), so
there is exactly one connection and one writer; the event loop never blocks on
the disk. WAL with ``synchronous=FULL``: a write has reached the disk when its
coroutine returns, which is before the HTTP response is sent.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from engine_ext.protocol import MAX_REVISION

from ._errors import RevisionRejectedError, SidecarConfigError, StoreError
from ._revisions import Decision, decide

__all__ = ["InstanceRow", "Registration", "Store"]

_T = TypeVar("_T")
_log = logging.getLogger("kvsidecar.store")

# 2: stopped_at (clean engine shutdown); 1 is migrated on open
# 3: the autopilot's tables (devices, policies; docs/autopilot.md); 2 gains them on open
# 4: policies.pin_revision (the revision of an operator's pin on a budgeted device)
# 5: policies.floor_bytes (the engine's last reported floor, kept free while it is dead)
_SCHEMA_VERSION = 5
_SCHEMA = """
CREATE TABLE IF NOT EXISTS instances (
    id TEXT PRIMARY KEY,
    limit_bytes INTEGER,               -- NULL = unlimited
    revision INTEGER NOT NULL,         -- 0 = no limit set yet
    updated_at REAL NOT NULL,          -- unix seconds of the last desired change
    engine TEXT,                       -- registration (NULL until the engine registers)
    engine_version TEXT,
    socket_path TEXT,
    device_total_bytes INTEGER,
    registered_at REAL,
    stopped_at REAL                    -- the engine deregistered (clean shutdown); NULL: not
) STRICT;
CREATE TABLE IF NOT EXISTS ready_probe (k INTEGER PRIMARY KEY, at REAL NOT NULL) STRICT;
CREATE TABLE IF NOT EXISTS devices (
    id TEXT PRIMARY KEY,
    budget_bytes INTEGER,              -- NULL = no budget (the autopilot leaves it alone)
    revision INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    dry_run INTEGER NOT NULL DEFAULT 0 -- 1: compute and show, write nothing
) STRICT;
CREATE TABLE IF NOT EXISTS policies (
    id TEXT PRIMARY KEY,               -- the instance id
    device_id TEXT,                    -- from the engine's registration
    min_bytes INTEGER NOT NULL DEFAULT 0,
    max_bytes INTEGER,                 -- NULL = no max
    weight REAL NOT NULL DEFAULT 1.0,
    pinned INTEGER NOT NULL DEFAULT 0, -- 1: an operator set the limit (PUT .../limit)
    pin_bytes INTEGER,                 -- the operator's limit (NULL = unlimited)
    source TEXT,                       -- who set the current desired limit: operator|policy
    reason TEXT,                       -- why the policy set it
    changed_at REAL,                   -- unix seconds of that change
    pin_revision INTEGER,              -- the pin's revision on a budgeted device (NULL: none)
    floor_bytes INTEGER NOT NULL DEFAULT 0 -- the engine's last reported floor
) STRICT;
"""
_COLUMNS = (
    "id, limit_bytes, revision, updated_at, engine, engine_version, socket_path, "
    "device_total_bytes, registered_at, stopped_at"
)
_COLUMN_NAMES = tuple(c.strip() for c in _COLUMNS.split(","))
_OWN_TABLES = ("instances", "ready_probe", "devices", "policies")


def _is_own_object(name: str) -> bool:
    """A table of ours, or the index SQLite made for one's primary key."""
    return name in _OWN_TABLES or any(
        name.startswith(f"sqlite_autoindex_{table}_") for table in _OWN_TABLES
    )


def _statements(script: str) -> tuple[str, ...]:
    """``script`` split into whole SQL statements (a ';' inside a comment does not end one)."""
    statements: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending.strip())
            pending = ""
    assert not pending.strip(), f"an unfinished statement in the schema: {pending!r}"
    return tuple(statements)


_SCHEMA_STATEMENTS = _statements(_SCHEMA)
_MIGRATE_1_TO_2 = "ALTER TABLE instances ADD COLUMN stopped_at REAL"
# the policies table's columns added by 4 and 5 (a version is set after its column is added:
# a file whose migration was cut short between the two has it already)
_POLICY_COLUMNS_ADDED = {
    4: ("pin_revision", "INTEGER"),
    5: ("floor_bytes", "INTEGER NOT NULL DEFAULT 0"),
}


@dataclass(frozen=True, slots=True)
class Registration:
    """What an engine told the sidecar when it registered."""

    engine: str
    engine_version: str
    socket_path: str | None
    device_total_bytes: int | None


@dataclass(frozen=True, slots=True)
class InstanceRow:
    """One row of ``instances``: the durable part of an instance."""

    id: str
    limit_bytes: int | None  # desired limit, None = unlimited
    revision: int  # desired revision, 0 = none set
    updated_at: float
    engine: str | None = None
    engine_version: str | None = None
    socket_path: str | None = None
    device_total_bytes: int | None = None
    registered_at: float | None = None
    stopped_at: float | None = None  # unix seconds of a clean engine shutdown
    seq: int = 0  # writer-thread write order (not stored): the newest write wins in memory

    def as_tuple(self) -> tuple[object, ...]:
        return (
            self.id,
            self.limit_bytes,
            self.revision,
            self.updated_at,
            self.engine,
            self.engine_version,
            self.socket_path,
            self.device_total_bytes,
            self.registered_at,
            self.stopped_at,
        )


_BUSY_TIMEOUT_MS = 5000  # how long a statement waits for another process's lock
_LOCKED_HURRY_S = 1.0  # after such a wait failed, queued statements try once for this long


def _lock_exclusively(path: Path) -> int:
    """Open ``path`` and take an exclusive ``flock`` on it, or refuse: two sidecars on one
    database would each serve the rows they loaded at start, answer from stale revisions
    and hand out revision numbers the other already used. (SQLite's own locks are POSIX
    record locks, which a flock does not touch.) Returns the fd that holds the lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise SidecarConfigError(
            f"cannot open the database {path}: {exc.strerror}; set KVSIDECAR_DB_PATH (or --db) "
            "to a writable file"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise SidecarConfigError(
            f"another kvsidecar serves the database {path} ({exc.strerror}); run one sidecar "
            "per database file, or give this one its own KVSIDECAR_DB_PATH (or --db)"
        ) from exc
    return fd


class Store:
    """Owns the SQLite connection and the writer thread.

    Call from the event loop only; every method hops to the writer thread.
    Methods that validate (revisions) do so inside the same transaction as
    the write, so concurrent requests cannot interleave a read and a write.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsidecar-db")
        self._conn: sqlite3.Connection | None = None
        self._seq = 0  # writes so far; writer thread only
        self._file_id: tuple[int, int] | None = None  # (st_dev, st_ino) at open
        self._lock_fd = -1  # the database file, flock()ed: one sidecar per file
        self._locked_until = 0.0  # writer thread: another process held the lock until then

    async def open(self) -> None:
        await self._run(self._open_sync)

    async def close(self) -> None:
        try:
            await self._run(self._close_sync)
        finally:
            self._executor.shutdown(wait=True)

    async def load_all(self) -> list[InstanceRow]:
        return await self._run(self._load_all_sync)

    async def set_desired(
        self, instance_id: str, limit: int | None, revision: int | None
    ) -> tuple[InstanceRow, Decision]:
        """Validate ``revision`` against the stored one and write; raises to change nothing."""
        return await self._run(lambda: self._set_desired_sync(instance_id, limit, revision))

    async def set_desired_many(
        self, writes: Sequence[tuple[str, int | None, int | None]]
    ) -> list[tuple[InstanceRow, Decision]]:
        """Several ``(instance_id, limit, revision)`` writes in one transaction (one commit:
        all or none), in order. A ``revision`` the stored one has reached meanwhile (an
        engine reported a newer one) is written as the next revision instead: the
        autopilot's writes, whose revision is only ever its own pin's."""

        def body() -> list[tuple[InstanceRow, Decision]]:
            out = []
            for instance_id, limit, revision in writes:
                try:
                    out.append(self._desired(instance_id, limit, revision))
                except RevisionRejectedError:
                    if revision is None:
                        raise
                    out.append(self._desired(instance_id, limit, None))
            return out

        return await self._run(lambda: self._transaction(body))

    async def adopt(self, instance_id: str, limit: int | None, revision: int) -> InstanceRow | None:
        """Take an engine's newer revision as the desired one; None if not newer."""
        return await self._run(lambda: self._adopt_sync(instance_id, limit, revision))

    async def register(self, instance_id: str, reg: Registration) -> InstanceRow:
        """Record (or refresh) an engine's registration; the desired limit is kept."""
        return await self._run(lambda: self._register_sync(instance_id, reg))

    async def forget(self, instance_id: str) -> bool:
        """Delete the instance's row; False if there was none."""
        return await self._run(lambda: self._forget_sync(instance_id))

    async def set_stopped(self, instance_id: str, at: float) -> InstanceRow | None:
        """Mark a registered engine as stopped (clean shutdown); None if not registered."""
        return await self._run(lambda: self._stopped_sync(instance_id, at))

    async def call(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn(connection)`` in one write transaction on the writer thread.

        For the other tables' modules (``_autopilot_store``); ``fn`` must not
        touch ``instances`` (its rows go through the methods above).
        """
        return await self._run(lambda: self._transaction(lambda: fn(self._db())))

    async def check_writable(self) -> None:
        """Raise :class:`StoreError` unless a write transaction can commit now."""
        await self._run(self._check_writable_sync)

    async def _run(self, fn: Callable[[], _T]) -> _T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, lambda: self._patiently(fn))
        except sqlite3.Error as exc:
            raise StoreError(
                f"the database {self.path} refused the operation ({exc}); check that the "
                "disk has space and the file is writable, then retry"
            ) from exc

    # --- writer thread only below ---------------------------------------------------------

    def _patiently(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``; while another process holds the database locked, only the first
        statement waits the busy timeout (5 s): those queued behind it, for the next
        second, try once and fail at once, so N queued requests (and ``/readyz`` behind
        them) get their 503 after 5 s, not after N times 5 s."""
        conn = self._conn
        hurry = conn is not None and time.monotonic() < self._locked_until
        if hurry:
            conn.execute("PRAGMA busy_timeout = 0")  # type: ignore[union-attr]
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                self._locked_until = time.monotonic() + _LOCKED_HURRY_S
            raise
        finally:
            if hurry and self._conn is not None:
                self._conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")

    def _db(self) -> sqlite3.Connection:
        assert self._conn is not None, "Store.open() was not awaited"
        return self._conn

    def _open_sync(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=_BUSY_TIMEOUT_MS / 1000)
        except (OSError, sqlite3.Error) as exc:
            raise SidecarConfigError(
                f"cannot open the database {self.path}: {exc}; set KVSIDECAR_DB_PATH "
                "(or --db) to a writable file"
            ) from exc
        # the lock first: a second sidecar (maybe a newer one) must not migrate the file
        # under the one that serves it, nor even switch its journal mode
        try:
            self._lock_fd = _lock_exclusively(self.path)
        except SidecarConfigError:
            conn.close()
            raise
        try:
            self._prepare(conn)
        except sqlite3.Error as exc:
            self._release_open(conn)
            raise SidecarConfigError(
                f"the database {self.path} cannot be read as a kvsidecar database ({exc}); "
                "set KVSIDECAR_DB_PATH (or --db) to another file"
            ) from exc
        except BaseException:
            self._release_open(conn)
            raise
        info = os.fstat(self._lock_fd)
        self._file_id = (info.st_dev, info.st_ino)
        self._conn = conn

    def _release_open(self, conn: sqlite3.Connection) -> None:
        conn.close()
        os.close(self._lock_fd)
        self._lock_fd = -1

    def _prepare(self, conn: sqlite3.Connection) -> None:
        # read-only checks first: a file that is refused is left exactly as it was
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        self._refuse_foreign(conn, version)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        # one transaction: a migration cut short (the sidecar killed, a write refused) leaves
        # the file as it was, never a column added under the old version number
        conn.execute("BEGIN IMMEDIATE")
        try:
            self._migrate(conn, version)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _refuse_foreign(self, conn: sqlite3.Connection, version: int) -> None:
        """Refuse a file of a schema this sidecar does not read, or another program's
        database (version 0 is only ever a new file: every kvsidecar sets the version in
        the transaction that creates its tables)."""
        if version not in (0, 1, 2, 3, 4, _SCHEMA_VERSION):
            raise SidecarConfigError(
                f"the database {self.path} has schema version {version}; this sidecar "
                f"reads version {_SCHEMA_VERSION}: use a newer kvsidecar or another --db"
            )
        if version:
            return
        if self._instance_columns(conn):  # ours by name: must be ours by shape as well
            self._check_columns(conn, _COLUMN_NAMES, version)
        found = [row[0] for row in conn.execute("SELECT name FROM sqlite_master ORDER BY name")]
        foreign = [name for name in found if not _is_own_object(name)]
        if foreign:
            shown = ", ".join(foreign[:5]) + (
                f" and {len(foreign) - 5} more" if foreign[5:] else ""
            )
            raise SidecarConfigError(
                f"the database {self.path} holds objects kvsidecar did not create ({shown}): "
                "it belongs to another program and is left as it is; set KVSIDECAR_DB_PATH "
                "(or --db) to a file of its own"
            )

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        if version == 1:
            # a sidecar before the migration was one transaction could be killed after
            # adding the column and before setting the version: the column is there already
            found = self._instance_columns(conn)
            if found != _COLUMN_NAMES:
                self._check_columns(conn, _COLUMN_NAMES[:-1], version)
                conn.execute(_MIGRATE_1_TO_2)
        elif version == 2:  # gains the autopilot's tables below; its own must be ours
            self._check_columns(conn, _COLUMN_NAMES, version)
        elif version in (3, 4):  # the policies table gains the pin's revision, the floor
            self._check_columns(conn, _COLUMN_NAMES, version)
            found_policies = {r[1] for r in conn.execute("PRAGMA table_info(policies)")}
            for added in range(version + 1, _SCHEMA_VERSION + 1):
                column, declared = _POLICY_COLUMNS_ADDED[added]
                if column not in found_policies:
                    conn.execute(f"ALTER TABLE policies ADD COLUMN {column} {declared}")
        for statement in _SCHEMA_STATEMENTS:  # not executescript: it would commit first
            conn.execute(statement)
        self._check_columns(conn, _COLUMN_NAMES, version)
        conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")

    @staticmethod
    def _instance_columns(conn: sqlite3.Connection) -> tuple[str, ...]:
        return tuple(r[1] for r in conn.execute("PRAGMA table_info(instances)"))

    def _check_columns(
        self, conn: sqlite3.Connection, expected: tuple[str, ...], version: int
    ) -> None:
        found = self._instance_columns(conn)
        if found != expected:
            raise SidecarConfigError(
                f"the database {self.path} says schema version {version} but its table "
                f"'instances' has the columns ({', '.join(found)}), not ({', '.join(expected)}); "
                "it was not written by kvsidecar: set KVSIDECAR_DB_PATH (or --db) to another file"
            )

    def _close_sync(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def _load_all_sync(self) -> list[InstanceRow]:
        rows = self._db().execute(f"SELECT {_COLUMNS} FROM instances ORDER BY id").fetchall()
        loaded = [InstanceRow(*row) for row in rows]
        for row in loaded:
            if row.revision > MAX_REVISION:  # written by an older sidecar without the bound
                _log.warning(
                    "instance %s: stored revision %d is above the largest revision "
                    "%d; forget it (kvctl forget %s) and set its limit again",
                    row.id,
                    row.revision,
                    MAX_REVISION,
                    row.id,
                )
        return loaded

    def _get(self, instance_id: str) -> InstanceRow | None:
        row = (
            self._db()
            .execute(f"SELECT {_COLUMNS} FROM instances WHERE id = ?", (instance_id,))
            .fetchone()
        )
        return None if row is None else InstanceRow(*row)

    def _put(self, row: InstanceRow) -> InstanceRow:
        self._db().execute(
            f"INSERT OR REPLACE INTO instances ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
            row.as_tuple(),
        )
        self._seq += 1
        return replace(row, seq=self._seq)

    def _transaction(self, body: Callable[[], _T]) -> _T:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            result = body()
            # a commit to a file deleted or replaced under us would be answered 200 and lost
            # at the next start: refuse it (one stat per write)
            self._check_same_file()
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    def _check_same_file(self) -> None:
        try:
            info = os.stat(self.path)
            same = (info.st_dev, info.st_ino) == self._file_id
        except OSError:
            same = False
        if not same:
            raise StoreError(
                f"the database file {self.path} was deleted or replaced while the sidecar "
                "runs; writes go to a file no one will read: restore it, or restart the "
                "sidecar (desired limits are re-registered by the engines)"
            )

    def _set_desired_sync(
        self, instance_id: str, limit: int | None, revision: int | None
    ) -> tuple[InstanceRow, Decision]:
        return self._transaction(lambda: self._desired(instance_id, limit, revision))

    def _desired(
        self, instance_id: str, limit: int | None, revision: int | None
    ) -> tuple[InstanceRow, Decision]:
        """One desired-limit write, inside the caller's transaction."""
        current = self._get(instance_id) or InstanceRow(instance_id, None, 0, time.time())
        decision = decide(current.limit_bytes, current.revision, limit, revision)
        if not decision.changed:
            return current, decision
        row = replace(
            current, limit_bytes=limit, revision=decision.revision, updated_at=time.time()
        )
        return self._put(row), decision

    def _adopt_sync(self, instance_id: str, limit: int | None, revision: int) -> InstanceRow | None:
        def body() -> InstanceRow | None:
            current = self._get(instance_id) or InstanceRow(instance_id, None, 0, time.time())
            if revision <= current.revision:
                return None
            row = replace(current, limit_bytes=limit, revision=revision, updated_at=time.time())
            return self._put(row)

        return self._transaction(body)

    def _register_sync(self, instance_id: str, reg: Registration) -> InstanceRow:
        def body() -> InstanceRow:
            current = self._get(instance_id) or InstanceRow(instance_id, None, 0, time.time())
            row = replace(
                current,
                engine=reg.engine,
                engine_version=reg.engine_version,
                socket_path=reg.socket_path,
                device_total_bytes=reg.device_total_bytes,
                registered_at=time.time(),
                stopped_at=None,
            )
            return self._put(row)

        return self._transaction(body)

    def _forget_sync(self, instance_id: str) -> bool:
        def body() -> bool:
            cur = self._db().execute("DELETE FROM instances WHERE id = ?", (instance_id,))
            self._seq += 1
            return cur.rowcount > 0

        return self._transaction(body)

    def _stopped_sync(self, instance_id: str, at: float) -> InstanceRow | None:
        def body() -> InstanceRow | None:
            current = self._get(instance_id)
            if current is None or current.registered_at is None:
                return None
            return self._put(replace(current, stopped_at=at))

        return self._transaction(body)

    def _check_writable_sync(self) -> None:
        self._check_same_file()
        self._transaction(
            lambda: self._db().execute(
                "INSERT OR REPLACE INTO ready_probe (k, at) VALUES (1, ?)", (time.time(),)
            )
        )
