"""Core tables: engines, configs, scrape windows, requests, steps, decisions, events.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tuner.store.types import UTCDateTime, id_type, json_type

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _id() -> sa.Column:
    return sa.Column("id", id_type(), primary_key=True, autoincrement=True, nullable=False)


def _engine_fk(table: str, nullable: bool = False) -> sa.Column:
    return sa.Column(
        "engine_id",
        id_type(),
        sa.ForeignKey("engines.id", name=f"fk_{table}_engine_id_engines", ondelete="CASCADE"),
        nullable=nullable,
    )


def _config_fk(table: str) -> sa.Column:
    return sa.Column(
        "config_id",
        id_type(),
        sa.ForeignKey("engine_configs.id", name=f"fk_{table}_config_id_engine_configs", ondelete="SET NULL"),
        nullable=True,
    )


def _counts() -> list[sa.Column]:
    return [
        sa.Column("num_spec_tokens", sa.Integer(), nullable=True),
        sa.Column("drafts", sa.BigInteger(), nullable=False),
        sa.Column("draft_tokens", sa.BigInteger(), nullable=False),
        sa.Column("accepted_tokens", sa.BigInteger(), nullable=False),
        sa.Column("accepted_per_pos", json_type(), nullable=False),
        sa.Column("draft_tokens_per_pos", json_type(), nullable=True),
    ]


def upgrade() -> None:
    op.create_table(
        "engines",
        _id(),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("model_name", sa.String(512), nullable=False),
        sa.Column("engine_index", sa.String(64), nullable=False),
        sa.Column("first_seen_at", UTCDateTime(), nullable=False),
        sa.Column("cache_config", json_type(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_engines"),
        sa.UniqueConstraint("url", "model_name", "engine_index", name="uq_engines_url_model_name_engine_index"),
    )
    op.create_table(
        "decisions",
        _id(),
        _engine_fk("decisions", nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("mode", sa.String(32), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("inputs", json_type(), nullable=False),
        sa.Column("proposed_config", json_type(), nullable=True),
        sa.Column("predicted_gain", sa.Float(), nullable=True),
        sa.Column("realized_gain", sa.Float(), nullable=True),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("status_message", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_decisions"),
    )
    op.create_index("ix_decisions_engine_id_created_at", "decisions", ["engine_id", "created_at"])
    op.create_index("ix_decisions_created_at", "decisions", ["created_at"])

    op.create_table(
        "engine_configs",
        _id(),
        _engine_fk("engine_configs"),
        sa.Column("method", sa.String(64), nullable=False),
        sa.Column("draft_model", sa.String(1024), nullable=True),
        sa.Column("num_spec_tokens", sa.Integer(), nullable=True),
        sa.Column("k_table", json_type(), nullable=True),
        sa.Column("spec_config", json_type(), nullable=True),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
        sa.Column("applied_by", sa.String(32), nullable=False),
        sa.Column(
            "decision_id",
            id_type(),
            sa.ForeignKey("decisions.id", name="fk_engine_configs_decision_id_decisions", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.PrimaryKeyConstraint("id", name="pk_engine_configs"),
    )
    op.create_index("ix_engine_configs_engine_id_started_at", "engine_configs", ["engine_id", "started_at"])

    op.create_table(
        "scrape_windows",
        _id(),
        _engine_fk("scrape_windows"),
        _config_fk("scrape_windows"),
        sa.Column("start_ts", UTCDateTime(), nullable=False),
        sa.Column("end_ts", UTCDateTime(), nullable=False),
        sa.Column("spec_enabled", sa.Boolean(), nullable=False),
        *_counts(),
        sa.Column("spec_generated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("generation_tokens", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.Float(), nullable=False),
        sa.Column("requests_running", sa.Float(), nullable=True),
        sa.Column("requests_waiting", sa.Float(), nullable=True),
        sa.Column("kv_cache_usage", sa.Float(), nullable=True),
        *[
            sa.Column(f"{name}_{field}", sa.Float(), nullable=True)
            for name in ("e2e", "ttft", "itl")
            for field in ("count", "sum_s", "p50_s", "p90_s", "p99_s")
        ],
        sa.Column("reset", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_scrape_windows"),
        sa.UniqueConstraint("engine_id", "end_ts", name="uq_scrape_windows_engine_id_end_ts"),
    )
    op.create_index("ix_scrape_windows_end_ts", "scrape_windows", ["end_ts"])

    op.create_table(
        "requests",
        _id(),
        sa.Column("ts", UTCDateTime(), nullable=False),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("model_name", sa.String(512), nullable=False),
        sa.Column("upstream_url", sa.String(2048), nullable=False),
        _config_fk("requests"),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("latency_s", sa.Float(), nullable=False),
        sa.Column("num_spec_tokens", sa.Integer(), nullable=True),
        sa.Column("drafts", sa.BigInteger(), nullable=False),
        sa.Column("draft_tokens", sa.BigInteger(), nullable=False),
        sa.Column("accepted_tokens", sa.BigInteger(), nullable=False),
        sa.Column("acceptance_histogram", json_type(), nullable=False),
        sa.Column("mean_acceptance_length", sa.Float(), nullable=True),
        sa.Column("draft_acceptance_rate", sa.Float(), nullable=True),
        sa.Column("per_step_accepted", json_type(), nullable=True),
        sa.Column("per_step_drafted", json_type(), nullable=True),
        sa.Column("streamed", sa.Boolean(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_requests"),
    )
    op.create_index("ix_requests_ts", "requests", ["ts"])

    op.create_table(
        "steps",
        _id(),
        _engine_fk("steps"),
        _config_fk("steps"),
        sa.Column("ts", UTCDateTime(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=True),
        sa.Column("num_scheduled_tokens", sa.Integer(), nullable=True),
        *_counts(),
        sa.Column("generated_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_steps"),
    )
    op.create_index("ix_steps_engine_id_ts", "steps", ["engine_id", "ts"])

    op.create_table(
        "events",
        _id(),
        _engine_fk("events", nullable=True),
        sa.Column("ts", UTCDateTime(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", json_type(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
    )
    op.create_index("ix_events_engine_id_ts", "events", ["engine_id", "ts"])
    op.create_index("ix_events_ts", "events", ["ts"])
    op.create_index("ix_events_kind_ts", "events", ["kind", "ts"])


def downgrade() -> None:
    for table in ("events", "steps", "requests", "scrape_windows", "engine_configs", "decisions"):
        op.drop_table(table)
    op.drop_table("engines")
