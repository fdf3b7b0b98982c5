"""Engine-side operations hardening (issue 14): the runtime-dir sweep and root, settings,
revision bound, and the sidecar client's registration token / deregistration against the
real sidecar app (uvicorn on loopback)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_pool import Pool
from support import ThreadedSidecar

from engine_ext import (
    ElasticInstance,
    EngineBinding,
    EngineExtConfigError,
    LimitMailbox,
    load_engine_settings,
)
from engine_ext._runtime_dir import OWNER_FILE, sweep_stale_runtime_dirs
from engine_ext.protocol import MAX_REVISION, Status
from sidecar import SidecarSettings


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _bind(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()


def _dead_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    (path / OWNER_FILE).write_text(f"{_dead_pid()} 1\n")
    return path


# --- 7. the sweep removes only what the project created ---------------------------------


def test_sweep_removes_exactly_our_files(tmp_path: Path) -> None:
    ours = _dead_dir(tmp_path, "ours")
    _bind(ours / "control.sock")
    (ours / ".owner.4242.tmp").write_text("1 2\n")  # a write_owner interrupted by kill -9
    assert sweep_stale_runtime_dirs(tmp_path) == [ours] and not ours.exists()


@pytest.mark.parametrize(
    "foreign",
    [
        ".owner-notes",
        ".owner.bak",
        ".ownerX",
        "other.sock",
        "control.sock.txt",
        ".owner.12.tmp.keep",
    ],
)
def test_sweep_leaves_a_dead_owners_dir_with_anything_else(tmp_path: Path, foreign: str) -> None:
    path = _dead_dir(tmp_path, "mixed")
    _bind(path / "control.sock")
    if foreign.endswith(".sock"):
        _bind(path / foreign)  # another program's socket
    else:
        (path / foreign).write_text("not kvsidecar's")
    before = sorted(p.name for p in path.iterdir())
    assert sweep_stale_runtime_dirs(tmp_path) == []
    assert sorted(p.name for p in path.iterdir()) == before  # nothing removed at all


def test_sweep_leaves_a_regular_file_named_like_the_socket(tmp_path: Path) -> None:
    path = _dead_dir(tmp_path, "fake")
    (path / "control.sock").write_text("a regular file, not our socket")
    assert sweep_stale_runtime_dirs(tmp_path) == []
    assert (path / "control.sock").read_text().startswith("a regular file")


def test_a_world_writable_runtime_root_is_tightened(pool: Pool, tmp_path: Path) -> None:
    root = tmp_path / "rt"
    root.mkdir()
    os.chmod(root, 0o777)
    settings = load_engine_settings(instance_id="inst-7", runtime_dir=root)
    inst = ElasticInstance(settings, EngineBinding("vllm", "0.33.0", pool.blocks, (pool.cache,)))
    inst.start()
    try:
        mode = stat.S_IMODE(os.stat(root).st_mode)
        assert mode & 0o022 == 0, oct(mode)
    finally:
        inst.close()


def test_an_empty_runtime_dir_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ENABLE", "1")  # off, an unused bad value is only warned about
    monkeypatch.setenv("KVSIDECAR_RUNTIME_DIR", "")
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_RUNTIME_DIR is empty"):
        load_engine_settings()
    monkeypatch.setenv("KVSIDECAR_RUNTIME_DIR", "  ")
    with pytest.raises(EngineExtConfigError, match="KVSIDECAR_RUNTIME_DIR is empty"):
        load_engine_settings()


def test_the_engine_token_is_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_TOKEN", " s3cret\n")
    token = load_engine_settings().token
    assert token is not None and token.get_secret_value() == "s3cret"


# --- 1. the engine never takes a revision past the bound --------------------------------


def test_the_mailbox_refuses_a_revision_past_the_largest() -> None:
    box = LimitMailbox(lambda: None)
    assert box.publish(1 << 20, MAX_REVISION).accepted
    result = box.publish_next(2 << 20)
    assert not result.accepted and result.status is Status.CONFLICT
    assert "largest revision" in (result.message or "")
    assert box.revision == MAX_REVISION and box.desired.limit_bytes == 1 << 20


# --- 4/5. deregistration and one id per process, with the real client -------------------


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[ThreadedSidecar]:
    settings = SidecarSettings(
        db_path=tmp_path / "s.db", push_backoff_initial_s=0.02, push_backoff_max_s=0.2, token="tok"
    )
    with ThreadedSidecar(settings) as server:
        yield server


def _instance(pool: Pool, root: Path, url: str, token: str = "tok") -> ElasticInstance:
    settings = load_engine_settings(
        instance_id="eng-d",
        sidecar_url=url,
        runtime_dir=root,
        heartbeat_s=0.2,
        register_timeout_s=1,
        token=token,
    )
    return ElasticInstance(
        settings,
        EngineBinding("vllm", "0.33.0", pool.blocks, (pool.cache,), wake=threading.Event().set),
    )


def test_a_clean_shutdown_deregisters_and_a_second_process_is_refused(
    pool: Pool, tmp_path: Path, sidecar: ThreadedSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    with httpx.Client(
        base_url=sidecar.url, timeout=30, headers={"Authorization": "Bearer tok"}
    ) as api:
        assert api.put("/instances/eng-d/limit", json={"limit": "1G"}).status_code == 200
        first = _instance(pool, tmp_path / "rt1", sidecar.url)
        first.start()
        try:
            assert first.sidecar is not None and first.sidecar.registered
            # a second engine process on the same id (another replica): refused, said clearly
            second = _instance(pool, tmp_path / "rt2", sidecar.url, token=" tok\n")
            assert second.sidecar is not None
            with caplog.at_level("ERROR", logger="engine_ext.sidecar_client"):
                assert not second.sidecar.register_blocking(timeout_s=0.5)
            assert "held by another live engine process" in caplog.text
            second.sidecar.stop()
            view = api.get("/instances/eng-d").json()
            assert view["engine"]["socket_path"] == first.socket_path
        finally:
            first.close()
        view = api.get("/instances/eng-d").json()
        assert (view["status"], view["reason"]) == ("stopped", "deregistered")
        assert view["desired"]["limit_bytes"] == 1 << 30  # kept for the next start
        again = _instance(pool, tmp_path / "rt2", sidecar.url)
        again.start()  # the id is free again after a clean stop
        try:
            assert again.sidecar is not None and again.sidecar.registered
            assert api.get("/instances/eng-d").json()["status"] != "stopped"
        finally:
            again.close()
