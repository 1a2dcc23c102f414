"""SQL tables (storage). The wire format lives in api/schemas.py; Alembic migrations create these."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, Integer, Text, UniqueConstraint, false
from sqlmodel import Field, SQLModel

from worker.config import JobSpec
from worker.protocol import MAX_COUNT

MAX_ID = MAX_COUNT  # the largest id (BIGINT); a larger one in a request is refused, not sent to the database


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def _ts(nullable: bool = True) -> Any:
    return Field(default=None, sa_type=DateTime(timezone=True), nullable=nullable)


class Job(SQLModel, table=True):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_seq", "tenant", "seq"),
        Index("ix_jobs_tenant_status_seq", "tenant", "status", "seq"),
        Index("ix_jobs_status_seq", "status", "seq"),
    )

    # seq orders the list (newest first) and backs the cursor; id is the public, unguessable name.
    seq: int | None = Field(
        default=None, sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    )
    id: str = Field(max_length=32, unique=True, index=True)
    tenant: str = Field(default="default", max_length=64)
    name: str = Field(max_length=128)
    status: str = Field(max_length=16)
    model: str = Field(max_length=32)
    method: str = Field(max_length=8)
    spec: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    executor: str = Field(max_length=16)

    created_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    started_at: datetime | None = _ts()
    finished_at: datetime | None = _ts()
    launched_at: datetime | None = _ts()
    # When it last took its chips: launched, or let start after the platform held it (Kueue); NULL while
    # it waits queued. Until it ends, or is preempted, it holds them (api.tenants.spent, the usage report).
    admitted_at: datetime | None = _ts()
    cancel_requested_at: datetime | None = _ts()
    # When its workers last reported (any report): a running job silent for TPUTUNE_STALL_MINUTES is
    # stopped and run again from its last checkpoint (api.dispatcher).
    reported_at: datetime | None = _ts()

    status_message: str | None = Field(default=None, max_length=2000)
    step: int = 0
    total_steps: int | None = None
    epoch: float | None = None
    eta_seconds: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    # Token accuracy (0..1), training and held out (migration 0022).
    accuracy: float | None = None
    eval_accuracy: float | None = None
    # A dpo job's rewards, chosen and rejected, training and held out (migration 0024).
    chosen_reward: float | None = None
    rejected_reward: float | None = None
    eval_chosen_reward: float | None = None
    eval_rejected_reward: float | None = None
    learning_rate: float | None = None
    tokens_per_second: float | None = None
    trained_tokens: int = Field(default=0, sa_type=BigInteger)
    restarts: int = 0
    # Moves from running back to queued (Kueue preempted it): api.tenants.spent reads when such a job ran
    # from its status events.
    preemptions: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    # Times it was paused (POST /jobs/{id}/pause); like a preempted one, api.tenants.spent reads its moves.
    pauses: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    # Times it was resumed after it failed (POST /jobs/{id}/resume); like a paused one, api.tenants.spent
    # reads its moves (the time it lay failed held nothing).
    retries: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    # What the worker reported its data came to (worker.protocol.DataFigures), once it packed it.
    # (None as SQL NULL, not JSON's null: a row copied with its None, or a Job object inserted, reads back
    # as NULL on both databases)
    data_stats: dict[str, Any] | None = Field(
        default=None, sa_column=Column(JSON(none_as_null=True), nullable=True)
    )
    # The seconds it held its chips before it last let them go (preempted, held for quota by Kueue, paused):
    # with the time since `admitted_at`, what it has held in all (its `usage` in GET /jobs/{id}).
    held_seconds: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})
    error_code: str | None = Field(default=None, max_length=64)
    error_message: str | None = Field(default=None, max_length=4000)
    output_uri: str = Field(max_length=2048)
    checkpoint_uri: str | None = Field(default=None, max_length=2048)
    # The step whose weights its export holds, as its result reported it (migration 0023).
    exported_step: int | None = None

    token_hash: str | None = Field(default=None, max_length=64)
    launch: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class JobMetadata(SQLModel, table=True):
    """Metadata pairs, one row each, so `GET /jobs?metadata[k]=v` is an indexed lookup."""

    __tablename__ = "job_metadata"
    __table_args__ = (Index("ix_job_metadata_key_value", "key", "value"),)

    job_seq: int = Field(sa_type=BigInteger, foreign_key="jobs.seq", primary_key=True, ondelete="CASCADE")
    key: str = Field(max_length=64, primary_key=True)
    value: str = Field(max_length=512)


class JobEvent(SQLModel, table=True):
    __tablename__ = "job_events"
    __table_args__ = (
        UniqueConstraint("job_seq", "dedupe_key", name="uq_job_events_dedupe"),
        Index("ix_job_events_job_id", "job_seq", "id"),
        Index("ix_job_events_job_type_step", "job_seq", "type", "step"),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    )
    job_seq: int = Field(sa_type=BigInteger, foreign_key="jobs.seq", ondelete="CASCADE")
    created_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    type: str = Field(max_length=16)
    level: str = Field(default="info", max_length=8)
    message: str = Field(default="", max_length=4000)
    step: int | None = None
    data: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # Set for worker reports: `kind:step:key`, so a retried report is stored once.
    dedupe_key: str | None = Field(default=None, max_length=128)


class JobLog(SQLModel, table=True):
    """The end of a run's worker log, saved as the run ended where the log goes with it (a pod's): one row
    a run, `run` being the job's pauses + retries while it ran."""

    __tablename__ = "job_logs"

    job_seq: int = Field(sa_type=BigInteger, foreign_key="jobs.seq", primary_key=True, ondelete="CASCADE")
    run: int = Field(primary_key=True)
    saved_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    text: str = Field(default="", sa_type=Text)
    truncated: bool = False


class UsageSpan(SQLModel, table=True):
    """A deleted job's time holding its chips: one row for each stretch of it (from its launch or
    admission until it ended, or was preempted or paused), with what `api.tenants.spent` needs to count it
    as it counted the job (its team, its resources' JSON, the tokens it trained on). Its job and events are
    gone (DELETE /jobs/{id}, or TPUTUNE_JOB_RETENTION_DAYS); what it used stays in GET /usage and in its
    team's monthly chip-hours."""

    __tablename__ = "usage_spans"
    __table_args__ = (Index("ix_usage_spans_ended", "ended"),)

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    )
    job_id: str = Field(max_length=32)
    tenant: str = Field(max_length=64)
    resources: str = Field(sa_type=Text)
    began: datetime = Field(sa_type=DateTime(timezone=True), nullable=False)
    ended: datetime = Field(sa_type=DateTime(timezone=True), nullable=False)
    trained_tokens: int = Field(default=0, sa_type=BigInteger)


class IdempotencyKey(SQLModel, table=True):
    __tablename__ = "idempotency_keys"

    tenant: str = Field(max_length=64, primary_key=True)
    key: str = Field(max_length=255, primary_key=True)
    request_hash: str = Field(max_length=64)
    job_id: str = Field(max_length=32)
    created_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)


class KeyUsage(SQLModel, table=True):
    """What one server (replica) has used of each API key's limits, for the other replicas (api.usage): the
    rate-limit tokens it spent since the row was made (`since`), and the streams it follows now. The row with
    key_digest 0 is the server's heartbeat. Keys are named by api.mapped.digest (as a signed BIGINT)."""

    __tablename__ = "key_usage"

    replica: str = Field(max_length=64, primary_key=True)
    key_digest: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    since: float  # (the writer's clock, time.time(); a row made again has another)
    spent: float = 0.0
    streams: int = 0
    seen_at: float


class ApiKey(SQLModel, table=True):
    """An API key of a tenant: only its hash is stored; `prefix` is the visible part, for humans.
    `last_used_at` is written by each API process about once a minute (api.auth.Authenticator.flush_uses)."""

    __tablename__ = "api_keys"

    id: str = Field(max_length=32, primary_key=True)
    tenant: str = Field(max_length=64, index=True)
    name: str = Field(max_length=128)
    prefix: str = Field(max_length=32)
    key_hash: str = Field(max_length=64, unique=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    revoked_at: datetime | None = _ts()
    expires_at: datetime | None = _ts()
    last_used_at: datetime | None = _ts()
    # An admin key: manages keys, and sees and acts on every tenant's jobs (as TPUTUNE_ADMIN_KEY does).
    admin: bool = Field(default=False, sa_column_kwargs={"server_default": false()})
    # A read-only key: it reads what its role may read, and changes nothing (api.deps.caller refuses it any
    # request but GET/HEAD). A read-only admin key is an auditor's: every team's jobs, keys and usage.
    read_only: bool = Field(default=False, sa_column_kwargs={"server_default": false()})


class Tenant(SQLModel, table=True):
    """A tenant's own limits on what its jobs hold at once and how many may wait, and where they may read
    and write, where an admin set them (PATCH /admin/tenants/{name}). A tenant without a row, or a limit
    NULL here, has the server's (TPUTUNE_TENANT_MAX_ACTIVE_JOBS/CHIPS, TPUTUNE_TENANT_MAX_QUEUED_JOBS,
    TPUTUNE_TENANT_DATA_PREFIXES); -1 (api.tenants.UNLIMITED): no limit, whatever the server's.
    api.tenants.Limits says what holds."""

    __tablename__ = "tenants"

    name: str = Field(max_length=64, primary_key=True)
    max_active_jobs: int | None = None
    max_active_chips: int | None = None
    max_queued_jobs: int | None = None
    max_chip_hours_per_month: int | None = None
    # Where its jobs may read and write (api.validation.check_data_scope): prefixes, or "any" (anywhere,
    # whatever the server's); NULL: the server's (TPUTUNE_TENANT_DATA_PREFIXES).
    data_prefixes: list[str] | str | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    updated_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    updated_by: str | None = Field(default=None, max_length=64)  # who set them, as Principal.who says


class Webhook(SQLModel, table=True):
    """An endpoint of a tenant's that is told of its jobs' moves (api.webhooks), signed with `secret` as
    Standard Webhooks does. The secret is kept as it is (the server signs with it), shown once."""

    __tablename__ = "webhooks"

    id: str = Field(max_length=32, primary_key=True)
    tenant: str = Field(max_length=64, index=True)
    url: str = Field(max_length=2048)
    events: list[str] = Field(sa_column=Column(JSON, nullable=False))
    description: str | None = Field(default=None, max_length=256)
    secret: str = Field(max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    created_by: str | None = Field(default=None, max_length=64)  # as Principal.who says
    # When every attempt since began to fail (None: the last one was delivered, or none failed yet).
    failing_since: datetime | None = _ts()
    # Set while nothing is sent to it: disabled by a user, or by the sender once it failed for
    # TPUTUNE_WEBHOOK_DISABLE_AFTER_HOURS; why, in a sentence.
    disabled_at: datetime | None = _ts()
    disabled_reason: str | None = Field(default=None, max_length=500)
    # When it was last enabled again: it hears of the moves made since (and since `created_at`), not of
    # those made while it was disabled.
    enabled_at: datetime | None = _ts()
    # The secret before the last rotation: deliveries are signed with it too until `old_secret_until`.
    old_secret: str | None = Field(default=None, max_length=64)
    old_secret_until: datetime | None = _ts()


class WebhookDelivery(SQLModel, table=True):
    """One event for one endpoint: its body (fixed, so every attempt sends the same), and how sending it
    went. `event_id` is the job event (a status event) it tells of; NULL for a test ping."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("webhook_id", "event_id", name="uq_webhook_deliveries_event"),
        Index("ix_webhook_deliveries_webhook_id", "webhook_id", "id"),
        Index("ix_webhook_deliveries_job", "webhook_id", "job_id", "id"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_hook_due", "webhook_id", "status", "next_attempt_at"),
    )

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    )
    webhook_id: str = Field(max_length=32, foreign_key="webhooks.id", ondelete="CASCADE")
    event_id: int | None = Field(default=None, sa_type=BigInteger)
    type: str = Field(max_length=32)
    job_id: str | None = Field(default=None, max_length=32)
    body: str = Field(sa_column=Column(Text, nullable=False))
    status: str = Field(default="pending", max_length=16)  # pending, delivered, failed
    attempts: int = 0
    created_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    next_attempt_at: datetime | None = _ts()
    last_attempt_at: datetime | None = _ts()
    response_status: int | None = None
    last_error: str | None = Field(default=None, max_length=500)


class WebhookCursor(SQLModel, table=True):
    """Where the webhook sender's reading of job events stands: every status event up to `event_id` was
    looked at (one row, id 1)."""

    __tablename__ = "webhook_cursor"

    id: int = Field(default=1, primary_key=True)
    event_id: int = Field(default=0, sa_type=BigInteger)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)


class AuditEvent(SQLModel, table=True):
    """A change to who may do what, and to what a team may use: a key made, rotated or revoked, a team's
    limits or data prefixes set, a webhook endpoint added, changed or deleted; and a job deleted. Who did
    it, when, and what changed (never a secret). Written in the change's own transaction
    (api.audit.record): no change without its event. Read with GET /audit."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_tenant_id", "tenant", "id"),)

    id: int | None = Field(
        default=None, sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    )
    at: datetime = Field(default_factory=utcnow, sa_type=DateTime(timezone=True), nullable=False)
    action: str = Field(max_length=32)  # api.audit.ACTIONS
    tenant: str = Field(max_length=64)  # the team whose key, limits or endpoint it was ("*": every team's)
    target: str = Field(max_length=64)  # the key's or endpoint's id, or the team's name
    actor_key_id: str = Field(max_length=32)  # the caller's key: an id, "admin" or "anonymous" (Principal)
    actor_tenant: str = Field(max_length=64)
    request_id: str | None = Field(default=None, max_length=64)
    details: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


# A job's spec never changes after it is created: validate it once per process, not on every read. A few
# thousand at most: each is ~10 objects the garbage collector walks on every full collection, and with
# 20,000 cached a full collection paused the server for ~130 ms (p99 of POST /jobs at 64 clients).
_SPECS: dict[str, JobSpec] = {}
_SPECS_MAX = 4_096


def job_spec(job: Any) -> JobSpec:
    """The validated spec of `job` (a Job or a row with its `id` and `spec`, a dict or its JSON text);
    shared: do not modify it."""
    spec = _SPECS.get(job.id)
    if spec is None:
        if isinstance(job.spec, str):
            spec = JobSpec.model_validate_json(job.spec)
        else:
            spec = JobSpec.model_validate(job.spec)
        if len(_SPECS) >= _SPECS_MAX:
            del _SPECS[next(iter(_SPECS))]  # the oldest
        _SPECS[job.id] = spec
    return spec
