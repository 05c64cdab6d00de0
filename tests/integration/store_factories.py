"""Record factories shared by the store tests: realistic values, one knob per test."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select

from collectors.records import EngineKey, LatencySummary, RequestRecord, StepRecord, WindowRecord
from policies.counters import SpecCounters
from tuner.store import Store

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
A = EngineKey(url="http://10.0.0.1:8000/metrics", model_name="llama", engine="0")
B = EngineKey(url="http://10.0.0.1:8000/metrics", model_name="llama", engine="1")


def spec(drafts: int = 10, k: int = 3, per_pos: tuple[int, ...] = (8, 6, 4)) -> SpecCounters:
    return SpecCounters(
        drafts=drafts,
        draft_tokens=drafts * k,
        accepted_tokens=sum(per_pos),
        accepted_per_pos=per_pos,
        num_spec_tokens=k,
        generated_tokens=drafts + sum(per_pos),
    )


def window(i: int, key: EngineKey = A, **changes: object) -> WindowRecord:
    rec = WindowRecord(
        key=key,
        start=T0 + timedelta(seconds=5 * i),
        end=T0 + timedelta(seconds=5 * i + 5),
        spec=spec(10 + i, per_pos=(8 + i, 6, 4)),
        generation_tokens=100.0 + i,
        prompt_tokens=50.0,
        requests_running=3.0,
        requests_waiting=0.0,
        kv_cache_usage=0.25,
        e2e_latency=LatencySummary(count=4, sum_s=2.0, p50_s=0.4, p90_s=0.7, p99_s=0.9),
        ttft=LatencySummary(count=4, sum_s=0.2, p50_s=0.05, p90_s=0.07, p99_s=0.09),
        itl=None,
    )
    return replace(rec, **changes)  # type: ignore[arg-type]


def request(i: int, **changes: object) -> RequestRecord:
    rec = RequestRecord(
        ts=T0 + timedelta(milliseconds=10 * i),
        request_id=f"cmpl-{i}",
        model_name="llama",
        prompt_tokens=20 + i,
        output_tokens=64,
        latency_s=0.75,
        num_spec_tokens=3,
        num_spec_steps=20,
        num_draft_tokens=60,
        num_accepted_draft_tokens=44,
        acceptance_histogram=(2, 3, 5, 10),
        mean_acceptance_length=3.2,
        draft_acceptance_rate=44 / 60,
        per_step_accepted=(3, 2, 3),
        per_step_drafted=(3, 3, 3),
        upstream_url="http://10.0.0.1:8000",
        streamed=bool(i % 2),
        status_code=200,
    )
    return replace(rec, **changes)  # type: ignore[arg-type]


def step(i: int, key: EngineKey = A, **changes: object) -> StepRecord:
    counters = SpecCounters(
        drafts=8,
        draft_tokens=24,
        accepted_tokens=15,
        accepted_per_pos=(7, 5, 3),
        num_spec_tokens=3,
        draft_tokens_per_pos=(8, 8, 8),
        generated_tokens=23,
    )
    rec = StepRecord(
        ts=T0 + timedelta(milliseconds=20 * i),
        key=key,
        batch_size=8,
        step_time_s=0.021,
        spec=counters,
        num_scheduled_tokens=32,
    )
    return replace(rec, **changes)  # type: ignore[arg-type]


def count(store: Store, table: object) -> int:
    with store.read_connection() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]
