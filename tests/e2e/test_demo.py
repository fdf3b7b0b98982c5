"""The README's main job, run for real: ``kvsidecar demo`` (quick mode).

Asserts on ``demo-results.json`` (the figures), never on printed text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp("demo-out")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.cli",
            "demo",
            "--quick",
            "--idle-s",
            "2",
            "--out",
            str(out),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    results_path = out / "demo-results.json"
    assert results_path.exists(), (
        f"no demo-results.json; output:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    assert (out / "demo-mapped.png").stat().st_size > 0
    return proc.returncode, json.loads(results_path.read_text())


def test_demo_exits_zero_and_every_check_passes(demo: tuple[int, dict[str, Any]]) -> None:
    code, results = demo
    failed = [
        c for part in ("limit_table", "elastic") for c in results[part]["checks"] if not c["ok"]
    ]
    assert not failed
    assert results["ok"] is True and code == 0


def test_limit_table_with_reclaim_fits_and_without_does_not(
    demo: tuple[int, dict[str, Any]],
) -> None:
    rows = demo[1]["limit_table"]["rows"]
    assert len(rows) >= 2
    for r in rows:
        assert r["with_idle_mib"] <= r["limit_mib"]
        assert r["with_after_traffic_mib"] <= r["limit_mib"]
        assert r["with_idle_status"] == "applied"
        assert r["without_idle_mib"] > r["limit_mib"]
        assert r["without_after_traffic_mib"] > r["limit_mib"]


def test_status_goes_to_applied_for_the_reclaiming_engine(demo: tuple[int, dict[str, Any]]) -> None:
    for timeline in demo[1]["limit_table"]["status_timelines"].values():
        steps = timeline["with-reclaim"]
        assert steps and steps[-1]["status"] == "applied"
        assert "applied" not in [s["status"] for s in timeline["without-reclaim"]]


def test_elastic_colocation_figures(demo: tuple[int, dict[str, Any]]) -> None:
    e = demo[1]["elastic"]
    assert e["a_after_reset_mib"] < e["peak_a_mib"]
    assert e["peak_b_mib"] > e["free_at_a_peak_mib"]
    assert sum(e["end_mapped_mib"].values()) <= e["budget_mib"]
    assert e["probes_identical"] is True
    assert all(n == 16 for n in e["completed"].values())


def test_samples_cover_both_engines(demo: tuple[int, dict[str, Any]]) -> None:
    ids = {s["instance_id"] for s in demo[1]["samples"]}
    assert {"with-reclaim", "without-reclaim", "engine-b"} <= ids
