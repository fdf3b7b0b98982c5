"""``kvsidecar serve`` freezes what start-up built before it serves (sidecar/_gc.py):
checked in a real ``serve`` process, its server's ``run`` replaced by a probe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.net import free_port

PROBE = """
import gc, sys, uvicorn
from sidecar import cli

def run(self, *args, **kwargs):
    print("frozen", gc.get_freeze_count(), flush=True)

uvicorn.Server.run = run
sys.argv = ["kvsidecar", "serve", "--port", sys.argv[1], "--db", sys.argv[2]]
cli.main()
"""


def test_serve_freezes_its_start_up_objects_before_it_serves(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(free_port()), str(tmp_path / "s.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,  # the return code is asserted with the probe's stderr
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("frozen ")]
    assert len(lines) == 1, done.stdout
    # the modules, the app and its models: tens of thousands of objects
    assert int(lines[0].split()[1]) > 10_000, lines
