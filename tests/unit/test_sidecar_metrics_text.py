"""The per-instance gauges are written directly (sidecar/_metrics.py ``instance_text``): the
text must be what prometheus_client writes for the same families, line for line, and parse
back to the same samples."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from support.metrics_reference import STATUSES, reference_text

from engine_ext.protocol import EngineState, Status
from sidecar._metrics import Metrics, _go, instance_text
from sidecar._models import DesiredLimit, EngineInfo, InstanceView

_BYTES = st.integers(min_value=0, max_value=1 << 60) | st.sampled_from([0, 10**6, 1 << 53])
_EDGES = [0, 1, 999_999, 10**6, 10**6 + 1, 1_048_576, 10**7, (1 << 53) - 1, 1 << 53, 10**16, 0.5]
_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


@st.composite
def _view(draw: st.DrawFn, iid: str) -> InstanceView:
    status = draw(st.sampled_from(STATUSES))
    observed = None
    if draw(st.booleans()):
        observed = EngineState(
            status=draw(st.sampled_from([Status.APPLIED, Status.DEFERRED])),
            mapped_bytes=draw(_BYTES),
            capacity_bytes=draw(_BYTES),
            evictable_bytes=draw(_BYTES),
            pinned_bytes=draw(_BYTES),
        )
    engine = None
    if draw(st.booleans()):
        engine = EngineInfo(
            engine="vllm",
            engine_version="0.33.0",
            socket_path=None,
            device_total_bytes=draw(st.none() | _BYTES),
            registered_at=1.7e9,
        )
    return InstanceView(
        id=iid,
        status=status,
        reason=draw(st.none() | st.sampled_from(["running_requests", "rank_timeout"])),
        desired=DesiredLimit(
            limit_bytes=draw(st.none() | _BYTES),
            revision=draw(st.integers(0, 1 << 40)),
            updated_at=1.7e9,
        ),
        effective_limit_bytes=draw(st.none() | _BYTES),
        mapped_bytes=0 if observed is None else observed.mapped_bytes,
        overage_bytes=draw(_BYTES),
        last_seen_s_ago=draw(st.none() | st.floats(0, 1e6, allow_nan=False)),
        engine=engine,
        observed=observed,
    )


@st.composite
def _views(draw: st.DrawFn) -> list[InstanceView]:
    ids = draw(st.lists(_IDS, max_size=12, unique=True))
    return [draw(_view(i)) for i in sorted(ids)]


@given(st.integers(0, 1 << 64) | st.floats(allow_nan=False) | st.sampled_from(_EDGES))
def test_values_are_written_as_prometheus_client_writes_them(value: float) -> None:
    assert _go(value) == floatToGoString(value)


@settings(max_examples=200, deadline=None)
@given(_views(), st.floats(1e9, 2e9, allow_nan=False))
def test_the_direct_text_is_what_prometheus_client_writes(
    views: list[InstanceView], now: float
) -> None:
    assert instance_text(views, now) == reference_text(views, now)


def _unreported(iid: str, status: Status, reason: str, *, limit: int) -> InstanceView:
    """An instance with a desired limit whose engine never reported."""
    return InstanceView(
        id=iid,
        status=status,
        reason=reason,
        desired=DesiredLimit(limit_bytes=limit, revision=1, updated_at=0.0),
        effective_limit_bytes=None,
        mapped_bytes=0,
        overage_bytes=0,
        last_seen_s_ago=None,
        engine=None,
        observed=None,
    )


def test_a_label_value_that_needs_quoting_is_escaped_as_the_format_says() -> None:
    """Ids match ID_PATTERN, but a row from a hand-edited database is not trusted."""
    odd = _unreported('a"b\\c\nd', Status.DEFERRED, 'x"y', limit=1)
    now = time.time()
    text = instance_text([odd], now)
    assert text == reference_text([odd], now)
    parsed = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    key = ("kvsidecar_deferred", (("kv_instance", 'a"b\\c\nd'), ("reason", 'x"y')))
    assert parsed[key] == 1.0


def test_the_sidecar_metrics_carry_the_instances_and_the_registry() -> None:
    metrics = Metrics()
    view = _unreported("llama-a", Status.PENDING, "not_registered", limit=4 << 30)
    metrics.add_instances(lambda: [view])
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    assert "kvsidecar_push_seconds_bucket" in text
    assert 'kvsidecar_desired_limit_bytes{kv_instance="llama-a"} 4.294967296e+09' in text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"kvsidecar_instance_status", "kvsidecar_push_seconds"} <= names
    assert "kvsidecar_build_info{" in text
