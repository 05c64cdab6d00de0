"""OpenTelemetry metrics: the same samples as observable instruments, pushed by OTLP/HTTP.

A private ``MeterProvider`` (never the global one: a library must not take over the process's
telemetry, and tests run several) with a ``PeriodicExportingMetricReader`` around an
``OTLPMetricExporter``; resource ``service.name=spectuner``. Gauges are observable gauges; counters are
observable counters reporting the running totals (cumulative temporality).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from tuner.exporters.failure_log import FailureLog, for_endpoint
from tuner.exporters.settings import OtlpSection
from tuner.exporters.values import METRICS, Sample

log = logging.getLogger(__name__)

SERVICE_NAME = "spectuner"


def resource() -> Resource:
    from tuner import __version__

    return Resource.create({"service.name": SERVICE_NAME, "service.version": __version__})


class _MetricExporter(OTLPMetricExporter):
    """OTLP/HTTP metrics that tell the endpoint's :class:`FailureLog` when an export works again."""

    def __init__(self, failures: FailureLog, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._failures = failures

    def export(self, metrics_data: Any, timeout_millis: float | None = 10_000, **kwargs: Any) -> MetricExportResult:
        result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        if result is MetricExportResult.SUCCESS:
            self._failures.succeeded()
        return result


class OtlpMetricsExporter:
    def __init__(self, samples: Callable[[], Sequence[Sample]], settings: OtlpSection) -> None:
        self._samples = samples
        exporter = _MetricExporter(
            for_endpoint(settings.endpoint),
            endpoint=f"{settings.endpoint}/v1/metrics",
            headers=dict(settings.headers),
            timeout=settings.timeout_s,
        )
        self.reader = PeriodicExportingMetricReader(
            exporter,
            export_interval_millis=settings.interval_s * 1000.0,
            export_timeout_millis=settings.timeout_s * 1000.0,
        )
        self.provider = MeterProvider(resource=resource(), metric_readers=[self.reader])
        meter = self.provider.get_meter("spectuner")
        for name, spec in METRICS.items():
            callback = self._callback(name)
            if spec.kind == "counter":
                meter.create_observable_counter(name, callbacks=[callback], description=spec.help, unit=spec.unit)
            else:
                meter.create_observable_gauge(name, callbacks=[callback], description=spec.help, unit=spec.unit)
        log.info("otlp exporter: metrics to %s/v1/metrics every %g s", settings.endpoint, settings.interval_s)

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(s.value, dict(s.labels)) for s in self._samples() if s.name == name]

        return observe

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export now (tests, shutdown)."""
        return bool(self.provider.force_flush(timeout_millis=int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self.provider.shutdown()
