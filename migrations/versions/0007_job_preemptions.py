"""jobs.preemptions: how often a running job was preempted back to the queue (Kueue)

The usage report reads when such a job ran from its moves; the others' rows say it on their own.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0"))
    # The jobs preempted before: from their moves (status events) from running back to queued.
    if op.get_bind().dialect.name == "postgresql":
        moved = "e.data->>'from' = 'running' AND e.data->>'status' = 'queued'"
    else:
        moved = "json_extract(e.data, '$.from') = 'running' AND json_extract(e.data, '$.status') = 'queued'"
    preempted = f"FROM job_events e WHERE e.type = 'status' AND {moved}"
    op.execute(
        f"UPDATE jobs SET preemptions = (SELECT count(*) {preempted} AND e.job_seq = jobs.seq) "
        f"WHERE seq IN (SELECT e.job_seq {preempted})"
    )


def downgrade() -> None:
    # (SQLite's own DROP COLUMN: a batch copy of the table would drop `jobs`, and with it, by their foreign
    # keys' ON DELETE CASCADE, every job's events and metadata)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN preemptions")
    else:
        op.drop_column("jobs", "preemptions")
