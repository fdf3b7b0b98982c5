"""Issue 11: SIGTERM and SIGINT remove the runtime dir of an SGLang scheduler process.

A real subprocess runs the adapter over the CPU harness as a scheduler
process does (the pool attached on its main thread, a scheduler-like loop),
then gets the signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from engine_ext import EngineSettings
    from engine_ext.sglang import prepare_cpu_imports
    prepare_cpu_imports()
    from engine_ext.cpu_harness import CpuHarness, HarnessConfig

    settings = EngineSettings(enable=True, runtime_dir=Path(sys.argv[1]), instance_id="sig")
    h = CpuHarness(settings, HarnessConfig(signal_cleanup=True))
    for i in range(4):
        h.submit([(i * 37 + j) % 2000 + 1 for j in range(40)], max_new_tokens=3)
    h.run_until_idle()
    print("ready", flush=True)
    while True:  # the scheduler's loop: spin idle iterations until a signal ends it
        h.iterate()
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_removes_the_runtime_dir(tmp_path: Path, signum: signal.Signals) -> None:
    runtime = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(runtime)],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read() if child.stderr else line
        instance_dir = runtime / "sig"
        assert (instance_dir / ".owner").exists() and (instance_dir / "control.sock").exists()
        child.send_signal(signum)
        rc = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pipe in (child.stdout, child.stderr):  # closed here, not left to the collector
            if pipe is not None:
                pipe.close()
    assert rc != 0  # the signal still ends the process (SGLang's own handling runs after)
    assert not instance_dir.exists(), sorted(p.name for p in instance_dir.iterdir())
