"""Each tenant's limits on what its jobs hold at once and how many may wait: its own, where an admin set
them (the `tenants` table, PATCH /admin/tenants/{name}), else the server's
(TPUTUNE_TENANT_MAX_ACTIVE_JOBS/CHIPS, TPUTUNE_TENANT_MAX_QUEUED_JOBS). Over an active limit a job waits
`queued` with the reason (api.dispatcher); a job bigger than the chip limit is refused when it is
submitted (api.validation.check_spec), as it could never start, and so is a job over the queued limit
(api.jobs.write_jobs, in the transaction that stores it). And what each tenant's jobs hold now (`usage`)
and held in a window of time (`spent`: chip-hours, GET /usage)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import anyio
from sqlalchemy import and_, bindparam, case, literal, or_
from sqlalchemy import select as sa_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from api.models import Job, JobEvent, Tenant, UsageSpan, utcnow
from api.settings import Settings
from api.states import ACTIVE, JobStatus
from api.validation import held_chips, resource_chips
from worker.config import Resources, for_tenant

log = logging.getLogger(__name__)

CACHE_SECONDS = 5.0  # how long an API process uses the limits it read, for the check of a new job


@dataclass(frozen=True)
class Limits:
    """What holds for a tenant now (None: no limit)."""

    max_active_jobs: int | None
    max_active_chips: int | None
    max_queued_jobs: int | None
    max_chip_hours_per_month: int | None = None
    # Where its jobs may read and write, `{tenant}` put in (api.validation.check_data_scope); None: anywhere.
    data_prefixes: tuple[str, ...] | None = None

    @classmethod
    def of(cls, row: Tenant | None, settings: Settings, tenant: str) -> Limits:
        """Tenant `tenant`'s own limits (`row`), each one it has no own of being the server's."""

        def own_or_server(name: str) -> int | None:
            value = getattr(row, name) if row is not None else None
            if value == UNLIMITED:
                return None
            return value if value is not None else getattr(settings, f"tenant_{name}")

        return cls(
            own_or_server("max_active_jobs"),
            own_or_server("max_active_chips"),
            own_or_server("max_queued_jobs"),
            own_or_server("max_chip_hours_per_month"),
            data_prefixes(row, settings, tenant),
        )

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMITS)


# (Limits' fields, Tenant's columns)
LIMITS = ("max_active_jobs", "max_active_chips", "max_queued_jobs", "max_chip_hours_per_month")
# A tenant's own limit that is none at all, whatever the server's: what `"unlimited"` is stored as.
UNLIMITED = -1
ANYWHERE: Literal["any"] = "any"  # a tenant's own data prefixes that are none at all, whatever the server's


def data_prefixes(row: Tenant | None, settings: Settings, tenant: str) -> tuple[str, ...] | None:
    """Where `tenant`'s jobs may read and write: its own prefixes (`row`) or else the server's, with
    `{tenant}` put in; None: anywhere."""
    own = row.data_prefixes if row is not None else None
    if own == ANYWHERE:
        return None
    prefixes = own if own is not None else settings.tenant_data_prefixes
    return tuple(for_tenant(prefix, tenant) for prefix in prefixes) or None


def load(session: Session) -> dict[str, Tenant]:
    """Every tenant that has limits of its own, by name (a small table: one row a team)."""
    return {row.name: row for row in session.exec(select(Tenant))}


@dataclass
class Usage:
    """What a tenant's unfinished jobs are and hold now."""

    statuses: dict[str, int] = field(default_factory=dict)  # its unfinished jobs, by status
    chips: int = 0  # what its active jobs hold: what max_active_chips counts

    @property
    def active_jobs(self) -> int:
        """Starting, running or cancelling: what max_active_jobs counts."""
        return sum(count for status, count in self.statuses.items() if status in ACTIVE)

    @property
    def queued_jobs(self) -> int:
        return self.statuses.get(JobStatus.queued.value, 0)


def usage(session: Session, settings: Settings, tenant: str | None = None) -> dict[str, Usage]:
    """Each tenant's usage (or only `tenant`'s), for the tenants with unfinished jobs (also /metrics')."""
    statuses = [JobStatus.queued.value, *(status.value for status in ACTIVE)]
    counts = select(Job.tenant, Job.status, func.count()).where(col(Job.status).in_(statuses))
    active = select(Job.id, Job.tenant, Job.spec).where(col(Job.status).in_([s.value for s in ACTIVE]))
    if tenant is not None:
        counts, active = counts.where(Job.tenant == tenant), active.where(Job.tenant == tenant)
    found: dict[str, Usage] = {}
    for name, status, count in session.exec(counts.group_by(Job.tenant, Job.status)):
        found.setdefault(name, Usage()).statuses[status] = count
    for row in session.exec(active):  # (id, tenant, spec)
        found.setdefault(row[1], Usage()).chips += held_chips(row, settings)
    return found


@dataclass
class Spent:
    """What a tenant's jobs ran in a window of time (`spent`)."""

    jobs: int = 0  # that ran in it (held their chips), for some of it at least
    chip_seconds: float = 0.0  # chips (local executor: processes) times the seconds each held them, in it
    trained_tokens: int = 0  # of those jobs, all of each (whenever trained)


def _seconds_within(session: Session, began: Any, ended: Any, since: Any, until: Any) -> Any:
    """SQL for the seconds from `began` to `ended` (NULL: still going) that fall between `since` and
    `until` (negative when none do)."""
    ended = func.coalesce(ended, until)
    start = case((began > since, began), else_=since)
    end = case((ended < until, ended), else_=until)
    if session.get_bind().dialect.name == "sqlite":
        return (func.julianday(end) - func.julianday(start)) * 86_400.0
    return func.extract("epoch", end - start)


_JOBS_AT_ONCE = 5_000  # preempted jobs whose moves one query reads (SQLite takes up to 32,766 parameters)
# The statuses in which a job holds its chips: from its launch (or admission) until it ends.
HOLDING = tuple(sorted(status.value for status in ACTIVE))
STOPPING = (JobStatus.cancelling.value, JobStatus.pausing.value)
LAUNCH = "launch"  # (the type of a job's launch event)


def shape_of(c: Any) -> Any:
    """A job's resources (its spec's), as JSON text: what its chips are counted from."""
    return c.spec["resources"].as_string()


def _spans() -> Any:
    """Each move of the jobs whose seqs are the `jobs` parameter (their status events that name a status,
    and their launches), with when the next came: the stretches a preempted, paused or retried job spent
    in each status. Those that held its chips: `_holding`."""
    jobs = Job.__table__  # type: ignore[attr-defined]
    events = JobEvent.__table__  # type: ignore[attr-defined]
    c, e = jobs.c, events.c
    # The status events that name a status (not the workers' reports of their phase, nor why a job waits),
    # each until the next; and its launches.
    status = e.data["status"].as_string()
    moves: dict[str, Any] = {"partition_by": e.job_seq, "order_by": e.id}  # (each job's, in order)
    return (
        sa_select(
            c.seq.label("job"),
            c.tenant.label("tenant"),
            shape_of(c).label("shape"),
            c.trained_tokens.label("tokens"),
            case((e.type == LAUNCH, literal(LAUNCH)), else_=status).label("status"),
            func.coalesce(e.data["from"].as_string(), "").label("moved_from"),
            e.created_at.label("began"),
            func.lead(e.created_at, type_=e.created_at.type).over(**moves).label("ended"),
            func.coalesce(func.lead(e.type).over(**moves), "").label("next"),
        )
        .select_from(jobs.join(events, e.job_seq == c.seq))
        .where(
            or_(and_(e.type == "status", status.is_not(None)), e.type == LAUNCH),
            c.seq.in_(bindparam("jobs", expanding=True)),
        )
        .subquery()
    )


def _holding(s: Any) -> list[Any]:
    """The conditions on `_spans` rows that keep those in which the job held its chips: starting, running,
    cancelling or pausing, and its launches. A move to `starting` that a launch follows is the claim (its
    dataset checked: for minutes if storage is away), its chips taken at the launch, as its own `usage`
    counts them; a move from `queued` to `starting` with no launch after is Kueue's admission of its run,
    which takes them."""
    return [
        s.status.in_((*HOLDING, LAUNCH)),
        ~and_(s.status == JobStatus.starting.value, s.next == LAUNCH),  # (claimed, not launched yet)
        # (a run held for quota that is then paused or cancelled holds nothing on its way out)
        ~and_(s.moved_from == JobStatus.queued.value, s.status.in_(STOPPING)),
    ]


# A job with any of these was preempted, paused, resumed after it failed, or let its chips go otherwise
# (`held_seconds`: Kueue held it back after its launch, before it ran): `spent` reads its moves; for the
# others their row says when they held their chips.
INTERRUPTED = ("preemptions", "pauses", "retries", "held_seconds")


def holding_spans(session: Session, jobs: Sequence[Job]) -> dict[int, list[tuple[datetime, datetime]]]:
    """When each of the ended `jobs` held its chips, as `spent` counts them: from when to when, each
    stretch, by seq (the moves of those interrupted read in one query)."""
    found: dict[int, list[tuple[datetime, datetime]]] = {}
    moved = {job.seq: job for job in jobs if any(getattr(job, name) for name in INTERRUPTED)}
    for job in jobs:
        assert job.seq is not None and job.finished_at is not None
        found[job.seq] = []
        if job.seq not in moved and job.admitted_at is not None:  # (admitted_at None: it never ran)
            found[job.seq].append((job.admitted_at, job.finished_at))
    if moved:
        s = _spans().c
        query = sa_select(s.job, s.began, s.ended).where(*_holding(s)).order_by(s.job, s.began)
        for seq, began, ended in session.connection().execute(query, {"jobs": list(moved)}):
            found[seq].append((began, ended or moved[seq].finished_at))  # type: ignore[arg-type]
    return found


def _deleted_jobs_spent(session: Session, since: Any, until: Any, tenant: str | None) -> Any:
    """What deleted jobs held between `since` and `until` (their `UsageSpan`s), grouped as `spent` groups
    the others: tenant, resources, jobs, seconds, tokens."""
    u = UsageSpan.__table__.c  # type: ignore[attr-defined]
    own = [u.tenant == tenant] if tenant is not None else []
    per_job = (
        sa_select(
            u.tenant,
            u.resources,
            func.max(u.trained_tokens).label("tokens"),
            func.sum(_seconds_within(session, u.began, u.ended, since, until)).label("seconds"),
        )
        .where(u.ended > since, u.began < until, *own)
        .group_by(u.job_id, u.tenant, u.resources)
        .subquery()
    )
    j = per_job.c
    return sa_select(j.tenant, j.resources, func.count(), func.sum(j.seconds), func.sum(j.tokens)).group_by(
        j.tenant, j.resources
    )


def spent(
    session: Session, settings: Settings, since: datetime, until: datetime, tenant: str | None = None
) -> dict[str, Spent]:
    """Each tenant's jobs that held chips between `since` and `until` (or only `tenant`'s), what they held
    then. A job takes its chips when it is launched (its JobSet created, its processes started), or when
    the platform lets a run it held for quota start (Kueue's admission, which counts its quota from then);
    it holds them while it starts (pods scheduled, the image pulled, the model loaded), runs, and is being
    cancelled or paused, until it ends. Not while it waits queued: before it is launched, held before its
    admission, or preempted back to the queue (Kueue); nor while it is paused.

    A job never preempted (`Job.preemptions`), paused (`Job.pauses`), resumed after it failed
    (`Job.retries`) nor held back by Kueue after its launch (`Job.held_seconds`: it let its chips go) held
    them from when it was last admitted (`admitted_at`: a wait for admission comes before) until it ended:
    its row says when. Another's moves (its status events) are read: it held its chips in each of those
    statuses until its next move. A deleted job's stretches were kept as it went (`UsageSpan`). Summed in
    the database, by tenant and resources (a few shapes serve many jobs). With 50,000 jobs in the window,
    5% of them preempted: 0.31 s on SQLite, 0.19 s on PostgreSQL; reading every job's moves (250,000) took
    0.67 s and 0.57 s (bench/usage_report.py)."""
    until = min(until, utcnow())  # (what runs now has run until now)
    if since >= until:
        return {}
    jobs = Job.__table__  # type: ignore[attr-defined]
    c = jobs.c
    at = c.admitted_at.type
    since_p, until_p = literal(since, at), literal(until, at)
    ended_after = or_(c.finished_at.is_(None), c.finished_at > since)
    own = [c.tenant == tenant] if tenant is not None else []
    shape = shape_of(c)
    # A job never preempted held its chips from its (last) admission until it ended (or now): its row says.
    plain = sa_select(
        c.tenant,
        shape,
        func.count(),
        func.sum(_seconds_within(session, c.admitted_at, c.finished_at, since_p, until_p)),
        func.sum(c.trained_tokens),
    )
    admitted = [c.admitted_at.is_not(None), c.admitted_at < until, ended_after]
    interrupted = [c[name] for name in INTERRUPTED]  # (any of them: its moves are read, below)
    plain = plain.where(*(count == 0 for count in interrupted), *admitted, *own).group_by(c.tenant, shape)
    s = _spans().c
    # Each job that held its chips in the window, for how long; then by tenant and shape.
    held = (
        sa_select(
            s.tenant,
            s.shape,
            func.max(s.tokens).label("tokens"),
            func.sum(_seconds_within(session, s.began, s.ended, since_p, until_p)).label("seconds"),
        )
        .where(*_holding(s), s.began < until_p, func.coalesce(s.ended, until_p) > since_p)
        .group_by(s.job, s.tenant, s.shape)
        .subquery()
    )
    h = held.c
    preempted = sa_select(h.tenant, h.shape, func.count(), func.sum(h.seconds), func.sum(h.tokens))
    preempted = preempted.group_by(h.tenant, h.shape)
    chips: dict[str | None, int] = {}
    found: dict[str, Spent] = {}
    connection = session.connection()
    rows = list(connection.execute(plain))
    # The preempted jobs first, then their moves: joined in one query, SQLite read every job's events.
    moved = or_(*(count > 0 for count in interrupted))
    preempted_then = [moved, c.created_at < until, ended_after, *own]
    seqs = list(connection.execute(sa_select(c.seq).where(*preempted_then)).scalars())
    for first in range(0, len(seqs), _JOBS_AT_ONCE):
        rows += connection.execute(preempted, {"jobs": seqs[first : first + _JOBS_AT_ONCE]})
    rows += connection.execute(_deleted_jobs_spent(session, since_p, until_p, tenant))
    for name, resources, count, seconds_held, tokens in rows:
        if resources not in chips:
            try:
                chips[resources] = resource_chips(Resources.model_validate_json(resources or "{}"), settings)
            except Exception:  # (a shape this server's settings no longer accept: it cannot tell)
                chips[resources] = 0
        entry = found.setdefault(name, Spent())
        entry.jobs += count
        entry.chip_seconds += chips[resources] * max(0.0, float(seconds_held or 0))
        entry.trained_tokens += int(tokens or 0)
    return found


def month_start(moment: datetime) -> datetime:
    """The start of `moment`'s calendar month (UTC): what a monthly chip-hour budget counts from."""
    return moment.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_month(moment: datetime) -> datetime:
    start = month_start(moment)
    return (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )


class MonthSpent:
    """The chip-hours each tenant's jobs held this calendar month (UTC), as GET /usage counts them (`spent`),
    read at most every SECONDS: what `max_chip_hours_per_month` is checked against (by the dispatcher,
    before a queued job starts) and shown (GET /tenant). Reading them takes 0.2-0.3 s with 50,000 jobs in
    the window (bench/usage_report.py); a job's hours are counted while it runs."""

    SECONDS = 30.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._read: dict[str | None, tuple[float, datetime, dict[str, float]]] = {}

    def hours(self, session: Session, tenant: str | None = None) -> dict[str, float]:
        """Each tenant's chip-hours this month (or only `tenant`'s), by name; a tenant that ran nothing is
        left out."""
        now = utcnow()
        start = month_start(now)
        with self._lock:
            cached = self._read.get(tenant)
            if cached is None and tenant is not None:  # (every tenant's, read lately, holds it)
                every = self._read.get(None)
                if every is not None:
                    cached = (every[0], every[1], {tenant: every[2][tenant]} if tenant in every[2] else {})
        if cached is not None and cached[1] == start and time.monotonic() - cached[0] < self.SECONDS:
            return cached[2]
        found = spent(session, self.settings, start, now, tenant)
        hours = {name: entry.chip_seconds / 3600 for name, entry in found.items()}
        with self._lock:
            self._read[tenant] = (time.monotonic(), start, hours)
        return hours

    def forget(self) -> None:
        with self._lock:
            self._read.clear()


class LimitsCache:
    """The tenants' limits as one API process last read them, for the check of each new job (POST /jobs
    reads no table of its own before the job writer's). Read again every CACHE_SECONDS, in the background
    once there is a first read; a change made through this process holds here at once (`put`), in the
    server's others within CACHE_SECONDS. The dispatcher reads the table on every pass: a job a stale
    limit let in waits, with a reason, as any job over its tenant's limit does."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self._rows: dict[str, Tenant] | None = None
        self._read_at = -float("inf")
        self._reading: asyncio.Task[None] | None = None
        # Rows `put` (by routes' threads) while a read was on its way: it may have read them before.
        self._lock = threading.Lock()
        self._put: dict[str, tuple[float, Tenant]] = {}

    async def of(self, tenant: str) -> Limits:
        if time.monotonic() - self._read_at >= CACHE_SECONDS and self._reading is None:
            self._reading = asyncio.create_task(self._read())
        if self._rows is None and self._reading is not None:
            await asyncio.shield(self._reading)  # (the first read: nothing to go on before it)
        return Limits.of((self._rows or {}).get(tenant), self.settings, tenant)

    async def _read(self) -> None:
        started = time.monotonic()
        try:
            rows = await anyio.to_thread.run_sync(self._load)
            with self._lock:
                for name, (when, row) in self._put.items():
                    if when >= started:  # (written after the read began: it may hold the old row)
                        rows[name] = row
                self._put.clear()
                self._rows = rows
        except Exception as error:  # (the server's limits meanwhile; the job writer says if the DB is away)
            log.warning("could not read the tenants' limits: %s", error)
        finally:
            self._read_at = time.monotonic()  # (also after a failure: the next try in CACHE_SECONDS)
            self._reading = None

    def _load(self) -> dict[str, Tenant]:
        with Session(self.engine, expire_on_commit=False) as session:
            return load(session)

    def put(self, row: Tenant) -> None:
        """A tenant's limits, just written by this process (from a route's thread)."""
        with self._lock:
            self._put[row.name] = (time.monotonic(), row)
            self._rows = {**(self._rows or {}), row.name: row}
