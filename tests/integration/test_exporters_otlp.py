"""OpenTelemetry over OTLP/HTTP to a real local receiver that decodes the protobuf requests: the same
metrics as the Prometheus endpoint with resource service.name=spectuner, and a span per decision with
an apply span under it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.exporter_fixtures import NOW, SERVER, WINDOW_S, fill
from tests.integration.receivers import OtlpReceiver
from tuner.controller.audit import TickResult
from tuner.exporters.service import ExportService
from tuner.exporters.settings import ExportersSection
from tuner.exporters.values import METRICS
from tuner.store import Store, upgrade


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    url = f"sqlite:///{tmp_path / 'otlp.db'}"
    upgrade(url)
    with Store(url) as store:
        yield store


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


def service_for(store: Store, endpoint: str) -> ExportService:
    settings = ExportersSection.model_validate(
        {
            "window_s": WINDOW_S,
            # A long interval: the test decides when to export (flush), the timer never races it.
            "otlp": {"enabled": True, "endpoint": endpoint, "interval_s": 600, "headers": {"x-tenant": "t1"}},
        }
    )
    return ExportService(store, settings, clock=lambda: NOW, metrics_url=SERVER, cost_ratio=0.05)


def test_metrics_arrive_with_the_same_values_as_prometheus(sqlite_store: Store, receiver: OtlpReceiver) -> None:
    ids = fill(sqlite_store)
    svc = service_for(sqlite_store, receiver.url)
    svc.start()
    try:
        assert svc.otlp is not None and svc.otlp.flush()
    finally:
        svc.stop()
    assert ids
    points = list(receiver.metric_points())
    assert points, "no metrics arrived"
    assert all(res["service.name"] == "spectuner" for res, *_ in points)
    assert receiver.requests[0].headers["x-tenant"] == "t1"
    assert receiver.requests[0].headers["content-type"] == "application/x-protobuf"
    got = {(name, tuple(sorted(attrs.items()))): value for _, name, attrs, value in points}
    want = {(s.name, tuple(sorted(s.labels))): s.value for s in svc.samples()}
    assert want and got == want  # every sample, same labels, same values
    assert {name for name, _ in got} <= set(METRICS)


def test_counters_are_cumulative_monotonic_sums(sqlite_store: Store, receiver: OtlpReceiver) -> None:
    fill(sqlite_store)
    svc = service_for(sqlite_store, receiver.url)
    svc.start()
    try:
        assert svc.otlp is not None and svc.otlp.flush()
    finally:
        svc.stop()
    kinds = {}
    for req in receiver.metrics:
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kinds[m.name] = m.WhichOneof("data")
                    if m.WhichOneof("data") == "sum":
                        assert m.sum.is_monotonic and m.sum.aggregation_temporality == 2  # CUMULATIVE
    assert kinds["spectuner_decisions_total"] == "sum" and kinds["spectuner_alpha"] == "gauge"


def test_a_span_per_decision_and_per_apply(sqlite_store: Store, receiver: OtlpReceiver) -> None:
    ids = fill(sqlite_store)
    svc = service_for(sqlite_store, receiver.url)
    svc.start()
    try:
        start = time.time_ns()
        svc.record_tick(TickResult("hold", "keep", "K=3 is best"), start_ns=start, end_ns=start + 1000)
        svc.record_tick(
            TickResult("applied", "applied", "restarted with K=4", ids["applied"]), start_ns=start, end_ns=start + 5000
        )
        svc.record_tick(TickResult("failed", "apply_failed", "did not start"), start_ns=start, end_ns=start + 9000)
        assert svc.tracer is not None and svc.tracer.flush()
    finally:
        svc.stop()
    spans = receiver.spans()
    assert all(res["service.name"] == "spectuner" for res, _ in spans)
    by_name: dict[str, list[Any]] = {}
    for _, span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert len(by_name["spectuner.decision"]) == 3 and len(by_name["spectuner.apply"]) == 2

    def attrs(span: Any) -> dict[str, Any]:
        return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}

    applied = next(s for s in by_name["spectuner.decision"] if attrs(s)["spectuner.action"] == "applied")
    a = attrs(applied)
    assert a["spectuner.decision_id"] == ids["applied"] and a["spectuner.predicted_gain"] == pytest.approx(1.25)
    assert a["spectuner.realized_gain"] == pytest.approx(1.18) and a["spectuner.model_name"] == "llama"
    assert applied.end_time_unix_nano - applied.start_time_unix_nano == 5000
    child = next(s for s in by_name["spectuner.apply"] if attrs(s)["spectuner.outcome"] == "applied")
    assert child.parent_span_id == applied.span_id and child.trace_id == applied.trace_id
    failed = next(s for s in by_name["spectuner.apply"] if attrs(s)["spectuner.outcome"] == "failed")
    assert failed.status.code == 2  # STATUS_CODE_ERROR


def test_a_down_endpoint_is_logged_once_not_every_export(caplog: pytest.LogCaptureFixture) -> None:
    import time

    from tuner.engine.process import free_port
    from tuner.exporters.otel import OtlpMetricsExporter
    from tuner.exporters.settings import OtlpSection
    from tuner.exporters.values import METRICS, Sample

    port = free_port()
    settings = OtlpSection(enabled=True, endpoint=f"http://127.0.0.1:{port}", interval_s=0.2, timeout_s=0.3)
    caplog.set_level(logging.WARNING, logger="opentelemetry")
    exporter = OtlpMetricsExporter(lambda: [Sample(next(iter(METRICS)), (), 1.0)], settings)
    try:
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # a dozen more failed exports
    finally:
        exporter.shutdown()
    failures = [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert f"OTLP export to http://127.0.0.1:{port}" in failures[0].getMessage()
