"""The per-instance gauges as prometheus_client builds and writes them: the reference the
sidecar's direct text (``sidecar._metrics.instance_text``) must equal, line for line
(tests/unit/test_sidecar_metrics_text.py), and what bench/bench_metrics.py times it against."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_ext.protocol import Status
from sidecar._models import InstanceView

__all__ = ["STATUSES", "PrometheusClientReference", "reference_text"]

STATUSES = (Status.PENDING, Status.DEFERRED, Status.APPLIED, Status.UNREACHABLE, Status.STOPPED)


class PrometheusClientReference(Collector):
    """The families as prometheus_client builds them (what the sidecar used until
    2026-12-07): the reference the direct text is compared with."""

    def __init__(self, views: list[InstanceView], now: float) -> None:
        self.views, self.now = views, now

    def collect(self) -> Iterator[Metric]:
        lab = ["kv_instance"]
        fams = {
            "desired": GaugeMetricFamily(
                "kvsidecar_desired_limit_bytes",
                "Desired KV limit per GPU (absent: unlimited)",
                labels=lab,
            ),
            "effective": GaugeMetricFamily(
                "kvsidecar_effective_limit_bytes",
                "Limit the engine works towards (absent: unlimited or not reported)",
                labels=lab,
            ),
            "mapped": GaugeMetricFamily(
                "kvsidecar_mapped_bytes", "KV bytes mapped (largest rank)", labels=lab
            ),
            "capacity": GaugeMetricFamily(
                "kvsidecar_capacity_bytes",
                "KV bytes the instance could map with no limit",
                labels=lab,
            ),
            "evictable": GaugeMetricFamily(
                "kvsidecar_evictable_bytes",
                "Prefix-cache KV bytes the engine could give back now",
                labels=lab,
            ),
            "pinned": GaugeMetricFamily(
                "kvsidecar_pinned_bytes", "KV bytes held by running requests", labels=lab
            ),
            "device": GaugeMetricFamily(
                "kvsidecar_device_total_bytes",
                "Device memory of one rank, as the engine registered it",
                labels=lab,
            ),
            "overage": GaugeMetricFamily(
                "kvsidecar_overage_bytes", "Mapped bytes above the limit while deferred", labels=lab
            ),
            "revision": GaugeMetricFamily(
                "kvsidecar_desired_revision", "Desired revision", labels=lab
            ),
            "last": GaugeMetricFamily(
                "kvsidecar_last_report_timestamp_seconds",
                "Unix time of the engine's last report or push answer",
                labels=lab,
            ),
            "status": GaugeMetricFamily(
                "kvsidecar_instance_status",
                "1 for the instance's current status",
                labels=["kv_instance", "status"],
            ),
            "deferred": GaugeMetricFamily(
                "kvsidecar_deferred",
                "1 while deferred, labelled with the reason",
                labels=["kv_instance", "reason"],
            ),
        }
        for v in self.views:
            i = [v.id]
            if v.desired.limit_bytes is not None:
                fams["desired"].add_metric(i, v.desired.limit_bytes)
            if v.effective_limit_bytes is not None:
                fams["effective"].add_metric(i, v.effective_limit_bytes)
            if v.observed is not None:
                fams["mapped"].add_metric(i, v.observed.mapped_bytes)
                fams["capacity"].add_metric(i, v.observed.capacity_bytes)
                fams["evictable"].add_metric(i, v.observed.evictable_bytes)
                fams["pinned"].add_metric(i, v.observed.pinned_bytes)
                fams["overage"].add_metric(i, v.overage_bytes)
            if v.engine is not None and v.engine.device_total_bytes is not None:
                fams["device"].add_metric(i, v.engine.device_total_bytes)
            if v.last_seen_s_ago is not None:
                fams["last"].add_metric(i, round(self.now - v.last_seen_s_ago, 3))
            fams["revision"].add_metric(i, v.desired.revision)
            for s in STATUSES:
                fams["status"].add_metric([v.id, s.value], 1.0 if v.status is s else 0.0)
            if v.status is Status.DEFERRED:
                fams["deferred"].add_metric([v.id, v.reason or "unknown"], 1.0)
        yield from fams.values()


def reference_text(views: list[InstanceView], now: float) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PrometheusClientReference(views, now))
    return generate_latest(registry).decode()
