"""Samples every instance's status from the sidecar, for the plot and the status timeline."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Sample", "Sampler"]


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float  # seconds since the demo started, when the GET was sent (not when it returned)
    instance_id: str
    status: str
    mapped_bytes: int
    limit_bytes: int | None
    reason: str | None


@dataclass
class Sampler:
    """A daemon thread polling ``GET /instances`` every ``period_s`` (reads only)."""

    sidecar_url: str
    t0: float
    period_s: float = 0.05
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="demo-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.wait(self.period_s):
                sent = time.monotonic() - self.t0  # the state read is at least this new
                try:
                    body: dict[str, Any] = client.get(self.sidecar_url + "/instances").json()
                except (httpx.HTTPError, ValueError):
                    continue
                for view in body.get("instances", []):
                    self.samples.append(
                        Sample(
                            t_s=sent,
                            instance_id=view["id"],
                            status=view["status"],
                            mapped_bytes=int(view["mapped_bytes"]),
                            limit_bytes=view["desired"]["limit_bytes"],
                            reason=view.get("reason"),
                        )
                    )

    def transitions(self, instance_id: str, since_s: float) -> list[dict[str, Any]]:
        """Status changes of one instance in samples sent at or after ``since_s``.

        Timestamps are relative to ``since_s``. A caller that takes ``since_s``
        after its own request returned sees only states that follow that request.
        """
        out: list[dict[str, Any]] = []
        last: str | None = None
        for s in list(self.samples):
            if s.instance_id != instance_id or s.t_s < since_s:
                continue
            if s.status != last:
                out.append(
                    {
                        "t_s": round(s.t_s - since_s, 3),
                        "status": s.status,
                        "reason": s.reason,
                        "mapped_mib": round(s.mapped_bytes / 2**20, 3),
                    }
                )
                last = s.status
        return out
