"""The controller: one decision is context → policy → guardrails → apply → audit; one verification is
after-windows → verdict → keep or roll back.

Reading order for one K decision (docs/architecture.md): :meth:`Controller.decide` here →
:func:`~tuner.controller.context.build_context` (the only store reads) →
:func:`~tuner.controller.policy.propose` (pure, composed from ``policies/``) →
:func:`~tuner.controller.guardrails.check_guardrails` (pure rails) →
:func:`~tuner.controller.apply.apply_config` (actuator + audit).

The controller holds no state that matters across restarts: pauses, overrides, pending
verifications, recent changes and recently failed configs are read from the database on every tick;
what it carries between ticks is one explicit value, :class:`~tuner.controller.context.ControllerMemory`.
Time comes in as ``now`` (and ``clock`` for the moment an apply finished); nothing here reads the
system clock.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from collectors.records import EngineKey
from policies.canary import CanaryDecision
from policies.draft_choice import DraftCandidate
from policies.memory import check_memory
from policies.spec_config import SpecConfig
from policies.speedup import independent_ratio_interval
from tuner.actuators.base import Actuator
from tuner.config import GuardrailsSection
from tuner.controller import manual
from tuner.controller.apply import apply_config, in_force, roll_back
from tuner.controller.audit import CHANGE, CHANGE_SOURCES, TickResult, record_configs, write_event
from tuner.controller.canary import CANARY, CanaryPlan, canaries_among, contested, find_peers, plan_of, promote
from tuner.controller.canary import judge as judge_canary_here
from tuner.controller.candidates import current_candidate
from tuner.controller.context import ControllerMemory, DecisionContext, DecisionInputs, build_context
from tuner.controller.evidence import summarize, window_batches, windows_under
from tuner.controller.guardrails import (
    BlockReason,
    ControllerState,
    Proposal,
    check_gain,
    check_guardrails,
    check_switching_cost,
    next_streak,
)
from tuner.controller.override_check import check_override
from tuner.controller.policy import PolicyOutcome, propose
from tuner.controller.recovery import config_to_start, recover
from tuner.controller.settings import ControllerSettings
from tuner.controller.verify import judge_at_matched_load, prompt_shift
from tuner.store import AppliedBy, DecisionRecord, DecisionStatus, Store, StoredConfig, StoredDecision

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
Policy = Callable[[DecisionContext], PolicyOutcome]
Candidates = Callable[[], Sequence[DraftCandidate]]

# Applied decisions that are verified after their window (a promotion: its canary judged it)
VERIFIED_ACTIONS = (CHANGE, manual.OVERRIDE, manual.PROMOTE)
SUPERSEDED = "superseded"  # an override replaced by a newer one before it was applied
REJECTED = "rejected"  # an override the daemon's own config refuses (K range, unknown draft, memory budget)


# rails that hold any change back alike (time, pause, the streak): a K change held by one of them is still
# taken before a swap, which they would hold as well
_SHARED_BLOCKS = frozenset({
    BlockReason.PAUSED, BlockReason.PENDING_VERIFICATION, BlockReason.CANARY_ELSEWHERE, BlockReason.NOT_PERSISTENT,
    BlockReason.COOLDOWN, BlockReason.TOO_MANY_CHANGES, BlockReason.OUTSIDE_MAINTENANCE_WINDOW,
})  # fmt: skip


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
        # the settings in force at each decision (the simulator re-pins [policy.step_cost] after a swap)
        self.policy: Policy = policy or (lambda ctx: propose(ctx, self.settings.policy))
        # Swap candidates are read on every tick: the operator's registry may change at run time.
        self.candidates: Candidates = candidates or (lambda: ())
        self.memory = ControllerMemory()
        # decide/verify/sync run on scheduler threads: one at a time, so a config recorded by an apply
        # is never raced by the collector's sync recording the same config as "observed".
        self.lock = threading.RLock()

    # -- the entry points (serialised) -------------------------------------------------------------
    def sync_configs(self, now: datetime, applied_by: str = AppliedBy.STARTUP) -> None:
        """Record the actuator's config for engine series that have none or a different one
        (first scrape after a start: the collector has just learned the series' keys)."""
        # Waits behind an apply on purpose: the collect job then stores no window while the engine changes
        # under it, so no window of the new engine is tagged with the old config (it would pollute the old
        # draft's measured history); the apply records the new config when it is in force.
        with self.lock:
            spec = in_force(self.actuator)
            if spec is None:
                return
            for key in self.engine_keys():
                stored = self.store.current_config(key)
                if stored is None or stored.config.spec.fingerprint != spec.fingerprint:
                    record_configs(self.store, [key], spec, now, applied_by)

    def decide(self, now: datetime) -> TickResult:
        """One reconcile step: overrides, else context → policy → guardrails → actuator → audit."""
        with self.lock:
            return self._decide(now)

    def verify(self, now: datetime) -> list[TickResult]:
        """Judge every applied change whose evaluation window has passed; roll back a regression."""
        with self.lock:
            return [self._verify_one(d, now) for d in self._due(now)]

    def recover(self, now: datetime) -> list[int]:
        """After a crash: applies that never finished are closed (:mod:`tuner.controller.recovery`)."""
        with self.lock:
            return recover(self.store, self.engine_keys(), now)

    def config_to_start(self, default: SpecConfig) -> tuple[SpecConfig, str]:
        return config_to_start(self.current_config(), default)

    # -- engines and state from the database -------------------------------------------------------
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

    def failed_configs(self, now: datetime) -> list[SpecConfig]:
        """Configs the controller proposed that did not come up (or were rolled back) lately."""
        since = now - timedelta(seconds=self.settings.failed_retry_s)
        out = []
        for d in self.store.decisions(since, None, status=(DecisionStatus.ROLLED_BACK, DecisionStatus.FAILED)):
            proposed = d.decision.proposed
            if proposed is not None and d.decision.action == CHANGE:
                out.append(proposed)
        return out

    def state(self, now: datetime, keys: Sequence[EngineKey], failed: Sequence[SpecConfig]) -> ControllerState:
        gr = self.settings.guardrails
        look_back = timedelta(seconds=max(3600.0, gr.cooldown_s))
        change_times: list[datetime] = []
        if keys:
            change_times = [
                c.config.started_at
                for c in self.store.configs(keys[0], since=now - look_back, until=now + timedelta(microseconds=1))
                if c.config.applied_by in CHANGE_SOURCES
            ]
        live = self.store.decisions(status=(DecisionStatus.APPLIED, DecisionStatus.APPLYING))  # every server's
        in_flight = [d for d in live if _mine(d, keys)]
        pending = any(
            d.status == DecisionStatus.APPLYING or d.decision.action in VERIFIED_ACTIONS for d in in_flight
        )
        elsewhere = canaries_among(live, keys[0].model_name, exclude=keys) if keys else []
        target, count = self.memory.streak
        return ControllerState(
            paused=bool(manual.active_pauses(self.store)),
            pending_verification=pending,
            canary_elsewhere=(
                f"A canary of this target runs on {elsewhere[0].decision.engine.url} (decision {elsewhere[0].id})"
                if elsewhere and elsewhere[0].decision.engine is not None
                else None
            ),
            change_times=tuple(change_times),
            streak_target=target,
            streak_count=count,
            failed_targets=frozenset(c.fingerprint for c in failed),
        )

    def switching_cost_s(self, target: SpecConfig, now: datetime) -> float | None:
        """Seconds of serving a change to ``target`` is expected to cost: the actuator's own figure for its
        strategy, else the median serving gap of this week's applied restarts, else None (the rail then
        uses the configured ``restart_downtime_s``)."""
        cost = self.actuator.switching_cost_s(target.to_vllm())
        if cost is not None or not self.actuator.needs_restart:
            return cost
        gaps = [
            float(e.data["downtime_s"])
            for e in self.store.events(now - timedelta(days=7), now + timedelta(microseconds=1), kind="config_applied")
            if isinstance(e.data.get("downtime_s"), int | float)
        ]
        return statistics.median(gaps) if gaps else None

    # -- decide ------------------------------------------------------------------------------------
    def _decide(self, now: datetime) -> TickResult:
        keys = self.engine_keys()
        if not keys:
            return TickResult("none", "no_engine", "No engine series seen yet at this URL; waiting for the collector.")
        current = self.current_config(keys)
        if current is None:
            return TickResult("none", "no_config", "The engine's current config is not known yet.")
        failed = self.failed_configs(now)  # read once: the rails and the policy see the same list
        state = self.state(now, keys, failed)
        ctx, self.memory = build_context(
            self.store, keys, current, now, self.settings, tuple(self.candidates()), failed, self.memory
        )
        self._watch_budget(ctx, current)

        override = self._override(keys, now)
        if override is not None:
            if state.paused or state.pending_verification or state.canary_elsewhere:
                why = f" ({state.canary_elsewhere})" if state.canary_elsewhere else ""
                return TickResult(
                    "blocked", "override_waiting", f"A manual override waits for resume or verification{why}."
                )
            order, target = override
            self.memory = replace(self.memory, last_recorded=None)
            return self._apply_order(order, target, keys, current, now)

        outcome = self.policy(ctx)
        if outcome.acceptance_low:
            self._event_once(
                ctx, current, "acceptance_low", "warning", f"Draft acceptance stays low: {outcome.acceptance_low}"
            )
        if outcome.target is None or outcome.predicted_gain is None or outcome.predicted_gain_ci is None:
            self.memory = replace(self.memory, streak=(None, 0))
            return TickResult("hold", outcome.reason.value, outcome.message)
        proposal, rails = self._proposal(ctx, outcome, keys, now)
        alternative = self._live_alternative(ctx, outcome, proposal, rails, state, keys, now)
        if alternative is not None:
            outcome, proposal, rails = alternative
        block = check_guardrails(rails, state, proposal, now)
        self.memory = replace(self.memory, streak=next_streak(state, proposal.streak_target))
        inputs = ctx.to_inputs(outcome.details).to_json()
        if block is not None:
            return self._record_once(
                ctx, outcome, inputs, DecisionStatus.BLOCKED, block.reason.value,
                f"{outcome.message} Held back: {block.message}",
            )  # fmt: skip
        if not self.settings.auto:
            return self._record_once(
                ctx, outcome, inputs, DecisionStatus.ADVISORY, outcome.reason.value,
                f"{outcome.message} (advisory mode: not applied)",
            )  # fmt: skip
        return self._apply_change(ctx, outcome, inputs)

    def _proposal(
        self, ctx: DecisionContext, outcome: PolicyOutcome, keys: Sequence[EngineKey], now: datetime
    ) -> tuple[Proposal, GuardrailsSection]:
        """What the rails judge of ``outcome`` (a target and a predicted gain), and the rails' settings with
        the switching cost of its apply path."""
        assert outcome.target is not None and outcome.predicted_gain is not None
        assert outcome.predicted_gain_ci is not None
        proposal = Proposal(
            target=outcome.target.fingerprint,
            predicted_gain=outcome.predicted_gain,
            predicted_gain_ci=outcome.predicted_gain_ci,
            # the evidence rail counts drafts as independent trials only up to the windows' over-dispersion
            drafts=(
                int(ctx.spec.drafts / ctx.alpha.dispersion)
                if outcome.evidence_drafts is None
                else outcome.evidence_drafts
            ),
            evidence_s=ctx.duration_s / max(len(keys), 1),
            needs_restart=self.actuator.needs_restart_for(outcome.target.to_vllm()),
            horizon_s=ctx.regime_remaining_s,
            horizon_basis=ctx.regime_basis,
            restarts=outcome.restarts,
            way_back_share=outcome.way_back_share,
            way_back_lag_s=outcome.way_back_lag_s,
            streak_key=outcome.streak_key,
            confidence=self.settings.policy.policy.confidence,
        )
        rails = self.settings.guardrails
        cost_s = self.switching_cost_s(outcome.target, now)
        if cost_s is not None:
            rails = rails.model_copy(update={"restart_downtime_s": cost_s})
        return proposal, rails

    def _live_alternative(
        self,
        ctx: DecisionContext,
        outcome: PolicyOutcome,
        proposal: Proposal,
        rails: GuardrailsSection,
        state: ControllerState,
        keys: Sequence[EngineKey],
        now: datetime,
    ) -> tuple[PolicyOutcome, Proposal, GuardrailsSection] | None:
        """The least disruptive path first: a swap beyond failure that needs a restart gives way to the
        running draft's own K proposal when that one applies without a restart and no rail holds it back
        for its own sake (a time or streak rail holds either change alike, and the streak then builds on
        the K change); the swap is judged again against the config it leaves in force. Unless the swap is
        worth its restart by its gain beyond the K change alone. None: the swap stands."""
        alt = outcome.alternative
        if alt is None or alt.target is None or alt.predicted_gain is None or not proposal.needs_restart:
            return None
        alt_proposal, alt_rails = self._proposal(ctx, alt, keys, now)
        if alt_proposal.needs_restart:
            return None
        if self._worth_its_restart_beyond(outcome, proposal, alt, rails, state, now):
            return None
        block = check_guardrails(alt_rails, state, alt_proposal, now)
        if block is not None and block.reason not in _SHARED_BLOCKS:
            return None  # the K change itself is held back (evidence, gain, a known bad K): the swap stands
        message = (
            f"{alt.message} Taken before the swap it is part of ({outcome.message}): it needs no restart; the "
            "swap is judged again against it."
        )
        return replace(alt, message=message), alt_proposal, alt_rails

    @staticmethod
    def _worth_its_restart_beyond(
        swap: PolicyOutcome,
        proposal: Proposal,
        alt: PolicyOutcome,
        rails: GuardrailsSection,
        state: ControllerState,
        now: datetime,
    ) -> bool:
        """Whether the swap's gain beyond its K alternative's is by itself surely worth its restart (the
        gain and payback rails), and nothing but time, the streak or evidence still to come holds the swap
        back. Then the K change would only be superseded, and its verification window and the streak it
        restarts would delay the swap (5 Dec 17:24 live: good at 1.88x against medium's best K at 1.18x
        waited 85 s behind medium's K change, until too little of the phase was left to repay a restart)."""
        assert swap.predicted_gain is not None and swap.predicted_gain_ci is not None
        assert alt.predicted_gain is not None and alt.predicted_gain_ci is not None
        # both gains are against the config in force; their intervals combine as independent (conservative:
        # the config in force's own uncertainty is counted twice)
        beyond_ci = independent_ratio_interval(
            swap.predicted_gain, swap.predicted_gain_ci, alt.predicted_gain, alt.predicted_gain_ci
        )
        beyond = replace(proposal, predicted_gain=swap.predicted_gain / alt.predicted_gain,
                         predicted_gain_ci=beyond_ci)  # fmt: skip
        if check_gain(rails, state, beyond, now) or check_switching_cost(rails, state, beyond, now):
            return False
        block = check_guardrails(rails, state, proposal, now)
        return block is None or block.reason in _SHARED_BLOCKS | {BlockReason.INSUFFICIENT_EVIDENCE}

    def _apply_change(self, ctx: DecisionContext, outcome: PolicyOutcome, inputs: dict[str, object]) -> TickResult:
        """Auto mode, every rail passed: audit the change as ``applying``, then apply it (as a canary when
        untouched replicas share the store and ``[canary]`` is enabled)."""
        assert outcome.target is not None
        plan = self._canary_plan(ctx.keys, ctx.current, ctx.now)
        message = outcome.message
        if plan is not None:
            inputs = {**inputs, CANARY: plan.to_json()}
            message += f" Applied as a canary: {len(plan.peers)} untouched replica(s) are its baseline."
        decision_id = self.store.record_decision(
            DecisionRecord(
                created_at=ctx.now,
                action=CHANGE,
                reason=outcome.reason.value,
                message=message,
                inputs=dict(inputs),
                mode="auto",
                engine=ctx.keys[0],
                proposed_config=outcome.target.to_vllm(),
                predicted_gain=outcome.predicted_gain,
                status=DecisionStatus.APPLYING,
            )
        )
        self.memory = replace(self.memory, streak=(None, 0), last_recorded=None)
        if plan is not None and (other := self._step_back(ctx.keys, decision_id, ctx.now)) is not None:
            return other
        return apply_config(
            self.store, self.actuator, self.clock, decision_id, outcome.target, ctx.now, ctx.keys, self.actuator.kind
        )

    # -- canary ------------------------------------------------------------------------------------
    def _canary_plan(self, keys: Sequence[EngineKey], current: SpecConfig, now: datetime) -> CanaryPlan | None:
        if not self.settings.canary.enabled:
            return None
        peers = find_peers(self.store, keys, current, now, self.settings.canary)
        return CanaryPlan(peers, current) if peers else None

    def _step_back(self, keys: Sequence[EngineKey], decision_id: int, now: datetime) -> TickResult | None:
        """Another replica recorded a canary at the same moment: both step back (never two at once)."""
        other = contested(self.store, keys, decision_id)
        if other is None:
            return None
        why = (
            f"Not applied: replica {other.decision.engine.url if other.decision.engine else '?'} started a canary "
            f"(decision {other.id}) at the same moment; one canary at a time, tried again on a later tick."
        )
        self.store.update_decision(decision_id, status=DecisionStatus.BLOCKED, at=now, status_message=why)
        return TickResult("blocked", "canary_contested", why, decision_id)

    def _apply_order(
        self, order: StoredDecision, target: SpecConfig, keys: Sequence[EngineKey], current: StoredConfig, now: datetime
    ) -> TickResult:
        """An operator's override (as a canary when asked and untouched replicas exist), or a promotion."""
        if order.decision.action == manual.PROMOTE:
            return apply_config(self.store, self.actuator, self.clock, order.id, target, now, keys, AppliedBy.PROMOTED)
        if order.decision.inputs.get(CANARY) is True:
            plan = self._canary_plan(keys, current.config.spec, now)
            if plan is not None:
                self.store.update_decision(
                    order.id, status=order.status, at=now, inputs={**order.decision.inputs, CANARY: plan.to_json()},
                    status_message=f"Applied as a canary: {len(plan.peers)} untouched replica(s) are its baseline.",
                )  # fmt: skip
            else:
                why = (
                    f"Override {order.id} was asked as a canary, but no untouched replica of this target shares the "
                    "store ([canary] disabled, or none runs this config now): applied as a plain override."
                )
                write_event(self.store, now, keys, "canary_unavailable", "warning", why, order.id)
        return apply_config(self.store, self.actuator, self.clock, order.id, target, now, keys, AppliedBy.MANUAL)

    def _override(self, keys: Sequence[EngineKey], now: datetime) -> tuple[StoredDecision, SpecConfig] | None:
        """The operator's override to apply: the newest pending one for this server (an override names its
        engine series when the database holds several servers). Older pending ones are closed as
        superseded, so overrides queued while no engine was seen are applied at most once, the newest."""
        pending = [
            o for o in manual.pending_overrides(self.store) if o.decision.engine is None or o.decision.engine in keys
        ]
        if not pending:
            return None
        newest = pending[-1]
        for older in pending[:-1]:
            self.store.update_decision(
                older.id, status=SUPERSEDED, at=now, status_message=f"superseded by override {newest.id}"
            )
        # re-validated here: the row may come from an older CLI, another config, or a hand edit
        p = self.settings.policy
        current = self.current_config(keys)
        configured = tuple(self.candidates())
        everyone = current_candidate(current.config.spec, configured, p.policy.cost_ratio)[1] if current else configured
        problem = check_override(
            newest.decision.proposed_config or {},
            k_max=p.policy.k_max,
            drafts=everyone,
            memory=p.memory,
            running_seqs=p.policy.max_batch_size,
        )
        target = newest.decision.proposed
        if problem is None and target is None:
            problem = "override refused: it holds no usable config"
        if problem is not None or target is None:
            self.store.update_decision(newest.id, status=REJECTED, at=now, status_message=problem)
            write_event(
                self.store, now, keys, "override_rejected", "warning", f"Override {newest.id}: {problem}", newest.id
            )
            log.warning("controller %s: override %d %s", self.settings.metrics_url, newest.id, problem)
            return None
        return newest, target

    def _record_once(
        self, ctx: DecisionContext, outcome: PolicyOutcome, inputs: dict[str, object], status: str, reason: str,
        message: str,
    ) -> TickResult:  # fmt: skip
        """Audit a held-back or advisory proposal once per (target, reason), not on every tick."""
        assert outcome.target is not None
        marker = (outcome.target.fingerprint, f"{status}:{reason}")
        if marker == self.memory.last_recorded:
            return TickResult(str(status), reason, message)
        self.memory = replace(self.memory, last_recorded=marker)
        decision_id = self.store.record_decision(
            DecisionRecord(
                created_at=ctx.now,
                action=CHANGE,
                reason=reason,
                message=message,
                inputs=dict(inputs),
                mode=self.settings.controller.mode.value,
                engine=ctx.keys[0],
                proposed_config=outcome.target.to_vllm(),
                predicted_gain=outcome.predicted_gain,
                status=status,
            )
        )
        log.info("controller %s: %s", self.settings.metrics_url, message)
        return TickResult(str(status), reason, message, decision_id)

    def _event_once(self, ctx: DecisionContext, current: StoredConfig, kind: str, severity: str, message: str) -> None:
        """An event raised at most once per config period (a condition, not every tick)."""
        if self.store.events(current.config.started_at, ctx.now + timedelta(microseconds=1), kind=kind):
            return
        write_event(self.store, ctx.now, ctx.keys, kind, severity, message, None)

    def _watch_budget(self, ctx: DecisionContext, current: StoredConfig) -> None:
        """Raise ``budget_exceeded`` when the config in force breaks the memory budget at the load seen."""
        memory = self.settings.policy.memory
        if memory is None or ctx.running is None or not ctx.current.speculates:
            return
        seqs = max(1, round(max((b for _, b in ctx.batch_profile), default=ctx.mean_batch_size or 1.0)))
        check = check_memory(ctx.running.footprint(), ctx.current.k or 0, seqs, memory)
        if not check.fits:
            self._event_once(ctx, current, "budget_exceeded", "warning", f"{ctx.current.describe()}: {check.message}")

    # -- verify ------------------------------------------------------------------------------------
    def _due(self, now: datetime) -> list[StoredDecision]:
        """This server's applied changes whose evaluation window passed; a canary's after its warm-up (it
        is judged on every tick until decided)."""
        keys = self.engine_keys()
        window = timedelta(seconds=self.settings.controller.verify_window_s)
        warmup = timedelta(seconds=self.settings.canary.warmup_s)
        return [
            d
            for d in self.store.decisions(status=DecisionStatus.APPLIED)
            if d.decision.action in VERIFIED_ACTIONS
            and _mine(d, keys)
            and now >= d.updated_at + (warmup if plan_of(d) is not None else window)
        ]

    def _verify_one(self, d: StoredDecision, now: datetime) -> TickResult:
        keys = self.engine_keys()
        if d.decision.action == manual.PROMOTE:
            message = f"Promoted after canary decision {d.decision.inputs.get('canary_decision')} passed; kept."
            self.store.update_decision(d.id, status=DecisionStatus.VERIFIED, at=now, status_message=message)
            return TickResult("verified", "promoted", message, d.id)
        plan = plan_of(d)
        if plan is not None:
            judged = self._verify_canary(d, plan, keys, now)
            if judged is not None:
                return judged
        applied_at = d.updated_at
        after = windows_under(self.store, keys, applied_at, applied_at, now + timedelta(microseconds=1))
        inputs = DecisionInputs.from_json(d.decision.inputs)
        shift, shift_note = prompt_shift(
            inputs.current_config,
            inputs.drafts,
            float(inputs.accepted_per_pos[0]) if inputs.accepted_per_pos else None,
            d.decision.proposed,
            [w.spec for w in after if w.spec is not None],
        )
        verdict = judge_at_matched_load(
            inputs.window_rates,
            inputs.window_batches,
            [r / shift for r in summarize(after)[3]],
            window_batches(after),
            tolerance=self.settings.controller.regression_tolerance,
        )
        message = f"{verdict.message} {shift_note}" if shift_note else verdict.message
        if verdict.rollback and d.decision.action == CHANGE and inputs.current_config is not None:
            return roll_back(
                self.store, self.actuator, self.clock, d.id, inputs.current_config, message, verdict.realized_gain,
                now, keys,
            )  # fmt: skip
        self.store.update_decision(
            d.id, status=DecisionStatus.VERIFIED, at=now, realized_gain=verdict.realized_gain, status_message=message
        )
        return TickResult("verified", verdict.reason.value, message, d.id)

    def _verify_canary(
        self, d: StoredDecision, plan: CanaryPlan, keys: Sequence[EngineKey], now: datetime
    ) -> TickResult | None:
        """Promote, roll back or wait; None when no untouched replica is left (then before/after)."""
        judgement = judge_canary_here(self.store, d, plan, keys, now, self.settings.canary)
        if judgement is None:
            log.warning("controller %s: canary %d has no untouched replica left; verified before/after", keys, d.id)
            return None
        message = judgement.message()
        decision = judgement.verdict.decision
        if decision is CanaryDecision.UNDECIDED:
            log.info("controller %s: canary decision %d: %s", self.settings.metrics_url, d.id, message)
            return TickResult("hold", "canary_undecided", message, d.id)
        target = d.decision.proposed
        if decision is CanaryDecision.ROLLBACK or target is None:
            write_event(
                self.store, now, keys, "canary_rolled_back", "warning", message, d.id, extra=judgement.to_json()
            )
            return roll_back(
                self.store, self.actuator, self.clock, d.id, plan.previous, message, judgement.goodput_ratio, now, keys
            )
        orders = promote(self.store, d, judgement, target, now)
        message += f" Promotion orders {', '.join(map(str, orders))} written for the untouched replica(s)."
        self.store.update_decision(
            d.id, status=DecisionStatus.VERIFIED, at=now, realized_gain=judgement.goodput_ratio, status_message=message
        )
        write_event(self.store, now, keys, "canary_promoted", "info", message, d.id, extra=judgement.to_json())
        return TickResult("verified", "canary_promoted", message, d.id)


def _mine(d: StoredDecision, keys: Sequence[EngineKey]) -> bool:
    """A decision of this server (or one naming no engine: an override in a one-server store)."""
    return d.decision.engine is None or d.decision.engine in keys


__all__ = ["REJECTED", "SUPERSEDED", "Controller", "ControllerSettings", "TickResult"]
