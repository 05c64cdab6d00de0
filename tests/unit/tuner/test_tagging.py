"""ConfigTaggingSink's remembered config: the same tags as a lookup per batch, invalidated by a config
written through the same store, re-checked after the TTL (a write by another process), and one lookup
for many batches under one config. Real SQLite stores; the sink's monotonic clock is injected."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from collectors.records import EngineKey, StepRecord, WindowRecord
from policies.counters import SpecCounters
from tuner.store import Store
from tuner.store.records import EngineConfigRecord
from tuner.store.schema import upgrade
from tuner.store.tagging import CONFIG_CACHE_TTL_S, ConfigTaggingSink

pytestmark = pytest.mark.unit
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
A = EngineKey(url="http://10.0.0.1:8000/metrics", model_name="llama", engine="0")
B = EngineKey(url="http://10.0.0.1:8000/metrics", model_name="llama", engine="1")


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(url)
    return url


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    with Store(url) as s:
        yield s


class Clock:
    """The sink's monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps(start: datetime, n: int = 8, key: EngineKey = A, every_ms: int = 60) -> list[StepRecord]:
    counters = SpecCounters(drafts=8, draft_tokens=24, accepted_tokens=15, accepted_per_pos=(7, 5, 3),
                            num_spec_tokens=3, draft_tokens_per_pos=(8, 8, 8), generated_tokens=23)
    return [
        StepRecord(ts=start + timedelta(milliseconds=every_ms * i), key=key, batch_size=8, step_time_s=0.021,
                   spec=counters, num_scheduled_tokens=32)
        for i in range(n)
    ]


def config(at: datetime, k: int = 3) -> EngineConfigRecord:
    return EngineConfigRecord(method="eagle", started_at=at, draft_model="d1", num_spec_tokens=k)


def tags_of(sink: ConfigTaggingSink, batch: Sequence[StepRecord]) -> list[int | None]:
    """The config ids the sink stamps on ``batch`` (and writes, as it always does)."""
    written: list[StepRecord] = []
    real = sink.store.write_steps

    def capture(records: Sequence[StepRecord]) -> None:
        written.extend(records)
        real(records)

    sink.store.write_steps = capture  # type: ignore[method-assign]
    try:
        sink.write_steps(batch)
    finally:
        del sink.store.write_steps
    return [r.config_id for r in written]


def uncached(store: Store, batch: Sequence[StepRecord]) -> int | None:
    """What the sink tagged before the cache: the config at the batch's first record's time."""
    found = store.config_at(batch[0].key, batch[0].ts)
    return None if found is None else found.id


def counting(store: Store, name: str) -> list[int]:
    """Count calls of one of ``store``'s methods (our own seam), passing them through."""
    calls = [0]
    real: Callable[..., Any] = getattr(store, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(store, name, wrapper)
    return calls


def test_tags_equal_the_uncached_answer_across_a_config_change_written_through_the_store(store: Store) -> None:
    first = store.record_config(A, config(T0))
    clock = Clock()  # never moves: only the store's generation can make the sink see the change
    sink = ConfigTaggingSink(store, clock=clock)
    got, want = [], []
    second = None
    for i in range(12):
        batch = steps(T0 + timedelta(seconds=1 + 0.5 * i))
        if i == 6:  # the controller applies a new config between two batches
            second = store.record_config(A, config(batch[0].ts - timedelta(milliseconds=10), k=5))
        got.append(tags_of(sink, batch))
        want.append([uncached(store, batch)] * len(batch))
    assert got == want
    assert {t for tags in got for t in tags} == {first, second}


def test_a_record_before_the_remembered_configs_start_gets_the_older_config(store: Store) -> None:
    t1 = T0 + timedelta(minutes=10)
    first = store.record_config(A, config(T0))
    second = store.record_config(A, config(t1, k=5))
    sink = ConfigTaggingSink(store, clock=Clock())
    assert tags_of(sink, steps(t1 + timedelta(seconds=1), n=2)) == [second] * 2  # remembered from t1 on
    assert tags_of(sink, steps(t1 - timedelta(seconds=30), n=2)) == [first] * 2
    assert tags_of(sink, steps(T0 - timedelta(seconds=30), n=2)) == [None] * 2  # before any config
    assert tags_of(sink, steps(t1 + timedelta(seconds=2), n=2)) == [second] * 2
    windows = [
        WindowRecord(key=A, start=t1 - timedelta(seconds=5), end=t1, spec=SpecCounters(drafts=1, draft_tokens=3,
                     accepted_tokens=1, accepted_per_pos=(1, 0, 0), num_spec_tokens=3, generated_tokens=2),
                     generation_tokens=2.0, prompt_tokens=1.0, requests_running=1.0, requests_waiting=0.0,
                     kv_cache_usage=0.1, e2e_latency=None, ttft=None, itl=None)
    ]
    sink.write_windows(windows)  # a window starting before the remembered config: the older one
    (stored,) = store.windows(A, t1 - timedelta(seconds=1), t1 + timedelta(seconds=1))
    assert stored.config_id == first


def test_a_config_written_by_another_store_is_seen_after_the_ttl(url: str, store: Store) -> None:
    first = store.record_config(A, config(T0))
    clock = Clock()
    sink = ConfigTaggingSink(store, clock=clock)
    assert tags_of(sink, steps(T0 + timedelta(seconds=1))) == [first] * 8
    t1 = T0 + timedelta(seconds=2)
    with Store(url) as other:  # another process on the same database: no generation to bump
        second = other.record_config(A, config(t1, k=5))
    clock.now += CONFIG_CACHE_TTL_S / 2
    # within the TTL the write is not seen: the documented bound on a change made elsewhere
    assert tags_of(sink, steps(t1 + timedelta(seconds=1))) == [first] * 8
    clock.now += CONFIG_CACHE_TTL_S / 2
    assert tags_of(sink, steps(t1 + timedelta(seconds=2))) == [second] * 8
    assert tags_of(sink, steps(t1 - timedelta(milliseconds=500), n=2)) == [first] * 2


def test_one_lookup_serves_many_batches_under_one_config(store: Store) -> None:
    store.record_config(A, config(T0))
    clock = Clock()
    sink = ConfigTaggingSink(store, clock=clock)
    config_at, configs = counting(store, "config_at"), counting(store, "configs")
    for i in range(4):  # 2 s of the step writer's 0.5 s batches, within the TTL
        sink.write_steps(steps(T0 + timedelta(seconds=1 + 0.5 * i), n=64))
        clock.now += 0.5
    assert (config_at[0], configs[0]) == (1, 1)  # the lookup and the check that it holds from its start
    for i in range(4, 200):  # past the TTL: one query re-checks the remembered config
        sink.write_steps(steps(T0 + timedelta(seconds=1 + 0.5 * i), n=64))
        clock.now += 0.5
    assert (config_at[0], configs[0]) == (1, 50)
    plain = ConfigTaggingSink(store, cache_ttl_s=0)  # the uncached path, as before
    for i in range(10):
        plain.write_steps(steps(T0 + timedelta(seconds=200 + 0.5 * i), n=64))
    assert (config_at[0], configs[0]) == (11, 50)


def test_each_series_is_looked_up_on_its_own_and_tagged_records_are_left_alone(store: Store) -> None:
    first = store.record_config(A, config(T0))
    store.upsert_engine(B, seen_at=T0)  # an engine with no config yet
    sink = ConfigTaggingSink(store, clock=Clock())
    batch = steps(T0 + timedelta(seconds=1), n=2) + steps(T0 + timedelta(seconds=1), n=2, key=B)
    assert tags_of(sink, batch) == [first, first, None, None]
    second = store.record_config(A, config(T0 + timedelta(seconds=2), k=5))
    pre_tagged = [replace(r, config_id=first) for r in steps(T0 + timedelta(seconds=3), n=2)]
    assert tags_of(sink, pre_tagged + steps(T0 + timedelta(seconds=3), n=1)) == [first, first, second]
    third = store.record_config(B, config(T0 + timedelta(seconds=4)))
    assert tags_of(sink, steps(T0 + timedelta(seconds=5), n=1, key=B)) == [third]


def test_a_backdated_config_is_not_remembered_past_a_later_one(store: Store) -> None:
    # The wall clock stepped back between two applies: the later-recorded config starts first, so
    # both stay open and config_at answers the earlier start only until the later one begins.
    t1 = T0 + timedelta(minutes=10)
    later = store.record_config(A, config(t1))
    earlier = store.record_config(A, config(T0, k=5))
    sink = ConfigTaggingSink(store, clock=Clock())
    for start in (T0 + timedelta(seconds=1), t1 + timedelta(seconds=1), T0 + timedelta(seconds=2)):
        batch = steps(start, n=2)
        assert tags_of(sink, batch) == [uncached(store, batch)] * 2
    assert uncached(store, steps(T0 + timedelta(seconds=1))) == earlier
    assert uncached(store, steps(t1 + timedelta(seconds=1))) == later
