"""jobs.held_seconds: the seconds a job held its chips before it last let them go

With the time since `admitted_at`, what a job has held in all: GET /jobs/{id} shows it (`usage`). Jobs
stored before get it from their events: each move back to the queue (a preemption, or Kueue holding a
launched run for quota) ends a hold that began at the latest launch, or admission, before it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("held_seconds", sa.Float(), server_default="0", nullable=False))
    if op.get_bind().dialect.name == "postgresql":
        status, moved_from = "{e}.data->>'status'", "{e}.data->>'from'"
        seconds = "extract(epoch FROM q.created_at - ({taken}))"
    else:
        status, moved_from = "json_extract({e}.data, '$.status')", "json_extract({e}.data, '$.from')"
        seconds = "(julianday(q.created_at) - julianday(({taken}))) * 86400.0"
    # A move to the queue from a status that holds chips, and what took them last before it (0008's rule).
    released = (
        f"q.type = 'status' AND {status.format(e='q')} = 'queued' "
        f"AND {moved_from.format(e='q')} IN ('starting', 'running', 'cancelling')"
    )
    admission = (
        f"t.type = 'status' AND {status.format(e='t')} = 'starting' AND {moved_from.format(e='t')} = 'queued'"
    )
    taken = (
        "SELECT max(t.created_at) FROM job_events t WHERE t.job_seq = q.job_seq "
        f"AND t.created_at <= q.created_at AND (t.type = 'launch' OR ({admission}))"
    )
    released_by_job = f"FROM job_events q WHERE q.job_seq = jobs.seq AND {released}"
    op.execute(
        f"UPDATE jobs SET held_seconds = coalesce((SELECT sum({seconds.format(taken=taken)}) "
        f"{released_by_job}), 0) WHERE launched_at IS NOT NULL AND EXISTS (SELECT 1 {released_by_job})"
    )


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0008's: a batch copy of the table would drop `jobs`, and with it, by
    # their foreign keys' ON DELETE CASCADE, every job's events and metadata)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN held_seconds")
    else:
        op.drop_column("jobs", "held_seconds")
