"""The autopilot over real HTTP against engines that admit, grow, finish and defer at random.

Each stand-in engine plays vLLM with the output reservation
(``KVSIDECAR_RESERVE_OUTPUT=1``), as the sidecar cannot see it: it admits a
request only when its prompt and whole output fit beside the running
requests' under the limit it holds; its outputs grow at random; a finished
request's pages stay as evictable cache; it takes a new limit only when it
syncs, evicts cache down to it, and reports (``deferred`` while the running
requests' end is above the limit, also when what it maps is under it). An
operator moves the instances' ``max`` at random, which forces shrinks the
demand alone would not ask for. Reports, pushes and autopilot passes
interleave as they happen.

What must hold at every moment, from the engines' own figures: what they map
adds up to at most the budget, and so does where their running requests end
(what is mapped for them plus the output still to come).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from autopilot_sim import post_register, post_report
from support import ThreadedSidecar, wait_until

from engine_ext.protocol import EngineState, Status
from sidecar import SidecarSettings

DEV = "gpu-0"
PAGE = 64 << 20
BUDGET = 128 * PAGE  # 8 GiB
CAPACITY = 256 * PAGE


@dataclass
class _Request:
    pages: int  # mapped for it now
    left: int  # pages its output may still add


@dataclass
class _Engine:
    """One engine's truth (test thread only)."""

    client: httpx.Client
    iid: str
    limit: int | None = None
    revision: int = 0
    cached: int = 0  # evictable pages (finished requests' prefixes)
    running: list[_Request] = field(default_factory=list)
    queue: list[tuple[int, int]] = field(default_factory=list)  # (prompt, output) pages

    @property
    def pinned(self) -> int:
        return sum(r.pages for r in self.running)

    @property
    def reserved(self) -> int:
        return sum(r.left for r in self.running)

    @property
    def mapped(self) -> int:
        return self.pinned + self.cached

    def _cap(self) -> int:
        return CAPACITY // PAGE if self.limit is None else self.limit // PAGE

    def _evict(self) -> None:
        """Cache is evicted down to the limit; a running request's pages never are."""
        self.cached = max(0, min(self.cached, self._cap() - self.pinned))

    def _admit(self) -> None:
        """The queue's head starts only if its prompt and whole output fit (reservation)."""
        while self.queue:
            prompt, output = self.queue[0]
            if self.pinned + self.reserved + prompt + output > self._cap():
                return
            self.queue.pop(0)
            self.running.append(_Request(prompt, output))
            self._evict()

    def arrive(self, prompt: int, output: int) -> None:
        self.queue.append((prompt, output))
        self._admit()

    def grow(self, rng: random.Random) -> None:
        growing = [r for r in self.running if r.left]
        if growing:
            r = rng.choice(growing)
            step = rng.randint(1, r.left)
            r.left -= step
            r.pages += step
            self._evict()

    def finish(self, rng: random.Random) -> None:
        if self.running:
            r = self.running.pop(rng.randrange(len(self.running)))
            self.cached += r.pages  # its prefix stays cached
            self._evict()
            self._admit()

    def state(self) -> EngineState:
        cap = None if self.limit is None else self._cap()
        mapped, pinned, reserved = self.mapped, self.pinned, self.reserved
        over = 0 if cap is None else max(0, mapped - cap, pinned + reserved - cap)
        waiting = sum(p + o for p, o in self.queue[:1])
        return EngineState(
            status=Status.DEFERRED if over else Status.APPLIED,
            revision=self.revision,
            limit_bytes=self.limit,
            effective_limit_bytes=self.limit,
            mapped_bytes=mapped * PAGE,
            overage_bytes=over * PAGE,
            reason="running_requests" if over else None,
            capacity_bytes=CAPACITY,
            page_bundle_bytes=PAGE,
            pinned_bytes=pinned * PAGE,
            reserved_bytes=reserved * PAGE,
            evictable_bytes=self.cached * PAGE,
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.queue),
            waiting_bytes=waiting * PAGE,
        )

    def register(self) -> None:
        r = post_register(self.client, self.iid, self.state(), CAPACITY, DEV)
        assert r.status_code == 200, r.text

    def sync(self) -> None:
        """Take the desired limit (as a push would deliver it), evict, admit, report."""
        desired = self.client.get(f"/instances/{self.iid}").json()["desired"]
        if desired["revision"] > self.revision:
            self.revision, self.limit = desired["revision"], desired["limit_bytes"]
        self._evict()
        self._admit()
        r = post_report(self.client, self.iid, self.state())
        assert r.status_code == 200, r.text


def _check(engines: list[_Engine], what: str) -> None:
    mapped = sum(e.mapped for e in engines)
    ends = sum(e.pinned + e.reserved for e in engines)
    detail = {e.iid: (e.limit, e.pinned, e.reserved, e.cached) for e in engines}
    assert mapped * PAGE <= BUDGET, f"{what}: mapped {mapped} pages > budget: {detail}"
    assert ends * PAGE <= BUDGET, f"{what}: requests end at {ends} pages > budget: {detail}"


@pytest.mark.parametrize("seed", range(6))
def test_what_engines_map_and_will_map_stays_within_the_budget(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    settings = SidecarSettings(
        db_path=tmp_path / "f.db", autopilot_interval_s=0.02, autopilot_busy_hold_s=0.2
    )
    with ThreadedSidecar(settings) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        engines = [_Engine(c, name) for name in ("a", "b", "c")]
        for e in engines:
            e.register()
        assert c.put(f"/devices/{DEV}/budget", json={"budget": BUDGET}).status_code == 200
        wait_until(
            lambda: all((e.sync(), e.limit is not None)[1] for e in engines),
            what="every engine holds a budget limit",
        )
        for step in range(400):
            e = rng.choice(engines)
            roll = rng.random()
            if roll < 0.25:
                e.arrive(rng.randint(1, 12), rng.randint(0, 40))
            elif roll < 0.5:
                e.grow(rng)
            elif roll < 0.6:
                e.finish(rng)
            elif roll < 0.65:  # an operator moves the instance's max (or lifts it)
                top = rng.choice([None, rng.randint(0, 96) * PAGE])
                r = c.put(f"/instances/{e.iid}/policy", json={"max": top})
                assert r.status_code == 200, r.text
            else:
                e.sync()
            _check(engines, f"step {step}")
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0, 0.03))  # let passes run between the engines' moves
        for e in engines:  # the outputs come, the requests finish, the queues drain
            while e.running:
                e.grow(rng)
                _check(engines, "draining")
                e.finish(rng)
                e.sync()

        def settled() -> bool:
            for e in engines:
                e.queue.clear()
                e.sync()
                _check(engines, "settling")
            dev = c.get(f"/devices/{DEV}").json()
            return all(m["status"] == "applied" for m in dev["instances"])

        wait_until(settled, what="every instance applied")
        dev = c.get(f"/devices/{DEV}").json()
        assert dev["sum_limits_bytes"] <= BUDGET, dev
