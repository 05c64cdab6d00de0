"""Collector baselines: per engine series, the last cumulative /metrics values stored.

Written by helper H5 (issue #3, gap c) for the lead to review (and renumber if needed).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tuner.store.types import UTCDateTime, id_type, json_type

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "collector_baselines",
        sa.Column("engine_id", id_type(), nullable=False),
        sa.Column("ts", UTCDateTime(), nullable=False),
        sa.Column("sample", json_type(), nullable=False),
        sa.ForeignKeyConstraint(
            ["engine_id"], ["engines.id"], name="fk_collector_baselines_engine_id_engines", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("engine_id", name="pk_collector_baselines"),
    )


def downgrade() -> None:
    op.drop_table("collector_baselines")
