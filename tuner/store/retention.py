"""Downsampling and retention: plain functions the daemon's scheduler calls with the current time.

- :func:`rollup_windows` sums raw scrape windows into 1-minute rollups per engine and config
  (a window belongs to the minute its end falls in). A minute is rolled up once it is ``settle_s``
  old; each run recomputes from ``lookback_s`` before the newest rollup, so late windows are caught
  and running it twice changes nothing.
- :func:`prune` deletes rows past their horizon. Raw windows go by whole minutes and only once
  rolled up, so a rollup never loses a window it counted and a window is never lost uncounted.
- :func:`run_retention` does both, rollup first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, func, insert, select, text

from tuner.store.store import (
    Store,
    events_t,
    requests_t,
    rollups_t,
    steps_t,
    windows_t,
)

log = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)
_DAY_S = 86_400.0


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each kind of row is kept, in seconds. Decisions and configs (the audit log) are kept.

    Defaults: raw windows a week (enough to re-estimate α at full resolution after an incident),
    rollups ~13 months (year-over-year comparisons), requests a week, steps two days (the highest
    volume: thousands per minute), events 90 days.
    """

    raw_windows_s: float = 7 * _DAY_S
    rollups_s: float = 400 * _DAY_S
    requests_s: float = 7 * _DAY_S
    steps_s: float = 2 * _DAY_S
    events_s: float = 90 * _DAY_S
    # A minute is rolled up once it is this old: a window ending in it may still be in flight.
    rollup_settle_s: float = 60.0
    # Each run recomputes this far back from the newest rollup, catching windows written late.
    rollup_lookback_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("raw_windows_s", "rollups_s", "requests_s", "steps_s", "events_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"retention {name} must be positive seconds but got {value!r}")
        for name in ("rollup_settle_s", "rollup_lookback_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"retention {name} cannot be negative but got {value!r}")
        floor_s = self.rollup_settle_s + self.rollup_lookback_s + 60.0
        if self.raw_windows_s < floor_s:
            raise ValueError(
                f"retention raw_windows_s ({self.raw_windows_s:g}) must be at least rollup_settle_s + "
                f"rollup_lookback_s + 60 = {floor_s:g}, or windows would be deleted before they are "
                "rolled up"
            )
        if self.rollups_s < self.raw_windows_s:
            raise ValueError(
                f"retention rollups_s ({self.rollups_s:g}) must be at least raw_windows_s "
                f"({self.raw_windows_s:g}): rollups are the long-term copy"
            )


@dataclass(frozen=True)
class RollupResult:
    since: datetime | None  # first bucket recomputed (None: nothing to do)
    until: datetime | None  # end of the last bucket recomputed (exclusive)
    windows_read: int
    buckets_written: int
    skipped: bool = False  # another sidecar on this database was rolling up (PostgreSQL); its run covers ours


# One advisory lock per database for the rollup: N sidecars sharing a PostgreSQL each run retention, and two
# rollups of the same minutes at once collide on the bucket key (measured: 10 % of runs with 100 sidecars).
ROLLUP_LOCK_KEY = 0x5EC7_0001


@dataclass(frozen=True)
class PruneResult:
    deleted: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RetentionResult:
    rollup: RollupResult
    prune: PruneResult


def floor_minute(ts: datetime) -> datetime:
    ts = ts.astimezone(UTC)
    return ts.replace(second=0, microsecond=0)


def _aware(now: datetime) -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("retention needs a timezone-aware `now`, e.g. datetime.now(UTC)")
    return now.astimezone(UTC)


def rollup_windows(
    store: Store,
    now: datetime,
    *,
    settle_s: float = 60.0,
    lookback_s: float = 600.0,
    since: datetime | None = None,
) -> RollupResult:
    """Recompute 1-minute rollups for complete minutes from ``since`` (default: ``lookback_s``
    before the newest rollup, or the oldest raw window) up to ``now - settle_s``. Idempotent."""
    now = _aware(now)
    until = floor_minute(now - timedelta(seconds=settle_s))
    with store.write_transaction() as conn:
        if store.dialect == "postgresql" and not conn.execute(
            text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": ROLLUP_LOCK_KEY}
        ).scalar_one():
            # Rollups are database-wide: the sidecar holding the lock is recomputing these minutes now.
            log.debug("rollup skipped: another sidecar on this database is rolling up")
            return RollupResult(None, None, 0, 0, skipped=True)
        oldest_raw = conn.execute(select(func.min(windows_t.c.end_ts))).scalar_one()
        if oldest_raw is None:
            return RollupResult(None, None, 0, 0)
        if since is None:
            newest_rollup = conn.execute(select(func.max(rollups_t.c.bucket_start))).scalar_one()
            since = oldest_raw if newest_rollup is None else newest_rollup - timedelta(seconds=lookback_s)
        # Never recompute a minute whose raw windows may already be pruned.
        start = max(floor_minute(_aware(since)), floor_minute(oldest_raw))
        if start >= until:
            return RollupResult(start, until, 0, 0)
        buckets, windows_read = _aggregate(conn, start, until)
        conn.execute(delete(rollups_t).where(rollups_t.c.bucket_start >= start, rollups_t.c.bucket_start < until))
        if buckets:
            conn.execute(insert(rollups_t), list(buckets.values()))
    log.debug("rolled up %d windows into %d minute buckets [%s, %s)", windows_read, len(buckets), start, until)
    return RollupResult(start, until, windows_read, len(buckets))


def _aggregate(conn: Connection, start: datetime, until: datetime) -> tuple[dict[Any, dict[str, Any]], int]:
    c = windows_t.c
    query = select(windows_t).where(c.end_ts >= start, c.end_ts < until).order_by(c.engine_id, c.end_ts)
    buckets: dict[Any, dict[str, Any]] = {}
    gauges: dict[Any, dict[str, list[float]]] = {}
    ks: dict[Any, set[int | None]] = {}
    n = 0
    for w in conn.execute(query):
        n += 1
        bucket = floor_minute(w.end_ts)
        group = (w.engine_id, w.config_id, bucket)
        b = buckets.get(group)
        if b is None:
            b = buckets[group] = _empty_bucket(w.engine_id, w.config_id, bucket)
            ks[group] = set()
            gauges[group] = {"requests_running": [], "requests_waiting": [], "kv_cache_usage": []}
        b["windows"] += 1
        b["duration_s"] += (w.end_ts - w.start_ts).total_seconds()
        b["resets"] += int(w.reset)
        for col in (
            "drafts",
            "draft_tokens",
            "accepted_tokens",
            "spec_generated_tokens",
            "generation_tokens",
            "prompt_tokens",
        ):
            b[col] += getattr(w, col)
        _add_into(b["accepted_per_pos"], w.accepted_per_pos)
        if w.spec_enabled:
            ks[group].add(w.num_spec_tokens)
            if b["draft_tokens_per_pos"] is not None:
                if w.draft_tokens_per_pos is None:
                    b["draft_tokens_per_pos"] = None
                else:
                    _add_into(b["draft_tokens_per_pos"], w.draft_tokens_per_pos)
        for gauge, values in gauges[group].items():
            value = getattr(w, gauge)
            if value is not None:
                values.append(value)
        for name in ("e2e", "ttft", "itl"):
            count = getattr(w, f"{name}_count")
            if count is None:
                continue
            b[f"{name}_count"] = (b[f"{name}_count"] or 0.0) + count
            b[f"{name}_sum_s"] = (b[f"{name}_sum_s"] or 0.0) + getattr(w, f"{name}_sum_s")
            p99 = getattr(w, f"{name}_p99_s")
            if p99 is not None:
                prev = b[f"{name}_p99_max_s"]
                b[f"{name}_p99_max_s"] = p99 if prev is None else max(prev, p99)
    for group, b in buckets.items():
        for gauge, values in gauges[group].items():
            b[f"{gauge}_avg"] = sum(values) / len(values) if values else None
            b[f"{gauge}_max"] = max(values) if values else None
        # K only when every speculating window in the minute agrees on it.
        b["num_spec_tokens"] = next(iter(ks[group])) if len(ks[group]) == 1 else None
        if b["draft_tokens_per_pos"] == []:
            b["draft_tokens_per_pos"] = None
    return buckets, n


def _empty_bucket(engine_id: int, config_id: int | None, bucket: datetime) -> dict[str, Any]:
    row: dict[str, Any] = {
        "engine_id": engine_id,
        "config_id": config_id,
        "bucket_start": bucket,
        "windows": 0,
        "duration_s": 0.0,
        "resets": 0,
        "num_spec_tokens": None,
        "drafts": 0,
        "draft_tokens": 0,
        "accepted_tokens": 0,
        "accepted_per_pos": [],
        "draft_tokens_per_pos": [],
        "spec_generated_tokens": 0,
        "generation_tokens": 0.0,
        "prompt_tokens": 0.0,
    }
    for name in ("e2e", "ttft", "itl"):
        row[f"{name}_count"] = None
        row[f"{name}_sum_s"] = None
        row[f"{name}_p99_max_s"] = None
    return row


def _add_into(total: list[int], values: list[int]) -> None:
    if len(values) > len(total):
        total.extend([0] * (len(values) - len(total)))
    for i, v in enumerate(values):
        total[i] += v


def prune(store: Store, policy: RetentionPolicy, now: datetime) -> PruneResult:
    """Delete rows older than their horizon; each table in its own transaction. Idempotent."""
    now = _aware(now)
    deleted: dict[str, int] = {}
    with store.write_transaction() as conn:
        newest_rollup = conn.execute(select(func.max(rollups_t.c.bucket_start))).scalar_one()
        raw_cutoff = floor_minute(now - timedelta(seconds=policy.raw_windows_s))
        # Only minutes already rolled up may lose their raw windows.
        rolled_until = None if newest_rollup is None else newest_rollup + MINUTE
        if rolled_until is not None and rolled_until < raw_cutoff:
            raw_cutoff = rolled_until
        if rolled_until is None:
            deleted["scrape_windows"] = 0
        else:
            deleted["scrape_windows"] = _delete(conn, windows_t, windows_t.c.end_ts, raw_cutoff)
    for name, table, column, horizon_s in (
        ("window_rollups_1m", rollups_t, rollups_t.c.bucket_start, policy.rollups_s),
        ("requests", requests_t, requests_t.c.ts, policy.requests_s),
        ("events", events_t, events_t.c.ts, policy.events_s),
    ):
        with store.write_transaction() as conn:
            deleted[name] = _delete(conn, table, column, now - timedelta(seconds=horizon_s))
    # Steps are indexed by (engine, ts) only, so delete engine by engine to use that index.
    steps_cutoff = now - timedelta(seconds=policy.steps_s)
    deleted["steps"] = 0
    for engine in store.engines():
        with store.write_transaction() as conn:
            deleted["steps"] += int(
                conn.execute(
                    delete(steps_t).where(steps_t.c.engine_id == engine.id, steps_t.c.ts < steps_cutoff)
                ).rowcount
                or 0
            )
    if any(deleted.values()):
        log.info("retention deleted %s", ", ".join(f"{n}={c}" for n, c in deleted.items() if c))
    return PruneResult(deleted)


def _delete(conn: Connection, table: Any, column: Any, cutoff: datetime) -> int:
    return int(conn.execute(delete(table).where(column < cutoff)).rowcount or 0)


def run_retention(store: Store, policy: RetentionPolicy, now: datetime) -> RetentionResult:
    """The scheduled job: roll up, then prune."""
    rollup = rollup_windows(store, now, settle_s=policy.rollup_settle_s, lookback_s=policy.rollup_lookback_s)
    return RetentionResult(rollup=rollup, prune=prune(store, policy, now))
