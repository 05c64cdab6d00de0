"""What the controller writes down: tick results, events and config periods (the audit trail).

Every decision row, event and config period the controller writes goes through here or
:mod:`tuner.controller.apply`, so the audit log has one shape whatever path a change took.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from collectors.records import EngineKey, EventRecord
from policies.spec_config import SpecConfig
from tuner.actuators.base import ApplyResult
from tuner.store import AppliedBy, EngineConfigRecord, Store

CHANGE = "change"  # a decision's action when the controller itself proposes a config
# Config periods that count as changes for the cooldown and the changes-per-hour rail.
CHANGE_SOURCES = frozenset(
    {
        AppliedBy.RESTART,
        AppliedBy.LIVE,
        AppliedBy.COMMAND,
        AppliedBy.WEBHOOK,
        AppliedBy.MANUAL,
        AppliedBy.ROLLBACK,
        AppliedBy.PROMOTED,
    }
)


@dataclass(frozen=True)
class TickResult:
    """What one decide/verify step did (for logs, the CLI, exporters and tests)."""

    action: str  # none | hold | blocked | advisory | applied | unchanged | rolled_back | failed | verified
    reason: str
    message: str
    decision_id: int | None = None


def write_event(
    store: Store,
    ts: datetime,
    keys: Sequence[EngineKey],
    kind: str,
    severity: str,
    message: str,
    decision_id: int | None,
    result: ApplyResult | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """One event row, carrying what the actuator reported of the apply (``ApplyResult.event_data``) and
    ``extra`` (e.g. a canary's verdict)."""
    data: dict[str, Any] = {"decision_id": decision_id}
    if result is not None:
        data.update(result.event_data())
    if extra is not None:
        data.update(extra)
    store.write_events(
        [EventRecord(ts=ts, kind=kind, message=message, severity=severity, engine=keys[0] if keys else None, data=data)]
    )


def record_configs(
    store: Store,
    keys: Sequence[EngineKey],
    spec: SpecConfig,
    at: datetime,
    applied_by: str,
    decision_id: int | None = None,
) -> None:
    """A new config period on every engine series of the server (data-parallel ranks share one config)."""
    for key in keys:
        store.record_config(key, EngineConfigRecord.of(spec, at, applied_by, decision_id))


__all__ = ["CHANGE", "CHANGE_SOURCES", "TickResult", "record_configs", "write_event"]
