"""Downsampling and retention on SQLite and PostgreSQL: rollups sum exactly, runs are idempotent,
late windows are caught, and pruning never loses a window that was not rolled up."""

from __future__ import annotations

from datetime import timedelta

import pytest

from collectors.records import EventRecord, LatencySummary
from policies.counters import SpecCounters
from tests.integration.store_factories import T0, A, B, count, request, spec, step, window
from tuner.store import (
    DecisionRecord,
    EngineConfigRecord,
    RetentionPolicy,
    Store,
    prune,
    rollup_windows,
    run_retention,
)
from tuner.store.store import rollups_t, windows_t

MIN = timedelta(minutes=1)


def _sum(specs: list[SpecCounters]) -> SpecCounters:
    total = specs[0]
    for s in specs[1:]:
        total = total + s
    return total


def test_rollups_sum_windows_per_engine_config_and_minute(store: Store) -> None:
    c1 = store.record_config(A, EngineConfigRecord(method="eagle", started_at=T0, num_spec_tokens=3))
    c2 = store.record_config(
        A, EngineConfigRecord(method="eagle", started_at=T0 + 90 * timedelta(seconds=1), num_spec_tokens=3)
    )
    # 36 five-second windows = 3 minutes; the config changes at 90 s, mid-minute.
    a_windows = [
        window(
            i,
            config_id=c1 if 5 * i + 5 <= 90 else c2,
            reset=i == 20,
            requests_running=float(i % 4),
            itl=LatencySummary(count=10, sum_s=0.5, p99_s=0.01 * i),
        )
        for i in range(36)
    ]
    b_windows = [window(i, key=B, spec=None) for i in range(36)]
    store.write_windows(a_windows + b_windows)

    result = rollup_windows(store, T0 + 5 * MIN, settle_s=60)
    assert result.windows_read == 72
    rollups = store.rollups(A)
    # minute 0 (ends 5..55 s): c1; minute 1 (60..115 s): c1 up to 90 s, then c2; minute 2: c2;
    # minute 3 holds only the window ending at exactly 180 s.
    assert [(r.bucket_start, r.config_id) for r in rollups] == [
        (T0, c1),
        (T0 + MIN, c1),
        (T0 + MIN, c2),
        (T0 + 2 * MIN, c2),
        (T0 + 3 * MIN, c2),
    ]
    for r in rollups:
        members = [
            w for w in a_windows if r.bucket_start <= w.end < r.bucket_start + MIN and w.config_id == r.config_id
        ]
        assert r.windows == len(members)
        expected = _sum([w.spec for w in members if w.spec is not None])
        assert r.spec.drafts == expected.drafts
        assert r.spec.draft_tokens == expected.draft_tokens
        assert r.spec.accepted_tokens == expected.accepted_tokens
        assert r.spec.accepted_per_pos == expected.accepted_per_pos
        assert r.spec.num_spec_tokens == 3
        assert r.generation_tokens == sum(w.generation_tokens for w in members)
        assert r.duration_s == pytest.approx(5.0 * len(members))
        assert r.resets == sum(w.reset for w in members)
        running = [w.requests_running for w in members if w.requests_running is not None]
        assert r.requests_running.avg == pytest.approx(sum(running) / len(running))
        assert r.requests_running.max == max(running)
        assert r.itl is not None and r.itl.count == 10 * len(members)
        assert r.itl.p99_max_s == pytest.approx(max(w.itl.p99_s for w in members if w.itl and w.itl.p99_s))
        assert r.ttft is not None and r.ttft.sum_s == pytest.approx(0.2 * len(members))
    # Summing the rollups gives the raw totals exactly.
    assert sum(r.spec.accepted_tokens for r in rollups) == store.window_totals(A).spec.accepted_tokens
    b = store.rollups(B)
    assert [r.windows for r in b] == [11, 12, 12, 1]
    assert all(r.spec.drafts == 0 and r.spec.num_spec_tokens is None for r in b)


def test_rollup_is_idempotent_waits_for_settled_minutes_and_catches_late_windows(store: Store) -> None:
    store.write_windows([window(i) for i in range(24)])  # ends 5..120 s
    now = T0 + 2 * MIN + timedelta(seconds=30)
    first = rollup_windows(store, now, settle_s=60)
    # Only minute 0 is settled (minute 1 ends at 120 s, less than 60 s before now).
    assert first.until == T0 + MIN and first.buckets_written == 1
    snapshot = store.rollups(A)
    again = rollup_windows(store, now, settle_s=60)
    assert store.rollups(A) == snapshot and again.buckets_written == 1
    assert count(store, rollups_t) == 1
    later = T0 + 4 * MIN
    rollup_windows(store, later, settle_s=60)
    assert [r.bucket_start for r in store.rollups(A)] == [T0, T0 + MIN, T0 + 2 * MIN]
    # A window for minute 1 written late (a collector that was catching up) is picked up next run.
    late = window(0, start=T0 + MIN + timedelta(seconds=1), end=T0 + MIN + timedelta(seconds=2))
    store.write_windows([late])
    rollup_windows(store, later + MIN, settle_s=60, lookback_s=600)
    minute1 = next(r for r in store.rollups(A) if r.bucket_start == T0 + MIN)
    assert minute1.windows == 13
    assert sum(r.windows for r in store.rollups(A)) == 25


def test_two_sidecars_on_one_postgresql_do_not_roll_up_the_same_minutes_at_once(store: Store) -> None:
    """Sidecars sharing a PostgreSQL each run retention; while one rolls up (holding the advisory lock) the
    other's run is skipped, not a unique-key collision on the bucket. SQLite serialises writers itself."""
    from sqlalchemy import text

    from tuner.store.retention import ROLLUP_LOCK_KEY

    store.write_windows([window(i) for i in range(24)])
    now = T0 + 2 * MIN + timedelta(seconds=30)
    if store.dialect != "postgresql":
        assert not rollup_windows(store, now, settle_s=60).skipped
        return
    with Store(store.url) as other, other.write_transaction() as conn:  # another sidecar, mid-rollup
        assert conn.execute(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": ROLLUP_LOCK_KEY}).scalar_one()
        busy = rollup_windows(store, now, settle_s=60)
        assert busy.skipped and busy.buckets_written == 0 and count(store, rollups_t) == 0
    done = rollup_windows(store, now, settle_s=60)  # the lock went with the other's transaction
    assert not done.skipped and done.buckets_written == 1


def test_prune_deletes_by_horizon_and_only_rolled_up_windows(store: Store) -> None:
    policy = RetentionPolicy(
        raw_windows_s=3600,
        rollups_s=7200,
        requests_s=1800,
        steps_s=600,
        events_s=900,
        rollup_settle_s=60,
        rollup_lookback_s=600,
    )
    store.write_windows([window(12 * m) for m in range(240)])  # one window a minute for 4 hours
    store.write_steps([step(3000 * m) for m in range(240)])  # one step a minute (20 ms * 3000)
    store.write_requests([request(6000 * m) for m in range(240)])  # one request a minute
    store.write_events([EventRecord(ts=T0 + m * MIN, kind="tick", message="") for m in range(240)])
    decision_id = store.record_decision(
        DecisionRecord(created_at=T0, action="keep", reason="r", message="m", inputs={})
    )
    now = T0 + 240 * MIN

    # Nothing rolled up yet: raw windows must survive a prune however old they are.
    first = prune(store, policy, now).deleted
    assert first["scrape_windows"] == 0
    assert count(store, windows_t) == 240
    # Steps older than 10 min, requests older than 30 min, events older than 15 min go.
    assert (first["steps"], first["requests"], first["events"]) == (230, 210, 225)

    deleted = run_retention(store, policy, now).prune.deleted
    assert deleted["scrape_windows"] == 180  # minutes 0..179 are older than 1 h
    assert deleted["window_rollups_1m"] == 120  # rollups of minutes 0..119 are older than 2 h
    assert count(store, windows_t) == 60
    assert min(w.end for w in store.windows(A)) >= now - timedelta(seconds=3600)
    assert min(r.bucket_start for r in store.rollups(A)) == now - timedelta(seconds=7200)
    assert store.decision(decision_id).decision.action == "keep"  # the audit log is kept

    # Idempotent: a second run deletes nothing and rewrites the same rollups.
    before = store.rollups(A)
    again = run_retention(store, policy, now)
    assert sum(again.prune.deleted.values()) == 0
    assert store.rollups(A) == before


def test_rollups_keep_the_totals_after_raw_windows_are_gone(store: Store) -> None:
    policy = RetentionPolicy(raw_windows_s=900, rollups_s=86_400, rollup_settle_s=60, rollup_lookback_s=120)
    windows = [window(i, spec=spec(10 + i, per_pos=(i % 7, 2, 1))) for i in range(360)]
    store.write_windows(windows)  # 30 minutes
    raw = store.window_totals(A)
    run_retention(store, policy, T0 + 60 * MIN)
    assert count(store, windows_t) == 0
    rolled = store.rollups(A)
    assert sum(r.spec.drafts for r in rolled) == raw.spec.drafts
    assert tuple(map(sum, zip(*(r.spec.accepted_per_pos for r in rolled), strict=True))) == raw.spec.accepted_per_pos


def test_retention_policy_refuses_unsafe_horizons() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        RetentionPolicy(steps_s=0)
    with pytest.raises(ValueError, match="deleted before they are rolled up"):
        RetentionPolicy(raw_windows_s=300, rollup_lookback_s=600)
    with pytest.raises(ValueError, match="rollups are the long-term copy"):
        RetentionPolicy(raw_windows_s=7200, rollups_s=3600)
    with pytest.raises(ValueError, match="cannot be negative"):
        RetentionPolicy(rollup_settle_s=-1)
