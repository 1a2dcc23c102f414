"""webhooks.failing_since, disabled_at, disabled_reason, enabled_at: endpoints disabled and enabled again;
old_secret, old_secret_until: a secret rotated; an index of each endpoint's due deliveries

An endpoint that failed every delivery for TPUTUNE_WEBHOOK_DISABLE_AFTER_HOURS is disabled (nothing more is
written or sent to it) until its team enables it again (PATCH /webhooks/{id}); it then hears of the moves
made since. The endpoints stored before were enabled from their creation, with no failure streak known.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("failing_since", "disabled_at", "disabled_reason", "enabled_at", "old_secret", "old_secret_until")


def upgrade() -> None:
    op.add_column("webhooks", sa.Column("failing_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("webhooks", sa.Column("disabled_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "webhooks",
        sa.Column("disabled_reason", sqlmodel.sql.sqltypes.AutoString(length=500), nullable=True),
    )
    op.add_column("webhooks", sa.Column("enabled_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "webhooks", sa.Column("old_secret", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True)
    )
    op.add_column("webhooks", sa.Column("old_secret_until", sa.DateTime(timezone=True), nullable=True))
    # each endpoint's due deliveries, oldest first: read one endpoint at a time in a backlog
    op.create_index(
        "ix_webhook_deliveries_hook_due", "webhook_deliveries", ["webhook_id", "status", "next_attempt_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_hook_due", table_name="webhook_deliveries")
    # (SQLite's own DROP COLUMN, as 0010's: a batch copy of the table would drop `webhooks`, and with it,
    # by their foreign key's ON DELETE CASCADE, every endpoint's deliveries)
    for column in reversed(COLUMNS):
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE webhooks DROP COLUMN {column}")
        else:
            op.drop_column("webhooks", column)
