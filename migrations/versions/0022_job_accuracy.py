"""jobs.accuracy, jobs.eval_accuracy: the job's latest token accuracy, training and held out, as its
worker reported them (the share of the trained target tokens the model ranks first)

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("accuracy", "eval_accuracy")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("jobs", sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    for name in COLUMNS:
        # (SQLite's own DROP COLUMN, as 0013's, not a batch copy of the table)
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE jobs DROP COLUMN {name}")
        else:
            op.drop_column("jobs", name)
