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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from collectors.records import EngineSample, EventRecord, RecordSink, RequestRecord, StepRecord, WindowRecord
from collectors.scrape import Collector, metrics_url, utc_now
from collectors.step_ingest import StepFeed, StepIngestServer
from collectors.vllm_plugin.client import ControlClient
from collectors.vllm_plugin.wire import STEPS_PATH
from policies.draft_choice import DraftCandidate, DraftTriggerConfig, TriggerStatistic
from policies.memory import MemoryBudget
from policies.step_cost import StepCostModel
from tuner.actuators import Actuator, CommandActuator, NullActuator, WebhookActuator
from tuner.actuators.live import LiveActuator, load_or_create_token, plugin_env
from tuner.actuators.strategy import build_restart_strategy
from tuner.config import SpectunerConfig
from tuner.controller.candidates import build_candidate
from tuner.controller.drafts import registered_drafts
from tuner.controller.guardrails import GuardrailSettings, MaintenanceWindowSpec
from tuner.controller.policy import PolicySettings
from tuner.controller.reconcile import Controller, ControllerSettings, TickResult
from tuner.controller.step_cost import StepCostFitSettings
from tuner.exporters.observers import Observers, ObserverStartError
from tuner.store import AppliedBy, RetentionPolicy, Store, run_retention
from tuner.store.deliveries import prune_deliveries

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


class DaemonStartError(RuntimeError):
    """The daemon could not start (the engine did not come up, ...)."""


def health_url_for(config: SpectunerConfig) -> str:
    if config.engine.health_url:
        return config.engine.health_url
    target = metrics_url(config.engine.metrics_url)
    return target.rsplit("/", 1)[0] + "/health"


def _sidecar_starts_engine(config: SpectunerConfig) -> bool:
    a = config.actuator
    return a.kind == "restart" or (a.kind == "live" and a.live is not None and a.live.fallback == "restart")


def plugin_token(config: SpectunerConfig) -> str | None:
    """The shared plugin token (``[plugin] token_file``), created when the sidecar starts the engine."""
    p = config.plugin
    if not (p.ingest_listen or p.control_address):
        return None
    path = config.resolve(p.token_file)
    try:
        return load_or_create_token(path, create=_sidecar_starts_engine(config))
    except ValueError as exc:
        if p.control_address:
            raise DaemonStartError(f"[plugin] control_address needs a token: {exc}") from None
        return None  # ingest only: loopback without a token


def engine_plugin_env(config: SpectunerConfig) -> dict[str, str]:
    """Environment for an engine the sidecar starts, so the spectuner vLLM plugin in it finds the sidecar."""
    p = config.plugin
    if not (p.ingest_listen or p.control_address):
        return {}
    return plugin_env(
        ingest_url=f"http://{p.ingest_listen}{STEPS_PATH}" if p.ingest_listen else None,
        control_address=p.control_address,
        token_file=config.resolve(p.token_file),
    )


def build_step_ingest(config: SpectunerConfig, sink: RecordSink, feed: StepFeed) -> StepIngestServer | None:
    """The per-step ingest endpoint (``[plugin] ingest_listen``), or None when it is not configured."""
    listen = config.plugin.ingest_listen
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    return StepIngestServer(
        sink,
        metrics_url(config.engine.metrics_url),
        host="127.0.0.1" if host == "localhost" else host,
        port=int(port),
        token=plugin_token(config),
        feed=feed,
    )


def build_actuator(config: SpectunerConfig, feed: StepFeed | None = None, kind: str | None = None) -> Actuator:
    a = config.actuator
    kind = kind or a.kind
    if kind == "live" and a.live is not None and config.plugin.control_address:
        return LiveActuator(
            ControlClient(config.plugin.control_address, plugin_token(config) or "", a.live.control_timeout_s),
            build_actuator(config, feed, kind=a.live.fallback),  # the fallback for what cannot be live
            feed=feed if config.plugin.ingest_listen else None,  # no step stream: verify by read-back only
            k_max=a.live.k_max or config.policy.k_max,
            verify_timeout_s=a.live.verify_timeout_s,
            min_evidence_steps=a.live.min_evidence_steps,
        )
    if kind == "restart" and a.restart is not None:
        # [actuator] strategy: plain restart, or drain-and-hold / blue-green behind the front door.
        return build_restart_strategy(
            a,
            health_url_for(config),
            config.resolve(a.restart.log_path),
            env={**a.restart.env, **engine_plugin_env(config)},
            resolve=config.resolve,
        )
    if kind == "command" and a.command is not None:
        return CommandActuator(a.command.argv, a.command.timeout_s)
    if kind == "webhook" and a.webhook is not None:
        return WebhookActuator(a.webhook.url, a.webhook.timeout_s, a.webhook.headers)
    return NullActuator()


def controller_settings(config: SpectunerConfig) -> ControllerSettings:
    g, p, c = config.guardrails, config.policy, config.controller
    return ControllerSettings(
        metrics_url=metrics_url(config.engine.metrics_url),
        mode=c.mode.value,
        model_name=config.engine.model_name,
        evidence_window_s=p.evidence_window_s,
        load_horizon_s=p.load_horizon_s,
        verify_window_s=c.verify_window_s,
        regression_tolerance=c.regression_tolerance,
        history_s=config.swap.history_s,
        step_cost_fit=(
            StepCostFitSettings(
                horizon_s=p.step_cost_horizon_s,
                min_steps=p.step_cost_min_steps,
                cell_min_steps=p.step_cost_cell_min_steps,
                refit_interval_s=p.step_cost_refit_s,
            )
            if p.step_cost_fit
            else None
        ),
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
        policy=policy_settings(config),
    )


def policy_settings(config: SpectunerConfig) -> PolicySettings:
    p, m, w = config.policy, config.memory, config.swap
    step_cost = None
    if p.step_cost is not None:
        sc = p.step_cost
        step_cost = StepCostModel(sc.fixed_s, sc.per_token_s, sc.draft_fixed_s, sc.draft_per_seq_s)
    memory = None
    if m.budget_bytes is not None:
        memory = MemoryBudget(
            budget_bytes=m.budget_bytes,
            target_kv_bytes_per_token=m.target_kv_bytes_per_token,
            tokens_per_seq=m.tokens_per_seq,
        )
    swap = None
    if w.enabled:
        swap = DraftTriggerConfig(
            threshold=w.threshold,
            duration_s=w.duration_s,
            min_drafts=w.min_drafts,
            statistic=TriggerStatistic(w.statistic),
            segments=w.segments,
            prior_strength_trials=w.prior_strength_trials,
            confidence=p.confidence,
        )
    return PolicySettings(
        k_max=p.k_max,
        cost_ratio=p.cost_ratio,
        confidence=p.confidence,
        step_cost=step_cost,
        per_batch_size=p.per_batch_size,
        max_batch_size=p.max_batch_size,
        target_params=p.target_params,
        memory=memory,
        swap=swap,
    )


def draft_candidates(config: SpectunerConfig, store: Store) -> list[DraftCandidate]:
    """The config file's ``[[drafts]]`` and the operator's registry (``spectuner drafts add``); a
    registry entry with the same name as a file entry replaces it."""
    out: dict[str, DraftCandidate] = {}
    for d in config.drafts:
        out[d.name] = build_candidate(
            d.name,
            d.method,
            str(config.resolve(d.model)) if d.model and Path(config.resolve(d.model)).exists() else d.model,
            num_params=d.num_params,
            dtype=d.dtype,
            kv_bytes=d.kv_bytes_per_token,
            prior_alpha=d.prior_alpha,
            cost_ratio=d.cost_ratio,
            extra=d.extra,
        )
    for spec in registered_drafts(store):
        out[spec.name] = build_candidate(
            spec.name,
            spec.method,
            spec.model,
            num_params=spec.num_params,
            dtype=spec.dtype,
            kv_bytes=spec.kv_bytes_per_token,
            extra=spec.extra,
        )
    return list(out.values())


_Tagged = TypeVar("_Tagged", WindowRecord, StepRecord)


class ConfigTaggingSink:
    """Passes records to the store, stamping windows with the id of the config in force for their
    engine series (so rollups and later analysis can split by config)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _tag(
        self, records: Sequence[_Tagged], at: Callable[[_Tagged], datetime], ids: dict[Any, int | None] | None = None
    ) -> list[_Tagged]:
        """Each record's ``config_id``: the config in force for its series at the first record's time."""
        ids = {} if ids is None else ids
        tagged = []
        for r in records:
            if r.key not in ids:
                cfg = self.store.config_at(r.key, at(r))
                ids[r.key] = cfg.id if cfg is not None else None
            tagged.append(replace(r, config_id=ids[r.key]) if r.config_id is None else r)
        return tagged

    def write_windows(self, records: Sequence[WindowRecord]) -> None:
        self.store.write_windows(self._tag(records, lambda w: w.start))

    def write_scrape(
        self,
        windows: Sequence[WindowRecord],
        events: Sequence[EventRecord] = (),
        baselines: Sequence[EngineSample] = (),
    ) -> None:
        self.store.write_scrape(self._tag(windows, lambda w: w.start), events, baselines)

    def baselines(self, url: str) -> Sequence[EngineSample]:
        return self.store.baselines(url)

    def write_requests(self, records: Sequence[RequestRecord]) -> None:
        self.store.write_requests(records)

    def write_steps(self, records: Sequence[StepRecord]) -> None:
        self.store.write_steps(self._tag(records, lambda s: s.ts))

    def write_windows_and_steps(self, windows: Sequence[WindowRecord], steps: Sequence[StepRecord]) -> None:
        """Windows and the steps of the same interval, tagged with one config lookup per series (the
        simulator's flush: one decide interval under one config)."""
        ids: dict[Any, int | None] = {}
        self.store.write_windows(self._tag(windows, lambda w: w.start, ids))
        if steps:
            self.store.write_steps(self._tag(steps, lambda s: s.ts, ids))

    def write_events(self, records: Sequence[EventRecord]) -> None:
        self.store.write_events(records)


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
        self.ticks: dict[str, int] = {"collect": 0, "decide": 0, "health": 0, "retention": 0, "export": 0, "alerts": 0}
        # Exporters (Prometheus, OTLP, decision spans) and alert hooks; each optional (docs/exporters.md).
        self.observers = Observers(config, store, clock)

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
        applied_by = AppliedBy.STARTUP if self.actuator.kind in ("restart", "live") else AppliedBy.OBSERVED
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
