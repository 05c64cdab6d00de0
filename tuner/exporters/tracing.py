"""Spans for controller decisions and applies, built from what the daemon already has after a tick.

The controller is not instrumented: the daemon times each decide/verify call and hands every
:class:`~tuner.controller.audit.TickResult` (plus its decision row, when it has one) to
:meth:`DecisionTracer.record_tick`. That gives one ``spectuner.decision`` span per tick and, when the
actuator ran (applied, unchanged, rolled back, failed), a child ``spectuner.apply`` span.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode, set_span_in_context

from policies.spec_config import K_KEY
from tuner.controller.audit import TickResult
from tuner.exporters.failure_log import FailureLog, for_endpoint
from tuner.exporters.otel import resource
from tuner.exporters.settings import OtlpSection
from tuner.store import StoredDecision

log = logging.getLogger(__name__)

APPLY_ACTIONS = frozenset({"applied", "unchanged", "rolled_back", "failed"})


def decision_attributes(tick: TickResult, decision: StoredDecision | None, phase: str) -> dict[str, Any]:
    """Span attributes (OTel allows str/bool/int/float; None values are left out)."""
    attrs: dict[str, Any] = {
        "spectuner.phase": phase,
        "spectuner.action": tick.action,
        "spectuner.reason": tick.reason,
        "spectuner.message": tick.message,
    }
    if tick.decision_id is not None:
        attrs["spectuner.decision_id"] = tick.decision_id
    if decision is not None:
        d = decision.decision
        attrs["spectuner.status"] = d.status
        attrs["spectuner.mode"] = d.mode
        attrs["spectuner.decision_reason"] = d.reason
        if d.predicted_gain is not None:
            attrs["spectuner.predicted_gain"] = float(d.predicted_gain)
        if decision.realized_gain is not None:
            attrs["spectuner.realized_gain"] = float(decision.realized_gain)
        if d.engine is not None:
            attrs["spectuner.engine"] = d.engine.engine
            attrs["spectuner.model_name"] = d.engine.model_name
        proposed = d.proposed
        if proposed is not None:
            # attribute names follow vLLM's keys (documented in docs/exporters.md)
            attrs["spectuner.proposed.method"] = proposed.method
            if proposed.k is not None:
                attrs[f"spectuner.proposed.{K_KEY}"] = proposed.k
            if proposed.model is not None:
                attrs["spectuner.proposed.draft"] = proposed.model
    return attrs


class _SpanExporter(OTLPSpanExporter):
    """OTLP/HTTP spans that tell the endpoint's :class:`FailureLog` when an export works again."""

    def __init__(self, failures: FailureLog, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._failures = failures

    def export(self, spans: Any, *args: Any, **kwargs: Any) -> SpanExportResult:
        result = super().export(spans, *args, **kwargs)
        if result is SpanExportResult.SUCCESS:
            self._failures.succeeded()
        return result


class DecisionTracer:
    """Owns a private ``TracerProvider`` with a ``BatchSpanProcessor`` (OTLP/HTTP by default)."""

    def __init__(self, settings: OtlpSection | None = None, *, exporter: SpanExporter | None = None) -> None:
        if exporter is None:
            assert settings is not None, "give OTLP settings or a span exporter"
            exporter = _SpanExporter(
                for_endpoint(settings.endpoint),
                endpoint=f"{settings.endpoint}/v1/traces",
                headers=dict(settings.headers),
                timeout=settings.timeout_s,
            )
        self.provider = TracerProvider(resource=resource())
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("spectuner.controller")

    def record_tick(
        self,
        tick: TickResult,
        decision: StoredDecision | None,
        *,
        start_ns: int,
        end_ns: int,
        phase: str = "decide",
    ) -> None:
        """One decision span over [start_ns, end_ns] (epoch ns), plus an apply span when the actuator ran."""
        span = self.tracer.start_span(
            "spectuner.decision", start_time=start_ns, attributes=decision_attributes(tick, decision, phase)
        )
        if tick.action == "failed":
            span.set_status(Status(StatusCode.ERROR, tick.message[:200]))
        if tick.action in APPLY_ACTIONS:
            child = self.tracer.start_span(
                "spectuner.apply",
                context=set_span_in_context(span),
                start_time=start_ns,
                attributes={
                    "spectuner.outcome": tick.action,
                    "spectuner.reason": tick.reason,
                    **({"spectuner.decision_id": tick.decision_id} if tick.decision_id is not None else {}),
                },
            )
            if tick.action == "failed":
                child.set_status(Status(StatusCode.ERROR, tick.message[:200]))
            child.end(end_time=end_ns)
        span.end(end_time=end_ns)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self.provider.force_flush(timeout_millis=int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self.provider.shutdown()
