"""tenants.data_prefixes: where a tenant's jobs may read and write, where an admin set it

A list of gs:// or local directory prefixes, or "any" (anywhere, whatever the server's); NULL: the
server's TPUTUNE_TENANT_DATA_PREFIXES (empty by default: anywhere, as before). The tenants stored before
keep the server's.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("data_prefixes", sa.JSON(), nullable=True))


def downgrade() -> None:
    # (SQLite's own DROP COLUMN, as 0010's and 0012's, not a batch copy of the table)
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE tenants DROP COLUMN data_prefixes")
    else:
        op.drop_column("tenants", "data_prefixes")
