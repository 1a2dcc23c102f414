"""tenants.max_queued_jobs: how many jobs a tenant may have waiting to start

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_queued_jobs", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:  # (SQLite drops a column by copying the table)
        batch.drop_column("max_queued_jobs")
