"""jobs.reported_at: when a job's workers last reported, to find a run that stalled

NULL for the jobs stored before (their last report is not known: a running one is timed from the
dispatcher's start).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("reported_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0013's, not a batch copy of the table)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN reported_at")
    else:
        op.drop_column("jobs", "reported_at")
