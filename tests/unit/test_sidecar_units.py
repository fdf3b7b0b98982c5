"""Sidecar pieces without HTTP: revision rules, the SQLite store, status, settings, exports."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path

import pytest

import sidecar
from engine_ext.protocol import EngineState, Status
from sidecar import RevisionRejectedError, SidecarConfigError, SidecarSettings, default_db_path
from sidecar._instances import InstanceRecord, derive_status
from sidecar._kvctl_render import bar
from sidecar._revisions import Decision, decide
from sidecar._store import InstanceRow, Registration, Store

GiB = 1 << 30


@pytest.mark.parametrize(
    ("cur_limit", "cur_rev", "limit", "rev", "expected"),
    [
        (None, 0, GiB, None, Decision(1, True)),  # none given: the next one
        (GiB, 7, None, None, Decision(8, True)),
        (GiB, 7, 2 * GiB, 9, Decision(9, True)),  # newer: accepted, gaps allowed
        (GiB, 7, GiB, 7, Decision(7, False)),  # same revision, same limit: idempotent
        (None, 7, None, 7, Decision(7, False)),
    ],
)
def test_decide_accepts(
    cur_limit: int | None, cur_rev: int, limit: int | None, rev: int | None, expected: Decision
) -> None:
    assert decide(cur_limit, cur_rev, limit, rev) == expected


@pytest.mark.parametrize(
    ("limit", "rev", "status"),
    [
        (2 * GiB, 7, Status.CONFLICT),
        (None, 7, Status.CONFLICT),
        (GiB, 6, Status.STALE),
        (GiB, 1, Status.STALE),
    ],
)
def test_decide_rejects(limit: int | None, rev: int, status: Status) -> None:
    with pytest.raises(RevisionRejectedError) as info:
        decide(GiB, 7, limit, rev)
    assert info.value.status is status and info.value.current_revision == 7
    assert "send a revision above 7" in info.value.detail


def _rows(db: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT * FROM instances ORDER BY id").fetchall()


def test_store_durable_wal_and_unchanged_on_rejection(tmp_path: Path) -> None:
    db = tmp_path / "deep" / "s.db"

    async def scenario() -> None:
        store = Store(db)
        await store.open()
        row, decision = await store.set_desired("a", GiB, None)
        assert (row.limit_bytes, row.revision, decision.changed) == (GiB, 1, True)
        before = _rows(db)
        with pytest.raises(RevisionRejectedError):
            await store.set_desired("a", 2 * GiB, 1)
        assert _rows(db) == before
        assert await store.adopt("a", 5 * GiB, 1) is None  # not newer: ignored
        adopted = await store.adopt("a", 5 * GiB, 4)
        assert adopted is not None and (adopted.limit_bytes, adopted.revision) == (5 * GiB, 4)
        reg = await store.register("a", Registration("vllm", "0.33.0", "/run/a.sock", 8 * GiB))
        assert (reg.revision, reg.socket_path, reg.device_total_bytes) == (
            4,
            "/run/a.sock",
            8 * GiB,
        )
        assert reg.seq > adopted.seq > row.seq  # write order, for the in-memory mirror
        await store.check_writable()
        await store.close()

    asyncio.run(scenario())
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert _rows(db)[0][:3] == ("a", 5 * GiB, 4)

    async def reopen() -> list[InstanceRow]:
        store = Store(db)
        await store.open()
        try:
            return await store.load_all()
        finally:
            await store.close()

    (loaded,) = asyncio.run(reopen())
    assert (loaded.limit_bytes, loaded.revision, loaded.engine) == (5 * GiB, 4, "vllm")


def test_store_writes_many_limits_in_one_commit_all_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``set_desired_many``: one transaction for the lot, in order; a revision an engine
    overtook becomes the next one; a write refused half-way leaves every row as it was."""
    db = tmp_path / "s.db"

    async def scenario() -> None:
        store = Store(db)
        await store.open()
        try:
            await store.set_desired("a", GiB, None)
            await store.adopt("b", 2 * GiB, 5)  # b's engine reported revision 5
            commits = []
            transaction = store._transaction
            monkeypatch.setattr(
                store, "_transaction", lambda body: commits.append(1) or transaction(body)
            )
            results = await store.set_desired_many(
                [("a", 3 * GiB, None), ("b", 4 * GiB, 3), ("c", None, 2)]
            )
            assert len(commits) == 1
            assert [(r.id, r.limit_bytes, r.revision, d.changed) for r, d in results] == [
                ("a", 3 * GiB, 2, True),
                ("b", 4 * GiB, 6, True),  # 3 is stale against 5: the next one
                ("c", None, 2, True),
            ]
            before = _rows(db)
            put, calls = store._put, []

            def failing(row: InstanceRow) -> InstanceRow:
                calls.append(row.id)
                if len(calls) == 2:
                    raise sqlite3.OperationalError("disk I/O error")
                return put(row)

            monkeypatch.setattr(store, "_put", failing)
            with pytest.raises(sidecar.StoreError):
                await store.set_desired_many([("a", GiB, None), ("b", GiB, None)])
            assert calls == ["a", "b"] and _rows(db) == before
        finally:
            await store.close()

    asyncio.run(scenario())


def test_store_refuses_a_newer_schema_and_an_unwritable_path(tmp_path: Path) -> None:
    db = tmp_path / "future.db"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA user_version=99")

    async def open_(path: Path) -> None:
        store = Store(path)
        try:
            await store.open()
        finally:
            await store.close()

    with pytest.raises(SidecarConfigError, match="schema version 99"):
        asyncio.run(open_(db))
    (tmp_path / "file").write_text("")
    with pytest.raises(SidecarConfigError, match="KVSIDECAR_DB_PATH"):
        asyncio.run(open_(tmp_path / "file" / "s.db"))


def _record(
    observed: EngineState | None,
    *,
    revision: int = 1,
    registered: bool = True,
    last_seen: float | None = 100.0,
) -> InstanceRecord:
    row = InstanceRow(
        "a",
        GiB,
        revision,
        0.0,
        registered_at=1.0 if registered else None,
        socket_path="/run/a.sock" if registered else None,
    )
    return InstanceRecord(row, observed=observed, last_seen=last_seen)


def _file_bytes(path: Path) -> bytes:
    return path.read_bytes() + b"".join(
        p.read_bytes() for p in sorted(path.parent.glob(path.name + "-*"))
    )


def _open_and_close(path: Path) -> None:
    async def run() -> None:
        store = Store(path)
        try:
            await store.open()
        finally:
            await store.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("script", "refusal"),
    [
        # another program's database: its tables, a view, its own use of user_version 0
        ("CREATE TABLE users (id, name); INSERT INTO users VALUES (1, 'a');", "users"),
        ("CREATE TABLE t (a); CREATE VIEW v AS SELECT a FROM t;", "t, v"),
        # a table with our name and another shape, at version 0
        ("CREATE TABLE instances (x); INSERT INTO instances VALUES (1);", "schema version 0"),
        # a version from the future
        ("CREATE TABLE instances (x); PRAGMA user_version=99;", "schema version 99"),
    ],
)
def test_store_leaves_a_file_it_refuses_byte_for_byte(
    tmp_path: Path, script: str, refusal: str
) -> None:
    """A refused file keeps its bytes: no kvsidecar table, no version, no journal mode."""
    path = tmp_path / "theirs.db"
    conn = sqlite3.connect(path)
    conn.executescript(script)
    conn.close()
    before = _file_bytes(path)
    with pytest.raises(SidecarConfigError, match=refusal) as caught:
        _open_and_close(path)
    assert "KVSIDECAR_DB_PATH" in str(caught.value) or "--db" in str(caught.value)
    assert _file_bytes(path) == before


def test_store_takes_the_lock_before_it_touches_the_file(tmp_path: Path) -> None:
    """A second (maybe newer) sidecar started on a served database is refused before it
    migrates anything under the one that serves it."""
    import fcntl
    import os

    path = tmp_path / "served.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE instances (id TEXT PRIMARY KEY, limit_bytes INTEGER,"
        " revision INTEGER NOT NULL, updated_at REAL NOT NULL, engine TEXT,"
        " engine_version TEXT, socket_path TEXT, device_total_bytes INTEGER,"
        " registered_at REAL, stopped_at REAL) STRICT;"
        "CREATE TABLE policies (id TEXT PRIMARY KEY, pin_revision INTEGER) STRICT;"
        "PRAGMA user_version=4;"
    )
    conn.close()
    before = _file_bytes(path)
    held = os.open(path, os.O_RDWR)  # the serving sidecar's lock
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SidecarConfigError, match="another kvsidecar serves"):
            _open_and_close(path)
        assert _file_bytes(path) == before
    finally:
        os.close(held)
    _open_and_close(path)  # once free, the same file is migrated
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    conn.close()


def test_derive_status() -> None:
    applied = EngineState(status=Status.APPLIED, revision=1, limit_bytes=GiB)
    deferred = EngineState(status=Status.DEFERRED, revision=1, limit_bytes=GiB, reason="evicting")
    other = EngineState(status=Status.APPLIED, revision=1, limit_bytes=2 * GiB)
    unlimited = EngineState(status=Status.APPLIED, revision=1, limit_bytes=None)
    cases = [
        (_record(None, registered=False, last_seen=None), (Status.PENDING, "not_registered")),
        (_record(None), (Status.PENDING, "awaiting_report")),
        (_record(applied, revision=2), (Status.PENDING, "push_in_flight")),
        (_record(applied), (Status.APPLIED, None)),
        (_record(deferred), (Status.DEFERRED, "evicting")),
        # the same revision number with another limit is never "applied"
        (_record(other), (Status.PENDING, "limit_mismatch")),
        (_record(unlimited), (Status.PENDING, "limit_mismatch")),
        (_record(applied, last_seen=80.0), (Status.UNREACHABLE, "no_heartbeat")),
        (_record(None, last_seen=80.0), (Status.UNREACHABLE, "no_heartbeat")),
    ]
    for rec, expected in cases:
        assert derive_status(rec, now=100.0, heartbeat_timeout_s=15.0) == expected


def test_needs_push() -> None:
    assert _record(None).needs_push()
    assert not _record(None, registered=False).needs_push()  # no socket to push to
    assert not _record(EngineState(status=Status.APPLIED, revision=1)).needs_push()
    assert _record(EngineState(status=Status.APPLIED, revision=1), revision=2).needs_push()


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "kvsidecar" / "sidecar.db"
    monkeypatch.setenv("KVSIDECAR_PORT", "9000")
    monkeypatch.setenv("KVSIDECAR_TOKEN", "  ")
    settings = SidecarSettings()
    assert (settings.host, settings.port, settings.token) == ("127.0.0.1", 9000, None)
    assert settings.db_path == tmp_path / "kvsidecar" / "sidecar.db"
    monkeypatch.setenv("KVSIDECAR_PUSH_BACKOFF_INITIAL_S", "10")
    with pytest.raises(ValueError, match="BACKOFF"):
        SidecarSettings()


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("KVSIDECAR_MAX_INSTANCES", "0"),
        ("KVSIDECAR_SHUTDOWN_GRACE_S", "-1"),
        ("KVSIDECAR_SHUTDOWN_GRACE_S", "soon"),
        ("KVSIDECAR_LOG_FORMAT", "xml"),
        ("KVSIDECAR_LOG_LEVEL", "verbose"),
        ("KVSIDECAR_KEEPALIVE_TIMEOUT_S", "0"),
        ("KVSIDECAR_MAX_WAITS", "0"),
        ("KVSIDECAR_AUTOPILOT_INTERVAL_S", "1e-9"),  # a busy loop on the event loop
        ("KVSIDECAR_PUSH_BACKOFF_INITIAL_S", "0"),
        ("KVSIDECAR_MAX_WAITS", "many"),
        ("KVSIDECAR_DB_PATH", ""),  # "." otherwise: the working directory
        ("KVSIDECAR_DB_PATH", "  "),
        # not finite, or past any sensible bound: a push or a request that never times out
        *(
            (f"KVSIDECAR_{name}", value)
            for name in (
                "HEARTBEAT_TIMEOUT_S",
                "PUSH_TIMEOUT_S",
                "PUSH_BACKOFF_MAX_S",
                "HEADER_TIMEOUT_S",
                "BODY_TIMEOUT_S",
            )
            for value in ("inf", "nan", "1e400", "1e9")
        ),
    ],
)
def test_bad_new_settings_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=env.removeprefix("KVSIDECAR_").lower()):
        SidecarSettings()


def test_max_waits_defaults_to_half_the_connections_and_never_exceeds_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert SidecarSettings().wait_slots == 128  # half of the default 256 connections
    monkeypatch.setenv("KVSIDECAR_MAX_CONNECTIONS", "9")
    assert SidecarSettings().wait_slots == 4
    monkeypatch.setenv("KVSIDECAR_MAX_WAITS", "9")
    assert SidecarSettings().wait_slots == 9  # every connection, on purpose
    monkeypatch.setenv("KVSIDECAR_MAX_WAITS", "10")
    with pytest.raises(ValueError, match="KVSIDECAR_MAX_WAITS .10. must not exceed"):
        SidecarSettings()


def test_bar_scales_to_the_limit_and_marks_overage() -> None:
    assert bar(GiB, 2 * GiB, 0).plain.count("█") == 12
    over = bar(3 * GiB, 2 * GiB, 0)
    assert over.plain.count("█") == 24 and over.style == "red"
    assert bar(GiB, 2 * GiB, 0).style == "green"
    assert bar(GiB, None, 4 * GiB).plain.count("█") == 6  # unlimited: against capacity


def test_exports_are_sorted_and_resolve() -> None:
    assert sidecar.__all__ == sorted(sidecar.__all__)
    for name in sidecar.__all__:
        assert getattr(sidecar, name) is not None


def test_serve_refuses_a_bad_database_path_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sidecar.cli import app

    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(app, ["serve", "--db", str(tmp_path / "file" / "s.db")])
    assert result.exit_code == 2
    assert "set KVSIDECAR_DB_PATH (or --db) to a writable file" in result.output
    assert "Traceback" not in result.output


def test_decide_never_computes_a_revision_past_the_bound() -> None:
    from engine_ext.protocol import MAX_REVISION

    assert decide(GiB, MAX_REVISION - 1, GiB, None) == Decision(MAX_REVISION, True)
    with pytest.raises(RevisionRejectedError, match="largest revision") as info:
        decide(GiB, MAX_REVISION, 2 * GiB, None)
    assert info.value.status is Status.CONFLICT


def _consistent(rng: random.Random) -> EngineState:
    """A random state the real coordinator could send (see ShrinkCoordinator._compute)."""
    from engine_ext.protocol import RankState

    num = rng.randint(1, 4)
    ranks = [RankState(rank=r, mapped_bytes=rng.randrange(0, 8 * GiB)) for r in range(num)]
    mapped = max(r.mapped_bytes for r in ranks)
    limit = rng.choice([None, rng.randrange(0, 8 * GiB)])
    floor = rng.randrange(0, 64 << 20)
    effective = None if limit is None else max(limit, floor)
    over = 0 if effective is None else max(0, mapped - effective)
    bundle = rng.choice([2 << 20, 64 << 20])
    # the output reservation: the running requests' remaining output counts in the
    # overage, in whole bundles, when it does not fit under the limit (it may exceed mapped)
    reserved = rng.randrange(0, 8 * GiB) if rng.random() < 0.3 else 0
    if reserved and effective is not None:
        in_use = rng.randint(0, mapped)
        shortfall = max(0, in_use + reserved - effective)
        over = max(over, -(-shortfall // bundle) * bundle)
    applied = over == 0 and rng.random() < 0.7
    return EngineState(
        page_bundle_bytes=bundle,
        reserved_bytes=reserved,
        status=Status.APPLIED if applied else Status.DEFERRED,
        revision=rng.randint(1, 50),
        limit_bytes=limit,
        effective_limit_bytes=effective,
        floor_bytes=floor,
        mapped_bytes=mapped,
        overage_bytes=over,
        num_ranks=num,
        ranks=ranks,
        reason=None if applied else "evicting",
    )


def test_report_rules_accept_every_consistent_state_and_catch_each_lie() -> None:
    """Fuzzed: 2000 states shaped like the coordinator's pass; one lie each is caught."""
    from sidecar._reports import report_problem

    rng = random.Random(14)
    for _ in range(2000):
        state = _consistent(rng)
        assert report_problem(state, state.limit_bytes, state.revision) is None, state
        assert (
            report_problem(state, rng.choice([None, 1]), rng.randint(0, 60)) is None
            or state.status is Status.APPLIED
        )
        if state.status is not Status.APPLIED or state.effective_limit_bytes is None:
            continue
        lies = [
            {"mapped_bytes": state.effective_limit_bytes + 1 + state.mapped_bytes},
            {"overage_bytes": 1},
            {"ranks": [r.model_copy(update={"alive": r.rank != 0}) for r in state.ranks]},
            {"effective_limit_bytes": (state.limit_bytes or 0) - 1}
            if state.limit_bytes
            else {"overage_bytes": 2},
            {"mapped_bytes": max(r.mapped_bytes for r in state.ranks) - 1}
            if max(r.mapped_bytes for r in state.ranks) > 0
            else {"overage_bytes": 3},
        ]
        for lie in lies:
            forged = state.model_copy(update=lie)
            assert report_problem(forged, state.limit_bytes, state.revision) is not None, lie
