"""A rank that acknowledges an unmap it never applied (well-formed, in order, wrong).

Its acks are the only figures the channel has of it, so they would say it maps
what the limit allows while its address space still maps every page: the
owner punches the pages out and the barrier says ``confirmed``: the engine's
passes take acks at their word (a read of every rank's maps per release would
cost more than the release). ``RankedBackend.probe`` reads each rank's view in
the kernel's own list, ``/proc/<pid>/maps``, and catches it; here the test reads
the same file to show what the rank really maps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from allocator import BackendError, HostBackend, PageLayout
from engine_ext.ranks import RankChannelBarrier, RankedBackend, memfd_view

from ._accepting import accept_ranks

LAYOUT = PageLayout(page_bytes=4096, num_pages=8, num_regions=2)
REPO = Path(__file__).resolve().parents[3]

_LYING_RANK = """
import sys
from engine_ext.ranks import RankWorker

class LyingRank(RankWorker):
    kept = 0  # pages it acknowledged unmapping and still maps

    def _apply(self, message):
        if message["op"] == "unmap":
            self.kept += len(message["pages"])
            return
        super()._apply(message)

    def _ack(self, seq, *, measure=False):
        ack = super()._ack(seq, measure=measure)
        bundle = self.backend.layout.bundle_bytes if self.backend is not None else 0
        return ack._replace(
            mapped_bytes=ack.mapped_bytes - self.kept * bundle,
            mapped_pages=ack.mapped_pages - self.kept,
        )

sys.exit(LyingRank(sys.argv[1], int(sys.argv[2])).run())
"""


def _view_pages(pid: int, name: str) -> int:
    return sum(length for _, length in memfd_view(pid, name)) // LAYOUT.bundle_bytes


def test_a_rank_that_acks_an_unmap_it_never_applied_is_caught_by_probe(
    tmp_path: Path,
) -> None:
    name = "kvs-lying-rank"
    path = str(tmp_path / "r.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    group, procs = accept_ranks(
        path,
        lambda: [
            subprocess.Popen(
                [sys.executable, "-m", "engine_ext.ranks", "--socket", path, "--rank", "0"],
                env=env,
            ),
            subprocess.Popen([sys.executable, "-c", _LYING_RANK, path, "1"], env=env),
        ],
    )
    owner = HostBackend.reserve(LAYOUT, name=name)
    try:
        backend = RankedBackend.start(owner, group, tp=2, pp=1, block_bytes=1024, slot_bytes=64)
        barrier = RankChannelBarrier(backend, wait_s=10.0)
        backend.map_many([1, 2, 3])
        assert barrier.sync().outcome.value == "confirmed"  # nothing released yet: no lie
        backend.unmap_many([2, 3])
        backend.flush()  # the unmap leaves with the probe; both acked, in order
        assert group.wait(group.broadcast("probe"), 10.0).value == "confirmed"
        liar = procs[1].pid
        assert group.states()[1].mapped_bytes == LAYOUT.bundle_bytes  # its word: one page
        assert _view_pages(liar, name) == 3  # the kernel's: three
        assert barrier.sync().outcome.value == "confirmed"  # the passes take its word
        with pytest.raises(BackendError, match=rf"/proc/{liar}/maps shows") as caught:
            backend.probe(10.0)  # the kernel's word
        assert "restart the instance" in str(caught.value)
        result = barrier.sync()
        assert result.outcome.value == "rank_failed", result
        assert [(s.alive, s.mapped_bytes) for s in result.ranks] == [
            (True, LAYOUT.bundle_bytes),
            (False, 0),
        ]
        assert procs[1].wait(30) == -signal.SIGKILL  # a rank that lies maps nothing any more
        why = group.describe(result.outcome)
        assert f"rank 1 (pid {liar})" in why and f"/proc/{liar}/maps" in why
        assert "restart the instance" in why
        assert _view_pages(procs[0].pid, name) == len(owner.mapped_pages()) == 1
    finally:
        group.close()
        owner.release()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[0].returncode == 0
