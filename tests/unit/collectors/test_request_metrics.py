"""Reading vLLM completion responses (JSON and SSE) into RequestRecords."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from collectors.request_metrics import (
    ResponseContext,
    ResponseNotUsable,
    StreamTail,
    record_from_json_body,
    record_from_payload,
)

CTX = ResponseContext(
    ts=datetime(2026, 12, 1, tzinfo=UTC),
    latency_s=0.25,
    upstream_url="http://127.0.0.1:8000",
    status_code=200,
    streamed=False,
    request_id_header="hdr-1",
)
SPEC: dict[str, Any] = {
    "mean_acceptance_length": 2.5,
    "draft_acceptance_rate": 0.5,
    "acceptance_histogram": [1, 1, 1, 1],  # 4 steps accepting 0, 1, 2, 3
    "num_spec_steps": 4,
    "num_accepted_draft_tokens": 6,
    "num_draft_tokens": 12,
    "num_spec_tokens": 3,
}


def completion(spec: dict[str, Any] | None = SPEC, usage: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "cmpl-42",
        "object": "text_completion",
        "model": "target",
        "choices": [{"index": 0, "text": "one two three", "finish_reason": "length"}],
    }
    if usage:
        body["usage"] = {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17}
    if spec is not None:
        body["metrics"] = {"time_to_first_token_ms": 12.0, "speculative_decoding": spec}
    return body


def test_json_body_with_usage_and_spec_metrics() -> None:
    rec = record_from_json_body(json.dumps(completion()).encode(), CTX)
    assert (rec.request_id, rec.model_name, rec.prompt_tokens, rec.output_tokens) == (
        "cmpl-42",
        "target",
        7,
        10,
    )
    assert (rec.num_spec_tokens, rec.num_spec_steps, rec.num_draft_tokens, rec.num_accepted_draft_tokens) == (
        3,
        4,
        12,
        6,
    )
    assert rec.acceptance_histogram == (1, 1, 1, 1)
    assert rec.mean_acceptance_length == 2.5 and rec.draft_acceptance_rate == pytest.approx(6 / 12)
    assert rec.per_step_accepted is None and rec.per_step_drafted is None
    assert (rec.latency_s, rec.upstream_url, rec.status_code, rec.streamed) == (
        0.25,
        CTX.upstream_url,
        200,
        False,
    )


def test_detailed_level_keeps_per_step_arrays() -> None:
    spec = {**SPEC, "per_step_accepted": [0, 1, 2, 3], "per_step_drafted": [3, 3, 3, 3]}
    rec = record_from_payload(completion(spec), CTX)
    assert rec.per_step_accepted == (0, 1, 2, 3) and rec.per_step_drafted == (3, 3, 3, 3)


def test_no_speculation_still_records_tokens_and_latency() -> None:
    rec = record_from_payload(completion(spec=None), CTX)
    assert rec.num_spec_tokens is None and rec.num_spec_steps == 0 and rec.acceptance_histogram == ()
    assert rec.prompt_tokens == 7


def test_missing_id_falls_back_to_the_request_header() -> None:
    body = completion()
    del body["id"]
    assert record_from_payload(body, CTX).request_id == "hdr-1"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "bad_json"),
        (b"[1, 2]", "bad_json"),
        (json.dumps(completion(spec=None, usage=False)).encode(), "no_usage"),
        (json.dumps(completion({**SPEC, "num_spec_steps": 5})).encode(), "inconsistent_metrics"),
        (json.dumps(completion({**SPEC, "num_draft_tokens": -1})).encode(), "bad_metrics"),
        (json.dumps(completion({**SPEC, "acceptance_histogram": "1,1"})).encode(), "bad_metrics"),
        (json.dumps(completion({**SPEC, "num_draft_tokens": 1.5})).encode(), "bad_metrics"),
        (json.dumps(completion({**SPEC, "mean_acceptance_length": "2"})).encode(), "bad_metrics"),
    ],
)
def test_unusable_bodies_say_why(body: bytes, reason: str) -> None:
    with pytest.raises(ResponseNotUsable) as info:
        record_from_json_body(body, CTX)
    assert info.value.reason == reason


def sse(*payloads: dict[str, Any] | str) -> list[bytes]:
    out = []
    for p in payloads:
        data = p if isinstance(p, str) else json.dumps(p)
        out.append(f"data: {data}\n\n".encode())
    return out


def chunk(text: str) -> dict[str, Any]:
    return {
        "id": "cmpl-42",
        "object": "text_completion",
        "model": "target",
        "choices": [{"index": 0, "text": text}],
    }


def final_chunk() -> dict[str, Any]:
    body = completion()
    body["choices"] = []
    return body


def test_stream_reads_the_final_usage_chunk_whatever_the_chunking() -> None:
    events = b"".join(sse(chunk("one"), chunk(" two"), final_chunk(), "[DONE]"))
    for size in (1, 7, 64, len(events)):
        tail = StreamTail()
        for i in range(0, len(events), size):
            tail.feed(events[i : i + size])
        rec = tail.record(CTX)
        assert rec.num_accepted_draft_tokens == 6 and rec.output_tokens == 10
        assert tail.total_bytes == len(events)


def test_stream_with_crlf_event_separators() -> None:
    events = b"".join(sse(chunk("one"), final_chunk(), "[DONE]")).replace(b"\n", b"\r\n")
    tail = StreamTail()
    tail.feed(events)
    assert tail.record(CTX).num_spec_steps == 4


def test_long_stream_keeps_only_a_bounded_tail_and_still_finds_the_metrics() -> None:
    tail = StreamTail(max_tail_bytes=4096)
    for i in range(5000):
        tail.feed(sse(chunk(f"token {i}"))[0])
    for part in sse(final_chunk(), "[DONE]"):
        tail.feed(part)
    assert len(tail._buf) <= 2 * 4096 + 2000
    assert tail.record(CTX).prompt_tokens == 7


def test_stream_without_usage_says_how_to_get_it() -> None:
    tail = StreamTail()
    for part in sse(chunk("one"), "[DONE]"):
        tail.feed(part)
    with pytest.raises(ResponseNotUsable, match="include_usage"):
        tail.record(CTX)
