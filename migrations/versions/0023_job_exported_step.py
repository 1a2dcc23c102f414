"""jobs.exported_step: the step whose weights a succeeded job's export holds (its last, or with
export_best the one of its lowest eval loss), as its worker's result reported it

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("exported_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0013's, not a batch copy of the table)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs DROP COLUMN exported_step")
    else:
        op.drop_column("jobs", "exported_step")
