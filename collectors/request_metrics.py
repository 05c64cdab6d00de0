"""Read one OpenAI-API response (a JSON body or an SSE stream) into a ``RequestRecord``.

Pure. vLLM puts ``metrics.speculative_decoding`` (with ``--per-request-spec-decode-metrics
summary|detailed``) and ``usage`` on the final JSON body, or — when streaming — on the last chunk,
which it only sends when the client asked for usage (``stream_options.include_usage``) or the
server forces it (``--enable-force-include-usage``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from collectors.records import RequestRecord
from collectors.sse import data_payloads

# What we keep of a long stream: the final chunks are all we read, so a bounded tail is enough.
_STREAM_TAIL_BYTES = 256 * 1024


class ResponseNotUsable(ValueError):
    """The response carries nothing to record (no usage, no metrics) or is not what it claims."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class ResponseContext:
    """What the proxy knows about an exchange besides the body."""

    ts: datetime
    latency_s: float
    upstream_url: str
    status_code: int
    streamed: bool
    request_id_header: str = ""


def record_from_payload(payload: Mapping[str, Any], ctx: ResponseContext) -> RequestRecord:
    """A record from a completion payload (a whole JSON body, or the final SSE chunk).

    Raises ``ResponseNotUsable`` when the payload has neither ``usage`` nor ``metrics``.
    """
    usage = payload.get("usage")
    metrics = payload.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, Mapping) else None
    if not isinstance(usage, Mapping) and not isinstance(spec, Mapping):
        raise ResponseNotUsable("no_usage", "the response has neither usage nor metrics")
    usage = usage if isinstance(usage, Mapping) else {}
    record = RequestRecord(
        ts=ctx.ts,
        request_id=str(payload.get("id") or ctx.request_id_header),
        model_name=str(payload.get("model") or ""),
        prompt_tokens=_int(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        output_tokens=_int(usage.get("completion_tokens"), "usage.completion_tokens"),
        latency_s=ctx.latency_s,
        upstream_url=ctx.upstream_url,
        streamed=ctx.streamed,
        status_code=ctx.status_code,
    )
    if not isinstance(spec, Mapping):
        return record
    histogram = tuple(_int(x, "acceptance_histogram[]") for x in _list(spec.get("acceptance_histogram")))
    steps = _int(spec.get("num_spec_steps"), "num_spec_steps")
    accepted = _int(spec.get("num_accepted_draft_tokens"), "num_accepted_draft_tokens")
    if histogram and (sum(histogram) != steps or sum(j * n for j, n in enumerate(histogram)) != accepted):
        raise ResponseNotUsable(
            "inconsistent_metrics",
            f"acceptance_histogram {list(histogram)} does not match num_spec_steps={steps}, "
            f"num_accepted_draft_tokens={accepted}",
        )
    per_step_accepted = spec.get("per_step_accepted")
    per_step_drafted = spec.get("per_step_drafted")
    k = spec.get("num_spec_tokens")
    return replace(
        record,
        num_spec_tokens=_int(k, "num_spec_tokens") if k is not None else None,
        num_spec_steps=steps,
        num_draft_tokens=_int(spec.get("num_draft_tokens"), "num_draft_tokens"),
        num_accepted_draft_tokens=accepted,
        acceptance_histogram=histogram,
        mean_acceptance_length=_float(spec.get("mean_acceptance_length")),
        draft_acceptance_rate=_float(spec.get("draft_acceptance_rate")),
        per_step_accepted=_ints_or_none(per_step_accepted, "per_step_accepted[]"),
        per_step_drafted=_ints_or_none(per_step_drafted, "per_step_drafted[]"),
    )


def record_from_json_body(body: bytes, ctx: ResponseContext) -> RequestRecord:
    """A record from a whole (non-streamed) JSON response body."""
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise ResponseNotUsable("bad_json", f"response body is not JSON ({exc})") from exc
    if not isinstance(payload, Mapping):
        raise ResponseNotUsable("bad_json", "response body is JSON but not an object")
    return record_from_payload(payload, ctx)


class StreamTail:
    """Keeps the tail of an SSE stream as it passes, then finds the final usage/metrics chunk.

    ``feed`` is cheap (a bytes append, trimmed to a bounded tail) so it can sit on the request
    path; parsing happens once, in ``record``, after the client has its last byte.
    """

    def __init__(self, max_tail_bytes: int = _STREAM_TAIL_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_tail_bytes
        self.total_bytes = 0

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        self.total_bytes += len(chunk)
        if len(self._buf) > 2 * self._max:
            del self._buf[: len(self._buf) - self._max]

    def record(self, ctx: ResponseContext) -> RequestRecord:
        payload = self._last_payload()
        if payload is not None:
            return record_from_payload(payload, ctx)
        raise ResponseNotUsable(
            "no_usage",
            "the stream has no chunk with usage or metrics; ask for them with "
            'stream_options {"include_usage": true} or start vLLM with --enable-force-include-usage',
        )

    def _last_payload(self) -> dict[str, Any] | None:
        """The last ``data:`` event that mentions usage or metrics, parsed."""
        for data in reversed(data_payloads(bytes(self._buf))):
            if b'"usage"' not in data and b'"metrics"' not in data:
                continue
            try:
                payload = json.loads(data)
            except ValueError:
                continue  # the first event of a trimmed tail may be cut; earlier ones are not needed
            if isinstance(payload, dict) and ("usage" in payload or "metrics" in payload):
                return payload
        return None


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ResponseNotUsable("bad_metrics", f"expected a list, got {type(value).__name__}")
    return value


def _ints_or_none(value: Any, name: str) -> tuple[int, ...] | None:
    return None if value is None else tuple(_int(x, name) for x in _list(value))


def _int(value: Any, name: str) -> int:
    if value is None:
        return 0
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or value != int(value)
    ):
        raise ResponseNotUsable("bad_metrics", f"{name} = {value!r} is not a non-negative whole number")
    return int(value)


def _float(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ResponseNotUsable("bad_metrics", f"expected a finite number, got {value!r}")
    return float(value)
