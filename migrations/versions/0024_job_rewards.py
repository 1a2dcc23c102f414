"""jobs.chosen_reward, rejected_reward, eval_chosen_reward, eval_rejected_reward: a dpo job's latest
rewards, training and held out, as its worker reported them (null for other jobs)

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward")


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
