"""A stand-in engine for the autopilot's HTTP tests: it reports over the real sidecar API.

It holds what its last report said: ``sync()`` reads the desired limit (as the
push would deliver it) and reports it held; with ``apply=True`` it also gives
back what is over the limit (``applied``), else stays ``deferred`` above it.
Its demand (``pinned``/``waiting``) is set by the test.
"""

from __future__ import annotations

from typing import Any

import httpx

from engine_ext.protocol import EngineState, RegisterBody, Status

GiB = 1 << 30
PAGE = 64 << 20  # one page bundle


def post_register(
    client: httpx.Client, iid: str, state: EngineState, capacity: int, device: str | None
) -> httpx.Response:
    """A stand-in engine's registration over the real API."""
    body = RegisterBody(
        engine="sim",
        engine_version="0",
        socket_path=None,
        device_total_bytes=capacity,
        state=state,
        device_id=device,
    )
    return client.post(
        f"/instances/{iid}/register",
        content=body.model_dump_json(),
        headers={"content-type": "application/json"},
    )


def post_report(client: httpx.Client, iid: str, state: EngineState) -> httpx.Response:
    """A stand-in engine's status report over the real API."""
    return client.post(
        f"/instances/{iid}/report",
        content=state.model_dump_json(),
        headers={"content-type": "application/json"},
    )


class SimEngine:
    """One stand-in engine on one device (test thread only)."""

    def __init__(
        self,
        client: httpx.Client,
        iid: str,
        device: str | None,
        *,
        mapped: int = 0,
        capacity: int = 16 * GiB,
        floor: int = 0,
    ) -> None:
        self.client = client
        self.iid = iid
        self.device = device
        self.mapped = max(mapped, floor)
        self.capacity = capacity
        self.floor = floor  # what it never gives back (vLLM's null block page)
        self.pinned = 0
        self.waiting = 0
        self.reserved = 0  # the running requests' remaining output (the output reservation)
        self.revision = 0
        self.limit: int | None = None

    def state(self, *, apply: bool) -> EngineState:
        limit = self.limit
        effective = None if limit is None else max(limit, self.floor)
        if apply and effective is not None:
            self.mapped = min(self.mapped, effective)
        # the output reservation: the running requests end at mapped + reserved; a limit
        # below that is deferred (also while what is mapped is under it)
        over = 0 if effective is None else max(0, self.mapped + self.reserved - effective)
        busy = self.pinned or self.waiting or self.reserved
        return EngineState(
            status=Status.DEFERRED if over else Status.APPLIED,
            revision=self.revision,
            limit_bytes=limit,
            effective_limit_bytes=effective if self.floor else None,
            floor_bytes=self.floor,
            mapped_bytes=self.mapped,
            overage_bytes=over,
            reason="running_requests" if over else None,
            capacity_bytes=self.capacity,
            page_bundle_bytes=PAGE,
            pinned_bytes=min(self.pinned, self.mapped),
            num_running_requests=1 if busy else 0,
            num_waiting_requests=1 if self.waiting else 0,
            waiting_bytes=self.waiting,
            reserved_bytes=self.reserved,
        )

    def register(self, device: str | None = None) -> httpx.Response:
        state = self.state(apply=False)
        r = post_register(self.client, self.iid, state, self.capacity, device or self.device)
        if r.status_code == 200:
            self._take(r.json())
        return r

    def sync(self, *, apply: bool = True, grow: bool = True) -> dict[str, Any]:
        """Take the desired limit, report; ``grow``: map up to the demand under the limit."""
        view = self.client.get(f"/instances/{self.iid}").json()
        self._take(
            {"limit": view["desired"]["limit_bytes"], "revision": view["desired"]["revision"]}
        )
        if grow and apply:
            want = self.pinned + self.waiting
            cap = self.capacity if self.limit is None else self.limit
            self.mapped = max(self.mapped, min(want, cap))
            if self.mapped >= self.pinned + self.waiting:
                self.pinned, self.waiting = self.pinned + self.waiting, 0
        r = post_report(self.client, self.iid, self.state(apply=apply))
        assert r.status_code == 200, r.text
        return view

    def _take(self, reply: dict[str, Any]) -> None:
        if reply["revision"] > self.revision:
            self.revision, self.limit = reply["revision"], reply["limit"]
