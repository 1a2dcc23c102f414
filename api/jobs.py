"""What the API does with jobs: create, read, list, cancel, move through states, ingest worker reports.

Route handlers call these functions; the dispatcher and executors use `transition` and `add_event`.
Every status change goes through `transition`, a conditional UPDATE that applies only if the job is
still in the status the caller saw, so two actors (a cancel request and the dispatcher, say) never
overwrite each other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, exists, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from api.db import read_connection
from api.errors import ApiError, not_found
from api.models import IdempotencyKey, Job, JobEvent, JobMetadata, as_utc, utcnow
from api.settings import Settings
from api.states import FINAL, JobStatus, check_transition
from api.validation import check_spec
from worker.config import JobSpec
from worker.protocol import (
    CheckpointReport,
    ErrorReport,
    EvalReport,
    MetricsReport,
    ProgressAck,
    ProgressBatch,
    ResultReport,
    SampleReport,
    StatusReport,
    WarningReport,
)

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def new_job_id() -> str:
    # Lowercase alphanumerics: the id names Kubernetes objects and process groups too.
    return "ft-" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))


def new_job_token() -> tuple[str, str]:
    token = secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _request_hash(spec: JobSpec) -> str:
    return hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def default_output_uri(settings: Settings, job_id: str) -> str:
    if settings.executor == "kubernetes" and settings.k8s_output_base_uri:
        return f"{settings.k8s_output_base_uri.rstrip('/')}/{job_id}"
    return str(settings.jobs_dir / job_id / "output")


# --- create / read ---------------------------------------------------------------------------------


def create_job(
    session: Session, spec: JobSpec, settings: Settings, tenant: str, idempotency_key: str | None = None
) -> tuple[Job, bool]:
    """Insert a queued job; returns (job, created). A repeated Idempotency-Key returns the first job."""
    check_spec(spec, settings)
    request_hash = _request_hash(spec)
    if idempotency_key is not None:
        existing = _job_for_key(session, tenant, idempotency_key, request_hash)
        if existing is not None:
            return existing, False
    job_id = new_job_id()
    job = Job(
        id=job_id,
        tenant=tenant,
        name=spec.name,
        status=JobStatus.queued,
        model=spec.model,
        method=spec.method.type,
        spec=spec.model_dump(mode="json"),
        executor=settings.executor,
        output_uri=spec.output_uri or default_output_uri(settings, job_id),
        status_message="Waiting for the dispatcher to start it.",
    )
    session.add(job)
    session.flush()
    assert job.seq is not None
    for key, value in spec.metadata.items():
        session.add(JobMetadata(job_seq=job.seq, key=key, value=value))
    session.add(
        JobEvent(job_seq=job.seq, type="status", message="Job created and queued.", data={"status": "queued"})
    )
    if idempotency_key is not None:
        session.add(
            IdempotencyKey(tenant=tenant, key=idempotency_key, request_hash=request_hash, job_id=job_id)
        )
    try:
        session.commit()
    except IntegrityError:
        # Another request with the same key won the race: answer with its job.
        session.rollback()
        if idempotency_key is None:
            raise
        existing = _job_for_key(session, tenant, idempotency_key, request_hash)
        if existing is None:
            raise
        return existing, False
    return job, True


def _job_for_key(session: Session, tenant: str, key: str, request_hash: str) -> Job | None:
    record = session.get(IdempotencyKey, (tenant, key))
    if record is None:
        return None
    if record.request_hash != request_hash:
        raise ApiError(
            409,
            "idempotency_key_reused",
            "This Idempotency-Key was already used with another request body; use a new key for a new job.",
        )
    return session.exec(select(Job).where(Job.id == record.job_id)).one()


def get_job(session: Session, tenant: str, job_id: str) -> Job:
    job = session.exec(select(Job).where(Job.id == job_id, Job.tenant == tenant)).first()
    if job is None:
        raise not_found(job_id)
    return job


# The columns a job's public view needs (not its token hash or launch record).
JOB_COLUMNS = (
    *("id", "name", "status", "status_message", "model", "method", "executor", "spec"),
    *("created_at", "started_at", "finished_at", "step", "total_steps", "epoch", "eta_seconds", "loss"),
    *("eval_loss", "learning_rate", "tokens_per_second", "trained_tokens", "restarts", "error_code"),
    *("error_message", "output_uri", "checkpoint_uri"),
)


_table = Job.__table__  # type: ignore[attr-defined]
_READ_JOB = select(*(_table.c[name] for name in JOB_COLUMNS)).where(
    _table.c.id == bindparam("job_id"), _table.c.tenant == bindparam("tenant")
)


def read_job_row(engine: Engine, tenant: str, job_id: str) -> Any | None:
    """The job as a plain row (the `JOB_COLUMNS` as attributes), or None; for reading only: no ORM
    object, no session, no transaction, and a statement built once (building it cost more than running
    it)."""
    with read_connection(engine) as connection:
        return connection.execute(_READ_JOB, {"job_id": job_id, "tenant": tenant}).first()


def list_jobs(
    session: Session,
    tenant: str,
    *,
    status: Sequence[str] = (),
    metadata: dict[str, str] | None = None,
    after: str | None = None,
    limit: int = 20,
) -> tuple[list[Any], bool]:
    """A page of the tenant's jobs, newest first: rows with the `Job` columns as attributes."""
    query = select(Job).where(Job.tenant == tenant)
    if status:
        query = query.where(col(Job.status).in_(list(status)))
    for key, value in (metadata or {}).items():
        query = query.where(
            exists().where(
                col(JobMetadata.job_seq) == col(Job.seq),
                col(JobMetadata.key) == key,
                col(JobMetadata.value) == value,
            )
        )
    if after is not None:
        cursor = session.exec(select(Job.seq).where(Job.id == after, Job.tenant == tenant)).first()
        if cursor is None:
            raise ApiError(
                400, "invalid_cursor", f"'after' must be the id of a job in a previous page; {after} is not."
            )
        query = query.where(col(Job.seq) < cursor)
    # Plain rows, not ORM objects (a page is only read): building 50 Job instances cost more than the query.
    table = Job.__table__  # type: ignore[attr-defined]
    statement = query.with_only_columns(*table.columns).order_by(col(Job.seq).desc()).limit(limit + 1)
    rows: list[Any] = list(session.execute(statement).all())
    return rows[:limit], len(rows) > limit


def list_events(
    session: Session, job: Job, *, after: int | None = None, limit: int = 100, types: Sequence[str] = ()
) -> tuple[list[JobEvent], bool]:
    query = select(JobEvent).where(JobEvent.job_seq == job.seq)
    if after is not None:
        query = query.where(col(JobEvent.id) > after)
    if types:
        query = query.where(col(JobEvent.type).in_(list(types)))
    rows = list(session.exec(query.order_by(col(JobEvent.id)).limit(limit + 1)).all())
    return rows[:limit], len(rows) > limit


# --- state changes ---------------------------------------------------------------------------------


def add_event(
    session: Session,
    job: Job,
    type: str,
    message: str,
    *,
    level: str = "info",
    step: int | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    assert job.seq is not None
    session.add(JobEvent(job_seq=job.seq, type=type, level=level, message=message, step=step, data=data))


def transition(
    session: Session, job: Job, target: JobStatus, message: str | None = None, **fields: Any
) -> bool:
    """Move `job` to `target` if it is still in the status it was read with; commit; False if it moved on.

    An invalid transition raises InvalidTransition: it is a bug to ask for one, never silently applied.
    """
    current = job.status
    check_transition(current, target)
    now = utcnow()
    values: dict[str, Any] = {"status": target.value, "updated_at": now, **fields}
    if message is not None:
        values["status_message"] = message
    if target == JobStatus.running and job.started_at is None:
        values.setdefault("started_at", now)
    if target in FINAL:
        values.setdefault("finished_at", now)
        values.setdefault("eta_seconds", None)
    result = session.execute(
        update(Job).where(col(Job.seq) == job.seq, col(Job.status) == current).values(**values)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        session.refresh(job)
        return False
    text = f"{current} → {target.value}" + (f": {message}" if message else "")
    level = "error" if target == JobStatus.failed else "info"
    add_event(session, job, "status", text, level=level, data={"status": target.value, "from": current})
    session.commit()
    session.refresh(job)
    return True


def request_cancel(session: Session, tenant: str, job_id: str) -> Job:
    for _ in range(5):
        job = get_job(session, tenant, job_id)
        if job.status in FINAL:
            raise ApiError(
                409,
                "job_finished",
                f"Job {job_id} already {job.status}; only queued or running jobs can be cancelled.",
            )
        if job.status == JobStatus.cancelling:
            return job
        if job.status == JobStatus.queued and job.launched_at is None:
            done = transition(session, job, JobStatus.cancelled, "Cancelled before it started.")
        else:
            done = transition(
                session,
                job,
                JobStatus.cancelling,
                "Cancel requested; stopping the workers.",
                cancel_requested_at=utcnow(),
            )
        if done:
            return job
    raise ApiError(409, "job_busy", f"Job {job_id} is changing state right now; retry the cancel.")


# --- worker reports --------------------------------------------------------------------------------


def authenticate_worker(session: Session, job_id: str, token: str | None) -> Job:
    job = session.exec(select(Job).where(Job.id == job_id)).first()
    # Same answer for an unknown job and a wrong token: a token holder learns nothing about other jobs.
    if (
        job is None
        or not token
        or not job.token_hash
        or not hmac.compare_digest(job.token_hash, hash_token(token))
    ):
        raise ApiError(
            401,
            "invalid_job_token",
            "The job token is missing or does not belong to this job; workers send "
            "'Authorization: Bearer $TPUTUNE_JOB_TOKEN'.",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return job


def _event_for(report: Any) -> tuple[str, str, str]:
    """(type, level, message) of the event a report becomes."""
    match report:
        case MetricsReport():
            total = f"/{report.total_steps}" if report.total_steps else ""
            loss = f" loss {report.loss:.4f}" if report.loss is not None else ""
            return "metrics", "info", f"step {report.step}{total}:{loss}".rstrip(":")
        case EvalReport():
            return "eval", "info", f"step {report.step}: eval loss {report.eval_loss:.4f}"
        case CheckpointReport():
            return "checkpoint", "info", f"Checkpoint saved at step {report.step}: {report.uri}"
        case SampleReport():
            return "sample", "info", f"Sample {report.phase} training: {report.prompt} → {report.text[:500]}"
        case ResultReport():
            return (
                "result",
                "info",
                "Training finished." + (f" Output: {report.output_uri}" if report.output_uri else ""),
            )
        case ErrorReport():
            return "error", "error", f"{report.code}: {report.message}"
        case WarningReport():
            return "warning", "warn", report.message
        case StatusReport():
            return "status", "info", report.message
    raise AssertionError(report)


def _insert_ignore(session: Session, rows: list[dict[str, Any]]) -> set[str]:
    """Insert event rows, skipping ones whose dedupe key exists; returns the keys inserted."""
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    # The rows are parameters of one statement that SQLAlchemy compiles once and caches (it still sends
    # them as multi-row INSERTs); `.values(rows)` made each batch a new statement to build and compile.
    table = JobEvent.__table__  # type: ignore[attr-defined]
    statement = (
        insert(table)
        .on_conflict_do_nothing(index_elements=["job_seq", "dedupe_key"])
        .returning(table.c.dedupe_key)
    )
    return {row[0] for row in session.execute(statement, rows)}


def ingest_progress(session: Session, job: Job, batch: ProgressBatch) -> ProgressAck:
    now = utcnow()
    by_key: dict[str, Any] = {}
    for report in batch.reports:
        by_key.setdefault(f"{report.kind}:{report.step}:{report.key}", report)
    rows = []
    for dedupe_key, report in by_key.items():
        type_, level, message = _event_for(report)
        data = report.model_dump(mode="json", exclude={"kind", "step", "key"}, exclude_none=True)
        rows.append(
            {
                "job_seq": job.seq,
                "created_at": now,
                "type": type_,
                "level": level,
                "message": message[:4000],
                "step": report.step,
                "data": data,
                "dedupe_key": dedupe_key,
            }
        )
    inserted = _insert_ignore(session, rows)
    fresh = [by_key[k] for k in by_key if k in inserted]
    values = _aggregate(job, fresh)
    if values:
        values["updated_at"] = now
        # A Core UPDATE: the ORM one also re-evaluated it against the objects in the session, for nothing.
        jobs = Job.__table__  # type: ignore[attr-defined]
        session.execute(update(jobs).where(jobs.c.seq == job.seq).values(**values))
    session.commit()
    # Any report, even one already stored, says a worker is alive: one that resumed after Kueue let the
    # job run again repeats reports of its first run.
    if batch.reports and job.status == JobStatus.starting:
        session.refresh(job)
        if job.status == JobStatus.starting:
            # Keep the worker's own status message (e.g. "Compiling") if the batch brought one.
            note = None if "status_message" in values else "The worker is running."
            transition(session, job, JobStatus.running, note)
    return ProgressAck(
        accepted=len(inserted), duplicates=len(batch.reports) - len(inserted), job_status=job.status
    )


def _aggregate(job: Job, reports: list[Any]) -> dict[str, Any]:
    """The job row's latest figures after `reports` (new ones only), following the highest step."""
    values: dict[str, Any] = {}
    step = job.step
    for report in sorted(reports, key=lambda r: r.step):
        match report:
            case MetricsReport() if report.step >= step:
                step = report.step
                values["step"] = report.step
                for field in (
                    "total_steps",
                    "epoch",
                    "loss",
                    "learning_rate",
                    "tokens_per_second",
                    "eta_seconds",
                ):
                    if getattr(report, field) is not None:
                        values[field] = getattr(report, field)
                if report.trained_tokens is not None:
                    values["trained_tokens"] = report.trained_tokens
            case EvalReport():
                values["eval_loss"] = report.eval_loss
            case CheckpointReport():
                values["checkpoint_uri"] = report.uri
            case ResultReport():
                for field in ("loss", "eval_loss", "trained_tokens"):
                    if getattr(report, field) is not None:
                        values[field] = getattr(report, field)
                values["eta_seconds"] = 0.0
            case ErrorReport():
                values["error_code"] = report.code
                values["error_message"] = report.message
            case StatusReport():
                values["status_message"] = report.message
    return values


# --- history ---------------------------------------------------------------------------------------

METRIC_FIELDS = ("loss", "learning_rate", "grad_norm", "tokens_per_second", "trained_tokens", "epoch")


def metrics_history(
    session: Session,
    job: Job,
    *,
    min_step: int | None = None,
    max_step: int | None = None,
    limit: int = 10_000,
) -> tuple[list[dict[str, Any]], bool]:
    """One point per step: the step's training metrics joined with its eval loss, oldest first."""
    query = select(JobEvent).where(JobEvent.job_seq == job.seq, col(JobEvent.type).in_(["metrics", "eval"]))
    if min_step is not None:
        query = query.where(col(JobEvent.step) >= min_step)
    if max_step is not None:
        query = query.where(col(JobEvent.step) <= max_step)
    points: dict[int, dict[str, Any]] = {}
    for event in session.exec(query.order_by(col(JobEvent.step), col(JobEvent.id))):
        step = event.step or 0
        if step not in points:
            if len(points) == limit:
                return list(points.values()), True
            points[step] = {"step": step, "eval_loss": None, **dict.fromkeys(METRIC_FIELDS)}
        data = event.data or {}
        if event.type == "eval":
            points[step]["eval_loss"] = data.get("eval_loss")
        else:
            points[step].update({k: data.get(k) for k in METRIC_FIELDS})
    return list(points.values()), False


def checkpoints(session: Session, job: Job) -> list[dict[str, Any]]:
    rows = session.exec(
        select(JobEvent)
        .where(JobEvent.job_seq == job.seq, JobEvent.type == "checkpoint")
        .order_by(col(JobEvent.step))
    )
    result = []
    for event in rows:
        data = event.data or {}
        result.append(
            {
                "step": event.step or 0,
                "uri": data.get("uri"),
                "created_at": as_utc(event.created_at),
                "metrics": {"loss": data.get("loss"), "eval_loss": data.get("eval_loss")},
            }
        )
    return result
