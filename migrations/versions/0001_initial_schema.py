"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("tenant", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("key", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=False),
        sa.Column("request_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "key"),
    )
    op.create_table(
        "jobs",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("tenant", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("model", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("method", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("executor", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("launched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status_message", sqlmodel.sql.sqltypes.AutoString(length=2000), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=True),
        sa.Column("epoch", sa.Float(), nullable=True),
        sa.Column("eta_seconds", sa.Float(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
        sa.Column("learning_rate", sa.Float(), nullable=True),
        sa.Column("tokens_per_second", sa.Float(), nullable=True),
        sa.Column("trained_tokens", sa.BigInteger(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("error_code", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("error_message", sqlmodel.sql.sqltypes.AutoString(length=4000), nullable=True),
        sa.Column("output_uri", sqlmodel.sql.sqltypes.AutoString(length=2048), nullable=False),
        sa.Column("checkpoint_uri", sqlmodel.sql.sqltypes.AutoString(length=2048), nullable=True),
        sa.Column("token_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("launch", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_id"), ["id"], unique=True)
        batch_op.create_index("ix_jobs_status_seq", ["status", "seq"], unique=False)
        batch_op.create_index("ix_jobs_tenant_seq", ["tenant", "seq"], unique=False)
        batch_op.create_index("ix_jobs_tenant_status_seq", ["tenant", "status", "seq"], unique=False)

    op.create_table(
        "job_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_seq", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("type", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("level", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=False),
        sa.Column("message", sqlmodel.sql.sqltypes.AutoString(length=4000), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.Column("dedupe_key", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
        sa.ForeignKeyConstraint(["job_seq"], ["jobs.seq"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_seq", "dedupe_key", name="uq_job_events_dedupe"),
    )
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.create_index("ix_job_events_job_id", ["job_seq", "id"], unique=False)
        batch_op.create_index("ix_job_events_job_type_step", ["job_seq", "type", "step"], unique=False)

    op.create_table(
        "job_metadata",
        sa.Column("job_seq", sa.BigInteger(), nullable=False),
        sa.Column("key", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("value", sqlmodel.sql.sqltypes.AutoString(length=512), nullable=False),
        sa.ForeignKeyConstraint(["job_seq"], ["jobs.seq"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_seq", "key"),
    )
    with op.batch_alter_table("job_metadata", schema=None) as batch_op:
        batch_op.create_index("ix_job_metadata_key_value", ["key", "value"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_metadata", schema=None) as batch_op:
        batch_op.drop_index("ix_job_metadata_key_value")

    op.drop_table("job_metadata")
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_index("ix_job_events_job_type_step")
        batch_op.drop_index("ix_job_events_job_id")

    op.drop_table("job_events")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_tenant_status_seq")
        batch_op.drop_index("ix_jobs_tenant_seq")
        batch_op.drop_index("ix_jobs_status_seq")
        batch_op.drop_index(batch_op.f("ix_jobs_id"))

    op.drop_table("jobs")
    op.drop_table("idempotency_keys")
