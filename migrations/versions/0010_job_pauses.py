"""jobs.pauses: how often a job was paused (POST /jobs/{id}/pause)

A paused job let its chips go and took them again once resumed: the usage report reads its status events
for when it held them, as it does for a preempted job's. Jobs stored before were never paused.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("pauses", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0008's: a batch copy of the table would drop `jobs`, and with it, by
    # their foreign keys' ON DELETE CASCADE, every job's events and metadata)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN pauses")
    else:
        op.drop_column("jobs", "pauses")
