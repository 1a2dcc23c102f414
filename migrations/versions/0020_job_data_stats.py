"""jobs.data_stats: what the job's training data came to, as its worker reported it (documents, tokens,
packed rows, padding, steps)

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("data_stats", sa.JSON(), nullable=True))


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0013's, not a batch copy of the table)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN data_stats")
    else:
        op.drop_column("jobs", "data_stats")
