"""jobs.admitted_at: when a job last took its chips (launched, or let start after Kueue held it)

The usage report counts a job's chip-hours from then, not from its first report. Jobs stored before get
it from their events: the latest launch, or move from queued to starting after one (an admission), if
no move back to the queue came after it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        status, moved_from = "e.data->>'status'", "e.data->>'from'"
    else:
        status, moved_from = "json_extract(e.data, '$.status')", "json_extract(e.data, '$.from')"
    events = "FROM job_events e WHERE e.job_seq = jobs.seq"
    admission = f"e.type = 'status' AND {status} = 'starting' AND {moved_from} = 'queued'"
    admitted = f"e.type = 'launch' OR ({admission})"
    op.execute(
        f"UPDATE jobs SET admitted_at = (SELECT max(e.created_at) {events} AND ({admitted})) "
        "WHERE launched_at IS NOT NULL AND status <> 'queued'"
    )
    # (the claim's move to starting comes before the launch: only a held run's admission is after one)
    op.execute(
        f"UPDATE jobs SET admitted_at = NULL WHERE admitted_at IS NOT NULL AND EXISTS (SELECT 1 {events} "
        f"AND e.type = 'status' AND {status} = 'queued' AND e.created_at > jobs.admitted_at)"
    )


def downgrade() -> None:
    # (SQLite's own DROP COLUMN: a batch copy of the table would drop `jobs`, and with it, by their foreign
    # keys' ON DELETE CASCADE, every job's events and metadata)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN admitted_at")
    else:
        op.drop_column("jobs", "admitted_at")
