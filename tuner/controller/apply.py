"""Put a decided config in force through the actuator, and record what happened; roll a change back.

The actuator is the vLLM edge: it takes vLLM's JSON (``SpecConfig.to_vllm``). Whatever it reports —
applied, unchanged, rolled back by itself because the new config did not come up, or failed — lands
in the decision's status, a config period when the engine's config changed, and an event carrying
the actuator's measurements (``ApplyResult.event_data``: downtime, strategy, client impact…).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

from collectors.records import EngineKey
from policies.spec_config import SpecConfig, change_kind
from tuner.actuators.base import Actuator, ApplyStatus
from tuner.controller.audit import TickResult, record_configs, write_event
from tuner.store import AppliedBy, DecisionStatus, Store

Clock = Callable[[], datetime]


def in_force(actuator: Actuator) -> SpecConfig | None:
    """The config the actuator last put in force (None: not known yet)."""
    return SpecConfig.from_vllm(actuator.current) if actuator.current is not None else None


def apply_config(
    store: Store,
    actuator: Actuator,
    clock: Clock,
    decision_id: int,
    target: SpecConfig,
    now: datetime,
    keys: Sequence[EngineKey],
    applied_by: str,
) -> TickResult:
    """Apply ``target`` for decision ``decision_id`` and record the outcome (see the module doc)."""
    store.update_decision(decision_id, status=DecisionStatus.APPLYING, at=now)
    previous = in_force(actuator)

    def note(message: str) -> None:
        # milestones of a long apply land on the row as they happen: a daemon killed mid-apply can tell
        # on restart how far it got (tuner.controller.recovery)
        store.update_decision(decision_id, status=DecisionStatus.APPLYING, at=max(clock(), now), status_message=message)

    actuator.progress = note
    try:
        result = actuator.apply(target.to_vllm())
    finally:
        actuator.progress = lambda message: None
    done_at = max(clock(), now)
    if result.status is ApplyStatus.APPLIED:
        record_configs(store, keys, target, done_at, applied_by, decision_id)
        store.update_decision(decision_id, status=DecisionStatus.APPLIED, at=done_at, status_message=result.message)
        write_event(
            store, done_at, keys, "config_applied", "info", f"Applied {target.describe()}: {result.message}",
            decision_id, result,
        )  # fmt: skip
        kind = change_kind(previous, target)
        if kind is not None and previous is not None:
            write_event(
                store, done_at, keys, kind.value, "info", f"{previous.describe()} → {target.describe()}", decision_id
            )
        return TickResult("applied", "applied", result.message, decision_id)
    if result.status is ApplyStatus.UNCHANGED:
        store.update_decision(decision_id, status=DecisionStatus.VERIFIED, at=done_at, status_message=result.message)
        return TickResult("unchanged", "unchanged", result.message, decision_id)
    if result.status is ApplyStatus.ROLLED_BACK and result.config is not None:
        # The engine restarted with the old config: a new config period begins (and counts for cooldown).
        record_configs(store, keys, SpecConfig.from_vllm(result.config), done_at, AppliedBy.ROLLBACK, decision_id)
        store.update_decision(decision_id, status=DecisionStatus.ROLLED_BACK, at=done_at, status_message=result.message)
        write_event(
            store, done_at, keys, "apply_rolled_back", "warning",
            f"{target.describe()} did not come up; rolled back: {result.message}", decision_id, result,
        )  # fmt: skip
        return TickResult("rolled_back", "start_failed", result.message, decision_id)
    store.update_decision(decision_id, status=DecisionStatus.FAILED, at=done_at, status_message=result.message)
    severity = "critical" if result.config is None and actuator.kind == "restart" else "warning"
    write_event(
        store, done_at, keys, "apply_failed", severity, f"Applying {target.describe()} failed: {result.message}",
        decision_id, result,
    )  # fmt: skip
    return TickResult("failed", "apply_failed", result.message, decision_id)


def roll_back(
    store: Store,
    actuator: Actuator,
    clock: Clock,
    decision_id: int,
    previous: SpecConfig,
    why: str,
    gain: float | None,
    now: datetime,
    keys: Sequence[EngineKey],
) -> TickResult:
    """Restore ``previous`` after decision ``decision_id`` regressed; a failed rollback is critical."""
    result = actuator.apply(previous.to_vllm())
    done_at = max(clock(), now)
    if result.status in (ApplyStatus.APPLIED, ApplyStatus.UNCHANGED):
        if result.status is ApplyStatus.APPLIED:
            record_configs(store, keys, previous, done_at, AppliedBy.ROLLBACK, decision_id)
        store.update_decision(
            decision_id, status=DecisionStatus.ROLLED_BACK, at=done_at, realized_gain=gain, status_message=why
        )
        write_event(store, done_at, keys, "regression_rolled_back", "warning", why, decision_id, result)
        return TickResult("rolled_back", "regressed", why, decision_id)
    message = f"{why} The rollback itself failed: {result.message}"
    store.update_decision(
        decision_id, status=DecisionStatus.FAILED, at=done_at, realized_gain=gain, status_message=message
    )
    write_event(store, done_at, keys, "rollback_failed", "critical", message, decision_id, result)
    return TickResult("failed", "rollback_failed", message, decision_id)


__all__ = ["apply_config", "in_force", "roll_back"]
