"""An OTLP endpoint that is down: the first failure is logged, then one summary per interval."""

from __future__ import annotations

import logging

import pytest

from tuner.exporters.failure_log import FailureLog

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_an_outage_is_logged_once_then_summarised_then_ended(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    failures = FailureLog("OTLP export to http://collector:4318", summary_interval_s=300, clock=clock)
    sdk = logging.getLogger("test.otel.sdk")
    sdk.addFilter(failures)
    try:
        caplog.set_level(logging.INFO)
        for _ in range(100):  # every 2 s for 200 s
            sdk.error("Failed to export metrics batch")
            clock.t += 2
        sdk.info("not a failure: always passes")
        for _ in range(60):  # past the summary interval
            sdk.error("Failed to export metrics batch")
            clock.t += 2
        failures.succeeded()
        failures.succeeded()  # only once
        sdk.error("Failed again")  # a new outage is logged again
    finally:
        sdk.removeFilter(failures)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5, lines
    assert "OTLP export to http://collector:4318: Failed to export" in lines[0] and "summarised" in lines[0]
    assert lines[1] == "not a failure: always passes"
    assert "still failing, 150 failure(s) in the last 300 s" in lines[2]
    assert "exporting again, after 159 more failure(s) since the first" in lines[3]
    assert "Failed again" in lines[4]
