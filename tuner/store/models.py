"""The time-series schema: SQLAlchemy 2 typed models.

One row per engine series, per config in force, per scrape window, per finished request, per engine
step, per controller decision and per event, plus 1-minute rollups of windows. Every table that grows
with time is indexed by ``(engine_id, time)`` for per-engine range queries and by time alone for
retention deletes. Counts are 64-bit integers; Prometheus counters that are floats on the wire
(generation/prompt tokens) stay floats. Migrations in ``migrations/versions`` must match these models
(a test compares them on SQLite and PostgreSQL).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from tuner.store.types import UTCDateTime, id_type, json_type

# Stable constraint names, so later migrations can alter them by name on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: json_type(),
        list[Any]: json_type(),
        int: BigInteger(),
        float: Float(),
        str: String(),
    }


def _pk() -> Mapped[int]:
    return mapped_column(id_type(), primary_key=True, autoincrement=True)


def _engine_fk(nullable: bool = False) -> Mapped[Any]:
    return mapped_column(id_type(), ForeignKey("engines.id", ondelete="CASCADE"), nullable=nullable)


def _config_fk() -> Mapped[int | None]:
    # A config row may be pruned or corrected; the measurements it labelled stay.
    return mapped_column(id_type(), ForeignKey("engine_configs.id", ondelete="SET NULL"), nullable=True)


class EngineRow(Base):
    """One engine series: a /metrics URL, a served model name and vLLM's ``engine`` label (DP rank)."""

    __tablename__ = "engines"
    __table_args__ = (UniqueConstraint("url", "model_name", "engine_index"),)

    id: Mapped[int] = _pk()
    url: Mapped[str] = mapped_column(String(2048))
    model_name: Mapped[str] = mapped_column(String(512))
    engine_index: Mapped[str] = mapped_column(String(64))
    first_seen_at: Mapped[datetime]
    # ``vllm:cache_config_info`` labels, when the collector captured them.
    cache_config: Mapped[dict[str, Any] | None]

    configs: Mapped[list[EngineConfigRow]] = relationship(back_populates="engine", lazy="raise")


class EngineConfigRow(Base):
    """A speculative-decoding config an engine ran with, from ``started_at`` until ``ended_at``."""

    __tablename__ = "engine_configs"
    __table_args__ = (Index(None, "engine_id", "started_at"),)

    id: Mapped[int] = _pk()
    engine_id: Mapped[int] = _engine_fk()
    method: Mapped[str] = mapped_column(String(64))  # "eagle", "draft_model", "ngram", "off", ...
    draft_model: Mapped[str | None] = mapped_column(String(1024))
    num_spec_tokens: Mapped[int | None] = mapped_column(Integer)
    # vLLM's per-batch-size K table: [[lo, hi, K], ...]
    k_table: Mapped[list[Any] | None]
    # The whole speculative_config as applied, for audit and exact replay.
    spec_config: Mapped[dict[str, Any] | None]
    started_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    applied_by: Mapped[str] = mapped_column(String(32))  # observed | startup | restart | live | ...
    decision_id: Mapped[int | None] = mapped_column(
        id_type(), ForeignKey("decisions.id", ondelete="SET NULL"), nullable=True
    )

    engine: Mapped[EngineRow] = relationship(back_populates="configs", lazy="raise")


class ScrapeWindowRow(Base):
    """Counter deltas for one engine between two /metrics scrapes (never negative; see ``reset``)."""

    __tablename__ = "scrape_windows"
    # One window per engine per end time: a retried write fails loudly instead of double counting.
    __table_args__ = (UniqueConstraint("engine_id", "end_ts"), Index(None, "end_ts"))

    id: Mapped[int] = _pk()
    engine_id: Mapped[int] = _engine_fk()
    config_id: Mapped[int | None] = _config_fk()
    start_ts: Mapped[datetime]
    end_ts: Mapped[datetime]
    spec_enabled: Mapped[bool] = mapped_column(Boolean)
    num_spec_tokens: Mapped[int | None] = mapped_column(Integer)
    drafts: Mapped[int]
    draft_tokens: Mapped[int]
    accepted_tokens: Mapped[int]
    accepted_per_pos: Mapped[list[Any]]
    draft_tokens_per_pos: Mapped[list[Any] | None]
    spec_generated_tokens: Mapped[int]
    generation_tokens: Mapped[float]
    prompt_tokens: Mapped[float]
    requests_running: Mapped[float | None]
    requests_waiting: Mapped[float | None]
    kv_cache_usage: Mapped[float | None]
    e2e_count: Mapped[float | None]
    e2e_sum_s: Mapped[float | None]
    e2e_p50_s: Mapped[float | None]
    e2e_p90_s: Mapped[float | None]
    e2e_p99_s: Mapped[float | None]
    ttft_count: Mapped[float | None]
    ttft_sum_s: Mapped[float | None]
    ttft_p50_s: Mapped[float | None]
    ttft_p90_s: Mapped[float | None]
    ttft_p99_s: Mapped[float | None]
    itl_count: Mapped[float | None]
    itl_sum_s: Mapped[float | None]
    itl_p50_s: Mapped[float | None]
    itl_p90_s: Mapped[float | None]
    itl_p99_s: Mapped[float | None]
    reset: Mapped[bool] = mapped_column(Boolean)


class WindowRollupRow(Base):
    """Windows summed per engine, per config, per UTC minute (by window end). Quantiles cannot be
    summed, so latency keeps count, sum and the worst window's p99."""

    __tablename__ = "window_rollups_1m"
    __table_args__ = (
        UniqueConstraint("engine_id", "bucket_start", "config_id"),
        Index(None, "bucket_start"),
    )

    id: Mapped[int] = _pk()
    engine_id: Mapped[int] = _engine_fk()
    config_id: Mapped[int | None] = _config_fk()
    bucket_start: Mapped[datetime]
    windows: Mapped[int] = mapped_column(Integer)
    duration_s: Mapped[float]
    resets: Mapped[int] = mapped_column(Integer)
    num_spec_tokens: Mapped[int | None] = mapped_column(Integer)
    drafts: Mapped[int]
    draft_tokens: Mapped[int]
    accepted_tokens: Mapped[int]
    accepted_per_pos: Mapped[list[Any]]
    draft_tokens_per_pos: Mapped[list[Any] | None]
    spec_generated_tokens: Mapped[int]
    generation_tokens: Mapped[float]
    prompt_tokens: Mapped[float]
    requests_running_avg: Mapped[float | None]
    requests_running_max: Mapped[float | None]
    requests_waiting_avg: Mapped[float | None]
    requests_waiting_max: Mapped[float | None]
    kv_cache_usage_avg: Mapped[float | None]
    kv_cache_usage_max: Mapped[float | None]
    e2e_count: Mapped[float | None]
    e2e_sum_s: Mapped[float | None]
    e2e_p99_max_s: Mapped[float | None]
    ttft_count: Mapped[float | None]
    ttft_sum_s: Mapped[float | None]
    ttft_p99_max_s: Mapped[float | None]
    itl_count: Mapped[float | None]
    itl_sum_s: Mapped[float | None]
    itl_p99_max_s: Mapped[float | None]


class RequestRow(Base):
    """One finished request as the tap saw it (``metrics.speculative_decoding`` + token counts)."""

    __tablename__ = "requests"
    # One index only: every index costs ingest time on the busiest tables. Queries by model scan
    # the time range (short) and filter.
    __table_args__ = (Index(None, "ts"),)

    id: Mapped[int] = _pk()
    ts: Mapped[datetime]
    request_id: Mapped[str] = mapped_column(String(256))
    model_name: Mapped[str] = mapped_column(String(512))
    upstream_url: Mapped[str] = mapped_column(String(2048))
    config_id: Mapped[int | None] = _config_fk()
    prompt_tokens: Mapped[int]
    output_tokens: Mapped[int]
    latency_s: Mapped[float]
    num_spec_tokens: Mapped[int | None] = mapped_column(Integer)
    drafts: Mapped[int]
    draft_tokens: Mapped[int]
    accepted_tokens: Mapped[int]
    acceptance_histogram: Mapped[list[Any]]
    mean_acceptance_length: Mapped[float | None]
    draft_acceptance_rate: Mapped[float | None]
    per_step_accepted: Mapped[list[Any] | None]
    per_step_drafted: Mapped[list[Any] | None]
    streamed: Mapped[bool] = mapped_column(Boolean)
    status_code: Mapped[int] = mapped_column(Integer)


class StepRow(Base):
    """One engine step from the in-engine plugin: batch size, step time, per-position stats."""

    __tablename__ = "steps"
    # One index only (ingest speed); retention deletes engine by engine through it.
    __table_args__ = (Index(None, "engine_id", "ts"),)

    id: Mapped[int] = _pk()
    engine_id: Mapped[int] = _engine_fk()
    config_id: Mapped[int | None] = _config_fk()
    ts: Mapped[datetime]
    batch_size: Mapped[int] = mapped_column(Integer)
    step_time_s: Mapped[float | None]
    num_scheduled_tokens: Mapped[int | None] = mapped_column(Integer)
    num_spec_tokens: Mapped[int | None] = mapped_column(Integer)
    drafts: Mapped[int]
    draft_tokens: Mapped[int]
    accepted_tokens: Mapped[int]
    accepted_per_pos: Mapped[list[Any]]
    draft_tokens_per_pos: Mapped[list[Any] | None]
    generated_tokens: Mapped[int]


class DecisionRow(Base):
    """The audit log: what the controller saw, chose and why, what it predicted and what happened."""

    __tablename__ = "decisions"
    __table_args__ = (Index(None, "engine_id", "created_at"), Index(None, "created_at"))

    id: Mapped[int] = _pk()
    engine_id: Mapped[int | None] = _engine_fk(nullable=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    mode: Mapped[str] = mapped_column(String(32))  # advisory | auto | manual
    action: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(String(64))  # the policy's machine-readable reason
    message: Mapped[str] = mapped_column(Text)  # the human sentence
    inputs: Mapped[dict[str, Any]]
    proposed_config: Mapped[dict[str, Any] | None]
    predicted_gain: Mapped[float | None]
    realized_gain: Mapped[float | None]
    status: Mapped[str] = mapped_column(String(32))
    status_message: Mapped[str | None] = mapped_column(Text)


class EventRow(Base):
    """Something an operator may want to know: a counter reset, a collector error, a swap..."""

    __tablename__ = "events"
    __table_args__ = (Index(None, "engine_id", "ts"), Index(None, "ts"), Index(None, "kind", "ts"))

    id: Mapped[int] = _pk()
    engine_id: Mapped[int | None] = _engine_fk(nullable=True)
    ts: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(64))
    severity: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]]


class AlertDeliveryRow(Base):
    """One alert event's outcome at one sink: delivered, failed after retries, deduplicated or rate
    limited. Never holds a secret or a sink URL (Slack webhook URLs are credentials)."""

    __tablename__ = "alert_deliveries"
    __table_args__ = (Index(None, "sink", "dedup_key", "created_at"), Index(None, "created_at"))

    id: Mapped[int] = _pk()
    # No foreign keys: events are pruned on their own horizon; the delivery log stays readable.
    event_id: Mapped[int]
    engine_id: Mapped[int | None]
    sink: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(64))
    dedup_key: Mapped[str] = mapped_column(String(512))
    outcome: Mapped[str] = mapped_column(String(32))  # delivered | failed | deduplicated | rate_limited
    attempts: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_s: Mapped[float]
    created_at: Mapped[datetime]


class AlertCursorRow(Base):
    """Per sink, the id of the last event it has dealt with: a restarted daemon resumes after it."""

    __tablename__ = "alert_cursors"

    sink: Mapped[str] = mapped_column(String(128), primary_key=True)
    last_event_id: Mapped[int]
    updated_at: Mapped[datetime]


class CollectorBaselineRow(Base):
    """Per engine series, the cumulative /metrics values the collector last stored a window up to
    (written in the same transaction as that window): a restarted collector resumes from them, so
    its first scrape is a window, not a gap. The engine's own restarts are still spotted (counters
    going down, a new ``_created`` time)."""

    __tablename__ = "collector_baselines"

    engine_id: Mapped[int] = mapped_column(id_type(), ForeignKey("engines.id", ondelete="CASCADE"), primary_key=True)
    ts: Mapped[datetime]  # when the sample was taken
    sample: Mapped[dict[str, Any]]  # collectors.records.EngineSample as JSON (tuner.store.rows.sample_json)


class ShadowEvidenceRow(Base):
    """One shadow evaluation of a draft candidate on recorded traffic (``spectuner shadow run``): its α
    evidence as the serving path would count it, with its sample size and when it was computed."""

    __tablename__ = "shadow_evidence"
    __table_args__ = (Index(None, "candidate", "computed_at"),)

    id: Mapped[int] = _pk()
    candidate: Mapped[str] = mapped_column(String(256))
    method: Mapped[str] = mapped_column(String(64))
    model_path: Mapped[str | None] = mapped_column(String(2048))
    computed_at: Mapped[datetime]
    samples: Mapped[int]  # recorded requests replayed
    output_tokens: Mapped[int]
    num_spec_tokens: Mapped[int] = mapped_column(Integer)  # K the replay drafted with
    drafts: Mapped[int]
    successes: Mapped[float]  # accepted draft tokens
    failures: Mapped[float]  # steps that rejected a token
    alpha: Mapped[float | None]
    alpha_lo: Mapped[float | None]
    alpha_hi: Mapped[float | None]
    greedy_only: Mapped[bool] = mapped_column(Boolean)  # some samples were sampled, not greedy
    tokenizer_check: Mapped[str] = mapped_column(String(64))  # "same_vocab" or why it was not checked
    details: Mapped[dict[str, Any]]
