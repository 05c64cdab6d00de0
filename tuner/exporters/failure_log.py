"""Export failures, logged once and then summarised: an OTLP endpoint that is down must not write an
ERROR line every few seconds into the sidecar's log.

The OpenTelemetry SDK logs each failed export itself (its own loggers). :class:`FailureLog` is a
logging filter put on those loggers: the first warning or error of an outage passes, later ones are
counted and one summary line passes every ``summary_interval_s``; :meth:`FailureLog.succeeded`
(called by our exporter wrappers after a good export) ends the outage with one line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# Where the SDK logs a failed export (exporter and processors, metrics and traces).
SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.sdk.metrics._internal.export",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk._shared_internal",
)


class FailureLog(logging.Filter):
    """Lets the first failure of an outage through, then one summary per ``summary_interval_s``."""

    def __init__(
        self, what: str, summary_interval_s: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.what = what
        self.summary_interval_s = summary_interval_s
        self.clock = clock
        self.failing = False
        self.suppressed = 0
        self._since_summary = 0
        self._last_shown = 0.0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = self.clock()
        with self._lock:
            if not self.failing:
                self.failing, self._last_shown, self._since_summary = True, now, 0
                self._rewrite(
                    record,
                    f"{self.what}: {record.getMessage()} (further failures are summarised every "
                    f"{self.summary_interval_s:g} s until it works again)",
                )
                return True
            self.suppressed += 1
            self._since_summary += 1
            if now - self._last_shown < self.summary_interval_s:
                return False
            count, self._since_summary, self._last_shown = self._since_summary, 0, now
        self._rewrite(
            record,
            f"{self.what}: still failing, {count} failure(s) in the last {self.summary_interval_s:g} s; "
            f"latest: {record.getMessage()}",
        )
        return True

    @staticmethod
    def _rewrite(record: logging.LogRecord, message: str) -> None:
        record.msg, record.args = message, None
        record.exc_info = record.exc_text = None  # one line: the SDK's traceback says nothing new

    def succeeded(self) -> None:
        """An export worked: end the outage (one line saying so)."""
        with self._lock:
            if not self.failing:
                return
            suppressed, self.failing, self.suppressed = self.suppressed, False, 0
        log.warning("%s: exporting again, after %d more failure(s) since the first", self.what, suppressed)

    def install(self) -> FailureLog:
        for name in SDK_LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def uninstall(self) -> None:
        for name in SDK_LOGGERS:
            logging.getLogger(name).removeFilter(self)


_SHARED: dict[str, FailureLog] = {}
_SHARED_LOCK = threading.Lock()


def for_endpoint(endpoint: str) -> FailureLog:
    """The one failure log of an OTLP endpoint (metrics and traces share its outages), installed."""
    with _SHARED_LOCK:
        if endpoint not in _SHARED:
            _SHARED[endpoint] = FailureLog(f"OTLP export to {endpoint}").install()
        return _SHARED[endpoint]
