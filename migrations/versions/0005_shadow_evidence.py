"""Shadow evidence: α measured by replaying recorded traffic through a draft candidate (issue #21).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from tuner.store.types import UTCDateTime, id_type, json_type

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "shadow_evidence",
        sa.Column("id", id_type(), autoincrement=True, nullable=False),
        sa.Column("candidate", sa.String(256), nullable=False),
        sa.Column("method", sa.String(64), nullable=False),
        sa.Column("model_path", sa.String(2048), nullable=True),
        sa.Column("computed_at", UTCDateTime(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_spec_tokens", sa.Integer(), nullable=False),
        sa.Column("drafts", sa.BigInteger(), nullable=False),
        sa.Column("successes", sa.Float(), nullable=False),
        sa.Column("failures", sa.Float(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=True),
        sa.Column("alpha_lo", sa.Float(), nullable=True),
        sa.Column("alpha_hi", sa.Float(), nullable=True),
        sa.Column("greedy_only", sa.Boolean(), nullable=False),
        sa.Column("tokenizer_check", sa.String(64), nullable=False),
        sa.Column("details", json_type(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_shadow_evidence"),
    )
    op.create_index("ix_shadow_evidence_candidate_computed_at", "shadow_evidence", ["candidate", "computed_at"])


def downgrade() -> None:
    op.drop_index("ix_shadow_evidence_candidate_computed_at", table_name="shadow_evidence")
    op.drop_table("shadow_evidence")
