"""The exporters as one service the daemon starts and stops: refresh job, Prometheus, OTLP, tracer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from tuner.controller.audit import TickResult
from tuner.exporters.settings import ExportersSection
from tuner.exporters.source import StoreSource
from tuner.exporters.values import Sample, job_samples
from tuner.store import Store, UnknownRecordError

if TYPE_CHECKING:
    from tuner.exporters.otel import OtlpMetricsExporter
    from tuner.exporters.prometheus import PrometheusExporter
    from tuner.exporters.tracing import DecisionTracer

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


class ExportService:
    def __init__(
        self,
        store: Store,
        settings: ExportersSection,
        *,
        clock: Clock,
        metrics_url: str | None = None,
        model_name: str | None = None,
        cost_ratio: float = 0.05,
        confidence: float = 0.95,
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.source = StoreSource(
            store,
            metrics_url=metrics_url,
            model_name=model_name,
            window_s=settings.window_s,
            cost_ratio=cost_ratio,
            length_window_s=settings.length_window_s,
            length_refresh_s=settings.length_refresh_s,
            confidence=confidence,
            fleet=settings.fleet,
            fleet_window_s=settings.fleet_window_s,
            fleet_refresh_s=settings.fleet_refresh_s,
        )
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        # the daemon's jobs in this process (record_job): failed runs, and whether the last run failed
        self._job_failures: dict[str, int] = {}
        self._job_failing: dict[str, bool] = {}
        # Imports inside: the OTel SDK costs start-up time only where it is used.
        self.prometheus: PrometheusExporter | None = None
        self.otlp: OtlpMetricsExporter | None = None
        self.tracer: DecisionTracer | None = None

    # -- values ----------------------------------------------------------------------------------
    def refresh(self) -> list[Sample]:
        """Recompute every sample from the store (the ``export`` job)."""
        samples = self.source.samples(self.clock())
        with self._lock:
            self._samples = samples
        return samples

    def samples(self) -> list[Sample]:
        with self._lock:
            return [*self._samples, *job_samples(self._job_failures, self._job_failing)]

    def record_job(self, name: str, ok: bool) -> None:
        """One run of a daemon job: ``spectuner_daemon_job_failures_total`` / ``spectuner_daemon_job_failing``."""
        with self._lock:
            self._job_failures.setdefault(name, 0)
            if not ok:
                self._job_failures[name] += 1
            self._job_failing[name] = not ok

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Compute once, then serve. Raises OSError when the Prometheus port cannot be bound."""
        try:
            self.refresh()
        except Exception:
            log.exception("exporters: the first refresh failed; serving what the next one computes")
        p, o = self.settings.prometheus, self.settings.otlp
        if p.enabled:
            from tuner.exporters.prometheus import PrometheusExporter

            self.prometheus = PrometheusExporter(self.samples, p.host, p.port)
            self.prometheus.start()
        if o.enabled:
            from tuner.exporters.otel import OtlpMetricsExporter
            from tuner.exporters.tracing import DecisionTracer

            self.otlp = OtlpMetricsExporter(self.samples, o)
            if o.traces:
                self.tracer = DecisionTracer(o)

    def record_tick(self, tick: TickResult, *, start_ns: int, end_ns: int | None = None, phase: str = "decide") -> None:
        """Hand one controller tick to the tracer (no-op without OTLP traces). Never raises."""
        if self.tracer is None:
            return
        try:
            decision = None
            if tick.decision_id is not None:
                try:
                    decision = self.store.decision(tick.decision_id)
                except UnknownRecordError:
                    decision = None
            self.tracer.record_tick(
                tick, decision, start_ns=start_ns, end_ns=end_ns or time.time_ns(), phase=phase
            )
        except Exception:
            log.exception("exporters: could not record a span for a %s tick", phase)

    def stop(self) -> None:
        """Flush and stop (the last OTLP export happens here)."""
        if self.prometheus is not None:
            self.prometheus.stop()
        for part in (self.otlp, self.tracer):
            if part is not None:
                try:
                    part.shutdown()
                except Exception:
                    log.warning("exporters: flushing OTLP at shutdown failed", exc_info=True)
