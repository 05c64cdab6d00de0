"""Canary verification by the controller (tuner/controller/canary.py): three replicas, one controller
each, one real store (SQLite and PostgreSQL), fake actuators at our seam and a shared fake clock. A
change goes to one replica, is judged against the two untouched ones over the same minutes, and is
promoted to them — or rolled back on the canary alone, the others never touched."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from collectors.records import EngineKey, RequestRecord, WindowRecord
from tests.fakes import FakeClock
from tests.integration.test_controller import K2, K8, FakeActuator, config_record, iid
from tuner.config import CanarySection, ControllerSection, GuardrailsSection, Mode, PolicySection
from tuner.controller import manual
from tuner.controller.audit import TickResult
from tuner.controller.canary import CanaryPlan, contested, error_samples, plan_of, upstream_of
from tuner.controller.controller import Controller
from tuner.controller.settings import ControllerSettings, PolicySettings
from tuner.store import AppliedBy, DecisionRecord, DecisionStatus, Store

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
PORTS = (8001, 8002, 8003)
KEYS = [EngineKey(f"http://127.0.0.1:{p}/metrics", "fake-target", "0") for p in PORTS]
CANARY = CanarySection(enabled=True, warmup_s=20, min_samples=5, bucket_s=60, max_s=600)


@dataclass
class Replica:
    key: EngineKey
    actuator: FakeActuator
    controller: Controller


def settings(key: EngineKey, canary: CanarySection = CANARY) -> ControllerSettings:
    return ControllerSettings(
        metrics_url=key.url,
        controller=ControllerSection(mode=Mode.AUTO, verify_window_s=120),
        guardrails=GuardrailsSection(min_drafts=1000, min_evidence_s=60, cooldown_s=0),
        policy=PolicySettings(PolicySection(k_max=8, cost_ratio=0.05, evidence_window_s=300)),
        canary=canary,
    )


def write(store: Store, key: EngineKey, start: datetime, n: int, rate: float, phase: int = 0) -> None:
    """n windows of 10 s at ``rate`` generated tokens/s, ±2 % in a pattern that differs per replica."""
    store.write_windows(
        [
            WindowRecord(
                key=key,
                start=start + timedelta(seconds=10 * i),
                end=start + timedelta(seconds=10 * (i + 1)),
                spec=iid(0.8, 2, 200),
                generation_tokens=10 * rate * (1.0 + 0.02 * (((i + phase) % 5) - 2) / 2),
                requests_running=4.0,
            )
            for i in range(n)
        ]
    )


@pytest.fixture
def fleet(db_url: str) -> Iterator[tuple[Store, FakeClock, list[Replica]]]:
    store = Store(db_url)
    clock = FakeClock(T0)
    replicas = []
    for i, key in enumerate(KEYS):
        store.record_config(key, config_record(K2, T0, AppliedBy.STARTUP))
        write(store, key, T0, 30, 100.0, phase=i)
        actuator = FakeActuator(K2, clock)
        replicas.append(Replica(key, actuator, Controller(store, actuator, settings(key), clock)))
    clock.now = T0 + timedelta(seconds=300)
    try:
        yield store, clock, replicas
    finally:
        store.close()


def start_canary(store: Store, clock: FakeClock, canary: Replica, others: list[Replica]) -> int:
    order = manual.request_override(store, clock(), K8, engine=canary.key, canary=True)
    result = canary.controller.decide(clock())
    assert result.action == "applied", result.message
    plan = plan_of(store.decision(order))
    assert plan is not None and set(plan.peers) == {r.key for r in others}
    assert plan.previous.to_vllm() == K2
    return order


def judge_after(store: Store, clock: FakeClock, replicas: list[Replica], order: int, canary_rate: float) -> TickResult:
    """Two minutes of windows after the canary's apply (the canary, replicas[0], at ``canary_rate``, the
    untouched ones at 100 tokens/s), then the canary's verify tick."""
    applied_at = store.decision(order).updated_at
    for i, r in enumerate(replicas):
        write(store, r.key, applied_at, 12, canary_rate if i == 0 else 100.0, phase=i)
    clock.now = applied_at + timedelta(seconds=120)
    [verdict] = replicas[0].controller.verify(clock())
    return verdict


def test_a_better_change_is_promoted_to_the_untouched_replicas(fleet: tuple[Store, FakeClock, list[Replica]]) -> None:
    store, clock, (a, b, c) = fleet
    order = start_canary(store, clock, a, [b, c])
    # While the canary runs the others change nothing, not even an operator's override.
    manual.request_override(store, clock(), {**K2, "num_speculative_tokens": 3}, engine=b.key)
    held = b.controller.decide(clock())
    assert held.action == "blocked" and "canary of this target runs on" in held.message
    verdict = judge_after(store, clock, [a, b, c], order, canary_rate=120.0)
    assert verdict.reason == "canary_promoted", verdict.message
    assert "ttft_p99, tpot_p99, error_rate" in verdict.message  # no data on either side: left out, said so
    row = store.decision(order)
    assert row.status == DecisionStatus.VERIFIED and row.realized_gain == pytest.approx(1.2, abs=0.03)
    promotions = [d for d in store.decisions() if d.decision.action == manual.PROMOTE]
    assert {d.decision.engine for d in promotions} == {b.key, c.key}
    [event] = store.events(T0, clock() + timedelta(seconds=1), kind="canary_promoted")
    assert event.data["canary"]["decision"] == "promote" and event.data["decision_id"] == order
    # Each untouched replica applies the promotion on its own next tick (B's own override, older, is dropped).
    for r in (b, c):
        result = r.controller.decide(clock())
        assert result.action == "applied", result.message
        assert r.actuator.current == K8
        current = store.current_config(r.key)
        assert current is not None and current.config.applied_by == AppliedBy.PROMOTED
    assert a.actuator.applied == [K8]


def test_a_worse_change_is_rolled_back_on_the_canary_alone(fleet: tuple[Store, FakeClock, list[Replica]]) -> None:
    store, clock, (a, b, c) = fleet
    order = start_canary(store, clock, a, [b, c])
    verdict = judge_after(store, clock, [a, b, c], order, canary_rate=70.0)
    assert verdict.action == "rolled_back", verdict.message
    assert "critical metric failed" in verdict.message
    assert a.actuator.applied == [K8, K2] and a.actuator.current == K2
    assert b.actuator.applied == [] and c.actuator.applied == []
    assert not [d for d in store.decisions() if d.decision.action == manual.PROMOTE]
    assert store.decision(order).status == DecisionStatus.ROLLED_BACK
    assert store.events(T0, clock() + timedelta(seconds=1), kind="canary_rolled_back")
    # The canary is over: the others may change again (nothing blocks them on its account).
    assert b.controller.state(clock(), [b.key], []).canary_elsewhere is None


def test_an_undecided_canary_waits_and_is_rolled_back_when_its_time_is_up(
    fleet: tuple[Store, FakeClock, list[Replica]],
) -> None:
    store, clock, (a, b, c) = fleet
    order = start_canary(store, clock, a, [b, c])
    applied_at = store.decision(order).updated_at
    for i, r in enumerate((a, b, c)):
        write(store, r.key, applied_at, 3, 100.0, phase=i)  # too few windows yet
    clock.now = applied_at + timedelta(seconds=30)
    [wait] = a.controller.verify(clock())
    assert wait.action == "hold" and wait.reason == "canary_undecided", wait.message
    assert store.decision(order).status == DecisionStatus.APPLIED
    # The canary's windows drift up and down by 8 %: it can be neither shown safe (2 % tolerance) nor worse.
    later = applied_at + timedelta(seconds=30)
    for i, r in enumerate((a, b, c)):
        for j in range(57):
            rate = 100.0 * (1.08 if j % 2 else 0.92) if r is a else 100.0
            write(store, r.key, later + timedelta(seconds=10 * j), 1, rate, phase=i + j)
    clock.now = applied_at + timedelta(seconds=CANARY.max_s)
    [final] = a.controller.verify(clock())
    assert final.action == "rolled_back", final.message
    assert "time is up" in final.message and b.actuator.applied == [] and c.actuator.applied == []


def test_without_an_untouched_replica_a_canary_override_is_a_plain_one(db_url: str) -> None:
    store = Store(db_url)
    try:
        clock = FakeClock(T0)
        store.record_config(KEYS[0], config_record(K2, T0, AppliedBy.STARTUP))
        write(store, KEYS[0], T0, 30, 100.0)
        clock.now = T0 + timedelta(seconds=300)
        actuator = FakeActuator(K2, clock)
        controller = Controller(store, actuator, settings(KEYS[0]), clock)
        order = manual.request_override(store, clock(), K8, engine=KEYS[0], canary=True)
        assert controller.decide(clock()).action == "applied"
        row = store.decision(order)
        assert plan_of(row) is None and row.status == DecisionStatus.APPLIED
        [event] = store.events(T0, clock() + timedelta(seconds=1), kind="canary_unavailable")
        assert "applied as a plain override" in event.message
    finally:
        store.close()


def test_two_canaries_recorded_at_once_are_contested(fleet: tuple[Store, FakeClock, list[Replica]]) -> None:
    store, clock, (a, b, c) = fleet
    plan = CanaryPlan((c.key,), a.controller.current_config([a.key]).config.spec)  # type: ignore[union-attr]
    ids = [
        store.record_decision(
            DecisionRecord(
                created_at=clock(),
                action="change",
                reason="test",
                message="canary",
                inputs={"canary": plan.to_json()},
                mode="auto",
                engine=r.key,
                proposed_config=K8,
                status=DecisionStatus.APPLYING,
            )
        )
        for r in (a, b)
    ]
    other = contested(store, [a.key], ids[0])
    assert other is not None and other.id == ids[1]
    assert contested(store, [c.key], -1) is not None  # C sees a canary elsewhere too


def test_error_samples_count_server_errors_per_replica_and_bucket() -> None:
    def req(t: float, port: int, status: int) -> RequestRecord:
        return RequestRecord(
            ts=T0 + timedelta(seconds=t), request_id=f"{t}-{port}", model_name="m", prompt_tokens=1,
            output_tokens=1, latency_s=0.1, upstream_url=f"http://127.0.0.1:{port}", status_code=status,
        )  # fmt: skip

    requests = [req(1, 8001, 200), req(2, 8001, 500), req(3, 8002, 200), req(70, 8001, 200), req(4, 8009, 502)]
    samples = error_samples(requests, [KEYS[0]], 60.0)
    assert [v for _, v in samples] == [0.5, 0.0]
    assert upstream_of(KEYS[0]) == "http://127.0.0.1:8001"
