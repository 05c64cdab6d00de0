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
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import FrameType

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from collectors.records import EventRecord
from collectors.scrape import Collector, metrics_url, utc_now
from collectors.step_ingest import StepFeed
from tuner.actuators import Actuator
from tuner.config import SpectunerConfig
from tuner.controller.audit import TickResult
from tuner.controller.controller import Controller
from tuner.observers import Observers, ObserverStartError
from tuner.shadow_job import shadow_job
from tuner.store import AppliedBy, RetentionPolicy, Store, run_retention
from tuner.store.deliveries import prune_deliveries
from tuner.store.tagging import ConfigTaggingSink
from tuner.wiring import DaemonStartError, build_actuator, build_step_ingest, controller_settings, draft_candidates

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


class _SkippedWhileBusy(logging.Filter):
    """A tick skipped because the previous one still runs (an apply restarting the engine holds the
    decide and health jobs for a minute) is expected; APScheduler would warn on every interval."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances reached" not in record.getMessage()


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
        self.step_feed = StepFeed()  # per-step records from the vLLM plugin; the live actuator verifies with them
        self.actuator = actuator or build_actuator(config, self.step_feed)
        self.step_ingest = build_step_ingest(config, ConfigTaggingSink(store), self.step_feed)
        self.controller = Controller(
            store, self.actuator, controller_settings(config), clock, candidates=lambda: draft_candidates(config, store)
        )
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
        self.ticks: dict[str, int] = {
            "collect": 0, "decide": 0, "health": 0, "retention": 0, "export": 0, "alerts": 0, "shadow": 0
        }
        self.shadow_job = shadow_job(config, store, lambda: draft_candidates(config, store))
        # Exporters (Prometheus, OTLP, decision spans) and alert hooks; each optional (docs/exporters.md).
        self.observers = Observers(config, store, clock)

    # -- start-up --------------------------------------------------------------------------------
    def start_engine(self) -> TickResult:
        """Recover from the database, then bring the engine up with the right config."""
        now = self.clock()
        closed = self.controller.recover(now)
        spec, source = self.controller.config_to_start(self.config.speculative.to_spec_config())
        result = self.actuator.start(spec.to_vllm())
        if not result.ok and source == "database":
            # The recorded config does not start any more (a draft path went away...): try the file's.
            log.warning("engine did not start with the recorded config (%s); trying the config file's", result.message)
            spec = self.config.speculative.to_spec_config()
            source = "config file"
            result = self.actuator.start(spec.to_vllm())
        if not result.ok:
            raise DaemonStartError(f"the engine did not start: {result.message}\n{result.detail}".rstrip())
        # A baseline scrape names the engine series, so the starting config is recorded against them
        # now (as "startup") rather than on the first window (as merely "observed").
        baseline = self.collector.collect_once()
        for sample in baseline.samples:
            self.store.upsert_engine(sample.key, seen_at=sample.ts, cache_config=sample.cache_config or None)
        applied_by = AppliedBy.STARTUP if self.actuator.kind in ("restart", "live") else AppliedBy.OBSERVED
        self.controller.sync_configs(self.clock(), applied_by)
        message = f"engine config from the {source}: {spec.describe()}" + (
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
            self._report_job(name, ok=False)
            return
        if health.failing:
            log.warning("daemon job %s recovered", name)
            health.failing = False
        self._report_job(name, ok=True)
        self.ticks[name] += 1

    def _report_job(self, name: str, ok: bool) -> None:
        # logged once, a failing job is easy to miss: the exporters count every failed run (live, 6 Dec: one
        # malformed evidence window stopped every decision for the last ~145 s of a phase, one log line)
        try:
            self.observers.record_job(name, ok)
        except Exception:
            log.warning("daemon: could not export the health of job %s", name, exc_info=True)

    def collect(self) -> None:
        result = self.collector.collect_once()
        if result.ok:
            self.controller.sync_configs(self.clock(), AppliedBy.OBSERVED)

    def decide(self) -> None:
        now = self.clock()
        start_ns = time.time_ns()
        for r in self.controller.verify(now):
            self.on_tick(r)
            self.observers.record_tick(r, start_ns, "verify")
        start_ns = time.time_ns()
        # a rollback in verify restarted the engine: decide on the clock after it, not before
        result = self.controller.decide(max(now, self.clock()))
        self.on_tick(result)
        self.observers.record_tick(result, start_ns, "decide")

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

    def shadow(self) -> None:
        if self.shadow_job is not None:
            keys = self.controller.engine_keys()
            self.shadow_job.engine_key = keys[0] if keys else None
            # the traffic moving (the controller's acceptance regime) is when a candidate's rank can change
            self.shadow_job.run_if_due(self.clock(), self.controller.memory.alpha_moved_at)

    def retain(self) -> None:
        now = self.clock()
        run_retention(self.store, self.retention, now)
        # the alert delivery log follows the events it records
        prune_deliveries(self.store, now - timedelta(seconds=self.retention.events_s))

    # -- the loop --------------------------------------------------------------------------------
    def run(self, install_signals: bool = True) -> None:
        """Start the engine, run the jobs until SIGTERM/SIGINT (or :meth:`request_stop`), shut down."""
        if install_signals:
            self._install_signals()
        # APScheduler logs every job run at INFO; our jobs log what matters themselves.
        logging.getLogger("apscheduler").setLevel(max(logging.WARNING, logging.getLogger().level))
        logging.getLogger("apscheduler.scheduler").addFilter(_SkippedWhileBusy())
        c = self.config.controller
        scheduler = BackgroundScheduler(
            # a shadow replay may take minutes: its own worker, so it never delays collect or decide
            executors={"default": ThreadPoolExecutor(4 if self.shadow_job is None else 5)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone="UTC",
        )
        jobs: list[tuple[str, Callable[[], None], float]] = [
            ("collect", self.collect, c.collect_interval_s),
            ("decide", self.decide, c.decide_interval_s),
            ("health", self.health, c.health_interval_s),
            ("retention", self.retain, c.retention_interval_s),
        ]
        if self.shadow_job is not None:
            jobs.append(("shadow", self.shadow, self.config.shadow.evaluate_interval_s))
        try:
            try:
                self.observers.start()  # before the engine: a busy port or a missing secret fails fast
            except ObserverStartError as exc:
                raise DaemonStartError(str(exc)) from None
            if self.step_ingest is not None:
                try:  # before the engine, whose plugin starts posting steps at once
                    self.step_ingest.start()
                except OSError as exc:
                    raise DaemonStartError(f"step ingest on {self.step_ingest.url}: {exc}") from None
            self.start_engine()
            for name, fn, interval_s in (*jobs, *self.observers.jobs()):
                scheduler.add_job(self._guard, "interval", args=(name, fn), seconds=interval_s, id=name, name=name)
            scheduler.start()
            log.info("daemon: running (%s mode)", c.mode.value)
            self.stop_event.wait()
        finally:
            log.info("daemon: stopping; waiting for running jobs to finish")
            self.observers.request_stop()
            if self.shadow_job is not None:
                self.shadow_job.stop()  # a replay in progress is only lost work
            if scheduler.running:
                scheduler.shutdown(wait=True)
            self.actuator.stop()
            if self.step_ingest is not None:
                self.step_ingest.stop()
            self.collector.close()
            self.observers.close()

    def request_stop(self) -> None:
        self.stop_event.set()

    def _install_signals(self) -> None:
        def _stop(signum: int, frame: FrameType | None) -> None:
            log.info("daemon: got signal %s", signum)
            self.stop_event.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
