from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPBearer
from pydantic import BaseModel
from sqlmodel import Session

from api import deletion
from api import jobs as service
from api.deps import (
    API_KEY_REQUIRED,
    DispatcherDep,
    ExecutorDep,
    PrincipalDep,
    SessionDep,
    SettingsDep,
    TenantDep,
    caller,
    json_response,
    own_tenant_only,
)
from api.errors import (
    ApiError,
    DatabaseUnavailable,
    json_body,
    not_found,
    parse_json_body,
    read_body,
    read_json_body,
)
from api.executors import FollowsLogs, LogStream
from api.models import MAX_ID, Job, JobLog, as_utc
from api.schemas import (
    EXAMPLE_JOB,
    CheckpointList,
    CheckpointPublic,
    ErrorResponse,
    EventPage,
    EventPublic,
    JobCreate,
    JobDeleted,
    JobPage,
    JobPublic,
    LogsResponse,
    MetricPoint,
    MetricsPage,
    error_responses,
    held_seconds,
    holding_now,
    usage_figures,
)
from api.states import JobStatus, is_final
from api.streams import EVENTS, LOGS, REVOKED, EventWatch, Followed, Stream, Streams
from worker.config import MAX_METADATA_PAIRS
from worker.protocol import MAX_STEP, ProgressAck, ProgressBatch

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=error_responses(401, 413, 422, 429, 503))


class _JobToken(HTTPBearer):
    """The worker's token, as the `JobToken` security scheme: a request without one is refused before its
    body is read (401, not a 422 about the body); whether it is the job's, the route asks the database
    before it parses the body."""

    async def __call__(self, request: Request) -> str:  # type: ignore[override]
        credentials = await super().__call__(request)
        if credentials is None:
            raise service.invalid_job_token()
        return credentials.credentials


_job_token = _JobToken(
    scheme_name="JobToken", description="The worker's per-job token ($TPUTUNE_JOB_TOKEN).", auto_error=False
)

_errors: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "No such job."},
}
_METADATA_PARAM = re.compile(r"^metadata\[(.+)\]$")


# Bodies routes read themselves (read_json_body): their schemas go into the OpenAPI document (api.main).
SELF_READ_BODIES: list[type[BaseModel]] = [JobCreate, ProgressBatch]
IDEMPOTENCY_KEY_MAX = 255
IDEMPOTENCY_KEY_PARAMETER = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "Retry-safe creation: the same key and body return the same job.",
    "schema": {"type": "string", "maxLength": IDEMPOTENCY_KEY_MAX, "title": "Idempotency-Key"},
}
_KEY_TOO_LONG = {
    "type": "string_too_long",
    "loc": ("header", "idempotency-key"),
    "msg": f"String should have at most {IDEMPOTENCY_KEY_MAX} characters",
    "ctx": {"max_length": IDEMPOTENCY_KEY_MAX},
}

_PROGRESS_EXAMPLE = {
    "reports": [
        {"kind": "status", "step": 0, "phase": "training", "message": "Training started."},
        {
            "kind": "metrics",
            "step": 10,
            "total_steps": 500,
            "epoch": 0.02,
            "loss": 2.31,
            "accuracy": 0.52,
            "learning_rate": 0.0001,
            "grad_norm": 0.8,
            "tokens_per_second": 15300.0,
            "trained_tokens": 40960,
            "eta_seconds": 1300.0,
        },
        {"kind": "eval", "step": 200, "eval_loss": 2.05, "eval_accuracy": 0.55},
        {
            "kind": "checkpoint",
            "step": 200,
            "uri": "gs://my-bucket/out/checkpoints/200",
            "loss": 1.9,
            "accuracy": 0.58,
            "eval_loss": 2.05,
            "eval_accuracy": 0.55,
        },
    ]
}


@router.post(
    "",
    status_code=201,
    response_model=JobPublic,
    summary="Create a fine-tuning job",
    openapi_extra={
        **API_KEY_REQUIRED,
        **json_body(JobCreate, {"lora": {"summary": "LoRA on a TPU slice", "value": EXAMPLE_JOB}}),
        "parameters": [IDEMPOTENCY_KEY_PARAMETER],
    },
    responses={
        200: {"model": JobPublic, "description": "The job created earlier with this Idempotency-Key."},
        409: {"model": ErrorResponse, "description": "The Idempotency-Key was used with another body."},
        413: {"model": ErrorResponse, "description": "The body is too large."},
        422: {"model": ErrorResponse, "description": "The spec is invalid; `error.code` says how."},
        429: {
            "model": ErrorResponse,
            "description": "Too many requests for this key (rate_limited), or the team has as many jobs "
            "queued as it may (too_many_queued_jobs); see Retry-After.",
        },
    },
)
async def create_job(request: Request) -> Response:
    # Reads its body, header and caller itself, as get_job does (they are declared in openapi_extra):
    # FastAPI solving them as parameters and a dependency took a third of this route's CPU time.
    tenant = (await caller(request)).tenant  # (first: a caller without a valid key learns nothing more)
    spec = await read_json_body(request, JobCreate)
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key is not None and len(idempotency_key) > IDEMPOTENCY_KEY_MAX:
        raise RequestValidationError([_KEY_TOO_LONG | {"input": idempotency_key}])
    if spec.from_job is not None:  # (its weights, from a job of the same tenant's: one read, on a thread)
        engine = request.app.state.engine
        settings = request.app.state.settings
        source = await anyio.to_thread.run_sync(
            service.read_source, engine, tenant, spec.from_job, spec.from_step, settings
        )
        spec = service.resolve_from_job(spec, source)
    # On the event loop: the checks are CPU work (and a kernel lookup of local paths); the write waits for
    # the job writer (api.writer), which stores the jobs of concurrent requests in one transaction (on the
    # loop too, but for jobs with an Idempotency-Key or a SQLite write lock held long by another writer).
    limits = await request.app.state.tenant_limits.of(tenant)  # (cached; read every few seconds)
    new = service.prepare_job(spec, request.app.state.settings, tenant, idempotency_key, limits)
    outcome = await request.app.state.job_writer.create(new)
    if outcome.created:
        return Response(new.created_json(), status_code=201, media_type="application/json")
    return json_response(JobPublic.of(outcome.job))


@router.get(
    "", response_model=JobPage, summary="List jobs, newest first", responses=error_responses(400, 403)
)
async def list_jobs(
    request: Request,
    scope: TenantDep,
    status: Annotated[
        list[JobStatus] | None, Query(max_length=16, description="Only jobs in these statuses.")
    ] = None,
    after: Annotated[str | None, Query(description="A job id: return the jobs older than it.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    tenant: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=64,
            description="Only this tenant's jobs. The admin key lists every tenant's by default; another "
            "key sees only its own tenant's.",
        ),
    ] = None,
) -> Response:
    """Filter by metadata with `metadata[key]=value` query parameters (all must match)."""
    own_tenant_only(tenant, scope, "jobs")
    metadata = {}
    for name, value in request.query_params.multi_items():
        match = _METADATA_PARAM.match(name)
        if match:
            metadata[match.group(1)] = value
    if len(metadata) > MAX_METADATA_PAIRS:  # (each one more to plan: 200 took PostgreSQL 11 s)
        raise ApiError(
            422,
            "too_many_filters",
            f"At most {MAX_METADATA_PAIRS} metadata[key]=value filters (a job has at most "
            f"{MAX_METADATA_PAIRS} metadata pairs); this request has {len(metadata)}.",
            param="metadata",
        )
    # Read without a worker thread (api.reader), each job's JSON as GET /jobs/{id} makes it (and keeps
    # it): through the thread pool, SQLAlchemy's ORM and the page's model, a page of 50 took 6 ms of CPU at
    # 64 clients, of which under half was the work itself (bench/api_cpu.py).
    listing = service.JobListing(
        status=sorted({s.value for s in status or []}), metadata=metadata, after=after, limit=limit
    )
    rows, has_more = await request.app.state.job_reader.list_jobs(tenant or scope, listing)
    return Response(_page_json(rows, has_more), media_type="application/json")


def _page_json(rows: list[Any], has_more: bool) -> str:
    """The JobPage of `rows` as JSON, as its model_dump_json writes it (tests compare the two)."""
    data = ",".join(_rendered(row) for row in rows)
    more = "true" if has_more else "false"
    next_after = json.dumps(rows[-1].id) if has_more else "null"
    return f'{{"object":"list","data":[{data}],"has_more":{more},"next_after":{next_after}}}'


@router.get(
    "/{job_id}",
    response_model=JobPublic,
    summary="Get a job",
    responses=_errors,
    openapi_extra=API_KEY_REQUIRED,
)
async def get_job(job_id: str, request: Request) -> Response:
    """The job as it is now; a queued one with its place in the queue (`queue_position`)."""
    # The route clients poll: it authenticates itself instead of through a dependency (solving one cost a
    # quarter of the route's CPU time) and reads on the event loop (see api.reader).
    scope = (await caller(request)).scope
    reader = request.app.state.job_reader
    row = await reader.read_job(scope, job_id)
    if row is None:
        raise not_found(job_id)
    text = _rendered(row)
    places = request.app.state.queue_places
    if row.status == JobStatus.queued and (
        position := await places.position(job_id, row.tenant, row.executor)
    ):
        # (the first: a string in the JSON holds no such text, its quotes are escaped)
        text = text.replace('"queue_position":null', f'"queue_position":{position}', 1)
    return Response(text, media_type="application/json")


def _rendered(row: Any) -> str:
    """`row` (a job's columns, `api.jobs.JOB_COLUMNS`) as GET /jobs/{id} shows it. A client polling a job
    mostly finds it as it was: the JSON of the last row read of each job is kept, and used again while
    the row is the same (making it, JobPublic.of and then the JSON, was a fifth of the route's CPU time).
    A job that holds its chips now has a `usage` that grows with the clock: its JSON is used again for
    USAGE_MAX_AGE, then its figures written anew into the JSON around them (24 µs the whole JSON; a tenth
    of that the figures, and a fifth of a GET's CPU time when written for every read)."""
    cached = _RENDERED.pop(row.id, None)
    if cached is None or cached.row != row:
        cached = _Rendered.of(row)
    elif cached.after is not None and time.monotonic() - cached.made >= USAGE_MAX_AGE:
        cached.update()
    if len(_RENDERED) >= _RENDERED_MAX:
        del _RENDERED[next(iter(_RENDERED))]  # the least recently read
    _RENDERED[row.id] = cached  # (last, so the dict's order is the order of reads)
    return cached.text


USAGE_MAX_AGE = 0.1  # s: how old a job's `usage` may be when GET /jobs/{id} shows it (where it grows)


@dataclass
class _Rendered:
    """A job's JSON (`text`) as last made from `row`. Where the job holds its chips: the JSON before the
    figures that grow with the clock (`before`), after them (`after`), and when they were written."""

    row: Any
    text: str
    before: str = ""
    after: str | None = None
    chips: int = 0
    made: float = 0.0

    @classmethod
    def of(cls, row: Any) -> _Rendered:
        job = JobPublic.of(row)
        text = job.model_dump_json()
        if not holding_now(row):
            return cls(row, text)
        usage = job.usage.model_dump_json()
        head = '"usage":' + usage[: usage.index('"held_seconds":')]
        start = text.index(head) + len(head)
        after = text[text.index("}", start) + 1 :]
        return cls(row, text, text[:start], after, job.usage.chips, time.monotonic())

    def update(self) -> None:
        """Write its `usage` figures as of now."""
        held, hours = usage_figures(self.chips, held_seconds(self.row))
        # (floats as pydantic writes them: the shortest text that reads back the same, as repr; a held time
        # under 10^16 s and hours rounded to 4 places never take an exponent, where the two differ)
        self.text = f'{self.before}"held_seconds":{held!r},"chip_hours":{hours!r}}}{self.after}'
        self.made = time.monotonic()


_RENDERED: dict[str, _Rendered] = {}
_RENDERED_MAX = 4096


@router.post(
    "/{job_id}/cancel",
    response_model=JobPublic,
    summary="Cancel a job",
    responses={**_errors, 409: {"model": ErrorResponse, "description": "The job already finished."}},
)
def cancel_job(
    job_id: str, session: SessionDep, principal: PrincipalDep, dispatcher: DispatcherDep
) -> Response:
    """A queued or paused job is cancelled at once; a running one goes to `cancelling` until its workers
    stop. Its status message and event say who asked (a key's id, or the admin)."""
    job = service.request_cancel(session, principal.scope, job_id, principal.who)
    if dispatcher is not None:
        dispatcher.wake()
    return json_response(JobPublic.of(job))


@router.delete(
    "/{job_id}",
    response_model=JobDeleted,
    summary="Delete an ended job",
    responses={
        **_errors,
        409: {"model": ErrorResponse, "description": "The job has not ended (cancel it first)."},
    },
)
def delete_job(job_id: str, session: SessionDep, principal: PrincipalDep, executor: ExecutorDep) -> Response:
    """Delete a job that ended (succeeded, failed or cancelled) with its events, loss history, metadata
    and saved logs (on the local executor, its config and workers' logs too; on GKE, its JobSet if it is
    still there). Its outputs are not deleted: the model and checkpoints stay at its `output_uri`. What it
    used stays counted in GET /usage and its team's chip-hours. Recorded in the audit log (`job.deleted`).
    Jobs that ended long ago go by themselves where the server sets TPUTUNE_JOB_RETENTION_DAYS."""
    job = deletion.delete_job(session, principal, job_id, executor.forget)
    return json_response(JobDeleted(id=job.id, output_uri=job.output_uri))


@router.post(
    "/{job_id}/pause",
    response_model=JobPublic,
    summary="Pause a job",
    responses={
        **_errors,
        409: {"model": ErrorResponse, "description": "The job finished, or is being cancelled."},
    },
)
def pause_job(
    job_id: str, session: SessionDep, principal: PrincipalDep, dispatcher: DispatcherDep
) -> Response:
    """Stop the job's workers and let its chips go, keeping what it has done: a queued job is paused at
    once; a starting or running one goes to `pausing` while its workers save a checkpoint and stop (its
    JobSet deleted, or its processes ended), then `paused`. It holds no chips while paused (its `usage`
    stands still) and stays so until resumed. Pausing a job that is pausing or paused changes nothing."""
    job = service.request_pause(session, principal.scope, job_id, principal.who)
    if dispatcher is not None:
        dispatcher.wake()
    return json_response(JobPublic.of(job))


@router.post(
    "/{job_id}/resume",
    response_model=JobPublic,
    summary="Resume a paused or failed job",
    responses={
        **_errors,
        409: {
            "model": ErrorResponse,
            "description": "The job is neither paused nor failed (it is pausing, succeeded or cancelled).",
        },
        429: {"model": ErrorResponse, "description": "The team has as many jobs queued as it may."},
    },
)
def resume_job(
    job_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    dispatcher: DispatcherDep,
    settings: SettingsDep,
) -> Response:
    """Queue a paused job again: it waits its turn (and its team's limits) as a new job does, then its
    workers start and continue from its last checkpoint (its step, optimizer state and data position). A
    failed job alike: its error is cleared, what is left of its run (its JobSet) is removed, and its new
    run goes on from the last checkpoint the failed one saved (none: from the start); its `retries` counts
    it. A team at its limit of queued jobs gets 429, as for a new job. Resuming a job that is queued or
    running changes nothing."""
    job = service.request_resume(session, principal.scope, job_id, principal.who, settings)
    if dispatcher is not None:
        dispatcher.wake()
    return json_response(JobPublic.of(job))


@router.get(
    "/{job_id}/events",
    response_model=EventPage,
    summary="A job's events (paged, or followed as Server-Sent Events)",
    responses={**_errors, 200: {"content": {"text/event-stream": {}}, "description": "Events."}},
)
def list_events(
    job_id: str,
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_ID, description="An event id: return the events after it.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    type: Annotated[
        list[str] | None,
        Query(
            max_length=16,
            description="Only these types: status, launch, data, metrics, eval, checkpoint, sample, "
            "result, restart, warning, error.",
        ),
    ] = None,
    follow: Annotated[
        bool,
        Query(description="Stream as Server-Sent Events until the job ends; resumes after `Last-Event-ID`."),
    ] = False,
    last_event_id: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Response:
    """Oldest first: status changes, metrics points, checkpoints, samples, restarts, warnings, errors.

    Followed, the stream ends with an `end` event when the job has ended, or a `closed` event (`code`,
    `message`) when the server stops it (the API key was revoked). One that ends without either (the server
    shutting down) is followed again, after its last event (`Last-Event-ID`)."""
    job = service.get_job(session, principal.scope, job_id)
    types = sorted(set(type or []))  # (9,000 `type=x` were 9,000 parameters)
    if follow:
        start = after
        if last_event_id and last_event_id.isascii() and last_event_id.isdigit():  # (else: not ours)
            start = min(int(last_event_id), MAX_ID)
        streams: Streams = request.app.state.streams
        stream = streams.admit(EVENTS, principal)
        # The stream reads through sessions of its own: the request's would hold a pooled connection for
        # as long as the client follows (hours, for a dashboard page left open).
        session.close()
        return Followed(
            _follow_events(request, stream, job.id, start or 0, types),
            streams,
            stream,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    rows, has_more = service.list_events(session, job, after=after, limit=limit, types=types)
    return json_response(
        EventPage(
            data=[EventPublic.of(e) for e in rows],
            has_more=has_more,
            next_after=rows[-1].id if has_more else None,
        )
    )


SSE_KEEPALIVE_SECONDS = 15.0
KEY_REVOKED = {
    "code": "key_revoked",
    "message": "The API key of this stream was revoked or has expired; sign in with a new one.",
}


async def _follow_events(
    request: Request, stream: Stream, job_id: str, after: int, types: list[str]
) -> AsyncIterator[str]:
    # A read is two statements on the event loop (api.reader), without a thread or an ORM session, made
    # when the job has something new: the process's EventWatch looks for all its followers at once, and
    # shares a read among the followers of a job that ask for the same.
    watch: EventWatch = request.app.state.event_watch
    tenant = stream.principal.scope
    seen = after  # the newest event id looked past (with `types`, past events of other types too)
    quiet_since = time.monotonic()
    while not await request.is_disconnected():
        if stream.ended == REVOKED:
            yield f"event: closed\ndata: {json.dumps(KEY_REVOKED)}\n\n"
            return
        if stream.ended:  # (the server is shutting down: the client follows again, from its last event)
            return
        poll = service.EventPoll(job_id, after, types)
        try:
            status, events = await watch.read(tenant, poll, _sse_event)
        except DatabaseUnavailable:
            status, events = "", []  # (the database is away: the stream waits for it, as for new events)
        if status is None:  # no longer a job of the tenant's
            yield "event: end\ndata: {}\n\n"
            return
        if events:
            yield "".join(text for _, text in events)
            after = events[-1][0]
            seen = max(seen, after)
            quiet_since = time.monotonic()
            if len(events) == poll.limit:
                continue  # (more were there)
        # The status was read before the events: a job that had ended has no more to come.
        if status and is_final(status):
            yield "event: end\ndata: {}\n\n"
            return
        keep_alive = quiet_since + SSE_KEEPALIVE_SECONDS - time.monotonic()
        if keep_alive <= 0:
            yield ": keep-alive\n\n"
            quiet_since, keep_alive = time.monotonic(), SSE_KEEPALIVE_SECONDS
        newest = await watch.wait(stream, job_id, status, seen, keep_alive)
        if newest is not None:
            seen = max(seen, newest)


def _sse_event(row: Any) -> str:
    event = EventPublic.of(row)
    return f"id: {event.id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"


@router.get(
    "/{job_id}/metrics",
    response_model=MetricsPage,
    summary="Loss curve and metrics per step",
    responses=_errors,
)
def job_metrics(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    min_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    max_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> Response:
    """Training loss and token accuracy, eval loss and accuracy, learning rate, grad norm and tokens/s at
    every reported step."""
    job = service.get_job(session, tenant, job_id)
    points, has_more = service.metrics_history(
        session, job, min_step=min_step, max_step=max_step, limit=limit
    )
    return json_response(
        MetricsPage(job_id=job.id, data=[MetricPoint(**p) for p in points], has_more=has_more)
    )


@router.get(
    "/{job_id}/checkpoints", response_model=CheckpointList, summary="Saved checkpoints", responses=_errors
)
def job_checkpoints(job_id: str, session: SessionDep, tenant: TenantDep) -> Response:
    """Every checkpoint the worker reported, with the metrics at its step."""
    job = service.get_job(session, tenant, job_id)
    checkpoints = [CheckpointPublic(**c) for c in service.checkpoints(session, job)]
    return json_response(CheckpointList(job_id=job.id, data=checkpoints))


@router.get(
    "/{job_id}/logs",
    response_model=LogsResponse,
    summary="The job's worker log (or, with follow, its live stream)",
    responses={
        **_errors,
        200: {"content": {"text/plain": {}}, "description": "The log; with `follow=true`, plain text lines."},
        409: {"model": ErrorResponse, "description": "`follow=true`: no worker log to follow (yet)."},
    },
)
def job_logs(
    job_id: str,
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    executor: ExecutorDep,
    tail: Annotated[int, Query(ge=1, le=10_000)] = 200,
    follow: Annotated[
        bool,
        Query(description="Kubernetes: stream the lines as text, then new ones until the worker's pod ends."),
    ] = False,
    previous: Annotated[
        bool,
        Query(
            description="Kubernetes: the log saved as the job's latest run to end ended (a failed run's, "
            "while the resumed job runs again)."
        ),
    ] = False,
    run: Annotated[
        int | None,
        Query(
            ge=0,
            le=2**31 - 1,
            description="Kubernetes: the log saved as this run of the job ended (0 its first; each pause, "
            "and each resume after a failure, starts the next; the response's `run` says which a saved "
            "log is). A run whose log was not saved is a 404 `log_not_saved` that names those saved.",
        ),
    ] = None,
) -> Response:
    """JAX process 0's log: the last `tail` lines, or with `follow=true` those and then new ones as they
    come (kubernetes executor; the stream ends when the pod does, e.g. at a restart: follow again).

    On Kubernetes a run's log goes with its pods (its JobSet deleted: the job paused, cancelled or
    resumed, or past TPUTUNE_K8S_TTL_SECONDS_AFTER_FINISHED): the end of it is saved as the run ends, and
    served, with `saved_at`, once no pod has a log; `previous=true` asks for it while one does, and
    `run=N` for an earlier run's."""
    job = service.get_job(session, principal.scope, job_id)
    if previous and run is not None:
        raise ApiError(
            400,
            "conflicting_params",
            "previous asks for the latest run's saved log, run for one run's; drop one of them.",
            param="run",
        )
    asked = "run" if run is not None else "previous" if previous else None  # (a saved log)
    if asked and follow:
        raise ApiError(
            400,
            f"{asked}_not_supported",
            f"A saved log cannot be followed; drop follow or {asked}.",
            param=asked,
        )
    if asked and executor.logs_outlive_runs:
        raise ApiError(
            400,
            f"{asked}_not_supported",
            "This server runs jobs as local processes, whose log file keeps every run's lines; "
            f"drop {asked}.",
            param=asked,
        )
    if run is not None:
        return _saved_run_log(session, job, run, tail)
    if follow:
        if not isinstance(executor, FollowsLogs):
            raise ApiError(
                400,
                "follow_not_supported",
                "This server runs jobs as local processes, whose logs cannot be followed; "
                "poll GET /jobs/{id}/logs instead.",
                param="follow",
            )
        streams: Streams = request.app.state.streams
        stream = streams.admit(LOGS, principal)
        session.close()  # (not held while the client follows: see list_events)
        try:
            log = executor.follow_logs(job, tail)
        except BaseException as exc:
            streams.release(stream)
            if isinstance(exc, LookupError):
                raise ApiError(409, "logs_not_ready", str(exc)) from None
            raise
        stream.on_ending(log.interrupt)  # (its key revoked, or shutdown: the read blocked in it returns)
        return Followed(
            _relay_log(log, stream, streams.log_threads),
            streams,
            stream,
            media_type="text/plain; charset=utf-8",
        )
    # (a resumed job's last run, until it runs again: its `launch` is kept until then)
    ran = job.launched_at is not None or job.launch is not None or job.pauses > 0
    lines, truncated = executor.logs(job, tail) if ran and not previous else ([], False)
    saved = service.saved_log(session, job) if previous or not lines else None
    if saved is None:
        return json_response(LogsResponse(job_id=job.id, lines=lines, truncated=truncated))
    return _saved_lines(job, saved, tail)


def _saved_run_log(session: Session, job: Job, run: int, tail: int) -> Response:
    saved = service.saved_log(session, job, run)
    if saved is None:
        runs = service.saved_runs(session, job)
        if not runs:
            those = "none has one yet"
        elif len(runs) == 1:
            those = f"run {runs[0]} has one"
        else:
            those = f"runs {', '.join(map(str, runs[:-1]))} and {runs[-1]} have one"
        raise ApiError(
            404,
            "log_not_saved",
            f"No log of run {run} of job {job.id} was saved; {those} (a run's log is saved as it ends).",
            param="run",
        )
    return _saved_lines(job, saved, tail)


def _saved_lines(job: Job, saved: JobLog, tail: int) -> Response:
    kept = saved.text.splitlines()
    return json_response(
        LogsResponse(
            job_id=job.id,
            lines=kept[-tail:],
            truncated=saved.truncated or len(kept) > tail,
            saved_at=as_utc(saved.saved_at),
            run=saved.run,
        )
    )


async def _relay_log(log: LogStream, stream: Stream, threads: anyio.CapacityLimiter) -> AsyncIterator[str]:
    """A followed log's lines. Reading one blocks until it comes, minutes away maybe: each log is read on a
    thread of its own (`threads`, one per log follower allowed), not on the routes' (`worker_threads`):
    there, a few followers held every thread, and the other sync routes, workers' progress reports among
    them, waited for one. When the client goes away (or its key is revoked) the read is interrupted at
    once, not at the log's next line."""
    lines = iter(log)
    try:
        while True:
            try:
                # abandon_on_cancel: a client that went away is let go now; the interrupt below ends the
                # read its thread is blocked in.
                line = await anyio.to_thread.run_sync(
                    next, lines, None, abandon_on_cancel=True, limiter=threads
                )
            except Exception:
                if stream.ended:
                    return
                raise
            if line is None or stream.ended:
                return
            yield f"{line}\n"
    finally:
        log.interrupt()


@router.post(
    "/{job_id}/progress",
    response_model=ProgressAck,
    summary="Worker reports (for the worker, with its job token)",
    openapi_extra=json_body(ProgressBatch, {"reports": {"value": _PROGRESS_EXAMPLE}}),
    responses={401: {"model": ErrorResponse, "description": "Missing or wrong job token."}},
)
async def post_progress(
    job_id: str, request: Request, token: Annotated[str, Depends(_job_token)]
) -> Response:
    """The worker's side of the contract is described in `worker/protocol.py`: batches of reports,
    stored once per (job, kind, step, key), so retrying a batch is safe."""
    body = await read_body(request)
    engine = request.app.state.engine

    def ingest() -> ProgressAck:
        with Session(engine, expire_on_commit=False) as session:
            # The token first: without the job's, a caller learns nothing, not even what its body lacks.
            job = service.authenticate_worker(session, job_id, token)
            return service.ingest_progress(session, job, parse_json_body(request, body, ProgressBatch))

    ack = await anyio.to_thread.run_sync(ingest)
    request.app.state.metrics.reports.inc(ack.accepted)
    return json_response(ack)
