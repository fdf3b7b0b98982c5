"""The rank channel in an engine process that holds more than 1024 descriptors.

A vLLM or SGLang engine raises its open-file limit and may hold many files and
connections; every rank socket and pidfd it opens then has a number above
1023, which ``select`` cannot take (FD_SETSIZE). Real rank processes, real
sockets; what each rank maps is read from its ``/proc/<pid>/maps``.
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_ext.protocol import Status

from ._toy import BLOCK_SIZE, ToyEngine

FILLER = 1100  # descriptors opened first: everything the group opens is numbered above 1024


@pytest.fixture
def many_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FILLER + 256
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"the hard open-file limit ({hard}) is below {want}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    filler = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(FILLER)]
    try:
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_ranks_work_when_the_engine_holds_over_1024_descriptors(
    tmp_path: Path, many_fds: None
) -> None:
    engine = ToyEngine(tmp_path, 2, 1, name="kvs-many-fds")
    try:
        group = engine.group
        fds = [r.fd for r in group._ranks] + [r.pidfd for r in group._ranks if r.pidfd]
        assert min(fds) >= 1024, fds  # the case under test
        req = engine.admit([5] * (3 * BLOCK_SIZE) + [6])
        assert req is not None
        engine.decode(req, 3)
        engine.finish(req)
        engine.instance.set_limit(0)
        state = engine.instance.step()
        for _ in range(50):
            if state.status is Status.APPLIED:
                break
            engine.woken.wait(5)
            engine.woken.clear()
            state = engine.instance.step()
        assert state.status is Status.APPLIED, state
        for pid in group.pids:  # applied: no rank maps a page, per the kernel
            assert engine.rank_pages(pid) == set()
        # an idle rank's death still wakes the engine (the watcher sleeps on its pidfd)
        engine.woken.clear()
        os.kill(group.pids[1], signal.SIGKILL)
        assert engine.woken.wait(30), "an idle rank's death did not wake the engine"
        state = engine.instance.step()
        assert state.status is Status.DEFERRED and state.reason == "rank_failed", state
    finally:
        engine.close()
