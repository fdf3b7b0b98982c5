"""A full disk under ``kvsidecar serve``: writes are refused clearly, nothing is lost.

The disk is made full for the sidecar process alone: its file-size limit
(``RLIMIT_FSIZE``, set from outside with ``prlimit``) is lowered to what its
database already holds, and it ignores ``SIGXFSZ`` (``trap`` before exec), so a
write past the limit fails with ``EFBIG`` as one on a full disk fails with
``ENOSPC``: SQLite answers "database or disk is full".
"""

from __future__ import annotations

import resource
from pathlib import Path

import httpx
from test_sidecar_support import SidecarProcess, db_rows

MiB = 1 << 20


#: runs its arguments with SIGXFSZ ignored (an ignored signal stays ignored across exec)
IGNORE_SIGXFSZ = ["bash", "-c", "trap '' XFSZ; exec \"$@\"", "ignore-sigxfsz"]


def _file_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))


def test_a_full_disk_refuses_writes_with_503_and_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "sidecar.db"
    sidecar = SidecarProcess(db, wrapper=IGNORE_SIGXFSZ).start()
    assert sidecar.proc is not None
    pid = sidecar.proc.pid
    try:
        with httpx.Client(base_url=sidecar.url, timeout=10) as c:
            for i in range(5):
                assert c.put(f"/instances/kept{i}/limit", json={"limit": "1G"}).status_code == 200
            acked = {
                iid: c.get(f"/instances/{iid}").json()["desired"]
                for iid in (f"kept{i}" for i in range(5))
            }
            # the disk fills: no file of this process may grow
            full = max(_file_bytes(db), 1)
            hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (full, hard))
            refused = 0
            for i in range(200):  # new rows and new revisions until the WAL cannot grow
                iid = f"new{i}" if i % 2 else f"kept{i % 5}"
                r = c.put(f"/instances/{iid}/limit", json={"limit": f"{2 + i}M"})
                if r.status_code == 200:
                    acked[iid] = r.json()["desired"]
                    continue
                refused += 1
                assert r.status_code == 503, r.text
                assert r.headers["content-type"].startswith("application/problem+json")
                assert "disk" in r.json()["detail"].lower(), r.json()
                if refused >= 5:
                    break
            assert refused >= 5, "the database never filled the disk"
            assert c.get("/healthz").status_code == 200  # alive; reads still answer
            for iid, desired in acked.items():
                got = c.get(f"/instances/{iid}").json()["desired"]
                assert (got["limit_bytes"], got["revision"]) == (
                    desired["limit_bytes"],
                    desired["revision"],
                ), iid
            # space again: writes work, nothing acknowledged before was lost
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
            r = c.put("/instances/after/limit", json={"limit": "3G"})
            assert r.status_code == 200, r.text
            acked["after"] = r.json()["desired"]
    finally:
        sidecar.stop()
    rows = {row[0]: (row[1], row[2]) for row in db_rows(db)}
    for iid, desired in acked.items():
        assert rows[iid] == (desired["limit_bytes"], desired["revision"]), iid
