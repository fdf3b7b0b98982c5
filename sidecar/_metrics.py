"""Prometheus metrics on the sidecar's own registry (not the process-global one).

The per-instance label is ``kv_instance``: ``instance`` is Prometheus' own
target label, and a scraped ``instance`` label would be renamed
``exported_instance``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_ext.protocol import Status

from ._models import InstanceView
from ._version import build_info

if TYPE_CHECKING:
    from ._waits import WaitSlots

__all__ = ["INSTANCE_LABEL", "Metrics"]

INSTANCE_LABEL = "kv_instance"
_REPORTED = (Status.PENDING, Status.DEFERRED, Status.APPLIED, Status.UNREACHABLE, Status.STOPPED)
_L = [INSTANCE_LABEL]


def _gauge(name: str, doc: str, labels: list[str] = _L) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class _InstanceCollector(Collector):
    """Per-instance gauges, computed from the instance table at scrape time.

    Figures an engine reports (mapped, capacity, evictable, pinned) exist only
    for instances whose engine has reported: an instance known only from a PUT
    has no ``kvsidecar_mapped_bytes`` series rather than a misleading 0.
    """

    def __init__(self, snapshot: Callable[[], Iterable[InstanceView]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        desired = _gauge(
            "kvsidecar_desired_limit_bytes", "Desired KV limit per GPU (absent: unlimited)"
        )
        effective = _gauge(
            "kvsidecar_effective_limit_bytes",
            "Limit the engine works towards (absent: unlimited or not reported)",
        )
        mapped = _gauge("kvsidecar_mapped_bytes", "KV bytes mapped (largest rank)")
        capacity = _gauge(
            "kvsidecar_capacity_bytes", "KV bytes the instance could map with no limit"
        )
        evictable = _gauge(
            "kvsidecar_evictable_bytes", "Prefix-cache KV bytes the engine could give back now"
        )
        pinned = _gauge("kvsidecar_pinned_bytes", "KV bytes held by running requests")
        device = _gauge(
            "kvsidecar_device_total_bytes", "Device memory of one rank, as the engine registered it"
        )
        overage = _gauge("kvsidecar_overage_bytes", "Mapped bytes above the limit while deferred")
        revision = _gauge("kvsidecar_desired_revision", "Desired revision")
        last_report = _gauge(
            "kvsidecar_last_report_timestamp_seconds",
            "Unix time of the engine's last report or push answer",
        )
        status = _gauge(
            "kvsidecar_instance_status",
            "1 for the instance's current status",
            [INSTANCE_LABEL, "status"],
        )
        deferred = _gauge(
            "kvsidecar_deferred",
            "1 while deferred, labelled with the reason",
            [INSTANCE_LABEL, "reason"],
        )
        now = time.time()
        for view in self._snapshot():
            iid = [view.id]
            if view.desired.limit_bytes is not None:
                desired.add_metric(iid, view.desired.limit_bytes)
            if view.effective_limit_bytes is not None:
                effective.add_metric(iid, view.effective_limit_bytes)
            obs = view.observed
            if obs is not None:
                mapped.add_metric(iid, obs.mapped_bytes)
                capacity.add_metric(iid, obs.capacity_bytes)
                evictable.add_metric(iid, obs.evictable_bytes)
                pinned.add_metric(iid, obs.pinned_bytes)
                overage.add_metric(iid, view.overage_bytes)
            if view.engine is not None and view.engine.device_total_bytes is not None:
                device.add_metric(iid, view.engine.device_total_bytes)
            if view.last_seen_s_ago is not None:
                last_report.add_metric(iid, round(now - view.last_seen_s_ago, 3))
            revision.add_metric(iid, view.desired.revision)
            for st in _REPORTED:
                status.add_metric([view.id, st.value], 1.0 if view.status is st else 0.0)
            if view.status is Status.DEFERRED:
                deferred.add_metric([view.id, view.reason or "unknown"], 1.0)
        yield from (
            desired,
            effective,
            mapped,
            capacity,
            evictable,
            pinned,
            device,
            overage,
            revision,
            last_report,
            status,
            deferred,
        )


class _WaitCollector(Collector):
    """The waiting clients (long-polls, event streams) against their cap, at scrape time."""

    def __init__(self, waits: WaitSlots) -> None:
        self._waits = waits

    def collect(self) -> Iterator[Metric]:
        waits = self._waits
        yield GaugeMetricFamily(
            "kvsidecar_waiting_clients",
            "Clients waiting in the app now: ?wait= long-polls and ?watch=1 streams",
            value=waits.in_use,
        )
        yield GaugeMetricFamily(
            "kvsidecar_max_waits", "Cap on waiting clients (KVSIDECAR_MAX_WAITS)", value=waits.limit
        )
        yield CounterMetricFamily(
            "kvsidecar_waits_refused",
            "Waits refused with 503 because KVSIDECAR_MAX_WAITS clients already waited",
            value=waits.refused,
        )


class Metrics:
    """Owns the registry, the histograms and the failure counter. Event-loop thread.

    ``limit_set``/``observed`` time each desired revision from the PUT that
    stored it to the first view showing it applied (``kvsidecar_apply_seconds``).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.push_seconds = Histogram(
            "kvsidecar_push_seconds",
            "Latency of one limit push to an engine control socket",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.apply_seconds = Histogram(
            "kvsidecar_apply_seconds",
            "From storing a desired limit (PUT) to the engine reporting it applied",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.push_failures = Counter(
            "kvsidecar_push_failures",
            "Limit pushes that failed (the push is retried)",
            [INSTANCE_LABEL, "reason"],
            registry=self.registry,
        )
        self.retention_forgotten = Counter(
            "kvsidecar_retention_forgotten",
            "Instances forgotten because their engine was gone longer than "
            "KVSIDECAR_FORGET_AFTER_S",
            registry=self.registry,
        )
        Info(
            "kvsidecar_build",
            "Version and build of this sidecar (value always 1)",
            registry=self.registry,
        ).info(build_info())
        self._awaiting: dict[str, tuple[int, float]] = {}  # id -> (revision, monotonic set at)
        self._failure_reasons: dict[str, set[str]] = {}  # id -> reasons with a counter series

    def add_instances(self, snapshot: Callable[[], Iterable[InstanceView]]) -> None:
        self.registry.register(_InstanceCollector(snapshot))

    def add_waits(self, waits: WaitSlots) -> None:
        self.registry.register(_WaitCollector(waits))

    def limit_set(self, instance_id: str, revision: int) -> None:
        """A new desired revision was stored: its apply latency starts now."""
        self._awaiting[instance_id] = (revision, time.monotonic())

    def observed(self, view: InstanceView) -> None:
        """The instance changed: record the apply latency once its revision shows applied."""
        pending = self._awaiting.get(view.id)
        if pending is None or view.status is not Status.APPLIED or view.observed is None:
            return
        revision, since = pending
        if view.observed.revision >= revision:
            del self._awaiting[view.id]
            self.apply_seconds.observe(time.monotonic() - since)

    def push_failed(self, instance_id: str, reason: str) -> None:
        """Count one failed push (``kvsidecar_push_failures``)."""
        self.push_failures.labels(instance_id, reason).inc()
        self._failure_reasons.setdefault(instance_id, set()).add(reason)

    def retention_forgot(self) -> None:
        """One instance forgotten by the retention sweep (``kvsidecar_retention_forgotten``)."""
        self.retention_forgotten.inc()

    def forget(self, instance_id: str) -> None:
        """The instance was forgotten: drop its pending apply timing and its counter series
        (its gauges go with it from the instance table)."""
        self._awaiting.pop(instance_id, None)
        for reason in self._failure_reasons.pop(instance_id, ()):
            self.push_failures.remove(instance_id, reason)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
