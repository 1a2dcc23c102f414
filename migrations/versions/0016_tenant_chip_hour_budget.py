"""tenants.max_chip_hours_per_month: the chip-hours a tenant's jobs may hold in a calendar month

NULL: the server's TPUTUNE_TENANT_MAX_CHIP_HOURS_PER_MONTH (none by default); -1: none, whatever the
server's. The tenants stored before keep the server's.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_chip_hours_per_month", sa.Integer(), nullable=True))


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0013's, not a batch copy of the table)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE tenants DROP COLUMN max_chip_hours_per_month")
    else:
        op.drop_column("tenants", "max_chip_hours_per_month")
