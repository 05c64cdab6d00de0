"""Records ⇄ table rows, validating on the way in.

Validation is per field: counts are non-negative integers (integral floats from the Prometheus
parser are accepted), measurements finite, timestamps timezone-aware. The high-volume tables
(requests, steps) have a faster single-pass encoder in ``tuner.store.ingest`` that falls back on
these checks for anything unusual. Cross-field invariants (accepted ≤ drafted) are not enforced:
/metrics counters are not read atomically, so a window may legitimately break them by a few tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Row

from collectors.records import (
    EngineKey,
    EngineSample,
    EventRecord,
    LatencySummary,
    RequestRecord,
    StepRecord,
    WindowRecord,
)
from policies.counters import SpecCounters
from tuner.store.records import (
    DecisionRecord,
    EngineConfigRecord,
    GaugeSummary,
    LatencyRollup,
    RollupRecord,
    StoredConfig,
    StoredDecision,
)

SEVERITIES = ("info", "warning", "critical")
_LATENCIES = ("e2e", "ttft", "itl")
_LATENCY_ATTRS = {"e2e": "e2e_latency", "ttft": "ttft", "itl": "itl"}


class InvalidRecordError(ValueError):
    """A record the store refuses. The message names the record, the field and the fix; nothing in
    the batch it came in was written."""


class FieldError(Exception):
    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field} {detail}")


# --- field checks -------------------------------------------------------------------------------


def check_count(value: Any, field: str) -> int:
    if type(value) is int:
        if value < 0:
            raise FieldError(field, f"is {value}; counts must be non-negative")
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer() and value >= 0:
        return int(value)
    raise FieldError(field, f"is {value!r}; expected a non-negative integer count")


def check_opt_count(value: Any, field: str) -> int | None:
    return None if value is None else check_count(value, field)


def check_counts(values: Any, field: str) -> list[int]:
    try:
        return [check_count(v, f"{field}[{i}]") for i, v in enumerate(values)]
    except TypeError as exc:
        raise FieldError(field, f"is {values!r}; expected a sequence of counts") from exc


def check_opt_counts(values: Any, field: str) -> list[int] | None:
    return None if values is None else check_counts(values, field)


def check_measure(value: Any, field: str) -> float:
    if type(value) is int and value >= 0:
        return float(value)
    if type(value) is float and math.isfinite(value) and value >= 0.0:
        return value
    raise FieldError(field, f"is {value!r}; expected a finite non-negative number")


def check_opt_measure(value: Any, field: str) -> float | None:
    return None if value is None else check_measure(value, field)


def check_opt_real(value: Any, field: str) -> float | None:
    """A finite number of either sign (a gain may be negative)."""
    if value is None:
        return None
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    raise FieldError(field, f"is {value!r}; expected a finite number")


def check_when(value: Any, field: str) -> datetime:
    if not isinstance(value, datetime):
        raise FieldError(field, f"is {value!r}; expected a datetime")
    if value.tzinfo is None or value.utcoffset() is None:
        raise FieldError(field, "is a naive datetime; pass a timezone-aware UTC time, e.g. datetime.now(UTC)")
    return value


def check_text(value: Any, field: str, max_len: int, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty_ok):
        raise FieldError(field, f"is {value!r}; expected a non-empty string")
    if len(value) > max_len:
        raise FieldError(field, f"is {len(value)} characters long; at most {max_len} are stored")
    return value


def check_json(value: Any, field: str) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FieldError(field, f"cannot be stored as JSON ({exc}); use plain numbers, strings, lists, dicts") from None
    return value


def check_key(key: Any) -> EngineKey:
    if not isinstance(key, EngineKey):
        raise InvalidRecordError(f"expected an EngineKey, got {key!r}")
    try:
        check_text(key.url, "key.url", 2048)
        check_text(key.model_name, "key.model_name", 512)
        check_text(key.engine, "key.engine", 64)
    except FieldError as exc:
        raise InvalidRecordError(f"engine key {key!r}: {exc}") from None
    return key


def describe_record(record: Any) -> str:
    key = getattr(record, "key", None) or getattr(record, "engine", None)
    when = getattr(record, "end", None) or getattr(record, "ts", None) or getattr(record, "created_at", None)
    parts = []
    if isinstance(key, EngineKey):
        parts.append(f"engine {key.url} model {key.model_name} engine {key.engine}")
    if isinstance(record, RequestRecord):
        parts.append(f"request {record.request_id!r}")
    if isinstance(when, datetime):
        parts.append(f"at {when.isoformat()}")
    return ", ".join(parts)


def batch_error(kind: str, index: int, total: int, record: Any, exc: Exception) -> InvalidRecordError:
    """The error for record ``index`` (0-based) of a batch: which record, which field, what to do."""
    if isinstance(exc, FieldError):
        return InvalidRecordError(
            f"{kind} {index + 1} of {total} ({describe_record(record)}): {exc}. "
            "Nothing in this batch was written; fix or drop the record and write the batch again."
        )
    return InvalidRecordError(
        f"{kind} {index + 1} of {total} is a {type(record).__name__}, not a {kind} record ({exc}); "
        "nothing in this batch was written"
    )


def convert_batch(kind: str, records: Sequence[Any], convert: Any, ids: dict[EngineKey, int]) -> list[dict[str, Any]]:
    """Convert every record or raise :class:`InvalidRecordError` for the first bad one."""
    rows = []
    for index, record in enumerate(records):
        try:
            rows.append(convert(record, ids))
        except (FieldError, AttributeError) as exc:
            raise batch_error(kind, index, len(records), record, exc) from None
    return rows


# --- windows ------------------------------------------------------------------------------------


def window_row(rec: WindowRecord, ids: dict[EngineKey, int]) -> dict[str, Any]:
    start = check_when(rec.start, "start")
    end = check_when(rec.end, "end")
    if end <= start:
        raise FieldError("end", f"({end.isoformat()}) is not after start ({start.isoformat()})")
    spec = rec.spec
    row: dict[str, Any] = {
        "engine_id": ids[rec.key],
        "config_id": rec.config_id,
        "start_ts": start,
        "end_ts": end,
        "generation_tokens": check_measure(rec.generation_tokens, "generation_tokens"),
        "prompt_tokens": check_measure(rec.prompt_tokens, "prompt_tokens"),
        "requests_running": check_opt_measure(rec.requests_running, "requests_running"),
        "requests_waiting": check_opt_measure(rec.requests_waiting, "requests_waiting"),
        "kv_cache_usage": check_opt_measure(rec.kv_cache_usage, "kv_cache_usage"),
        "reset": bool(rec.reset),
    }
    row.update(_spec_columns(spec))
    row["spec_generated_tokens"] = row.pop("generated_tokens")
    for name in _LATENCIES:
        summary = getattr(rec, _LATENCY_ATTRS[name])
        if summary is None:
            row.update(
                dict.fromkeys((f"{name}_count", f"{name}_sum_s", f"{name}_p50_s", f"{name}_p90_s", f"{name}_p99_s"))
            )
        else:
            row[f"{name}_count"] = check_measure(summary.count, f"{name}.count")
            row[f"{name}_sum_s"] = check_measure(summary.sum_s, f"{name}.sum_s")
            row[f"{name}_p50_s"] = check_opt_measure(summary.p50_s, f"{name}.p50_s")
            row[f"{name}_p90_s"] = check_opt_measure(summary.p90_s, f"{name}.p90_s")
            row[f"{name}_p99_s"] = check_opt_measure(summary.p99_s, f"{name}.p99_s")
    return row


def _spec_columns(spec: SpecCounters | None) -> dict[str, Any]:
    if spec is None:
        return {
            "spec_enabled": False,
            "num_spec_tokens": None,
            "drafts": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "accepted_per_pos": [],
            "draft_tokens_per_pos": None,
            "generated_tokens": 0,
        }
    return {
        "spec_enabled": True,
        "num_spec_tokens": check_opt_count(spec.num_spec_tokens, "spec.num_spec_tokens"),
        "drafts": check_count(spec.drafts, "spec.drafts"),
        "draft_tokens": check_count(spec.draft_tokens, "spec.draft_tokens"),
        "accepted_tokens": check_count(spec.accepted_tokens, "spec.accepted_tokens"),
        "accepted_per_pos": check_counts(spec.accepted_per_pos, "spec.accepted_per_pos"),
        "draft_tokens_per_pos": check_opt_counts(spec.draft_tokens_per_pos, "spec.draft_tokens_per_pos"),
        "generated_tokens": check_count(spec.generated_tokens, "spec.generated_tokens"),
    }


def _spec_from(row: Any, generated: int) -> SpecCounters:
    return SpecCounters(
        drafts=row.drafts,
        draft_tokens=row.draft_tokens,
        accepted_tokens=row.accepted_tokens,
        accepted_per_pos=tuple(row.accepted_per_pos),
        num_spec_tokens=row.num_spec_tokens,
        draft_tokens_per_pos=None if row.draft_tokens_per_pos is None else tuple(row.draft_tokens_per_pos),
        generated_tokens=generated,
    )


def window_from_row(row: Row[Any], key: EngineKey) -> WindowRecord:
    latencies: dict[str, LatencySummary | None] = {}
    for name in _LATENCIES:
        count = getattr(row, f"{name}_count")
        latencies[_LATENCY_ATTRS[name]] = (
            None
            if count is None
            else LatencySummary(
                count=count,
                sum_s=getattr(row, f"{name}_sum_s"),
                p50_s=getattr(row, f"{name}_p50_s"),
                p90_s=getattr(row, f"{name}_p90_s"),
                p99_s=getattr(row, f"{name}_p99_s"),
            )
        )
    return WindowRecord(
        key=key,
        start=row.start_ts,
        end=row.end_ts,
        spec=_spec_from(row, row.spec_generated_tokens) if row.spec_enabled else None,
        generation_tokens=row.generation_tokens,
        prompt_tokens=row.prompt_tokens,
        requests_running=row.requests_running,
        requests_waiting=row.requests_waiting,
        kv_cache_usage=row.kv_cache_usage,
        reset=row.reset,
        config_id=row.config_id,
        **latencies,
    )


def rollup_from_row(row: Row[Any], key: EngineKey) -> RollupRecord:
    latencies: dict[str, LatencyRollup | None] = {}
    for name in _LATENCIES:
        count = getattr(row, f"{name}_count")
        latencies[_LATENCY_ATTRS[name]] = (
            None
            if count is None
            else LatencyRollup(
                count=count, sum_s=getattr(row, f"{name}_sum_s"), p99_max_s=getattr(row, f"{name}_p99_max_s")
            )
        )
    return RollupRecord(
        key=key,
        bucket_start=row.bucket_start,
        config_id=row.config_id,
        windows=row.windows,
        duration_s=row.duration_s,
        resets=row.resets,
        spec=_spec_from(row, row.spec_generated_tokens),
        generation_tokens=row.generation_tokens,
        prompt_tokens=row.prompt_tokens,
        requests_running=GaugeSummary(row.requests_running_avg, row.requests_running_max),
        requests_waiting=GaugeSummary(row.requests_waiting_avg, row.requests_waiting_max),
        kv_cache_usage=GaugeSummary(row.kv_cache_usage_avg, row.kv_cache_usage_max),
        **latencies,
    )


# --- requests -----------------------------------------------------------------------------------


def request_from_row(row: Row[Any]) -> RequestRecord:
    return RequestRecord(
        ts=row.ts,
        request_id=row.request_id,
        model_name=row.model_name,
        prompt_tokens=row.prompt_tokens,
        output_tokens=row.output_tokens,
        latency_s=row.latency_s,
        num_spec_tokens=row.num_spec_tokens,
        num_spec_steps=row.drafts,
        num_draft_tokens=row.draft_tokens,
        num_accepted_draft_tokens=row.accepted_tokens,
        acceptance_histogram=tuple(row.acceptance_histogram),
        mean_acceptance_length=row.mean_acceptance_length,
        draft_acceptance_rate=row.draft_acceptance_rate,
        per_step_accepted=None if row.per_step_accepted is None else tuple(row.per_step_accepted),
        per_step_drafted=None if row.per_step_drafted is None else tuple(row.per_step_drafted),
        upstream_url=row.upstream_url,
        streamed=row.streamed,
        status_code=row.status_code,
        config_id=row.config_id,
    )


# --- steps --------------------------------------------------------------------------------------


def step_from_row(row: Row[Any], key: EngineKey) -> StepRecord:
    return StepRecord(
        ts=row.ts,
        key=key,
        batch_size=row.batch_size,
        step_time_s=row.step_time_s,
        spec=_spec_from(row, row.generated_tokens),
        num_scheduled_tokens=row.num_scheduled_tokens,
        config_id=row.config_id,
    )


# --- events -------------------------------------------------------------------------------------


def event_row(rec: EventRecord, ids: dict[EngineKey, int]) -> dict[str, Any]:
    if rec.severity not in SEVERITIES:
        raise FieldError("severity", f"is {rec.severity!r}; expected one of {', '.join(SEVERITIES)}")
    return {
        "engine_id": None if rec.engine is None else ids[rec.engine],
        "ts": check_when(rec.ts, "ts"),
        "kind": check_text(rec.kind, "kind", 64),
        "severity": rec.severity,
        "message": check_text(rec.message, "message", 1_000_000, empty_ok=True),
        "data": check_json(dict(rec.data), "data"),
    }


def event_from_row(row: Row[Any], key: EngineKey | None) -> EventRecord:
    return EventRecord(
        ts=row.ts,
        kind=row.kind,
        message=row.message,
        severity=row.severity,
        engine=key,
        data=dict(row.data),
    )


# --- collector baselines ------------------------------------------------------------------------

_SAMPLE_JSON_VERSION = 1


def _bound(le: float) -> float | str:
    # JSON (and PostgreSQL's jsonb) has no infinity: the +Inf bucket bound goes as a string.
    return le if math.isfinite(le) else repr(le)


def sample_json(sample: EngineSample) -> dict[str, Any]:
    """The cumulative values of one engine sample, as JSON (all but the key and the time, which
    are columns). Validated: counts non-negative, measurements finite."""
    spec = sample.spec
    return {
        "version": _SAMPLE_JSON_VERSION,
        "spec": None if spec is None else _spec_columns(spec),
        "generation_tokens": check_measure(sample.generation_tokens, "generation_tokens"),
        "prompt_tokens": check_measure(sample.prompt_tokens, "prompt_tokens"),
        "requests_running": check_opt_measure(sample.requests_running, "requests_running"),
        "requests_waiting": check_opt_measure(sample.requests_waiting, "requests_waiting"),
        "kv_cache_usage": check_opt_measure(sample.kv_cache_usage, "kv_cache_usage"),
        "cache_config": check_json(dict(sample.cache_config), "cache_config"),
        "histograms": {
            name: {
                "buckets": [[_bound(le), check_measure(n, f"{name} bucket")] for le, n in buckets],
                "count": check_measure(count, f"{name} count"),
                "sum": check_opt_real(total, f"{name} sum"),
            }
            for name, (buckets, count, total) in sample.histograms.items()
        },
        "created_s": check_opt_real(sample.created_s, "created_s"),
    }


def sample_from_json(data: dict[str, Any], key: EngineKey, ts: datetime) -> EngineSample:
    """The inverse of :func:`sample_json`; raises ``ValueError`` on a version it cannot read."""
    if data.get("version") != _SAMPLE_JSON_VERSION:
        raise ValueError(f"collector baseline format {data.get('version')!r} is not {_SAMPLE_JSON_VERSION}")
    s = data["spec"]
    spec = None
    if s is not None:
        spec = SpecCounters(
            drafts=s["drafts"],
            draft_tokens=s["draft_tokens"],
            accepted_tokens=s["accepted_tokens"],
            accepted_per_pos=tuple(s["accepted_per_pos"]),
            num_spec_tokens=s["num_spec_tokens"],
            draft_tokens_per_pos=None if s["draft_tokens_per_pos"] is None else tuple(s["draft_tokens_per_pos"]),
            generated_tokens=s["generated_tokens"],
        )
    return EngineSample(
        key=key,
        ts=ts,
        spec=spec,
        generation_tokens=data["generation_tokens"],
        prompt_tokens=data["prompt_tokens"],
        requests_running=data["requests_running"],
        requests_waiting=data["requests_waiting"],
        kv_cache_usage=data["kv_cache_usage"],
        cache_config=dict(data["cache_config"]),
        histograms={
            name: (tuple((float(le), n) for le, n in h["buckets"]), h["count"], h["sum"])
            for name, h in data["histograms"].items()
        },
        created_s=data["created_s"],
    )


# --- configs and decisions ----------------------------------------------------------------------


def check_k_table(table: Any) -> list[list[int]] | None:
    """vLLM's per-batch-size table: rows [lo, hi, K], lo ≤ hi, K ≥ 0, first row at 1, no gaps or
    overlaps (a gap would leave some batch sizes without a K)."""
    if table is None:
        return None
    rows: list[list[int]] = []
    for i, entry in enumerate(table):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise FieldError(f"k_table[{i}]", f"is {entry!r}; expected [lo, hi, K]")
        lo, hi, k = (check_count(v, f"k_table[{i}]") for v in entry)
        if lo < 1 or hi < lo:
            raise FieldError(f"k_table[{i}]", f"is {list(entry)}; need 1 <= lo <= hi")
        expected_lo = 1 if not rows else rows[-1][1] + 1
        if lo != expected_lo:
            raise FieldError(f"k_table[{i}]", f"starts at {lo}; the next row must start at {expected_lo}")
        rows.append([lo, hi, k])
    if not rows:
        raise FieldError("k_table", "is empty; give None for a single K")
    return rows


def config_row(rec: EngineConfigRecord, engine_id: int) -> dict[str, Any]:
    started = check_when(rec.started_at, "started_at")
    ended = None if rec.ended_at is None else check_when(rec.ended_at, "ended_at")
    if ended is not None and ended < started:
        raise FieldError("ended_at", f"({ended.isoformat()}) is before started_at ({started.isoformat()})")
    return {
        "engine_id": engine_id,
        "method": check_text(rec.method, "method", 64),
        "draft_model": None if rec.draft_model is None else check_text(rec.draft_model, "draft_model", 1024),
        "num_spec_tokens": check_opt_count(rec.num_spec_tokens, "num_spec_tokens"),
        "k_table": check_k_table(rec.k_table),
        "spec_config": None if rec.spec_config is None else check_json(dict(rec.spec_config), "spec_config"),
        "started_at": started,
        "ended_at": ended,
        "applied_by": check_text(str(rec.applied_by), "applied_by", 32),
        "decision_id": rec.decision_id,
    }


def config_from_row(row: Row[Any], key: EngineKey) -> StoredConfig:
    return StoredConfig(
        id=row.id,
        key=key,
        config=EngineConfigRecord(
            method=row.method,
            started_at=row.started_at,
            applied_by=row.applied_by,
            draft_model=row.draft_model,
            num_spec_tokens=row.num_spec_tokens,
            k_table=None if row.k_table is None else tuple((a, b, c) for a, b, c in row.k_table),
            spec_config=row.spec_config,
            ended_at=row.ended_at,
            decision_id=row.decision_id,
        ),
    )


def decision_row(rec: DecisionRecord, engine_id: int | None) -> dict[str, Any]:
    created = check_when(rec.created_at, "created_at")
    return {
        "engine_id": engine_id,
        "created_at": created,
        "updated_at": created,
        "mode": check_text(str(rec.mode), "mode", 32),
        "action": check_text(str(rec.action), "action", 64),
        "reason": check_text(str(rec.reason), "reason", 64),
        "message": check_text(rec.message, "message", 1_000_000),
        "inputs": check_json(dict(rec.inputs), "inputs"),
        "proposed_config": None
        if rec.proposed_config is None
        else check_json(dict(rec.proposed_config), "proposed_config"),
        "predicted_gain": check_opt_real(rec.predicted_gain, "predicted_gain"),
        "realized_gain": None,
        "status": check_text(str(rec.status), "status", 32),
        "status_message": None,
    }


def decision_from_row(row: Row[Any], key: EngineKey | None) -> StoredDecision:
    return StoredDecision(
        id=row.id,
        decision=DecisionRecord(
            created_at=row.created_at,
            action=row.action,
            reason=row.reason,
            message=row.message,
            inputs=row.inputs,
            mode=row.mode,
            engine=key,
            proposed_config=row.proposed_config,
            predicted_gain=row.predicted_gain,
            status=row.status,
        ),
        updated_at=row.updated_at,
        realized_gain=row.realized_gain,
        status_message=row.status_message,
    )


def check_single(kind: str, convert: Any, *args: Any) -> dict[str, Any]:
    """Convert one config/decision, turning a field error into :class:`InvalidRecordError`."""
    try:
        result: dict[str, Any] = convert(*args)
    except FieldError as exc:
        raise InvalidRecordError(f"{kind}: {exc}; nothing was written") from None
    return result


def check_fields(kind: str, **checks: tuple[Any, str]) -> dict[str, Any]:
    """Validate loose arguments (decision updates) with the same messages as records."""
    out: dict[str, Any] = {}
    try:
        for name, (value, how) in checks.items():
            if how == "when":
                out[name] = check_when(value, name)
            elif how == "real":
                out[name] = check_opt_real(value, name)
            elif how == "text":
                out[name] = None if value is None else check_text(str(value), name, 1_000_000)
            elif how == "status":
                out[name] = check_text(str(value), name, 32)
            else:  # pragma: no cover - programming error
                raise AssertionError(how)
    except FieldError as exc:
        raise InvalidRecordError(f"{kind}: {exc}; nothing was written") from None
    return out
