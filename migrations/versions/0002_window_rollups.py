"""1-minute rollups of scrape windows (downsampling for long retention).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tuner.store.types import UTCDateTime, id_type, json_type

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "window_rollups_1m",
        sa.Column("id", id_type(), primary_key=True, autoincrement=True, nullable=False),
        sa.Column(
            "engine_id",
            id_type(),
            sa.ForeignKey("engines.id", name="fk_window_rollups_1m_engine_id_engines", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "config_id",
            id_type(),
            sa.ForeignKey(
                "engine_configs.id", name="fk_window_rollups_1m_config_id_engine_configs", ondelete="SET NULL"
            ),
            nullable=True,
        ),
        sa.Column("bucket_start", UTCDateTime(), nullable=False),
        sa.Column("windows", sa.Integer(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("resets", sa.Integer(), nullable=False),
        sa.Column("num_spec_tokens", sa.Integer(), nullable=True),
        sa.Column("drafts", sa.BigInteger(), nullable=False),
        sa.Column("draft_tokens", sa.BigInteger(), nullable=False),
        sa.Column("accepted_tokens", sa.BigInteger(), nullable=False),
        sa.Column("accepted_per_pos", json_type(), nullable=False),
        sa.Column("draft_tokens_per_pos", json_type(), nullable=True),
        sa.Column("spec_generated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("generation_tokens", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.Float(), nullable=False),
        *[
            sa.Column(f"{gauge}_{agg}", sa.Float(), nullable=True)
            for gauge in ("requests_running", "requests_waiting", "kv_cache_usage")
            for agg in ("avg", "max")
        ],
        *[
            sa.Column(f"{name}_{field}", sa.Float(), nullable=True)
            for name in ("e2e", "ttft", "itl")
            for field in ("count", "sum_s", "p99_max_s")
        ],
        sa.PrimaryKeyConstraint("id", name="pk_window_rollups_1m"),
        sa.UniqueConstraint(
            "engine_id",
            "bucket_start",
            "config_id",
            name="uq_window_rollups_1m_engine_id_bucket_start_config_id",
        ),
    )
    op.create_index("ix_window_rollups_1m_bucket_start", "window_rollups_1m", ["bucket_start"])


def downgrade() -> None:
    op.drop_index("ix_window_rollups_1m_bucket_start", table_name="window_rollups_1m")
    op.drop_table("window_rollups_1m")
