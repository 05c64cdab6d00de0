"""The daemon's side of the exporters and alert hooks, in one object: build from the config, start
(fail fast: a port in use, a missing secret), the scheduler jobs, the per-tick span hook, stop.

Kept out of ``tuner/daemon.py`` so the daemon only calls four methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime

from collectors.scrape import metrics_url
from tuner.alerts.dispatcher import AlertDispatcher, build_dispatcher
from tuner.alerts.sinks import SinkConfigError
from tuner.config import SpectunerConfig
from tuner.controller.audit import TickResult
from tuner.exporters.service import ExportService
from tuner.store import Store

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
Job = tuple[str, Callable[[], None], float]


class ObserverStartError(RuntimeError):
    """An exporter or an alert sink cannot start; the message says what to fix."""


class Observers:
    def __init__(self, config: SpectunerConfig, store: Store, clock: Clock) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.exports: ExportService | None = None
        if config.exporters.enabled:
            self.exports = ExportService(
                store,
                config.exporters,
                clock=clock,
                metrics_url=metrics_url(config.engine.metrics_url),
                model_name=config.engine.model_name,
                cost_ratio=config.policy.cost_ratio,
                confidence=config.policy.confidence,
            )
        self.alerts: AlertDispatcher | None = None

    def start(self) -> None:
        a = self.config.alerts
        if a.enabled and a.sinks:
            try:
                self.alerts = build_dispatcher(self.store, a, self.clock)
            except SinkConfigError as exc:
                raise ObserverStartError(str(exc)) from None
            log.info("alerts: %d sink(s): %s", len(a.sinks), ", ".join(s.name for s in a.sinks))
        if self.exports is not None:
            try:
                self.exports.start()
            except OSError as exc:
                p = self.config.exporters.prometheus
                raise ObserverStartError(
                    f"the Prometheus exporter cannot listen on {p.host}:{p.port}: {exc.strerror or exc}; "
                    "choose another [exporters.prometheus] port"
                ) from None

    def jobs(self) -> list[Job]:
        out: list[Job] = []
        if self.exports is not None:
            out.append(("export", self.export, self.config.exporters.refresh_interval_s))
        if self.alerts is not None:
            out.append(("alerts", self.deliver_alerts, self.config.alerts.poll_interval_s))
        return out

    def export(self) -> None:
        if self.exports is not None:
            self.exports.refresh()

    def deliver_alerts(self) -> None:
        if self.alerts is not None:
            self.alerts.poll_once()

    def record_tick(self, tick: TickResult, start_ns: int, phase: str = "decide") -> None:
        if self.exports is not None:
            self.exports.record_tick(tick, start_ns=start_ns, end_ns=time.time_ns(), phase=phase)

    def record_job(self, name: str, ok: bool) -> None:
        """One run of a daemon job, for the exporters (no-op without them)."""
        if self.exports is not None:
            self.exports.record_job(name, ok)

    def request_stop(self) -> None:
        """Cut alert retry waits short, so the scheduler's shutdown does not wait for them."""
        if self.alerts is not None:
            self.alerts.stop()

    def close(self) -> None:
        if self.alerts is not None:
            self.alerts.close()
        if self.exports is not None:
            self.exports.stop()
