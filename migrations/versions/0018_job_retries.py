"""jobs.retries: times a job was resumed after it failed, to go on from its last checkpoint

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("retries", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0013's, not a batch copy of the table)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN retries")
    else:
        op.drop_column("jobs", "retries")
