"""key usage: each replica's share of API keys' rate limits and streams

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "key_usage",
        sa.Column("replica", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("key_digest", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("since", sa.Float(), nullable=False),
        sa.Column("spent", sa.Float(), nullable=False),
        sa.Column("streams", sa.Integer(), nullable=False),
        sa.Column("seen_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("replica", "key_digest"),
    )


def downgrade() -> None:
    op.drop_table("key_usage")
