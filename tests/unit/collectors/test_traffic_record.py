"""The sampled traffic record: parsing an exchange, the size cap (oldest dropped, counted), retention,
forgetting, and the recorder's bounded queue."""

from __future__ import annotations

import json
import os
import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from collectors.traffic_record import (
    NotRecordable,
    RecorderSettings,
    SampleStore,
    TrafficRecorder,
    TrafficSample,
    sample_from_exchange,
)

pytestmark = pytest.mark.unit
T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def _words(text: str, special: bool) -> list[int]:
    # a tokenizer at our own seam: one id per word, 1 = BOS when special tokens are asked for
    return ([1] if special else []) + [100 + len(w) for w in text.split()]


def _req(**kw: object) -> bytes:
    return json.dumps({"model": "m", "prompt": "one two three", "temperature": 0, **kw}).encode()


def _resp(text: str = "four five", **choice: object) -> bytes:
    return json.dumps({"id": "cmpl-1", "model": "m", "choices": [{"text": text, **choice}]}).encode()


def test_token_ids_from_the_response_win_over_tokenising() -> None:
    s = sample_from_exchange(T0, _req(), _resp(prompt_token_ids=[5, 6], token_ids=[7, 8, 9]), _words)
    assert (s.prompt_ids, s.output_ids, s.ids_source, s.greedy) == ((5, 6), (7, 8, 9), "response", True)


def test_text_is_tokenised_with_the_targets_tokenizer() -> None:
    s = sample_from_exchange(T0, _req(temperature=0.7), _resp("four five"), _words)
    assert s.prompt_ids == (1, 103, 103, 105)
    assert s.output_ids == (104, 104)
    assert s.ids_source == "tokenized" and not s.greedy
    assert TrafficSample.from_json(json.loads(json.dumps(s.to_json()))) == s


@pytest.mark.parametrize(
    ("req", "resp", "reason"),
    [
        (b"{", _resp(), "bad_json"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), _resp(), "chat_without_token_ids"),
        (_req(prompt=["a", "b"]), _resp(), "not_text"),
        (_req(), json.dumps({"choices": []}).encode(), "no_choices"),
        (_req(), _resp(""), "empty_output"),
    ],
)
def test_what_cannot_be_recorded_says_why(req: bytes, resp: bytes, reason: str) -> None:
    with pytest.raises(NotRecordable) as info:
        sample_from_exchange(T0, req, resp, _words)
    assert info.value.reason == reason


def _sample(i: int, n: int = 200) -> TrafficSample:
    return TrafficSample(T0 + timedelta(seconds=i), f"r{i}", "m", tuple(range(n)), tuple(range(n)), True, False,
                         "response", "completions")


def test_a_full_store_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    store = SampleStore(RecorderSettings(tmp_path, max_bytes=16 * 1024))
    for i in range(60):
        store.append([_sample(i)])
    assert store.size_bytes() <= 16 * 1024
    kept = [s.request_id for s in store]
    assert kept == [f"r{i}" for i in range(60 - len(kept), 60)]  # the newest survive, in order
    assert store.stats.written == 60
    assert store.stats.dropped_for_space == 60 - len(kept) > 0
    # the count survives a restart
    assert SampleStore(RecorderSettings(tmp_path, max_bytes=16 * 1024)).stats.dropped_for_space == 60 - len(kept)


def test_retention_deletes_old_segments_and_forget_deletes_all(tmp_path: Path) -> None:
    store = SampleStore(RecorderSettings(tmp_path, max_bytes=16 * 1024, retention_s=3600))
    for i in range(20):
        store.append([_sample(i)])
    old = store.segments()[0]
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    before = sum(1 for _ in store)
    store.sweep()
    assert old not in store.segments()
    assert store.stats.dropped_for_age == before - sum(1 for _ in store) > 0
    remaining = sum(1 for _ in store)
    assert store.forget() == remaining > 0
    assert list(store) == [] and store.stats.written == 0


def test_the_recorder_samples_and_never_waits_on_a_full_queue(tmp_path: Path) -> None:
    store = SampleStore(RecorderSettings(tmp_path, sample_rate=0.5, max_queue=4))
    rec = TrafficRecorder(store, _words, rng=random.Random(1))
    for _ in range(40):
        rec.observe(_req(), _resp())
    assert rec.stats.seen == 40
    assert rec.stats.queued == 4  # the thread is not started: the queue fills, the rest are counted
    assert rec.stats.not_recorded["queue_full"] > 0
    rec.drain()
    assert rec.stats.recorded == 4 and len(list(store)) == 4
    rec.start()
    rec.observe(_req(), _resp())
    rec.observe(b"{", _resp())
    rec.close()
    assert rec.stats_dict()["recorded"] + rec.stats.not_recorded["bad_json"] >= 4


def test_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        RecorderSettings(tmp_path, sample_rate=0)
    with pytest.raises(ValueError, match="max_bytes"):
        RecorderSettings(tmp_path, max_bytes=10)
