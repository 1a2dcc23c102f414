"""Deleting ended jobs: one at a time (DELETE /jobs/{id}, `tputune delete`), or every job that ended
more than TPUTUNE_JOB_RETENTION_DAYS ago (the dispatcher's housekeeping, api.housekeeping).

A job goes with all it has in the database: its events (the loss history among them), its metadata, its
saved logs, the idempotency keys that named it; and what is left of its runs (the executor's `forget`):
its records in the job's directory on the local executor (its config, its runner's files and its
workers' logs), its JobSet on GKE (kept for its pods' logs until its TTL, a failed one's until resumed).
Not its outputs: the model and the checkpoints it wrote stay where they are (its `output_uri`), for their
owner to delete.

What it used stays counted: as it goes, the stretches in which it held its chips are kept (api.models.
UsageSpan), so GET /usage, and its team's chip-hours this month (its budget), count it as they did. And
webhooks still tell of its moves: the deliveries of status events the sender has not read yet are
written as it goes (api.webhooks.deliver_before_deleting).

Only an ended job (succeeded, failed, cancelled): a paused one may be resumed, a running one holds chips.
The jobs are claimed first (their rows written: PostgreSQL locks them, SQLite takes its write lock), so a
job resumed at the same time is either resumed or deleted, never deleted with its use counted twice."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime

from sqlalchemy import delete, update
from sqlalchemy import select as sa_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from api import audit
from api.auth import Principal
from api.db import session_scope
from api.errors import ApiError
from api.jobs import get_job
from api.models import IdempotencyKey, Job, UsageSpan, utcnow
from api.states import FINAL
from api.tenants import holding_spans, shape_of
from api.webhooks import deliver_before_deleting

log = logging.getLogger(__name__)

ENDED = tuple(sorted(status.value for status in FINAL))
BATCH = 20  # jobs deleted in one transaction by the retention (each with all its events)


def not_ended(job: Job) -> ApiError:
    return ApiError(
        409,
        "job_not_ended",
        f"Job {job.id} is {job.status}; only a job that ended (succeeded, failed or cancelled) can be "
        f"deleted. Cancel it first (POST /jobs/{job.id}/cancel), then delete it.",
    )


Forget = Callable[[Job], None]


def delete_job(session: Session, principal: Principal, job_id: str, forget: Forget) -> Job:
    """Delete the job `job_id` (of the caller's tenant; the admin key: any) if it ended; 404 if it is not
    one of the tenant's, 409 if it has not ended. Then `forget` what is left of its runs (the executor's).
    Returns it as it was."""
    job = get_job(session, principal.scope, job_id)
    if job.status not in FINAL:
        raise not_ended(job)
    gone = _delete(session, [job.seq])  # type: ignore[list-item]
    if not gone:  # (it moved meanwhile: resumed)
        session.rollback()
        raise not_ended(get_job(session, principal.scope, job_id))
    [job] = gone
    audit.record(
        session,
        principal,
        "job.deleted",
        job.tenant,
        job.id,
        {
            "name": job.name,
            "status": job.status,
            "created_at": audit.when(job.created_at),
            "finished_at": audit.when(job.finished_at),
            "output_uri": job.output_uri,
        },
    )
    session.commit()
    _forget(forget, job)
    return job


def delete_ended_before(engine: Engine, before: datetime, forget: Forget) -> int:
    """Delete every job that ended before `before`, BATCH a transaction (the oldest first); how many went.
    (Not one audit event each: the server's setting deleted them, and its log says how many.)"""
    deleted = 0
    while True:
        with session_scope(engine) as session:
            query = (
                sa_select(Job.seq)  # type: ignore[call-overload]
                .where(col(Job.status).in_(ENDED), col(Job.finished_at) < before)
                .order_by(col(Job.seq))
                .limit(BATCH)
            )
            seqs = list(session.execute(query).scalars())
            if not seqs:
                return deleted
            gone = _delete(session, seqs)
            session.commit()
        for job in gone:
            _forget(forget, job)
        deleted += len(gone)
        if len(seqs) < BATCH:
            return deleted


def _forget(forget: Forget, job: Job) -> None:
    try:
        forget(job)
    except Exception:  # (deleted all the same: what is left of its run stays, a JobSet until its TTL)
        log.warning("could not remove what is left of the runs of deleted job %s", job.id, exc_info=True)


def _delete(session: Session, seqs: Sequence[int]) -> list[Job]:
    """Delete those of the jobs `seqs` that ended, in `session`'s transaction (not committed): keep what they
    used, write their webhooks' deliveries not written yet, forget their idempotency keys. Returns them."""
    jobs = Job.__table__  # type: ignore[attr-defined]
    ended = [jobs.c.seq.in_(seqs), jobs.c.status.in_(ENDED)]
    # Claimed first: written, their rows are this transaction's until it ends (a resume waits, then finds
    # none), and what is read next is what is deleted.
    session.execute(update(jobs).where(*ended).values(updated_at=utcnow()))
    # (with each job's resources as `spent` reads them: its spec's JSON text, as the database writes it)
    query = select(Job, shape_of(jobs.c)).where(col(Job.seq).in_(seqs), col(Job.status).in_(ENDED))
    rows = session.exec(query.execution_options(populate_existing=True)).all()
    if not rows:
        return []
    found = [job for job, _ in rows]
    stretches = holding_spans(session, found)
    spans = [
        {
            "job_id": job.id,
            "tenant": job.tenant,
            "resources": resources or "{}",
            "began": began,
            "ended": ended,
            "trained_tokens": job.trained_tokens,
        }
        for job, resources in rows
        for began, ended in stretches[job.seq]  # type: ignore[index]
    ]
    if spans:
        session.execute(UsageSpan.__table__.insert(), spans)  # type: ignore[attr-defined]
    seqs = [job.seq for job in found]  # type: ignore[misc]
    deliver_before_deleting(session, seqs)
    for tenant in {job.tenant for job in found}:
        ids = [job.id for job in found if job.tenant == tenant]
        session.execute(
            delete(IdempotencyKey).where(
                col(IdempotencyKey.tenant) == tenant, col(IdempotencyKey.job_id).in_(ids)
            )
        )
    # (their events, metadata and saved logs by their foreign keys' ON DELETE CASCADE)
    session.execute(delete(jobs).where(jobs.c.seq.in_(seqs)))
    for job in found:
        session.expunge(job)
    return found
