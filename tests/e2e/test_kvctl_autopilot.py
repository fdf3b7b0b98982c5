"""kvctl's autopilot commands (devices, budget, policy, device-limits) against a real sidecar."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from autopilot_sim import GiB, SimEngine
from support import ThreadedSidecar, wait_until
from typer.testing import CliRunner

from sidecar import SidecarSettings
from sidecar.kvctl import app

runner = CliRunner()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ThreadedSidecar]:
    with ThreadedSidecar(
        SidecarSettings(db_path=tmp_path / "s.db", autopilot_interval_s=0.05)
    ) as s:
        yield s


def kvctl(server: ThreadedSidecar, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["--url", server.url, *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_devices_budget_policy_and_device_limits(server: ThreadedSidecar) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        a, b = SimEngine(c, "a", "gpu-0"), SimEngine(c, "b", "gpu-0")
        a.register(), b.register()
        code, out = kvctl(server, "devices")
        assert code == 0 and "gpu-0: budget unlimited" in out and "  a: applied" in out
        code, out = kvctl(server, "policy", "a", "--min", "1G", "--weight", "2")
        assert code == 0 and "device gpu-0" in out
        assert c.get("/instances/a").json()["policy"]["weight"] == 2
        code, out = kvctl(server, "budget", "gpu-0", "6G")
        assert code == 0 and "gpu-0: budget 6GiB" in out
        wait_until(
            lambda: (
                a.sync(),
                b.sync(),
                5 * GiB
                < (c.get("/devices/gpu-0").json()["sum_limits_bytes"] or 1 << 62)
                <= 6 * GiB,
            )[2]
        )
        code, out = kvctl(server, "devices", "gpu-0", "--json")
        assert code == 0 and json.loads(out)["budget_bytes"] == 6 * GiB
        code, out = kvctl(server, "status", "a")
        assert "source policy" in out
        code, out = kvctl(server, "device-limits", "gpu-0", "a=2G", "b=4G")
        assert code == 0 and "pinned" in out
        # usage errors and refusals: one line, non-zero, nothing changed
        code, out = kvctl(server, "budget", "gpu-0", "1G")
        assert code == 1 and "below what its instances are promised" in out
        code, out = kvctl(server, "budget", "nope", "1G")
        assert code == 1 and "not known" in out
        code, out = kvctl(server, "policy", "a", "--weight", "-1")
        assert code == 2 and "above 0" in out
        code, out = kvctl(server, "device-limits", "gpu-0", "a2G")
        assert code == 2 and "ID=SIZE" in out
        assert c.get("/devices/gpu-0").json()["budget_bytes"] == 6 * GiB
        code, out = kvctl(server, "budget", "gpu-0", "none")
        assert code == 0 and "budget unlimited" in out


def test_device_limits_refuse_an_instance_given_twice(server: ThreadedSidecar) -> None:
    """``a=1G a=4G`` pinned a at 4 GiB (the last pair won, silently): now a usage error,
    and nothing is pinned."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        a = SimEngine(c, "a", "gpu-0")
        a.register()
        before = c.get("/instances/a").json()
        code, out = kvctl(server, "device-limits", "gpu-0", "a=1G", "a=4G")
        assert code == 2 and "'a' is given twice" in out, out
        assert len(out.strip().splitlines()) == 1
        after = c.get("/instances/a").json()
        assert after["desired"] == before["desired"] and not after["policy"]["pinned"]


@pytest.mark.parametrize("interval", ["inf", "1e300"])
def test_watch_refuses_an_interval_it_cannot_sleep(server: ThreadedSidecar, interval: str) -> None:
    """``--interval inf`` drew one refresh, then time.sleep raised OverflowError."""
    result = runner.invoke(
        app, ["--url", server.url, "watch", "--count", "2", "--interval", interval]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit) and "--interval" in result.output


def test_the_budget_refused_over_an_unlimited_pin_names_kvctl_commands_that_work(
    server: ThreadedSidecar,
) -> None:
    """A budget over an instance pinned to unlimited is 409 with the commands that fix it;
    they named ``kvctl set`` and ``kvctl clear``, which kvctl does not have. Each command
    named runs, and doing what it says lets the budget through."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        a = SimEngine(c, "a", "gpu-0")
        assert a.register().status_code == 200
        code, out = kvctl(server, "limit", "a", "none")  # no budget yet: an unlimited pin
        assert code == 0, out
        code, out = kvctl(server, "budget", "gpu-0", "6G")
        assert code != 0 and "pinned to unlimited" in out, out
        named = re.findall(r"kvctl (\w[\w-]*) a\b", out)
        assert named, out
        for command in named:
            result = runner.invoke(app, [command, "--help"])
            assert result.exit_code == 0, f"kvctl {command}: {result.output}"
        code, out = kvctl(server, "delete", "a")
        assert code == 0, out
        code, out = kvctl(server, "budget", "gpu-0", "6G")
        assert code == 0 and "gpu-0: budget 6GiB" in out, out
