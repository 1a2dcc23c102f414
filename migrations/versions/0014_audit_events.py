"""audit_events: who made, rotated or revoked a key, set a team's limits or data prefixes, or added,
changed or deleted a webhook endpoint; when, and what changed

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("action", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("tenant", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("target", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("actor_key_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("actor_tenant", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("request_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_events_tenant_id", "audit_events", ["tenant", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_tenant_id", table_name="audit_events")
    op.drop_table("audit_events")
