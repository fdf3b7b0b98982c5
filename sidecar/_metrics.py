"""Prometheus metrics on the sidecar's own registry (not the process-global one)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_ext.protocol import Status

from ._models import InstanceView
from ._version import build_info

__all__ = ["Metrics"]

_REPORTED = (Status.PENDING, Status.DEFERRED, Status.APPLIED, Status.UNREACHABLE, Status.STOPPED)


class _InstanceCollector(Collector):
    """Per-instance gauges, computed from the instance table at scrape time."""

    def __init__(self, snapshot: Callable[[], Iterable[InstanceView]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        desired = GaugeMetricFamily("kvsidecar_desired_limit_bytes",
                                    "Desired KV limit per GPU (absent: unlimited)", labels=["instance"])
        effective = GaugeMetricFamily("kvsidecar_effective_limit_bytes",
                                      "Limit the engine works towards (absent: unlimited)",
                                      labels=["instance"])
        mapped = GaugeMetricFamily("kvsidecar_mapped_bytes",
                                   "KV bytes mapped (largest rank)", labels=["instance"])
        overage = GaugeMetricFamily("kvsidecar_overage_bytes",
                                    "Mapped bytes above the limit while deferred", labels=["instance"])
        revision = GaugeMetricFamily("kvsidecar_desired_revision",
                                     "Desired revision", labels=["instance"])
        status = GaugeMetricFamily("kvsidecar_instance_status",
                                   "1 for the instance's current status", labels=["instance", "status"])
        for view in self._snapshot():
            iid = view.id
            if view.desired.limit_bytes is not None:
                desired.add_metric([iid], view.desired.limit_bytes)
            if view.effective_limit_bytes is not None:
                effective.add_metric([iid], view.effective_limit_bytes)
            mapped.add_metric([iid], view.mapped_bytes)
            overage.add_metric([iid], view.overage_bytes)
            revision.add_metric([iid], view.desired.revision)
            for st in _REPORTED:
                status.add_metric([iid, st.value], 1.0 if view.status is st else 0.0)
        yield from (desired, effective, mapped, overage, revision, status)


class Metrics:
    """Owns the registry, the push histogram and the failure counter. Event-loop thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.push_seconds = Histogram(
            "kvsidecar_push_seconds", "Latency of one limit push to an engine control socket",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry)
        self.push_failures = Counter(
            "kvsidecar_push_failures", "Limit pushes that failed (the push is retried)",
            ["instance", "reason"], registry=self.registry)
        Info("kvsidecar_build", "Version and build of this sidecar (value always 1)",
             registry=self.registry).info(build_info())

    def add_instances(self, snapshot: Callable[[], Iterable[InstanceView]]) -> None:
        self.registry.register(_InstanceCollector(snapshot))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
