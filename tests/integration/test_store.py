"""The store suite: every test runs on SQLite and on a real PostgreSQL (see conftest)."""

from __future__ import annotations

import math
import shutil
import threading
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from collectors.records import EngineKey, EventRecord, LatencySummary, RecordSink
from policies.counters import SpecCounters
from tests.integration.store_factories import T0, A, B, count, request, spec, step, window
from tuner.store import (
    DecisionRecord,
    EngineConfigRecord,
    InvalidRecordError,
    Store,
    UnknownRecordError,
)
from tuner.store.store import engines_t, requests_t, steps_t, windows_t

# --- round trips ----------------------------------------------------------------------------------


def test_the_store_is_the_collectors_record_sink(store: Store) -> None:
    sink: RecordSink = store  # checked by mypy: the seam collectors write through
    sink.write_events([EventRecord(ts=T0, kind="collector_started", message="hello")])
    assert [e.kind for e in store.events()] == ["collector_started"]


def test_windows_round_trip_every_field(store: Store) -> None:
    config_id = store.record_config(A, EngineConfigRecord(method="eagle", started_at=T0, num_spec_tokens=3))
    records = [
        window(0, config_id=config_id),
        window(1, spec=None, e2e_latency=None, ttft=None, requests_running=None, kv_cache_usage=None),
        window(2, reset=True, itl=LatencySummary(count=100, sum_s=1.5)),
        window(3, spec=replace(spec(), draft_tokens_per_pos=(10, 10, 10), num_spec_tokens=None)),
    ]
    store.write_windows(records)
    assert store.windows(A) == records
    assert store.latest_window(A) == records[-1]
    assert store.windows(B) == []
    assert store.latest_window(B) is None


def test_requests_round_trip(store: Store) -> None:
    records = [
        request(0),
        request(
            1,
            num_spec_tokens=None,
            mean_acceptance_length=None,
            draft_acceptance_rate=None,
            per_step_accepted=None,
            per_step_drafted=None,
            acceptance_histogram=(),
        ),
        request(2, request_id="", status_code=500, latency_s=12.5),
    ]
    store.write_requests(records)
    assert store.requests() == records
    assert store.requests(model_name="other") == []


def test_steps_round_trip(store: Store) -> None:
    records = [
        step(0),
        step(1, step_time_s=None, num_scheduled_tokens=None),
        step(
            2,
            spec=replace(step(0).spec, draft_tokens_per_pos=None, num_spec_tokens=None, accepted_per_pos=()),
        ),
        step(3, key=B),
    ]
    store.write_steps(records)
    assert store.steps(A) == records[:3]
    assert store.steps(B) == records[3:]


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_batches_around_the_multi_row_statement_size_round_trip_in_order(store: Store, extra: int) -> None:
    """SQLite inserts whole multi-row statements and then the remainder row by row: every split
    (none left over, some, a batch smaller than one statement) keeps every row and its order."""
    per_request = store._fast_requests.rows_per_statement
    per_step = store._fast_steps.rows_per_statement
    requests = [request(i, request_id=f"r{i}", prompt_tokens=i) for i in range(2 * per_request + extra)]
    steps = [step(i, key=A if i % 3 else B, batch_size=i) for i in range(per_step + extra)]
    store.write_requests(requests)
    store.write_steps(steps)
    store.write_requests(requests[:1])
    assert store.requests() == sorted(requests + requests[:1], key=lambda r: r.ts)
    assert store.steps(A) + store.steps(B) == [s for s in steps if s.key == A] + [s for s in steps if s.key == B]


def test_collector_baselines_round_trip_and_are_replaced_per_engine(store: Store) -> None:
    from collectors.records import EngineSample

    inf = float("inf")
    first = EngineSample(
        key=A,
        ts=T0,
        spec=spec(),
        generation_tokens=1234.0,
        prompt_tokens=99.0,
        requests_running=2.0,
        kv_cache_usage=0.5,
        cache_config={"block_size": "16"},
        histograms={"vllm:e2e_request_latency_seconds": (((0.1, 3.0), (1.0, 7.0), (inf, 9.0)), 9.0, 4.25)},
        created_s=1_765_000_000.25,
    )
    spec_off = EngineSample(key=B, ts=T0, spec=None, generation_tokens=5.0)
    store.write_scrape([], [], [first, spec_off])
    assert {b.key: b for b in store.baselines(A.url)} == {A: first, B: spec_off}
    later = replace(first, ts=T0 + timedelta(seconds=10), generation_tokens=2000.0)
    store.write_scrape([window(0)], [], [later])  # the window and the moved baseline together
    assert {b.key: b for b in store.baselines(A.url)} == {A: later, B: spec_off}
    assert store.baselines("http://elsewhere/metrics") == []
    with pytest.raises(InvalidRecordError, match="baseline 1 of 1"):
        store.write_scrape([window(1)], [], [replace(later, generation_tokens=-1.0)])
    assert len(store.windows(A)) == 1  # the window of the refused call was not written either


def test_events_round_trip(store: Store) -> None:
    records = [
        EventRecord(
            ts=T0,
            kind="counter_reset",
            message="engine 0 restarted",
            severity="warning",
            engine=A,
            data={"before": 120, "after": 4, "labels": ["a", "b"]},
        ),
        EventRecord(
            ts=T0 + timedelta(seconds=1),
            kind="collector_error",
            message="timeout after 5 s",
            severity="critical",
        ),
        EventRecord(ts=T0 + timedelta(seconds=2), kind="scrape_stale", message="", engine=B),
    ]
    store.write_events(records)
    assert store.events() == records
    assert store.events(key=A) == records[:1]
    assert store.events(kind="scrape_stale") == records[2:]


def test_non_utc_times_are_stored_as_the_same_instant_in_utc(store: Store) -> None:
    plus2 = timezone(timedelta(hours=2))
    local = T0.astimezone(plus2)
    store.write_steps([step(0, ts=local)])
    store.write_windows([window(0, start=local, end=local + timedelta(seconds=5))])
    got_step = store.steps(A)[0]
    got_window = store.windows(A)[0]
    assert got_step.ts == T0 and got_step.ts.tzinfo is not None and got_step.ts.utcoffset() == timedelta(0)
    assert got_window.start == T0


def test_integral_floats_from_the_parser_are_stored_as_ints(store: Store) -> None:
    # prometheus_client's parser gives floats; the collector may pass them on unconverted.
    parsed: dict[str, Any] = {
        "drafts": 10.0,
        "draft_tokens": 30.0,
        "accepted_tokens": 18.0,
        "accepted_per_pos": (8.0, 6.0, 4.0),
    }
    counters = SpecCounters(**parsed)
    store.write_windows([window(0, spec=counters)])
    store.write_steps([step(0, spec=counters, batch_size=4.0)])
    got = store.windows(A)[0].spec
    assert got is not None and got.drafts == 10 and type(got.drafts) is int
    assert got.accepted_per_pos == (8, 6, 4)
    assert store.steps(A)[0].spec.accepted_per_pos == (8, 6, 4)
    assert store.steps(A)[0].batch_size == 4


# --- engines --------------------------------------------------------------------------------------


def test_engines_are_upserted_once_and_keep_cache_config(db_url: str) -> None:
    with Store(db_url) as one, Store(db_url) as two:
        first = one.upsert_engine(A, seen_at=T0, cache_config={"block_size": "16"})
        assert two.upsert_engine(A, seen_at=T0 + timedelta(hours=1)) == first
        one.write_windows([window(0)])
        two.write_steps([step(0)])
        engines = two.engines()
    assert [(e.id, e.key) for e in engines] == [(first, A)]
    assert engines[0].cache_config == {"block_size": "16"}
    engine_id, key, cache_config = engines[0]  # unpacks like a tuple too
    assert (engine_id, key, cache_config) == (first, A, {"block_size": "16"})


def test_time_ranges_are_half_open_and_per_engine(store: Store) -> None:
    store.write_windows([window(i) for i in range(10)] + [window(i, key=B) for i in range(10)])
    store.write_steps([step(i) for i in range(10)])
    store.write_requests([request(i) for i in range(10)])
    since, until = T0 + timedelta(seconds=15), T0 + timedelta(seconds=35)
    # windows are placed by their end: ends at 15, 20, 25, 30 are in; 35 is out
    assert [w.end for w in store.windows(A, since, until)] == [T0 + timedelta(seconds=s) for s in (15, 20, 25, 30)]
    assert len(store.windows(B, since, until)) == 4
    assert len(store.windows(A, since=since)) == 8
    assert len(store.windows(A, until=until)) == 6
    assert len(store.windows(A, limit=3)) == 3
    s_since, s_until = T0 + timedelta(milliseconds=40), T0 + timedelta(milliseconds=100)
    assert [s.ts for s in store.steps(A, s_since, s_until)] == [T0 + timedelta(milliseconds=ms) for ms in (40, 60, 80)]
    r_since, r_until = T0 + timedelta(milliseconds=30), T0 + timedelta(milliseconds=50)
    assert [r.request_id for r in store.requests(r_since, r_until)] == ["cmpl-3", "cmpl-4"]


def test_range_bounds_must_be_timezone_aware(store: Store) -> None:
    with pytest.raises(InvalidRecordError, match="timezone-aware"):
        store.windows(A, since=datetime(2026, 1, 1))
    with pytest.raises(InvalidRecordError, match="timezone-aware"):
        store.steps(A, until=datetime(2026, 1, 1))
    with pytest.raises(InvalidRecordError, match="before since"):
        store.requests(since=T0, until=T0 - timedelta(seconds=1))


def test_window_totals_sum_the_range_and_filter_by_config(store: Store) -> None:
    c1 = store.record_config(A, EngineConfigRecord(method="eagle", started_at=T0, num_spec_tokens=3))
    c2 = store.record_config(
        A, EngineConfigRecord(method="eagle", started_at=T0 + timedelta(seconds=25), num_spec_tokens=3)
    )
    records = [window(i, config_id=c1 if i < 5 else c2, reset=i == 7) for i in range(10)]
    records.append(window(10, spec=None))  # speculation off: counts nothing, still a window
    store.write_windows(records)
    totals = store.window_totals(A)
    speculating = [r.spec for r in records if r.spec is not None]
    expected = speculating[0]
    for s in speculating[1:]:
        expected = expected + s
    assert totals.windows == 11
    assert totals.spec.drafts == expected.drafts
    assert totals.spec.accepted_tokens == expected.accepted_tokens
    assert totals.spec.accepted_per_pos == expected.accepted_per_pos
    assert totals.spec.num_spec_tokens == 3
    assert totals.spec.generated_tokens == expected.generated_tokens
    assert totals.generation_tokens == sum(r.generation_tokens for r in records)
    assert totals.duration_s == pytest.approx(55.0)
    assert totals.resets == 1
    assert totals.first_start == T0 and totals.last_end == T0 + timedelta(seconds=55)
    only_c1 = store.window_totals(A, config_id=c1)
    assert only_c1.windows == 5
    assert only_c1.spec.drafts == sum(10 + i for i in range(5))
    ranged = store.window_totals(A, T0 + timedelta(seconds=10), T0 + timedelta(seconds=20))
    assert ranged.windows == 2 and ranged.spec.drafts == 11 + 12
    assert store.window_totals(B).windows == 0


# --- one transaction per call ---------------------------------------------------------------------


def test_a_bad_record_fails_the_batch_before_anything_is_written(store: Store) -> None:
    store.write_windows([window(0)])
    store.write_steps([step(0)])
    store.write_requests([request(0)])
    bad_spec = replace(spec(), drafts=-3)
    with pytest.raises(InvalidRecordError) as info:
        store.write_windows([window(1), window(2, spec=bad_spec), window(3)])
    message = str(info.value)
    assert "window 2 of 3" in message and "spec.drafts is -3" in message and "Nothing in this batch" in message
    with pytest.raises(InvalidRecordError, match=r"step 3 of 3 .*step_time_s is nan"):
        store.write_steps([step(1), step(2), step(3, step_time_s=math.nan)])
    with pytest.raises(InvalidRecordError, match=r"request 2 of 2 .*request 'cmpl-2'.*timezone-aware"):
        store.write_requests([request(1), request(2, ts=datetime(2026, 3, 1, 12))])
    with pytest.raises(InvalidRecordError, match=r"accepted_per_pos\[1\] is 2\.5"):
        store.write_steps([step(4, spec=replace(step(0).spec, accepted_per_pos=(1, 2.5, 3)))])  # type: ignore[arg-type]
    with pytest.raises(InvalidRecordError, match="is a WindowRecord, not a step record"):
        store.write_steps([window(9)])  # type: ignore[list-item]
    with pytest.raises(InvalidRecordError, match="severity"):
        store.write_events([EventRecord(ts=T0, kind="x", message="m", severity="loud")])
    with pytest.raises(InvalidRecordError, match="JSON"):
        store.write_events([EventRecord(ts=T0, kind="x", message="m", data={"v": math.inf})])
    with pytest.raises(InvalidRecordError, match="not after start"):
        store.write_windows([window(5, end=T0)])
    assert len(store.windows(A)) == 1
    assert len(store.steps(A)) == 1
    assert len(store.requests()) == 1
    assert store.events() == []


def test_a_database_error_rolls_back_the_whole_batch(store: Store) -> None:
    store.write_windows([window(0)])
    # Window 1 is new, window 0 again violates (engine, end) uniqueness: neither may land.
    with pytest.raises(IntegrityError):
        store.write_windows([window(1), window(0)])
    assert [w.end for w in store.windows(A)] == [window(0).end]
    # The fast paths too: a config id that does not exist breaks the foreign key on the last row.
    store.write_steps([step(0)])
    store.write_requests([request(0)])
    with pytest.raises(IntegrityError):
        store.write_steps([step(1), step(2), step(3, config_id=999_999)])
    with pytest.raises(IntegrityError):
        store.write_requests([request(1), request(2, config_id=999_999)])
    assert len(store.steps(A)) == 1
    assert len(store.requests()) == 1


def test_a_failed_batch_leaves_no_engine_behind_and_no_stale_id_cached(store: Store) -> None:
    new = EngineKey(url="http://10.0.0.2:8000/metrics", model_name="llama", engine="0")
    with pytest.raises(IntegrityError):
        store.write_steps([step(0, key=new), step(1, key=new, config_id=999_999)])
    assert count(store, engines_t) == 0
    assert store.engine_id(new) is None
    store.write_steps([step(0, key=new)])  # would hit a foreign-key error if a dead id were cached
    assert len(store.steps(new)) == 1


def test_concurrent_writers_all_land(db_url: str) -> None:
    """Collector, tap and plugin are separate writers: none may lose a batch to a lock."""
    errors: list[BaseException] = []

    def writer(worker: int) -> None:
        try:
            with Store(db_url) as own:
                for batch in range(15):
                    base = worker * 10_000 + batch * 100
                    own.write_steps([step(base + i) for i in range(100)])
                    own.write_windows([window(worker * 1000 + batch)])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with Store(db_url) as check:
        assert count(check, steps_t) == 3 * 15 * 100
        assert count(check, windows_t) == 3 * 15


# --- configs and decisions ------------------------------------------------------------------------


def test_configs_open_close_and_answer_what_was_in_force(store: Store) -> None:
    first = store.record_config(
        A,
        EngineConfigRecord(
            method="eagle",
            started_at=T0,
            draft_model="d1",
            num_spec_tokens=3,
            applied_by="startup",
            spec_config={"method": "eagle", "model": "d1"},
        ),
    )
    t1 = T0 + timedelta(minutes=10)
    table = ((1, 4, 5), (5, 16, 3), (17, 256, 0))
    second = store.record_config(
        A,
        EngineConfigRecord(
            method="eagle",
            started_at=t1,
            draft_model="d1",
            num_spec_tokens=5,
            k_table=table,
            applied_by="live",
        ),
    )
    assert store.config(first).config.ended_at == t1
    assert store.current_config(A) == store.config(second)
    assert store.config(second).config.k_table == table
    assert store.config_at(A, T0 + timedelta(minutes=5)) == store.config(first)
    assert store.config_at(A, t1) == store.config(second)
    assert store.config_at(A, T0 - timedelta(seconds=1)) is None
    assert [c.id for c in store.configs(A)] == [first, second]
    store.end_config(second, t1 + timedelta(minutes=1))
    assert store.current_config(A) is None
    with pytest.raises(InvalidRecordError, match="before the config started"):
        store.end_config(second, T0)
    with pytest.raises(UnknownRecordError):
        store.end_config(424242, t1)
    with pytest.raises(InvalidRecordError, match="must start at 5"):
        store.record_config(A, EngineConfigRecord(method="eagle", started_at=t1, k_table=((1, 4, 5), (6, 9, 3))))
    with pytest.raises(InvalidRecordError, match=r"k_table\[0\] starts at 2"):
        store.record_config(A, EngineConfigRecord(method="eagle", started_at=t1, k_table=((2, 4, 5),)))


def test_decisions_record_update_and_query(store: Store) -> None:
    decision = DecisionRecord(
        created_at=T0,
        action="set_k",
        reason="better_k",
        message="K=5 predicts 1.31x over K=3 at batch 1-4",
        inputs={"alpha": 0.81, "alpha_ci": [0.78, 0.84], "drafts": 12000},
        mode="auto",
        engine=A,
        proposed_config={"num_speculative_tokens": 5},
        predicted_gain=0.31,
    )
    first = store.record_decision(decision)
    second = store.record_decision(
        replace(
            decision,
            created_at=T0 + timedelta(minutes=1),
            engine=None,
            action="keep",
            reason="insufficient_evidence",
            predicted_gain=None,
        )
    )
    store.update_decision(first, status="applied", at=T0 + timedelta(seconds=30))
    store.update_decision(
        first,
        status="verified",
        at=T0 + timedelta(minutes=5),
        realized_gain=-0.02,
        status_message="regressed: rolled back",
    )
    got = store.decision(first)
    assert got.decision == replace(decision, status="verified")
    assert got.status == "verified" and got.realized_gain == pytest.approx(-0.02)
    assert got.status_message == "regressed: rolled back" and got.updated_at == T0 + timedelta(minutes=5)
    store.update_decision(first, status="rolled_back", at=T0 + timedelta(minutes=6))
    assert store.decision(first).realized_gain == pytest.approx(-0.02)  # kept when not given
    assert [d.id for d in store.decisions()] == [first, second]
    assert [d.id for d in store.decisions(newest_first=True, limit=1)] == [second]
    assert [d.id for d in store.decisions(key=A)] == [first]
    assert [d.id for d in store.decisions(status="rolled_back")] == [first]
    assert [d.id for d in store.decisions(since=T0 + timedelta(seconds=1))] == [second]
    with pytest.raises(UnknownRecordError):
        store.update_decision(999, status="applied", at=T0)
    with pytest.raises(InvalidRecordError, match="predicted_gain"):
        store.record_decision(replace(decision, predicted_gain=math.nan))
    with pytest.raises(InvalidRecordError, match="JSON"):
        store.record_decision(replace(decision, inputs={"x": object()}))


def test_sqlite_runs_in_wal_with_foreign_keys_and_a_busy_timeout(tmp_path: Path, sqlite_template: Path) -> None:
    path = tmp_path / "s.db"
    shutil.copyfile(sqlite_template, path)
    with Store(f"sqlite:///{path}") as store, store.read_connection() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar_one() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar_one() >= 1000


def test_ids_and_rows_survive_reopening(db_url: str) -> None:
    with Store(db_url) as first:
        first.write_windows([window(0)])
        first.write_requests([request(0)])
    with Store(db_url) as second:
        assert second.windows(A) == [window(0)]
        second.write_windows([window(1)])
        assert count(second, engines_t) == 1
        assert count(second, requests_t) == 1
