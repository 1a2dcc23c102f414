"""What the API does with jobs: create, read, list, cancel, move through states, ingest worker reports.

Route handlers call these functions; the dispatcher and executors use `transition` and `add_event`.
Every status change goes through `transition`, a conditional UPDATE that applies only if the job is
still in the status the caller saw, so two actors (a cancel request and the dispatcher, say) never
overwrite each other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from collections import namedtuple
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, update
from sqlalchemy import select as sa_select
from sqlalchemy import text as sql_text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, col, select

from api import tpu
from api.datasets import DatasetUnavailable, StorageUnreachable, check_dataset
from api.db import autocommit_connection, upsert_insert
from api.errors import ApiError, not_found
from api.models import IdempotencyKey, Job, JobEvent, JobLog, Tenant, as_utc, job_spec, utcnow
from api.schemas import JobExports
from api.settings import Settings
from api.states import FINAL, JobStatus, check_transition
from api.tenants import Limits
from api.validation import check_spec
from worker.config import JobSpec, for_tenant
from worker.protocol import (
    REWARDS,
    CheckpointReport,
    DataFigures,
    DataReport,
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


def new_job_id() -> str:
    # Lowercase letters and digits (base32: a-z, 2-7), 60 random bits: the id names Kubernetes objects
    # and process groups too. One call for the randomness (twelve `secrets.choice` calls were 4% of a
    # POST /jobs).
    return "ft-" + base64.b32encode(secrets.token_bytes(10)).decode()[:12].lower()


def new_job_token() -> tuple[str, str]:
    token = secrets.token_urlsafe(32)
    return token, hash_token(token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def default_output_uri(settings: Settings, job_id: str, tenant: str) -> str:
    if settings.executor == "kubernetes" and settings.k8s_output_base_uri:
        return f"{for_tenant(settings.k8s_output_base_uri, tenant).rstrip('/')}/{job_id}"
    return f"{settings.jobs_dir}/{job_id}/output"  # (pathlib's `/` twice cost 8% of POST /jobs's CPU)


# --- create / read ---------------------------------------------------------------------------------


# The columns a job's public view needs (not its token hash or launch record).
JOB_COLUMNS = (
    *("id", "tenant", "name", "status", "status_message", "model", "method", "executor", "spec"),
    *("created_at", "started_at", "finished_at", "step", "total_steps", "epoch", "eta_seconds", "loss"),
    *("eval_loss", "accuracy", "eval_accuracy", "learning_rate", "tokens_per_second", "trained_tokens"),
    *("chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward"),
    *("restarts", "preemptions"),
    *("admitted_at", "held_seconds", "pauses", "retries", "data_stats"),
    *("error_code", "error_message", "output_uri", "exported_step", "checkpoint_uri"),
)
JobRow = namedtuple("JobRow", JOB_COLUMNS)  # type: ignore[misc]


@dataclass
class NewJob:
    """A checked job spec, ready to insert (`prepare_job`); `write_jobs` stores many in one transaction."""

    tenant: str
    spec: JobSpec
    row: dict[str, Any]  # the `jobs` row
    idempotency_key: str | None
    request_hash: str | None  # of the spec, when there is an idempotency key
    spec_json: str  # row["spec"] as JSON text (stored as such on SQLite, and shown in the response)
    max_queued: int | None = None  # its tenant's limit on queued jobs (`write_jobs` keeps to it)

    @property
    def id(self) -> str:
        return str(self.row["id"])

    @property
    def needs_transaction(self) -> bool:
        """Whether its write reads first (its Idempotency-Key) or counts after (its tenant's queued jobs):
        not one statement in autocommit, nor the event loop's writers (api.writer)."""
        return self.idempotency_key is not None or self.max_queued is not None

    def created(self) -> Outcome:
        """The outcome of this job once inserted: its row as read back (without a read)."""
        row = self.row
        return Outcome(JobRow._make([row.get(name) for name in JOB_COLUMNS]), True)

    def created_json(self) -> str:
        """The job as `JobPublic.of` shows it, as JSON, once `write_jobs` has created it: the values are
        those of `row`, the rest as every new job has them. Made here, not by the model: JobPublic.of and
        model_dump_json were a fifth of POST /jobs's CPU time on the event loop. (Tests compare the two.)"""
        row, text = self.row, _json_string
        return (
            f'{{"id":{text(row["id"])},"object":"fine_tuning.job","tenant":{text(row["tenant"])},'
            f'"name":{text(row["name"])},'
            f'"status":{text(row["status"])},"queue_position":null,'
            f'"status_message":{text(row["status_message"])},'
            f'"model":{text(row["model"])},"method":{text(row["method"])},'
            f'"executor":{text(row["executor"])},"created_at":"{_utc_iso(row["created_at"])}",'
            f'"started_at":null,"finished_at":null,"progress":{{"step":{row["step"]},"total_steps":null,'
            '"epoch":null,"fraction":null,"eta_seconds":null},"metrics":{"loss":null,"eval_loss":null,'
            '"accuracy":null,"eval_accuracy":null,"chosen_reward":null,"rejected_reward":null,'
            '"eval_chosen_reward":null,"eval_rejected_reward":null,'
            f'"learning_rate":null,"tokens_per_second":null}},"trained_tokens":{row["trained_tokens"]},'
            '"data_stats":null,'
            f'"restarts":{row["restarts"]},"preemptions":{row["preemptions"]},"pauses":{row["pauses"]},'
            f'"retries":{row["retries"]},'
            f'"usage":{{"chips":{tpu.chips_of(self.spec.resources, row["executor"])},'
            f'"chip_unit":{text(tpu.chip_unit(row["executor"]))},"held_seconds":0.0,"chip_hours":0.0}},'
            '"error":null,'
            f'"output_uri":{text(row["output_uri"])},"exported_step":null,"exports":null,'
            f'"checkpoint_uri":null,"metadata":{_json(self.spec.metadata)},"spec":{self.spec_json}}}'
        )


# As pydantic writes JSON: compact, and other than ASCII as UTF-8.
_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_json_string: Callable[[str], str] = json.encoder.encode_basestring


def _utc_iso(value: Any) -> str:
    """An aware UTC datetime as pydantic writes it: ISO 8601 with Z, microseconds only when not zero."""
    return f"{value.replace(tzinfo=None).isoformat()}Z"


@dataclass
class Outcome:
    """What `write_jobs` did with one NewJob: the job (its `JOB_COLUMNS` as attributes) and whether it was
    created now (False: an earlier request with the same Idempotency-Key created it)."""

    job: Any
    created: bool


QUEUED_MESSAGE = "Waiting for the dispatcher to start it."


def prepare_job(
    spec: JobSpec,
    settings: Settings,
    tenant: str,
    idempotency_key: str | None = None,
    limits: Limits | None = None,
) -> NewJob:
    """Check `spec` against this deployment and the tenant's `limits` (default: the server's) (ApiError
    if it does not fit) and build its row; no I/O but the checks of local paths."""
    check_spec(spec, settings, limits or Limits.of(None, settings, tenant), tenant)
    dumped = spec.model_dump(mode="json")
    spec_json = spec.model_dump_json()  # (half the time json.dumps(dumped) takes)
    request_hash = None
    if idempotency_key is not None:
        request_hash = hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()
    job_id = new_job_id()
    now = utcnow()
    row = dict(_NEW_ROW)
    row.update(
        id=job_id,
        tenant=tenant,
        name=spec.name,
        model=spec.model,
        method=spec.method.type,
        spec=dumped,
        executor=settings.executor,
        output_uri=spec.output_uri or default_output_uri(settings, job_id, tenant),
        created_at=now,
        updated_at=now,
    )
    limit = limits.max_queued_jobs if limits is not None else settings.tenant_max_queued_jobs
    return NewJob(tenant, spec, row, idempotency_key, request_hash, spec_json, limit)


# A new job's columns; every row of one executemany names the same ones.
_NEW_ROW: dict[str, Any] = {"status": JobStatus.queued.value, "status_message": QUEUED_MESSAGE}
_NEW_ROW.update(step=0, trained_tokens=0, restarts=0, preemptions=0, pauses=0, retries=0, held_seconds=0.0)
_CREATED_EVENT = {"type": "status", "level": "info", "message": "Job created and queued."}
_CREATED_DATA_JSON = json.dumps({"status": "queued"})

_INSERT_KEYS = insert(IdempotencyKey.__table__)  # type: ignore[attr-defined]


def write_jobs(connection: Connection, batch: Sequence[NewJob]) -> list[Outcome | ApiError]:
    """Insert the jobs of `batch` (with their metadata, first event and idempotency keys) on `connection`,
    in its transaction, one statement per table; the caller commits. A job whose Idempotency-Key is
    already taken is not inserted: its outcome is the first job (or a 409 if the body differs).

    IntegrityError when another writer took one of the keys meanwhile: roll back, and write the jobs one
    at a time (`write_one`) to give each its own answer.

    Jobs whose tenant has a limit on queued jobs (`NewJob.max_queued`) are counted with the others after
    the insert, in the same transaction. QueueFull when a tenant has more than its limit then: roll back,
    and write the batch again without the jobs that did not fit (`QueueFull.refusals`, answered 429).
    Exact, also with concurrent writers (replicas): on SQLite the insert holds the database's write lock
    until the commit; on PostgreSQL a transaction lock per tenant, taken first (pg_advisory_xact_lock, in
    the order of the names), serializes the tenant's inserts, whose counts (read committed) then see each
    other's. (It needs a transaction: not autocommit.)
    """
    capped = {new.tenant: new.max_queued for new in batch if new.max_queued is not None}
    for tenant in sorted(capped):
        _lock_tenant_queue(connection, tenant)
    outcomes: list[Outcome | ApiError | None] = [None] * len(batch)
    taken = _taken_keys(connection, [new for new in batch if new.idempotency_key is not None])
    first_of_key: dict[tuple[str, str], int] = {}
    fresh: list[int] = []
    existing: dict[int, str] = {}  # index in batch -> id of the job stored before
    for i, new in enumerate(batch):
        if new.idempotency_key is None:
            fresh.append(i)
            continue
        key = (new.tenant, new.idempotency_key)
        if key in taken:
            request_hash, job_id = taken[key]
            if request_hash != new.request_hash:
                outcomes[i] = _key_reused()
            else:
                existing[i] = job_id
        elif key in first_of_key:  # the same key twice in this batch: the first one creates the job
            first = batch[first_of_key[key]]
            if first.request_hash != new.request_hash:
                outcomes[i] = _key_reused()
            else:
                existing[i] = first.id
        else:
            first_of_key[key] = i
            fresh.append(i)
    if fresh:
        news = [batch[i] for i in fresh]
        if connection.dialect.name == "postgresql":
            _insert_postgres(connection, news)
        else:
            _insert_sqlite(connection, news)
        for i in fresh:
            outcomes[i] = batch[i].created()
    if existing:
        found = {row.id: row for row in connection.execute(_READ_JOBS, {"ids": list(set(existing.values()))})}
        for i, job_id in existing.items():
            outcomes[i] = Outcome(found[job_id], False)
    if capped and any(batch[i].max_queued is not None for i in fresh):
        statement = _COUNT_QUEUED.where(col(Job.tenant).in_(capped)).group_by(col(Job.tenant))
        over = {
            tenant: (queued, [i for i in fresh if batch[i].tenant == tenant], capped[tenant])
            for tenant, queued in connection.execute(statement)
            if queued > capped[tenant]
        }
        if over:
            raise QueueFull(over)
    assert all(outcome is not None for outcome in outcomes)
    return outcomes  # type: ignore[return-value]


def _insert_sqlite(connection: Connection, news: Sequence[NewJob]) -> None:
    """The new jobs, their first events and metadata: one statement per table, whose rows arrive as one
    JSON parameter that SQLite takes apart (json_each). sqlite3 lets go of the GIL for each step of a
    statement and needs it back after: an executemany of n rows was n hand-offs, each a wait of up to the
    switch interval while the event loop runs (POST /jobs at 64 clients: the jobs' executemany took 13 ms
    for 32 rows, 3 ms of it CPU; as one statement, ~1.1 ms for 9). The events and metadata find their
    job's seq by its id. Values as SQLAlchemy stores them: times as text in UTC, JSON as text."""
    for statement, parameters in sqlite_new_jobs_statements(news):
        connection.exec_driver_sql(statement, parameters)
    _insert_keys(connection, news)


def sqlite_new_jobs_statements(news: Sequence[NewJob]) -> list[tuple[str, tuple[str, ...]]]:
    """The statements (sqlite3's ? style) that insert the jobs `news`, their first events and metadata."""
    rows: list[tuple[Any, ...]] = []
    metadata: list[tuple[str, str, str]] = []
    for new in news:
        row = new.row
        created_at = row["created_at"].strftime(_SQLITE_TIME)
        rows.append((*[row[name] for name in _SQLITE_JOB_COLUMNS], new.spec_json, created_at))
        metadata.extend((new.id, key, value) for key, value in new.spec.metadata.items())
    ids = json.dumps([new.id for new in news])
    statements = [
        (_SQLITE_INSERT_JOBS, (json.dumps(rows),)),
        (_SQLITE_INSERT_EVENTS, (*_SQLITE_CREATED_EVENT, ids)),
    ]
    if metadata:
        statements.append((_SQLITE_INSERT_METADATA, (json.dumps(metadata),)))
    return statements


_SQLITE_TIME = "%Y-%m-%d %H:%M:%S.%f"  # SQLAlchemy's storage format for DateTime on SQLite
_SQLITE_JOB_COLUMNS = ["id", "tenant", "name", "status", "model", "method", "executor", "status_message"]
_SQLITE_JOB_COLUMNS += ["output_uri", "step", "trained_tokens", "restarts"]
_SQLITE_ROW = [f"json_extract(value, '$[{i}]')" for i in range(len(_SQLITE_JOB_COLUMNS) + 2)]
_SQLITE_INSERT_JOBS = (
    f"INSERT INTO jobs ({', '.join(_SQLITE_JOB_COLUMNS)}, spec, created_at, updated_at) "
    f"SELECT {', '.join(_SQLITE_ROW)}, {_SQLITE_ROW[-1]} FROM json_each(?) ORDER BY key"
)
_SQLITE_INSERT_EVENTS = (
    "INSERT INTO job_events (job_seq, created_at, type, level, message, data) "
    "SELECT seq, created_at, ?, ?, ?, ? FROM jobs WHERE id IN (SELECT value FROM json_each(?)) ORDER BY seq"
)
_SQLITE_CREATED_EVENT = (*_CREATED_EVENT.values(), _CREATED_DATA_JSON)
_SQLITE_INSERT_METADATA = (
    "INSERT INTO job_metadata (job_seq, key, value) "
    "SELECT jobs.seq, json_extract(m.value, '$[1]'), json_extract(m.value, '$[2]') "
    "FROM json_each(?) AS m JOIN jobs ON jobs.id = json_extract(m.value, '$[0]')"
)


def _insert_keys(connection: Connection, news: Sequence[NewJob]) -> None:
    keys = [
        {
            "tenant": new.tenant,
            "key": new.idempotency_key,
            "request_hash": new.request_hash,
            "job_id": new.id,
            "created_at": new.row["created_at"],
        }
        for new in news
        if new.idempotency_key is not None
    ]
    if keys:
        connection.execute(_INSERT_KEYS, keys)


# PostgreSQL: the rows as one JSON parameter (json_to_recordset), so a statement's text is the same for
# any number of jobs: psycopg parses it once and the server prepares it. The multi-row VALUES statements
# SQLAlchemy builds otherwise differ with each batch size; parsing them was half the writer's time.
_PG_JOB_COLUMNS = {
    **dict.fromkeys(["id", "tenant", "name", "status", "model", "method", "executor"], "text"),
    **dict.fromkeys(["status_message", "output_uri"], "text"),
    "spec": "json",
    **dict.fromkeys(["created_at", "updated_at"], "timestamptz"),
    **dict.fromkeys(["step", "restarts"], "int"),
    "trained_tokens": "bigint",
}
_PG_ROWS = ", ".join(f"{name} {kind}" for name, kind in _PG_JOB_COLUMNS.items())
# The jobs, their first events and metadata in one statement: one round trip (it was one per table, and
# on a busy server each of the writer thread's waits for an answer cost it a wait for the GIL after). The
# rows travel as one JSON document, which PostgreSQL takes apart: as an array per column (unnest), psycopg's
# array dumper took a quarter of the writer thread's time (py-spy, 64 clients). Nothing is returned.
PG_INSERT_NEW_JOBS = (
    f"WITH new_jobs AS (INSERT INTO jobs ({', '.join(_PG_JOB_COLUMNS)}) "
    f"SELECT {', '.join(_PG_JOB_COLUMNS)} FROM json_to_recordset(%(jobs)s::json) AS j({_PG_ROWS}) "
    "RETURNING id, seq, created_at), "
    "new_events AS (INSERT INTO job_events (job_seq, created_at, type, level, message, data) "
    "SELECT seq, created_at, %(type)s, %(level)s, %(message)s, %(data)s::json FROM new_jobs) "
    "INSERT INTO job_metadata (job_seq, key, value) "
    "SELECT new_jobs.seq, m.key, m.value FROM new_jobs "
    "JOIN json_to_recordset(%(metadata)s::json) AS m(job text, key text, value text) ON m.job = new_jobs.id"
)
_PG_TIMES = ("created_at", "updated_at")


def _insert_postgres(connection: Connection, news: Sequence[NewJob]) -> None:
    connection.exec_driver_sql(PG_INSERT_NEW_JOBS, pg_new_jobs_parameters(news))
    _insert_keys(connection, news)


def pg_new_jobs_parameters(news: Sequence[NewJob]) -> dict[str, str]:
    """The parameters of PG_INSERT_NEW_JOBS (psycopg's %(name)s style) for the jobs `news`."""
    jobs = []
    for new in news:
        row = {name: new.row[name] for name in _PG_JOB_COLUMNS}
        for name in _PG_TIMES:
            row[name] = row[name].isoformat()
        jobs.append(row)
    metadata = [
        {"job": new.id, "key": key, "value": value}
        for new in news
        for key, value in new.spec.metadata.items()
    ]
    return {
        "jobs": json.dumps(jobs),
        "metadata": json.dumps(metadata),
        "data": _CREATED_DATA_JSON,
        **_CREATED_EVENT,
    }


def write_one(engine: Engine, new: NewJob) -> Outcome | ApiError:
    """`new` in a transaction of its own. A unique-key race on its Idempotency-Key (another writer stored
    the key after this one looked) answers with the winner's job; one too many of its tenant's queued jobs
    (`write_jobs`), with 429."""
    for _ in range(2):
        try:
            with engine.begin() as connection:
                [outcome] = write_jobs(connection, [new])
            return outcome
        except QueueFull as full:  # (rolled back)
            return full.error()
        except IntegrityError:
            if new.idempotency_key is None:
                raise
    raise ApiError(409, "job_busy", "This Idempotency-Key is being used by another request right now; retry.")


_LOCK_TENANT_QUEUE = sql_text("SELECT pg_advisory_xact_lock(hashtext(:key))")


def _lock_tenant_queue(db: Connection | Session, tenant: str) -> None:
    """On PostgreSQL, the lock on `tenant`'s queue, held until the transaction ends: the writers that count
    its queued jobs to keep to its limit (`write_jobs`, `_queue_room_check`) take it first, so that their
    counts see each other's writes. (On SQLite the database's write lock does it.)"""
    bind = db.get_bind() if isinstance(db, Session) else db
    if bind.dialect.name == "postgresql":
        db.execute(_LOCK_TENANT_QUEUE, {"key": f"tputune.queued:{tenant}"})


_COUNT_QUEUED = sa_select(col(Job.tenant), func.count()).where(col(Job.status) == JobStatus.queued.value)
QUEUE_FULL_RETRY_SECONDS = 30  # Retry-After's hint: queued jobs start as others end, at no set time


class QueueFull(Exception):
    """Tenants with more jobs queued than they may, counting those `write_jobs` just inserted (rolled back
    now): by tenant, (its queued jobs, the indices in the batch of those inserted, its limit)."""

    def __init__(self, over: dict[str, tuple[int, list[int], int]]) -> None:
        super().__init__(", ".join(f"{t}: {q} queued, limit {limit}" for t, (q, _, limit) in over.items()))
        self.over = over

    def refusals(self) -> dict[int, ApiError]:
        """The jobs of the batch to refuse, by index, for each tenant to have no more than it may: the last
        of those inserted, once the room its queue had before them is taken."""
        refused: dict[int, ApiError] = {}
        for tenant, (queued, inserted, limit) in self.over.items():
            before = queued - len(inserted)
            room = max(0, limit - before)
            error = too_many_queued_jobs(tenant, before + room, limit)
            refused.update((i, error) for i in inserted[room:])
        return refused

    def error(self) -> ApiError:
        """The answer to the job inserted, when it was the only one."""
        [error] = self.refusals().values()
        return error


def too_many_queued_jobs(tenant: str, queued: int, limit: int, action: str = "submit this one") -> ApiError:
    if limit == 0:
        message = (
            f"Your team ({tenant}) may not queue jobs now (its limit of queued jobs is 0); ask an admin "
            "to raise it."
        )
    else:
        message = (
            f"Your team ({tenant}) has {queued} jobs queued and may have {limit}: {action} once "
            "some have started, or cancel some."
        )
    return ApiError(
        429, "too_many_queued_jobs", message, headers={"Retry-After": str(QUEUE_FULL_RETRY_SECONDS)}
    )


def _taken_keys(connection: Connection, keyed: Sequence[NewJob]) -> dict[tuple[str, str], tuple[str, str]]:
    if not keyed:
        return {}
    table = IdempotencyKey.__table__  # type: ignore[attr-defined]
    statement = sa_select(table.c.tenant, table.c.key, table.c.request_hash, table.c.job_id).where(
        table.c.key.in_({new.idempotency_key for new in keyed}),
        table.c.tenant.in_({new.tenant for new in keyed}),
    )
    return {(row.tenant, row.key): (row.request_hash, row.job_id) for row in connection.execute(statement)}


@dataclass(frozen=True)
class Source:
    """The job a new job's `from_job` names, as read for it (`read_source`)."""

    row: Any | None  # its row (JOB_COLUMNS), within the caller's tenant; None: no such job
    checkpoint_uri: str | None = None  # with `from_step`: the checkpoint it reported at that step
    checkpoint_gone: bool = False  # no longer kept (its worker said so since, or a local one is gone)
    base_tokenizer: str | None = None  # the tokenizer.model of its base, a Hugging Face model directory


def read_source(engine: Engine, tenant: str, job_id: str, step: int | None, settings: Settings) -> Source:
    """The job `job_id` of `tenant` and, for a `step`, its checkpoint there (on a thread: reads the
    database, for a local checkpoint the file system, and where the job's base weights were a Hugging
    Face model directory without a tokenizer_uri, whether that directory has its tokenizer)."""
    row = read_job_row(engine, tenant, job_id)
    if row is None:
        return Source(row)
    base_tokenizer = _base_tokenizer(job_spec(row), settings)
    if step is None:
        return Source(row, base_tokenizer=base_tokenizer)
    with autocommit_connection(engine) as connection:
        saved = _checkpoint_events(connection, col(Job.id) == job_id, col(Job.tenant) == tenant)
    uri = next((data.get("uri") for at, _, data in saved if at == step), None)
    kept = _kept_steps([data for _, _, data in saved])
    gone = uri is not None and (
        (kept is not None and step not in kept) or (not uri.startswith("gs://") and not os.path.isdir(uri))
    )
    return Source(row, uri, gone, base_tokenizer)


def _base_tokenizer(spec: JobSpec, settings: Settings) -> str | None:
    """`{base}/tokenizer.model` where the job's base weights were a Hugging Face model directory holding
    one and it named no tokenizer (its worker's tokenizer was that file); else None. Storage that does not
    answer counts as none (the new job then gets the official tokenizer, as before)."""
    base = spec.base_checkpoint_uri
    if spec.tokenizer_uri is not None or base is None or base.endswith(".gguf"):
        return None
    base = base.rstrip("/")
    try:  # (the check a job's dataset gets: local files, or the API's storage client, bounded)
        for name in ("config.json", "tokenizer.model"):
            check_dataset(f"{base}/{name}", settings, what="file")
    except (DatasetUnavailable, StorageUnreachable):
        return None
    return f"{base}/tokenizer.model"


def resolve_from_job[SpecT: JobSpec](spec: SpecT, source: Source) -> SpecT:
    """`spec` starting from the weights of the job its `from_job` names (`source`, read within the caller's
    tenant): its final export, or with `from_step` its checkpoint there, as `base_checkpoint_uri`; a LoRA
    job's adapter (unless it exported it merged) as `adapter_uri` on the base it trained on. Its tokenizer
    too, unless the spec names one. ApiError 422 (param `from_job`) when it cannot start from them."""
    job_id, step, job = spec.from_job, spec.from_step, source.row

    def refuse(code: str, why: str, param: str = "from_job") -> ApiError:
        return ApiError(422, code, f"{param}: {why}", param=param)

    if job is None:
        raise refuse("from_job_not_found", f"there is no job {job_id} of your team.")
    if job.model != spec.model:
        raise refuse(
            "from_job_model_mismatch",
            f"job {job_id} fine-tuned {job.model}, not {spec.model}; use the same model.",
        )
    made = job_spec(job)
    lora = made.method.type == "lora"
    if step is None:
        if job.status != JobStatus.succeeded:
            why = f"job {job_id} is {job.status}; only a job that succeeded has final weights."
            if job.status == JobStatus.failed:
                why += f" To go on from its last checkpoint, resume it (POST /jobs/{job_id}/resume)."
            if job.checkpoint_uri:
                why += (
                    f" To start from one of its checkpoints, give from_step (GET /jobs/{job_id}/checkpoints)."
                )
            raise refuse("from_job_not_succeeded", why)
        exports = JobExports.of(job.output_uri, made)  # (as the job shows them)
        weights = exports.params or exports.adapter
    else:
        if source.checkpoint_uri is None:
            raise refuse(
                "from_job_checkpoint_not_found",
                f"job {job_id} saved no checkpoint at step {step}; its checkpoints: GET "
                f"/jobs/{job_id}/checkpoints.",
                "from_step",
            )
        if source.checkpoint_gone:
            raise refuse(
                "from_job_checkpoint_not_found",
                f"job {job_id}'s checkpoint at step {step} is no longer kept (a job keeps its last "
                "keep_checkpoints, and with export_best its lowest eval loss's); pick a later one: GET "
                f"/jobs/{job_id}/checkpoints.",
                "from_step",
            )
        weights = source.checkpoint_uri
    base: str | None = weights
    adapter: str | None = None
    if lora and (step is not None or not made.method.export_merged):  # (the adapter, on its base)
        if made.adapter_uri is not None:
            raise refuse(
                "from_job_not_merged",
                f"job {job_id} trained an adapter on weights that were themselves a base and an adapter; a "
                "job starts from one adapter on its base: run that job with method.export_merged: true and "
                "start from its final weights.",
            )
        base, adapter = made.base_checkpoint_uri, weights
    if spec.base_checkpoint_uri not in (None, base) or spec.adapter_uri not in (None, adapter):
        # (a job's spec as shown, posted again: the same)
        raise refuse(
            "conflicting_fields",
            "a job starts from another job's weights or from base_checkpoint_uri and adapter_uri, not both; "
            "leave one out.",
        )
    update: dict[str, Any] = {"base_checkpoint_uri": base, "adapter_uri": adapter}
    if spec.tokenizer_uri is None:
        update["tokenizer_uri"] = made.tokenizer_uri
        gguf = made.base_checkpoint_uri
        if made.tokenizer_uri is None and gguf is not None and gguf.endswith(".gguf") and base != gguf:
            update["tokenizer_uri"] = gguf  # (its tokenizer was the GGUF file's; its weights are no more)
        elif source.base_tokenizer is not None and base != made.base_checkpoint_uri:
            update["tokenizer_uri"] = source.base_tokenizer  # (a Hugging Face base's own, the same way)
    return spec.model_copy(update=update)


def _key_reused() -> ApiError:
    return ApiError(
        409,
        "idempotency_key_reused",
        "This Idempotency-Key was already used with another request body; use a new key for a new job.",
    )


def create_job(
    session: Session, spec: JobSpec, settings: Settings, tenant: str, idempotency_key: str | None = None
) -> tuple[Job, bool]:
    """Insert a queued job and commit; returns (job, created). For scripts and tests: the API creates
    jobs through `api.writer` (`make_writer`), which stores the jobs of concurrent requests together."""
    own = session.get(Tenant, tenant)
    new = prepare_job(spec, settings, tenant, idempotency_key, Limits.of(own, settings, tenant))
    try:
        [outcome] = write_jobs(session.connection(), [new])
    except QueueFull as full:
        session.rollback()
        raise full.error() from None
    session.commit()
    if isinstance(outcome, ApiError):
        raise outcome
    return session.exec(select(Job).where(Job.id == outcome.job.id)).one(), outcome.created


def get_job(session: Session, tenant: str | None, job_id: str) -> Job:
    """The job, if it is one of `tenant`'s (None: of any tenant, for the admin key); else a 404."""
    query = select(Job).where(Job.id == job_id)
    job = session.exec(query if tenant is None else query.where(Job.tenant == tenant)).first()
    if job is None:
        raise not_found(job_id)
    return job


_table = Job.__table__  # type: ignore[attr-defined]
_SELECT_JOBS = select(*(_table.c[name] for name in JOB_COLUMNS))
_READ_JOB = _SELECT_JOBS.where(_table.c.id == bindparam("job_id"), _table.c.tenant == bindparam("tenant"))
_READ_JOBS = _SELECT_JOBS.where(_table.c.id.in_(bindparam("ids", expanding=True)))


def read_job_row(engine: Engine, tenant: str, job_id: str) -> Any | None:
    """The job as a plain row (the `JOB_COLUMNS` as attributes), or None; for reading only: no ORM
    object, no session, no transaction, and a statement built once (building it cost more than running
    it)."""
    with autocommit_connection(engine) as connection:
        return connection.execute(_READ_JOB, {"job_id": job_id, "tenant": tenant}).first()


@dataclass(frozen=True)
class JobListing:
    """What `GET /jobs` asks for: a page of a tenant's jobs, newest first (`api.reader` runs it)."""

    status: Sequence[str] = ()
    metadata: dict[str, str] | None = None
    after: str | None = None  # a job id: the jobs older than it
    limit: int = 20

    @property
    def filtered(self) -> bool:
        """Whether finding a page may read many rows that are not on it (a status or metadata filter): an
        unfiltered page reads at most `limit` + 1 rows of an index, and the cursor's row by its id."""
        return bool(self.status or self.metadata)

    def statement(self, tenant: str | None, columns: str, mark: str) -> tuple[str, list[Any]]:
        """The page's SELECT of `columns` (SQL) and its parameters, `mark` the driver's placeholder ("?" or
        "%s"): `limit` + 1 rows, the extra one saying whether there are more; `tenant` None: every tenant's
        jobs (the admin key). A cursor that is not a job of the tenant's selects nothing (`seq < NULL`);
        `cursor_statement` tells that from an empty page."""
        where, params = _of_tenant(tenant, mark)
        if self.after is not None:
            cursor, cursor_params = _of_tenant(tenant, mark)
            where.append(f"seq < (SELECT seq FROM jobs WHERE {' AND '.join([f'id = {mark}', *cursor])})")
            params += [self.after, *cursor_params]
        if self.status:
            where.append(f"status IN ({', '.join([mark] * len(self.status))})")
            params += list(self.status)
        for key, value in (self.metadata or {}).items():
            where.append(
                "EXISTS (SELECT 1 FROM job_metadata WHERE job_metadata.job_seq = jobs.seq"
                f" AND job_metadata.key = {mark} AND job_metadata.value = {mark})"
            )
            params += [key, value]
        condition = f"WHERE {' AND '.join(where)} " if where else ""
        sql = f"SELECT {columns} FROM jobs {condition}ORDER BY seq DESC LIMIT {mark}"
        return sql, [*params, self.limit + 1]

    def cursor_statement(self, tenant: str | None, mark: str) -> tuple[str, list[Any]]:
        """A row if `after` is a job of the tenant's (asked only when the page came back empty)."""
        return _job_of_tenant("1", self.after, tenant, mark)

    def page(self, rows: list[Any], cursor_found: bool = True) -> tuple[list[Any], bool]:
        """(the page's rows, whether more follow) from the statement's rows."""
        if not cursor_found:
            raise ApiError(
                400,
                "invalid_cursor",
                f"'after' must be the id of a job in a previous page; {self.after} is not.",
            )
        return rows[: self.limit], len(rows) > self.limit


def _of_tenant(tenant: str | None, mark: str) -> tuple[list[str], list[Any]]:
    """The WHERE conditions (and their parameters) that keep to `tenant`'s jobs; None: every tenant's."""
    return ([], []) if tenant is None else ([f"tenant = {mark}"], [tenant])


def _job_of_tenant(columns: str, job_id: Any, tenant: str | None, mark: str) -> tuple[str, list[Any]]:
    """SELECT `columns` of the job `job_id` if it is one of `tenant`'s (None: any tenant's)."""
    where, params = _of_tenant(tenant, mark)
    return f"SELECT {columns} FROM jobs WHERE {' AND '.join([f'id = {mark}', *where])}", [job_id, *params]


EVENT_COLUMNS = ("id", "created_at", "type", "level", "message", "step", "data")


@dataclass(frozen=True)
class EventPoll:
    """One look for new events of a followed job (`GET /jobs/{id}/events?follow=true`; `api.reader`
    runs it): the job's status, then its events after `after`, oldest first."""

    job_id: str
    after: int = 0
    types: Sequence[str] = ()
    limit: int = 500

    def job_statement(self, tenant: str | None, mark: str) -> tuple[str, list[Any]]:
        return _job_of_tenant("seq, status", self.job_id, tenant, mark)

    def events_statement(self, job_seq: int, columns: str, mark: str) -> tuple[str, list[Any]]:
        """(Read after the status: an event stored before the job ended is seen before its end.)"""
        where = f"job_seq = {mark} AND id > {mark}"
        params: list[Any] = [job_seq, self.after]
        if self.types:
            where += f" AND type IN ({', '.join([mark] * len(self.types))})"
            params += list(self.types)
        return f"SELECT {columns} FROM job_events WHERE {where} ORDER BY id LIMIT {mark}", [
            *params,
            self.limit,
        ]


EventHead = namedtuple("EventHead", ["tenant", "status", "last_event"])


def event_heads_statement(job_ids: Sequence[str], mark: str, any_of: bool) -> tuple[str, list[Any]]:
    """Of each job: its tenant, its status and its newest event's id (0 if none), one index lookup each,
    for all followed jobs at once (api.streams.EventWatch). `any_of`: PostgreSQL's `= ANY(array)`."""
    where = f"= ANY({mark})" if any_of else f"IN ({', '.join([mark] * len(job_ids))})"
    params: list[Any] = [list(job_ids)] if any_of else list(job_ids)
    return (
        "SELECT j.id, j.tenant, j.status, "
        "COALESCE((SELECT max(e.id) FROM job_events e WHERE e.job_seq = j.seq), 0) "
        f"FROM jobs j WHERE j.id {where}",
        params,
    )


# How the status message of a job held back by its team's limits begins (api.dispatcher).
TEAM_WAIT = "Waiting: "


def queue_position_statement(job_id: str, mark: str) -> tuple[str, list[Any]]:
    """The job's place in its executor's queue (1: the next to start), 0 if it is not waiting there (not
    queued, or queued and held by the platform: Kueue decides those): itself and the jobs queued for launch
    before it, in the dispatcher's order (`seq`), counted on the (status, seq) index, but other teams' held
    back by their own limits (the dispatcher passes them by: they start after it)."""
    return (
        "SELECT count(*) FROM jobs j JOIN jobs q ON q.status = j.status AND q.seq <= j.seq "
        "AND q.executor = j.executor AND q.launched_at IS NULL AND (q.tenant = j.tenant "
        f"OR q.status_message IS NULL OR q.status_message NOT LIKE {mark}) "
        f"WHERE j.id = {mark} AND j.status = 'queued' AND j.launched_at IS NULL",
        [TEAM_WAIT + "%", job_id],
    )


def queued_order_statement(executor: str, mark: str) -> tuple[str, list[Any]]:
    """The jobs waiting in `executor`'s queue, as `queue_position_statement` counts them, in the
    dispatcher's order: (id, tenant, 1 if held back by its team's limits else 0)."""
    return (
        f"SELECT id, tenant, CASE WHEN status_message LIKE {mark} THEN 1 ELSE 0 END FROM jobs "
        f"WHERE status = 'queued' AND launched_at IS NULL AND executor = {mark} ORDER BY seq",
        [TEAM_WAIT + "%", executor],
    )


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
    at: datetime | None = None,
) -> None:
    """Add an event of `job`'s, made `at` (default: now)."""
    assert job.seq is not None
    event = JobEvent(job_seq=job.seq, type=type, level=level, message=message, step=step, data=data)
    if at is not None:
        event.created_at = at
    session.add(event)


def transition(
    session: Session,
    job: Job,
    target: JobStatus,
    message: str | None = None,
    check: Callable[[], None] | None = None,
    event_data: dict[str, Any] | None = None,
    commit: bool = True,
    **fields: Any,
) -> bool:
    """Move `job` to `target` if it is still in the status it was read with; commit; False if it moved on.
    Its status event's data is `{"status", "from"}`, and `event_data` if given. `commit=False`: the move is
    left for the caller to commit, with a next one (moves that must happen together or not at all).

    `check`, if given, runs after the move and before the commit, in the same transaction (it sees the
    move); if it raises, the move is rolled back and the error goes on to the caller.
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
    if current == JobStatus.running and target == JobStatus.queued:  # (preempted: the usage report asks)
        values["preemptions"] = job.preemptions + 1
    if target in (JobStatus.queued, JobStatus.paused):  # (held back to wait for quota, or paused: its
        values["admitted_at"] = None  # chips are let go; a failed job's, when it ended)
        if (admitted := as_utc(job.admitted_at)) is not None:
            until = as_utc(job.finished_at) if current == JobStatus.failed else None
            values["held_seconds"] = job.held_seconds + ((until or now) - admitted).total_seconds()
    if target == JobStatus.paused:
        values["pauses"] = job.pauses + 1
    elif current in (JobStatus.paused, JobStatus.failed):  # (resumed: launched anew. Its `launch` is kept
        values["launched_at"] = None  # until then, for the dispatcher to remove what is left of that run)
        if current == JobStatus.failed:
            values.update(retries=job.retries + 1, finished_at=None, error_code=None, error_message=None)
    elif current == JobStatus.queued and target == JobStatus.starting and job.launched_at is not None:
        values.setdefault("admitted_at", now)  # (the platform let a run it held start: it takes its chips)
    if target in FINAL:
        values.setdefault("finished_at", now)
        values.setdefault("eta_seconds", None)
    # synchronize_session=False: the default matched the criteria against every object in the session
    # (the dispatcher's holds a pass's 200 jobs), which made a pass quadratic; `job` is updated below.
    statement = update(Job).where(col(Job.seq) == job.seq, col(Job.status) == current).values(**values)
    result = session.execute(statement.execution_options(synchronize_session=False))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        session.refresh(job)
        return False
    if check is not None:
        try:
            check()
        except BaseException:
            session.rollback()
            raise
    event = _status_event(current, target, message)
    data = event["data"] if event_data is None else {**event["data"], **event_data}
    # Made when the job's own times say (started_at, finished_at, what it held): not after the UPDATE's
    # round trip, which under load put a job's end 50 ms after its finished_at (the usage report, which
    # reads its moves, then counted more than the job's own usage).
    add_event(session, job, "status", event["message"], level=event["level"], data=data, at=now)
    if commit:
        session.commit()
    for name, value in values.items():
        set_committed_value(job, name, value)  # what the row now holds, without marking the job changed
    return True


def _status_event(current: str, target: JobStatus, message: str | None) -> dict[str, Any]:
    """The event a move from `current` to `target` records (its job_seq and time apart)."""
    return {
        "type": "status",
        "level": "error" if target == JobStatus.failed else "info",
        "message": f"{current} → {target.value}" + (f": {message}" if message else ""),
        "data": {"status": target.value, "from": current},
    }


def fail_queued(connection: Connection, failures: Sequence[tuple[int, str, str]]) -> list[int]:
    """Fail queued jobs, given as (seq, error code, message), as `transition` would one at a time: the
    status, times and messages, and a status event each. Jobs that moved on since they were read (a
    cancel) are left alone. No commit: the caller's. Returns the seqs of the jobs that failed.

    PostgreSQL: one statement (_PG_FAIL_QUEUED), one round trip. SQLite: an UPDATE run for each job (one
    statement text, compiled once), then the events of the ones that were still queued."""
    if not failures:
        return []
    check_transition(JobStatus.queued, JobStatus.failed)
    now = utcnow()
    if connection.dialect.name == "postgresql":
        seqs, codes, messages = (list(column) for column in zip(*failures, strict=True))
        parameters = {"seqs": seqs, "codes": codes, "messages": messages, "now": now, **_PG_FAILED_EVENT}
        return list(connection.exec_driver_sql(_PG_FAIL_QUEUED, parameters).scalars())
    rows = [{"b_seq": seq, "b_now": now, "b_code": code, "b_message": text} for seq, code, text in failures]
    moved = connection.execute(_FAIL_QUEUED, rows)
    failed = list(failures)
    if moved.rowcount != len(failures) or not connection.dialect.supports_sane_multi_rowcount:
        # Some moved on (or the driver cannot tell): the rows this statement changed carry its time.
        query = sa_select(_table.c.seq).where(
            _table.c.seq.in_([seq for seq, _, _ in failures]),
            _table.c.status == JobStatus.failed.value,
            _table.c.updated_at == now,
        )
        ours = set(connection.execute(query).scalars())
        failed = [failure for failure in failures if failure[0] in ours]
    if failed:
        events = [
            {
                "job_seq": seq,
                "created_at": now,
                **_status_event(JobStatus.queued.value, JobStatus.failed, message),
            }
            for seq, _, message in failed
        ]
        connection.execute(insert(JobEvent.__table__), events)  # type: ignore[attr-defined]
    return [seq for seq, _, _ in failed]


_FAIL_QUEUED = (
    update(_table)
    .where(_table.c.seq == bindparam("b_seq"), _table.c.status == JobStatus.queued.value)
    .values(
        status=JobStatus.failed.value,
        updated_at=bindparam("b_now"),
        finished_at=bindparam("b_now"),
        eta_seconds=None,
        status_message=bindparam("b_message"),
        error_message=bindparam("b_message"),
        error_code=bindparam("b_code"),
    )
)
# The same on PostgreSQL in one statement: the jobs still queued fail, and their events are written. The
# rows are found through the primary key (`seq = ANY`), and `status || ''` keeps the planner from using
# ix_jobs_status_seq instead: in a burst of jobs its statistics count few queued jobs (they come and go
# between two ANALYZEs), and that index holds an entry for every job queued since the last VACUUM, failed
# since or not. Planned through it, a group of 32 read them all: 37 ms with 100,000 such entries, against
# 1.5 ms (EXPLAIN ANALYZE; bench/README.md).
_PG_FAIL_QUEUED = (
    "WITH failures AS (SELECT * FROM unnest(%(seqs)s::bigint[], %(codes)s::text[], %(messages)s::text[]) "
    "AS f(seq, code, message)), "
    "failed AS (UPDATE jobs SET status = 'failed', updated_at = %(now)s, finished_at = %(now)s, "
    "eta_seconds = NULL, status_message = failures.message, error_message = failures.message, "
    "error_code = failures.code FROM failures "
    "WHERE jobs.seq = ANY(%(seqs)s::bigint[]) AND jobs.seq = failures.seq AND jobs.status || '' = 'queued' "
    "RETURNING jobs.seq, failures.message) "
    "INSERT INTO job_events (job_seq, created_at, type, level, message, data) "
    "SELECT seq, %(now)s, %(type)s, %(level)s, %(prefix)s || message, %(data)s::json FROM failed "
    "RETURNING job_seq"
)
_FAILED_EVENT = _status_event(JobStatus.queued.value, JobStatus.failed, "")
_PG_FAILED_EVENT = {
    "type": _FAILED_EVENT["type"],
    "level": _FAILED_EVENT["level"],
    "prefix": _FAILED_EVENT["message"] + ": ",
    "data": json.dumps(_FAILED_EVENT["data"]),
}


def request_cancel(session: Session, tenant: str | None, job_id: str, by: str | None = None) -> Job:
    """Cancel the job (of `tenant`'s; None: any): at once if it never launched, else `cancelling`. `by`:
    who asked, in the status message and event ("the admin", "key key_x"), so that a tenant whose job
    someone else stopped can tell who."""
    who = f" by {by}" if by else ""
    for _ in range(5):
        job = get_job(session, tenant, job_id)
        if job.status in FINAL:
            raise ApiError(
                409,
                "job_finished",
                f"Job {job_id} already {job.status}; only unfinished jobs can be cancelled.",
            )
        if job.status == JobStatus.cancelling:
            return job
        if job.status == JobStatus.paused:
            done = transition(session, job, JobStatus.cancelled, f"Cancelled{who} while paused.")
        elif job.status == JobStatus.queued and job.launched_at is None:
            done = transition(session, job, JobStatus.cancelled, f"Cancelled{who} before it started.")
        else:
            done = transition(
                session,
                job,
                JobStatus.cancelling,
                f"Cancel requested{who}; stopping the workers.",
                cancel_requested_at=utcnow(),
            )
        if done:
            return job
    raise ApiError(409, "job_busy", f"Job {job_id} is changing state right now; retry the cancel.")


# Who paused a pausing job, in its status events' data "for" (`paused_for`): the server, as its team's jobs
# held the team's monthly chip-hours (BUDGET) or as its workers reported nothing for TPUTUNE_STALL_MINUTES
# (STALLED), once stopped the job is queued again to go on; or its owner, who asked for a pause meanwhile
# (OWNER: once stopped, it stays paused until resumed; the owner's pause of a running job says nothing of
# it: None).
BUDGET = "budget"
STALLED = "stalled"
OWNER = "owner"


def paused_for(session: Session, job: Job) -> str | None:
    """Who paused a pausing job, as its last status event that says: BUDGET, STALLED, OWNER, or None (its
    owner)."""
    said = col(JobEvent.data)["for"].as_string().is_not(None)
    last = select(JobEvent.data).where(JobEvent.job_seq == job.seq, JobEvent.type == "status", said)
    data = session.exec(last.order_by(col(JobEvent.id).desc()).limit(1)).first()
    return (data or {}).get("for")


def stalls(session: Session, job: Job) -> int:
    """How many times the server stopped the job's run as stalled (since it was last resumed after it
    failed: its owner's retry starts the count anew)."""
    said = col(JobEvent.data)["for"].as_string() == STALLED
    count = select(func.count()).where(JobEvent.job_seq == job.seq, JobEvent.type == "status", said)
    if job.retries:
        resumed = col(JobEvent.data)["from"].as_string() == JobStatus.failed.value
        last = select(func.max(JobEvent.id)).where(
            JobEvent.job_seq == job.seq, JobEvent.type == "status", resumed
        )
        count = count.where(col(JobEvent.id) > last.scalar_subquery())
    return int(session.exec(count).one())


def request_pause(session: Session, tenant: str | None, job_id: str, by: str | None = None) -> Job:
    """Pause the job (of `tenant`'s; None: any): at once if it never launched, else `pausing` until its
    workers have saved a checkpoint and stopped (the dispatcher ends the run; its chips are let go). A
    paused job stays so until resumed (`request_resume`); its checkpoints and history are kept. One the
    server is stopping (its team's budget, a stall) then stays paused too, not queued to go on."""
    who = f" by {by}" if by else ""
    for _ in range(5):
        job = get_job(session, tenant, job_id)
        if job.status == JobStatus.pausing and paused_for(session, job) in (BUDGET, STALLED):
            message = f"Pause requested{who}; once its workers stop, the job stays paused until resumed."
            add_event(session, job, "status", message, data={"for": OWNER})
            session.commit()
            return job
        if job.status in (JobStatus.pausing, JobStatus.paused):
            return job
        if job.status not in (JobStatus.queued, JobStatus.starting, JobStatus.running):
            verb = "is being cancelled" if job.status == JobStatus.cancelling else f"already {job.status}"
            raise ApiError(
                409,
                "job_not_pausable",
                f"Job {job_id} {verb}; only queued, starting or running jobs can be paused.",
            )
        if job.status == JobStatus.queued and job.launched_at is None:
            message = f"Paused{who} before it started; resume it to queue it again."
            done = transition(session, job, JobStatus.paused, message)
        else:
            message = f"Pause requested{who}; the workers save a checkpoint and stop."
            done = transition(session, job, JobStatus.pausing, message)
        if done:
            return job
    raise ApiError(409, "job_busy", f"Job {job_id} is changing state right now; retry the pause.")


def request_resume(
    session: Session, tenant: str | None, job_id: str, by: str | None = None, settings: Settings | None = None
) -> Job:
    """Queue a paused or failed job again (of `tenant`'s; None: any): it waits its turn as a new job does,
    within its team's limits, and its workers continue from its last checkpoint (a failed job's: the last
    its run saved; none, and it starts over). With `settings`, a team at its limit of queued jobs is refused
    (429) as a new job would be."""
    who = f" by {by}" if by else ""
    for _ in range(5):
        job = get_job(session, tenant, job_id)
        if job.status in (JobStatus.queued, JobStatus.starting, JobStatus.running):
            return job  # (resumed already, or never paused)
        if job.status not in (JobStatus.paused, JobStatus.failed):
            verb = "is still pausing" if job.status == JobStatus.pausing else f"is {job.status}"
            hint = "; resume it once it is paused." if job.status == JobStatus.pausing else "."
            message = f"Job {job_id} {verb}; only a paused or failed job can be resumed{hint}"
            raise ApiError(409, "job_not_paused", message)
        check = None if settings is None else _queue_room_check(session, job.tenant, settings)
        if job.status == JobStatus.failed:
            since = "its last checkpoint" if job.checkpoint_uri else "the start (it saved no checkpoint)"
            message = f"Resumed{who} after it failed ({job.error_code}); queued, it goes on from {since}."
        else:
            message = f"Resumed{who}; queued, it continues from its last checkpoint."
        if transition(session, job, JobStatus.queued, message, check=check):
            return job
    raise ApiError(409, "job_busy", f"Job {job_id} is changing state right now; retry the resume.")


def _queue_room_check(session: Session, tenant: str, settings: Settings) -> Callable[[], None] | None:
    """For a move of one of `tenant`'s jobs to `queued`: a check (for `transition`) that refuses it (429)
    if it takes the tenant past its limit of queued jobs; None if it has none. Exact with concurrent moves
    and submissions, as `write_jobs` is: the jobs are counted after the move, in its transaction (on SQLite
    the move holds the write lock until the commit); on PostgreSQL the tenant's queue lock is taken first
    (here: it is held until the move's commit or rollback)."""
    limit = Limits.of(session.get(Tenant, tenant), settings, tenant).max_queued_jobs
    if limit is None:
        return None
    _lock_tenant_queue(session, tenant)

    def check() -> None:
        statement = _COUNT_QUEUED.where(col(Job.tenant) == tenant).group_by(col(Job.tenant))
        queued = next((count for _, count in session.execute(statement)), 0)  # (this job among them)
        if queued > limit:
            raise too_many_queued_jobs(tenant, queued - 1, limit, action="resume this job")

    return check


# --- worker reports --------------------------------------------------------------------------------


def invalid_job_token() -> ApiError:
    return ApiError(
        401,
        "invalid_job_token",
        "The job token is missing or does not belong to this job; workers send "
        "'Authorization: Bearer $TPUTUNE_JOB_TOKEN'.",
        headers={"WWW-Authenticate": "Bearer"},
    )


def authenticate_worker(session: Session, job_id: str, token: str | None) -> Job:
    job = session.exec(select(Job).where(Job.id == job_id)).first()
    # Same answer for an unknown job and a wrong token: a token holder learns nothing about other jobs.
    if (
        job is None
        or not token
        or not job.token_hash
        or not hmac.compare_digest(job.token_hash, hash_token(token))
    ):
        raise invalid_job_token()
    return job


def _rewards(chosen: float | None, rejected: float | None) -> str:
    """A dpo job's rewards in an event's message: ", rewards chosen +0.120, rejected -0.310"."""
    if chosen is None or rejected is None:
        return ""
    return f", rewards chosen {chosen:+.3f}, rejected {rejected:+.3f}"


def _event_for(report: Any) -> tuple[str, str, str]:
    """(type, level, message) of the event a report becomes."""
    match report:
        case MetricsReport():
            total = f"/{report.total_steps}" if report.total_steps else ""
            loss = f" loss {report.loss:.4f}" if report.loss is not None else ""
            loss += f", accuracy {report.accuracy:.1%}" if report.accuracy is not None and loss else ""
            loss += _rewards(report.chosen_reward, report.rejected_reward) if loss else ""
            return "metrics", "info", f"step {report.step}{total}:{loss}".rstrip(":")
        case EvalReport():
            accuracy = f", accuracy {report.eval_accuracy:.1%}" if report.eval_accuracy is not None else ""
            accuracy += _rewards(report.eval_chosen_reward, report.eval_rejected_reward)
            return "eval", "info", f"step {report.step}: eval loss {report.eval_loss:.4f}{accuracy}"
        case CheckpointReport():
            return "checkpoint", "info", f"Checkpoint saved at step {report.step}: {report.uri}"
        case SampleReport():
            return "sample", "info", f"Sample {report.phase} training: {report.prompt} → {report.text[:500]}"
        case ResultReport():
            chosen = ""
            if report.exported_step is not None and report.exported_step != report.step:
                eval_loss = f", {report.eval_loss:.4f}" if report.eval_loss is not None else ""
                chosen = f" Exported the weights of step {report.exported_step}"
                chosen += f" (the lowest eval loss{eval_loss})."
            output = f" Output: {report.output_uri}" if report.output_uri else ""
            return "result", "info", f"Training finished.{chosen}{output}"
        case ErrorReport():
            return "error", "error", f"{report.code}: {report.message}"
        case WarningReport():
            return "warning", "warn", report.message
        case DataReport():
            documents = "preference pairs" if report.preference_pairs else "documents"
            validation = ""
            if report.validation_documents is not None:
                validation = f"; validation: {report.validation_documents:,} {documents}"
                validation += f", {report.validation_tokens or 0:,} tokens"
            return (
                "data",
                "info",
                f"Data: {report.documents:,} {documents}, {report.tokens:,} tokens ({report.target_tokens:,} "
                f"with loss) packed into {report.rows:,} rows of {report.row_tokens} tokens "
                f"({report.pad_fraction:.1%} padding); {report.steps_per_epoch:,} steps an epoch, "
                f"{report.total_steps:,} in all{validation}.",
            )
        case StatusReport():
            return "status", "info", report.message
    raise AssertionError(report)


def _rewind(session: Session, job: Job, step: int) -> None:
    """A run went on from the job's checkpoint at `step`: an earlier run's metrics and evals of the steps
    after it (a crashed run's since its last checkpoint, which this run trains again) are dropped, for this
    run's to take their place, and the job's progress and figures go back to that step's."""
    events = JobEvent.__table__  # type: ignore[attr-defined]
    mine = events.c.job_seq == job.seq
    dropped = session.execute(
        delete(events).where(mine, events.c.type.in_(("metrics", "eval")), events.c.step > step)
    )
    if not dropped.rowcount and job.step <= step:  # type: ignore[attr-defined]
        return
    values: dict[str, Any] = {"step": min(job.step, step)}
    for kind, fields in (("metrics", ("loss", "accuracy")), ("eval", ("eval_loss", "eval_accuracy"))):
        latest = session.execute(
            sa_select(events.c.data)
            .where(mine, events.c.type == kind)
            .order_by(events.c.step.desc(), events.c.id.desc())
            .limit(1)
        ).scalar()
        values.update({field: (latest or {}).get(field) for field in fields})
    jobs = Job.__table__  # type: ignore[attr-defined]
    session.execute(update(jobs).where(jobs.c.seq == job.seq).values(**values))
    for name, value in values.items():
        set_committed_value(job, name, value)  # (what `_aggregate` then goes on from)


def _insert_ignore(session: Session, rows: list[dict[str, Any]]) -> set[str]:
    """Insert event rows, skipping ones whose dedupe key exists; returns the keys inserted."""
    if not rows:
        return set()
    insert = upsert_insert(session.get_bind())
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
    # A failed job resumed (`retries`) may fail again as it did: its new run's error is its own.
    retry = f":{job.retries}" if job.retries else ""
    for report in batch.reports:
        again = retry if report.kind == "error" else ""
        by_key.setdefault(f"{report.kind}:{report.step}:{report.key}{again}", report)
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
    # A run going on from its checkpoint (a resume, or a restart after a crash) says so first: once stored
    # (not again for a retried batch), what an earlier run reported past that step goes before the rest.
    resumes = {
        key
        for key, report in by_key.items()
        if isinstance(report, StatusReport) and report.resumed_from is not None
    }
    try:
        inserted = _insert_ignore(session, [row for row in rows if row["dedupe_key"] in resumes])
        for key in sorted(inserted, key=lambda k: by_key[k].resumed_from):
            _rewind(session, job, by_key[key].resumed_from)
        inserted |= _insert_ignore(session, [row for row in rows if row["dedupe_key"] not in resumes])
    except IntegrityError:  # (the job deleted since its token was checked: its foreign key refuses them)
        session.rollback()
        raise invalid_job_token() from None
    fresh = [by_key[k] for k in by_key if k in inserted]
    values = _aggregate(job, fresh)
    if batch.reports:
        values["reported_at"] = now  # (any report, one stored already too, says the workers are alive)
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
                    "accuracy",
                    "chosen_reward",
                    "rejected_reward",
                    "learning_rate",
                    "tokens_per_second",
                    "eta_seconds",
                ):
                    if getattr(report, field) is not None:
                        values[field] = getattr(report, field)
                if report.trained_tokens is not None:
                    values["trained_tokens"] = report.trained_tokens
            case EvalReport():
                for field in EVAL_FIELDS:
                    values[field] = getattr(report, field)
            case CheckpointReport():
                values["checkpoint_uri"] = report.uri
            case ResultReport():
                # The figures of the weights exported: another step's (export_best) are its own, None too.
                chosen = report.exported_step not in (None, report.step)
                for field in (*CHECKPOINT_FIELDS, "trained_tokens", "exported_step"):
                    if getattr(report, field) is not None or (chosen and field in CHECKPOINT_FIELDS):
                        values[field] = getattr(report, field)
                values["eta_seconds"] = 0.0
            case ErrorReport():
                values["error_code"] = report.code
                values["error_message"] = report.message
            case StatusReport():
                values["status_message"] = report.message
            case DataReport():
                values["data_stats"] = report.model_dump(mode="json", include=set(DataFigures.model_fields))
    return values


# --- history ---------------------------------------------------------------------------------------

METRIC_FIELDS = (
    "loss",
    "accuracy",
    "learning_rate",
    "grad_norm",
    "tokens_per_second",
    "trained_tokens",
    "epoch",
    "chosen_reward",
    "rejected_reward",
)
EVAL_FIELDS = ("eval_loss", "eval_accuracy", *REWARDS[2:])


def metrics_history(
    session: Session,
    job: Job,
    *,
    min_step: int | None = None,
    max_step: int | None = None,
    limit: int = 10_000,
) -> tuple[list[dict[str, Any]], bool]:
    """One point per step: the step's training metrics joined with its eval's, oldest first."""
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
            points[step] = {"step": step, **dict.fromkeys(EVAL_FIELDS), **dict.fromkeys(METRIC_FIELDS)}
        data = event.data or {}
        if event.type == "eval":
            points[step].update({k: data.get(k) for k in EVAL_FIELDS})
        else:
            points[step].update({k: data.get(k) for k in METRIC_FIELDS})
    return list(points.values()), False


SAVED_LOG_BYTES = 256 * 1024  # the most of a run's log kept (its last lines)


def run_index(job: Job) -> int:
    """Which of the job's runs goes now: each pause and each retry ends one, its next launch starts
    another."""
    return job.pauses + job.retries


def save_log(session: Session, job: Job, lines: list[str], truncated: bool) -> None:
    """Keep the end of the current run's log (again, if it was saved before: the later lines replace it),
    at most SAVED_LOG_BYTES of it. Committed by the caller."""
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        size += len(line.encode()) + 1
        if size > SAVED_LOG_BYTES:
            truncated = True
            break
        kept.append(line)
    text = "\n".join(reversed(kept))
    assert job.seq is not None
    row = session.get(JobLog, (job.seq, run_index(job)))
    if row is None:
        row = JobLog(job_seq=job.seq, run=run_index(job))
    row.text, row.truncated, row.saved_at = text, truncated, utcnow()
    session.add(row)


def saved_log(session: Session, job: Job, run: int | None = None) -> JobLog | None:
    """The log saved as the job's run `run` ended (default: its latest run to end), if any."""
    query = select(JobLog).where(JobLog.job_seq == job.seq)
    if run is not None:
        query = query.where(JobLog.run == run)
    return session.exec(query.order_by(col(JobLog.run).desc()).limit(1)).first()


def saved_runs(session: Session, job: Job) -> list[int]:
    """The runs of the job whose logs were saved, in order."""
    query = select(JobLog.run).where(JobLog.job_seq == job.seq).order_by(col(JobLog.run))
    return list(session.exec(query))


CHECKPOINT_FIELDS = ("loss", "eval_loss", "accuracy", "eval_accuracy", *REWARDS)


def _checkpoint_events(connection: Connection, *job: Any) -> list[tuple[int, datetime, dict[str, Any]]]:
    """The checkpoint events of the job that `job` (conditions on Job) selects, oldest first:
    (step, when, data)."""
    statement = (
        sa_select(JobEvent.step, JobEvent.created_at, JobEvent.data)  # type: ignore[call-overload]
        .join(Job, col(Job.seq) == col(JobEvent.job_seq))
        .where(*job, JobEvent.type == "checkpoint")
        .order_by(col(JobEvent.id))
    )
    return [
        # (SQLite's JSON as text, where the column's type is not applied)
        (step or 0, at, (json.loads(data) if isinstance(data, str) else data) or {})
        for step, at, data in connection.execute(statement)
    ]


def _kept_steps(reports: Sequence[dict[str, Any] | None]) -> set[int] | None:
    """The steps of the checkpoints kept, as the last of a job's checkpoint reports (`reports`, oldest
    first) that said so says; None if none did."""
    for data in reversed(reports):
        if data and data.get("kept") is not None:
            return set(data["kept"])
    return None


def checkpoints(session: Session, job: Job) -> list[dict[str, Any]]:
    events = _checkpoint_events(session.connection(), col(Job.seq) == job.seq)
    kept = _kept_steps([data for _, _, data in events])
    return [
        {
            "step": step,
            "uri": data.get("uri"),
            "kept": None if kept is None else step in kept,
            "created_at": as_utc(at),
            "metrics": {k: data.get(k) for k in CHECKPOINT_FIELDS},
        }
        for step, at, data in sorted(events, key=lambda event: event[0])  # (by step; stable: by id within)
    ]
