"""Operator orders kept in the database (the admin CLI writes them, the controller reads them).

They are decision rows, so they are part of the audit log and never pruned:

- pause: action ``pause``, status ``in_force`` until a resume lifts it (status ``lifted``).
- resume: action ``resume``, status ``applied``; lifts every pause in force.
- override: action ``override`` with ``proposed_config``, status ``proposed`` until the controller
  applies it (then ``applied``/``rolled_back``/``failed`` like any change). Overrides bypass the
  evidence and gain rails (an operator decided) but not a pause or a pending apply. With
  ``inputs.canary`` true (``spectuner apply --canary``) it runs as a canary when untouched replicas
  share the store (``tuner.controller.canary``): judged against them, rolled back if it fails.
- promote: written by another replica's sidecar when its canary passed, one per untouched replica;
  applied like an override by that replica's own controller.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from collectors.records import EngineKey
from tuner.store import DecisionRecord, DecisionStatus, Store, StoredDecision

PAUSE = "pause"
RESUME = "resume"
OVERRIDE = "override"
PROMOTE = "promote"
IN_FORCE = "in_force"
LIFTED = "lifted"


def pause(store: Store, now: datetime, *, by: str = "operator", note: str = "") -> int:
    return store.record_decision(
        DecisionRecord(
            created_at=now,
            action=PAUSE,
            reason="manual",
            message=f"Paused by {by}." + (f" {note}" if note else ""),
            inputs={"by": by},
            mode="manual",
            status=IN_FORCE,
        )
    )


def resume(store: Store, now: datetime, *, by: str = "operator") -> int:
    for d in active_pauses(store):
        store.update_decision(d.id, status=LIFTED, at=now, status_message=f"lifted by {by}")
    return store.record_decision(
        DecisionRecord(
            created_at=now,
            action=RESUME,
            reason="manual",
            message=f"Resumed by {by}.",
            inputs={"by": by},
            mode="manual",
            status=DecisionStatus.APPLIED,
        )
    )


def active_pauses(store: Store) -> list[StoredDecision]:
    return [d for d in store.decisions(status=IN_FORCE) if d.decision.action == PAUSE]


def request_override(
    store: Store,
    now: datetime,
    config: dict[str, Any],
    *,
    engine: EngineKey | None = None,
    by: str = "operator",
    canary: bool = False,
) -> int:
    """Ask the controller to apply ``config`` on its next tick (even in advisory mode); ``canary``: judge
    it against the untouched replicas first."""
    if not isinstance(config.get("method"), str):
        raise ValueError('an override config needs a "method" (e.g. "draft_model", "ngram", "off")')
    return store.record_decision(
        DecisionRecord(
            created_at=now,
            action=OVERRIDE,
            reason="manual",
            message=f"Manual override by {by}" + (", as a canary." if canary else "."),
            inputs={"by": by, "canary": True} if canary else {"by": by},
            mode="manual",
            engine=engine,
            proposed_config=config,
            status=DecisionStatus.PROPOSED,
        )
    )


def pending_overrides(store: Store) -> list[StoredDecision]:
    """Overrides and promotions not yet acted on, oldest first."""
    return [d for d in store.decisions(status=DecisionStatus.PROPOSED) if d.decision.action in (OVERRIDE, PROMOTE)]
