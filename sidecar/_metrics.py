"""Prometheus metrics on the sidecar's own registry (not the process-global one).

The per-instance label is ``kv_instance``: ``instance`` is Prometheus' own
target label, and a scraped ``instance`` label would be renamed
``exported_instance``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, cast

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
from prometheus_client.utils import floatToGoString

from engine_ext.protocol import Status

from ._models import InstanceView
from ._version import build_info

if TYPE_CHECKING:
    from ._waits import WaitSlots

__all__ = ["INSTANCE_LABEL", "Metrics", "instance_text"]

INSTANCE_LABEL = "kv_instance"
_REPORTED = (Status.PENDING, Status.DEFERRED, Status.APPLIED, Status.UNREACHABLE, Status.STOPPED)


#: the per-instance gauges, in exposition order: (name, help)
_INSTANCE_FAMILIES = (
    ("kvsidecar_desired_limit_bytes", "Desired KV limit per GPU (absent: unlimited)"),
    (
        "kvsidecar_effective_limit_bytes",
        "Limit the engine works towards (absent: unlimited or not reported)",
    ),
    ("kvsidecar_mapped_bytes", "KV bytes mapped (largest rank)"),
    ("kvsidecar_capacity_bytes", "KV bytes the instance could map with no limit"),
    ("kvsidecar_evictable_bytes", "Prefix-cache KV bytes the engine could give back now"),
    ("kvsidecar_pinned_bytes", "KV bytes held by running requests"),
    ("kvsidecar_device_total_bytes", "Device memory of one rank, as the engine registered it"),
    ("kvsidecar_overage_bytes", "Mapped bytes above the limit while deferred"),
    ("kvsidecar_desired_revision", "Desired revision"),
    (
        "kvsidecar_last_report_timestamp_seconds",
        "Unix time of the engine's last report or push answer",
    ),
    ("kvsidecar_instance_status", "1 for the instance's current status"),
    ("kvsidecar_deferred", "1 while deferred, labelled with the reason"),
)


#: how prometheus_client writes a value (``1.0``, ``4.294967296e+09``; untyped there)
_float_to_go = cast(Callable[[float], str], floatToGoString)
_EXACT = 1 << 53  # every int below is a float exactly, whose repr is its digits and ".0"


def _go(value: float) -> str:
    """``floatToGoString(value)``, its result exactly; a non-negative int below 2**53
    (bytes, revisions: most values here) without its float round trip (1.5 µs a call,
    most of a scrape's time)."""
    if type(value) is int and 0 <= value < _EXACT:
        if value < 1_000_000:
            return f"{value}.0"
        digits = str(value)  # Go writes 7 or more integer digits as an exponent
        return f"{f'{digits[0]}.{digits[1:]}'.rstrip('0.')}e+{len(digits) - 1:02d}"
    return _float_to_go(value)


def _label_value(value: str) -> str:
    """A label value as the text format quotes it (ids match ID_PATTERN: nothing to escape,
    but a row read from a hand-edited database is not trusted)."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def instance_text(views: Iterable[InstanceView], now: float) -> str:
    """The per-instance gauges in Prometheus' text format, written directly.

    prometheus_client spends ~10 µs per sample building and formatting it; with ~14
    samples per instance a scrape of 1,024 instances held the event loop (which owns
    the instance table) for 75 ms, and every PUT and report waited behind it. The
    values are written as prometheus_client writes them (``floatToGoString``), so the
    text is the same line for line (tests/unit/test_sidecar_metrics_text.py).

    Figures an engine reports (mapped, capacity, evictable, pinned) exist only for
    instances whose engine has reported: an instance known only from a PUT has no
    ``kvsidecar_mapped_bytes`` series rather than a misleading 0.
    """
    go = _go
    lines: list[list[str]] = [[] for _ in _INSTANCE_FAMILIES]
    (desired, effective, mapped, capacity, evictable, pinned, device, overage) = lines[:8]
    revision, last_report, status, deferred = lines[8:]
    names = [name for name, _ in _INSTANCE_FAMILIES]
    statuses = [(st, f'",status="{st.value}"}} ') for st in _REPORTED]
    for view in views:
        iid = _label_value(view.id)
        lab = f'{{kv_instance="{iid}"}} '
        if view.desired.limit_bytes is not None:
            desired.append(f"{names[0]}{lab}{go(view.desired.limit_bytes)}\n")
        if view.effective_limit_bytes is not None:
            effective.append(f"{names[1]}{lab}{go(view.effective_limit_bytes)}\n")
        obs = view.observed
        if obs is not None:
            mapped.append(f"{names[2]}{lab}{go(obs.mapped_bytes)}\n")
            capacity.append(f"{names[3]}{lab}{go(obs.capacity_bytes)}\n")
            evictable.append(f"{names[4]}{lab}{go(obs.evictable_bytes)}\n")
            pinned.append(f"{names[5]}{lab}{go(obs.pinned_bytes)}\n")
            overage.append(f"{names[7]}{lab}{go(view.overage_bytes)}\n")
        if view.engine is not None and view.engine.device_total_bytes is not None:
            device.append(f"{names[6]}{lab}{go(view.engine.device_total_bytes)}\n")
        if view.last_seen_s_ago is not None:
            seen = round(now - view.last_seen_s_ago, 3)
            last_report.append(f"{names[9]}{lab}{go(seen)}\n")
        revision.append(f"{names[8]}{lab}{go(view.desired.revision)}\n")
        head = f'{names[10]}{{kv_instance="{iid}'
        for st, tail in statuses:
            status.append(f"{head}{tail}{'1.0' if view.status is st else '0.0'}\n")
        if view.status is Status.DEFERRED:
            reason = _label_value(view.reason or "unknown")
            deferred.append(f'{names[11]}{{kv_instance="{iid}",reason="{reason}"}} 1.0\n')
    out: list[str] = []
    for (name, doc), samples in zip(_INSTANCE_FAMILIES, lines, strict=True):
        out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")
        out.extend(samples)
    return "".join(out)


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
        self._instances: Callable[[], Iterable[InstanceView]] = list
        self._awaiting: dict[str, tuple[int, float]] = {}  # id -> (revision, monotonic set at)
        self._failure_reasons: dict[str, set[str]] = {}  # id -> reasons with a counter series

    def add_instances(self, snapshot: Callable[[], Iterable[InstanceView]]) -> None:
        """The instance table's gauges, from ``snapshot`` at each scrape (instance_text)."""
        self._instances = snapshot

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
        """The exposition text: the registry's metrics, then the per-instance gauges.
        Event-loop thread (the snapshot reads the instance table)."""
        text = instance_text(self._instances(), time.time())
        return generate_latest(self.registry) + text.encode(), CONTENT_TYPE_LATEST
