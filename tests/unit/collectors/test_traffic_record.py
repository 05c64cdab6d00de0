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
    StreamCopy,
    TrafficRecorder,
    TrafficSample,
    merge_sse_stream,
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


def _sse(*events: object, sep: bytes = b"\n\n") -> bytes:
    """A server-sent event stream as vLLM writes it: ``data: <json>`` events, then ``data: [DONE]``."""
    return b"".join(b"data: " + json.dumps(e).encode() + sep for e in events) + b"data: [DONE]" + sep


def _chunk(text: str, ids: list[int] | None = None, index: int = 0, **extra: object) -> dict[str, object]:
    choice: dict[str, object] = {"index": index, "text": text, "token_ids": ids, **extra}
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]}


def test_a_streamed_completion_gives_the_sample_its_non_streamed_answer_gives() -> None:
    # vLLM with return_token_ids: the prompt's IDs on the first chunk, each chunk its delta's IDs
    stream = _sse(_chunk("four", [7], prompt_token_ids=[5, 6]), _chunk(" five", [8, 9]),
                  _chunk("", [], finish_reason="length"), {"id": "cmpl-1", "choices": [], "usage": {}})
    whole = _resp("four five", prompt_token_ids=[5, 6], token_ids=[7, 8, 9])
    streamed = sample_from_exchange(T0, _req(stream=True), stream, _words, sse=True)
    assert streamed == sample_from_exchange(T0, _req(stream=True), whole, _words)
    assert (streamed.prompt_ids, streamed.output_ids, streamed.ids_source) == ((5, 6), (7, 8, 9), "response")
    # without IDs the joined text is tokenised, as for a non-streamed answer; CRLF separators are SSE too
    plain = _sse(_chunk("four"), _chunk(" five"), sep=b"\r\n\r\n")
    assert sample_from_exchange(T0, _req(), plain, _words, sse=True) == sample_from_exchange(
        T0, _req(), _resp("four five"), _words)


def test_a_streamed_chat_joins_the_deltas_and_reads_the_prompt_ids_of_the_first_chunk() -> None:
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "return_token_ids": True, "top_k": 1}).encode()
    first = {"id": "chat-1", "model": "m", "prompt_token_ids": [1, 2, 3],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    rest = [{"id": "chat-1", "model": "m", "choices": [{"index": 0, "delta": {"content": t}, "token_ids": ids}]}
            for t, ids in (("a", [10]), ("b c", [11, 12]))]
    other = {"id": "chat-1", "choices": [{"index": 1, "delta": {"content": "x"}, "token_ids": [99]}]}  # n = 2
    s = sample_from_exchange(T0, chat, _sse(first, rest[0], other, rest[1]), None, sse=True)
    assert (s.prompt_ids, s.output_ids, s.endpoint, s.greedy, s.request_id) == (
        (1, 2, 3), (10, 11, 12), "chat", True, "chat-1")


def test_output_ids_missing_from_one_chunk_fall_back_to_the_text() -> None:
    stream = _sse(_chunk("four", [7], prompt_token_ids=[5, 6]), _chunk(" five"))  # the second chunk has none
    merged = merge_sse_stream(stream)
    assert merged["choices"][0]["token_ids"] is None and merged["choices"][0]["text"] == "four five"
    s = sample_from_exchange(T0, _req(), stream, _words, sse=True)
    assert (s.prompt_ids, s.output_ids, s.ids_source) == ((5, 6), (104, 104), "tokenized")


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (b"data: {not json\n\n", "bad_json"),
        (_sse(_chunk("a"), {"error": {"message": "engine died", "code": 500}}), "stream_error"),
        (b"data: [DONE]\n\n", "no_choices"),
        (b": keep-alive\n\n", "no_choices"),
        (_sse({"id": "x", "choices": [], "usage": {}}), "no_choices"),
        (_sse(_chunk("", [])), "empty_output"),
    ],
)
def test_a_stream_that_cannot_be_recorded_says_why(stream: bytes, reason: str) -> None:
    with pytest.raises(NotRecordable) as info:
        sample_from_exchange(T0, _req(stream=True), stream, _words, sse=True)
    assert info.value.reason == reason


def test_a_stream_copy_is_bounded() -> None:
    copy = StreamCopy(limit_bytes=10)
    copy.feed(b"12345")
    copy.feed(b"6789")
    assert copy.body() == b"123456789" and not copy.overflowed
    copy.feed(b"ab")
    copy.feed(b"c")
    assert copy.overflowed and copy.body() == b""  # dropped whole, never a truncated stream


def test_a_drawn_stream_is_queued_and_parsed_by_the_recorders_thread(tmp_path: Path) -> None:
    rec = TrafficRecorder(SampleStore(RecorderSettings(tmp_path, sample_rate=1.0)), _words)
    assert rec.draw() and rec.stats.seen == 1
    rec.enqueue(_req(stream=True), _sse(_chunk("four"), _chunk(" five")), sse=True)
    rec.skip("incomplete_stream")
    rec.drain()
    assert [s.output_ids for s in rec.store] == [(104, 104)]
    assert rec.stats_dict()["not_recorded"] == {"incomplete_stream": 1}


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
    # the count survives a clean restart
    store.close()
    assert SampleStore(RecorderSettings(tmp_path, max_bytes=16 * 1024)).stats.dropped_for_space == 60 - len(kept)


def _state(directory: Path) -> dict[str, int]:
    return dict(json.loads((directory / "state.json").read_text()))


def test_appends_save_the_counts_at_most_once_per_interval_and_close_saves_the_rest(tmp_path: Path) -> None:
    now = [T0]
    store = SampleStore(RecorderSettings(tmp_path, state_save_interval_s=5.0), clock=lambda: now[0])
    for i in range(50):  # all within the interval: the first append saves, the others wait
        store.append([_sample(i, n=4)])
        now[0] += timedelta(milliseconds=50)
    assert _state(tmp_path)["written"] == 1 and store.stats.written == 50
    now[0] = T0 + timedelta(seconds=5)
    store.append([_sample(50, n=4)])  # the interval has passed: saved again
    assert _state(tmp_path)["written"] == 51
    store.append([_sample(51, n=4)])
    assert _state(tmp_path)["written"] == 51
    now[0] -= timedelta(hours=1)  # a wall clock stepped back saves rather than waiting an hour
    store.append([_sample(52, n=4)])
    assert _state(tmp_path)["written"] == 53
    store.append([_sample(53, n=4)])
    store.close()
    assert _state(tmp_path)["written"] == 54
    assert SampleStore(RecorderSettings(tmp_path)).stats.written == 54


def test_the_recorders_close_saves_the_counts(tmp_path: Path) -> None:
    store = SampleStore(RecorderSettings(tmp_path, sample_rate=1.0), clock=lambda: T0)
    rec = TrafficRecorder(store, _words)
    for _ in range(3):
        rec.observe(_req(), _resp())
        rec.drain()
    assert _state(tmp_path)["written"] == 1  # the fixed clock never lets the interval pass
    rec.close()
    assert _state(tmp_path)["written"] == 3


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
    with pytest.raises(ValueError, match="state_save_interval_s"):
        RecorderSettings(tmp_path, state_save_interval_s=-1)
