"""job_logs: the end of each run's worker log, saved as the run ended on Kubernetes (its pods' logs go
with the pods: a JobSet deleted when its job is paused, cancelled or resumed, or past its TTL)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_logs",
        sa.Column("job_seq", sa.BigInteger(), nullable=False),
        sa.Column("run", sa.Integer(), nullable=False),
        sa.Column("saved_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("truncated", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["job_seq"], ["jobs.seq"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_seq", "run"),
    )


def downgrade() -> None:
    op.drop_table("job_logs")
