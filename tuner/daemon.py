"""The sidecar daemon behind ``spectuner run``: APScheduler jobs around one collector and one controller.

Jobs (each at most one instance at a time; a late run is coalesced, never stacked):
- collect   every ``collect_interval_s``: scrape /metrics into the store, tag windows with the config
            in force, record the running config for newly seen engine series;
- decide    every ``decide_interval_s``: verify changes whose evaluation window passed, then decide;
- health    every ``health_interval_s``: restart a managed engine that died (last good config);
- retention every ``retention_interval_s``: rollups and pruning.

Start-up is restart-safe: applies a crash interrupted are closed, the engine starts with the last
config recorded in the database (else the config file's), and cooldowns, pauses and pending
verifications are read from the database by the controller on every tick.

SIGTERM/SIGINT: no new jobs; the running ones finish (an apply in progress completes and is
recorded); the managed engine is stopped (graceful drain); the store is closed.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from types import FrameType
from typing import Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from collectors.records import EventRecord, RequestRecord, StepRecord, WindowRecord
from collectors.scrape import Collector, metrics_url, utc_now
from tuner.actuators import Actuator, CommandActuator, NullActuator, RestartActuator, WebhookActuator
from tuner.config import SpectunerConfig
from tuner.controller.guardrails import GuardrailSettings, MaintenanceWindowSpec
from tuner.controller.policy import PolicySettings
from tuner.controller.reconcile import Controller, ControllerSettings, TickResult
from tuner.store import AppliedBy, RetentionPolicy, Store, run_retention

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


class DaemonStartError(RuntimeError):
    """The daemon could not start (the engine did not come up, ...)."""


def health_url_for(config: SpectunerConfig) -> str:
    if config.engine.health_url:
        return config.engine.health_url
    target = metrics_url(config.engine.metrics_url)
    return target.rsplit("/", 1)[0] + "/health"


def build_actuator(config: SpectunerConfig) -> Actuator:
    a = config.actuator
    if a.kind == "restart" and a.restart is not None:
        return RestartActuator(
            a.restart.argv,
            health_url_for(config),
            config.resolve(a.restart.log_path),
            startup_timeout_s=a.restart.startup_timeout_s,
            shutdown_timeout_s=a.restart.shutdown_timeout_s,
            pass_shutdown_timeout=a.restart.pass_shutdown_timeout,
        )
    if a.kind == "command" and a.command is not None:
        return CommandActuator(a.command.argv, a.command.timeout_s)
    if a.kind == "webhook" and a.webhook is not None:
        return WebhookActuator(a.webhook.url, a.webhook.timeout_s, a.webhook.headers)
    return NullActuator()


def controller_settings(config: SpectunerConfig) -> ControllerSettings:
    g, p, c = config.guardrails, config.policy, config.controller
    return ControllerSettings(
        metrics_url=metrics_url(config.engine.metrics_url),
        mode=c.mode.value,
        model_name=config.engine.model_name,
        evidence_window_s=p.evidence_window_s,
        verify_window_s=c.verify_window_s,
        regression_tolerance=c.regression_tolerance,
        guardrails=GuardrailSettings(
            min_drafts=g.min_drafts,
            min_evidence_s=g.min_evidence_s,
            min_gain=g.min_gain,
            hysteresis_ticks=g.hysteresis_ticks,
            cooldown_s=g.cooldown_s,
            max_changes_per_hour=g.max_changes_per_hour,
            restart_downtime_s=g.restart_downtime_s,
            payback_horizon_s=g.payback_horizon_s,
            maintenance_windows=tuple(
                MaintenanceWindowSpec(w.start, w.end, tuple(w.days)) for w in g.maintenance_windows
            ),
        ),
        policy=PolicySettings(k_max=p.k_max, cost_ratio=p.cost_ratio, confidence=p.confidence),
    )


class ConfigTaggingSink:
    """Passes records to the store, stamping windows with the id of the config in force for their
    engine series (so rollups and later analysis can split by config)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def write_windows(self, records: Sequence[WindowRecord]) -> None:
        ids: dict[Any, int | None] = {}
        tagged = []
        for w in records:
            if w.key not in ids:
                cfg = self.store.config_at(w.key, w.start)
                ids[w.key] = cfg.id if cfg is not None else None
            tagged.append(replace(w, config_id=ids[w.key]) if w.config_id is None else w)
        self.store.write_windows(tagged)

    def write_requests(self, records: Sequence[RequestRecord]) -> None:
        self.store.write_requests(records)

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        self.store.write_steps(records)

    def write_events(self, records: Sequence[EventRecord]) -> None:
        self.store.write_events(records)


@dataclass
class _JobHealth:
    """Log a failing job once when it starts failing and once when it recovers, not every tick."""

    failing: bool = False


class Daemon:
    def __init__(
        self,
        config: SpectunerConfig,
        store: Store,
        *,
        clock: Clock = utc_now,
        actuator: Actuator | None = None,
        on_tick: Callable[[TickResult], None] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.actuator = actuator or build_actuator(config)
        self.controller = Controller(store, self.actuator, controller_settings(config), clock)
        self.collector = Collector(
            metrics_url(config.engine.metrics_url),
            ConfigTaggingSink(store),
            interval_s=config.controller.collect_interval_s,
            clock=clock,
        )
        self.retention = RetentionPolicy()
        self.on_tick = on_tick or (lambda r: None)
        self.stop_event = threading.Event()
        self._health: dict[str, _JobHealth] = {}
        self.ticks: dict[str, int] = {"collect": 0, "decide": 0, "health": 0, "retention": 0}

    # -- start-up --------------------------------------------------------------------------------
    def start_engine(self) -> TickResult:
        """Recover from the database, then bring the engine up with the right config."""
        now = self.clock()
        closed = self.controller.recover(now)
        spec, source = self.controller.config_to_start(self.config.speculative.to_spec_config())
        result = self.actuator.start(spec)
        if not result.ok and source == "database":
            # The recorded config does not start any more (a draft path went away...): try the file's.
            log.warning("engine did not start with the recorded config (%s); trying the config file's", result.message)
            spec = self.config.speculative.to_spec_config()
            source = "config file"
            result = self.actuator.start(spec)
        if not result.ok:
            raise DaemonStartError(f"the engine did not start: {result.message}\n{result.detail}".rstrip())
        # A baseline scrape names the engine series, so the starting config is recorded against them
        # now (as "startup") rather than on the first window (as merely "observed").
        baseline = self.collector.collect_once()
        for sample in baseline.samples:
            self.store.upsert_engine(sample.key, seen_at=sample.ts, cache_config=sample.cache_config or None)
        applied_by = AppliedBy.STARTUP if self.actuator.kind == "restart" else AppliedBy.OBSERVED
        self.controller.sync_configs(self.clock(), applied_by)
        message = f"engine config from the {source}: {spec}" + (
            f"; closed {len(closed)} interrupted apply(s)" if closed else ""
        )
        log.info("daemon: %s", message)
        return TickResult("started", source, message)

    # -- jobs ------------------------------------------------------------------------------------
    def _guard(self, name: str, fn: Callable[[], None]) -> None:
        health = self._health.setdefault(name, _JobHealth())
        try:
            fn()
        except Exception:
            if not health.failing:
                log.exception("daemon job %s failed (logged once until it recovers)", name)
            health.failing = True
            return
        if health.failing:
            log.warning("daemon job %s recovered", name)
            health.failing = False
        self.ticks[name] += 1

    def collect(self) -> None:
        result = self.collector.collect_once()
        if result.ok:
            self.controller.sync_configs(self.clock(), AppliedBy.OBSERVED)

    def decide(self) -> None:
        now = self.clock()
        for r in self.controller.verify(now):
            self.on_tick(r)
        self.on_tick(self.controller.decide(now))

    def health(self) -> None:
        result = self.actuator.ensure_running()
        if result is None:
            return
        now = self.clock()
        keys = self.controller.engine_keys()
        ok = result.ok
        self.store.write_events(
            [
                EventRecord(
                    ts=now,
                    kind="engine_restarted" if ok else "engine_down",
                    message=result.message,
                    severity="warning" if ok else "critical",
                    engine=keys[0] if keys else None,
                    data={"detail": result.detail[-1000:]},
                )
            ]
        )
        if ok:
            self.controller.sync_configs(now, AppliedBy.RESTART)

    def retain(self) -> None:
        run_retention(self.store, self.retention, self.clock())

    # -- the loop --------------------------------------------------------------------------------
    def run(self, install_signals: bool = True) -> None:
        """Start the engine, run the jobs until SIGTERM/SIGINT (or :meth:`request_stop`), shut down."""
        if install_signals:
            self._install_signals()
        # APScheduler logs every job run at INFO; our jobs log what matters themselves.
        logging.getLogger("apscheduler").setLevel(max(logging.WARNING, logging.getLogger().level))
        c = self.config.controller
        scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(4)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone="UTC",
        )
        jobs = (
            ("collect", self.collect, c.collect_interval_s),
            ("decide", self.decide, c.decide_interval_s),
            ("health", self.health, c.health_interval_s),
            ("retention", self.retain, c.retention_interval_s),
        )
        try:
            self.start_engine()
            for name, fn, interval_s in jobs:
                scheduler.add_job(self._guard, "interval", args=(name, fn), seconds=interval_s, id=name, name=name)
            scheduler.start()
            log.info("daemon: running (%s mode)", c.mode.value)
            self.stop_event.wait()
        finally:
            log.info("daemon: stopping; waiting for running jobs to finish")
            if scheduler.running:
                scheduler.shutdown(wait=True)
            self.actuator.stop()
            self.collector.close()

    def request_stop(self) -> None:
        self.stop_event.set()

    def _install_signals(self) -> None:
        def _stop(signum: int, frame: FrameType | None) -> None:
            log.info("daemon: got signal %s", signum)
            self.stop_event.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
