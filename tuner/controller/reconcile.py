"""The reconcile step: snapshot → policy → guardrails → actuator → audit row → event; and verify.

:class:`Controller` holds no state that matters across restarts: pauses, overrides, pending
verifications, recent changes (cooldown, changes per hour) and recently failed configs are read from
the database on every tick, so a restarted daemon carries on where it stopped. Only the hysteresis
streak lives in memory (after a restart it starts again from zero, which only delays a change).

Time comes in as ``now`` (and ``clock`` for the moment an apply finished); nothing here reads the
system clock.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from collectors.records import EngineKey, EventRecord, WindowRecord
from policies.draft_choice import DraftCandidate
from policies.memory import check_memory
from policies.step_cost import StepCostModel
from tuner.actuators.base import START_FAILED, Actuator, ApplyResult, ApplyStatus, config_fingerprint
from tuner.controller import manual
from tuner.controller.candidates import current_candidate, same_draft
from tuner.controller.evidence import (
    Evidence,
    HistoryCache,
    LoadProfile,
    gather_evidence,
    measured_history,
    spec_config_of,
    spec_windows,
    summarize,
    window_batches,
    windows_under,
)
from tuner.controller.guardrails import (
    ControllerState,
    GuardrailSettings,
    Proposal,
    check_guardrails,
    next_streak,
)
from tuner.controller.policy import PolicyOutcome, PolicySettings, propose
from tuner.controller.step_cost import StepCostFitSettings, config_specs, draft_identity, step_cost_from_steps
from tuner.controller.verify import acceptance_shift, judge_at_matched_load
from tuner.store import AppliedBy, DecisionRecord, DecisionStatus, EngineConfigRecord, Store, StoredConfig

log = logging.getLogger(__name__)

CHANGE = "change"  # a decision's action when the controller itself proposes a config
_CHANGE_SOURCES = {
    AppliedBy.RESTART,
    AppliedBy.LIVE,
    AppliedBy.COMMAND,
    AppliedBy.WEBHOOK,
    AppliedBy.MANUAL,
    AppliedBy.ROLLBACK,
}

Clock = Callable[[], datetime]
Policy = Callable[[Evidence], PolicyOutcome]
Candidates = Callable[[], Sequence[DraftCandidate]]


@dataclass(frozen=True)
class ControllerSettings:
    metrics_url: str  # the engine series' url (as the collector stores it)
    mode: str = "advisory"  # "advisory" | "auto"
    model_name: str | None = None
    evidence_window_s: float = 300.0
    verify_window_s: float = 300.0
    regression_tolerance: float = 0.05
    failed_retry_s: float = 86400.0  # a config that failed is not proposed again for this long
    history_s: float = 7 * 86400.0  # how far back a draft candidate's measured α counts
    step_cost_fit: StepCostFitSettings | None = field(default_factory=StepCostFitSettings)  # None: never fit
    load_horizon_s: float = 3600.0  # one K is chosen for the load of this long (a burst is not chased)
    guardrails: GuardrailSettings = field(default_factory=GuardrailSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)


@dataclass(frozen=True)
class TickResult:
    """What one decide/verify step did (for logs, the CLI and tests)."""

    action: str  # none | hold | blocked | advisory | applied | unchanged | rolled_back | failed | verified
    reason: str
    message: str
    decision_id: int | None = None


def config_record(
    spec: dict[str, Any], started_at: datetime, applied_by: str, decision_id: int | None = None
) -> EngineConfigRecord:
    table = spec.get("num_speculative_tokens_per_batch_size")
    k = spec.get("num_speculative_tokens")
    return EngineConfigRecord(
        method=str(spec.get("method", "off")),
        started_at=started_at,
        applied_by=applied_by,
        draft_model=spec.get("model"),
        num_spec_tokens=k if isinstance(k, int) else None,
        k_table=tuple((int(r[0]), int(r[1]), int(r[2])) for r in table) if table else None,
        spec_config=dict(spec),
        decision_id=decision_id,
    )


class Controller:
    def __init__(
        self,
        store: Store,
        actuator: Actuator,
        settings: ControllerSettings,
        clock: Clock,
        policy: Policy | None = None,
        candidates: Candidates | None = None,
    ) -> None:
        self.store = store
        self.actuator = actuator
        self.settings = settings
        self.clock = clock
        self.policy: Policy = policy or (lambda ev: propose(ev, settings.policy))
        # Swap candidates are read on every tick: the operator's registry may change at run time.
        self.candidates: Candidates = candidates or (lambda: ())
        self._streak: tuple[str | None, int] = (None, 0)
        self._last_recorded: tuple[str, str] | None = None  # (target, reason) of the last hold-type row
        self._history_cache = HistoryCache()  # α evidence read so far, per config period
        self._load_profile = LoadProfile()
        # (read at, running draft, T(B, K) with its note and source): re-read every refit_interval_s or on a swap
        self._step_cost_cache: tuple[datetime, tuple[Any, Any], tuple[StepCostModel, str, str] | None] | None = None
        # decide/verify/sync run on scheduler threads: one at a time, so a config recorded by an apply
        # is never raced by the collector's sync recording the same config as "observed".
        self.lock = threading.RLock()

    # -- the three entry points (serialised) ------------------------------------------------------
    def sync_configs(self, now: datetime, applied_by: str = AppliedBy.STARTUP) -> None:
        """Record the actuator's config for engine series that have none or a different one
        (first scrape after a start: the collector has just learned the series' keys)."""
        with self.lock:
            self._sync_configs(now, applied_by)

    def decide(self, now: datetime) -> TickResult:
        """One reconcile step: overrides, else evidence → policy → guardrails → actuator → audit."""
        with self.lock:
            return self._decide(now)

    def verify(self, now: datetime) -> list[TickResult]:
        """Judge every applied change whose evaluation window has passed; roll back a regression."""
        with self.lock:
            return self._verify(now)

    # -- engines and configs ---------------------------------------------------------------------
    def engine_keys(self) -> list[EngineKey]:
        """The engine series this controller drives (every data-parallel rank of the server)."""
        return sorted(
            (
                e.key
                for e in self.store.engines()
                if e.key.url == self.settings.metrics_url
                and (self.settings.model_name is None or e.key.model_name == self.settings.model_name)
            ),
            key=lambda k: (k.model_name, k.engine),
        )

    def current_config(self, keys: Sequence[EngineKey] | None = None) -> StoredConfig | None:
        keys = self.engine_keys() if keys is None else keys
        return self.store.current_config(keys[0]) if keys else None

    def _record_configs(
        self, keys: Sequence[EngineKey], spec: dict[str, Any], at: datetime, applied_by: str, decision_id: int | None
    ) -> None:
        for key in keys:
            self.store.record_config(key, config_record(spec, at, applied_by, decision_id))

    def _sync_configs(self, now: datetime, applied_by: str) -> None:
        """Record the actuator's config for engine series that have none or a different one
        (first scrape after a start: the collector has just learned the series' keys)."""
        spec = self.actuator.current
        if spec is None:
            return
        for key in self.engine_keys():
            stored = self.store.current_config(key)
            if stored is None or config_fingerprint(spec_config_of(stored)) != config_fingerprint(spec):
                self.store.record_config(key, config_record(spec, now, applied_by))

    # -- state from the database -----------------------------------------------------------------
    def state(
        self, now: datetime, keys: Sequence[EngineKey], failed_configs: Sequence[dict[str, Any]] | None = None
    ) -> ControllerState:
        gr = self.settings.guardrails
        look_back = timedelta(seconds=max(3600.0, gr.cooldown_s))
        change_times: list[datetime] = []
        if keys:
            change_times = [
                c.config.started_at
                for c in self.store.configs(keys[0], since=now - look_back, until=now + timedelta(microseconds=1))
                if c.config.applied_by in _CHANGE_SOURCES
            ]
        in_flight = self.store.decisions(status=(DecisionStatus.APPLIED, DecisionStatus.APPLYING))
        pending = any(
            d.status == DecisionStatus.APPLYING or d.decision.action in (CHANGE, manual.OVERRIDE) for d in in_flight
        )
        if failed_configs is None:
            failed_configs = self.failed_configs(now)
        failed = frozenset(config_fingerprint(c) for c in failed_configs)
        target, count = self._streak
        return ControllerState(
            paused=bool(manual.active_pauses(self.store)),
            pending_verification=pending,
            change_times=tuple(change_times),
            streak_target=target,
            streak_count=count,
            failed_targets=failed,
        )

    def measured_downtime_s(self, now: datetime) -> float | None:
        """Median serving gap of this week's applied restarts (from their events), or None if there
        were none: the switching-cost rail then uses the configured ``restart_downtime_s``."""
        if not self.actuator.needs_restart:
            return None
        gaps = [
            float(e.data["downtime_s"])
            for e in self.store.events(now - timedelta(days=7), now + timedelta(microseconds=1), kind="config_applied")
            if isinstance(e.data.get("downtime_s"), int | float)
        ]
        return statistics.median(gaps) if gaps else None

    # -- decide ----------------------------------------------------------------------------------
    def _decide(self, now: datetime) -> TickResult:
        keys = self.engine_keys()
        if not keys:
            return TickResult("none", "no_engine", "No engine series seen yet at this URL; waiting for the collector.")
        current = self.current_config(keys)
        if current is None:
            return TickResult("none", "no_config", "The engine's current config is not known yet.")
        failed = self.failed_configs(now)  # read once: the rails and the policy see the same list
        state = self.state(now, keys, failed)
        evidence = self._evidence(now, keys, current, failed)
        self._watch_budget(now, keys, current, evidence)

        # An override names its engine series when the database holds several servers: only ours.
        overrides = [
            o for o in manual.pending_overrides(self.store) if o.decision.engine is None or o.decision.engine in keys
        ]
        if overrides:
            if state.paused or state.pending_verification:
                return TickResult("blocked", "override_waiting", "A manual override waits for resume or verification.")
            order = overrides[0]
            assert order.decision.proposed_config is not None
            return self._apply(order.id, order.decision.proposed_config, now, keys, AppliedBy.MANUAL)

        outcome = self.policy(evidence)
        low = (outcome.details or {}).get("acceptance_low")
        if low:
            self._event_once(now, keys, current, "acceptance_low", "warning", f"Draft acceptance stays low: {low}")
        if outcome.target is None or outcome.predicted_gain is None or outcome.predicted_gain_ci is None:
            self._streak = (None, 0)
            return TickResult("hold", outcome.reason.value, outcome.message)
        target_fp = config_fingerprint(outcome.target)
        proposal = Proposal(
            target=target_fp,
            predicted_gain=outcome.predicted_gain,
            predicted_gain_ci=outcome.predicted_gain_ci,
            drafts=evidence.spec.drafts,
            evidence_s=evidence.duration_s / max(len(keys), 1),
            needs_restart=self.actuator.needs_restart_for(outcome.target),
        )
        rails = self.settings.guardrails
        measured_s = self.actuator.switching_cost_s(outcome.target)
        if measured_s is None:
            measured_s = self.measured_downtime_s(now)
        if measured_s is not None:
            rails = replace(rails, restart_downtime_s=measured_s)
        block = check_guardrails(rails, state, proposal, now)
        self._streak = next_streak(state, target_fp)
        inputs = {**evidence.to_inputs(), "policy": outcome.details or {}}
        if block is not None:
            return self._record_once(
                now,
                keys,
                outcome,
                inputs,
                DecisionStatus.BLOCKED,
                block.reason.value,
                f"{outcome.message} Held back: {block.message}",
            )
        if self.settings.mode != "auto":
            return self._record_once(
                now,
                keys,
                outcome,
                inputs,
                DecisionStatus.ADVISORY,
                outcome.reason.value,
                f"{outcome.message} (advisory mode: not applied)",
            )
        decision_id = self.store.record_decision(
            DecisionRecord(
                created_at=now,
                action=CHANGE,
                reason=outcome.reason.value,
                message=outcome.message,
                inputs=inputs,
                mode="auto",
                engine=keys[0],
                proposed_config=outcome.target,
                predicted_gain=outcome.predicted_gain,
                status=DecisionStatus.APPLYING,
            )
        )
        self._streak = (None, 0)
        return self._apply(decision_id, outcome.target, now, keys, self.actuator.kind)

    def _record_once(
        self,
        now: datetime,
        keys: Sequence[EngineKey],
        outcome: PolicyOutcome,
        inputs: dict[str, Any],
        status: str,
        reason: str,
        message: str,
    ) -> TickResult:
        """Audit a held-back or advisory proposal once per (target, reason), not on every tick."""
        marker = (config_fingerprint(outcome.target), f"{status}:{reason}")
        if marker == self._last_recorded:
            return TickResult(str(status), reason, message)
        self._last_recorded = marker
        decision_id = self.store.record_decision(
            DecisionRecord(
                created_at=now,
                action=CHANGE,
                reason=reason,
                message=message,
                inputs=inputs,
                mode=self.settings.mode,
                engine=keys[0],
                proposed_config=outcome.target,
                predicted_gain=outcome.predicted_gain,
                status=status,
            )
        )
        log.info("controller %s: %s", self.settings.metrics_url, message)
        return TickResult(str(status), reason, message, decision_id)

    def _apply(
        self, decision_id: int, target: dict[str, Any], now: datetime, keys: Sequence[EngineKey], applied_by: str
    ) -> TickResult:
        self.store.update_decision(decision_id, status=DecisionStatus.APPLYING, at=now)
        previous = self.actuator.current or {}

        def note(message: str) -> None:
            self.store.update_decision(
                decision_id, status=DecisionStatus.APPLYING, at=max(self.clock(), now), status_message=message
            )

        self.actuator.progress = note
        try:
            result = self.actuator.apply(target)
        finally:
            self.actuator.progress = lambda message: None
        done_at = max(self.clock(), now)
        self._last_recorded = None
        if result.status is ApplyStatus.APPLIED:
            self._record_configs(keys, target, done_at, applied_by, decision_id)
            self.store.update_decision(
                decision_id, status=DecisionStatus.APPLIED, at=done_at, status_message=result.message
            )
            self._event(
                done_at,
                keys,
                "config_applied",
                "info",
                f"Applied {_describe(target)}: {result.message}",
                decision_id,
                result,
            )
            kind = change_kind(previous, target)
            if kind is not None:
                self._event(done_at, keys, kind, "info", f"{_describe(previous)} → {_describe(target)}", decision_id)
            return TickResult("applied", "applied", result.message, decision_id)
        if result.status is ApplyStatus.UNCHANGED:
            self.store.update_decision(
                decision_id, status=DecisionStatus.VERIFIED, at=done_at, status_message=result.message
            )
            return TickResult("unchanged", "unchanged", result.message, decision_id)
        if result.status is ApplyStatus.ROLLED_BACK and result.config is not None:
            # The engine restarted with the old config: a new config period begins (and counts for cooldown).
            self._record_configs(keys, result.config, done_at, AppliedBy.ROLLBACK, decision_id)
            self.store.update_decision(
                decision_id, status=DecisionStatus.ROLLED_BACK, at=done_at, status_message=result.message
            )
            self._event(
                done_at,
                keys,
                "apply_rolled_back",
                "warning",
                f"{_describe(target)} did not come up; rolled back: {result.message}",
                decision_id,
                result,
            )
            return TickResult("rolled_back", "start_failed", result.message, decision_id)
        self.store.update_decision(decision_id, status=DecisionStatus.FAILED, at=done_at, status_message=result.message)
        severity = "critical" if result.config is None and self.actuator.kind == "restart" else "warning"
        self._event(
            done_at,
            keys,
            "apply_failed",
            severity,
            f"Applying {_describe(target)} failed: {result.message}",
            decision_id,
            result,
        )
        return TickResult("failed", "apply_failed", result.message, decision_id)

    def _event(
        self,
        ts: datetime,
        keys: Sequence[EngineKey],
        kind: str,
        severity: str,
        message: str,
        decision_id: int | None,
        result: ApplyResult | None = None,
    ) -> None:
        data: dict[str, Any] = {"decision_id": decision_id}
        if result is not None:
            data.update(result.event_data())
        self.store.write_events(
            [
                EventRecord(
                    ts=ts, kind=kind, message=message, severity=severity, engine=keys[0] if keys else None, data=data
                )
            ]
        )

    def _evidence(
        self, now: datetime, keys: Sequence[EngineKey], current: StoredConfig, failed: Sequence[dict[str, Any]]
    ) -> Evidence:
        """The policy's snapshot: windows under the current config and, when draft candidates are
        configured, the swap trigger's windows, each candidate's measured α and recent failures."""
        evidence = gather_evidence(self.store, keys, current, now, self.settings.evidence_window_s)
        evidence = replace(
            evidence,
            failed_configs=tuple(failed),
            load_profile=self._load_profile.update(self.store, keys, now, self.settings.load_horizon_s)
            if not self.settings.policy.per_batch_size
            else (),
        )
        swap = self.settings.policy.swap
        candidates = tuple(self.candidates())
        spec = spec_config_of(current)
        running, everyone = current_candidate(spec, candidates, self.settings.policy.cost_ratio)
        fit = self.settings.step_cost_fit
        if fit is not None:
            ratio = running.cost_ratio_for(self.settings.policy.target_params) if running is not None else None
            cached = self._step_cost_cache
            if (
                cached is not None
                and cached[1] == draft_identity(spec)
                and now - cached[0] < timedelta(seconds=fit.refit_interval_s)
            ):
                fitted = cached[2]
            else:
                fitted = step_cost_from_steps(
                    self.store,
                    keys,
                    spec,
                    config_specs(self.store, keys, now, fit.horizon_s),
                    now,
                    fit,
                    self.settings.policy.cost_ratio if ratio is None else ratio,
                    pinned=self.settings.policy.step_cost,
                )
                self._step_cost_cache = (now, draft_identity(spec), fitted)
            if fitted is not None:
                evidence = replace(evidence, step_cost=fitted[0], step_cost_note=fitted[1], step_cost_source=fitted[2])
        if swap is None or not candidates:
            return evidence
        return replace(
            evidence,
            trigger_windows=spec_windows(self.store, keys, current, now, swap.duration_s),
            candidates=candidates,
            history=measured_history(
                self.store, keys, now, self.settings.history_s, everyone, same_draft, self._history_cache
            ),
        )

    def failed_configs(self, now: datetime) -> list[dict[str, Any]]:
        """Configs the controller proposed that did not come up (or were rolled back) lately."""
        since = now - timedelta(seconds=self.settings.failed_retry_s)
        return [
            dict(d.decision.proposed_config)
            for d in self.store.decisions(since, None, status=(DecisionStatus.ROLLED_BACK, DecisionStatus.FAILED))
            if d.decision.proposed_config is not None and d.decision.action == CHANGE
        ]

    def _event_once(
        self, now: datetime, keys: Sequence[EngineKey], current: StoredConfig, kind: str, severity: str, message: str
    ) -> None:
        """An event raised at most once per config period (a condition, not every tick)."""
        since = current.config.started_at
        if self.store.events(since, now + timedelta(microseconds=1), kind=kind):
            return
        self._event(now, keys, kind, severity, message, None)

    def _watch_budget(self, now: datetime, keys: Sequence[EngineKey], current: StoredConfig, ev: Evidence) -> None:
        """Raise ``budget_exceeded`` when the config in force breaks the memory budget at the load seen."""
        p = self.settings.policy
        if p.memory is None:
            return
        spec = spec_config_of(current)
        k = spec.get("num_speculative_tokens")
        running, _ = current_candidate(spec, tuple(self.candidates()), p.cost_ratio)
        if running is None or not isinstance(k, int) or k < 1:
            return
        seqs = max(1, round(max((b for _, b in ev.batch_profile), default=ev.mean_batch_size or 1.0)))
        check = check_memory(running.footprint(), k, seqs, p.memory)
        if not check.fits:
            self._event_once(now, keys, current, "budget_exceeded", "warning", f"{_describe(spec)}: {check.message}")

    # -- verify ----------------------------------------------------------------------------------
    def _verify(self, now: datetime) -> list[TickResult]:
        """Judge every applied change whose evaluation window has passed; roll back a regression."""
        out: list[TickResult] = []
        keys = self.engine_keys()
        for d in self.store.decisions(status=DecisionStatus.APPLIED):
            if d.decision.action not in (CHANGE, manual.OVERRIDE):
                continue
            applied_at = d.updated_at
            if now < applied_at + timedelta(seconds=self.settings.verify_window_s):
                continue
            after = windows_under(self.store, keys, applied_at, applied_at, now + timedelta(microseconds=1))
            before_rates = [float(r) for r in d.decision.inputs.get("window_rates", [])]
            before_batches = [
                float(b) if isinstance(b, int | float) else None for b in d.decision.inputs.get("window_batches", [])
            ]
            after_rates = summarize(after)[3]
            shift, shift_note = _acceptance_shift(d.decision.inputs, d.decision.proposed_config, after)
            verdict = judge_at_matched_load(
                before_rates,
                before_batches,
                [r / shift for r in after_rates],
                window_batches(after),
                tolerance=self.settings.regression_tolerance,
            )
            if shift_note:
                verdict = replace(verdict, message=f"{verdict.message} {shift_note}")
            previous = d.decision.inputs.get("current_config")
            if verdict.rollback and d.decision.action == CHANGE and isinstance(previous, dict):
                out.append(self._roll_back(d.id, previous, verdict.message, verdict.realized_gain, now, keys))
                continue
            self.store.update_decision(
                d.id,
                status=DecisionStatus.VERIFIED,
                at=now,
                realized_gain=verdict.realized_gain,
                status_message=verdict.message,
            )
            out.append(TickResult("verified", verdict.reason.value, verdict.message, d.id))
        return out

    def _roll_back(
        self,
        decision_id: int,
        previous: dict[str, Any],
        why: str,
        gain: float | None,
        now: datetime,
        keys: Sequence[EngineKey],
    ) -> TickResult:
        result = self.actuator.apply(previous)
        done_at = max(self.clock(), now)
        if result.status in (ApplyStatus.APPLIED, ApplyStatus.UNCHANGED):
            if result.status is ApplyStatus.APPLIED:
                self._record_configs(keys, previous, done_at, AppliedBy.ROLLBACK, decision_id)
            self.store.update_decision(
                decision_id, status=DecisionStatus.ROLLED_BACK, at=done_at, realized_gain=gain, status_message=why
            )
            self._event(done_at, keys, "regression_rolled_back", "warning", why, decision_id, result)
            return TickResult("rolled_back", "regressed", why, decision_id)
        message = f"{why} The rollback itself failed: {result.message}"
        self.store.update_decision(
            decision_id, status=DecisionStatus.FAILED, at=done_at, realized_gain=gain, status_message=message
        )
        self._event(done_at, keys, "rollback_failed", "critical", message, decision_id, result)
        return TickResult("failed", "rollback_failed", message, decision_id)

    # -- recovery --------------------------------------------------------------------------------
    def recover(self, now: datetime) -> list[int]:
        """After a crash: applies that never finished are marked failed (the daemon starts the engine
        with the last recorded config). Returns the ids it closed."""
        closed: list[int] = []
        keys = self.engine_keys()
        for d in self.store.decisions(status=DecisionStatus.APPLYING):
            got = d.status_message or ""
            if got.startswith(START_FAILED):
                # The new config had already failed to start: finishing the rollback is what the daemon
                # does next (it starts the last recorded config), so it is recorded as one.
                message = (
                    f"{got.split(';')[0]}; the daemon stopped while restoring the previous config, and the "
                    "next daemon restarted the last recorded config"
                )
                self.store.update_decision(d.id, status=DecisionStatus.ROLLED_BACK, at=now, status_message=message)
                self._event(now, keys, "apply_rolled_back", "warning", message, d.id)
            else:
                # Failed: a config whose apply coincided with a crash is not retried automatically (it may
                # have caused it); an operator can apply it by hand (spectuner apply).
                self.store.update_decision(
                    d.id,
                    status=DecisionStatus.FAILED,
                    at=now,
                    status_message="interrupted: the daemon stopped during this apply; it restarted with the last "
                    "recorded config",
                )
            closed.append(d.id)
        if closed:
            self._event(
                now,
                keys,
                "apply_interrupted",
                "warning",
                f"{len(closed)} apply(s) were interrupted by a daemon stop; state recovered",
                None,
            )
        return closed

    def config_to_start(self, default: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The config the engine should (re)start with: the last recorded one, else ``default``."""
        current = self.current_config()
        if current is not None:
            return spec_config_of(current), "database"
        return dict(default), "config file"


_SHIFT_MIN_DRAFTS = 200  # drafts each side needs before the acceptance shift is corrected for


def _acceptance_shift(
    inputs: dict[str, Any], proposed: dict[str, Any] | None, after: Sequence[WindowRecord]
) -> tuple[float, str]:
    """(factor, note): how much the workload's acceptance alone moved tokens per step between the
    decision's evidence and the windows after a change of K under the same draft
    (``verify.acceptance_shift``); 1 for a draft swap (moving α is its point) or when either side
    drafted too little. Read at the first draft position, which every draft has at any K: a larger
    K's later, weaker positions must not pass for harder prompts."""
    previous = inputs.get("current_config")
    if not isinstance(previous, dict) or proposed is None or draft_identity(previous) != draft_identity(proposed):
        return 1.0, ""
    drafts_before = inputs.get("drafts")
    per_pos = inputs.get("accepted_per_pos")
    if (
        not isinstance(drafts_before, int)
        or drafts_before < _SHIFT_MIN_DRAFTS
        or not isinstance(per_pos, list)
        or not per_pos
        or not isinstance(per_pos[0], int | float)
    ):  # an audit row from before these inputs, or one edited by hand: judge on raw rates
        return 1.0, ""
    drafts_after = sum(w.spec.drafts for w in after if w.spec is not None)
    if drafts_after < _SHIFT_MIN_DRAFTS:
        return 1.0, ""
    first_after = sum(w.spec.accepted_per_pos[0] for w in after if w.spec is not None and w.spec.accepted_per_pos)
    alpha_before = min(max(float(per_pos[0]) / drafts_before, 0.0), 1.0)
    alpha_after = min(max(first_after / drafts_after, 0.0), 1.0)
    k_after = sum(w.spec.draft_tokens for w in after if w.spec is not None) / drafts_after
    shift = acceptance_shift(alpha_before, alpha_after, k_after)
    if abs(shift - 1.0) < 0.01:
        return 1.0, ""
    return shift, (
        f"Rates after the change divided by {shift:.3f}: the first draft token's acceptance moved "
        f"{alpha_before:.3f} → {alpha_after:.3f} with the prompts, which changes tokens per step under any "
        f"config (at the {k_after:.1f} tokens drafted per step after the change)."
    )


def change_kind(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """``draft_swapped`` when the method or draft changes, ``k_changed`` when only K or the table does."""
    if not before:
        return None
    if before.get("method") != after.get("method") or before.get("model") != after.get("model"):
        return "draft_swapped"
    keys = ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")
    if any(before.get(k) != after.get(k) for k in keys):
        return "k_changed"
    return None


def _describe(spec: dict[str, Any]) -> str:
    method = spec.get("method")
    parts = [f"method={method}"]
    if spec.get("model"):
        parts.append(f"draft={spec['model']}")
    if "num_speculative_tokens" in spec:
        parts.append(f"K={spec['num_speculative_tokens']}")
    table = spec.get("num_speculative_tokens_per_batch_size")
    if table:
        parts.append("table=" + ",".join(f"{r[0]}-{r[1]}:{r[2]}" for r in table))
    return "config " + " ".join(parts)


__all__ = ["CHANGE", "Controller", "ControllerSettings", "TickResult", "config_record"]
