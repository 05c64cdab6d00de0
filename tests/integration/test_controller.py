"""The controller (tuner/controller/controller.py) on a real store (SQLite and PostgreSQL) with a fake
actuator at our seam and the shared fake clock: decide → guardrails → apply → audit → events; verify →
rollback; pause, override, recovery."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from collectors.records import EngineKey, EventRecord, LatencySummary, StepRecord, WindowRecord
from policies.counters import SpecCounters
from policies.spec_config import SpecConfig
from policies.step_cost import StepCostModel
from tests.fakes import FakeClock, declining_counters
from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, config_fingerprint
from tuner.actuators.base import VllmSpec as VllmConfig
from tuner.config import ControllerSection, GuardrailsSection, Mode, PolicySection, StepCostSection
from tuner.controller import manual
from tuner.controller.apply import apply_config
from tuner.controller.audit import CHANGE
from tuner.controller.context import measure
from tuner.controller.controller import REJECTED, SUPERSEDED, Controller
from tuner.controller.evidence import LoadProfile
from tuner.controller.policy import propose_k
from tuner.controller.settings import ControllerSettings, PolicySettings
from tuner.controller.step_cost import config_specs, step_cost_from_steps
from tuner.store import AppliedBy, DecisionRecord, DecisionStatus, EngineConfigRecord, Store

URL = "http://127.0.0.1:8000/metrics"
KEY = EngineKey(URL, "fake-target", "0")
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
K2 = {"method": "draft_model", "model": "/drafts/good", "num_speculative_tokens": 2}
K8 = {**K2, "num_speculative_tokens": 8}


def config_record(spec: VllmConfig, at: datetime, by: str, decision_id: int | None = None) -> EngineConfigRecord:
    return EngineConfigRecord.of(SpecConfig.from_vllm(spec), at, by, decision_id)


class FakeActuator(Actuator):
    """Our seam: records what it was asked; ``outcome`` decides what the 'engine' did."""

    kind = "restart"

    def __init__(self, current: VllmConfig, clock: FakeClock, outcome: ApplyStatus = ApplyStatus.APPLIED) -> None:
        super().__init__()
        self.current = dict(current)
        self.clock = clock
        self.outcome = outcome
        self.applied: list[VllmConfig] = []

    def apply(self, config: VllmConfig) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged:
            return unchanged
        self.applied.append(dict(config))
        self.clock.advance(30)  # a restart takes time; the controller must stamp the config after it
        if self.outcome is ApplyStatus.APPLIED:
            self.current = dict(config)
            return ApplyResult(ApplyStatus.APPLIED, "restarted", self.current, 30.0)
        if self.outcome is ApplyStatus.ROLLED_BACK:
            return ApplyResult(
                ApplyStatus.ROLLED_BACK,
                "did not come up; old config back",
                self.current,
                45.0,
                detail="error: draft model path does not exist",
            )
        return ApplyResult(ApplyStatus.FAILED, "engine down", None)


def iid(alpha: float, k: int, drafts: int) -> SpecCounters:
    per_pos = tuple(int(drafts * alpha ** (i + 1)) for i in range(k))
    return SpecCounters(drafts, drafts * k, sum(per_pos), per_pos)


def write_windows(store: Store, start: datetime, n: int, *, k: int, rate: float, alpha: float = 0.8) -> datetime:
    """n windows of 10 s from ``start`` at ``rate`` generated tokens/s (±1% so the noise is not zero)."""
    recs = [
        WindowRecord(
            key=KEY,
            start=start + timedelta(seconds=10 * i),
            end=start + timedelta(seconds=10 * (i + 1)),
            spec=iid(alpha, k, 200) if k else None,
            generation_tokens=10 * rate * (1.0 + 0.01 * ((i % 3) - 1)),
            requests_running=1.0,
        )
        for i in range(n)
    ]
    store.write_windows(recs)
    return start + timedelta(seconds=10 * n)


SETTINGS = ControllerSettings(
    metrics_url=URL,
    controller=ControllerSection(mode=Mode.AUTO, verify_window_s=120, regression_tolerance=0.05),
    guardrails=GuardrailsSection(
        min_drafts=1000,
        min_evidence_s=60,
        hysteresis_ticks=2,
        cooldown_s=600,
        max_changes_per_hour=4,
        restart_downtime_s=60,
        payback_horizon_s=3600,
    ),
    policy=PolicySettings(PolicySection(k_max=8, cost_ratio=0.05, evidence_window_s=300)),
)


@pytest.fixture
def world(db_url: str) -> Iterator[tuple[Store, FakeClock, FakeActuator]]:
    store = Store(db_url)
    clock = FakeClock(T0)
    store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
    clock.now = write_windows(store, T0, 30, k=2, rate=100.0)  # 300 s of K = 2 at α = 0.8
    try:
        yield store, clock, FakeActuator(K2, clock)
    finally:
        store.close()


def controller(
    store: Store, act: Actuator, clock: FakeClock, *, mode: Mode | None = None, **changes: Any
) -> Controller:
    """A controller on SETTINGS with some sections replaced (``mode``: the [controller] mode)."""
    if mode is not None:
        changes["controller"] = SETTINGS.controller.model_copy(update={"mode": mode})
    settings = replace(SETTINGS, **changes)
    return Controller(store, act, settings, clock)


def policy_with(**fields: Any) -> PolicySettings:
    """SETTINGS' policy with some [policy] keys changed."""
    return replace(SETTINGS.policy, policy=SETTINGS.policy.policy.model_copy(update=fields))


def rails_state(ctl: Controller, now: datetime) -> Any:
    """The rails' state as the controller's own tick reads it (failed configs read once, passed in)."""
    return ctl.state(now, [KEY], ctl.failed_configs(now))


def test_no_engine_yet(db_url: str) -> None:
    with Store(db_url) as store:
        clock = FakeClock(T0)
        result = controller(store, FakeActuator(K2, clock), clock).decide(T0)
        assert (result.action, result.reason) == ("none", "no_engine")


def test_auto_applies_after_the_streak_and_audits_everything(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    ctl = controller(store, act, clock)
    first = ctl.decide(clock.now)
    assert (first.action, first.reason) == ("blocked", "not_persistent")
    assert act.applied == []
    decided_at = clock.advance(60)
    second = ctl.decide(decided_at)
    assert second.action == "applied", second.message
    assert act.applied == [K8]
    d = store.decision(second.decision_id or -1)
    assert d.status == DecisionStatus.APPLIED and d.decision.action == CHANGE
    assert (
        d.decision.proposed_config == K8 and d.decision.predicted_gain is not None and d.decision.predicted_gain > 1.2
    )
    # the evidence window is the last 300 s: windows ending in (T0 + 60 s, T0 + 300 s], 25 of the 30
    assert d.decision.inputs["drafts"] == 25 * 200 and d.decision.inputs["current_config"] == K2
    assert "K 2 → 8" in d.decision.message
    current = store.current_config(KEY)
    assert current is not None and current.config.num_spec_tokens == 8
    assert current.config.applied_by == AppliedBy.RESTART and current.config.decision_id == d.id
    assert current.config.started_at == decided_at + timedelta(seconds=30)  # stamped when the apply finished
    [event] = store.events(kind="config_applied")
    assert event.data["decision_id"] == d.id and event.data["downtime_s"] == 30.0
    # while the change is being verified the rails hold any further change
    assert rails_state(ctl, clock.advance(60)).pending_verification
    assert ctl.decide(clock.now).action == "hold"  # and there is no evidence under K = 8 yet anyway


def test_advisory_records_once_and_never_acts(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    ctl = controller(store, act, clock, mode=Mode.ADVISORY)
    results = [ctl.decide(clock.advance(60)) for _ in range(4)]
    assert [r.action for r in results] == ["blocked", "advisory", "advisory", "advisory"]
    assert act.applied == []
    rows = store.decisions()
    assert [r.status for r in rows] == [DecisionStatus.BLOCKED, DecisionStatus.ADVISORY]  # not one per tick
    assert rows[1].decision.proposed_config == K8 and "advisory mode" in rows[1].decision.message


def test_insufficient_evidence_blocks(db_url: str) -> None:
    with Store(db_url) as store:
        clock = FakeClock(T0)
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        clock.now = write_windows(store, T0, 3, k=2, rate=100.0)  # 600 drafts, 30 s
        ctl = controller(store, FakeActuator(K2, clock), clock)
        assert ctl.decide(clock.now).reason == "insufficient_evidence"


def test_stationary_best_config_makes_no_change(db_url: str) -> None:
    with Store(db_url) as store:
        clock = FakeClock(T0)
        store.record_config(KEY, config_record(K8, T0, AppliedBy.STARTUP))
        clock.now = write_windows(store, T0, 30, k=8, rate=200.0)
        act = FakeActuator(K8, clock)
        ctl = controller(store, act, clock)
        for _ in range(5):
            assert ctl.decide(clock.advance(60)).action == "hold"
        assert act.applied == [] and store.decisions() == []


def test_start_failure_is_rolled_back_recorded_and_not_retried(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    act.outcome = ApplyStatus.ROLLED_BACK
    ctl = controller(
        store, act, clock, guardrails=GuardrailsSection(min_drafts=1000, hysteresis_ticks=1, cooldown_s=60)
    )
    result = ctl.decide(clock.now)
    assert (result.action, result.reason) == ("rolled_back", "start_failed")
    d = store.decision(result.decision_id or -1)
    assert d.status == DecisionStatus.ROLLED_BACK
    current = store.current_config(KEY)
    assert current is not None and current.config.applied_by == AppliedBy.ROLLBACK
    assert current.config.num_spec_tokens == 2
    [event] = store.events(kind="apply_rolled_back")
    assert event.severity == "warning" and "does not exist" in event.data["detail"]
    # evidence under the restored config accumulates; the same config is not tried again — the
    # policy falls back to the best K that has not failed (bounded by cooldown and changes per hour)
    clock.now = write_windows(store, clock.now, 30, k=2, rate=100.0)
    ctl.decide(clock.advance(1))
    assert len(act.applied) == 2 and act.applied[1] != act.applied[0]
    assert [a["num_speculative_tokens"] for a in act.applied].count(act.applied[0]["num_speculative_tokens"]) == 1


def test_engine_down_is_a_critical_event(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    act.outcome = ApplyStatus.FAILED
    ctl = controller(store, act, clock, guardrails=GuardrailsSection(min_drafts=1000, hysteresis_ticks=1))
    assert ctl.decide(clock.now).action == "failed"
    [event] = store.events(kind="apply_failed")
    assert event.severity == "critical"


def apply_k8(store: Store, clock: FakeClock, act: FakeActuator) -> tuple[Controller, int]:
    ctl = controller(store, act, clock, guardrails=GuardrailsSection(min_drafts=1000, hysteresis_ticks=1))
    result = ctl.decide(clock.now)
    assert result.action == "applied" and result.decision_id is not None
    return ctl, result.decision_id


def test_regression_is_rolled_back_after_the_evaluation_window(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    ctl, decision_id = apply_k8(store, clock, act)
    applied_at = clock.now
    assert ctl.verify(clock.advance(60)) == []  # evaluation window (120 s) not over
    clock.now = write_windows(store, applied_at, 12, k=8, rate=70.0)  # 30% worse than before
    [result] = ctl.verify(clock.now)
    assert (result.action, result.reason) == ("rolled_back", "regressed")
    assert act.applied == [K8, K2]
    d = store.decision(decision_id)
    assert d.status == DecisionStatus.ROLLED_BACK and d.realized_gain == pytest.approx(0.7, abs=0.01)
    current = store.current_config(KEY)
    assert current is not None and current.config.num_spec_tokens == 2
    assert current.config.applied_by == AppliedBy.ROLLBACK
    assert [e.kind for e in store.events(kind="regression_rolled_back")] == ["regression_rolled_back"]


def test_improvement_is_verified_with_the_realized_gain(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    ctl, decision_id = apply_k8(store, clock, act)
    clock.now = write_windows(store, clock.now, 12, k=8, rate=140.0)
    [result] = ctl.verify(clock.now)
    assert (result.action, result.reason) == ("verified", "improved")
    d = store.decision(decision_id)
    assert d.status == DecisionStatus.VERIFIED and d.realized_gain == pytest.approx(1.4, abs=0.01)
    assert act.applied == [K8]
    # verified: no longer pending; the change still counts for the cooldown and the hourly limit
    state = rails_state(ctl, clock.now)
    assert not state.pending_verification and len(state.change_times) == 1
    assert ctl.decide(clock.now).reason == "keep"  # K = 8 is the best for α = 0.8, c = 0.05


def test_pause_resume_and_manual_override(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    ctl = controller(
        store, act, clock, mode=Mode.ADVISORY, guardrails=GuardrailsSection(min_drafts=1000, hysteresis_ticks=1)
    )
    manual.pause(store, clock.now, by="alice")
    assert ctl.decide(clock.now).reason == "paused"
    manual.request_override(store, clock.now, {"method": "ngram", "num_speculative_tokens": 3}, engine=KEY)
    assert ctl.decide(clock.advance(1)).reason == "override_waiting"
    manual.resume(store, clock.advance(1), by="alice")
    assert manual.active_pauses(store) == []
    result = ctl.decide(clock.advance(1))  # advisory mode, but an operator's override is applied
    assert result.action == "applied"
    assert act.applied == [{"method": "ngram", "num_speculative_tokens": 3}]
    current = store.current_config(KEY)
    assert current is not None and current.config.applied_by == AppliedBy.MANUAL and current.config.method == "ngram"
    assert manual.pending_overrides(store) == []


def test_only_the_newest_pending_override_is_applied_the_older_superseded(db_url: str) -> None:
    """Overrides queued before any engine was seen are applied at most once, the newest; the older ones
    are closed as superseded (never applied after it). Another server's override is left alone."""
    with Store(db_url) as store:
        clock = FakeClock(T0 - timedelta(seconds=60))
        act = FakeActuator(K2, clock)
        ctl = controller(store, act, clock, mode=Mode.ADVISORY)
        ngram3 = {"method": "ngram", "num_speculative_tokens": 3}
        ngram5 = {"method": "ngram", "num_speculative_tokens": 5}
        older = manual.request_override(store, clock.now, ngram3)
        newest = manual.request_override(store, clock.advance(10), ngram5, engine=KEY)
        other_server = EngineKey("http://10.0.0.9:8000/metrics", "fake-target", "0")
        elsewhere = manual.request_override(store, clock.advance(10), ngram3, engine=other_server)
        waiting = ctl.decide(clock.advance(10))  # no engine scraped, no config known: every override waits
        assert waiting.action == "none" and waiting.reason in ("no_engine", "no_config") and act.applied == []
        assert [o.id for o in manual.pending_overrides(store)] == [older, newest, elsewhere]
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        clock.now = write_windows(store, T0, 3, k=2, rate=100.0)
        result = ctl.decide(clock.now)
        assert result.action == "applied", result.message
        assert act.applied == [ngram5]
        superseded = store.decision(older)
        assert superseded.status == SUPERSEDED == "superseded"
        assert f"superseded by override {newest}" in (superseded.status_message or "")
        assert store.decision(newest).status == DecisionStatus.APPLIED
        current = store.current_config(KEY)
        assert current is not None and current.config.applied_by == AppliedBy.MANUAL
        assert current.config.spec == SpecConfig.from_vllm(ngram5)
        assert [o.id for o in manual.pending_overrides(store)] == [elsewhere]  # not this server's
        for _ in range(3):  # the older override is never applied after the newest
            ctl.decide(clock.advance(60))
        assert act.applied == [ngram5]
        assert store.decision(older).status == SUPERSEDED


def test_an_override_the_daemons_config_refuses_is_rejected_and_audited(db_url: str) -> None:
    """Overrides are re-validated before they are applied (a row may come from an older CLI, another
    config or a hand edit): K above the daemon's K_max, an unknown vLLM key, a draft that is no candidate
    are each rejected with the reason in the row and an event, and nothing reaches the actuator. The
    running draft at another K is a valid override and is applied."""
    with Store(db_url) as store:
        clock = FakeClock(T0)
        act = FakeActuator(K2, clock)
        ctl = controller(store, act, clock, mode=Mode.ADVISORY)
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        clock.now = write_windows(store, T0, 3, k=2, rate=100.0)
        refused = {
            "K above K_max": ({**K2, "num_speculative_tokens": 1000}, "above"),
            "unknown key": ({**K2, "evil": 1}, "unknown key"),
            "not a candidate": ({**K2, "model": "/drafts/elsewhere"}, "not a candidate"),
        }
        for config, why in refused.values():
            order = manual.request_override(store, clock.now, config, engine=KEY)
            result = ctl.decide(clock.advance(60))
            assert result.action != "applied" and act.applied == []
            row = store.decision(order)
            assert row.status == REJECTED == "rejected" and why in (row.status_message or ""), row.status_message
            events = store.events(T0, clock.now + timedelta(seconds=1), kind="override_rejected")
            assert any(e.data.get("decision_id") == order for e in events)
        valid = {**K2, "num_speculative_tokens": 4}
        order = manual.request_override(store, clock.now, valid, engine=KEY)
        assert ctl.decide(clock.advance(60)).action == "applied"
        assert act.applied == [valid] and store.decision(order).status == DecisionStatus.APPLIED


def test_restart_safe_state_and_recovery(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    _, decision_id = apply_k8(store, clock, act)
    clock.now = write_windows(store, clock.now, 12, k=8, rate=140.0)
    # a new controller (a restarted daemon) sees the pending verification and the change time
    fresh = controller(store, FakeActuator(K8, clock), clock)
    state = rails_state(fresh, clock.now)
    assert state.pending_verification and len(state.change_times) == 1
    assert fresh.config_to_start(SpecConfig.from_vllm(K2)) == (SpecConfig.from_vllm(K8), "database")
    # an apply interrupted by kill -9 is closed on start
    stuck = store.record_decision(
        DecisionRecord(
            created_at=clock.now,
            action=CHANGE,
            reason="change_k",
            message="m",
            inputs={},
            mode="auto",
            engine=KEY,
            proposed_config=K2,
            status=DecisionStatus.APPLYING,
        )
    )
    assert rails_state(fresh, clock.now).pending_verification
    assert fresh.recover(clock.now) == [stuck]
    assert store.decision(stuck).status == DecisionStatus.FAILED
    assert [e.kind for e in store.events(kind="apply_interrupted")] == ["apply_interrupted"]
    assert store.decision(decision_id).status == DecisionStatus.APPLIED  # untouched


def test_sync_records_the_running_config_once(db_url: str) -> None:
    with Store(db_url) as store:
        clock = FakeClock(T0)
        write_windows(store, T0, 1, k=2, rate=100.0)  # the collector has seen the engine, no config yet
        act = FakeActuator(K2, clock)
        ctl = controller(store, act, clock)
        ctl.sync_configs(T0, AppliedBy.STARTUP)
        ctl.sync_configs(T0 + timedelta(seconds=10), AppliedBy.OBSERVED)
        [cfg] = store.configs(KEY)
        assert cfg.config.applied_by == AppliedBy.STARTUP
        assert config_fingerprint(cfg.config.spec_config) == config_fingerprint(K2)


def test_switching_cost_uses_the_measured_restart_downtime(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    rails = GuardrailsSection(min_drafts=1000, hysteresis_ticks=1, restart_downtime_s=1.0, payback_horizon_s=3600)
    ctl = controller(store, act, clock, guardrails=rails)
    # no restart yet: the configured 1 s applies
    assert ctl.switching_cost_s(SpecConfig.from_vllm(K8), clock.now) is None
    # an earlier restart of this engine took 50 minutes (a huge model loading from slow storage)
    store.write_events(
        [
            EventRecord(
                ts=clock.now - timedelta(hours=1),
                kind="config_applied",
                message="m",
                engine=KEY,
                data={"downtime_s": 3000.0},
            )
        ]
    )
    assert ctl.switching_cost_s(SpecConfig.from_vllm(K8), clock.now) == 3000.0
    result = ctl.decide(clock.now)  # K 2 → 8 gains ~1.39×: 3000 s take ~7700 s to repay
    assert (result.action, result.reason) == ("blocked", "switching_cost")
    assert "3000 s" in result.message and act.applied == []


class ProgressActuator(FakeActuator):
    """Reports the restart actuator's milestone, then 'dies' (raises) as a SIGKILL would stop it."""

    def apply(self, config: VllmConfig) -> ApplyResult:
        self.progress("start_failed: the draft did not load; restoring the last good config")
        raise KeyboardInterrupt  # the daemon is killed while restoring


def test_kill_during_the_restore_of_a_failed_start_is_recovered_as_a_rollback(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    store, clock, _ = world
    rails = SETTINGS.guardrails.model_copy(update={"min_drafts": 0})
    dying = controller(store, ProgressActuator(K2, clock), clock, guardrails=rails)
    decision_id = store.record_decision(
        DecisionRecord(
            created_at=clock.now, action=CHANGE, reason="swap_draft", message="m", inputs={}, mode="auto",
            engine=KEY, proposed_config=K8, status=DecisionStatus.APPLYING,
        )
    )
    with pytest.raises(KeyboardInterrupt):
        apply_config(store, dying.actuator, clock, decision_id, SpecConfig.from_vllm(K8), clock.now, [KEY], "restart")
    assert (store.decision(decision_id).status_message or "").startswith("start_failed")
    fresh = controller(store, FakeActuator(K2, clock), clock)
    assert fresh.recover(clock.now) == [decision_id]
    d = store.decision(decision_id)
    assert d.status == DecisionStatus.ROLLED_BACK and "restarted the last recorded config" in (d.status_message or "")
    assert [e.kind for e in store.events(kind="apply_rolled_back")] == ["apply_rolled_back"]
    # the config that failed to start is not proposed again
    assert fresh.failed_configs(clock.now) == [SpecConfig.from_vllm(K8)]
    assert config_fingerprint(K8) in rails_state(fresh, clock.now).failed_targets


def test_a_weak_draft_is_swapped_with_a_draft_swapped_event(db_url: str) -> None:
    from policies.draft_choice import DraftCandidate, DraftTriggerConfig

    store = Store(db_url)
    try:
        clock = FakeClock(T0)
        weak = {"method": "draft_model", "model": "/models/weak", "num_speculative_tokens": 3}
        store.record_config(KEY, config_record(weak, T0, AppliedBy.STARTUP))
        clock.now = write_windows(store, T0, 30, k=3, rate=60.0, alpha=0.25)
        act = FakeActuator(weak, clock)
        good = DraftCandidate("good", "draft_model", "/models/good", prior_alpha=0.9, cost_ratio=0.05)
        policy = replace(SETTINGS.policy, swap=DraftTriggerConfig(duration_s=200, min_drafts=500, segments=2))
        ctl = Controller(store, act, replace(SETTINGS, policy=policy), clock, candidates=lambda: [good])
        first = ctl.decide(clock.now)
        assert first.action == "blocked" and first.reason == "not_persistent"  # hysteresis: one tick is not enough
        assert [e.kind for e in store.events(kind="acceptance_low")] == ["acceptance_low"]
        result = ctl.decide(clock.now + timedelta(seconds=10))
        assert result.action == "applied", result.message
        assert act.applied[-1]["model"] == "/models/good"
        d = store.decision(result.decision_id or 0)
        assert d.decision.reason == "swap_draft" and (d.decision.predicted_gain or 0) > 1.5
        assert d.decision.inputs["policy"]["trigger"]["upper"] < 0.4
        assert [e.kind for e in store.events(kind="draft_swapped")] == ["draft_swapped"]
        assert len(store.events(kind="acceptance_low")) == 1  # once per config period, not every tick
    finally:
        store.close()


def pinned_section(model: StepCostModel) -> StepCostSection:
    """[policy.step_cost] holding this model."""
    return StepCostSection(
        fixed_s=model.fixed_s,
        per_token_s=model.per_token_s,
        draft_fixed_s=model.draft_fixed_s,
        draft_per_seq_s=model.draft_per_seq_s,
    )


def write_steps(store: Store, start: datetime, *, k: int, step_s: Any, config_id: int) -> None:
    """Per-step records as the in-engine plugin ships them: 40 decode steps at each of B = 1, 2, 4, 8."""
    recs = [
        StepRecord(
            ts=start + timedelta(milliseconds=50 * i + 1000 * j),
            key=KEY,
            batch_size=b,
            step_time_s=step_s(b) * (1.0 + 0.02 * ((i % 3) - 1)),
            spec=iid(0.8, k, b) if k else SpecCounters(),
            num_scheduled_tokens=b * (k + 1),
            config_id=config_id,
        )
        for j, b in enumerate((1, 2, 4, 8))
        for i in range(40)
    ]
    # a prefill step (more tokens scheduled than B·(K+1)) is far slower and must not count
    recs.append(replace(recs[0], step_time_s=5.0, num_scheduled_tokens=4000))
    store.write_steps(recs)


def test_the_step_cost_fitted_from_plugin_steps_drives_the_decision(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    store, clock, act = world
    current = store.current_config(KEY)
    assert current is not None
    # Compute-bound target: scoring K + 1 tokens costs K + 1 times one; Leviathan's model (the config's
    # c = 0.05, verifying is free) would raise K to 8, the measured steps say speculation does not pay.
    truth = StepCostModel.from_cost_ratio(0.05, target_step_s=0.001, per_token_s=0.01)
    write_steps(store, T0, k=2, step_s=lambda b: truth.step_time_s(b, 2), config_id=current.id)
    ctl = controller(store, act, clock)
    ctl.decide(clock.advance(60))
    ctl.decide(clock.advance(60))
    rows = store.decisions()
    assert rows, "the controller recorded no decision"
    inputs = rows[-1].decision.inputs
    assert inputs["step_cost"]["source"] == "fitted" and "fitted from 160 steps" in inputs["step_cost"]["message"]
    fitted = StepCostModel.from_dict(inputs["step_cost"]["model"])
    assert fitted.per_token_s == pytest.approx(0.01, rel=0.05)
    assert rows[-1].decision.proposed_config == {"method": "off", "num_speculative_tokens": 0}
    assert K8 not in act.applied


def test_after_a_swap_the_steps_under_the_old_draft_measure_the_target(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    """16 requests all day: the 8B ran K = 2 and 5, then ngram K = 6. ngram's own steps (one K, one batch
    size) cannot tell the target's per-token cost from its fixed cost; with the 8B's steps (its cost ratio
    known) they can, so ngram's K is not chosen on a model where verifying 7 tokens per sequence is free."""
    store, _, _ = world
    old = store.current_config(KEY)
    assert old is not None
    eight_b = StepCostModel.from_cost_ratio(0.08, target_step_s=0.025, per_token_s=0.0001)
    ngram = StepCostModel.from_cost_ratio(0.008, target_step_s=0.025, per_token_s=0.0001)
    ngram_spec = SpecConfig("ngram", None, 6)
    store.record_config(KEY, EngineConfigRecord.of(ngram_spec, T0 + timedelta(seconds=600), AppliedBy.RESTART))
    new = store.current_config(KEY)
    assert new is not None and new.id != old.id

    def steps(at: datetime, k: int, model: StepCostModel, config_id: int) -> list[StepRecord]:
        return [
            StepRecord(
                ts=at + timedelta(seconds=i),
                key=KEY,
                batch_size=16,
                step_time_s=model.step_time_s(16, k),
                spec=iid(0.8, k, 16),
                num_scheduled_tokens=16 * (k + 1),
                config_id=config_id,
            )
            for i in range(40)
        ]

    store.write_steps(steps(T0, 2, eight_b, old.id) + steps(T0 + timedelta(seconds=100), 5, eight_b, old.id))
    store.write_steps(steps(T0 + timedelta(seconds=700), 6, ngram, new.id))
    now = T0 + timedelta(seconds=800)
    specs = config_specs(store, [KEY], now, 86400)
    section = SETTINGS.policy.policy

    def ratio(spec: SpecConfig) -> float | None:
        return 0.08 if spec.model == "/drafts/good" else None

    fitted = step_cost_from_steps(store, [KEY], ngram_spec, specs, now, section, 0.008, cost_ratio_of=ratio)
    assert fitted is not None
    model, note, source = fitted
    assert "steps under other drafts too" in note and source.startswith("fitted")
    assert model.step_time_s(16, 8) == pytest.approx(ngram.step_time_s(16, 8), rel=1e-3)
    assert model.per_token_s == pytest.approx(0.0001, rel=1e-3)
    alone = step_cost_from_steps(store, [KEY], ngram_spec, specs, now, section, 0.008)
    assert alone is not None and "flat in B" in alone[1]  # ngram's own steps: verification looks free


def test_a_pinned_step_cost_is_not_refitted(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    store, clock, act = world
    current = store.current_config(KEY)
    assert current is not None
    truth = StepCostModel.from_cost_ratio(0.05, target_step_s=0.001, per_token_s=0.01)
    write_steps(store, T0, k=2, step_s=lambda b: truth.step_time_s(b, 2), config_id=current.id)
    pinned = policy_with(step_cost=pinned_section(StepCostModel.from_cost_ratio(0.05)))
    ctl = controller(store, act, clock, policy=pinned)
    assert ctl.decide(clock.advance(60)).action == "blocked"
    assert ctl.decide(clock.advance(60)).action == "applied"
    assert act.applied == [K8]
    step_cost = store.decisions()[-1].decision.inputs["step_cost"]
    assert step_cost["source"] == "pinned" and "pinned by [policy.step_cost]" in step_cost["message"]
    expected = StepCostModel.from_cost_ratio(0.05)
    assert StepCostModel.from_dict(step_cost["model"]).parameters.tolist() == expected.parameters.tolist()
    assert pinned.pinned_step_cost == StepCostModel.from_cost_ratio(0.05)


def test_cells_this_engine_measured_overrule_a_pinned_model(world: tuple[Store, FakeClock, FakeActuator]) -> None:
    """The pinned model (verifying is free) says K = 8; this engine's own steps at K = 0, 2 and 8 say every
    drafted token costs a full target pass: the controller believes its steps and turns speculation off."""
    store, clock, act = world
    current = store.current_config(KEY)
    assert current is not None
    # a draft_model engine: its K = 0 steps run the draft's catch-up pass
    truth = replace(StepCostModel.from_cost_ratio(0.05, target_step_s=0.001, per_token_s=0.01), draft_pass_at_k0=True)
    for i, k in enumerate((0, 2, 8)):
        write_steps(store, T0 + timedelta(seconds=10 * i), k=k, step_s=lambda b, k=k: truth.step_time_s(b, k),
                    config_id=current.id)
    # write_steps gives each (B, K) 40 steps
    pinned = policy_with(step_cost=pinned_section(StepCostModel.from_cost_ratio(0.05)), step_cost_cell_min_steps=40)
    ctl = controller(store, act, clock, policy=pinned)
    ctl.decide(clock.advance(60))
    ctl.decide(clock.advance(60))
    decision = store.decisions()[-1].decision
    step_cost = decision.inputs["step_cost"]
    assert step_cost["source"] == "pinned + measured cells", step_cost
    cells = step_cost["model"]["measured_cells"]
    assert sorted({c["k"] for c in cells}) == [0, 2, 8] and len(cells) == 12  # B = 1, 2, 4, 8 × K = 0, 2, 8
    assert "measured on this engine (12 cells;" in step_cost["message"]
    assert step_cost["model"]["draft_pass_at_k0"] is True  # the running draft_model engine drafts at K = 0
    assert decision.proposed_config == {"method": "off", "num_speculative_tokens": 0}
    assert K8 not in act.applied


def test_an_engine_that_skips_the_draft_pass_at_k0_is_fitted_and_priced_as_such(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    """A draft_model engine whose plugin skips the draft's pass in K = 0 steps ([plugin]
    skip_draft_pass_at_k0): its K = 0 steps cost the target alone. Read with the skip, the fit recovers the
    draft's cost and the model prices a table's K = 0 as plain decoding; read as vLLM's own behaviour (a pass
    at K = 0), the same steps give a different model that charges K = 0 a pass it never ran."""
    store, _, _ = world
    current = store.current_config(KEY)
    assert current is not None
    truth = StepCostModel.from_cost_ratio(0.2, target_step_s=0.01, per_token_s=0.001)  # no pass at K = 0
    for i, k in enumerate((0, 2, 5)):
        write_steps(store, T0 + timedelta(seconds=10 * i), k=k, step_s=lambda b, k=k: truth.step_time_s(b, k),
                    config_id=current.id)
    now = T0 + timedelta(seconds=60)
    specs = config_specs(store, [KEY], now, 86400)
    section = SETTINGS.policy.policy.model_copy(update={"step_cost_cell_min_steps": 10**6})  # the fit alone, no cells
    skipping = replace(SETTINGS.policy, k0_draft_pass_skipped=True)
    assert not skipping.drafts_at_k0("draft_model") and SETTINGS.policy.drafts_at_k0("draft_model")
    assert not SETTINGS.policy.drafts_at_k0("ngram")
    fitted = step_cost_from_steps(
        store, [KEY], current.config.spec, specs, now, section, 0.2, drafts_at_k0=skipping.drafts_at_k0
    )
    assert fitted is not None
    model = fitted[0]
    assert model.draft_pass_at_k0 is False
    for b in (1, 4, 8):
        assert model.step_time_s(b, 0) == pytest.approx(truth.plain_step_time_s(b), rel=0.03)
        assert model.step_time_s(b, 5) == pytest.approx(truth.step_time_s(b, 5), rel=0.03)
    stock = step_cost_from_steps(store, [KEY], current.config.spec, specs, now, section, 0.2)
    assert stock is not None and stock[0].draft_pass_at_k0 is True
    assert stock[0].step_time_s(8, 0) > 1.05 * truth.step_time_s(8, 0)  # a pass the engine never ran


def test_under_the_skip_k0_steps_with_a_prompt_keep_the_pass_in_the_fit_and_the_price(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    """The plugin skips the draft's pass only in decode-only K = 0 steps: with requests of 4 output tokens
    on average most K = 0 steps at 8 sequences take a prompt and keep it (1 − e⁻²). Given the requests'
    mean length, the fit reads the K = 0 steps with that share and prices K = 0 so; the controller takes the
    length from the evidence windows (tokens over requests finished)."""
    store, _, _ = world
    current = store.current_config(KEY)
    assert current is not None
    truth = StepCostModel.from_cost_ratio(0.2, target_step_s=0.01, per_token_s=0.001).with_k0_skip(4.0)
    for i, k in enumerate((0, 2, 5)):
        write_steps(store, T0 + timedelta(seconds=10 * i), k=k, step_s=lambda b, k=k: truth.step_time_s(b, k),
                    config_id=current.id)
    now = T0 + timedelta(seconds=60)
    specs = config_specs(store, [KEY], now, 86400)
    section = SETTINGS.policy.policy.model_copy(update={"step_cost_cell_min_steps": 10**6})
    skipping = replace(SETTINGS.policy, k0_draft_pass_skipped=True)
    assert skipping.k0_skip_output_tokens(4.0) == 4.0 and skipping.k0_skip_output_tokens(None) == 0.0
    assert SETTINGS.policy.k0_skip_output_tokens(4.0) == 0.0  # no skip configured
    fitted = step_cost_from_steps(
        store, [KEY], current.config.spec, specs, now, section, 0.2,
        drafts_at_k0=skipping.drafts_at_k0, k0_skip_output_tokens=skipping.k0_skip_output_tokens(4.0),
    )
    assert fitted is not None
    model = fitted[0]
    assert model.k0_skip_output_tokens == 4.0 and not model.draft_pass_at_k0
    assert model.step_time_s(8, 0) == pytest.approx(truth.step_time_s(8, 0), rel=0.03)
    assert model.step_time_s(8, 0) > 1.1 * truth.plain_step_time_s(8)  # not plain decoding: prompts keep the pass
    priced = skipping.engine_step_cost(StepCostModel.from_cost_ratio(0.2, 0.01, 0.001), "draft_model", 4.0)
    assert priced.step_time_s(8, 0) == pytest.approx(truth.step_time_s(8, 0))
    lookup = skipping.engine_step_cost(priced, "ngram", 4.0)  # a lookup has no pass to keep
    assert lookup.step_time_s(8, 0) == pytest.approx(truth.plain_step_time_s(8))


def test_the_evidence_counts_finished_requests_for_their_mean_length(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    """Windows carry vLLM's e2e latency count (requests finished); the context's mean output tokens per
    request is the windows' tokens over it, None where the scraper saw no histogram."""
    store, _, _ = world
    stored = store.current_config(KEY)
    assert stored is not None
    end = write_windows(store, T0 + timedelta(hours=2), 6, k=2, rate=100.0)
    assert measure(store, [KEY], stored, end, 60.0).output_tokens_per_request is None
    later = [
        WindowRecord(
            key=KEY, start=end + timedelta(seconds=10 * i), end=end + timedelta(seconds=10 * (i + 1)),
            spec=iid(0.8, 2, 200), generation_tokens=1000.0, requests_running=8.0,
            e2e_latency=LatencySummary(count=20.0, sum_s=40.0),
        )
        for i in range(3)
    ]
    store.write_windows(later)
    ctx = measure(store, [KEY], stored, end + timedelta(seconds=30), 30.0)
    assert ctx.output_tokens_per_request == pytest.approx(50.0)  # 3000 tokens, 60 requests: the older window left out


def test_load_profile_is_topped_up_without_double_counting(db_url: str) -> None:
    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        end = write_windows(store, T0, 30, k=2, rate=100.0)  # 300 s at 1 running
        profile = LoadProfile()
        first = profile.update(store, [KEY], end, horizon_s=3600)
        assert len(first) == 30 and sum(d for d, _ in first) == pytest.approx(300.0)
        later = write_windows(store, end, 6, k=2, rate=100.0)
        second = profile.update(store, [KEY], later, horizon_s=3600)  # re-reads a minute of overlap
        assert len(second) == 36
        third = profile.update(store, [KEY], later + timedelta(seconds=3600 - 100), horizon_s=3600)
        assert len(third) == 11  # windows ending before the horizon are dropped (ends T0+260 s … T0+360 s stay)


def test_k_is_chosen_for_a_sustained_load_within_minutes_and_never_for_a_burst(db_url: str) -> None:
    """An hour at 4 requests, a 3-minute burst to 64, half an hour at 4, then the load steps to 64 and
    stays. The burst never narrows the load profile K is chosen over (the hour); the step does once it
    has lasted 5 minutes (``load_regime_sustained_s``), and the switching-cost horizon is then what the
    engine's history says of such rises (one 3-minute burst on record: Lindy, as long again as its age)."""
    from tuner.controller.context import ControllerMemory, DecisionContext, build_context

    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        stored = store.current_config(KEY)
        assert stored is not None
        memory = ControllerMemory()
        now = T0

        def minutes(n: int, running: float) -> list[tuple[float, ...]]:
            """n minutes at ``running`` requests, a decide tick after each; each tick's load profile."""
            nonlocal now, memory
            profiles = []
            for _ in range(n):
                store.write_windows(
                    [
                        WindowRecord(KEY, now + timedelta(seconds=10 * i), now + timedelta(seconds=10 * (i + 1)),
                                     iid(0.8, 2, 200), 1000.0, requests_running=running)
                        for i in range(6)
                    ]
                )  # fmt: skip
                now += timedelta(seconds=60)
                ctx, memory = build_context(store, [KEY], stored, now, SETTINGS, [], [], memory)
                profiles.append(tuple(b for _, b in ctx.load_profile))
                ticks.append(ctx)
            return profiles

        ticks: list[DecisionContext] = []
        minutes(60, 4.0)
        for profile in minutes(3, 64.0):  # the burst: the hour
            assert len(profile) >= 360 and min(profile) == 4.0
        after = minutes(30, 4.0)  # the fall back is a regime too: once sustained, its own load (as before the burst)
        assert all(len(p) >= 360 for p in after[:4]) and set(after[-1]) == {4.0} and len(after[-1]) < 360
        step = minutes(6, 64.0)
        assert all(min(p) == 4.0 for p in step[:5])  # 5 minutes in (4 of them observed): not sustained yet
        assert set(step[5]) == {64.0} and len(step[5]) == 30  # 6 minutes in: the load since the step
        ctx, _ = build_context(store, [KEY], stored, now, SETTINGS, [], [], memory)
        assert ctx.load_window is not None and ctx.load_window.regime
        assert ctx.regime_remaining_s == pytest.approx(300.0)  # the burst on record lasted 180 s: Lindy
        # the switching-cost rail names which regime bounded it and why (acceptance never moved here)
        assert ctx.regime_basis == (
            "the load rose 300 s ago; none of 1 earlier rises lasted that long: expected to last as long again"
        )
        assert ctx.load_before == pytest.approx(4.0)  # where it rose from: where dropping a draft is undone
        # one minute back at 4: the regime K was chosen for may be ending, so no restart is weighed on it
        minutes(1, 4.0)
        ctx = ticks[-1]
        assert ctx.regime_remaining_s == 0.0
        assert ctx.regime_basis is not None and ctx.regime_basis.endswith("the regime may be ending")


def test_a_shadow_replay_from_before_the_traffic_moved_weighs_no_more_than_the_prior(db_url: str) -> None:
    """A candidate replayed while the prompts were easy says little about them once the running draft's
    acceptance has fallen with the traffic: set against the running draft's α now at full weight, it
    would swap to a draft that was better on the old mix; dropped, an optimistic prior would stand alone.
    It is kept at the prior's weight (``prior_strength_trials``). Our own swap restarts the acceptance
    tracker (another draft is another α) but not the traffic: the cap holds across it. A replay after the
    move counts in full (the replay-error cap off here: ``shadow_error_sd`` = 0; the next test has it)."""
    from policies.acceptance import AcceptanceEvidence
    from policies.draft_choice import DraftCandidate, DraftTriggerConfig
    from tuner.controller.context import ControllerMemory, build_context
    from tuner.store.shadow import ShadowResult, write_shadow_result

    other = DraftCandidate("other", "draft_model", "/drafts/other")
    good = DraftCandidate("good", "draft_model", "/drafts/good")
    swap = DraftTriggerConfig(
        duration_s=200, min_drafts=500, segments=2, prior_strength_trials=150.0, shadow_error_sd=0.0
    )
    settings = replace(SETTINGS, policy=replace(SETTINGS.policy, swap=swap))
    full = AcceptanceEvidence(successes=2700.0, failures=300.0, drafts=1000.0)

    def replay(at: datetime) -> None:
        write_shadow_result(store, ShadowResult("other", "draft_model", "/drafts/other", at, 48, 3000, 3, full, 0.9,
                                                (0.89, 0.91), False, "ok"))  # fmt: skip

    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        memory = ControllerMemory()
        now = T0

        def minutes(n: int, alpha: float) -> AcceptanceEvidence | None:
            nonlocal now, memory
            seen = None
            for _ in range(n):
                now = write_windows(store, now, 6, k=2, rate=100.0, alpha=alpha)
                current = store.current_config(KEY)
                assert current is not None
                ctx, memory = build_context(store, [KEY], current, now, settings, [good, other], [], memory)
                seen = ctx.shadow.get("other")
            return seen

        minutes(10, 0.8)
        replay(now)
        assert minutes(5, 0.8) == full  # the same traffic: in full
        capped = minutes(5, 0.3)  # the running draft's acceptance fell with the traffic: the prior's weight
        assert capped is not None and capped.trials == pytest.approx(150.0)
        assert capped.successes / capped.trials == pytest.approx(0.9)  # what it measured, at less weight
        moved = memory.alpha_moved_at
        assert moved is not None and T0 + timedelta(minutes=15) <= moved <= T0 + timedelta(minutes=16)
        store.record_config(KEY, config_record({**K2, "model": "/drafts/third"}, now, AppliedBy.RESTART))
        after_swap = minutes(3, 0.5)  # our own swap began this regime: the cap holds
        assert after_swap is not None and after_swap.trials == pytest.approx(150.0)
        assert memory.alpha_moved_at == moved
        replay(now)
        assert minutes(1, 0.5) == full  # replayed after the move: in full


def test_a_replay_counts_no_more_trials_than_its_run_to_run_error_allows(db_url: str) -> None:
    """Thousands of replayed tokens make a tight binomial interval, but the sample of recorded requests moves
    each run off the traffic (live: ~0.013 in α, every draft of a run together). A candidate's newest replay
    counts at most α̂(1 − α̂)/σ² trials, σ the configured ``shadow_error_sd`` until consecutive replays within
    the acceptance regime measure it (``policies.replay_error``)."""
    from policies.acceptance import AcceptanceEvidence
    from policies.draft_choice import DraftCandidate, DraftTriggerConfig
    from policies.replay_error import PRIOR_PAIRS
    from tuner.controller.context import ControllerMemory, build_context
    from tuner.store.shadow import ShadowResult, write_shadow_result

    other = DraftCandidate("other", "draft_model", "/drafts/other")
    swap = DraftTriggerConfig(duration_s=200, min_drafts=500, segments=2, shadow_error_sd=0.02)
    settings = replace(SETTINGS, policy=replace(SETTINGS.policy, swap=swap))

    def replay(at: datetime, alpha: float) -> None:
        ev = AcceptanceEvidence(successes=3000.0 * alpha, failures=3000.0 * (1 - alpha), drafts=1000.0)
        write_shadow_result(store, ShadowResult("other", "draft_model", "/drafts/other", at, 48, 3000, 3, ev, alpha,
                                                (alpha - 0.01, alpha + 0.01), False, "ok"))  # fmt: skip

    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        now = write_windows(store, T0, 30, k=2, rate=100.0, alpha=0.8)
        current = store.current_config(KEY)
        assert current is not None

        weights: list[str | None] = []

        def seen() -> AcceptanceEvidence:
            ctx, _ = build_context(store, [KEY], current, now, settings, [other], [], ControllerMemory())
            weights.append(ctx.shadow_weight)  # what the decision's message and audit row say of it
            return ctx.shadow["other"]

        replay(now - timedelta(seconds=200), 0.90)
        first = seen()  # one run: the configured 0.02 → 0.9·0.1/0.02² = 225 trials
        assert first.trials == pytest.approx(225.0) and first.successes / first.trials == pytest.approx(0.9)
        assert weights[-1] == "replay error σ 0.020 (configured; no two replays of one regime yet)"
        replay(now - timedelta(seconds=100), 0.94)
        replay(now, 0.90)
        # two pairs 0.04 apart: σ² ≈ (0.04² − binomial) / 2 each, shrunk toward 0.02² by PRIOR_PAIRS
        binomial = 0.9 * 0.1 / 3000 + 0.94 * 0.06 / 3000
        measured = (0.04**2 - binomial) / 2
        sd2 = (2 * measured + PRIOR_PAIRS * 0.02**2) / (2 + PRIOR_PAIRS)
        assert seen().trials == pytest.approx(0.9 * 0.1 / sd2, rel=1e-6)
        assert weights[-1] == f"replay error σ {sd2 ** 0.5:.3f} (2 consecutive pair(s) read {measured ** 0.5:.3f})"


def test_a_lookup_candidate_is_ranked_at_the_share_of_steps_its_newest_replay_drafted_at(db_url: str) -> None:
    """A prompt lookup drafts only where it finds a match: its replay's totals say at what share of the steps
    (``policies.shadow_replay.proposal_share``), and the candidate the policy ranks carries that share — the
    running draft as the same object as its entry in the list, a draft model at share 1 — from the newest
    replay within the history horizon, whether speculation is on or off."""
    from policies.acceptance import AcceptanceEvidence
    from policies.draft_choice import DraftCandidate, DraftTriggerConfig
    from tuner.controller.context import ControllerMemory, build_context
    from tuner.store.shadow import ShadowResult, write_shadow_result

    lookup = DraftCandidate("lookup", "ngram", speculative_config={"prompt_lookup_min": 2, "prompt_lookup_max": 5})
    running = DraftCandidate("running", "draft_model", K2["model"])
    settings = replace(SETTINGS, policy=replace(SETTINGS.policy, swap=DraftTriggerConfig()))

    def replay(name: str, method: str, at: datetime, ev: AcceptanceEvidence, samples: int, tokens: int) -> None:
        write_shadow_result(store, ShadowResult(name, method, None, at, samples, tokens, 3, ev, 0.9, (0.85, 0.95),
                                                False, "ok"))  # fmt: skip

    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        now = write_windows(store, T0, 6, k=2, rate=100.0, alpha=0.8)
        current = store.current_config(KEY)
        assert current is not None
        # 10 samples of 201 tokens: 200 decode steps' worth each; the lookup drafted at 300 steps, accepting
        # 600 tokens (900 of the 2000 decode tokens), so the other 1100 came one a step: 300 / 1400
        replay("lookup", "ngram", now - timedelta(hours=2), AcceptanceEvidence(100.0, 100.0, 150.0), 10, 2010)
        replay("lookup", "ngram", now, AcceptanceEvidence(600.0, 60.0, 300.0), 10, 2010)
        # a draft model's replay: every step drafted (its tokens add up to more than the record: share 1)
        replay("running", "draft_model", now, AcceptanceEvidence(1500.0, 200.0, 520.0), 10, 2010)
        ctx, _ = build_context(store, [KEY], current, now, settings, [running, lookup], [], ControllerMemory())
        by_name = {c.name: c for c in ctx.candidates}
        assert by_name["lookup"].proposal_share == pytest.approx(300 / 1400)
        assert by_name["running"].proposal_share == 1.0
        assert ctx.running is by_name["running"]
        # speculation off: the drafts it could come back with carry their shares too
        store.record_config(KEY, config_record({"method": "off"}, now, AppliedBy.RESTART))
        off = store.current_config(KEY)
        assert off is not None
        ctx, _ = build_context(store, [KEY], off, now + timedelta(seconds=5), settings, [running, lookup], [],
                               ControllerMemory())  # fmt: skip
        assert {c.name: c.proposal_share for c in ctx.candidates}["lookup"] == pytest.approx(300 / 1400)


def test_evidence_starts_where_the_traffic_moved_the_acceptance_once_history_can_weigh_it(db_url: str) -> None:
    """Windows from before the acceptance moved with the traffic measured another prompt mix: pooled
    with the new ones they hold α̂ near the old level, and their mix inflates the over-dispersion that
    discounts the drafts, until they age out of the evidence window. Once three falls are on record (the
    switching-cost rail can weigh a restart on the new regime) the evidence of a confirmed fall starts
    where it began, and the message says so; before, the first dips are judged on the whole window (cut,
    they restarted the engine there and back); while α̂ holds still the whole window counts."""
    from tuner.controller.context import ControllerMemory, build_context

    policy = SETTINGS.policy.policy.model_copy(update={"evidence_window_s": 600})
    settings = replace(SETTINGS, policy=replace(SETTINGS.policy, policy=policy))
    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        memory = ControllerMemory()
        now = T0
        seen = []
        # a tick per minute: 8 steady, three 3-minute dips 8 minutes apart, then a fall that stays
        for alpha in [0.9] * 8 + ([0.5] * 3 + [0.9] * 8) * 3 + [0.5] * 4:
            now = write_windows(store, now, 6, k=2, rate=100.0, alpha=alpha)
            current = store.current_config(KEY)
            assert current is not None
            ctx, memory = build_context(store, [KEY], current, now, settings, [], [], memory)
            seen.append(ctx)
    steady = seen[7]
    assert steady.evidence_since is None and steady.duration_s == pytest.approx(480)
    assert steady.alpha.alpha is not None and steady.alpha.alpha == pytest.approx(0.9, abs=0.02)
    for ctx in seen[8:11]:  # the first dip, confirmed at its second tick: no falls on record, not cut
        assert ctx.evidence_since is None and ctx.alpha.alpha is not None and ctx.alpha.alpha > 0.75
    assert seen[9].regime_remaining_s is None
    assert seen[41].evidence_since is None  # one tick outside the band is not a regime yet (confirm = 2)
    moved = T0 + timedelta(minutes=41)  # the first confirming tick's decide interval
    for ctx in seen[42:]:
        assert ctx.regime_remaining_s is not None
        assert ctx.evidence_since == moved
        assert ctx.alpha.alpha is not None and ctx.alpha.alpha == pytest.approx(0.5, abs=0.03)
        assert ctx.alpha.dispersion < 2.0  # one prompt mix: no over-dispersion from mixing two
        assert ctx.duration_s == pytest.approx((ctx.now - moved).total_seconds())
        assert "when the acceptance moved" in ctx.alpha.message and "12:41:00 UTC" in ctx.alpha.message
    assert seen[42].recent_alpha == pytest.approx(0.5, abs=0.03)


def test_a_running_periods_history_is_read_incrementally_and_adds_up(db_url: str) -> None:
    """A draft in force for days must not make every tick re-read its windows: the cached history reads
    only what ended since the last tick (less the settle margin), and always equals a full re-read."""
    from policies.draft_choice import DraftCandidate
    from tuner.controller.candidates import same_draft
    from tuner.controller.evidence import HistoryCache, measured_history

    class CountingStore(Store):
        def __init__(self, url: str) -> None:
            super().__init__(url)
            self.windows_read = 0

        def windows(self, *args: Any, **kwargs: Any) -> list[WindowRecord]:
            out = super().windows(*args, **kwargs)
            self.windows_read += len(out)
            return out

    good = DraftCandidate("good", "draft_model", "/drafts/good")
    with CountingStore(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        now = write_windows(store, T0, 360, k=2, rate=100.0)  # an hour under the running config
        cache = HistoryCache()

        def read(cache: HistoryCache | None) -> tuple[float, int]:
            before = store.windows_read
            at = now + timedelta(seconds=1)  # a tick just after the last window
            ev = measured_history(store, [KEY], at, 7 * 86400.0, [good], same_draft, cache)["good"]
            return ev.trials, store.windows_read - before

        full, n_full = read(None)
        assert n_full == 360
        assert read(cache) == (full, 360)  # the first read is a full one
        for _ in range(3):  # ticks: 3 new windows each
            now = write_windows(store, now, 3, k=2, rate=100.0, alpha=0.6)
            cached, n_read = read(cache)
            assert cached == pytest.approx(read(None)[0], rel=1e-9)  # the sums add in another order
            assert n_read <= 3 + HistoryCache.SETTLE_S / 10 + 1  # the new windows and the unsettled tail
        # the period ends: one full read, kept for good
        store.record_config(KEY, config_record(K8, now, AppliedBy.RESTART))
        ended, n_read = read(cache)
        assert n_read == 369 and ended == read(None)[0]
        assert read(cache)[1] <= 1  # the ended period from the cache; the new one's tail (K = 8, same draft)


def test_a_drafts_history_is_its_evidence_since_its_acceptance_last_changed(db_url: str) -> None:
    """A draft steady at α 0.75 for an hour keeps all its evidence; once it has fallen to 0.3 for 10 minutes
    (the traffic moved) its history is those 10 minutes, not an hour-weighted 0.69 (ranking it on that
    would swap straight back to it)."""
    from policies.acceptance import evidence_from_counters
    from policies.draft_choice import DraftCandidate
    from tuner.controller.candidates import same_draft
    from tuner.controller.evidence import measured_history

    good = DraftCandidate("good", "draft_model", "/drafts/good")
    per_window = evidence_from_counters(iid(0.75, 2, 200)).evidence
    assert per_window is not None
    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        now = write_windows(store, T0, 360, k=2, rate=100.0, alpha=0.75)
        steady = measured_history(store, [KEY], now + timedelta(seconds=1), 7 * 86400.0, [good], same_draft)["good"]
        store.record_config(KEY, config_record(K8, now, AppliedBy.RESTART))  # a K change: the same draft
        now = write_windows(store, now, 60, k=8, rate=100.0, alpha=0.3)
        fell = measured_history(store, [KEY], now + timedelta(seconds=1), 7 * 86400.0, [good], same_draft)["good"]
    assert steady.trials == pytest.approx(360 * per_window.trials)  # identical windows: one regime, φ = 1
    assert fell.successes / fell.trials == pytest.approx(0.3, abs=0.01)


def test_a_config_that_started_before_the_history_horizon_still_counts_and_can_be_turned_back_on(db_url: str) -> None:
    """An engine ran K = 2 for longer than ``history_s`` before speculation went off: its history is read from
    the horizon's start (not lost because the period started earlier), and it is the config to come back to."""
    from policies.acceptance import evidence_from_counters
    from policies.draft_choice import DraftCandidate
    from tuner.controller.candidates import same_draft
    from tuner.controller.context import last_speculative
    from tuner.controller.evidence import measured_history

    good = DraftCandidate("good", "draft_model", "/drafts/good")
    horizon_s = 1800.0  # stands for the 7 days: the K = 2 period below runs 3600 s before going off
    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        now = write_windows(store, T0, 360, k=2, rate=100.0, alpha=0.75)
        store.record_config(KEY, config_record({"method": "off"}, now, AppliedBy.RESTART))
        now = write_windows(store, now, 30, k=0, rate=120.0)
        at = now + timedelta(seconds=1)
        history = measured_history(store, [KEY], at, horizon_s, [good], same_draft)
        assert last_speculative(store, [KEY], at, horizon_s) == SpecConfig.from_vllm(K2)
        assert last_speculative(store, [KEY], at, 100.0) is None  # off for 300 s: nothing within 100 s
    # the windows of the last 1800 s before `at` that ran K = 2: ~150 of its 360 (the rest are older; the
    # window ending on the period's end is left out, as for any ended period)
    per_window = evidence_from_counters(iid(0.75, 2, 200)).evidence
    assert per_window is not None
    assert history["good"].trials == pytest.approx(150 * per_window.trials, abs=per_window.trials)


@pytest.mark.parametrize("true_gain,verdict", [(1.0, ("verified", "no_worse")), (0.7, ("rolled_back", "regressed"))])
def test_harder_prompts_after_a_k_change_are_not_taken_for_its_regression(
    world: tuple[Store, FakeClock, FakeActuator], true_gain: float, verdict: tuple[str, str]
) -> None:
    """K 2 → 8, then the prompts turn hard (α 0.8 → 0.6): the tokens per step fall to E(8, 0.6)/E(8, 0.8)
    = 0.57 under any config. Judged on raw rates every such change would be rolled back; corrected for
    the first position's acceptance, a neutral change is kept and a real 30% loss still rolled back."""
    store, clock, act = world
    ctl, decision_id = apply_k8(store, clock, act)
    workload = (1 - 0.6**9) / (1 - 0.6) / ((1 - 0.8**9) / (1 - 0.8))
    clock.now = write_windows(store, clock.now, 12, k=8, rate=100.0 * workload * true_gain, alpha=0.6)
    [result] = ctl.verify(clock.now)
    assert (result.action, result.reason) == verdict
    d = store.decision(decision_id)
    assert d.realized_gain == pytest.approx(true_gain, abs=0.02)
    assert "first draft token's acceptance moved 0.800 → 0.600" in (d.status_message or "")


def test_the_draft_the_floor_swapped_out_is_held_off_the_opportunistic_ranking_until_acceptance_moves(
    db_url: str,
) -> None:
    from policies.draft_choice import DraftCandidate, DraftTriggerConfig
    from tuner.controller.context import ControllerMemory, build_context

    store = Store(db_url)
    try:
        weak_spec = {"method": "draft_model", "model": "/models/weak", "num_speculative_tokens": 3}
        good_spec = {"method": "draft_model", "model": "/models/good", "num_speculative_tokens": 3}
        store.record_config(KEY, config_record(weak_spec, T0, AppliedBy.STARTUP))
        swapped_at = write_windows(store, T0, 30, k=3, rate=60.0, alpha=0.25)  # left below the 0.4 floor
        store.record_config(KEY, config_record(good_spec, swapped_at, AppliedBy.RESTART))
        now = write_windows(store, swapped_at, 30, k=3, rate=100.0, alpha=0.8)
        weak = DraftCandidate("weak", "draft_model", "/models/weak", prior_alpha=0.9, cost_ratio=0.05)
        good = DraftCandidate("good", "draft_model", "/models/good", prior_alpha=0.8, cost_ratio=0.05)
        policy = replace(SETTINGS.policy, swap=DraftTriggerConfig(duration_s=200, min_drafts=500, segments=2))
        settings = replace(SETTINGS, policy=policy)
        stored = store.current_config(KEY)
        assert stored is not None

        def tick(at: datetime, memory: ControllerMemory) -> tuple[frozenset[str], ControllerMemory]:
            ctx, memory = build_context(store, [KEY], stored, at, settings, [weak, good], [], memory)
            return ctx.floored, memory

        floored, memory = tick(now, ControllerMemory())
        assert floored == {"weak"}
        floored, memory = tick(now + timedelta(seconds=10), memory)
        assert floored == {"weak"}  # the good draft's acceptance has not moved since the swap
        # it rises to 0.9: a new regime, but nothing in weak's favour
        later = write_windows(store, now, 6, k=3, rate=110.0, alpha=0.9)
        floored, memory = tick(later, memory)
        later = write_windows(store, later, 6, k=3, rate=110.0, alpha=0.9)
        floored, memory = tick(later, memory)
        assert floored == {"weak"}
        now = later
        # it falls to 0.6 and stays there: the traffic moved, so weak may be ranked again
        later = write_windows(store, now, 6, k=3, rate=80.0, alpha=0.6)
        floored, memory = tick(later, memory)
        later = write_windows(store, later, 6, k=3, rate=80.0, alpha=0.6)
        floored, memory = tick(later, memory)
        assert floored == frozenset()
    finally:
        store.close()


class LiveKActuator(FakeActuator):
    """A K change of the running draft applies live (the plugin); another draft restarts."""

    def needs_restart_for(self, config: VllmConfig) -> bool:
        return config.get("model") != self.current.get("model")


SWAP_TO_OTHER = {"method": "draft_model", "model": "/drafts/other", "num_speculative_tokens": 2}


def swap_with_k_alternative(
    alt_gain_ci: tuple[float, float], swap_gain: tuple[float, tuple[float, float]] = (1.2, (1.1, 1.3))
) -> Any:
    """Our policy seam: a swap beyond failure (1.2x) whose running draft's own K change (K 2 → 8, 1.15x)
    is part of that gain."""
    from tuner.controller.policy import PolicyOutcome, PolicyReason

    def policy(ctx: Any) -> PolicyOutcome:
        alt = PolicyOutcome(PolicyReason.CHANGE_K, "K 2 → 8.", SpecConfig.from_vllm(K8), 1.15, alt_gain_ci)
        return PolicyOutcome(PolicyReason.SWAP_DRAFT, "other beats good.", SpecConfig.from_vllm(SWAP_TO_OTHER),
                             *swap_gain, alternative=alt)  # fmt: skip

    return policy


def test_a_swap_gives_way_to_a_live_k_change_that_is_part_of_its_gain(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    store, clock, _ = world
    act = LiveKActuator(K2, clock)
    ctl = Controller(store, act, SETTINGS, clock, policy=swap_with_k_alternative((1.1, 1.2)))
    assert ctl.decide(clock.advance(60)).action == "blocked"  # hysteresis, on the K change
    assert ctl.decide(clock.advance(60)).action == "applied"
    assert act.applied == [K8]  # live, no restart; the swap is judged again against it
    decision = store.decisions()[-1].decision
    assert decision.reason == "change_k" and "Taken before the swap it is part of (other beats good.)" in (
        decision.message
    )


def test_a_swap_surely_worth_its_restart_beyond_the_k_change_does_not_wait_for_it(
    world: tuple[Store, FakeClock, FakeActuator],
) -> None:
    # 2.2x against the config in force, of which the K change is 1.15x: ~1.9x beyond it, surely above the
    # gain bar and repaid long before the horizon; the K change would only delay the swap it is part of
    store, clock, _ = world
    act = LiveKActuator(K2, clock)
    ctl = Controller(store, act, SETTINGS, clock, policy=swap_with_k_alternative((1.1, 1.2), (2.2, (2.1, 2.3))))
    first = ctl.decide(clock.advance(60))
    assert first.action == "blocked" and first.reason == "not_persistent"  # the streak builds on the swap
    assert store.decisions()[-1].decision.reason == "not_persistent"
    assert "Taken before the swap" not in store.decisions()[-1].decision.message
    assert ctl.decide(clock.advance(60)).action == "applied"
    assert act.applied == [SWAP_TO_OTHER]
    assert store.decisions()[-1].decision.reason == "swap_draft"


@pytest.mark.parametrize(
    ("live_k", "alt_gain_ci"),
    [(True, (0.8, 1.5)), (False, (1.1, 1.2))],
    ids=["k-change-not-surely-worth-it", "every-change-restarts"],
)
def test_a_swap_stands_when_its_k_alternative_is_held_back_or_would_restart_too(
    world: tuple[Store, FakeClock, FakeActuator], live_k: bool, alt_gain_ci: tuple[float, float]
) -> None:
    # held back by the gain rail, the K change leaves the swap to its own rails; with an actuator that
    # restarts for every change, one restart for the whole gain beats two
    store, clock, _ = world
    act = LiveKActuator(K2, clock) if live_k else FakeActuator(K2, clock)
    ctl = Controller(store, act, SETTINGS, clock, policy=swap_with_k_alternative(alt_gain_ci))
    ctl.decide(clock.advance(60))
    ctl.decide(clock.advance(60))
    assert act.applied == [SWAP_TO_OTHER]
    assert store.decisions()[-1].decision.reason == "swap_draft"


def test_acceptance_that_scatters_as_it_always_has_is_not_the_traffic_moving(db_url: str) -> None:
    """At one stream a decide interval's α̂ scatters with the one or two requests it saw. Once that scatter
    is on record (±0.05 here), two ticks 0.07–0.09 from the level — beyond the 0.05 band, within its scatter —
    are not a new regime (before: the acceptance "moved", and every shadow replay taken earlier was cut to
    the prior's weight); a fall of 0.25 still is, at its second tick."""
    from tuner.controller.context import ControllerMemory, build_context

    with Store(db_url) as store:
        store.record_config(KEY, config_record(K2, T0, AppliedBy.STARTUP))
        memory = ControllerMemory()
        now = T0
        seen = []
        for alpha in [0.8, 0.86, 0.74] * 5 + [0.89, 0.89, 0.8, 0.55, 0.55]:
            now = write_windows(store, now, 6, k=2, rate=100.0, alpha=alpha)
            current = store.current_config(KEY)
            assert current is not None
            ctx, memory = build_context(store, [KEY], current, now, SETTINGS, [], [], memory)
            seen.append((ctx, memory))
    ctx, memory = seen[-3]  # after the two ticks at 0.89
    assert 0.0 < ctx.recent_alpha_noise < 0.05  # the tick's own interval: 1200 drafts say little of it
    assert memory.alpha_moved_at is None
    assert memory.alpha_regime is not None and memory.alpha_regime[1].lengths_s == ()
    _, memory = seen[-1]
    assert memory.alpha_moved_at == now - timedelta(minutes=1)  # the first tick at 0.55 (confirm = 2)
    assert memory.alpha_regime is not None and memory.alpha_regime[1].direction == -1


def _windows_of(store: Store, start: datetime, counters: list[SpecCounters]) -> datetime:
    store.write_windows([
        WindowRecord(key=KEY, start=start + timedelta(seconds=10 * i), end=start + timedelta(seconds=10 * (i + 1)),
                     spec=c, generation_tokens=1000.0, requests_running=4.0)
        for i, c in enumerate(counters)
    ])  # fmt: skip
    return start + timedelta(seconds=10 * len(counters))


def test_positions_pool_the_drafts_earlier_configs_so_k_one_does_not_plan_k_two_on_position_zero(db_url: str) -> None:
    """Live (7 Dec, hard prompts at 4 streams) a table running K = 1 measured position 0 alone (α̂ 0.89) and
    planned K = 2 as if position 1 accepted as often; at K = 2 α̂ read 0.81 and the table went back, five times
    in 150 s. The draft's acceptance per position is the draft's at every K: the evidence window's earlier
    configs of the same draft add their positions (another draft's, older windows and those before the
    traffic moved do not), α̂ stays the current config's, and the plan says it went by position."""
    other = {"method": "draft_model", "model": "/drafts/other", "num_speculative_tokens": 3}
    k3, k1 = {**K2, "num_speculative_tokens": 3}, {**K2, "num_speculative_tokens": 1}
    with Store(db_url) as store:
        store.record_config(KEY, config_record(other, T0, AppliedBy.STARTUP))
        t = _windows_of(store, T0, [declining_counters(400, (0.5, 0.5, 0.5))] * 6)
        store.record_config(KEY, config_record(k3, t, AppliedBy.LIVE))
        t = _windows_of(store, t, [declining_counters(400, (0.9, 0.7, 0.6))] * 6)
        k1_start = t
        store.record_config(KEY, config_record(k1, t, AppliedBy.LIVE))
        end = _windows_of(store, t, [declining_counters(400, (0.9,))] * 6)
        stored = store.current_config(KEY)
        assert stored is not None and stored.config.num_spec_tokens == 1

        ctx = measure(store, [KEY], stored, end, 120.0)
        assert ctx.alpha.alpha == pytest.approx(0.9, abs=0.002)  # α̂: this config's windows alone
        assert ctx.positions_earlier_configs == 1  # K = 3's, not the other draft's (outside the window anyway)
        assert ctx.positions.trials[0] == pytest.approx(12 * 400)
        assert ctx.positions.successes[1] == pytest.approx(6 * 360 * 0.7, abs=6)  # from K = 3's windows only
        assert len(ctx.positions.trials) == 3

        alone = measure(store, [KEY], stored, end, 120.0, not_before=k1_start)  # the traffic moved at the change
        assert alone.positions_earlier_configs == 0 and len(alone.positions.trials) == 1
        wide = measure(store, [KEY], stored, end, 300.0)  # the other draft's windows are in the window now
        assert wide.positions_earlier_configs == 1 and wide.positions.trials == ctx.positions.trials

        settings = PolicySettings(PolicySection(k_max=5, cost_ratio=0.15))
        pooled = propose_k(ctx, settings)
        assert pooled.details["acceptance_model"]["choice"] == "positional_constant_alpha_rejected"
        assert "this config and 1 earlier one" in pooled.details["acceptance_model"]["message"]
        assert pooled.details["positions"]["earlier_configs"] == 1
        one_alpha = propose_k(alone, settings)
        assert "acceptance_model" not in one_alpha.details and one_alpha.target is not None
        # one α of 0.9 plans K = 5; positions 0.9, 0.7, 0.6 (and a decay beyond) plan K = 3, and say so
        assert one_alpha.target.k == 5
        assert pooled.target is not None and pooled.target.k == 3
        assert "K planned with per-position acceptance" in pooled.message
