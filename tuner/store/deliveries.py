"""Data access for the alert hooks: events by id, each sink's cursor, and the delivery log.

Events are read by id (not by time): ids only grow, so "every event after the cursor" neither skips an
event written with an older timestamp nor repeats one. A sink's cursor moves in the same transaction
as the delivery row for the event it passed, so after a crash the event is either logged and passed,
or neither (and is then delivered again: at-least-once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, delete, func, insert, select, update

from collectors.records import EngineKey
from tuner.store.models import AlertCursorRow, AlertDeliveryRow, EngineRow, EventRow
from tuner.store.store import Store

deliveries_t = cast(Table, AlertDeliveryRow.__table__)
cursors_t = cast(Table, AlertCursorRow.__table__)
_events_t = cast(Table, EventRow.__table__)
_engines_t = cast(Table, EngineRow.__table__)


@dataclass(frozen=True)
class StoredEvent:
    """An event row with its id (the alert cursor's unit)."""

    id: int
    ts: datetime
    kind: str
    severity: str
    message: str
    engine: EngineKey | None
    engine_id: int | None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeliveryRecord:
    """One event's outcome at one sink. ``error`` must already be free of secrets and URLs."""

    event_id: int
    sink: str
    kind: str
    dedup_key: str
    outcome: str
    attempts: int
    duration_s: float
    created_at: datetime
    engine_id: int | None = None
    status_code: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class StoredDelivery:
    id: int
    record: DeliveryRecord


def latest_event_id(store: Store) -> int:
    """The highest event id so far (0 for none)."""
    with store.read_connection() as conn:
        return int(conn.execute(select(func.coalesce(func.max(_events_t.c.id), 0))).scalar_one())


def events_after(store: Store, after_id: int, limit: int = 500) -> list[StoredEvent]:
    """Events with id > ``after_id``, in id order, at most ``limit``."""
    query = (
        select(_events_t, _engines_t.c.url, _engines_t.c.model_name, _engines_t.c.engine_index)
        .select_from(_events_t.outerjoin(_engines_t, _events_t.c.engine_id == _engines_t.c.id))
        .where(_events_t.c.id > after_id)
        .order_by(_events_t.c.id)
        .limit(limit)
    )
    with store.read_connection() as conn:
        return [
            StoredEvent(
                id=row.id,
                ts=row.ts,
                kind=row.kind,
                severity=row.severity,
                message=row.message,
                engine=None if row.url is None else EngineKey(row.url, row.model_name, row.engine_index),
                engine_id=row.engine_id,
                data=dict(row.data or {}),
            )
            for row in conn.execute(query)
        ]


def cursor(store: Store, sink: str) -> int | None:
    """The last event id ``sink`` has dealt with, or None for a sink never seen."""
    with store.read_connection() as conn:
        value = conn.execute(select(cursors_t.c.last_event_id).where(cursors_t.c.sink == sink)).scalar_one_or_none()
    return None if value is None else int(value)


def set_cursor(store: Store, sink: str, last_event_id: int, at: datetime) -> None:
    with store.write_transaction() as conn:
        _set_cursor(conn, sink, last_event_id, at)


def _set_cursor(conn: Any, sink: str, last_event_id: int, at: datetime) -> None:
    done = conn.execute(
        update(cursors_t).where(cursors_t.c.sink == sink).values(last_event_id=last_event_id, updated_at=at)
    )
    if not done.rowcount:
        conn.execute(insert(cursors_t).values(sink=sink, last_event_id=last_event_id, updated_at=at))


def record_delivery(store: Store, record: DeliveryRecord, *, advance_cursor: bool = True) -> int:
    """Log one outcome and (by default) move the sink's cursor to its event, in one transaction."""
    row = {
        "event_id": record.event_id,
        "engine_id": record.engine_id,
        "sink": record.sink,
        "kind": record.kind,
        "dedup_key": record.dedup_key[:512],
        "outcome": record.outcome,
        "attempts": record.attempts,
        "status_code": record.status_code,
        "error": record.error,
        "duration_s": record.duration_s,
        "created_at": record.created_at,
    }
    with store.write_transaction() as conn:
        new_id = int(conn.execute(insert(deliveries_t).returning(deliveries_t.c.id), row).scalar_one())
        if advance_cursor:
            _set_cursor(conn, record.sink, record.event_id, record.created_at)
    return new_id


def last_delivered_at(store: Store, sink: str, dedup_key: str, since: datetime) -> datetime | None:
    """When ``sink`` last delivered an event with ``dedup_key`` at or after ``since`` (None: not since)."""
    c = deliveries_t.c
    query = select(func.max(c.created_at)).where(
        c.sink == sink, c.dedup_key == dedup_key[:512], c.outcome == "delivered", c.created_at >= since
    )
    with store.read_connection() as conn:
        value: datetime | None = conn.execute(query).scalar_one()
    return value


def attempts_since(store: Store, sink: str, since: datetime) -> int:
    """Deliveries ``sink`` attempted (delivered or failed) at or after ``since``: its rate-limit usage."""
    c = deliveries_t.c
    query = select(func.count()).where(
        c.sink == sink, c.outcome.in_(("delivered", "failed")), c.created_at >= since
    )
    with store.read_connection() as conn:
        return int(conn.execute(query).scalar_one())


def deliveries(
    store: Store, *, sink: str | None = None, after_id: int = 0, limit: int | None = None
) -> list[StoredDelivery]:
    """The delivery log in id order (optionally one sink, after an id)."""
    query = select(deliveries_t).where(deliveries_t.c.id > after_id).order_by(deliveries_t.c.id)
    if sink is not None:
        query = query.where(deliveries_t.c.sink == sink)
    if limit is not None:
        query = query.limit(limit)
    with store.read_connection() as conn:
        return [
            StoredDelivery(
                id=row.id,
                record=DeliveryRecord(
                    event_id=row.event_id,
                    sink=row.sink,
                    kind=row.kind,
                    dedup_key=row.dedup_key,
                    outcome=row.outcome,
                    attempts=row.attempts,
                    duration_s=row.duration_s,
                    created_at=row.created_at,
                    engine_id=row.engine_id,
                    status_code=row.status_code,
                    error=row.error,
                ),
            )
            for row in conn.execute(query)
        ]


def delivery_counts(store: Store, after_id: int = 0) -> tuple[int, list[tuple[int | None, str, str, int]]]:
    """(highest id, [(engine_id, sink, outcome, count)]) of deliveries after ``after_id``: the
    exporter's incremental ``spectuner_alert_deliveries_total``."""
    c = deliveries_t.c
    with store.read_connection() as conn:
        top = int(conn.execute(select(func.coalesce(func.max(c.id), 0))).scalar_one())
        rows = conn.execute(
            select(c.engine_id, c.sink, c.outcome, func.count())
            .where(c.id > after_id, c.id <= top)
            .group_by(c.engine_id, c.sink, c.outcome)
        ).all()
    return max(top, after_id), [(r[0], str(r[1]), str(r[2]), int(r[3])) for r in rows]


def prune_deliveries(store: Store, before: datetime) -> int:
    """Delete delivery-log rows older than ``before`` (cursors stay). Returns how many went.
    Retention should call it on the events' horizon (dedup and rate limits look back minutes only)."""
    with store.write_transaction() as conn:
        return int(conn.execute(delete(deliveries_t).where(deliveries_t.c.created_at < before)).rowcount or 0)
