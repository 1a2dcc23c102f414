"""Rows kept for a while only, deleted by the dispatcher (the leader's) once an hour: idempotency keys
past TPUTUNE_IDEMPOTENCY_KEY_HOURS (a request with one after that makes a new job), audit events past
TPUTUNE_AUDIT_RETENTION_DAYS (unset: kept), jobs that ended more than TPUTUNE_JOB_RETENTION_DAYS ago
(unset: kept; api.deletion, as DELETE /jobs/{id}). (Webhook deliveries done:
api.webhooks.WebhookSender.cleanup.) Audit events go in batches of BATCH rows, jobs in batches of
api.deletion.BATCH, a transaction each: a year of them at once would hold SQLite's write lock, and every
writer behind it, for as long."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from api import deletion
from api.db import session_scope
from api.models import AuditEvent, IdempotencyKey, utcnow
from api.settings import Settings

EVERY_SECONDS = 3600.0
BATCH = 10_000


def _commit_if(session: Session, deleted: int) -> None:
    """Commit what was deleted; nothing deleted, no commit (an hourly pass of a quiet server writes
    nothing)."""
    if deleted:
        session.commit()
    else:
        session.rollback()


def prune(
    engine: Engine, settings: Settings, now: datetime | None = None, forget: deletion.Forget | None = None
) -> dict[str, int]:
    """Delete what is past its time; how many rows of each table went. `forget`: what removes what is left
    of a deleted job's runs (the executor's; None: nothing outside the database)."""
    now = now or utcnow()
    pruned = {"idempotency_keys": 0, "audit_events": 0, "jobs": 0}
    if settings.job_retention_days is not None:
        jobs_before = now - timedelta(days=settings.job_retention_days)
        pruned["jobs"] = deletion.delete_ended_before(engine, jobs_before, forget or (lambda job: None))
    with session_scope(engine) as session:
        keys_before = now - timedelta(hours=settings.idempotency_key_hours)
        result = session.execute(delete(IdempotencyKey).where(col(IdempotencyKey.created_at) < keys_before))
        pruned["idempotency_keys"] = result.rowcount  # type: ignore[attr-defined]
        _commit_if(session, result.rowcount)  # type: ignore[attr-defined]
        if settings.audit_retention_days is None:
            return pruned
        audit_before = now - timedelta(days=settings.audit_retention_days)
        while True:
            # (the oldest first: ids grow with time, so the scan stops at the first BATCH it finds)
            oldest = (
                select(AuditEvent.id).where(col(AuditEvent.at) < audit_before).order_by(col(AuditEvent.id))
            )
            result = session.execute(delete(AuditEvent).where(col(AuditEvent.id).in_(oldest.limit(BATCH))))
            pruned["audit_events"] += result.rowcount  # type: ignore[attr-defined]
            _commit_if(session, result.rowcount)  # type: ignore[attr-defined]
            if result.rowcount < BATCH:  # type: ignore[attr-defined]
                return pruned
