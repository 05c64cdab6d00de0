"""Alert hooks: the delivery log and each sink's event cursor.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tuner.store.types import UTCDateTime, id_type

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "alert_deliveries",
        sa.Column("id", id_type(), primary_key=True, autoincrement=True, nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("engine_id", sa.BigInteger(), nullable=True),
        sa.Column("sink", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("dedup_key", sa.String(512), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_alert_deliveries"),
    )
    op.create_index(
        "ix_alert_deliveries_sink_dedup_key_created_at", "alert_deliveries", ["sink", "dedup_key", "created_at"]
    )
    op.create_index("ix_alert_deliveries_created_at", "alert_deliveries", ["created_at"])
    op.create_table(
        "alert_cursors",
        sa.Column("sink", sa.String(128), nullable=False),
        sa.Column("last_event_id", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("sink", name="pk_alert_cursors"),
    )


def downgrade() -> None:
    op.drop_table("alert_cursors")
    op.drop_index("ix_alert_deliveries_created_at", table_name="alert_deliveries")
    op.drop_index("ix_alert_deliveries_sink_dedup_key_created_at", table_name="alert_deliveries")
    op.drop_table("alert_deliveries")
